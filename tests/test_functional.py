"""The pure formulas, each against NumPy or a two-pass computation."""

import math

from cockpit_gradnoise import _device, functional, order_statistics
from cockpit_gradnoise.functional.norms import NUMPY_NORM_AT_MOST

import numpy
import pytest
import torch


@pytest.mark.parametrize("n", [2, 7, 64])
def test_gradient_sd_matches_two_pass(n):
    torch.manual_seed(n)
    contributions = torch.randn(n, 30, dtype=torch.float64)
    got = functional.gradient_sd(contributions.pow(2).sum(0), contributions.sum(0), n)
    centred = contributions - contributions.mean(0)
    expected = (n / (n - 1) * centred.pow(2).sum(0)).sqrt()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 7, 64, 128])
def test_gradient_sd_is_exactly_zero_for_identical_examples(n, dtype):
    """Equal contributions give sd 0, not rounding noise (SNR would explode)."""
    torch.manual_seed(0)
    row = torch.randn(1000, dtype=dtype) * 10.0 ** torch.randint(-6, 6, (1000,))
    # the same value, rounded the way a per-example computation rounds it
    offsets = (torch.arange(n * 1000).reshape(n, 1000) % 3 - 1).to(dtype)
    contributions = row * (1 + offsets * torch.finfo(dtype).eps)
    sum_of_squares = contributions.pow(2).sum(0)
    total = contributions.sum(0)
    naive = sum_of_squares - total.square() / n
    assert (naive != 0).any(), "the case must show the rounding noise it guards against"
    sd = functional.gradient_sd(sum_of_squares, total, n)
    assert torch.equal(sd, torch.zeros_like(sd))


def test_gradient_sd_keeps_real_spread_in_float32():
    """The rounding threshold does not swallow a 1% spread between examples."""
    n = 64
    torch.manual_seed(1)
    contributions = 1 + 0.01 * torch.randn(n, 500)
    sd = functional.gradient_sd(contributions.pow(2).sum(0), contributions.sum(0), n)
    double = contributions.double()
    expected = (n / (n - 1) * (double - double.mean(0)).pow(2).sum(0)).sqrt()
    torch.testing.assert_close(sd.double(), expected, rtol=2e-2, atol=0)
    assert (sd > 0).all()


def test_gradient_sd_needs_two_examples():
    with pytest.raises(ValueError, match="at least 2"):
        functional.gradient_sd(torch.ones(3), torch.ones(3), 1)


def test_signal_to_noise_without_limit_skips_zero_sd():
    grad = torch.tensor([1.0, -2.0, 3.0])
    sd = torch.tensor([0.5, 0.0, 3.0])
    assert functional.signal_to_noise(grad, sd).tolist() == [2.0, 1.0]
    assert functional.signal_to_noise(grad, torch.zeros(3)).numel() == 0


def test_signal_to_noise_with_limit_puts_zero_sd_at_the_limit_and_leaves_out_zero_by_zero():
    grad = torch.tensor([1.0, -2.0, 3.0, 0.0, 0.0, 50.0])
    sd = torch.tensor([0.5, 0.0, 3.0, 0.0, 2.0, 1.0])
    assert functional.signal_to_noise(grad, sd, 10.0).tolist() == [2.0, 10.0, 1.0, 0.0, 10.0]


