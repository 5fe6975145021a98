"""ParamGradRatio's and UpdateSize's float64 norms of all parameters in one fused call.

On other devices than the CPU (issue 32): ``functional.squared_norms(..., defer=True)`` and
UpdateSize's two norms per parameter by one float64 ``_foreach_norm`` per device, squared,
and the updates by one ``_foreach_sub_``, where each tensor took a float64 copy and a
``dot`` (two launches), and each update a ``sub_``. The squared norms are float64 sums of
the exact squares of the elements in another order, with a square root and a square more:
within ``(n + 2) 2**-53`` relative of ``math.fsum`` of the exact squares, as a ``dot`` is
within ``n 2**-53``.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, functional
from cockpit_gradnoise.quantities import update_size

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import ModelCase, build, run_step
from tests.test_values_of_many import launches_of

EPS64 = 2.0**-53


def _exact(tensor: torch.Tensor) -> float:
    return math.fsum(v * v for v in tensor.double().reshape(-1).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_squared_norms_of_other_devices_are_within_their_bound(dtype, monkeypatch):
    """Each within ``(n + 2) 2**-53`` of the exact sum of squares, left on the device (0-dim
    float64 tensors), an empty tensor's 0, a NaN's NaN and nothing else's."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    generator = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(shape, generator=generator) * scale).to(dtype)
               for shape, scale in [((7, 5), 1.0), ((300,), 1e-20), ((0,), 1.0), ((4, 3, 2), 1e15), ((9,), 1.0)]]
    tensors[4][2] = math.nan
    found = functional.squared_norms(tensors, defer=True)
    for tensor, squared in zip(tensors, found):
        assert isinstance(squared, torch.Tensor) and squared.dim() == 0 and squared.dtype == torch.float64
        exact = _exact(tensor)
        if math.isnan(exact):
            assert math.isnan(squared.item())
        else:
            assert squared.item() == pytest.approx(exact, rel=(tensor.numel() + 2) * EPS64, abs=0)


def _updates(together: bool, monkeypatch):
    """UpdateSize's output at its second step of an MLP trained by SGD, on the paths of other devices."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    if not together:
        monkeypatch.setattr(update_size, "_squares_together", lambda cache, params: None)
    case = ModelCase("mlp", lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
                     lambda n: torch.randn(n, 6))
    problem = build(case, 4, "mean", dtype=torch.float32)
    quantity = cgn.UpdateSize(linear(1), param_names=problem.names)
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    cockpit = None
    for step in range(2):
        cockpit = run_step(problem, [quantity], step=step, cockpit=cockpit)
        optimizer.step()
    monkeypatch.undo()
    return quantity.output, [p.detach().clone() for p in problem.params]


def test_updates_together_are_within_the_bound_of_one_at_a_time(monkeypatch):
    """The same parameters and updates (the cache overwritten by them alike); each norm within
    twice the bound of one way of the other's (both ways round, ``n + 2`` and ``n``)."""
    together, params = _updates(True, monkeypatch)
    alone, params_alone = _updates(False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(params, params_alone))
    assert together.keys() == alone.keys() and together
    for step, updates in together.items():
        assert [u.name for u in updates] == [u.name for u in alone[step]]
        for update, other, param in zip(updates, alone[step], params):
            bound = 2 * (param.numel() + 3) * EPS64
            assert update.norm > 0 and update.norm == pytest.approx(other.norm, rel=bound, abs=0)
            assert update.start_norm == pytest.approx(other.start_norm, rel=bound, abs=0)


def test_the_norms_take_a_few_launches_for_all_parameters(monkeypatch):
    """Five launches a parameter before (two float64 copies, two dots, a ``sub_``); a few for
    all now (20 parameters more: the same launches)."""
    def launches(layers):  # UpdateSize's end, at its second step
        return launches_of(cgn.UpdateSize, layers, monkeypatch, method="end", steps=2)

    grown = launches(12) - launches(2)
    monkeypatch.setattr(update_size, "_squares_together", lambda cache, params: None)
    grown_alone = launches(12) - launches(2)
    assert grown == 0 and grown_alone >= 20 * 5, (grown, grown_alone)
