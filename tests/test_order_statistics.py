"""Exact quantiles by selection: bit for bit numpy.quantile, for tensors and unions."""

import importlib.util
from pathlib import Path

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.order_statistics import SORT_WHOLE_AT_MOST

import numpy
import pytest
import torch

LEVELS = (0.0, 0.05, 0.25, 1 / 3, 0.5, 0.51, 0.75, 0.95, 1.0)
# Whole sort, then bucket selection (several pieces: the test beyond 16 million).
SIZES = [1, 2, 3, 7, 1000, SORT_WHOLE_AT_MOST, SORT_WHOLE_AT_MOST + 1, 600_001]


def awkward_values(n, dtype, seed):
    """Spread-out values with ties, exact zeros, -0.0, negatives and infinities."""
    rng = numpy.random.default_rng(seed)
    values = rng.standard_normal(n) * numpy.exp(3 * rng.standard_normal(n))
    tied = rng.random(n) < 0.3
    values[tied] = numpy.round(values[tied], 1)
    values[rng.random(n) < 0.1] = 0.0
    values[rng.random(n) < 0.05] = -0.0
    if n > 10:
        values[rng.integers(n, size=2)] = numpy.inf
        values[rng.integers(n)] = -numpy.inf
    return values.astype(dtype)


def random_parts(values, rng):
    """``values`` cut into a few pieces at random places, some empty."""
    cuts = numpy.sort(rng.integers(0, values.size + 1, size=rng.integers(0, 6)))
    return [torch.from_numpy(part) for part in numpy.split(values, cuts)]


def expected_quantiles(values, levels):
    with numpy.errstate(invalid="ignore"):  # inf - inf at the ends is NaN for both
        return numpy.quantile(values.astype(numpy.float64), levels)


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("n", SIZES)
def test_quantiles_equal_numpy_bit_for_bit(n, dtype):
    rng = numpy.random.default_rng(n)
    for seed in range(3):
        values = awkward_values(n, dtype, seed)
        expected = expected_quantiles(values, LEVELS)
        got = order_statistics.quantiles(torch.from_numpy(values), LEVELS)
        numpy.testing.assert_array_equal(got, expected)
        union = order_statistics.quantiles(random_parts(values, rng), LEVELS)
        numpy.testing.assert_array_equal(union, expected)


def test_quantiles_of_non_negative_values_equal_numpy_bit_for_bit():
    """The quantities' case: sd, SNR, norms and ratios (no NaN, no negative)."""
    rng = numpy.random.default_rng(1)
    for n in (2, 5, 99_999, 300_000):
        values = numpy.abs(awkward_values(n, numpy.float32, n))
        got = order_statistics.quantiles(torch.from_numpy(values), LEVELS)
        numpy.testing.assert_array_equal(got, expected_quantiles(values, LEVELS))
        parts = random_parts(values, rng)
        numpy.testing.assert_array_equal(
            order_statistics.quantiles(parts, LEVELS), expected_quantiles(values, LEVELS)
        )


@pytest.mark.parametrize("n", [5, 40, 2 * SORT_WHOLE_AT_MOST + 17])
def test_select_finds_every_requested_rank_of_a_union(n):
    rng = numpy.random.default_rng(n)
    values = awkward_values(n, numpy.float32, 0)
    ordered = numpy.sort(values)
    ranks = sorted(set(rng.integers(n, size=60).tolist()) | {0, n - 1})
    got = order_statistics.select(random_parts(values, rng), ranks)
    numpy.testing.assert_array_equal(got, ordered[ranks].astype(numpy.float64))


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_each_group_and_their_union_equal_numpy_bit_for_bit(dtype):
    """The layers' and the network's quantiles from shared passes (small and large groups)."""
    rng = numpy.random.default_rng(3)
    sizes = [1, 7, SORT_WHOLE_AT_MOST, SORT_WHOLE_AT_MOST + 1, 250_003, 3]
    values = [awkward_values(n, dtype, seed) for seed, n in enumerate(sizes)]
    # Groups of different scales, as layers are: the union's ranks fall elsewhere.
    values[4] *= 1e-3
    groups = [random_parts(v, rng) for v in values]
    # A summary: the quantiles in level order, then the mean.
    each, union = order_statistics.quantile_summaries(groups, LEVELS)
    for got, v in zip(each, values):
        quantiles = got[: len(LEVELS)]
        numpy.testing.assert_array_equal(quantiles, expected_quantiles(v, LEVELS))
    everything = numpy.concatenate(values)
    numpy.testing.assert_array_equal(
        union[: len(LEVELS)],
        expected_quantiles(everything, LEVELS),
    )
    non_negative = [numpy.abs(numpy.nan_to_num(v, posinf=1.0, neginf=1.0)) for v in values]
    each, union = order_statistics.quantile_summaries(
        [torch.from_numpy(v) for v in non_negative], (0.5,)
    )
    for got, v in zip(each, non_negative):
        assert got[-1] == pytest.approx(v.astype(numpy.float64).mean(), rel=1e-12)
    joined = numpy.concatenate(non_negative).astype(numpy.float64)
    assert union[-1] == pytest.approx(joined.mean(), rel=1e-12)
    assert union[0] == expected_quantiles(joined, (0.5,))[0]


