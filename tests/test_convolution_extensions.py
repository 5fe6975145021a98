"""The convolution extensions against a per-example loop, in float64.

Both: ``||x_i||^2`` (``PerExampleSquaredNorms``) and ``[sum_i x_i, sum_i x_i**2]``
(``SumsOfContributions``).

Every convolution class with stride, padding, dilation, groups and
``output_padding`` variants, with and without bias, both methods forced
(forming per-example gradients; products of positions: Gram matrices, or the
two products of one position),
in one chunk or several, against autograd on an un-extended copy of the model.
"""

import copy
import functools
from dataclasses import dataclass
from typing import Callable, Tuple

from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    _conv_math,
    _cost,
    override_module_extensions,
    sums,
)

import pytest
import torch
from backpack import backpack, extend
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions.firstorder.sum_grad_squared import conv1d as sgs_conv1d
from torch import nn

from tests.cases import MODELS
from tests.helpers import RTOL


@dataclass(frozen=True)
class ConvCase:
    name: str
    make: Callable[..., nn.Module]  # make(bias) -> the convolution
    example_shape: Tuple[int, ...]


CONVS = [
    ConvCase("conv1d", lambda bias: nn.Conv1d(4, 6, 3, bias=bias), (4, 9)),
    ConvCase(
        "conv1d-stride-padding-dilation-groups",
        lambda bias: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, bias=bias),
        (4, 11),
    ),
    ConvCase(
        "conv1d-same-circular",
        lambda bias: nn.Conv1d(2, 3, 4, padding="same", padding_mode="circular", bias=bias),
        (2, 7),
    ),
    ConvCase(
        "conv2d-stride-padding",
        lambda bias: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 2), bias=bias),
        (3, 7, 6),
    ),
    ConvCase(
        "conv2d-dilation-groups",
        lambda bias: nn.Conv2d(4, 6, 3, dilation=(2, 1), padding=1, groups=2, bias=bias),
        (4, 7, 6),
    ),
    ConvCase(
        "conv2d-depthwise-strided",
        lambda bias: nn.Conv2d(3, 6, 3, stride=2, groups=3, bias=bias),
        (3, 7, 7),
    ),
    ConvCase("conv2d-one-position", lambda bias: nn.Conv2d(3, 5, 4, bias=bias), (3, 4, 4)),
    ConvCase(
        "conv2d-same-reflect-dilated",
        lambda bias: nn.Conv2d(
            2, 3, 3, padding="same", padding_mode="reflect", dilation=2, bias=bias
        ),
        (2, 6, 7),
    ),
    ConvCase(
        "conv3d",
        lambda bias: nn.Conv3d(
            2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2), bias=bias
        ),
        (2, 4, 5, 5),
    ),
    ConvCase(
        "conv3d-groups-strided",
        lambda bias: nn.Conv3d(4, 4, 2, stride=2, groups=2, bias=bias),
        (4, 4, 4, 4),
    ),
    ConvCase("convtranspose1d", lambda bias: nn.ConvTranspose1d(3, 2, 4, bias=bias), (3, 5)),
    ConvCase(
        "convtranspose1d-all-options",
        lambda bias: nn.ConvTranspose1d(
            4, 6, 3, stride=2, padding=1, dilation=3, output_padding=2, groups=2, bias=bias
        ),
        (4, 5),
    ),
    ConvCase(
        "convtranspose2d-output-padding-groups",
        lambda bias: nn.ConvTranspose2d(
            4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, bias=bias
        ),
        (4, 4, 3),
    ),
    ConvCase(
        "convtranspose2d-dilation",
        lambda bias: nn.ConvTranspose2d(
            3, 2, (2, 3), stride=(1, 2), padding=(0, 1), dilation=(2, 1), bias=bias
        ),
        (3, 4, 4),
    ),
    ConvCase(
        "convtranspose3d-output-padding-groups",
        lambda bias: nn.ConvTranspose3d(
            2,
            4,
            (2, 3, 2),
            stride=(2, 1, 3),
            padding=(0, 1, 1),
            output_padding=(1, 0, 2),
            groups=2,
            bias=bias,
        ),
        (2, 3, 3, 2),
    ),
]


