"""GradientNoiseScale's and PerExampleGradNorm's values of a step's parameters formed together.

On other devices than the CPU (``values_of_many``, issue 32): a few launches for all
parameters, not about a dozen each. PerExampleGradNorm's quotients are the same numbers
bit for bit; GradientNoiseScale's ``S`` and ``M`` are float64 sums in another order,
within their derived bounds of a float64 brute force (``math.fsum`` of the exact squares).
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device
from cockpit_gradnoise.step import Batch

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.benchmark_op_count import _NO_KERNEL
from tests.cases import ModelCase, build, run_step

EPS64 = 2.0**-53  # the unit roundoff of float64


def _parameters(examples, generator):
    """Parameters with gradients and per-example squared norms as the backward pass leaves
    them: float32, float64 and bfloat16 (its norms float32), one a structural zero (norms
    exactly 0, the gradient rounding noise), one whose norms hold a NaN."""
    found = []
    for shape, dtype in [((7, 5), torch.float32), ((5,), torch.float32), ((3, 4), torch.float64),
                         ((6,), torch.float32), ((9,), torch.float32), ((4, 3), torch.bfloat16)]:
        param = nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        param.grad = (torch.randn(shape, generator=generator) * 3).to(dtype)
        param.cgn_batch_l2 = torch.rand(examples, generator=generator).to(torch.promote_types(dtype, torch.float32))
        found.append(param)
    found[3].cgn_batch_l2 = torch.zeros(examples)  # a structural zero
    found[3].grad = found[3].grad * 1e-9  # its gradient: rounding noise, not 0
    found[4].cgn_batch_l2[1] = math.nan
    return [(f"p{i}", param) for i, param in enumerate(found)]


@pytest.mark.parametrize("scale", [1.0, 1 / 3, 0.125])
def test_noise_scale_sums_together_are_within_their_bounds_of_brute_force(scale, monkeypatch):
    """``S = sum_i ||x_i||^2 / c^2 / N`` within ``(N + 1) eps64`` relative (a sum of ``N``
    terms of one sign, two divisions), ``M = ||g / c||^2 / N^2`` within ``(n + 3) eps64``
    (:func:`~cockpit_gradnoise.functional.divided_squared_norms`, one division) of
    ``math.fsum`` of the exact squares of the same float32 quotients ``g / c``; 0 for the
    structural zero; NaN ``S`` where a norm is NaN, with ``M`` kept."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    examples = 6
    items = _parameters(examples, torch.Generator().manual_seed(1))
    quantity = cgn.GradientNoiseScale(linear(1))
    deferred = []
    values = quantity.values_of_many(items, Batch(examples, scale), deferred)
    assert [name for name, _, _ in deferred] == [name for name, _ in items]
    for name, param in items:
        s, m, n = values[name]
        assert n == examples and s.dtype == m.dtype == torch.float64
        norms = param.cgn_batch_l2.double().tolist()
        exact_s = math.fsum(norms) / scale**2 / examples
        grad = param.grad.to(torch.promote_types(param.dtype, torch.float32))  # widened, as the sums are
        quotients = (grad / scale if scale != 1.0 else grad).double().reshape(-1).tolist()
        exact_m = math.fsum(q * q for q in quotients) / examples**2
        if name == "p3":
            assert s.item() == 0.0 and m.item() == 0.0 and exact_m > 0
            continue
        if name == "p4":
            assert math.isnan(s.item())
        else:
            assert s.item() == pytest.approx(exact_s, rel=(examples + 1) * EPS64, abs=0)
        assert m.item() == pytest.approx(exact_m, rel=(param.numel() + 3) * EPS64, abs=0)


