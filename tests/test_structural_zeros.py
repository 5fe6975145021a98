"""Structurally zero gradients are exact zeros: an attention key's bias.

A key bias adds one constant to every score of a query, which softmax
ignores: its gradient is exactly 0 for every example, computed as rounding
noise (an sd of ``1e-21``, an SNR of order 1). Each example's contribution is a
sum over the sequence of output gradients whose magnitudes are at hand, so
rounding noise is told from a gradient (:func:`~cockpit_gradnoise.extensions.sums.structural_zeros`):
there, sum and sum of squares are exactly 0, so sd 0 and no SNR (``0 / 0``).
The references below know the key bias is zero; every other element is as
before, within the rounding bound of the case matrix. Short sequences are the
hard case: there the terms' own rounding (softmax's backward cancels) exceeds
the summation's, and at ``T = 4`` with 64 examples the summation's allowance
alone missed key elements (:data:`~cockpit_gradnoise.extensions.sums.TERM_ROUNDING`).
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    cost_model,
)
from cockpit_gradnoise.extensions import sums as sums_module

import numpy
import pytest
import torch
import torch.nn.functional as F
from backpack import backpack, extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.helpers import RTOL, assert_statistics_match, rows, sd_rtol
from tests.models import TokenCrossEntropy

WIDTH, VOCABULARY = 8, 11
#: (examples, sequence length)
SHAPES = [(6, 7), (64, 4)]
LEVELS = (0.1, 0.5, 0.9)


def conv1d(inputs, outputs):
    """Hugging Face's ``Conv1D`` (GPT-2's projections: ``x @ W + b``, ``W`` stored ``[in, out]``)."""
    from transformers.pytorch_utils import Conv1D

    return Conv1D(outputs, inputs)


class FusedBlock(nn.Module):
    """nanoGPT's attention: one ``c_attn`` with bias ``[q | k | v]``, a ``Linear`` or,
    as in GPT-2, a ``Conv1D``."""

    def __init__(self, layer=nn.Linear):
        super().__init__()
        self.c_attn, self.c_proj = layer(WIDTH, 3 * WIDTH), layer(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        q, k, v = (z.view(*z.shape[:2], 2, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.c_proj(y.transpose(1, 2).reshape(x.shape))


class Converted(nn.Module):
    """``nn.MultiheadAttention``, converted: the key third of ``attn.in_proj_bias``."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

    def forward(self, x):
        return x + self.attn(x, x, x, need_weights=False)[0]


class Model(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.wte = nn.Embedding(VOCABULARY, WIDTH)
        self.block = block
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, idx):
        return self.head(torch.tanh(self.block(self.wte(idx))))


# (model, {parameter: its elements whose gradient is structurally zero})
CASES = {
    "fused-c_attn": (lambda: Model(FusedBlock()), {"block.c_attn.bias": slice(WIDTH, 2 * WIDTH)}),
    "hf-conv1d-c_attn": (
        lambda: Model(FusedBlock(conv1d)), {"block.c_attn.bias": slice(WIDTH, 2 * WIDTH)},
    ),
    "multihead-attention": (
        lambda: cgn.convert_attention(Model(Converted())),
        {"block.attn.in_proj_bias": slice(WIDTH, 2 * WIDTH)},
    ),
}


