"""GradientNoiseScale: against brute force, unbiased exactly, right across batches."""

import itertools
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional, references
from cockpit_gradnoise.extensions import PerExampleSquaredNorms
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities.gradient_noise_scale import DEFAULT_SMOOTHING

import numpy
import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, ModelCase, Problem, build, reference_gradients, run_step
from tests.helpers import rounding_bounds, rows, without_coverage

RTOL = 1e-10


def test_matches_reference(model_case, reduction, batch_size, recwarn):
    problem = build(model_case, batch_size, reduction)
    cockpit = run_step(problem, [cgn.GradientNoiseScale(linear(1), param_names=problem.names)])
    got = without_coverage(rows(cockpit, "GradientNoiseScale"))
    expected = references.gradient_noise_scale(
        None, None, problem.inputs, None, gradients=reference_gradients(model_case, problem)
    )
    assert set(got) == set(expected)
    numel = dict((n, p.numel()) for n, p in zip(problem.names, problem.params))
    numel["all"] = sum(numel[name] for name in expected if name != "all")
    for name, stats in expected.items():
        assert set(got[name]) == {
            "grad_sq", "trace_cov", "b_simple", "b_simple_smoothed", "batch_size"
        }
        assert got[name]["batch_size"] == batch_size
        grad_sq, trace_cov = stats["grad_sq"], stats["trace_cov"]
        atol_g, atol_t = rounding_bounds(batch_size, numel[name], grad_sq, trace_cov)
        assert got[name]["grad_sq"] == pytest.approx(grad_sq, rel=RTOL, abs=atol_g)
        assert got[name]["trace_cov"] == pytest.approx(trace_cov, rel=RTOL, abs=atol_t)
        if grad_sq > atol_g:
            rtol = atol_g / grad_sq + (atol_t / trace_cov if trace_cov > 0 else 0)
            assert got[name]["b_simple"] == pytest.approx(
                stats["b_simple"], rel=max(RTOL, rtol), abs=0
            )
        elif grad_sq < -atol_g or grad_sq == trace_cov == 0:
            assert got[name]["b_simple"] == math.inf
        # First tracked step: the moving averages are the values themselves.
        assert got[name]["b_simple_smoothed"] == got[name]["b_simple"]


TINY = ModelCase(
    "tiny-mlp",
    lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
    lambda n: torch.randn(n, 3),
)


def tiny_problem(inputs, targets, reduction="mean"):
    """A 2-class MLP with 26 parameters on the given data (float64)."""
    problem = build(TINY, len(inputs), reduction)
    problem.inputs, problem.targets = inputs, targets
    return problem