@pytest.mark.parametrize("small_groups", [3, 40])
def test_union_of_many_small_groups_equals_numpy_bit_for_bit(small_groups):
    """Small groups are counted and filtered for the union together (40 x 128
    elements: more than a small group, so counted like a large one); the
    union's ranks fall among them."""
    rng = numpy.random.default_rng(11)
    values = [
        (awkward_values(128, numpy.float32, seed) * 10.0 ** rng.integers(-3, 3)).astype(numpy.float32)
        for seed in range(small_groups)
    ]
    values.append(awkward_values(SORT_WHOLE_AT_MOST + 1, numpy.float32, 99) * numpy.float32(1e-4))
    levels = (0.0, 0.1, 0.5, 0.9, 1.0)
    each, union = order_statistics.quantile_summaries(
        [random_parts(v, rng) for v in values], levels
    )
    for got, v in zip(each, values):
        numpy.testing.assert_array_equal(
            got[: len(levels)], expected_quantiles(v, levels)
        )
    numpy.testing.assert_array_equal(
        union[: len(levels)],
        expected_quantiles(numpy.concatenate(values), levels),
    )


@pytest.mark.parametrize("subnormals", [False, True])
def test_mostly_zeros_are_counted_exactly_beside_the_tiniest_subnormals(subnormals):
    """Zeros are counted, not gathered, unless their buckets hold subnormals too."""
    rng = numpy.random.default_rng(5)
    values = []
    for n in (50_001, 9_000, 3):
        v = numpy.abs(rng.standard_normal(n)).astype(numpy.float32)
        v[rng.random(n) < 0.9] = 0.0
        v[rng.random(n) < 0.05] = -0.0
        values.append(v)
    if subnormals:  # in the zero buckets (|x| < 2**-131), in one group only
        values[0][:7] = numpy.float32(1e-44) * numpy.arange(1, 8)
        values[0][7:9] = -numpy.float32(1e-44)
    levels = (0.0, 0.3, 0.5, 0.89, 0.9, 0.91, 0.99, 1.0)
    each, union = order_statistics.quantile_summaries(
        [torch.from_numpy(v) for v in values], levels
    )
    for got, v in zip(each, values):
        quantiles = got[: len(levels)]
        numpy.testing.assert_array_equal(quantiles, expected_quantiles(v, levels))
    numpy.testing.assert_array_equal(
        union[: len(levels)],
        expected_quantiles(numpy.concatenate(values), levels),
    )
    ranks = [0, 6, 7, 8, 9, 10, 45_000, 50_000]
    (got,), _ = order_statistics.select_each_and_union([torch.from_numpy(values[0])], [ranks], [])
    numpy.testing.assert_array_equal(got, numpy.sort(values[0])[ranks])


def test_select_each_and_union_finds_every_rank_and_rejects_nan():
    rng = numpy.random.default_rng(4)
    values = [awkward_values(n, numpy.float32, n) for n in (5, 70_001, 30_000)]
    ranks = [sorted(set(rng.integers(v.size, size=30).tolist())) for v in values]
    everything = numpy.sort(numpy.concatenate(values))
    union_ranks = sorted(set(rng.integers(everything.size, size=30).tolist()))
    each, union = order_statistics.select_each_and_union(
        [torch.from_numpy(v) for v in values], ranks, union_ranks
    )
    for got, v, r in zip(each, values, ranks):
        numpy.testing.assert_array_equal(got, numpy.sort(v)[r])
    numpy.testing.assert_array_equal(union, everything[union_ranks])
    values[1][123] = numpy.nan
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select_each_and_union(
            [torch.from_numpy(v) for v in values], [[0]] * 3, [0]
        )
    with pytest.raises(ValueError, match="ranks must lie"):
        order_statistics.select_each_and_union([torch.ones(3)], [[0]], [3])