def build(case, bias, n, reduction, seed=0):
    """``(extended model, un-extended copy, loss, inputs, targets)`` in float64."""
    torch.default_generator.manual_seed(seed)  # torch.manual_seed also seeds CUDA: slow
    conv = case.make(bias).double()
    inputs = torch.randn(n, *case.example_shape, dtype=torch.float64)
    features = conv(inputs)[0].numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(features, 3)).double()
    plain = copy.deepcopy(model)
    targets = torch.randint(0, 3, (n,))
    return extend(model), plain, extend(nn.CrossEntropyLoss(reduction=reduction)), inputs, targets


@functools.cache
def expected_for(case, bias, n, reduction):
    """:func:`expected_results` of :func:`build`'s problem, computed once per problem."""
    _, plain, _, inputs, targets = build(case, bias, n, reduction)
    return expected_results(plain, inputs, targets, reduction)


def expected_results(plain, inputs, targets, reduction):
    """``{conv param name: (sum_i x_i**2, ||x_i||**2, contributions x_i)}``, one
    backward pass per example."""
    grads = references.per_example_gradients(
        plain, nn.CrossEntropyLoss(reduction="none"), inputs, targets
    )
    scale = 1.0 / len(inputs) if reduction == "mean" else 1.0
    contributions = {name: g * scale for name, g in grads.items() if name.startswith("0.")}
    return {
        name: (x.pow(2).sum(0), x.flatten(start_dim=1).pow(2).sum(1), x)
        for name, x in contributions.items()
    }


def extension_results(model, loss_fn, inputs, targets):
    """``{conv param name: (squared norms, [sum, sum of squares])}`` from one
    BackPACK backward pass."""
    loss = loss_fn(model(inputs), targets)
    with backpack(PerExampleSquaredNorms(), SumsOfContributions()):
        loss.backward()
    return {
        f"0.{name}": tuple(getattr(p, field) for field in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD))
        for name, p in model[0].named_parameters()
    }


def assert_results_match(got, expected):
    assert set(got) == set(expected)
    for name, (sum_of_squares, norms, x) in expected.items():
        torch.testing.assert_close(got[name][0], norms, rtol=RTOL, atol=0)
        total, squares = got[name][1]
        torch.testing.assert_close(squares, sum_of_squares, rtol=RTOL, atol=0)
        # sum_i x_i can cancel: its error is relative to sum_i |x_i|, per element.
        error = (total - x.sum(0)).abs()
        assert (error <= RTOL * x.abs().sum(0)).all(), name


