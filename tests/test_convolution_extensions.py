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
import math
from dataclasses import dataclass
from typing import Callable, Tuple

from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    conv_math,
    cost_model,
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
from tests.helpers import EPS64, RTOL


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

# Depthwise (one input channel per group): formed from windows, conv_math.depthwise_gradients.
DEPTHWISE = [
    ConvCase(
        "conv2d-depthwise-7x7-4-positions",  # ConvNeXt's stage 3 at 32x32
        lambda bias: nn.Conv2d(4, 4, 7, padding=3, groups=4, bias=bias),
        (4, 2, 2),
    ),
    ConvCase(
        "conv1d-depthwise-same-reflect-dilated",
        lambda bias: nn.Conv1d(
            3, 3, 4, padding="same", padding_mode="reflect", dilation=2, groups=3, bias=bias
        ),
        (3, 9),
    ),
    ConvCase(
        "conv3d-depthwise-multiplier-stride-skips-the-end",
        lambda bias: nn.Conv3d(
            2, 4, (2, 3, 2), stride=(2, 2, 3), dilation=(1, 2, 1), padding=(1, 0, 1), groups=2,
            bias=bias,
        ),
        (2, 5, 7, 6),
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


@dataclass(frozen=True)
class Expected:
    """A convolution parameter's references, one backward pass per example."""

    squares: torch.Tensor  # sum_i x_i**2
    norms: torch.Tensor  # ||x_i||**2
    contributions: torch.Tensor  # x_i
    absolute: torch.Tensor  # the weight's A = sum_i (sum_l |b_il| |a_il|^T)**2 (the bias's: unused)
    positions: int  # L


def expected_results(plain, inputs, targets, reduction):
    """``{conv param name: Expected}``, one backward pass per example."""
    grads = references.per_example_gradients(
        plain, nn.CrossEntropyLoss(reduction="none"), inputs, targets
    )
    scale = 1.0 / len(inputs) if reduction == "mean" else 1.0
    contributions = {name: g * scale for name, g in grads.items() if name.startswith("0.")}
    conv, outputs = plain[0], []
    handle = conv.register_forward_hook(lambda m, args, out: outputs.append(out))
    loss = nn.CrossEntropyLoss(reduction=reduction)(plain(inputs), targets)
    handle.remove()
    (grad_output,) = torch.autograd.grad(loss, outputs)
    absolute = absolute_terms(conv, inputs, grad_output)
    transposed = isinstance(conv, conv_math.TRANSPOSED)
    positions = (inputs if transposed else grad_output)[0, 0].numel()
    return {
        name: Expected(x.pow(2).sum(0), x.flatten(start_dim=1).pow(2).sum(1), x, absolute, positions)
        for name, x in contributions.items()
    }


def absolute_terms(conv, inputs, grad_output):
    """``A = sum_i (sum_l |b_il| |a_il|^T)**2`` of the weight, by autograd one example at a time.

    ``sum_l |b_il| |a_il|^T`` is the weight gradient of the same convolution
    applied to ``|input_i|`` with output gradient ``|grad_output_i|``: its
    patches (padded in any mode) are those of the input, made absolute.
    """
    weight = conv.weight.detach().requires_grad_()
    total = torch.zeros_like(weight)
    for x, g in zip(inputs, grad_output):
        out = torch.func.functional_call(conv, {"weight": weight}, (x.abs()[None],))
        (alpha,) = torch.autograd.grad((out * g.abs()[None]).sum(), weight)
        total += alpha.square()
    return total


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


def assert_results_match(got, expected, expanded=False):
    """``got`` matches ``expected``; ``expanded``: the weight's sums must come from the
    expanded square where the layer has several positions."""
    assert set(got) == set(expected)
    for name, reference in expected.items():
        x = reference.contributions
        torch.testing.assert_close(got[name][0], reference.norms, rtol=RTOL, atol=0)
        sums = got[name][1]
        has_magnitudes = name.endswith("weight") and reference.positions > 1 and expanded
        assert len(sums) == (3 if has_magnitudes else 2), name
        total, squares = sums[:2]
        if len(sums) == 3:
            assert_expansion_within_bound(sums, reference)
        else:
            torch.testing.assert_close(squares, reference.squares, rtol=RTOL, atol=0)
        # sum_i x_i can cancel: its error is relative to sum_i |x_i|, per element.
        error = (total - x.sum(0)).abs()
        assert (error <= RTOL * x.abs().sum(0)).all(), name


def assert_expansion_within_bound(sums, reference):
    """``S`` and ``R = w(L) A`` of the expanded square within their float64 rounding bounds.

    First order, ``M = N L(L+1)/2`` products of positions: ``S`` is off by at
    most ``(M + 2) u A`` (three rounded products per term, :mod:`.conv_math`),
    the reference ``sum_i x_i**2`` by ``(2L + N) u A`` (each ``x_i`` a sum of
    ``L`` products, squared, summed over ``N``); ``A``'s terms are positive, so
    ``R / w(L)`` and the reference ``A`` are off by as much relative to ``A``
    (and ``R`` by one more rounding for ``w(L)``). ``eps = 2u`` covers the
    second-order terms.
    """
    _, squares, magnitudes = sums
    n, positions = len(reference.contributions), reference.positions
    terms = n * positions * (positions + 1) // 2 + 2 * positions + n + 3
    allowed = terms * EPS64 * reference.absolute
    assert ((squares - reference.squares).abs() <= allowed).all()
    weight = conv_math.expansion_rounding_terms(positions)
    assert ((magnitudes / weight - reference.absolute).abs() <= allowed).all()


@pytest.mark.parametrize("method", ["formation", "expansion"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "n, chunked", [(2, False), (7, False), (7, True)], ids=["N2", "N7", "N7-chunked"]
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", CONVS + DEPTHWISE, ids=lambda case: case.name)
def test_extensions_match_per_example_loop(case, bias, n, chunked, reduction, method, monkeypatch):
    monkeypatch.setattr(cost_model, "FORCE_METHOD", method)
    model, _, loss_fn, inputs, targets = build(case, bias, n, reduction)
    if chunked:  # chunks of 3, 3 and 1 examples
        monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: 3)
    got = extension_results(model, loss_fn, inputs, targets)
    assert_results_match(got, expected_for(case, bias, n, reduction), method == "expansion")


@pytest.mark.parametrize("case", CONVS + DEPTHWISE, ids=lambda case: case.name)
def test_chosen_method_matches_per_example_loop(case):
    model, _, loss_fn, inputs, targets = build(case, True, 7, "mean")
    got = extension_results(model, loss_fn, inputs, targets)
    with torch.no_grad():
        _, c_b, c_a, positions = conv_math.layer_shape(model[0], inputs, model[0](inputs))
    expanded = not conv_math.forms(model[0], cost_model.expansion_cost, c_b, c_a, positions)
    assert_results_match(got, expected_for(case, True, 7, "mean"), expanded)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("case", [case for case in CONVS + DEPTHWISE if "depthwise" in case.name],
                         ids=lambda case: case.name)
def test_depthwise_convolutions_are_formed_from_windows(case, channels_last, monkeypatch):
    """Formed from the input's windows (here at any number of positions), no patches
    copied (:func:`.conv_math.weight_factors` never called), exact; also from
    channels-last inputs and output gradients (ConvNeXt's blocks)."""
    calls, original = [], conv_math.weight_factors
    monkeypatch.setattr(conv_math, "weight_factors", lambda *args: calls.append(1) or original(*args))
    monkeypatch.setattr(conv_math, "from_windows",
                        lambda module, positions: module.in_channels == module.groups)
    model, _, loss_fn, inputs, targets = build(case, True, 7, "mean")
    if channels_last:
        inputs = inputs.movedim(1, -1).contiguous().movedim(-1, 1)
        model.insert(1, ChannelsLast())
    got = extension_results(model, loss_fn, inputs, targets)
    assert not calls
    assert_results_match(got, expected_for(case, True, 7, "mean"))


@pytest.mark.parametrize("conv, shape, windows", [
    (nn.Conv2d(768, 768, 7, padding=3, groups=768), (768, 1, 1), True),  # ConvNeXt-T's last stage
    (nn.Conv2d(384, 384, 7, padding=3, groups=384), (384, 2, 2), True),
    (nn.Conv2d(96, 96, 7, padding=3, groups=96), (96, 7, 7), True),  # 49 positions, 49 elements
    (nn.Conv2d(96, 96, 7, padding=3, groups=96), (96, 8, 8), False),  # ConvNeXt-T's first stage
    (nn.Conv2d(32, 32, 3, padding=1, groups=32), (32, 28, 28), False),  # MobileNet's early layers
    (nn.Conv2d(1, 32, 3), (1, 28, 28), False),  # an MNIST network's first (one group)
    (nn.Conv2d(1, 4, 3), (1, 3, 3), True),
    (nn.Conv2d(4, 8, 3, groups=2), (4, 3, 3), False),  # two input channels per group
    (nn.ConvTranspose2d(4, 4, 3, groups=4), (4, 1, 1), False),
], ids=lambda value: None)
def test_formation_from_windows_only_over_at_most_as_many_positions_as_kernel_elements(
        conv, shape, windows):
    """Windows take a multiply-add per output position, patches a copy per kernel
    element: windows where the positions are at most the kernel's elements
    (:func:`.conv_math.from_windows`); an MNIST network's first convolution, over
    676 positions, was 18 times slower from windows."""
    with torch.no_grad():
        positions = math.prod(conv(torch.zeros(1, *shape)).shape[2:])
    assert conv_math.from_windows(conv, positions) is windows


class ChannelsLast(nn.Module):
    """The identity, its output (so the convolution's output gradient) channels-last."""

    def forward(self, x):
        return x.movedim(1, -1).contiguous().movedim(-1, 1)


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
    "shape, formation_for_norms, formation_for_sums",
    [
        ((64, 147, 256), True, True),  # resnet18 conv1: 16x16 output positions
        ((64, 576, 64), False, True),  # layer1: 8x8
        ((128, 1152, 16), False, True),  # layer2: 4x4
        ((128, 64, 16), False, True),  # layer2's 1x1 downsample
        ((256, 2304, 4), False, False),  # layer3: 2x2
        ((256, 1152, 4), False, False),  # layer3's first, strided
        ((512, 4608, 1), False, False),  # layer4: one position
        ((64, 288, 576), True, True),  # benchmark CNN's second convolution
    ],
)
def test_cost_model_picks_the_measured_faster_method(shape, formation_for_norms, formation_for_sums):
    """The choices that measurement on these layers found fastest: the norms' per-layer
    tables of benchmarks/README.md at bb7178a (in git); the sums' from
    ``python -m benchmarks.conv_sums_methods`` (benchmarks/README.md): expansion,
    with its absolute terms, 1.5-2.1x faster than formation at ``L = 4`` (also
    layer3's 1x1 downsample, ``256 x 128``, the closest call: 1.1-1.7x over
    two runs, left out), formation 3.6-5.7x faster at ``L = 16``."""
    assert cost_model.formation_is_cheaper(cost_model.gram_cost, *shape) is formation_for_norms
    assert cost_model.formation_is_cheaper(cost_model.expansion_cost, *shape) is formation_for_sums


def test_cost_model_expands_only_few_positions():
    """Expansion's products grow like ``L**2``, formation's writes do not: past
    ``L = 5`` formation is cheaper whatever the channels (``conv_math``'s docstring)."""
    for c_b, c_a in [(1, 1), (4, 18), (64, 27), (512, 4608), (4096, 4096)]:
        assert cost_model.formation_is_cheaper(cost_model.expansion_cost, c_b, c_a, 6), (c_b, c_a)


def _sums_methods(case):
    """``{"formation", "expansion", "one position"}``: how the sums of the case's
    convolutions are computed, found from the layers' shapes in one forward pass."""
    shapes = []

    def record(module, args, output):
        shapes.append(conv_math.layer_shape(module, args[0], output)[1:])

    model = case.make()
    handles = [m.register_forward_hook(record) for m in model.modules()
               if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, *conv_math.TRANSPOSED))]
    with torch.no_grad():
        model(case.inputs(2))
    for handle in handles:
        handle.remove()
    return {
        "formation" if cost_model.formation_is_cheaper(cost_model.expansion_cost, *shape)
        else "expansion" if shape[2] > 1 else "one position"
        for shape in shapes
    }