def dataset_truth(problem, inputs, targets):
    """``|G|^2`` and ``tr(Sigma)`` of the dataset's per-example gradients, per name and "all"."""
    grads = references.per_example_gradients(
        problem.model, problem.per_example_loss, inputs, targets
    )
    flat = {name: g.reshape(len(inputs), -1).detach().numpy() for name, g in grads.items()}
    flat["all"] = numpy.concatenate(list(flat.values()), axis=1)
    truth = {}
    for name, g in flat.items():
        mean = g.mean(0)
        truth[name] = (float(mean @ mean), float(((g - mean) ** 2).sum(1).mean()), g)
    return truth


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_unbiased_exactly_over_every_batch_drawn_with_replacement(reduction):
    """Every ordered batch of 3 from 4 examples is equally likely; the mean of the
    estimates over all 64 is their expectation, which must be |G|^2 and tr(Sigma)."""
    torch.manual_seed(1)
    inputs = torch.randn(4, 3, dtype=torch.float64)
    targets = torch.tensor([0, 0, 1, 0])
    problem = tiny_problem(inputs, targets, reduction)
    quantity = cgn.GradientNoiseScale(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    batches = list(itertools.product(range(4), repeat=3))
    for step, batch in enumerate(batches):
        problem.inputs, problem.targets = inputs[list(batch)], targets[list(batch)]
        run_step(problem, None, step, cockpit)
    frame = cgn.to_frame(cockpit)
    truth = dataset_truth(problem, inputs, targets)
    for name, (grad_sq, trace_cov, _) in truth.items():
        mine = frame[(frame.quantity == "GradientNoiseScale") & (frame.param == name)]
        estimates = mine.groupby("statistic").value.mean()
        assert mine.step.nunique() == len(batches) == 64
        assert estimates["grad_sq"] == pytest.approx(grad_sq, rel=RTOL, abs=0)
        assert estimates["trace_cov"] == pytest.approx(trace_cov, rel=RTOL, abs=0)
        # The test can fail: the plug-in M = ||mean g||^2 is off by tr(Sigma) / N.
        biased = estimates["grad_sq"] + estimates["trace_cov"] / 3
        assert abs(biased - grad_sq) > 1e-4 * grad_sq


def u_statistic_variance(kernel, n):
    """Variance of the U-statistic of a symmetric ``kernel`` matrix over N i.i.d. draws.

    ``kernel[a, b] = k(x_a, x_b)`` over the dataset (draws are uniform with
    replacement): ``Var U = (4 (N - 2) zeta_1 + 2 zeta_2) / (N (N - 1))`` with
    ``zeta_1 = Var_a(mean_b k(x_a, x_b))`` and ``zeta_2 = Var_ab k(x_a, x_b)``
    (Hoeffding 1948).
    """
    zeta_1, zeta_2 = kernel.mean(1).var(), kernel.var()
    return (4 * (n - 2) * zeta_1 + 2 * zeta_2) / (n * (n - 1))


def test_b_simple_from_one_large_batch_matches_the_dataset_value():
    """``grad_sq`` (kernel ``g_a . g_b``) and ``trace_cov`` (kernel
    ``||g_a - g_b||^2 / 2``) are U-statistics of the batch; to first order
    ``B_hat - B = (T_hat - T) / G2 - B (G2_hat - G2) / G2``, so 4 standard
    deviations of each term bound the error (each exceeded with probability
    below 1e-4 for a normal error). Batches of 4096 drawn with replacement
    from 512 examples, fixed seeds."""
    dataset_size, n = 512, 4096
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(dataset_size, 3, dtype=torch.float64, generator=generator)
    noise = 0.5 * torch.randn(dataset_size, dtype=torch.float64, generator=generator)
    targets = (inputs[:, 0] + noise > 0).long()
    problem = tiny_problem(inputs, targets)
    _, _, g = dataset_truth(problem, inputs, targets)["all"]
    mean = g.mean(0)
    grad_sq, trace_cov = float(mean @ mean), float(((g - mean) ** 2).sum(1).mean())
    b_true = trace_cov / grad_sq
    gram = g @ g.T
    squared = numpy.diag(gram)
    half_distance = (squared[:, None] + squared[None, :] - 2 * gram) / 2
    sd_grad_sq = math.sqrt(u_statistic_variance(gram, n))
    sd_trace_cov = math.sqrt(u_statistic_variance(half_distance, n))
    tolerance = 4 * (sd_trace_cov + b_true * sd_grad_sq) / grad_sq
    assert sd_grad_sq / grad_sq < 0.1, "first order suffices"
    assert tolerance < 0.25 * b_true, "an error of 25% would fail"
    quantity = cgn.GradientNoiseScale(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    for seed in range(3):
        batch = torch.randint(dataset_size, (n,), generator=torch.Generator().manual_seed(seed))
        problem.inputs, problem.targets = inputs[batch], targets[batch]
        run_step(problem, None, seed, cockpit)
        b_simple = rows(cockpit, "GradientNoiseScale", seed)["all"]["b_simple"]
        assert abs(b_simple - b_true) < tolerance, (seed, b_simple, b_true, tolerance)


def test_smoothed_is_ratio_of_moving_averages_skipping_non_finite_steps():
    torch.manual_seed(2)
    inputs = torch.randn(80, 3, dtype=torch.float64)
    targets = (inputs[:, 0] > 0).long()
    problem = tiny_problem(inputs, targets)
    smoothing = 0.7
    quantity = cgn.GradientNoiseScale(
        linear(1), smoothing=smoothing, param_names=problem.names
    )
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    for step in range(5):
        batch = slice(16 * step, 16 * step + 16)
        problem.inputs, problem.targets = inputs[batch].clone(), targets[batch]
        if step == 2:
            problem.inputs[0, 0] = math.nan
        with pytest.warns(UserWarning, match="NaN") if step == 2 else _nothing():
            run_step(problem, None, step, cockpit)
    for name in problem.names + ["all"]:
        averages, expected = None, {}
        for step in range(5):
            stats = rows(cockpit, "GradientNoiseScale", step)[name]
            if step == 2:
                assert all(math.isnan(v) for v in stats.values())
                continue
            values = (stats["trace_cov"], stats["grad_sq"])
            averages = values if averages is None else tuple(
                smoothing * old + (1 - smoothing) * new for old, new in zip(averages, values)
            )
            expected[step] = schema.ratio_or_inf(*averages)
            assert stats["b_simple_smoothed"] == pytest.approx(expected[step], rel=1e-15)
        assert math.isfinite(expected[4]) and expected[4] != pytest.approx(expected[3])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_negative_grad_sq_is_reported_and_b_simple_is_inf():
    """Two examples with the same input and different classes at a zero-initialized
    linear model: ``g_1 . g_2 = (p - e_0) . (p - e_1) (||x||^2 + 1) < 0``."""
    model = extend(nn.Linear(3, 3).double())
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    inputs = torch.ones(2, 3, dtype=torch.float64)
    problem = Problem(
        model, extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none"),
        inputs, torch.tensor([0, 1]), "mean",
    )
    cockpit = run_step(problem, [cgn.GradientNoiseScale(linear(1), param_names=["w", "b"])])
    got = rows(cockpit, "GradientNoiseScale")
    # p = (1/3, 1/3, 1/3): (p - e_0) . (p - e_1) = 1/3 - 2/3 = -1/3; weight: times ||x||^2 = 3
    assert got["w"]["grad_sq"] == pytest.approx(-1.0, rel=1e-14)
    assert got["b"]["grad_sq"] == pytest.approx(-1 / 3, rel=1e-14)
    for stats in got.values():
        assert stats["b_simple"] == stats["b_simple_smoothed"] == math.inf


def test_batch_size_1_records_nothing_and_warns_once():
    problem = build(MODELS[0], 1, "mean")
    quantity = cgn.GradientNoiseScale(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    with pytest.warns(UserWarning, match="batch size 1") as records:
        for step in range(3):
            run_step(problem, None, step, cockpit)
    assert len([r for r in records if "batch size 1" in str(r.message)]) == 1
    assert len(cgn.to_frame(cockpit)) == 0


def test_shares_the_per_example_norms_with_per_example_grad_norm():
    """One BackPACK extension computes both; the numbers do not change."""
    problem = build(MODELS[2], 7, "sum")
    alone = run_step(problem, [cgn.GradientNoiseScale(linear(1), param_names=problem.names)])
    both = [
        cgn.GradientNoiseScale(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
    ]
    together = run_step(problem, both)
    extensions = together._get_extensions(0)
    assert [type(e) for e in extensions] == [PerExampleSquaredNorms]
    assert rows(alone, "GradientNoiseScale") == rows(together, "GradientNoiseScale")


def test_smoothing_must_be_a_weight_of_the_past():
    assert 0 <= DEFAULT_SMOOTHING < 1
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(ValueError, match="smoothing must lie in"):
            cgn.GradientNoiseScale(linear(1), smoothing=bad)


def test_noise_scale_estimates_formulas():
    # g_1 = (1, 0), g_2 = (0, 1): S = 1, M = 1/2; pairs i != j give g_1 . g_2 = 0.
    grad_sq, trace_cov = functional.noise_scale_estimates(1.0, 0.5, 2)
    assert (grad_sq, trace_cov) == (0.0, 1.0)
    with pytest.raises(ValueError, match="at least 2 examples"):
        functional.noise_scale_estimates(1.0, 1.0, 1)
    assert functional.exponential_moving_average(None, 3.0, 0.9) == 3.0
    assert functional.exponential_moving_average(1.0, 3.0, 0.75) == 1.5