@pytest.mark.parametrize("method", ["formation", "expansion"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "n, chunked", [(2, False), (7, False), (7, True)], ids=["N2", "N7", "N7-chunked"]
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", CONVS, ids=lambda case: case.name)
def test_extensions_match_per_example_loop(case, bias, n, chunked, reduction, method, monkeypatch):
    monkeypatch.setattr(_cost, "FORCE_METHOD", method)
    model, _, loss_fn, inputs, targets = build(case, bias, n, reduction)
    if chunked:  # chunks of 3, 3 and 1 examples
        monkeypatch.setattr(_cost, "examples_per_chunk", lambda *args: 3)
    got = extension_results(model, loss_fn, inputs, targets)
    assert_results_match(got, expected_for(case, bias, n, reduction))


@pytest.mark.parametrize("case", CONVS, ids=lambda case: case.name)
def test_chosen_method_matches_per_example_loop(case):
    model, _, loss_fn, inputs, targets = build(case, True, 7, "mean")
    got = extension_results(model, loss_fn, inputs, targets)
    assert_results_match(got, expected_for(case, True, 7, "mean"))


@pytest.mark.parametrize("case", CONVS[4::4], ids=lambda case: case.name)
def test_backpacks_save_memory_setting_does_not_matter(case):
    results = []
    for save_memory in (True, False):
        model, _, loss_fn, inputs, targets = build(case, True, 7, "sum")
        with weight_jac_t_save_memory(save_memory):
            results.append(extension_results(model, loss_fn, inputs, targets))
    for name, values in results[0].items():
        for value, other in zip(values, results[1][name]):
            assert torch.equal(value, other), name


@pytest.mark.parametrize(
    "shape, formation_for_norms",
    [
        ((64, 147, 256), True),  # resnet18 conv1: 16x16 output positions
        ((64, 576, 64), False),  # layer1: 8x8
        ((128, 1152, 16), False),  # layer2: 4x4
        ((256, 2304, 4), False),  # layer3: 2x2
        ((512, 4608, 1), False),  # layer4: one position
        ((64, 288, 576), True),  # benchmark CNN's second convolution
    ],
)
def test_cost_model_picks_the_measured_faster_method(shape, formation_for_norms):
    """The choices that measurement on these layers found fastest (per-layer tables of
    benchmarks/README.md at bb7178a, in git); the sums ask the cost model only for one position (resnet18's layer4)."""
    assert _cost.formation_is_cheaper(_cost.gram_cost, *shape) is formation_for_norms
    if shape[2] == 1:
        assert not _cost.formation_is_cheaper(_cost.expansion_cost, *shape)


def test_case_matrix_reaches_both_methods_for_the_sums():
    """tests/cases.py drives the quantities through both methods of the sums:
    formation where a convolution has several positions, the two products of
    one position where the cost model picks them."""
    shapes = {}
    for name in ("cnn", "conv-one-position"):
        case = next(c for c in MODELS if c.name == name)
        conv, inputs = case.make()[0], case.inputs(2)
        shapes[name] = _conv_math.layer_shape(conv, inputs, conv(inputs))[1:]
    assert shapes["cnn"][2] > 1
    assert shapes["conv-one-position"][2] == 1
    assert not _cost.formation_is_cheaper(_cost.expansion_cost, *shapes["conv-one-position"])


def test_unknown_forced_method_is_refused(monkeypatch):
    monkeypatch.setattr(_cost, "FORCE_METHOD", "gram")
    model, _, loss_fn, inputs, targets = build(CONVS[0], True, 2, "mean")
    with pytest.raises(ValueError, match="'formation' or 'expansion'"):
        extension_results(model, loss_fn, inputs, targets)


def test_examples_per_chunk_fit_the_budget(monkeypatch):
    monkeypatch.setattr(_cost, "CHUNK_BYTES", 1000)
    assert _cost.examples_per_chunk(60, 8) == 2  # 960 bytes
    assert _cost.examples_per_chunk(200, 8) == 1  # over the budget: one at a time


@pytest.mark.parametrize("method", ["formation", "expansion"])
@pytest.mark.parametrize("case", CONVS[4::4], ids=lambda case: case.name)
def test_a_tiny_budget_processes_one_example_at_a_time(case, method, monkeypatch):
    monkeypatch.setattr(_cost, "FORCE_METHOD", method)
    monkeypatch.setattr(_cost, "CHUNK_BYTES", 1)
    seen = []
    original = _conv_math.weight_factors

    def recording(module, inputs, grad_output):
        seen.append(len(inputs))
        return original(module, inputs, grad_output)

    monkeypatch.setattr(_conv_math, "weight_factors", recording)
    model, _, loss_fn, inputs, targets = build(case, True, 7, "sum")
    got = extension_results(model, loss_fn, inputs, targets)
    assert seen == [1] * 14  # 7 examples, for each of the two extensions
    assert_results_match(got, expected_for(case, True, 7, "sum"))



def test_rows_are_overridden_on_the_instances_given():
    """``override_module_extensions`` replaces a row of the instances given (what the
    benchmarks' "BackPACK's conv rows" methods do) and leaves new instances alone."""
    calls = []

    class RecordingSums(sums.SumsFromContributionsMixin, sgs_conv1d.SGSConv1d):
        def __call__(self, *args):
            calls.append(type(args[0]))
            super().__call__(*args)

    extensions = [SumsOfContributions(), PerExampleSquaredNorms()]
    override_module_extensions(extensions, {SumsOfContributions: {nn.Conv1d: RecordingSums()}})
    model, _, loss_fn, inputs, targets = build(CONVS[0], True, 5, "sum")
    with backpack(*extensions):
        loss_fn(model(inputs), targets).backward()
    assert calls == [SumsOfContributions]
    for name, (_, norms, x) in expected_for(CONVS[0], True, 5, "sum").items():
        param = model.get_parameter(name)
        torch.testing.assert_close(getattr(param, BATCH_L2_SAVEFIELD), norms, rtol=RTOL, atol=0)
        total, squares = getattr(param, SUMS_SAVEFIELD)
        torch.testing.assert_close(squares, x.pow(2).sum(0), rtol=RTOL, atol=0)
        assert ((total - x.sum(0)).abs() <= RTOL * x.abs().sum(0)).all(), name
    model, _, loss_fn, inputs, targets = build(CONVS[0], True, 5, "sum")
    with backpack(SumsOfContributions()):
        loss_fn(model(inputs), targets).backward()
    assert calls == [SumsOfContributions]