def test_quantiles_beyond_16_million_elements():
    """Older torch.quantile refuses more than 2**24 elements; ours is exact there."""
    n = 2**24 + 3
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(n, generator=generator)  # float32: many ties
    values[::5] = 0.0
    levels = (0.05, 0.5, 0.95)
    got = order_statistics.quantiles(values, levels)
    numpy.testing.assert_array_equal(got, expected_quantiles(values.numpy(), levels))


def test_other_dtypes_and_mixed_unions_are_compared_exactly():
    half = torch.randn(70_000, dtype=torch.float16)
    numpy.testing.assert_array_equal(
        order_statistics.quantiles(half, LEVELS), expected_quantiles(half.numpy(), LEVELS)
    )
    integers = torch.arange(10)
    assert order_statistics.quantiles(integers, (0.5,)) == [4.5]
    mixed = [torch.tensor([3.0, 1.0]), torch.tensor([2.0], dtype=torch.float64), half]
    expected = numpy.concatenate([m.numpy().astype(numpy.float64) for m in mixed])
    numpy.testing.assert_array_equal(
        order_statistics.quantiles(mixed, LEVELS), expected_quantiles(expected, LEVELS)
    )


def test_float64_beyond_float32_range_is_exact():
    """float64 values are bucketed as float32: huge ones share the bucket of
    inf, tiny ones that of 0; both are still ordered exactly."""
    rng = numpy.random.default_rng(3)
    values = rng.standard_normal(3 * SORT_WHOLE_AT_MOST)
    extremes = [1e300, -1e300, 3.5e38, -3.5e38, 1e-300, -1e-300, 5e-324, 1e-46]
    values[: 8 * 300] = numpy.repeat(extremes, 300) * rng.random(8 * 300)
    rng.shuffle(values)
    levels = [i / 20 for i in range(21)]
    got = order_statistics.quantiles(torch.from_numpy(values), levels)
    numpy.testing.assert_array_equal(got, expected_quantiles(values, levels))


def test_negative_zero_counts_as_zero():
    values = torch.tensor([-0.0, 0.0, -0.0, 1.0, -1.0])
    assert order_statistics.select(values, [1, 2, 3]) == [0.0, 0.0, 0.0]
    big = torch.zeros(SORT_WHOLE_AT_MOST + 5)
    big[::2] = -0.0
    big[-1] = 2.0
    assert order_statistics.quantiles(big, (0.5, 1.0)) == [0.0, 2.0]


@pytest.mark.parametrize("n", [3, SORT_WHOLE_AT_MOST + 1])
def test_nan_is_rejected_naming_the_fix(n):
    values = torch.rand(n)
    values[1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN.*values\[~values.isnan\(\)\]"):
        order_statistics.quantiles(values, (0.5,))
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select([torch.rand(n), -values], [0])


@pytest.mark.parametrize("bits", [0x7F800001, 0xFF800001 - (1 << 32), 0xFFC00000 - (1 << 32)])
def test_nan_of_either_sign_is_rejected_whichever_rank_is_asked(bits):
    """+-0x7F800001 are NaNs in the buckets of +-inf, 0xFFC00000 in a bucket
    below -inf: buckets always looked into, whatever the ranks."""
    values = torch.rand(SORT_WHOLE_AT_MOST + 1)
    values[7] = torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]
    assert values[7].isnan()
    for rank in (0, SORT_WHOLE_AT_MOST // 2, SORT_WHOLE_AT_MOST):
        with pytest.raises(ValueError, match="NaN"):
            order_statistics.select(values, [rank])


def test_empty_input_and_bad_ranks_are_rejected():
    with pytest.raises(ValueError, match="no elements"):
        order_statistics.quantiles(torch.zeros(0), (0.5,))
    with pytest.raises(ValueError, match="no elements"):
        order_statistics.select([torch.zeros(0), torch.zeros(2, 0)], [0])
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, 3\)"):
        order_statistics.select(torch.ones(3), [3])


