"""The device paths' quantiles do not depend on where ``torch.sort`` puts NaN.

CUDA's radix sort orders a float by its bits: a NaN whose sign bit is set sorts
before ``-inf``. On an H200 that made GradientVarianceQuantiles' SNR median (its
left-out elements are ``0 / 0``) come out low, while the CPU's sort puts every
NaN last. Here ``torch.sort`` is replaced by such a bit-order sort, on the CPU.
"""

import math

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.functional.ratios import abs_ratio_statistics
from cockpit_gradnoise.logs import schema

import numpy
import pytest
import torch

NEGATIVE_NAN = torch.tensor([-0x8000000000000000 + 0x7FF8000000000000]).view(torch.float64).item()


def sort_by_bits(tensor, *args, **kwargs):
    """``torch.sort`` as a radix sort of the float64 bits orders: -NaN < -inf < ... < inf < NaN."""
    assert tensor.dtype == torch.float64 and not args and not kwargs
    bits = tensor.view(torch.int64)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    order = torch.argsort(key, stable=True)
    return torch.return_types.sort((tensor[order], order))


@pytest.fixture
def bit_order_sort_on_device(monkeypatch):
    monkeypatch.setattr(torch, "sort", sort_by_bits)
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)


def values_with_left_out(seed=0, size=101, left_out=37):
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(size, generator=generator, dtype=torch.float64)
    values[torch.randperm(size, generator=generator)[:left_out]] = NEGATIVE_NAN
    return values


def test_the_bit_order_sort_puts_a_negative_nan_first():
    """The replacement does what CUDA's radix sort does (else the tests below could not fail)."""
    ordered = sort_by_bits(torch.tensor([1.0, NEGATIVE_NAN, -math.inf, math.nan], dtype=torch.float64)).values
    assert math.isnan(ordered[0]) and ordered[1] == -math.inf and ordered[2] == 1.0 and math.isnan(ordered[3])


def test_kept_quantiles_leave_every_nan_out(bit_order_sort_on_device):
    values = values_with_left_out()
    kept_values = values[~values.isnan()].numpy()
    kept, summary = order_statistics.kept_quantile_summary([values[:50], values[50:]], (0.0, 0.5, 1.0))
    assert int(kept) == len(kept_values) == 64
    expected = list(numpy.quantile(kept_values, [0.0, 0.5, 1.0])) + [kept_values.mean()]
    assert [float(v) for v in summary] == pytest.approx(expected, rel=1e-15)


def test_sorted_on_device_puts_every_nan_last_and_keeps_infinities(bit_order_sort_on_device):
    values = torch.cat([values_with_left_out(size=20, left_out=5),
                        torch.tensor([math.inf, -math.inf, math.nan], dtype=torch.float64)])
    ordered = order_statistics.sorted_on_device([values])
    finite = values[~values.isnan()]
    assert ordered[: finite.numel()].tolist() == sorted(finite.tolist())
    assert ordered[finite.numel():].isnan().all() and ordered[finite.numel():].numel() == 6


def test_a_nan_is_still_an_error_where_the_quantiles_refuse_it(bit_order_sort_on_device):
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.quantile_summary(values_with_left_out(left_out=1), (0.5,))


def test_ratio_statistics_leave_the_zero_gradients_out(bit_order_sort_on_device):
    generator = torch.Generator().manual_seed(1)
    theta = torch.randn(64, generator=generator, dtype=torch.float64)
    grad = torch.randn(64, generator=generator, dtype=torch.float64)
    grad[::3] = 0.0
    stats = abs_ratio_statistics(theta, grad)
    kept = (theta.abs() / grad.abs())[grad != 0].numpy()
    assert stats[schema.MEDIAN] == pytest.approx(numpy.median(kept), rel=1e-15)
    assert stats[schema.MIN] == pytest.approx(kept.min(), rel=1e-15)
    assert stats[schema.MAX] == pytest.approx(kept.max(), rel=1e-15)
