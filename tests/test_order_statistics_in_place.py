"""Selection by nested partitions (order_statistics.select_in_place): bit for bit a sort."""

import math

from cockpit_gradnoise import order_statistics
from cockpit_gradnoise.order_statistics import partition

import numpy
import pytest

from tests.test_order_statistics import awkward_values


@pytest.fixture(autouse=True, params=["partitions", "buckets"])
def either_way(request, monkeypatch):
    """Every test of this file both ways, whichever this machine takes: by partitions (where
    NumPy's selection is cheap), and by the buckets from ``BUCKETS_AT_LEAST`` elements on."""
    monkeypatch.setattr(partition, "PARTITIONS_CHEAPER", request.param == "partitions")
    return request.param


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


def test_quantile_summaries_in_place_of_a_large_union_equal_numpy_on_the_kept_values(either_way):
    """Each array's and the union's quantiles (the union of ``BUCKETS_AT_LEAST`` elements or
    more: by the buckets' shared passes where partitions are the dearer way) bit for bit
    numpy.quantile of the kept values, placeholder zeros left out; an array with nothing
    kept has no summary; ties, kept zeros and a value far above the others."""
    rng = numpy.random.default_rng(2)
    levels = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
    sizes, left_out = [partition.BUCKETS_AT_LEAST + 7, 3000, 90, 20_000, 6], [500, 0, 3, 17, 6]
    kept = [numpy.abs(rng.standard_normal(n - z)).astype(numpy.float32) for n, z in zip(sizes, left_out)]
    kept[0][:40] = 0.0  # kept zeros tie with the placeholders
    kept[0][40:60] = kept[0][60]  # ties
    kept[3][5] = 3e38  # far above the others
    arrays = [numpy.concatenate([numpy.zeros(z, numpy.float32), k]) for k, z in zip(kept, left_out)]
    for a in arrays:
        rng.shuffle(a)
    assert sum(sizes) >= partition.BUCKETS_AT_LEAST
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels, left_out)
    for values, summary in zip(kept, each):
        if values.size == 0:
            assert summary == []
            continue
        assert summary[: len(levels)] == numpy.quantile(values.astype(numpy.float64), levels).tolist()
        assert summary[-1] == pytest.approx(values.astype(numpy.float64).mean(), rel=1e-12)
    everything = numpy.concatenate(kept).astype(numpy.float64)
    assert union[: len(levels)] == numpy.quantile(everything, levels).tolist()
    assert union[-1] == everything.mean() or union[-1] == pytest.approx(everything.mean(), rel=1e-12)


def test_partitions_cheaper_is_measured_once(monkeypatch):
    """A bool, measured at the first call and kept (no second measurement)."""
    monkeypatch.setattr(partition, "PARTITIONS_CHEAPER", None)
    found = partition.partitions_cheaper()
    assert isinstance(found, bool) and partition.PARTITIONS_CHEAPER is found
    monkeypatch.setattr(partition, "_select_by_buckets", None)  # a second measurement would fail
    assert partition.partitions_cheaper() is found
