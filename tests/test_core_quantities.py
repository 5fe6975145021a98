"""GradientVarianceQuantiles and PerExampleGradNorm against brute force.

Every statistic, every parameter and "all", over the case matrix, in float64.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references

import numpy
import pytest
import torch
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, case_named, run_step
from tests.helpers import assert_statistics_match, sd_rtol


def test_gradient_variance_quantiles_match_reference(model_case, reduction, batch_size):
    problem = build(model_case, batch_size, reduction)
    quantiles = (0.0, 0.05, 0.5, 0.95, 1.0)
    quantity = cgn.GradientVarianceQuantiles(
        linear(1), quantiles=quantiles, param_names=problem.names
    )
    with pytest.warns(UserWarning) if model_case.name == "unused-frozen" else _no_warning():
        cockpit = run_step(problem, [quantity])
    got = cockpit.get_output()[0]["GradientVarianceQuantiles"]
    expected = references.gradient_variance_quantiles(
        problem.model,
        problem.per_example_loss,
        problem.inputs,
        problem.targets,
        reduction=reduction,
        quantiles=quantiles,
    )
    grads = references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    sd_tolerances = {
        name: sd_rtol(grads, batch_size, name, model_case.inner_terms) for name in expected
    }

    def rtol_of(name, statistic):
        return sd_tolerances[name]

    assert_statistics_match(got, expected, rtol_of=rtol_of)


def test_per_example_grad_norm_matches_reference(model_case, reduction, batch_size):
    problem = build(model_case, batch_size, reduction)
    quantiles = (0.0, 0.05, 0.5, 0.95, 1.0)
    quantity = cgn.PerExampleGradNorm(linear(1), quantiles=quantiles, param_names=problem.names)
    with pytest.warns(UserWarning) if model_case.name == "unused-frozen" else _no_warning():
        cockpit = run_step(problem, [quantity])
    got = cockpit.get_output()[0]["PerExampleGradNorm"]
    expected = references.per_example_grad_norm(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets,
        quantiles=quantiles,
    )
    assert_statistics_match(got, expected)


def test_unused_and_frozen_parameters_have_no_rows():
    problem = build(case_named("unused-frozen"), 7, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    with pytest.warns(UserWarning, match=r"\['unused.weight', 'unused.bias'\] have no gradient"):
        cockpit = run_step(problem, [quantity])
    frame = cgn.to_frame(cockpit)
    assert set(frame.param) == {"body.1.weight", "body.1.bias", "body.3.weight", "body.3.bias", "all"}


class _no_warning:
    """Context manager that fails on any warning of this package."""

    def __enter__(self):
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catcher.__exit__(*exc)
        ours = [str(r.message) for r in self._records if "Full backward hook" not in str(r.message)]
        assert not ours, ours


def _track_steps(problem, quantities, steps):
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    opt = torch.optim.SGD(problem.params, lr=0.1)
    for step in range(steps):
        run_step(problem, quantities, step=step, cockpit=cockpit, optimizer=opt)
        opt.step()
    return cockpit


def _ours(problem, schedule=linear(1)):
    return [
        cgn.GradientVarianceQuantiles(schedule, param_names=problem.names),
        cgn.PerExampleGradNorm(schedule, param_names=problem.names),
    ]


@pytest.mark.parametrize("case", [MODELS[0], MODELS[2]], ids=lambda c: c.name)
def test_identical_alone_together_and_with_cockpit_full_configuration(case, tmp_path):
    """Each quantity gives the same numbers alone, with the other, and beside
    Cockpit's own quantities (float32: Cockpit's HessMaxEV fails in float64),
    and Cockpit's plotter still renders that cockpit."""
    steps = 3

    def frame_of(make_quantities):
        problem = build(case, 16, "mean", dtype=torch.float32)
        quantities = make_quantities(problem)
        cockpit = _track_steps(problem, quantities, steps)
        return cgn.to_frame(cockpit), cockpit

    alone = [
        frame_of(lambda p, i=i: [_ours(p)[i]])[0] for i in range(2)
    ]
    together, _ = frame_of(_ours)
    with_full, cockpit = frame_of(lambda p: _ours(p) + configuration("full"))
    expected = pandas_concat(alone)
    assert len(expected) > 0
    assert together.equals(expected)
    assert with_full.equals(expected)

    plotter = cgn.CockpitPlotter()
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=str(tmp_path), savename="cockpit")
    assert (tmp_path / "cockpit__primary.png").stat().st_size > 0


def pandas_concat(frames):
    import pandas

    # As to_frame: by step and quantity, each quantity's rows in stored order.
    return pandas.concat(frames).sort_values(["step", "quantity"], kind="stable",
                                             ignore_index=True)


def test_output_steps_equal_schedule_steps():
    problem = build(MODELS[0], 7, "mean")
    schedule = lambda step: step in (0, 3, 4, 9)  # noqa: E731
    cockpit = _track_steps(problem, _ours(problem, schedule), 10)
    frame = cgn.to_frame(cockpit)
    for quantity in ("GradientVarianceQuantiles", "PerExampleGradNorm"):
        assert sorted(set(frame[frame.quantity == quantity].step)) == [0, 3, 4, 9]


def test_per_example_norms_do_not_depend_on_reduction():
    frames = {}
    for reduction in ("mean", "sum"):
        problem = build(MODELS[2], 7, reduction)
        cockpit = run_step(problem, [cgn.PerExampleGradNorm(linear(1), param_names=problem.names)])
        frames[reduction] = cgn.to_frame(cockpit)
    numpy.testing.assert_allclose(frames["mean"].value, frames["sum"].value, rtol=1e-12)
    assert not math.isnan(frames["mean"].value.sum())


def test_both_per_example_norm_paths_for_convolutions_are_in_the_case_matrix():
    """Convolutions contract Gram matrices or form per-example gradients,
    whichever is cheaper; the matrix covers both."""
    from cockpit_gradnoise.extensions import _conv_math, _cost

    chosen = {}
    for name in ("cnn", "conv-one-position"):
        case = next(c for c in MODELS if c.name == name)
        conv, inputs = case.make()[0], case.inputs(2)
        _, c_b, c_a, positions = _conv_math.layer_shape(conv, inputs, conv(inputs))
        chosen[name] = _cost.formation_is_cheaper(_cost.gram_cost, c_b, c_a, positions)
    assert chosen == {"cnn": True, "conv-one-position": False}