def test_case_matrix_reaches_every_method_for_the_sums():
    """tests/cases.py drives the quantities through the three ways of the sums:
    formation (the CNN), the two products of one position (``conv-one-position``),
    and the expanded square with its absolute terms (resnet18's layer3, 2x2 positions)."""
    methods = {name: _sums_methods(next(c for c in MODELS if c.name == name))
               for name in ("cnn", "conv-one-position", "resnet18")}
    assert methods["cnn"] == {"formation"}
    assert methods["conv-one-position"] == {"one position"}
    assert methods["resnet18"] == {"formation", "expansion", "one position"}


def test_unknown_forced_method_is_refused(monkeypatch):
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "gram")
    model, _, loss_fn, inputs, targets = build(CONVS[0], True, 2, "mean")
    with pytest.raises(ValueError, match="'formation' or 'expansion'"):
        extension_results(model, loss_fn, inputs, targets)


def test_examples_per_chunk_fit_the_budget(monkeypatch):
    monkeypatch.setattr(cost_model, "CHUNK_BYTES", 1000)
    assert cost_model.examples_per_chunk(60, 8) == 2  # 960 bytes
    assert cost_model.examples_per_chunk(200, 8) == 1  # over the budget: one at a time


@pytest.mark.parametrize("method", ["formation", "expansion"])
@pytest.mark.parametrize("case", CONVS[4::4], ids=lambda case: case.name)
def test_a_tiny_budget_processes_one_example_at_a_time(case, method, monkeypatch):
    monkeypatch.setattr(cost_model, "FORCE_METHOD", method)
    monkeypatch.setattr(cost_model, "CHUNK_BYTES", 1)
    seen = []
    original = conv_math.weight_factors

    def recording(module, inputs, grad_output):
        seen.append(len(inputs))
        return original(module, inputs, grad_output)

    monkeypatch.setattr(conv_math, "weight_factors", recording)
    model, _, loss_fn, inputs, targets = build(case, True, 7, "sum")
    got = extension_results(model, loss_fn, inputs, targets)
    # 7 examples: formed once for both extensions (convolution.shares_formation); the
    # expansion's sums and the Gram matrices' norms each take their own factors.
    assert seen == [1] * (7 if method == "formation" else 14)
    assert_results_match(got, expected_for(case, True, 7, "sum"), method == "expansion")



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
    for name, reference in expected_for(CONVS[0], True, 5, "sum").items():
        norms, x = reference.norms, reference.contributions
        param = model.get_parameter(name)
        torch.testing.assert_close(getattr(param, BATCH_L2_SAVEFIELD), norms, rtol=RTOL, atol=0)
        total, squares = getattr(param, SUMS_SAVEFIELD)
        torch.testing.assert_close(squares, x.pow(2).sum(0), rtol=RTOL, atol=0)
        assert ((total - x.sum(0)).abs() <= RTOL * x.abs().sum(0)).all(), name
    model, _, loss_fn, inputs, targets = build(CONVS[0], True, 5, "sum")
    with backpack(SumsOfContributions()):
        loss_fn(model(inputs), targets).backward()
    assert calls == [SumsOfContributions]


