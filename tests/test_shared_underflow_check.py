"""Issue 34's cost: GradientVarianceQuantiles and PreconditionedNoiseScale check the same sums once.

Both read :class:`~cockpit_gradnoise.extensions.SumsOfContributions`' savefield and check it
for squares that underflow lost with the same floor; beside each other the second takes the
first's count (:mod:`cockpit_gradnoise.quantities._shared_checks`). The count must be the one
each would find alone: the same parameters left out and named, in either order, on both
device paths; and never a count of other numbers (sums not views of the savefield, or
written in place after the first check).
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, functional
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD
from cockpit_gradnoise.quantities import _shared_checks, gradient_variance, preconditioned_noise_scale

import pytest
import torch
from torch import nn

from tests.test_underflowing_squares import tracked_with_optimizer

GONE = ("fc.weight", "fc.bias", "out.weight")  # the float64 unit's squares underflow there
BOTH = ("GradientVarianceQuantiles", "PreconditionedNoiseScale")


def counted(monkeypatch):
    """A list that grows by one at each call of ``functional.unresolved_sums`` by the helper, and
    by one per parameter of each call of ``functional.unresolved_sums_of_segments`` (on other
    devices GradientVarianceQuantiles checks a group of parameters together, and keeps each
    count for the other quantity as the helper would)."""
    calls = []
    original, of_segments = functional.unresolved_sums, functional.unresolved_sums_of_segments

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    def counting_segments(squares, total, lengths, *args):
        calls.extend([None] * len(lengths))
        return of_segments(squares, total, lengths, *args)

    monkeypatch.setattr(functional, "unresolved_sums", counting)
    monkeypatch.setattr(functional, "unresolved_sums_of_segments", counting_segments)
    return calls


def tracked(quantities, dtype=torch.float64):
    """One step of ``quantities`` on the model whose unit saturates, with Adam."""
    return tracked_with_optimizer(quantities, torch.optim.Adam, dtype)


@pytest.mark.parametrize("order", [BOTH, BOTH[::-1]], ids=["variance-first", "preconditioned-first"])
def test_both_leave_out_what_each_leaves_out_alone_on_the_host(order, monkeypatch):
    """One check per parameter for the two (before: two), and each quantity's rows those it
    has alone: the unit's parameters left out of both, named in the call's warning (one for
    the names, as before: ``Step.warn_names``)."""
    calls = counted(monkeypatch)
    together, told, names = tracked(order)
    assert len(calls) == len(names)
    for quantity in order:
        alone, _, _ = tracked((quantity,))
        assert together[quantity] == alone[quantity], quantity
        assert set(GONE).isdisjoint(together[quantity]) and set(names) - set(GONE) <= set(together[quantity])
    said = [text for text in told if "underflow" in text]
    assert len(said) == 1 and all(repr(name) in said[0] for name in GONE), told


def test_on_other_devices_both_are_nan_where_each_is_alone(monkeypatch):
    """The device's path (the count a 0-dim tensor read with the step's one transfer), one
    tensor for the two: the unit's rows and the network's NaN in both, named."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    calls = counted(monkeypatch)
    together, told, names = tracked(BOTH)
    assert len(calls) == len(names)
    for quantity in BOTH:
        alone, _, _ = tracked((quantity,))
        for name in GONE + (cgn.NETWORK,):
            assert all(math.isnan(value) for value in together[quantity][name].values()), (quantity, name)
        kept = set(together[quantity]) - set(GONE) - {cgn.NETWORK}
        assert kept and all(together[quantity][name] == alone[quantity][name] for name in kept)
    assert any(all(repr(name) in text for name in GONE) for text in told if "underflow" in text), told


def test_on_other_devices_float32_sums_kept_in_float64_are_checked_once(monkeypatch):
    """float32 parameters, whose sums the extensions keep in float64 there: each quantity reads
    ``T`` converted to float32 (a copy, not a view), and the check is still made once per
    parameter (keyed by the row it is converted from); each quantity's rows as alone, NaN
    where they are (the unit's, and the network's)."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    kept = []
    original = _shared_checks.unresolved_sums_once

    def noting(checks, param, squares, total, *args):
        kept.append((squares.dtype, total.dtype))
        return original(checks, param, squares, total, *args)

    for module in (gradient_variance, preconditioned_noise_scale):
        monkeypatch.setattr(module, "unresolved_sums_once", noting)
    calls = counted(monkeypatch)
    together, _, names = tracked(BOTH, torch.float32)
    assert (torch.float64, torch.float32) in kept  # the case: T converted, not a view
    assert len(calls) == len(names)
    for quantity in BOTH:
        alone, _, _ = tracked((quantity,), torch.float32)
        assert together[quantity].keys() == alone[quantity].keys()
        for name, row in together[quantity].items():
            assert row == pytest.approx(alone[quantity][name], rel=0, abs=0, nan_ok=True), (quantity, name)


def test_a_count_is_shared_only_for_the_same_numbers():
    """Shared between views of the savefield (one computation); computed again after a
    write in place into it (its version), and each time for sums that are not its views."""
    param = nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    field = torch.zeros(2, 3, 4, dtype=torch.float64)
    field[1, 0, 0] = 1e-320  # an unresolved S_j
    setattr(param, SUMS_SAVEFIELD, field)
    checks = {}
    try:
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], field[0], 3) == 1
        assert _shared_checks.unresolved_sums_once(checks, param, field.detach()[1], field[0], 3) == 1
        assert len(checks) == 1
        field[1, 0, 1] = 1e-320  # a second one, written in place
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], field[0], 3) == 2
        divided = field[1] * 4.0  # not a view: checked itself (no key from an address)
        assert _shared_checks.unresolved_sums_once(checks, param, divided, field[0] * 2.0, 3, 2.0) == 2
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], field[0], 4) == 2  # another N
        assert len(checks) == 3
        converted = field[0].to(torch.float32)  # a copy: keyed by the row it comes from, and its dtype
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], converted, 3, 1.0, field[0]) == 2
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], converted.clone(), 3, 1.0, field[0]) == 2
        assert len(checks) == 4
        assert _shared_checks.unresolved_sums_once(checks, param, field[1], converted, 3) == 2  # no row: its own
        assert len(checks) == 4
    finally:
        delattr(param, SUMS_SAVEFIELD)
