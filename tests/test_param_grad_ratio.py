"""ParamGradRatio against brute force, and its edge cases."""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional, references
from cockpit_gradnoise.logs import schema

import numpy
import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, build, case_named, run_step
from tests.helpers import assert_statistics_match, rows


def test_matches_reference(model_case, reduction, batch_size, recwarn):
    problem = build(model_case, batch_size, reduction)
    cockpit = run_step(problem, [cgn.ParamGradRatio(linear(1), param_names=problem.names)])
    torch.set_rng_state(problem.random_state)  # the same dropout masks
    expected = references.param_grad_ratio(
        problem.model, problem.loss_fn, problem.inputs, problem.targets
    )
    assert_statistics_match(rows(cockpit, "ParamGradRatio"), expected)


def test_all_zero_gradient_gives_inf_norm_ratio_and_no_ratio_statistics():
    problem = build(MODELS[0], 7, "mean")
    with torch.no_grad():
        # Every ReLU off: only the last bias gets a gradient.
        problem.model[0].bias.fill_(-100.0)
    cockpit = run_step(problem, [cgn.ParamGradRatio(linear(1), param_names=problem.names)])
    got = rows(cockpit, "ParamGradRatio")
    for name in ("0.weight", "0.bias", "2.weight"):
        assert got[name] == {"zero_grad_fraction": 1.0, "norm_ratio": math.inf}
    assert set(got["2.bias"]) == {"mean", "median", "min", "max", "zero_grad_fraction", "norm_ratio"}
    assert not any(math.isnan(v) for stats in got.values() for v in stats.values())
    assert got["all"]["zero_grad_fraction"] == (6 * 5 + 5 + 5 * 3) / (6 * 5 + 5 + 5 * 3 + 3)


def test_works_without_backpack_extension():
    """It reads only param.data and param.grad: a model that was never extended works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    names = [n for n, _ in model.named_parameters()]
    quantity = cgn.ParamGradRatio(linear(1), param_names=names)
    assert quantity.extensions(0) == []
    cockpit = cgn.Cockpit(model.parameters(), quantities=[quantity])
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    loss = nn.functional.cross_entropy(model(x), y)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    got = rows(cockpit, "ParamGradRatio")
    theta, grad = model[0].weight.detach(), model[0].weight.grad
    assert got["0.weight"]["max"] == pytest.approx((theta.abs() / grad.abs()).max().item(), rel=1e-6)
    assert set(got) == set(names) | {"all"}


def test_same_numbers_with_an_extended_model_in_a_cockpit_with_other_quantities():
    problem = build(MODELS[2], 7, "mean")
    alone = run_step(problem, [cgn.ParamGradRatio(linear(1), param_names=problem.names)])
    others = [
        cgn.ParamGradRatio(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
    ]
    together = run_step(problem, others)
    assert rows(alone, "ParamGradRatio") == rows(together, "ParamGradRatio")


@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e30])
def test_a_non_finite_or_huge_weight_is_left_out_or_kept_as_the_ratio_defines(bad):
    """The quantity skips the finiteness pass when both sums of squares are
    finite; an inf or NaN weight (or one whose square overflows) must still
    be left out (or kept) exactly as abs_ratio_statistics' own check does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    names = [n for n, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(model.parameters(), quantities=[cgn.ParamGradRatio(linear(1), param_names=names)])
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    loss = nn.functional.cross_entropy(model(x), y)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    with torch.no_grad():
        model[2].weight[0, 1] = bad  # after the backward pass: the gradient stays finite
    # A fresh instance: the cockpit's recorded step 0 and saw this .grad at it.
    fresh = cgn.ParamGradRatio(linear(1), param_names=names)
    got = fresh._compute(0, list(model.parameters()), loss)["2.weight"]
    theta, grad = model[2].weight.detach(), model[2].weight.grad
    expected = functional.abs_ratio_statistics(theta.clone(), grad.clone())
    assert {k: got[k] for k in expected} == expected
    if not math.isfinite(bad):
        assert len(expected) == 4 and math.isfinite(expected["max"])