def problem(name, dtype, shape):
    make, zeros = CASES[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    idx = torch.randint(0, VOCABULARY, shape)
    targets = torch.randint(0, VOCABULARY, shape)
    return model, idx, targets, zeros


def saved_sums(model, idx, targets, reduction):
    model = extend(copy.deepcopy(model))
    loss = extend(TokenCrossEntropy(reduction))(model(idx), targets)
    with backpack(SumsOfContributions()):
        loss.backward()
    return {name: getattr(p, SUMS_SAVEFIELD) for name, p in model.named_parameters()}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_key_bias_sums_are_exactly_zero_and_nothing_else_is(name, dtype, reduction, shape):
    model, idx, targets, zeros = problem(name, dtype, shape)
    sums = saved_sums(model, idx, targets, reduction)
    for param, where in zeros.items():
        assert torch.equal(sums[param][:, where], torch.zeros_like(sums[param][:, where]))
        # What it was: rounding noise, not zero.
        assert model.get_parameter(param).grad is None
        rest = torch.ones(sums[param].shape[1], dtype=torch.bool)
        rest[where] = False
        assert (sums[param][1, rest] > 0).all()
    for param, value in sums.items():
        if param not in zeros:
            assert (value[1] > 0).any(), param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_bias_is_exactly_zero_with_magnitudes_summed_in_chunks(dtype, monkeypatch):
    """On the host the magnitudes ``A_i`` are summed over chunks of examples
    (``sums.summed_magnitudes``, of ``cost_model.HOST_FORMATION_BYTES``; 3 of the 64 examples
    a chunk here): each example's as a float64 sum gives it, and the key bias still exactly 0."""
    per_position = torch.randn(7, 5, 3, dtype=dtype)
    monkeypatch.setattr(cost_model, "HOST_FORMATION_BYTES", 2 * 5 * 3 * per_position.element_size())
    chunked = sums_module.summed_magnitudes(per_position, 1)
    # Five terms of one sign each: at most 4 roundings of the float32 (float64) sum.
    reference = per_position.double().abs().sum(1)
    assert chunked.shape == reference.shape
    assert torch.allclose(chunked.double(), reference, rtol=4 * torch.finfo(dtype).eps, atol=0)
    model, idx, targets, zeros = problem("fused-c_attn", dtype, SHAPES[1])
    monkeypatch.setattr(cost_model, "HOST_FORMATION_BYTES", 3 * SHAPES[1][1] * 3 * WIDTH * torch.finfo(dtype).bits // 8)
    found = saved_sums(model, idx, targets, "mean")
    for param, where in zeros.items():
        assert torch.equal(found[param][:, where], torch.zeros_like(found[param][:, where]))
        rest = torch.ones(found[param].shape[1], dtype=torch.bool)
        rest[where] = False
        assert (found[param][1, rest] > 0).all()


def test_key_bias_gradient_was_rounding_noise():
    """The case shows what it guards against: autograd's key-bias gradient is not 0."""
    model, idx, targets, zeros = problem("fused-c_attn", torch.float64, SHAPES[0])
    TokenCrossEntropy("mean")(model(idx), targets).backward()
    noise = model.block.c_attn.bias.grad[WIDTH : 2 * WIDTH]
    assert noise.abs().max() > 0
    assert noise.abs().max() < 1e-14 * model.block.c_attn.bias.grad.abs().max()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CASES))
def test_statistics_against_a_reference_that_knows_the_key_bias_is_zero(name, reduction, shape):
    model, idx, targets, zeros = problem(name, torch.float64, shape)
    n, length = shape
    tracked = extend(copy.deepcopy(model))
    loss_fn = extend(TokenCrossEntropy(reduction))
    quantity = cgn.GradientVarianceQuantiles(linear(1), quantiles=LEVELS, param_names=tracked)
    cockpit = cgn.Cockpit(list(tracked.parameters()), quantities=[quantity])
    logits = tracked(idx)
    loss = loss_fn(logits, targets)
    per_example = TokenCrossEntropy("none", per_token=reduction)
    with cockpit(0, info={"loss": loss, "individual_losses": per_example(logits, targets)}):
        loss.backward()
    got = rows(cockpit, "GradientVarianceQuantiles")

    grads = references.per_example_gradients(model, per_example, idx, targets)
    for param, where in zeros.items():
        grads[param][:, where] = 0.0  # exactly, as the exact gradient is
    expected = references.gradient_variance_quantiles(
        model, per_example, idx, targets, reduction=reduction, quantiles=LEVELS, gradients=grads
    )
    for param in zeros:
        # Left out of the SNR as 0 / 0 (the converted key bias: every element).
        if zeros[param] == slice(None):
            assert got[param] == {"q0.1": 0.0, "q0.5": 0.0, "q0.9": 0.0, "mean": 0.0}
    scale = 1 / n if reduction == "mean" else 1.0
    contributions = {key: g * scale for key, g in grads.items()}

    def rtol_of(param, statistic):
        if zeros.get(param) == slice(None):
            return RTOL  # every element exactly 0: compared exactly, in effect
        return sd_rtol(contributions, n, param, inner_terms=length)

    assert_statistics_match(got, expected, rtol_of=rtol_of)


