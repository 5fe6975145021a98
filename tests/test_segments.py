"""Order statistics of many tensors in one sort (``order_statistics/segments.py``).

The segments' quantiles must be those each tensor's own sort gave
(:func:`~cockpit_gradnoise.order_statistics.on_device.summary_of_sorted`), bit for
bit, and ``numpy.quantile``'s where a tensor holds no NaN; the means those sums to
float64 rounding (``n eps64`` relative for ``n`` terms). Values chosen to catch a
wrong order: NaN (both signs) beside ``+inf`` and ``-inf``, ties, ``-0.0``, segments
of one element, a segment of NaN only, and segments whose values interleave.
"""

import math

from cockpit_gradnoise import functional, order_statistics
from cockpit_gradnoise.order_statistics import on_device, segments

import numpy
import pytest
import torch

LEVELS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def awkward_tensors(dtype):
    """Tensors whose union interleaves, with NaN, infinities, ties and signed zeros."""
    g = torch.Generator().manual_seed(3)
    sizes = [1, 2, 3, 5, 17, 64, 1, 9, 200]
    flats = [torch.randn(n, generator=g, dtype=dtype) * 10 ** (k % 3) for k, n in enumerate(sizes)]
    flats[2][1] = math.nan
    flats[3][:] = 0.0
    flats[3][1] = -0.0
    flats[4][[0, 3, 5]] = math.nan
    flats[4][6] = -math.nan  # sign bit set: a radix sort by bits would put it first
    flats[4][7] = math.inf
    flats[5][:32] = 1.5  # ties
    flats[5][40] = -math.inf
    flats[6][0] = math.nan  # a segment of NaN only
    flats[7][:] = math.inf
    # Medians from the upper value where t = 0.5 (numpy's _lerp): these two differ by an ulp
    # from the lower one in float64.
    flats[1][:] = torch.tensor([-0.1321048632913019, 0.1257302210933933], dtype=dtype)
    # NaN and +inf interleaved: only the key (segment, isnan) puts every NaN after every inf.
    mixed = torch.full((60,), math.inf, dtype=dtype)
    mixed[torch.randperm(60, generator=g)[:30]] = math.nan
    return flats + [mixed]


def reference(flat, levels, kept):
    """``(count, summary)`` of one tensor by its own sort, as before the segments."""
    if kept:
        return on_device.kept_quantile_summary([flat], levels)
    return flat.numel(), on_device.summary_of_sorted(
        on_device.sorted_on_device([flat]), flat.numel(), levels)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("group_at_most", [segments.GROUP_AT_MOST, 40])
@pytest.mark.parametrize("kept", [False, True])
def test_segment_summaries_are_each_tensor_s_own_sort_s(kept, group_at_most, monkeypatch):
    """Mixed dtypes (grouped apart), groups cut by size (40: several groups, some of one
    tensor, the 200-element one alone): quantiles bit for bit, counts equal, means to
    float64 rounding; and ``numpy.quantile``'s values where no NaN is counted."""
    monkeypatch.setattr(segments, "GROUP_AT_MOST", group_at_most)
    flats = awkward_tensors(torch.float32) + awkward_tensors(torch.float64)[1::2]
    found = order_statistics.segment_summaries(flats, LEVELS, kept=kept)
    for flat, (count, values) in zip(flats, found):
        expected_count, expected = reference(flat, LEVELS, kept)
        assert int(count) == int(expected_count)
        if int(count) == 0:
            continue
        assert [v.dtype for v in values] == [torch.float64] * (len(LEVELS) + 1)
        assert all(same(float(v), float(e)) for v, e in zip(values[:-1], expected[:-1])), (flat, values, expected)
        mean, expected_mean = float(values[-1]), float(expected[-1])
        assert same(mean, expected_mean) or mean == pytest.approx(
            expected_mean, rel=flat.numel() * 2.0**-52, abs=0)
        x = flat.double().numpy()
        x = x[~numpy.isnan(x)] if kept else x
        if not numpy.isnan(x).any() and not numpy.isinf(x).any():
            assert [float(v) for v in values[:-1]] == list(numpy.quantile(x, LEVELS))


def test_groups_hold_one_dtype_and_device_and_at_most_the_limit(monkeypatch):
    monkeypatch.setattr(segments, "GROUP_AT_MOST", 10)
    tensors = [torch.zeros(4), torch.zeros(3, dtype=torch.float64), torch.zeros(6), torch.zeros(11),
               torch.zeros(1), torch.zeros(5, dtype=torch.float64)]
    assert segments.segment_groups(tensors) == [[0, 2], [1, 5], [3], [4]]


def test_the_sorted_segments_are_numpy_s_sort_with_nan_last():
    """The order itself (what every rank reads): each segment as ``numpy.sort`` of it
    (NaN last, ``-0.0`` equal to ``0.0``), however the segments' values interleave."""
    flats = awkward_tensors(torch.float32)
    found = segments.Segments(torch.cat(flats), [f.numel() for f in flats])
    start = 0
    for flat in flats:
        got = found.ordered[start:start + flat.numel()].numpy()
        numpy.testing.assert_array_equal(got, numpy.sort(flat.numpy()))
        start += flat.numel()
    assert found.kept_counts().tolist() == [int((~f.isnan()).sum()) for f in flats]


def ratio_pairs():
    g = torch.Generator().manual_seed(5)
    pairs = []
    for n in (1, 2, 6, 7, 30, 1):
        theta, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
        pairs.append((theta, grad))
    pairs[1][1][:] = 0.0  # every gradient 0: no ratio statistics
    pairs[2][1][[0, 2]] = 0.0
    pairs[2][0][3] = math.inf  # left out: theta not finite
    pairs[3][1][1] = math.nan
    pairs[4][0][:10] = 2.0  # ties
    pairs[4][1][:10] = 1.0
    pairs[5][0][0] = 1e38  # a ratio too large for float32: inf, kept
    pairs[5][1][0] = 1e-30
    return pairs


def test_ratio_statistics_of_pairs_are_each_pair_s_own():
    """Mean, median (``numpy.median``: the mean of the middle two), min and max of each
    pair's kept ratios, as NumPy and the CPU's path (its partitions) give them."""
    pairs = ratio_pairs()
    found = functional.abs_ratio_statistics_of_pairs(pairs)
    for (theta, grad), stats in zip(pairs, found):
        got = functional.abs_ratio_statistics(theta, grad)
        kept = (grad != 0) & grad.isfinite() & theta.isfinite()
        count, values = int(stats.count), {k: float(v) for k, v in stats.statistics.items()}
        assert count == int(kept.sum())
        if count == 0:
            continue
        ratio = (theta[kept].double() / grad[kept].double()).float().abs().double().numpy()
        assert values["median"] == float(numpy.median(ratio))
        assert values["min"] == ratio.min() and values["max"] == ratio.max()
        assert values["mean"] == pytest.approx(ratio.mean(), rel=ratio.size * 2.0**-52)
        assert {k: values[k] for k in ("median", "min", "max")} == {
            k: got[k] for k in ("median", "min", "max")}