def test_abs_ratio_statistics_leave_out_zero_and_non_finite_elements():
    inf, nan = math.inf, math.nan
    theta = torch.tensor([1.0, 2.0, inf, 3.0, 0.0, nan, 5.0, -4.0])
    grad = torch.tensor([1.0, 0.0, 1.0, -2.0, 4.0, 1.0, inf, 1.0])
    # kept: 1/1, 3/2, 0/4, 4/1 (the others have grad 0, or a non-finite value)
    ratios = numpy.array([1.0, 1.5, 0.0, 4.0])
    expected = {"mean": ratios.mean(), "median": 1.25, "min": 0.0, "max": 4.0}
    assert functional.abs_ratio_statistics(theta, grad) == pytest.approx(expected, rel=1e-15)
    odd = functional.abs_ratio_statistics(theta[:5], grad[:5])
    assert odd["median"] == 1.0
    assert functional.abs_ratio_statistics(torch.ones(3), torch.zeros(3)) == {}
    # All finite (no mask needed): zeros, including 0 / 0, are left out.
    zeros = functional.abs_ratio_statistics(torch.tensor([0.0, 1, 2, -3]), torch.tensor([0.0, 0, 1, 2]))
    assert zeros == {"mean": 1.75, "median": 1.75, "min": 1.5, "max": 2.0}
    # A ratio too large for float32 is kept, as inf.
    huge = functional.abs_ratio_statistics(torch.tensor([1e30, 1.0]), torch.tensor([1e-30, 1.0]))
    assert huge == {"mean": inf, "median": inf, "min": 1.0, "max": inf}


@pytest.mark.parametrize("n", [1, 2, 5, 6, 1001])
def test_abs_ratio_median_is_numpy_median(n):
    generator = torch.Generator().manual_seed(n)
    theta = torch.randn(n, dtype=torch.float64, generator=generator)
    grad = torch.randn(n, dtype=torch.float64, generator=generator)
    ratio = (theta.abs() / grad.abs()).numpy()
    assert functional.abs_ratio_statistics(theta, grad)["median"] == numpy.median(ratio)


RATIO_CASES = [(0.0, 0.0), (1.0, 0.0), (1.0, -2.0), (3.0, 2.0), (math.nan, 1.0), (1.0, math.nan),
               (math.nan, 0.0), (math.nan, -1.0), (math.nan, math.nan), (0.0, math.nan), (math.inf, 0.0),
               (-math.inf, -1.0), (math.inf, 2.0), (-math.inf, 2.0), (-3.0, 0.0)]


def test_ratio_or_inf_never_gives_nan_from_a_zero_denominator():
    assert schema.ratio_or_inf(0.0, 0.0) == math.inf
    assert schema.ratio_or_inf(1.0, 0.0) == math.inf
    assert schema.ratio_or_inf(1.0, -2.0) == math.inf
    assert schema.ratio_or_inf(3.0, 2.0) == 1.5
    assert math.isnan(schema.ratio_or_inf(math.nan, 1.0))
    assert math.isnan(schema.ratio_or_inf(1.0, math.nan))
    assert all(type(schema.ratio_or_inf(*case)) is float for case in RATIO_CASES)


def test_ratio_or_inf_of_tensors_is_the_rule_for_floats_elementwise():
    numerators, denominators = (torch.tensor(column, dtype=torch.float64) for column in zip(*RATIO_CASES))
    expected = torch.tensor([schema.ratio_or_inf(*case) for case in RATIO_CASES], dtype=torch.float64)
    torch.testing.assert_close(
        schema.ratio_or_inf(numerators, denominators), expected, rtol=0, atol=0, equal_nan=True
    )
    # One side a tensor, the other a float: a tensor.
    assert torch.equal(schema.ratio_or_inf(torch.tensor([3.0, 1.0]), 0.0), torch.tensor([math.inf] * 2))
    assert torch.equal(schema.ratio_or_inf(3.0, torch.tensor(2.0)), torch.tensor(1.5))


