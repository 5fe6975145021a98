"""The union's brackets and each large array's own in one pass (issue 32: VGG-11's selections).

``order_statistics.bracket.select_bracketed_with_union`` counts every array once against
the union's brackets and, for the arrays with ranks of their own, theirs merged in; the
union's counts are read off each array's (``Tally.within``). Exact order statistics: each
value against a sort in float64, on spread values, ties, zeros of both signs, an SNR's
ties at its cap, constants, and arrays whose quantiles lie far from the union's (brackets
not merged) and near them (merged); sizes at and around ``BRACKET_AT_LEAST`` (set small).
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.functional import fused
from cockpit_gradnoise.order_statistics import bracket, partition
from cockpit_gradnoise.quantities import gradient_variance

import numpy
import pytest
import torch
from cockpit.utils.schedules import linear

from tests.cases import build, case_named, run_step
from tests.test_large_selection import bracket_cases
from tests.test_sd_over_sums import QUANTILES, check_against_reference

N = 300_007
RANKS = [0.0, 0.001, 0.05, 0.25, 0.5, 0.5001, 0.75, 0.95, 0.999, 1.0]


def ranks_of(fractions, n):
    return [min(int(f * n), n - 1) for f in fractions]


def sorted64(values):
    return numpy.sort(numpy.asarray(values, dtype=numpy.float64))


@pytest.mark.parametrize("case", ["spread", "mostly zeros", "ties", "sorted", "periodic", "constant", "capped"])
def test_union_and_each_array_equal_a_sort(case):
    """Three arrays: a small one, one drawn as the union (its brackets merge with the
    union's) and one shifted far from it (they do not); the union's values and each large
    array's at every kind of rank, including the first of the largest value's ties."""
    values = bracket_cases(N)[case]
    shifted = values[N // 3 :] * numpy.float32(4) + numpy.float32(10)
    arrays = [values[:7].copy(), values[7 : N // 3].copy(), shifted]
    copies = [a.copy() for a in arrays]
    union = sorted64(numpy.concatenate(arrays))
    first_top = int(numpy.searchsorted(union, union[-1]))
    union_ranks = ranks_of(RANKS, union.size) + [max(first_top - 1, 0), first_top]
    own_ranks = {k: ranks_of(RANKS, arrays[k].size) + [1, arrays[k].size - 2] for k in (1, 2)}
    found, own, totals = bracket.select_bracketed_with_union(arrays, union_ranks, own_ranks)
    assert found == union[union_ranks].tolist()
    assert own == {k: sorted64(arrays[k])[ranks].tolist() for k, ranks in own_ranks.items()}
    assert all(numpy.array_equal(a, c) for a, c in zip(arrays, copies))  # not reordered
    # The float64 sums taken in the pass: NumPy's own sums of float32 arrays, bit for bit
    # (float64 arrays, as "spread", are summed whole by the caller).
    expected = [float(a.sum(dtype=numpy.float64)) if a.dtype == numpy.float32 else None for a in arrays]
    assert [repr(total) for total in totals] == [repr(total) for total in expected]  # nan (inf - inf) too


def test_float64_arrays_and_nan():
    rng = numpy.random.default_rng(5)
    arrays = [rng.standard_normal(150_001), numpy.abs(rng.standard_normal(90_000)) * 1e-300]
    ranks = ranks_of(RANKS, 240_001)
    found, own, totals = bracket.select_bracketed_with_union(arrays, ranks, {0: ranks_of(RANKS, 150_001)})
    assert totals == [None, None]  # float64: NumPy sums the whole array pairwise, not by pieces
    assert found == sorted64(numpy.concatenate(arrays))[ranks].tolist()
    assert own[0] == sorted64(arrays[0])[ranks_of(RANKS, 150_001)].tolist()
    arrays[1][-5] = math.nan  # not in the sample: found by the pass
    with pytest.raises(ValueError, match="NaN"):
        bracket.select_bracketed_with_union(arrays, ranks, {0: [3]})


@pytest.mark.parametrize("n", [1, 8191, 8193, (1 << 18) - 1, 1 << 18, (1 << 18) + 1, 3 * (1 << 18) + 8191])
def test_sums_carried_over_the_pieces_are_numpys_sums(n):
    """``carried_sum`` over the pass's pieces equals ``values.sum(dtype=float64)`` of float32
    values spread over 40 orders of magnitude, with cancellation; not finite where an element
    is infinite (and the pass then finds a NaN by the piece's max)."""
    rng = numpy.random.default_rng(n)
    values = (rng.standard_normal(n) * numpy.exp(8 * rng.standard_normal(n))).astype(numpy.float32)
    tally = bracket.Tally([(0.0, 1.0)], summing=True)
    for start in range(0, n, bracket._PIECE):
        tally.add(values[start : start + bracket._PIECE])
    assert tally.total == float(values.sum(dtype=numpy.float64))
    values[n // 2] = numpy.inf
    assert bracket.carried_sum(values, 0.0) == math.inf
    values[n - 1] = math.nan
    tally = bracket.Tally([(0.0, 1.0)], summing=True)
    with pytest.raises(ValueError, match="NaN"):
        for start in range(0, n, bracket._PIECE):
            tally.add(values[start : start + bracket._PIECE])


def test_within_reads_what_a_tally_of_the_smaller_bracket_holds():
    """Negatives, zeros of both signs, ties at the outer bracket's top and at an inner one's
    end, in pieces: each inner bracket read off the outer tally holds the same counts and
    elements inside as a tally of its own (its top's ties counted apart where the outer's are)."""
    rng = numpy.random.default_rng(2)
    values = numpy.concatenate([rng.uniform(-3, 3, 5000), numpy.zeros(700), -numpy.zeros(300),
                                numpy.full(400, 2.0), numpy.full(90, 0.5)]).astype(numpy.float32)
    rng.shuffle(values)
    outer = bracket.Tally([(-1.0, 2.0)], [True])
    for start in range(0, values.size, 999):
        outer.add(values[start : start + 999])
    for low, high in [(-1.0, 2.0), (-0.5, 0.5), (0.0, 0.0), (0.5, 0.5), (0.1, 2.0), (-1.0, -0.2), (0.25, 1.5)]:
        alone = bracket.Tally([(low, high)], [high == 2.0])
        alone.add(values)
        below, inside, zeros, at_top = outer.within(low, high)
        assert (below, zeros) == (alone.below[0], alone.zeros[0])
        # The elements inside, gathered or counted as ties at the top (either way for a
        # bracket of one value).
        assert numpy.array_equal(numpy.sort(numpy.concatenate([inside, numpy.full(at_top, high, inside.dtype)])),
                                 numpy.sort(numpy.concatenate([alone.candidates(0),
                                                               numpy.full(alone.at_top[0], high, inside.dtype)])))
        assert at_top == (alone.at_top[0] if high == 2.0 else 0)


def test_a_bracket_of_one_value_gathers_nothing():
    """A bracket ``(c, c)`` (a quantile inside a long run of ties: an sd's zeros) counts its
    elements as zeros or ties, never gathers them, and gives its ranks and no others."""
    values = numpy.array([-1.0] * 3 + [0.0] * 4 + [1.0] * 5 + [2.0] * 6, numpy.float32)
    for value, first, last in ((0.0, 3, 7), (1.0, 7, 12)):
        tally = bracket.Tally([(value, value)])
        tally.add(values[:9])
        tally.add(values[9:])
        assert tally.candidates(0).size == 0
        assert [tally.at(rank) for rank in range(first, last)] == [value] * (last - first)
        assert tally.at(first - 1) is None and tally.at(last) is None


@pytest.mark.parametrize("sizes", [(4999, 3), (5000, 1), (5001, 0), (4998, 2), (2500, 2499)])
@pytest.mark.parametrize("case", ["mostly zeros", "capped"])
def test_summaries_read_each_array_once_at_and_around_the_threshold(monkeypatch, sizes, case):
    """With ``BRACKET_AT_LEAST`` at 5000 (above ``SORT_WHOLE_AT_MOST``, as the real one): arrays
    below, at and above it, unions just below and above it, with placeholder zeros; the
    summaries equal numpy.quantile of the kept values, and an array selected by its own
    brackets is read once, in the union's pass."""
    monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 5000)
    values = numpy.nan_to_num(numpy.abs(bracket_cases(sum(sizes) + 11)[case]), posinf=1e30)
    arrays = [values[: sizes[0]].copy(), values[sizes[0] : sum(sizes)].copy(), values[sum(sizes) :].copy()]
    left_out = [int(numpy.count_nonzero(a == 0)) // 2 for a in arrays]
    for a, z in zip(arrays, left_out):
        a[numpy.flatnonzero(a == 0)[:z]] = 0.0  # the placeholders (they sort first)
    read = []
    add = bracket.Tally.add
    monkeypatch.setattr(bracket.Tally, "add", lambda self, piece: (read.append(piece.size), add(self, piece)))
    levels = (0.0, 0.1, 0.5, 0.9, 1.0)
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels, left_out)

    def expected(parts, placeholders):
        kept = sorted64(numpy.concatenate(parts))[placeholders:]
        if kept.size == 0:
            return []
        return numpy.quantile(kept, levels).tolist() + [float(kept.sum()) / kept.size]
    assert union[:5] == expected(arrays, sum(left_out))[:5]
    assert math.isclose(union[5], expected(arrays, sum(left_out))[5], rel_tol=1e-12)
    assert [row[:5] for row in each] == [expected([a], z)[:5] for a, z in zip(arrays, left_out)]
    total = sum(a.size for a in arrays)
    # The union's pass (and no other) where it is large enough: each element read once.
    assert sum(read) == (total if total >= 5000 else 0)


def test_where_the_shared_brackets_miss_the_other_paths_are_exact(monkeypatch):
    """No margin: the union's ranks and the arrays' own miss (None), and the summaries come
    from the buckets or the partitions, still equal to numpy.quantile."""
    monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 1000)
    monkeypatch.setattr(bracket, "_MARGIN", 0.0)
    values = bracket_cases(N)["spread"]
    arrays = [values[:200_000].copy(), values[200_000:].copy()]
    found, own, _ = bracket.select_bracketed_with_union(arrays, [N // 3, N // 2 + 1], {0: [77_777, 100_001]})
    assert found is None and own == {0: None}
    levels = (0.2, 0.5)
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels)
    assert union[:2] == numpy.quantile(sorted64(values), levels).tolist()
    assert [row[:2] for row in each] == [numpy.quantile(sorted64(a), levels).tolist() for a in arrays]


def test_gradient_variance_quantiles_by_the_shared_pass_match_the_reference(monkeypatch):
    """End to end, VGG-11's route at a small size: sd and SNR over each layer's sums, the
    network's and the large layers' quantiles in one pass (thresholds lowered so that the
    test GPT's 256-element layers count as large), against the float64 per-example reference."""
    monkeypatch.setattr(gradient_variance, "OVER_SUMS_AT_LEAST", 0)
    monkeypatch.setattr(fused, "_JOINED_BELOW", 1)
    monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 200)
    monkeypatch.setattr(partition, "SORT_WHOLE_AT_MOST", 16)
    shared, select = [], bracket.select_bracketed_with_union

    def spy(arrays, union_ranks, own_ranks):
        found = select(arrays, union_ranks, own_ranks)
        shared.append((len(own_ranks), found[0] is not None and None not in found[1].values()))
        return found

    monkeypatch.setattr(partition, "select_bracketed_with_union", spy)
    case = case_named("gpt")
    problem = build(case, 5, "sum")
    quantity = cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=problem.names)
    cockpit = run_step(problem, [quantity])
    check_against_reference(cockpit, problem, case, 0)
    # sd, then SNR: 4 layers of 256 elements each; the paths of other devices select by torch
    # (the CPU's forced onto them: none of this pass).
    assert shared == ([(4, True), (4, True)] if _device.on_host(torch.zeros(1)) else [])
