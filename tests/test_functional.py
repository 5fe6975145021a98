"""The pure formulas, each against NumPy or a two-pass computation."""

import math

import numpy
import pytest
import torch

from cockpit_gradnoise import functional


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_exact_quantiles_match_numpy(n):
    torch.manual_seed(n)
    values = torch.randn(n, dtype=torch.float64).exp()
    levels = (0.0, 0.05, 0.25, 0.5, 0.51, 0.75, 0.95, 1.0)
    got = functional.exact_quantiles(values, levels)
    expected = numpy.quantile(values.numpy(), levels)
    numpy.testing.assert_allclose(got.numpy(), expected, rtol=1e-14, atol=0)


def test_exact_quantiles_with_ties_and_shape():
    values = torch.tensor([[3.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    got = functional.exact_quantiles(values, (0.5, 1 / 3))
    numpy.testing.assert_allclose(got.numpy(), numpy.quantile(values.numpy(), (0.5, 1 / 3)))


def test_exact_quantiles_beyond_16_million_elements():
    """Older torch.quantile refuses more than 2**24 elements; ours is exact there."""
    n = 2**24 + 3
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(n, generator=generator, dtype=torch.float32)
    levels = (0.05, 0.5, 0.95)
    got = functional.exact_quantiles(values, levels)
    expected = numpy.quantile(values.numpy().astype(numpy.float64), levels)
    numpy.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_exact_quantiles_rejects_empty():
    with pytest.raises(ValueError, match="empty"):
        functional.exact_quantiles(torch.zeros(0), (0.5,))


@pytest.mark.parametrize("levels", [(), (1.5,), (-0.1, 0.5), ("half",)])
def test_check_quantile_levels_rejects(levels):
    with pytest.raises(ValueError, match="quantile"):
        functional.check_quantile_levels(levels)


def test_quantile_name_uses_percent_g():
    names = [functional.quantile_name(q) for q in (0.05, 0.5, 0.95, 0.1, 1.0)]
    assert names == ["q0.05", "q0.5", "q0.95", "q0.1", "q1"]


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


def test_signal_to_noise_skips_zero_sd():
    grad = torch.tensor([1.0, -2.0, 3.0])
    sd = torch.tensor([0.5, 0.0, 3.0])
    assert functional.signal_to_noise(grad, sd).tolist() == [2.0, 1.0]
    assert functional.signal_to_noise(grad, torch.zeros(3)).numel() == 0


def test_loss_scale_tells_mean_from_sum():
    losses = torch.tensor([0.5, 1.0, 2.5])
    assert functional.loss_scale(losses.mean(), losses) == pytest.approx(1 / 3)
    assert functional.loss_scale(losses.sum(), losses) == 1.0
    assert functional.loss_scale(losses[:1].sum(), losses[:1]) == 1.0


def test_loss_scale_refuses_other_losses():
    losses = torch.tensor([0.5, 1.0, 2.5])
    with pytest.raises(ValueError, match="neither the mean"):
        functional.loss_scale(losses.max(), losses)
    with pytest.raises(ValueError, match="one loss per example"):
        functional.loss_scale(losses.sum(), losses.reshape(3, 1))


def test_batch_norm_statistics():
    squared = torch.tensor([9.0, 16.0, 0.0, 1.0], dtype=torch.float64)
    stats = functional.batch_norm_statistics(squared, (0.5,))
    norms = numpy.array([3.0, 4.0, 0.0, 1.0])
    assert stats == {"q0.5": numpy.quantile(norms, 0.5), "mean": 2.0, "max": 4.0}
    assert not any(math.isnan(v) for v in stats.values())


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_sorted_summary_of_several_arrays_matches_numpy_on_their_union(dtype):
    """Exact order statistics of a union without joining it: ties, zeros, inf,
    empty arrays, every rank."""
    rng = numpy.random.default_rng(0)
    for trial in range(100):
        arrays = [
            numpy.abs(rng.standard_normal(rng.integers(0, 40))).astype(dtype)
            for _ in range(rng.integers(1, 5))
        ]
        if trial % 3 == 0:  # ties and exact zeros
            arrays = [numpy.round(a, 1).astype(dtype) for a in arrays]
        if trial % 7 == 0:
            arrays[0] = numpy.append(arrays[0], dtype(numpy.inf))
        union = numpy.sort(numpy.concatenate(arrays))
        if union.size == 0:
            continue
        arrays = [numpy.sort(a) for a in arrays]
        ranks = range(union.size)
        assert functional.union_order_statistics(arrays, ranks) == union.astype(numpy.float64).tolist()
        if numpy.isinf(union).any():
            continue
        levels = (0.0, 0.05, 0.3, 0.5, 0.95, 1.0)
        got = functional.sorted_summary(arrays, levels)
        expected = numpy.quantile(union.astype(numpy.float64), levels)
        numpy.testing.assert_allclose(
            [got[functional.quantile_name(q)] for q in levels], expected, rtol=1e-15, atol=0
        )
        assert got["mean"] == pytest.approx(union.astype(numpy.float64).mean(), rel=1e-12)


def test_sort_values_sorts_in_place():
    values = torch.tensor([3.0, 1.0, 2.0])
    array = functional.sort_values_(values)
    assert array.tolist() == [1.0, 2.0, 3.0] and values.tolist() == [1.0, 2.0, 3.0]


def test_sorted_signal_to_noise_equals_selection():
    torch.manual_seed(0)
    grad = torch.randn(1000)
    grad[::7] = 0.0
    sd = torch.rand(1000)
    sd[::3] = 0.0  # x/0 and 0/0 both left out
    expected = numpy.sort(functional.signal_to_noise(grad, sd).numpy())
    numpy.testing.assert_array_equal(functional.sorted_signal_to_noise(grad, sd), expected)
    assert functional.sorted_signal_to_noise(grad, torch.zeros(1000)).size == 0


def test_gradient_sd_in_place_equals_copy():
    torch.manual_seed(3)
    contributions = torch.randn(5, 40)
    sum_of_squares, total = contributions.pow(2).sum(0), contributions.sum(0)
    expected = functional.gradient_sd(sum_of_squares, total, 5)
    got = functional.gradient_sd(sum_of_squares, total, 5, in_place=True)
    assert got.data_ptr() == sum_of_squares.data_ptr()
    assert torch.equal(got, expected)
