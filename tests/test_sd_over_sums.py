"""sd and SNR formed over each layer's own sums (``functional.sd_and_signal_to_noise`` with
``over_sums``): only where nothing reads the sums afterwards.

GradientVarianceQuantiles takes that route for networks of ``OVER_SUMS_AT_LEAST`` elements
or more (VGG-11's 129M); here the threshold is 0, and every layer is formed over its own
sums (none joined with the small ones into a copy), so that small float64 models take it,
and each test fails if the route is taken where it must not be: another quantity reading
the sums (before or after), the torch.func fallback's local gradient (a view of the sums'
row 0), micro-batches of an accumulated step.
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional, references
from cockpit_gradnoise.extensions import LOCAL_GRADIENT_SAVEFIELD, SUMS_SAVEFIELD
from cockpit_gradnoise.functional import fused
from cockpit_gradnoise.quantities import gradient_variance
from cockpit_gradnoise.tracking import Tracker

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import build, case_named, reference_gradients, run_step
from tests.helpers import assert_statistics_match, rows, sd_rtol, snr_atol
from tests.test_accumulation import accumulate, assert_steps_match, quantities, stored
from tests.test_base import SumsReader

QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


@pytest.fixture
def routes(monkeypatch):
    """Every network over its sums where allowed; the routes taken, one per formation:
    ``"over sums"``, ``"union"`` (the arena's one buffer) or ``"buffers"``."""
    monkeypatch.setattr(gradient_variance, "OVER_SUMS_AT_LEAST", 0)
    monkeypatch.setattr(fused, "_JOINED_BELOW", 1)
    taken, formed = [], functional.sd_and_signal_to_noise

    def spy(sums, n, limit, union=None, *, over_sums=False):
        result = formed(sums, n, limit, union, over_sums=over_sums)
        taken.append("union" if union is not None else "over sums" if result[0] is None else "buffers")
        return result

    monkeypatch.setattr(functional, "sd_and_signal_to_noise", spy)
    return taken


def check_against_reference(cockpit, problem, case, step, reduction="sum"):
    """GradientVarianceQuantiles' rows of ``step`` against the float64 per-example reference."""
    grads = reference_gradients(case, problem)
    expected = references.gradient_variance_quantiles(
        problem.model, None, problem.inputs, problem.targets, reduction=reduction,
        quantiles=QUANTILES, gradients=grads,
    )
    n = len(problem.inputs)
    sd = {name: sd_rtol(grads, n, name, case.inner_terms) for name in expected}
    snr = {name: snr_atol(grads, n, name, case.inner_terms) for name in expected}
    assert_statistics_match(
        rows(cockpit, "GradientVarianceQuantiles", step), expected, rtol_of=lambda name, _: sd[name],
        atol_of=lambda name, statistic: snr[name] if statistic.startswith("snr") else 0.0,
    )


def assert_same_rows(got, expected):
    """The same statistics, to rounding (two routes: the same operations, other memory)."""
    assert set(got) == set(expected)
    for name, row in expected.items():
        assert got[name] == pytest.approx(row, rel=1e-12, abs=0), name


def gvq(problem):
    return cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=problem.names)


@pytest.mark.parametrize("name, expected", [("cnn", ["over sums"] * 3),
                                            ("mlp", ["over sums", "union", "union"])])
def test_over_each_layers_sums_two_steps_in_a_row_match_the_reference(routes, name, expected):
    """Three tracked steps in a row, each against the reference (the MLP's sums lie in the
    arena's one buffer from the second on: formed over that union); the savefields formed
    over are taken off their parameters at once."""
    case = case_named(name)
    problem = build(case, 5, "sum")
    left = []

    class After(cgn.ParamGradRatio):  # reads param.grad only: not a reader of the sums
        def step_context(self, step, params):
            left.append(sum(hasattr(p, SUMS_SAVEFIELD) for p in params))
            return super().step_context(step, params)

    cockpit = cgn.Cockpit(problem.params, quantities=[gvq(problem), After(linear(1), param_names=problem.names)])
    for step in range(3):
        run_step(problem, [], step=step, cockpit=cockpit)
        check_against_reference(cockpit, problem, case, step)
    assert routes == expected
    assert left == [0, 0, 0]


