"""The squares' scale and marks in fewer launches (issue 32): what each shortcut must keep.

``extensions/_squares.py`` unscales by one multiplication with the scale's powers
``(s, 1/s, 1/s**2)`` (float64, looked up with the scale), and on other devices marks a
squared norm of 0 beside nonzero rows of every factor inside ``unscaled_norms``, from the
rows' magnitudes the scale was taken from (``Scale.rows``), instead of again in
``exact_where_lost``. These tests fail where a rule forgets the rows, where a power is off,
or where a product of two factors' scales leaves float32's range.
"""

import math

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import _squares, conv_math, cost_model, linear
from cockpit_gradnoise.extensions.fallback import reduce
from cockpit_gradnoise.functional.underflow import UNRESOLVED

import pytest
import torch
from torch import nn

EPS32 = 2.0**-24
TINY = 2.0**-70  # an example's rows times this in two factors: x_i ~ 2**-140, whose squares float32 loses


def _factors(*shapes, seed=0):
    """float32 factors ``[4, ...]``: example 1 tiny in every factor (its norm underflows at the
    scale of the others: ``x_1 ~ 2**-140`` of two factors, ``2**-80`` of contributions, squares
    below float32's smallest ``2**-149``), example 2 zero in the first factor (x_2 = 0 exactly)."""
    generator = torch.Generator().manual_seed(seed)
    factors = [torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in shapes]
    for factor in factors:
        factor[1] *= TINY if len(factors) > 1 else 2.0**-80
    factors[0][2] = 0.0
    return [factor.float() for factor in factors]


def _conv():
    torch.manual_seed(0)
    return nn.Conv2d(2, 3, 3)


def _rule_norms(rule, factors):
    """The squared norms ``[4]`` of ``rule`` on ``factors``, as the extensions form them."""
    if rule == "outer product":
        return linear.exact(linear._outer_product_squared_norms, "n", *factors)
    if rule in ("gram", "formation"):
        return linear.exact(linear.linear_weight_squared_norms, "n", *factors)
    if rule == "sums and norms":
        return linear.exact(linear.linear_weight_sums_and_squared_norms, "sn", *factors)[1]
    if rule == "convolution":
        module = _conv()
        return _squares.exact_where_lost(lambda i, g: conv_math.weight_squared_norms(module, i, g), "n",
                                         4, module.weight.numel(), *factors)
    if rule == "contributions":
        return _squares.squared_norms_of(factors[0])
    return reduce.norms_and_sums(factors[0])[0]  # the fallback's contributions


SHAPES = {
    "outer product": [(4, 5), (4, 3)],  # inputs [N, in], output gradients [N, out]
    "gram": [(4, 6, 5), (4, 6, 3)],
    "formation": [(4, 6, 5), (4, 6, 3)],
    "sums and norms": [(4, 6, 5), (4, 6, 3)],
    "convolution": [(4, 2, 5, 5), (4, 3, 3, 3)],
    "contributions": [(4, 3, 5)],
    "fallback": [(4, 3, 5)],
}


def _exact_norms(rule, factors):
    """float64 ``||x_i||^2`` of the same factors, by forming ``x_i``."""
    wide = [factor.double() for factor in factors]
    if rule == "outer product":
        x = wide[1][:, :, None] * wide[0][:, None, :]
    elif rule == "convolution":
        weight = _conv().weight.detach().double().requires_grad_()
        x = torch.stack([torch.autograd.grad((nn.functional.conv2d(wide[0][i:i + 1], weight) * wide[1][i:i + 1])
                                             .sum(), weight)[0] for i in range(4)])
    elif len(wide) == 2:
        x = torch.bmm(wide[1].transpose(1, 2), wide[0])
    else:
        x = wide[0]
    return x.flatten(1).square().sum(1)


