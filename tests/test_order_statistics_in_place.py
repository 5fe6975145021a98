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


def _mostly_zeros(n: int, nonzero: int, seed: int) -> numpy.ndarray:
    """``n`` float32 values, ``nonzero`` of them not 0 (of both signs), the zeros of both signs."""
    rng = numpy.random.default_rng(seed)
    values = numpy.where(rng.random(n) < 0.5, 0.0, -0.0).astype(numpy.float32)
    values[rng.choice(n, size=nonzero, replace=False)] = rng.standard_normal(nonzero).astype(numpy.float32)
    return values


def _ways_taken(monkeypatch) -> list:
    """The names of the selection ways :func:`partition.select_in_place` and the union's
    summaries take, in order, each still run."""
    taken = []
    for name in ("_select_by_buckets", "_select_around_zeros", "_select_by_partitions", "_summaries_by_buckets"):
        original = getattr(partition, name)
        monkeypatch.setattr(partition, name,
                            lambda *args, _name=name, _original=original: taken.append(_name) or _original(*args))
    return taken


@pytest.mark.parametrize("nonzero", [0, 3, 2048, 10_000])
def test_an_array_mostly_zeros_is_selected_around_them_where_partitions_are_dearer(nonzero, either_way, monkeypatch):
    """An array of ``BUCKETS_AT_LEAST`` elements or more, few of them not 0 (GPT-2's position table
    past the sequence length): around its zeros, not by the buckets' two passes (three times the
    time), whichever way is the dearer here; bit for bit a sort."""
    n = partition.BUCKETS_AT_LEAST + 5000
    values = _mostly_zeros(n, nonzero, seed=nonzero)
    taken = _ways_taken(monkeypatch)
    ranks = [0, 1, n // 4, n // 2, n // 2 + 1, n - 2, n - 1]
    got = order_statistics.select_in_place(values.copy(), ranks)
    assert got == numpy.sort(values)[ranks].astype(numpy.float64).tolist()
    assert "_select_by_buckets" not in taken and taken[0] == "_select_around_zeros"


def test_an_array_with_few_zeros_takes_the_buckets_where_partitions_are_dearer(either_way, monkeypatch):
    """The same size, a fifth of it 0: the buckets where partitions are the dearer way, else the
    partitions around the zeros."""
    n = partition.BUCKETS_AT_LEAST + 5000
    values = _mostly_zeros(n, 4 * n // 5, seed=7)
    taken = _ways_taken(monkeypatch)
    ranks = [0, n // 3, n // 2, n - 1]
    assert order_statistics.select_in_place(values.copy(), ranks) == numpy.sort(values)[ranks].tolist()
    assert taken[0] == ("_select_around_zeros" if either_way == "partitions" else "_select_by_buckets")


def test_a_sample_that_sees_only_zeros_still_selects_exactly(either_way, monkeypatch):
    """Zeros exactly where :func:`partition.nonzero_at_least` samples, every other element not 0:
    the sample is wrong, the exact count of zeros finds few, and the array is selected as one
    without many zeros (the buckets where partitions are the dearer way): bit for bit a sort."""
    n = partition.BUCKETS_AT_LEAST * 2
    values = numpy.random.default_rng(3).standard_normal(n).astype(numpy.float32)
    values[:: -(-n // partition.SAMPLE_AT_MOST)] = 0.0
    assert not partition.nonzero_at_least([values], 1)
    taken = _ways_taken(monkeypatch)
    ranks = [0, 5, n // 2, n - 1]
    assert order_statistics.select_in_place(values.copy(), ranks) == numpy.sort(values)[ranks].tolist()
    assert taken == (["_select_by_partitions"] if either_way == "partitions" else ["_select_by_buckets"])


def test_nonzero_at_least_counts_small_arrays_whole_and_samples_large_ones():
    """A small array counts its size unread (zeros too); a large one its sampled share of
    nonzero elements (here exact: every element of a stride class alike); the largest first."""
    small = numpy.zeros(partition.SAMPLE_AT_MOST, numpy.float32)
    assert partition.nonzero_at_least([small], partition.SAMPLE_AT_MOST)
    assert not partition.nonzero_at_least([small], partition.SAMPLE_AT_MOST + 1)
    large = numpy.zeros(64 * partition.SAMPLE_AT_MOST, numpy.float32)
    large[::2] = 1.0  # the stride (64) is even: the sample sees only ones
    assert partition.nonzero_at_least([large], large.size)
    large[::2], large[1::2] = 0.0, 1.0  # the sample sees only zeros
    assert not partition.nonzero_at_least([large], 1)
    assert partition.nonzero_at_least([large, small], small.size)
    assert not partition.nonzero_at_least([large, small], small.size + 1)


@pytest.mark.parametrize("mostly_zeros", [True, False])
def test_a_union_mostly_zeros_is_selected_array_by_array(mostly_zeros, either_way, monkeypatch):
    """A union of ``BUCKETS_AT_LEAST`` elements or more, most of them 0 (a position table's sd
    beside small layers'): each array and the union selected as without the buckets' shared
    passes, whichever way is the dearer here; with few zeros, the shared passes where partitions
    are the dearer way. Bit for bit numpy.quantile either way."""
    levels = (0.0, 0.1, 0.5, 0.9, 1.0)
    nonzero = 1500 if mostly_zeros else partition.BUCKETS_AT_LEAST
    arrays = [numpy.abs(_mostly_zeros(partition.BUCKETS_AT_LEAST, nonzero, seed=5))]
    arrays += [numpy.abs(numpy.random.default_rng(k).standard_normal(900).astype(numpy.float32)) for k in range(4)]
    taken = _ways_taken(monkeypatch)
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels)
    for values, summary in zip(arrays, each):
        assert summary[: len(levels)] == numpy.quantile(values.astype(numpy.float64), levels).tolist()
    everything = numpy.concatenate(arrays).astype(numpy.float64)
    assert union[: len(levels)] == numpy.quantile(everything, levels).tolist()
    shared = either_way == "buckets" and not mostly_zeros
    assert ("_summaries_by_buckets" in taken) == shared