def test_loss_scale_tells_mean_from_sum():
    losses = torch.tensor([0.5, 1.0, 2.5])
    assert functional.loss_scale(losses.mean(), losses) == pytest.approx(1 / 3)
    assert functional.loss_scale(losses.sum(), losses) == 1.0
    assert functional.loss_scale(losses[:1].sum(), losses[:1]) == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_loss_scale_allows_the_rounding_of_the_losses_dtype(dtype):
    torch.manual_seed(0)
    exact = torch.rand(64, dtype=torch.float64) + 1
    losses = exact.to(dtype)
    # The loss rounded from the float64 mean: within half an ulp of its dtype,
    # where the per-example losses are off by as much each.
    mean = exact.mean().to(dtype)
    assert functional.loss_scale(mean, losses) == pytest.approx(1 / 64)
    assert functional.loss_scale(exact.sum().to(dtype), losses) == 1.0
    # Ten ulps off, or the mean of other losses, is another loss.
    eps = torch.finfo(dtype).eps
    off = (exact.mean() * (1 + 10 * max(eps, 1e-4))).to(dtype)
    with pytest.raises(ValueError, match="neither the mean"):
        functional.loss_scale(off, losses)


def test_loss_scale_refuses_other_losses():
    losses = torch.tensor([0.5, 1.0, 2.5])
    with pytest.raises(ValueError, match="neither the mean"):
        functional.loss_scale(losses.max(), losses)
    with pytest.raises(ValueError, match="one loss per example"):
        functional.loss_scale(losses.sum(), losses.reshape(3, 1))


def test_per_example_norm_statistics():
    squared = torch.tensor([9.0, 16.0, 0.0, 1.0], dtype=torch.float64)
    stats = functional.per_example_norm_statistics(squared, (0.5,))
    norms = numpy.array([3.0, 4.0, 0.0, 1.0])
    assert stats == {"q0.5": numpy.quantile(norms, 0.5), "mean": 2.0, "max": 4.0}
    assert not any(math.isnan(v) for v in stats.values())


def test_gradient_sd_in_place_equals_copy():
    torch.manual_seed(3)
    contributions = torch.randn(5, 40)
    sum_of_squares, total = contributions.pow(2).sum(0), contributions.sum(0)
    expected = functional.gradient_sd(sum_of_squares, total, 5)
    got = functional.gradient_sd(sum_of_squares, total, 5, in_place=True)
    assert got.data_ptr() == sum_of_squares.data_ptr()
    assert torch.equal(got, expected)


