"""The base classes' contract: what a subclass must declare, and what no quantity may do."""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities._declarations import SUM

import pytest
import torch
from backpack.extensions import SumGradSquared
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, run_step
from tests.helpers import rows


def all_quantities(names):
    return [
        cgn.GradientVarianceQuantiles(linear(1), param_names=names),
        cgn.PerExampleGradNorm(linear(1), param_names=names),
        cgn.ParamGradRatio(linear(1), param_names=names),
        cgn.UpdateSize(linear(1), param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names),
    ]


def test_a_subclass_without_statistic_names_fails_when_defined():
    """Written from the old docstring, it ran until the first NaN gradient."""
    with pytest.raises(TypeError, match="must implement statistic_names"):

        class Incomplete(cgn.ParameterQuantity):
            def parameter_value(self, param, context):
                return param.grad.abs().max().item()

            def network_value(self, values):
                return max(values)

            def statistics(self, value):
                return {"max": value}


def test_a_subclass_with_declared_sums_must_form_values_from_them():
    with pytest.raises(TypeError, match="parameter_sums, value_from_sums"):

        class SumsWithoutMethods(cgn.ParameterQuantity):
            sums = {"total": SUM}

            def parameter_value(self, param, context):
                return 0.0

            def network_value(self, values):
                return 0.0

            def statistics(self, value):
                return {}

            def statistic_names(self):
                return []


def test_an_unknown_reduction_of_a_declared_sum_fails_when_defined():
    with pytest.raises(TypeError, match="reductions must be one of"):

        class BadReduction(cgn.ParameterQuantity):
            sums = {"total": "mean"}


class MaxAbsGradient(cgn.ParameterQuantity):
    """Largest |grad_j|, declaring a name other than the one it returns."""

    def parameter_value(self, param, context):
        return param.grad.abs().max().item()

    def network_value(self, values):
        return max(values)

    def statistics(self, value):
        return {"max_abs": value}

    def statistic_names(self):
        return ["max"]


def test_undeclared_statistic_names_fail_at_the_first_tracked_step():
    problem = build(MODELS[0], 3, "mean")
    with pytest.raises(TypeError, match=r"returned \['max_abs'\].*statistic_names"):
        run_step(problem, [MaxAbsGradient(linear(1), param_names=problem.names)])


class SumOfSquaresReader(cgn.ParameterQuantity):
    """A user's quantity reading the sum of squares from another extension in one step."""

    extension_classes = (SumGradSquared,)

    def parameter_value(self, param, context):
        return getattr(param, "sum_grad_squared").sum().item()

    def network_value(self, values):
        return sum(values)

    def statistics(self, value):
        return {"total": value}

    def statistic_names(self):
        return ["total"]


class SumsReader(SumOfSquaresReader):
    """A user's quantity reading the same savefield as GradientVarianceQuantiles."""

    extension_classes = (SumsOfContributions,)

    def parameter_value(self, param, context):
        return getattr(param, SUMS_SAVEFIELD)[1].sum().item()


@pytest.mark.parametrize("reader", [SumOfSquaresReader, SumsReader])
@pytest.mark.parametrize("reader_first", [True, False])
def test_two_readers_of_one_savefield_both_see_the_sums_unaltered(reader_first, reader):
    """GradientVarianceQuantiles once turned the sum of squares into sd in place."""
    problem = build(MODELS[0], 5, "sum")
    expected = {}
    for name, grads in cgn.references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    ).items():
        expected[name] = grads.pow(2).sum().item()
    quantities = [
        reader(linear(1), param_names=problem.names),
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
    ]
    if not reader_first:
        quantities.reverse()
    cockpit = run_step(problem, quantities)
    got = rows(cockpit, reader.__name__)
    for name, total in expected.items():
        assert got[name]["total"] == pytest.approx(total, rel=1e-12)
    alone = run_step(
        build(MODELS[0], 5, "sum"),
        [cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names)],
    )
    assert rows(cockpit, schema.GRADIENT_VARIANCE) == rows(alone, schema.GRADIENT_VARIANCE)


def test_a_failed_backward_computes_warns_and_stores_nothing():
    problem = build(MODELS[0], 4, "mean")
    quantities = all_quantities(problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    info = {
        "batch_size": 4,
        "individual_losses": problem.per_example_loss(outputs, problem.targets),
        "loss": loss,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the user's own error"):
            with cockpit(0, info=info):
                raise RuntimeError("the user's own error")
    ours = [w for w in caught if any(type(q).__name__ in str(w.message) for q in quantities)]
    assert ours == []
    assert all(len(q.get_output()) == 0 for q in quantities)
    # The next step works as usual; UpdateSize starts anew.
    run_step(problem, None, step=1, cockpit=cockpit)
    stored = {type(q).__name__ for q in quantities if 1 in q.get_output()}
    assert stored == set(schema.QUANTITIES) - {schema.UPDATE_SIZE}


@pytest.mark.parametrize("quantity_class", [cgn.PerExampleGradNorm, cgn.GradientNoiseScale])
def test_individual_losses_of_the_wrong_length_are_refused(quantity_class):
    """4 losses for a batch of 8 whose mean happens to equal the loss."""
    problem = build(MODELS[0], 8, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity_class(linear(1), param_names=problem.names)])
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    losses = problem.per_example_loss(outputs, problem.targets)
    halves = torch.stack([losses[:4].mean(), losses[4:].mean(), losses[:4].mean(), losses[4:].mean()])
    assert halves.mean().item() == pytest.approx(loss.item())
    info = {"individual_losses": halves, "loss": loss}
    with pytest.raises(ValueError, match="has 4 values but the batch has 8 examples"):
        with cockpit(0, info=info):
            loss.backward()


def test_a_partial_network_row_says_how_many_parameters_it_covers(recwarn):
    case = next(c for c in MODELS if c.name == "unused-frozen")
    problem = build(case, 3, "sum")
    cockpit = run_step(problem, all_quantities(problem.names))
    frame = cgn.to_frame(cockpit)
    network = frame[frame.param == schema.NETWORK]
    total = len(problem.params)
    for quantity in set(schema.QUANTITIES) - {schema.UPDATE_SIZE}:
        stats = network[network.quantity == quantity].set_index("statistic").value
        assert stats[schema.PARAMS_COVERED] == total - 2  # the unused layer's weight and bias
        assert stats[schema.PARAMS_TOTAL] == total


def test_a_complete_network_row_has_no_coverage_statistics():
    problem = build(MODELS[0], 3, "sum")
    frame = cgn.to_frame(run_step(problem, all_quantities(problem.names)))
    assert not frame.statistic.isin(schema.COVERAGE_STATISTICS).any()


def test_rows_are_stored_in_the_order_of_param_names_with_the_network_last():
    problem = build(MODELS[2], 3, "sum")
    output = run_step(problem, all_quantities(problem.names)).get_output()[0]
    for quantity in set(schema.QUANTITIES) - {schema.UPDATE_SIZE}:
        assert list(output[quantity]) == problem.names + [schema.NETWORK]


def test_resolve_returns_python_numbers_as_they_are_and_merges_conditionals():
    from cockpit_gradnoise import _device

    plain = {"a": {"q0.5": 1.0}, "b": [2.0, (3, 4)]}
    assert _device.resolve(plain) is plain
    tree = {"a": {"q0.5": torch.tensor(1.5), "x": _device.PresentIfPositive(torch.tensor(0), {"m": 1.0})},
            "b": _device.PresentIfPositive(2, {"n": torch.tensor(2.0)})}
    assert _device.resolve(tree) == {"a": {"q0.5": 1.5}, "n": 2.0}
