"""``_squares.largest_magnitude`` on the CPU (``aminmax``) against ``abs().max()``: the
largest magnitude negative or positive, strided, NaN and infinities as the inf-norm gives them."""

import math

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