@pytest.mark.parametrize("n", [1, 32, SORT_WHOLE_AT_MOST, 100_001])
def test_quantile_summary_of_a_union(n):
    """Small unions (a batch's norms) are sorted whole, large ones selected."""
    rng = numpy.random.default_rng(n)
    values = numpy.abs(awkward_values(n, numpy.float32, 0))
    values[numpy.isinf(values)] = 1.0
    parts = random_parts(values, rng)
    got = order_statistics.quantile_summary(parts, (0.1, 0.5))
    assert len(got) == 3  # the two quantiles in level order, then the mean
    numpy.testing.assert_array_equal(
        got[:2], expected_quantiles(values, (0.1, 0.5))
    )
    assert got[2] == pytest.approx(values.astype(numpy.float64).mean(), rel=1e-12)
    values[n // 2] = numpy.nan
    with pytest.raises(ValueError, match=r"NaN.*values\[~values.isnan\(\)\]"):
        order_statistics.quantile_summary(random_parts(values, rng), (0.5,))


@pytest.mark.parametrize("levels", [(), (1.5,), (-0.1, 0.5), ("half",)])
def test_check_quantile_levels_rejects(levels):
    with pytest.raises(ValueError, match="quantile"):
        order_statistics.check_quantile_levels(levels)


def test_the_paths_of_other_devices_are_exact_too(monkeypatch):
    """GPUs take torch's sort and boolean indexing, whole tensors, a torch sum:
    the same results (run here on CPU tensors)."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    rng = numpy.random.default_rng(2)
    for n in (5, SORT_WHOLE_AT_MOST + 1, 100_000):
        values = awkward_values(n, numpy.float32, n)
        expected = expected_quantiles(values, LEVELS)
        numpy.testing.assert_array_equal(
            order_statistics.quantiles(random_parts(values, rng), LEVELS), expected
        )
    finite = numpy.abs(awkward_values(100_000, numpy.float64, 0))
    finite[numpy.isinf(finite)] = 0.0
    summary = order_statistics.quantile_summary(torch.from_numpy(finite), (0.5,))
    assert summary[-1] == pytest.approx(finite.mean(), rel=1e-12)
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select(torch.tensor([1.0, float("nan")]), [0])


@pytest.mark.parametrize("n", [1, 2, 7, SORT_WHOLE_AT_MOST + 1, 100_000])
def test_kept_quantile_summary_equals_numpy_on_the_elements_not_nan(n):
    """Ranks from the number kept, computed on the device: bit for bit, with
    none kept (no statistics) and all kept."""
    rng = numpy.random.default_rng(n)
    values = numpy.abs(awkward_values(n, numpy.float32, n))
    for left_out in (0.0, 0.3, 1.0):
        marked = values.copy()
        marked[rng.random(n) < left_out] = numpy.nan
        kept = marked[~numpy.isnan(marked)]
        count, summary = order_statistics.kept_quantile_summary(random_parts(marked, rng), LEVELS)
        got = _device.resolve(_device.PresentIfPositive(count, summary))
        if kept.size == 0:
            assert got == {}
            continue
        expected = expected_quantiles(kept, LEVELS)
        quantiles = got[: len(LEVELS)]
        numpy.testing.assert_array_equal(quantiles, expected)
        with numpy.errstate(invalid="ignore"):  # inf - inf
            mean = kept.astype(numpy.float64).mean()
        assert got[-1] == pytest.approx(mean, rel=1e-12, nan_ok=True)


def test_benchmark_script_checks_every_candidate_and_prints_its_table(capsys):
    """Smoke test (no timing asserted): each candidate is checked exact first."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_order_statistics.py"
    spec = importlib.util.spec_from_file_location("benchmark_order_statistics", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(["--quick"])
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1")]
    assert len(rows) == 2 * (len(module.CANDIDATES) + len(module.LAYER_CANDIDATES))


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_buckets_are_the_top_bits_of_the_float32_pattern(dtype):
    """Each element's bucket, of either sign, zeros, subnormals, infinities and NaN: the
    top ``_BUCKET_BITS`` bits of its float32 pattern read unsigned (sign bit first)."""
    from cockpit_gradnoise.order_statistics import buckets

    values = numpy.concatenate([awkward_values(5000, numpy.float64, seed=3),
                                [numpy.nan, -numpy.nan, 1e-45, -1e-45, 1e-310, -1e-310, -1.0, 1.0]])
    flat = torch.from_numpy(values.astype(dtype))
    patterns = flat.to(torch.float32).view(torch.int32).long() & 0xFFFFFFFF
    expected = patterns >> (32 - buckets._BUCKET_BITS)
    got = buckets._buckets(flat)
    assert got.dtype == torch.int32 and torch.equal(got.long(), expected)
    assert int(got.max()) >= buckets._SIGN  # negative values' buckets occur