def test_per_example_norms_together_are_the_quotients_of_one_at_a_time(monkeypatch):
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    examples, batch = 6, Batch(6, 1 / 3)
    items = _parameters(examples, torch.Generator().manual_seed(2))
    quantity = cgn.PerExampleGradNorm(linear(1))
    deferred = []
    values = quantity.values_of_many(items, batch, deferred)
    for (name, param), (deferred_name, _, sums) in zip(items, deferred):
        one = quantity.parameter_sums(param, batch)["squared_norms"]
        assert deferred_name == name and sums["squared_norms"] is values[name]
        assert torch.equal(values[name], one) or name == "p4" and torch.equal(values[name].isnan(), one.isnan())
        assert values[name].dtype == one.dtype


def test_values_are_formed_one_at_a_time_on_the_cpu():
    items = _parameters(4, torch.Generator().manual_seed(3))
    for quantity in (cgn.GradientNoiseScale(linear(1)), cgn.PerExampleGradNorm(linear(1))):
        assert quantity.values_of_many(items, Batch(4, 0.25), []) is None


class _Launches(TorchDispatchMode):
    """Counts the ops dispatched inside it that launch a kernel on a GPU (not views)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not (func.is_view or func.overloadpacket.__name__ in _NO_KERNEL)
        return func(*args, **(kwargs or {}))


def launches_of(quantity_class, layers, monkeypatch, method="_compute", steps=1) -> int:
    """Launching ops inside ``method`` of one ``quantity_class`` over ``steps`` tracked steps of an
    MLP of ``layers`` linear layers (batch 8, float32), on the paths of other devices."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    case = ModelCase("deep-mlp", lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]),
                     lambda n: torch.randn(n, 4))
    problem = build(case, 8, "mean", dtype=torch.float32)
    quantity = quantity_class(linear(1), param_names=problem.names)
    counter, original = _Launches(), getattr(quantity, method)

    def counted(*args, **kwargs):
        with counter:
            return original(*args, **kwargs)

    setattr(quantity, method, counted)
    cockpit = None
    for step in range(steps):
        cockpit = run_step(problem, [quantity], step=step, cockpit=cockpit)
    return counter.count


def _launches_after_backward(layers, monkeypatch):
    """Launching ops of both quantities' computation after the backward pass, on an MLP of
    ``layers`` linear layers (``2 * layers`` parameters), on the paths of other devices."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    case = ModelCase("deep-mlp", lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]),
                     lambda n: torch.randn(n, 4))
    problem = build(case, 8, "mean", dtype=torch.float32)
    quantities = [cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
                  cgn.GradientNoiseScale(linear(1), param_names=problem.names)]
    counter = _Launches()
    for quantity in quantities:
        def counted(*args, _compute=quantity._compute, **kwargs):
            with counter:
                return _compute(*args, **kwargs)
        quantity._compute = counted
    run_step(problem, quantities)
    return counter.count


def test_launches_after_the_backward_pass_do_not_grow_with_the_parameters(monkeypatch):
    """Issue 32: on a GPU each op is a launch of 10-40 us; one at a time, the two took
    about 11 per parameter after the backward pass."""
    assert _launches_after_backward(6, monkeypatch) == _launches_after_backward(2, monkeypatch)


@pytest.mark.parametrize("quantity_class", [cgn.GradientNoiseScale, cgn.PerExampleGradNorm,
                                            cgn.GradientVarianceQuantiles])
def test_a_subclass_with_values_of_its_own_forms_them_one_at_a_time(quantity_class, monkeypatch):
    """``values_of_many`` forms the values as the class's ``value_from_sums`` would: a subclass
    that forms them its own way is not bypassed (``forms_values_together``), on any path."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    items = _parameters(4, torch.Generator().manual_seed(5))

    class OwnValues(quantity_class):
        def value_from_sums(self, sums, batch):
            return super().value_from_sums(sums, batch)

    assert quantity_class(linear(1)).forms_values_together(quantity_class, items)
    assert not OwnValues(linear(1)).forms_values_together(quantity_class, items)
    assert not quantity_class(linear(1)).forms_values_together(quantity_class, [])
    assert OwnValues(linear(1)).values_of_many(items, Batch(4, 1.0), []) is None
