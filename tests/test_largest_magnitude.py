"""``_squares.largest_magnitude`` on the CPU (``aminmax``) against ``abs().max()``: the
largest magnitude negative or positive, strided, NaN and infinities as the inf-norm gives them."""

import math

from cockpit_gradnoise.extensions import _squares
from cockpit_gradnoise.extensions._squares import largest_magnitude

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_magnitude_of_either_sign_in_a_strided_tensor(dtype, sign):
    values = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    values[3, 17] = sign * 7.5  # the largest magnitude, positive or negative
    strided = values.T[::2]
    assert not strided.is_contiguous()
    for tensor in (values, strided):
        result = largest_magnitude(tensor)
        assert result.dtype == dtype and result.dim() == 0
        assert result.item() == tensor.abs().max().item()
    assert largest_magnitude(values).item() == 7.5


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_a_nan_or_an_infinity_is_what_the_inf_norm_gives(special):
    values = torch.randn(50, generator=torch.Generator().manual_seed(1))
    values[20] = special
    expected = torch.linalg.vector_norm(values, math.inf).item()
    result = largest_magnitude(values).item()
    assert (math.isnan(result) and math.isnan(expected)) or result == expected == math.inf


def test_zeros_give_zero():
    assert largest_magnitude(torch.tensor([0.0, -0.0])).item() == 0.0


@pytest.mark.parametrize("rest", [1.0, 1e-30, math.nan], ids=["large", "tiny", "nan"])
@pytest.mark.parametrize("first", [1.0, 1e-30, 0.0, math.nan], ids=["large", "tiny", "zero", "nan"])
def test_on_the_host_the_first_rows_decide_scaling_as_the_whole_factors_do(first, rest, monkeypatch):
    """``scaled_factors`` on the host decides from the factors' first rows where they suffice
    (``_squares._unscaled_by_first_rows``): the same decision, the same scale and factors, as
    from the whole factors; here the first example's row of ``g`` against the others'."""
    g = torch.full((4, 3, 5), rest)
    g[0] = first
    a = torch.full((4, 3, 2), 1e-6)  # scale 2**20: g of 1 leaves the layer unscaled, g of 1e-30 not
    shortcut, shortcut_scale = _squares.scaled_factors(g, a, rows=True)
    monkeypatch.setattr(_squares, "_unscaled_by_first_rows", lambda factors: False)
    whole, whole_scale = _squares.scaled_factors(g, a, rows=True)
    assert (shortcut_scale is None) == (whole_scale is None)
    if whole_scale is not None:
        assert torch.equal(shortcut_scale.powers, whole_scale.powers)
    for mine, theirs in zip(shortcut, whole):
        assert torch.equal(mine.nan_to_num(7.0), theirs.nan_to_num(7.0))
    # The cases the shortcut meets: a large first row decides at once; a tiny one reads the rest.
    assert (whole_scale is None) == (first == 1.0 or rest == 1.0 or math.isnan(rest) or math.isnan(first))
