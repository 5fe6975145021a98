"""The SNR of elements whose examples agree to rounding: at the top, never dropped.

An element with ``sd_j = 0`` (its centred sum at or below the rounding bound)
and ``grad_j != 0`` is the most consistent of its layer. Its SNR counts as
``R = sqrt((N - 1) / ((3N + 4) eps))``
(:func:`~cockpit_gradnoise.functional.resolvable_snr`), the largest any other
element can have; only ``0 / 0`` is left out. The reference here knows by
construction which elements have identical examples (exact ``sd_j = 0``).
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional

import numpy
import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.helpers import rows

N = 16
RTOL = 1e-10


def batch(dtype, seed):
    """Inputs whose feature 0 is one value for every example, feature 3 zero
    for every example; targets that give every example the same output error.

    So every example contributes the same to the bias and to the weight's
    column 0 (sd exactly 0, gradient not 0), nothing to column 3 (``0 / 0``),
    and contributions that differ to columns 1 and 2.
    """
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(N, 4, generator=generator, dtype=torch.float64)
    inputs[:, 0] = 0.75
    inputs[:, 3] = 0.0
    model = nn.Linear(4, 3).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.randn(3, 4, generator=generator))
        model.bias.copy_(torch.randn(3, generator=generator))
    error = torch.tensor([0.5, -1.25, 2.0], dtype=torch.float64)
    targets = inputs @ model.weight.double().T + model.bias.double() - error
    return model, inputs.to(dtype), targets.to(dtype), error


def reference(inputs, error, limit):
    """``{param: statistics}`` from exact contributions: ``x_i = 2 e a_i^T / (3N)``
    for the weight, ``2 e / (3N)`` for the bias (mean squared error over
    ``N * 3`` outputs), in float64; sd of the identical columns exactly 0."""
    a = inputs.double().numpy()
    e = error.numpy()
    c = 2 / (3 * N)
    weight = c * e[None, :, None] * a[:, None, :]  # [N, 3, 4]
    weight[:, :, 0] = c * e[None, :] * 0.75  # identical by construction
    bias = numpy.broadcast_to(c * e, (N, 3))
    contributions = {"weight": weight.reshape(N, -1), "bias": bias}
    contributions[cgn.NETWORK] = numpy.concatenate(list(contributions.values()), axis=1)
    result = {}
    for name, x in contributions.items():
        sd = numpy.sqrt(N / (N - 1) * ((x - x.mean(0)) ** 2).sum(0))
        identical = (x == x[:1]).all(0)
        sd[identical] = 0.0
        grad = x.sum(0)
        defined = (sd > 0) | (grad != 0)
        with numpy.errstate(divide="ignore"):
            snr = numpy.minimum(numpy.abs(grad[defined]) / sd[defined], limit)
        result[name] = {"snr_q0.5": float(numpy.median(snr)), "snr_mean": float(snr.mean()),
                        "identical": int(identical.sum()), "zero_by_zero": int((~defined).sum())}
    return result


def in_dtype(value, dtype):
    """``value`` as the model's dtype holds it (the SNR is in the contributions' dtype)."""
    return torch.tensor(value, dtype=dtype).item()


def tracked(model, inputs, targets):
    model = extend(model)
    loss_fn = extend(nn.MSELoss())
    quantity = cgn.GradientVarianceQuantiles(linear(1), quantiles=(0.5,), param_names=model)
    cockpit = cgn.Cockpit(list(model.parameters()), quantities=[quantity])
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    individual = ((outputs - targets) ** 2).mean(1)
    with cockpit(0, info={"loss": loss, "individual_losses": individual, "batch_size": N}):
        loss.backward()
    return rows(cockpit, "GradientVarianceQuantiles")


def test_the_limit_bounds_every_kept_snr_and_is_reached_by_identical_examples():
    """``R`` from the rounding bound: the examples' spread that the bound keeps
    (a centred sum just above ``(3N + 4) eps S``) has an SNR just below ``R``."""
    for dtype in (torch.float32, torch.float64):
        limit = functional.resolvable_snr(N, dtype)
        eps = torch.finfo(dtype).eps
        assert limit == pytest.approx(math.sqrt((N - 1) / ((3 * N + 4) * eps)), rel=1e-15)
        generator = torch.Generator().manual_seed(0)
        spread = torch.logspace(-9, 0, 400, dtype=torch.float64)
        x = (1 + spread[None, :] * torch.randn(N, 400, generator=generator, dtype=torch.float64))
        x = x.to(dtype)
        sd = functional.gradient_sd(x.pow(2).sum(0), x.sum(0), N)
        snr = functional.signal_to_noise(x.sum(0), sd, limit)
        kept = sd > 0
        assert (~kept).any() and kept.any(), "the spreads must reach the bound from both sides"
        assert (snr[~kept] == limit).all()
        assert (x.sum(0).abs()[kept] / sd[kept] < limit).all()
        # Just above the bound the SNR approaches R: within a factor 2 of it.
        assert snr[kept].max() > limit / 2


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_consistent_elements_count_at_the_limit_and_zero_by_zero_is_left_out(dtype, seed):
    model, inputs, targets, error = batch(dtype, seed)
    limit = in_dtype(functional.resolvable_snr(N, dtype), dtype)
    expected = reference(inputs, error, limit)
    got = tracked(model, inputs, targets)
    assert expected["bias"]["identical"] == 3 and expected["weight"]["identical"] == 6
    assert expected["weight"]["zero_by_zero"] == 3
    assert got["bias"]["q0.5"] == 0.0
    # Every bias element is at the limit: median and mean are the limit.
    assert got["bias"]["snr_q0.5"] == limit
    assert got["bias"]["snr_mean"] == pytest.approx(limit, rel=RTOL, abs=0)
    # The weight's median falls among elements that differ: the exact value
    # (float32 contributions: their SNR, below 10, to float32's rounding).
    rtol = RTOL if dtype == torch.float64 else 64 * N * torch.finfo(dtype).eps
    for name in ("weight", cgn.NETWORK):
        for statistic in ("snr_q0.5", "snr_mean"):
            assert got[name][statistic] == pytest.approx(
                expected[name][statistic], rel=rtol
            ), (name, statistic)
    # Before: the consistent elements were dropped, a median of the rest.
    assert got[cgn.NETWORK]["snr_mean"] > limit / 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identical_examples_give_the_limit_everywhere_but_zero_by_zero(dtype):
    model, inputs, targets, _ = batch(dtype, 0)
    inputs, targets = inputs[:1].repeat(N, 1), targets[:1].repeat(N, 1)
    got = tracked(model, inputs, targets)
    limit = in_dtype(functional.resolvable_snr(N, dtype), dtype)
    for name, statistics in got.items():
        assert statistics["q0.5"] == 0.0 and statistics["mean"] == 0.0, name
        assert statistics["snr_q0.5"] == limit, name
        # The mean adds the copies of the limit in float64.
        assert statistics["snr_mean"] == pytest.approx(limit, rel=RTOL, abs=0), name