def test_squared_norm_is_accurate_as_documented(paths):
    """Within ``n 2**-53`` relative of the exact sum (``n + 1`` for float64,
    whose squares round), on any CPU: float64 accumulation by pieces, several
    of them here. The reference is the correctly rounded sum of the squares
    (``math.fsum``; exact squares for float32 and half)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1_000_000, dtype=torch.float64, generator=generator)
    n, u = x.numel(), 2.0**-53
    for values, terms in ((x, n + 2), (x.float(), n + 1), (x.half(), n + 1)):
        exact = math.fsum((values.double() ** 2).tolist())
        assert abs(functional.squared_norm(values) - exact) <= terms * u * exact
    huge = torch.full((3,), 2.0**100)  # squares beyond float32's range
    assert functional.squared_norm(huge) == 3 * 2.0**200


def test_squared_norms_of_many_tensors_are_accurate_as_documented(paths):
    """Each within ``(n + 4) 2**-53`` relative of the exact sum: ``n 2**-53`` for the
    float64 sum (``n + 1`` for float64 input), and on the CPU's one call for the small
    tensors, one rounding of the norm's square root and one of its square (each
    ``2**-53``, and ``2**-52`` for their product's first order). Small and large tensors
    (past a piece, by :func:`squared_norm`), float64, float32, half and bfloat16, and
    an empty one, in one call."""
    from cockpit_gradnoise import _device

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(_device.CHUNK + 5, dtype=torch.float64, generator=generator)
    tensors = [x[:70_000].float().reshape(700, 100), x[:3].float(), x[:1000], x[:5000].half(),
               x.float(), x[:4097].bfloat16(), torch.zeros(0)]
    got = functional.squared_norms(tensors)
    u = 2.0**-53
    for tensor, value in zip(tensors, got):
        assert isinstance(value, float)
        exact = math.fsum((tensor.double().reshape(-1) ** 2).tolist())
        assert abs(value - exact) <= (tensor.numel() + 4) * u * exact, (tensor.dtype, tensor.numel())


def test_gradients_proved_finite_by_their_norms_are_not_checked_again_and_others_are(monkeypatch):
    """ParamGradRatio's finite sums of squares spare the step's finiteness pass over each
    gradient; a gradient with an inf is still checked, and its row (and the network's) is NaN."""
    from cockpit_gradnoise.step import Step

    checked = []  # the gradients the step sums to check them (not known already)
    check = Step._finite_on_host

    def counted(self, tensor):
        known = self._finite.get(id(tensor))
        if known is None or known[0] is not tensor or known[1] != tensor._version:
            checked.append(tensor)
        return check(self, tensor)

    monkeypatch.setattr(Step, "_finite_on_host", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    names = [n for n, _ in model.named_parameters()]
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    nn.functional.cross_entropy(model(x), y).backward()
    params = list(model.parameters())
    got = cgn.ParamGradRatio(linear(1), param_names=names)._compute(10**6, params, None)  # a step of its own
    assert checked == [] and not any(math.isnan(v) for row in got.values() for v in row.values())
    model[2].weight.grad[0, 0] = math.inf
    with pytest.warns(UserWarning, match="NaN or Inf"):
        got = cgn.ParamGradRatio(linear(1), param_names=names)._compute(10**6 + 1, params, None)
    assert [t is model[2].weight.grad for t in checked] == [True]
    assert all(math.isnan(v) for name in ("2.weight", "all") for v in got[name].values())
    assert got["0.weight"]["max"] == pytest.approx((params[0].abs() / params[0].grad.abs()).max().item())


def test_unused_parameter_is_left_out_with_a_warning():
    problem = build(case_named("unused-frozen"), 7, "sum")
    quantity = cgn.ParamGradRatio(linear(1), param_names=problem.names)
    with pytest.warns(UserWarning, match="have no gradient"):
        cockpit = run_step(problem, [quantity])
    assert "unused.weight" not in rows(cockpit, "ParamGradRatio")


def test_small_parameters_ratios_formed_together_are_each_pair_s_own_bit_for_bit(monkeypatch):
    """:func:`functional.abs_ratio_statistics_of_small` (one table per size and dtype) gives each
    pair what :func:`functional.abs_ratio_statistics_and_zeros` gives it alone, bit for bit:
    sizes repeated and single, float32, float64 and bfloat16, zero gradients (one, many, all),
    zero weights, a huge ratio (inf), and non-finite elements where ``all_finite`` is not
    claimed (left out); a NaN ratio where it is claimed raises, as alone. The CPU's path,
    whatever the session forces (the only one that forms them together)."""
    from cockpit_gradnoise import _device

    monkeypatch.setattr(_device, "on_host", lambda tensor: tensor.device.type == "cpu")
    generator = torch.Generator().manual_seed(0)

    def pair(n, dtype=torch.float32, zeros=0, bad=None):
        theta = torch.randn(n, generator=generator).to(dtype)
        grad = (torch.randn(n, generator=generator) * torch.rand(n, generator=generator) ** 4).to(dtype)
        grad[:zeros] = 0.0
        theta[zeros : zeros + 1] = 0.0
        if bad is not None:
            theta[-1] = bad
        return theta, grad, bad is None

    pairs = [pair(48), pair(48, zeros=3), pair(48, zeros=48), pair(7, torch.float64, zeros=2),
             pair(48, torch.bfloat16, zeros=1), pair(4096, zeros=100), pair(1), pair(48, bad=math.nan),
             pair(48, torch.float64, bad=math.inf), pair(3, zeros=1)]
    theta, grad, _ = pairs[-1]
    theta[-1], grad[-1] = 1e30, 1e-30  # a ratio beyond float32: inf, kept
    got = functional.abs_ratio_statistics_of_small(pairs)
    expected = [functional.abs_ratio_statistics_and_zeros(a, b, all_finite=finite) for a, b, finite in pairs]
    assert got == expected
    assert got[2] == ({}, 48) and got[-1][0]["max"] == math.inf and got[7][1] == 0
    assert [type(zeros) for _, zeros in got] == [int] * len(pairs)
    theta, grad, _ = pair(48, bad=math.nan)
    for alone in (lambda: functional.abs_ratio_statistics_of_small([(theta, grad, True)]),
                  lambda: functional.abs_ratio_statistics_and_zeros(theta, grad, all_finite=True)):
        with pytest.raises(ValueError):
            alone()