@pytest.mark.parametrize("rule", list(SHAPES))
def test_each_float32_norm_rule_marks_a_zero_norm_beside_nonzero_rows_on_other_devices(rule, monkeypatch):
    """On other devices' paths: an example whose rows are nonzero in every factor but whose
    squares underflow at the layer's scale (norm 0) is UNRESOLVED; an example with a zero row
    in a factor (x_i = 0) keeps 0; the others are within float32's rounding of float64's."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    if rule in ("gram", "formation"):
        monkeypatch.setattr(cost_model, "use_formation", lambda *args, rule=rule: rule == "formation")
    factors = _factors(*SHAPES[rule])
    got, want = _rule_norms(rule, factors), _exact_norms(rule, factors)
    assert got.dtype == torch.float64
    assert got[1].item() == UNRESOLVED and want[1].item() > 0, "the case must underflow at the scale"
    assert got[2].item() == 0.0 and want[2].item() == 0.0
    # Marked once, by unscaled_norms from the scale's rows (exact_where_lost's own mark would
    # give the same numbers in five launches more).
    assert getattr(got, _squares._ZEROS_MARKED, False)
    for i in (0, 3):
        assert got[i].item() == pytest.approx(want[i].item(), rel=200 * EPS32, abs=0.0)


def test_the_powers_table_holds_each_scale_its_inverse_and_inverse_square():
    """``powers_of_largest`` against ``scales_of_largest`` (itself checked against ``frexp``):
    ``(s, 1/s, 1/s**2)`` exactly, for every power of two float32 holds, 0, NaN and inf."""
    powers = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    values = torch.cat([powers, powers * 1.5, torch.tensor([0.0, math.inf, math.nan])])
    got = _squares.powers_of_largest(values)
    scales = _squares.scales_of_largest(values).double()
    assert got.dtype == torch.float64 and got.shape == (len(values), 3)
    assert torch.equal(got[:, 0], scales)
    assert got[:, 1].tolist() == [1.0 / s for s in scales.tolist()]
    assert got[:, 2].tolist() == [1.0 / (s * s) for s in scales.tolist()]


@pytest.mark.parametrize("exponent", [-125, -3, 0, 60, 127])
def test_unscaling_is_division_by_the_scale_s_powers(exponent):
    """``unscaled_norms`` and ``unscaled_sums`` with a ``Scale`` give ``at_scale / s**2`` and
    ``[T / s, S / s**2, R / s**2]`` in float64 exactly (powers of two), as from a 0-dim scale."""
    s = 2.0**-exponent
    scale = _squares.Scale(_squares.scale_powers(s))
    at_scale = torch.tensor([0.0, 0.75, 3.0, 1e30])
    expected = [v / (s * s) for v in at_scale.double().tolist()]
    assert _squares.unscaled_norms(at_scale, scale, 4).tolist() == expected
    assert _squares.unscaled_norms(at_scale, torch.tensor(s), 4).tolist() == expected
    sums = torch.tensor([[0.5, -3.0], [0.25, 9.0], [1.0, 2.0]])
    for rows in (2, 3):
        got = _squares.unscaled_sums(sums[:rows].clone(), scale, 4)
        assert got.dtype == torch.float64
        wide = sums[:rows].double().tolist()
        assert got.tolist() == [[v / s ** min(k + 1, 2) for v in row] for k, row in enumerate(wide)]


@pytest.mark.parametrize("on_host", [True, False])
def test_two_tiny_factors_keep_exact_norms_and_sums(on_host, monkeypatch):
    """Inputs and output gradients both ``~2**-70``: each factor's scale is ``2**70``, their
    product ``2**140`` is beyond float32's range. In float64 it is exact, so the norms and the
    sums of ``x_i = g_i a_i^T`` (``~2**-140``, below float32's range) are float64's to float32's
    rounding (before: the float32 product was inf, and both came out 0)."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: on_host)
    generator = torch.Generator().manual_seed(1)
    inputs, grad_output = (torch.randn(4, n, generator=generator, dtype=torch.float64) * TINY for n in (5, 3))
    x = grad_output[:, :, None] * inputs[:, None, :]
    norms = linear.exact(linear._outer_product_squared_norms, "n", inputs.float(), grad_output.float())
    sums = linear.exact(linear.linear_weight_sums, "s", inputs.float(), grad_output.float())
    assert torch.allclose(norms, x.flatten(1).square().sum(1), rtol=16 * EPS32, atol=0.0)
    assert torch.allclose(sums[1], x.square().sum(0), rtol=16 * EPS32, atol=0.0)
    assert torch.allclose(sums[0], x.sum(0), rtol=0.0, atol=16 * EPS32 * x.abs().sum(0).max().item())


def test_two_parameters_norms_together_are_each_alone_at_its_own_scale(monkeypatch):
    """``squared_norms_of_many`` on other devices (a LayerNorm's scale and shift, one pass): each
    parameter at its own scale (the second is ``2**-100`` times the first: one shared scale would
    lose its squares), its own marks (example 1 underflows in the first: UNRESOLVED; example 2
    is 0: kept), within float32's rounding of float64's elsewhere, as each alone gives."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randn(4, 6, generator=generator, dtype=torch.float64) for _ in range(2))
    first[1] *= 2.0**-80
    first[2] = 0.0
    second *= 2.0**-100
    together = _squares.squared_norms_of_many([first.float(), second.float()])
    for got, x in zip(together, (first, second)):
        alone, want = _squares.squared_norms_of(x.float()), x.float().double().square().sum(1)
        assert got.dtype == torch.float64 and got.shape == (4,)
        for i in range(4):
            if x is first and i == 1:
                assert got[i].item() == alone[i].item() == UNRESOLVED
            else:
                assert got[i].item() == pytest.approx(want[i].item(), rel=8 * EPS32, abs=0.0)
                assert alone[i].item() == pytest.approx(want[i].item(), rel=8 * EPS32, abs=0.0)
