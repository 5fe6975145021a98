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
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions

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