@pytest.mark.parametrize("reader_first", [True, False])
def test_a_second_reader_of_the_sums_sees_them_unaltered_in_either_order(routes, reader_first):
    """A quantity of the user's reading the same savefield: the sums are formed into buffers,
    and its totals are the per-example gradients'; alone, the same rows over the sums."""
    problem = build(case_named("cnn"), 5, "sum")
    expected = {name: grads.pow(2).sum().item() for name, grads in references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets).items()}
    both = [SumsReader(linear(1), param_names=problem.names), gvq(problem)]
    cockpit = run_step(problem, both if reader_first else both[::-1])
    got = rows(cockpit, "SumsReader")
    for name, total in expected.items():
        assert got[name]["total"] == pytest.approx(total, rel=1e-12)
    assert routes == ["buffers"]
    alone = run_step(build(case_named("cnn"), 5, "sum"), [gvq(problem)])
    assert routes == ["buffers", "over sums"]
    assert_same_rows(rows(cockpit, "GradientVarianceQuantiles"), rows(alone, "GradientVarianceQuantiles"))


class Scale(nn.Module):
    """``x * gamma``: no rule, so the torch.func fallback computes its sums, and its local
    gradient as a view of their row 0."""

    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(width, dtype=torch.float64))

    def forward(self, x):
        return x * self.gamma


@pytest.mark.filterwarnings("ignore:cockpit-gradnoise. param.grad of")
def test_the_fallbacks_local_gradient_view_of_the_sums_is_left_as_it_was(routes):
    """With gradients held before the tracked backward pass GradientNoiseScale reads the local
    gradient, which the fallback leaves as ``sums[0]``: GradientVarianceQuantiles before it
    forms that layer's sd and SNR over a copy, and both report what they report alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3).double(), Scale(3), nn.Tanh(), nn.Linear(3, 2).double())
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    seen = []

    class Probe(cgn.GradientVarianceQuantiles):
        def step_context(self, step, params):
            gamma = params[2]
            seen.append(getattr(gamma, LOCAL_GRADIENT_SAVEFIELD).data_ptr()
                        == getattr(gamma, SUMS_SAVEFIELD)[0].data_ptr())
            return super().step_context(step, params)

    def run(first):
        prepared = cgn.prepare_model(copy.deepcopy(model))
        names = [name for name, _ in prepared.named_parameters()]
        noise = cgn.GradientNoiseScale(linear(1), param_names=names)
        tracker = Tracker(cgn.Cockpit(list(prepared.parameters()),
                                      quantities=first(names) + [noise]), names)
        loss_fn = nn.CrossEntropyLoss(reduction="none")
        loss_fn(prepared(x), y).sum().backward()  # gradients held before the tracked step
        with tracker(0, loss_fn(prepared(x), y), reduction="sum") as loss:
            loss.backward()
        return rows(tracker.cockpit, "GradientNoiseScale")

    together = run(lambda names: [Probe(linear(1), param_names=names)])
    assert seen == [True]
    assert routes == ["over sums"]  # the other layers' over theirs, gamma's over a copy
    assert_same_rows(together, run(lambda names: []))


def test_micro_batches_of_an_accumulated_step_are_formed_into_buffers(routes):
    """The sums of an accumulated step are added over its micro-batches: formed into
    buffers (the route over each layer's sums is one batch's, on one process), each
    step's statistics those of one batch of all the examples."""
    sizes = (2, 3)
    problem = build(case_named("cnn"), 2 * sum(sizes), "sum")
    initial = copy.deepcopy(problem)
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem.names)), problem.names)
    accumulate(problem, tracker, "sum", sizes, steps=2)
    assert_steps_match(stored(tracker), initial, "sum", sizes, len(sizes))
    assert routes == ["buffers", "buffers"]
