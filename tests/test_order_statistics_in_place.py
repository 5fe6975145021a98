"""Selection by nested partitions (order_statistics.select_in_place): bit for bit a sort."""

import math

from cockpit_gradnoise import order_statistics

import numpy
import pytest

from tests.test_order_statistics import awkward_values


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000, 100_003])
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_select_in_place_equals_sorted_values_and_keeps_the_multiset(n, dtype):
    """Every kind of rank: extremes, neighbours of a partition's rank (on both
    sides), repeats, any order; ties, zeros of both signs and infinities."""
    values = awkward_values(n, dtype, seed=n)
    ordered = numpy.sort(values)
    rng = numpy.random.default_rng(n)
    ranks = [n - 1, 0, n // 2, min(n // 2 + 1, n - 1), (n - 1) // 2, n // 2]
    ranks += rng.integers(0, n, size=12).tolist()
    ranks += [min(r + 1, n - 1) for r in ranks[-12:]] + [max(r - 1, 0) for r in ranks[-12:]]
    work = values.copy()
    got = order_statistics.select_in_place(work, ranks)
    assert got == ordered[ranks].astype(numpy.float64).tolist()
    assert numpy.array_equal(numpy.sort(work), ordered)


def test_select_in_place_refuses_nan():
    values = numpy.array([1.0, math.nan, 0.5], dtype=numpy.float32)
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select_in_place(values, [1])


@pytest.mark.parametrize("zero_fraction", [0.0, 0.5, 0.95, 1.0])
def test_select_in_place_with_many_zeros(zero_fraction):
    """Mostly zeros (the sd of dead units), of either sign, among negative and
    positive values: the zeros are taken out first (partitions slow down on them)."""
    n = 50_000
    rng = numpy.random.default_rng(1)
    values = rng.standard_normal(n).astype(numpy.float32)
    zero = rng.random(n) < zero_fraction
    values[zero] = numpy.where(rng.random(int(zero.sum())) < 0.5, 0.0, -0.0)
    ordered = numpy.sort(values)
    ranks = [0, 1, n // 3, n // 2, n // 2 + 1, int(0.97 * n), n - 2, n - 1]
    got = order_statistics.select_in_place(values.copy(), ranks)
    assert got == ordered[ranks].astype(numpy.float64).tolist()
    with_nan = values.copy()
    with_nan[7] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select_in_place(with_nan, [n // 2])


@pytest.mark.parametrize("n", [0, 1, order_statistics.COUNT_PIECE, 3 * order_statistics.COUNT_PIECE + 5])
def test_count_where_counts_every_piece(n):
    """The counts of the whole array, pieces ending inside and at the array's end."""
    values = numpy.random.default_rng(n).standard_normal(n).astype(numpy.float32)
    values[::7] = 0.0
    values[3::11] = numpy.nan
    assert order_statistics.count_where(values, numpy.equal, 0) == numpy.count_nonzero(values == 0)
    assert order_statistics.count_where(values, numpy.isnan) == numpy.count_nonzero(numpy.isnan(values))
