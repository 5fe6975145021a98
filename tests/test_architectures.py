"""The models people train: ResNets (in-place operations, BatchNorm in training mode)."""

import copy
import warnings

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references, schema
from cockpit_gradnoise.prepare import needs_converter
from tests.cases import Problem, run_step
from tests.helpers import RTOL, assert_statistics_match, rounding_bounds, rows, sd_rtol


def resnet18(inplace=True):
    from torchvision.models import resnet18 as torchvision_resnet18

    model = torchvision_resnet18(num_classes=3)
    for module in model.modules():
        if hasattr(module, "inplace"):
            module.inplace = inplace
    return model


def test_prepare_model_converts_resnet18_and_keeps_parameter_names():
    model = resnet18()
    names = [n for n, _ in model.named_parameters()]
    assert needs_converter(model)
    prepared = cgn.prepare_model(model)
    assert isinstance(prepared, torch.fx.GraphModule)
    assert [n for n, _ in prepared.named_parameters()] == names
    assert all(a is b for a, b in zip(prepared.parameters(), model.parameters()))
    prepared(torch.randn(2, 3, 32, 32)).sum().backward()  # no in-place error


def test_prepare_model_leaves_models_without_in_place_operations_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert not needs_converter(model)
    assert cgn.prepare_model(model) is model


def test_an_in_place_failure_names_prepare_model_and_the_converter():
    """Without in-place ReLUs the `out += identity` of a ResNet block still fails;
    it cannot be seen without running the model."""
    model = resnet18(inplace=False)
    assert not needs_converter(model)
    prepared = cgn.prepare_model(model)
    duplicate = copy.deepcopy(prepared)  # as references and checkpoints make
    with pytest.raises(RuntimeError, match=r"prepare_model\(model, use_converter=True\)"):
        prepared(torch.randn(2, 3, 32, 32))
    with pytest.raises(RuntimeError, match="use_converter=True"):
        duplicate(torch.randn(2, 3, 32, 32))


def test_plain_backpack_extend_of_resnet18_fails_as_the_issue_reports():
    """The failure prepare_model exists for, so the test above stays meaningful."""
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        extend(resnet18())(torch.randn(2, 3, 32, 32))


def train_mode_problem(n, reduction):
    torch.manual_seed(0)
    model = cgn.prepare_model(resnet18().double().train())
    return Problem(
        model,
        extend(nn.CrossEntropyLoss(reduction=reduction)),
        nn.CrossEntropyLoss(reduction="none"),
        torch.randn(n, 3, 32, 32, dtype=torch.float64),
        torch.randint(0, 3, (n,)),
        reduction,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_resnet18_in_training_mode_gives_each_examples_contribution_through_the_batch(reduction):
    """Exact against contributions formed from one batch backward pass with hooks."""
    n = 3
    problem = train_mode_problem(n, reduction)
    reference_model = copy.deepcopy(problem.model)
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
        cgn.GradientNoiseScale(linear(1), param_names=problem.names),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = run_step(problem, quantities)
    interact = [str(w.message) for w in caught if "examples interact" in str(w.message)]
    assert len(interact) == 3 and sum("unbiasedness" in m for m in interact) == 1
    contributions = references.contributions_through_batch(
        reference_model, problem.loss_fn, problem.inputs, problem.targets
    )
    scale = 1.0 / n if reduction == "mean" else 1.0
    gradients = {name: x / scale for name, x in contributions.items()}
    args = (None, None, problem.inputs, None)
    expected_sd = references.gradient_variance_quantiles(
        *args, reduction=reduction, gradients=gradients
    )
    tolerances = {name: sd_rtol(gradients, n, name) for name in expected_sd}
    assert_statistics_match(
        rows(cockpit, schema.GRADIENT_VARIANCE),
        expected_sd,
        rtol_of=lambda name, statistic: tolerances[name],
    )
    assert_statistics_match(
        rows(cockpit, schema.PER_EXAMPLE_NORM),
        references.per_example_grad_norm(*args, gradients=gradients),
    )
    got = rows(cockpit, schema.NOISE_SCALE)
    numel = {name: x[0].numel() for name, x in gradients.items()}
    numel[schema.NETWORK] = sum(numel.values())
    for name, stats in references.gradient_noise_scale(*args, gradients=gradients).items():
        grad_sq, trace_cov = stats[schema.GRAD_SQ], stats[schema.TRACE_COV]
        atol_g, atol_t = rounding_bounds(n, numel[name], grad_sq, trace_cov)
        assert got[name][schema.GRAD_SQ] == pytest.approx(grad_sq, rel=RTOL, abs=atol_g)
        assert got[name][schema.TRACE_COV] == pytest.approx(trace_cov, rel=RTOL, abs=atol_t)