def test_signal_to_noise_on_other_devices_marks_zero_sd_nan(monkeypatch):
    """No size that depends on the data there (it would make the host wait)."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    snr = functional.signal_to_noise(torch.tensor([1.0, -2.0, 0.0]), torch.tensor([0.5, 0.0, 0.0]))
    assert snr[0] == 2.0 and snr[1:].isnan().all()
    capped = functional.signal_to_noise(
        torch.tensor([1.0, -2.0, 0.0, 50.0]), torch.tensor([0.5, 0.0, 0.0, 1.0]), 10.0
    )
    assert capped[[0, 1, 3]].tolist() == [2.0, 10.0, 10.0] and capped[2].isnan()


def test_sd_statistics_of_a_union_equal_numpy_on_the_joined_values(paths):
    """Layers' sd and SNR as parts of the network's: quantiles bit for bit."""
    torch.manual_seed(0)
    sds = [torch.rand(n) * (torch.rand(n) > 0.2) for n in (3, 70_000, 1)]
    snrs = [functional.signal_to_noise(torch.randn(sd.shape), sd) for sd in sds]
    levels = (0.05, 0.5, 0.95)
    got = functional.sd_statistics(sds, snrs, levels)
    sd, snr = (numpy.concatenate(ts).astype(numpy.float64) for ts in (sds, snrs))
    snr = snr[~numpy.isnan(snr)]  # left out on other devices
    assert [got[f"q{q:g}"] for q in levels] == numpy.quantile(sd, levels).tolist()
    assert got["snr_q0.5"] == numpy.quantile(snr, 0.5)
    assert got["mean"] == pytest.approx(sd.mean(), rel=1e-12)
    assert got["snr_mean"] == pytest.approx(snr.mean(), rel=1e-12)
    # Joined: the same quantiles; the means' float64 sums add in another order
    # (pieces of another size), within (n - 1) 2**-53 relative of each other.
    joined = functional.sd_statistics(torch.cat(sds), torch.cat(snrs), levels)
    assert set(joined) == set(got)
    for name, value in joined.items():
        tolerance = 0 if name.startswith(("q", "snr_q")) else 2 * sd.size * 2.0**-53
        assert got[name] == pytest.approx(value, rel=tolerance, abs=0), name
    no_snr = functional.sd_statistics([torch.zeros(4)], [torch.zeros(0)], levels)
    assert set(no_snr) == {"q0.05", "q0.5", "q0.95", "mean"}


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 2 * order_statistics.SORT_WHOLE_AT_MOST + 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_abs_ratio_statistics_equal_numpy_on_the_kept_ratios(n, dtype, paths):
    """Median and extremes bit for bit, with ties, zeros on both sides, ratios
    too large for the dtype (inf) and non-finite elements left out."""
    generator = torch.Generator().manual_seed(n)
    theta = torch.randn(n, generator=generator, dtype=dtype).round(decimals=1)
    grad = torch.randn(n, generator=generator, dtype=dtype).round(decimals=2)
    if n > 2:
        theta[0], grad[0] = torch.finfo(dtype).max, torch.finfo(dtype).tiny  # inf ratio
        theta[1] = math.nan
        grad[2] = math.inf
    keep = torch.isfinite(theta) & torch.isfinite(grad) & (grad != 0)
    ratio = (theta[keep] / grad[keep]).abs().double().numpy()
    got = functional.abs_ratio_statistics(theta, grad)
    if ratio.size == 0:
        assert got == {}
        return
    assert got["median"] == numpy.median(ratio)
    assert (got["min"], got["max"]) == (ratio.min(), ratio.max())
    assert got["mean"] == pytest.approx(ratio.mean(), rel=1e-12)


def test_float64_sums_by_pieces_on_either_path(paths, monkeypatch):
    """Pieces of a few elements (a buffer reused for each): the float64 sums
    and squared norms of all of them, within ``n 2**-53`` of the exact ones."""
    monkeypatch.setattr(_device, "CHUNK", 7)
    monkeypatch.setattr(_device, "DEVICE_CHUNK", 7)
    values = torch.randn(50, generator=torch.Generator().manual_seed(0))
    values[3] = math.nan
    finite = values.nan_to_num()
    exact = math.fsum(finite.double().tolist())
    bound = 50 * 2.0**-53 * finite.abs().sum().item()
    assert abs(_device.float64_total(values, skip_nan=True).item() - exact) <= bound
    squares = math.fsum((finite.double() ** 2).tolist())
    assert abs(functional.squared_norm(finite) - squares) <= 50 * 2.0**-53 * squares
    assert math.isnan(_device.float64_total(values).item())


@pytest.mark.parametrize("numel", [1, 128, NUMPY_NORM_AT_MOST,
                                   NUMPY_NORM_AT_MOST + 1, 3 * (1 << 17) + 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_squared_norm_within_its_bound_on_both_sides_of_the_numpy_path(numel, dtype):
    """Against the exactly rounded sum of the exact squares (math.fsum of float64
    squares, exact for float32 and narrower): off by at most n 2**-53 relative
    ((n + 1) for float64), NumPy's dot for small tensors, torch's pieces above."""
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    exact = math.fsum(float(v) ** 2 for v in values.double().tolist())
    got = functional.squared_norm(values)
    assert isinstance(got, float)
    assert abs(got - exact) <= (numel + 1) * 2.0**-53 * exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_count_over_pieces_on_either_path(paths, dtype):
    """Exact zeros (either sign), not NaN or inf, over several of count_where's pieces;
    also of a strided view."""
    n = 3 * order_statistics.COUNT_PIECE + 5
    values = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=dtype)
    values[::7], values[3::11], values[5::13], values[-1] = 0.0, -0.0, math.nan, math.inf
    for tensor in (values, values[::2]):
        assert float(functional.zero_count(tensor)) == int((tensor == 0).sum())