def test_param_grad_ratio_reads_param_grad_whose_key_bias_keeps_its_noise():
    """ParamGradRatio describes ``param.grad`` as the optimizer gets it (the decision
    in ``docs/param-grad-ratio.md``): the key third's rounding noise counts as nonzero
    gradient, its ratios set ``max``, while GradientVarianceQuantiles in the same step
    reads exact zeros there."""
    model, idx, targets, zeros = problem("fused-c_attn", torch.float64, SHAPES[1])
    tracked = extend(copy.deepcopy(model))
    loss_fn = extend(TokenCrossEntropy("mean"))
    names = [n for n, _ in tracked.named_parameters()]
    ratio = cgn.ParamGradRatio(linear(1), param_names=names)
    variance = cgn.GradientVarianceQuantiles(linear(1), quantiles=LEVELS, param_names=names)
    cockpit = cgn.Cockpit(list(tracked.parameters()), quantities=[ratio, variance])
    seen = {}
    logits = tracked(idx)
    loss = loss_fn(logits, targets)
    per_example = TokenCrossEntropy("none", per_token="mean")(logits, targets)
    with cockpit(0, info={"loss": loss, "individual_losses": per_example}):
        loss.backward()
        for param, where in zeros.items():
            seen[param] = getattr(tracked.get_parameter(param), SUMS_SAVEFIELD)[:, where].clone()
    got = rows(cockpit, "ParamGradRatio")
    for param, where in zeros.items():
        # GradientVarianceQuantiles' sums are exact zeros there; param.grad is noise.
        assert torch.equal(seen[param], torch.zeros_like(seen[param]))
        p = tracked.get_parameter(param)
        grad, theta = p.grad.detach(), p.detach()
        noise = grad[where]
        assert (noise != 0).any() and noise.abs().max() < 1e-14 * grad.abs().max()
        nonzero = grad != 0
        ratios = (theta.abs() / grad.abs())[nonzero].numpy()
        expected = {
            "mean": ratios.mean(), "median": numpy.median(ratios), "min": ratios.min(),
            "max": ratios.max(), "zero_grad_fraction": 1 - nonzero.double().mean().item(),
            "norm_ratio": (theta.norm() / grad.norm()).item(),
        }
        assert got[param] == pytest.approx(expected, rel=1e-12)
        # The largest ratio is a key element's, far above every query and value element's.
        rest = torch.ones_like(nonzero)
        rest[where] = False
        assert got[param]["max"] > 1e10 * (theta.abs() / grad.abs())[rest].max().item()


def fallback_sums(model, inputs, targets, reduction="mean"):
    """``{name: [T, S]}`` and the gradients of a model prepared as the front door prepares it
    (the torch.func fallback on the modules that need it)."""
    model = cgn.prepare_model(model)
    loss = extend(nn.CrossEntropyLoss(reduction=reduction))(model(inputs), targets)
    with backpack(SumsOfContributions(), PerExampleSquaredNorms()):
        loss.backward()
    return {name: getattr(p, SUMS_SAVEFIELD) for name, p in model.named_parameters()}, model