def _weight_results(extensions, case, dtype, scale):
    """``(norms, sums)`` of the convolution's weight from one backward pass with ``extensions``."""
    model, _, loss_fn, inputs, targets = build(case, True, 5, "mean")
    model = model.to(dtype)
    loss = loss_fn(model(inputs.to(dtype) * scale), targets)
    with backpack(*extensions):
        loss.backward()
    return tuple(getattr(model[0].weight, field, None) for field in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD))


@pytest.mark.parametrize("dtype, scale", [(torch.float64, 1.0), (torch.float32, 1e-12)],
                         ids=["float64", "float32-scaled"])
@pytest.mark.parametrize("case", [CONVS[3], CONVS[10], DEPTHWISE[0]], ids=lambda case: case.name)
def test_together_each_layer_is_formed_once(case, dtype, scale, monkeypatch):
    """Where the sums form ``x_i``, both extensions take the weight's results from one
    formation (:func:`.convolution.shares_formation`), in either order, and they are the
    very numbers each computes alone (the same scale, chunks and operations; float32 at a
    scale, :mod:`._squares`)."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    formed, original = [], conv_math._formed_gradients
    monkeypatch.setattr(conv_math, "_formed_gradients", lambda *args: formed.append(1) or original(*args))
    together = [_weight_results(order, case, dtype, scale) for order in (
        (PerExampleSquaredNorms(), SumsOfContributions()), (SumsOfContributions(), PerExampleSquaredNorms()))]
    assert len(formed) == 2  # once per backward pass
    norms_alone = _weight_results((PerExampleSquaredNorms(),), case, dtype, scale)[0]
    sums_alone = _weight_results((SumsOfContributions(),), case, dtype, scale)[1]
    assert len(formed) == 4
    assert sums_alone.dtype == norms_alone.dtype == torch.float64  # float32: saved wide (scaled)
    for norms, weight_sums in together:
        assert torch.equal(norms, norms_alone) and torch.equal(weight_sums, sums_alone)