@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swin_key_bias_through_the_fallback_is_exactly_zero(dtype, reduction, n):
    """torchvision's ``ShiftedWindowAttention`` adds ``qkv.bias`` in ``F.linear`` (on windows,
    the attention is its own block, recomputed per example at this first tracked step, that
    call's output the layer's: ``block_biases``): its key third is zero by structure, as a fused
    ``c_attn``'s, and comes out as exact zeros; its query and value thirds and ``proj.bias`` do not."""
    from tests.matrix_models import SWIN_WIDTH, torchvision_swin

    torch.manual_seed(0)
    model = torchvision_swin().to(dtype)
    inputs, targets = torch.randn(n, 3, 16, 16, dtype=dtype), torch.randint(0, 3, (n,))
    sums, prepared = fallback_sums(model, inputs, targets, reduction)
    key = slice(SWIN_WIDTH, 2 * SWIN_WIDTH)
    biases = [name for name in sums if name.endswith("attn.qkv.bias")]
    assert len(biases) == 2
    for name in biases:
        assert torch.equal(sums[name][:, key], torch.zeros_like(sums[name][:, key]))
        rest = torch.ones(3 * SWIN_WIDTH, dtype=torch.bool)
        rest[key] = False
        assert (sums[name][1, rest] > 0).all(), name
        # What it was: rounding noise, not zero.
        grad = prepared.get_parameter(name).grad
        assert (grad[key] != 0).any()
        assert grad[key].abs().max() < 100 * torch.finfo(dtype).eps * grad.abs().max()
    for name, value in sums.items():
        if name not in biases:
            assert (value[1] > 0).all(), name


class BiasUsedTwice(nn.Module):
    """An attention whose key bias is also added elsewhere: there it gets a real gradient,
    which the ``F.linear`` terms alone do not show. Scaled so that it stays below the
    structural-zero test's allowance for the attention's terms (``(L + 1024) eps`` of
    them, about ``1e-13`` relative here), which would otherwise take it for noise."""

    def __init__(self, width=4):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.randn(3 * width, width) / width**0.5)
        self.bias = nn.Parameter(torch.randn(3 * width))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        q, k, v = F.linear(x, self.weight, self.bias).split(self.width, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.head((y + 1e-14 * self.bias[self.width : 2 * self.width]).mean(1))


class KeyBiasOnly(BiasUsedTwice):
    def forward(self, x):
        q, k, v = F.linear(x, self.weight, self.bias).split(self.width, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(1))


class ScaledInPlace(BiasUsedTwice):
    """``F.linear``'s output scaled in place through a view and back: the gradient at the
    changed tensor is no longer the terms of the bias's contributions (1e14 times them),
    which would take every contribution for noise."""

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        y[..., : 2 * self.width].mul_(1e-14)
        y = y * torch.cat([torch.full((2 * self.width,), 1e14), torch.ones(self.width)]).to(y)
        q, k, v = y.split(self.width, dim=-1)
        return self.head((F.scaled_dot_product_attention(q, k, v) + q).mean(1))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunks-of-2"])
@pytest.mark.parametrize("make, key_is_zero", [
    (KeyBiasOnly, True), (BiasUsedTwice, False), (ScaledInPlace, False)])
def test_fallback_zeros_a_bias_only_where_f_linear_is_its_only_use(make, key_is_zero, chunked,
                                                                   monkeypatch):
    """Also with the examples in chunks (5 = 2 + 2 + 1): a bias's contributions are held
    to the end in every chunk, in the examples' order."""
    if chunked:
        monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: 2)
    torch.manual_seed(0)
    model = make().double()
    inputs, targets = torch.randn(5, 6, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    sums, prepared = fallback_sums(model, inputs, targets)
    key = sums["bias"][:, 4:8]
    assert torch.equal(key, torch.zeros_like(key)) == key_is_zero
    expected = references.per_example_gradients(
        model, nn.CrossEntropyLoss(reduction="none"), inputs, targets)["bias"] / 5
    if key_is_zero:
        expected[:, 4:8] = 0.0
    # Within the rounding of the sums over 5 examples of 6 positions' terms (float64), which
    # for the key elements is that of the attention's terms, of the layer's largest size.
    magnitudes = expected.abs().sum(0)
    bound = 1e-13 * (magnitudes + magnitudes.max())
    assert ((sums["bias"][0] - expected.sum(0)).abs() <= bound).all()
    # | ||x|| - ||y|| | <= ||x - y||_2 <= ||x - y||_1, within the same bound.
    norms = expected.square().sum(0).sqrt()
    assert ((sums["bias"][1].sqrt() - norms).abs() <= bound).all()
    # Per example, in the examples' order: ||x_i|| within the same bound, ||x_i - y_i||_1.
    per_example = getattr(prepared.bias, BATCH_L2_SAVEFIELD).sqrt()
    assert ((per_example - expected.norm(dim=1)).abs() <= bound.sum()).all()
