"""Selection and ratios where many values are 0, by pieces (issue 32: VGG-11's classifier).

``order_statistics.select_in_place`` and ``quantile_summaries_in_place`` select by the
buckets' two passes in pieces of ``_device.CHUNK`` where many values are 0, and
``functional.abs_ratio_statistics`` forms its ratios in pieces of ``_RATIO_PIECE``:
each against a sort of the same values, at sizes around the pieces' boundaries, with
ties, zeros of both signs, subnormals (which share the zero buckets), infinities and NaN.
"""

import math

from cockpit_gradnoise import _device, functional, order_statistics
from cockpit_gradnoise.functional import ratios
from cockpit_gradnoise.functional.ratios import _RATIO_PIECE
from cockpit_gradnoise.functional.underflow import underflow_floor
from cockpit_gradnoise.order_statistics import bracket, partition

import numpy
import pytest
import torch

CHUNK = _device.CHUNK
SIZES = [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]


def mostly_zeros(n, dtype, seed, *, non_negative=False, subnormals=True):
    """Values of which about 60% are 0 (half of them -0.0), with ties, infinities, and
    subnormals (in the zero buckets: then the zeros are gathered, else only counted)."""
    rng = numpy.random.default_rng(seed)
    values = rng.standard_normal(n) * numpy.exp(3 * rng.standard_normal(n))
    tied = rng.random(n) < 0.2
    values[tied] = numpy.round(values[tied], 1)
    if subnormals:
        values[rng.random(n) < 0.01] = numpy.finfo(dtype).smallest_subnormal * rng.integers(1, 5)
    values[rng.integers(n, size=3)] = numpy.inf
    if not non_negative:
        values[rng.integers(n)] = -numpy.inf
    zero = rng.random(n) < 0.6
    values[zero] = numpy.where(rng.random(int(zero.sum())) < 0.5, 0.0, -0.0)
    values = numpy.abs(values) if non_negative else values
    return values.astype(dtype)


@pytest.mark.parametrize("n, dtype, subnormals", [(n, numpy.float32, s) for n in SIZES for s in (True, False)]
                         + [(SIZES[-1], numpy.float64, True), (SIZES[-1], numpy.float64, False)])
@pytest.mark.parametrize("large", [False, True], ids=["zeros taken out", "buckets"])
def test_select_in_place_with_many_zeros_equals_sorted_values(monkeypatch, n, dtype, subnormals, large):
    """Below ``BRACKET_AT_LEAST`` the zeros are taken out; above it, where the brackets
    miss (made to here), the buckets count them."""
    if large:
        monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 1000)
        monkeypatch.setattr(partition, "select_bracketed", lambda arrays, ranks: None)
    values = mostly_zeros(n, dtype, seed=n, subnormals=subnormals)
    ordered = numpy.sort(values)
    negative, zeros = int(numpy.sum(values < 0)), int(numpy.sum(values == 0))
    # Ranks at both ends, at the zeros' edges (the last negative, first and last
    # zero, first positive: the subnormals next to them) and in the middle.
    ranks = [0, n - 1, negative - 1, negative, negative + zeros - 1, negative + zeros,
             negative + zeros + 1, n // 2, (n - 1) // 2, n - 2]
    got = order_statistics.select_in_place(values.copy(), ranks)
    assert got == ordered[ranks].astype(numpy.float64).tolist()
    with_nan = values.copy()
    with_nan[n - 1] = math.nan  # in the last piece
    with pytest.raises(ValueError, match="NaN"):
        order_statistics.select_in_place(with_nan, [n // 2])


def test_quantile_summaries_in_place_with_many_zeros_equal_numpy_on_the_kept_values():
    """The buckets' shared passes for each array and the union: bit for bit
    numpy.quantile of the kept values, placeholders left out; an array with
    nothing kept, and an empty one, have no summary."""
    levels = (0.0, 0.1, 0.5, 0.9, 1.0)
    sizes, left_out = [CHUNK + 1, 2 * CHUNK + 3, 7, CHUNK - 1], [CHUNK // 2, CHUNK, 3, 0]
    kept = [mostly_zeros(n - z, numpy.float32, seed=n, non_negative=True) for n, z in zip(sizes, left_out)]
    kept = [numpy.where(numpy.isinf(k), 7.0, k).astype(numpy.float32) for k in kept]
    rng = numpy.random.default_rng(0)
    arrays = [numpy.concatenate([numpy.zeros(z, numpy.float32), k]) for k, z in zip(kept, left_out)]
    for a in arrays:
        rng.shuffle(a)
    arrays += [numpy.zeros(5, numpy.float32), numpy.zeros(0, numpy.float32)]
    left_out += [5, 0]
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels, left_out)
    for values, summary in zip(kept, each):
        assert summary[: len(levels)] == numpy.quantile(values.astype(numpy.float64), levels).tolist()
        assert summary[-1] == pytest.approx(values.astype(numpy.float64).mean(), rel=1e-12)
    assert each[-2:] == [[], []]
    everything = numpy.concatenate(kept).astype(numpy.float64)
    assert union[: len(levels)] == numpy.quantile(everything, levels).tolist()
    assert union[-1] == pytest.approx(everything.mean(), rel=1e-12)


def reference_ratio_statistics(theta, grad):
    """The obvious computation: the kept ratios in float64 (a float32 ratio rounded as
    the package rounds it, then widened), their mean, numpy.median, min and max."""
    a, b = theta.numpy(), grad.numpy()
    with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = numpy.abs(a / b).astype(numpy.float64)
    kept = numpy.isfinite(a) & numpy.isfinite(b) & (b != 0)
    values = ratio[kept]
    return {"mean": values.mean(), "median": numpy.median(values), "min": values.min(),
            "max": values.max()}, int(numpy.sum(b == 0))


@pytest.mark.parametrize("n", [_RATIO_PIECE - 1, _RATIO_PIECE, _RATIO_PIECE + 1, 3 * _RATIO_PIECE + 5])
@pytest.mark.parametrize("finite", [True, False])
@pytest.mark.parametrize("path", ["whole", "brackets", "brackets missed"])
def test_ratio_statistics_by_pieces_equal_the_obvious_computation(monkeypatch, n, finite, path):
    """Gradients mostly 0 (the dead units of a classifier), ties, kept zeros (theta 0),
    a ratio too large for float32 (inf, kept), and where not ``finite``, infinities
    and NaN in both, in the first and last piece: left out."""
    rng = numpy.random.default_rng(n)
    theta = rng.standard_normal(n).astype(numpy.float32)
    grad = rng.standard_normal(n).astype(numpy.float32)
    grad[rng.random(n) < 0.6] = 0.0
    grad[rng.random(n) < 0.1] = -0.0
    theta[rng.random(n) < 0.05] = 0.0
    theta[rng.random(n) < 0.2] = 0.5  # ties
    grad[: n // 3 : 101] = numpy.float32(1e-39)  # subnormal: ratios around 1e38 and inf
    theta[1], grad[1] = 1e30, 1e-30
    if not finite:
        theta[[0, n - 1]], grad[[2, n - 2]] = [numpy.inf, numpy.nan], [-numpy.inf, numpy.nan]
    theta, grad = torch.from_numpy(theta), torch.from_numpy(grad)
    if path != "whole":  # ratios never formed whole (where the brackets hold the median)
        monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 1000)
    if path == "brackets missed":
        monkeypatch.setattr(bracket.Tally, "at", lambda self, rank: None)
    expected, zeros = reference_ratio_statistics(theta, grad)
    if path == "brackets":  # the path ran: its median's ranks lay in their bracket
        assert ratios._statistics_by_brackets(theta.numpy(), grad.numpy(), finite) is not None
    got, got_zeros = functional.abs_ratio_statistics_and_zeros(theta.clone(), grad.clone(), all_finite=finite)
    assert got_zeros == zeros
    assert {k: got[k] for k in ("median", "min", "max")} == {k: expected[k] for k in ("median", "min", "max")}
    assert got["mean"] == pytest.approx(expected["mean"], rel=1e-12)
    assert got["max"] == math.inf and got["min"] == 0.0


@pytest.mark.parametrize("n", [order_statistics.COUNT_PIECE - 1, 3 * order_statistics.COUNT_PIECE + 5])
def test_unresolved_sums_counted_by_pieces(n):
    """Dead units (S = T = 0) beside unresolved sums (S below the floor, not a dead unit),
    in every piece and at both ends: the count of the obvious whole-array masks."""
    rng = numpy.random.default_rng(n)
    squares = rng.random(n).astype(numpy.float32) + 1.0
    total = rng.standard_normal(n).astype(numpy.float32)
    dead = rng.random(n) < 0.5
    squares[dead], total[dead] = 0.0, 0.0
    lost = rng.random(n) < 0.01
    squares[lost] = numpy.where(rng.random(int(lost.sum())) < 0.5, 1e-40, 0.0)
    squares[[0, n - 1]], total[[0, n - 1]] = 0.0, 1.0  # S = 0 beside T != 0: unresolved
    floor = underflow_floor(2, torch.float32)
    expected = int(numpy.sum((squares < floor) & ~((squares == 0) & (total == 0))))
    assert expected > 2
    assert functional.unresolved_sums(torch.from_numpy(squares), torch.from_numpy(total), 2) == expected
    healthy = torch.from_numpy(squares[~dead & ~lost])
    assert functional.unresolved_sums(healthy, healthy, 2) is None


def bracket_cases(n):
    """Spread-out values; mostly zeros; sorted, reversed and periodic (a sample drawn at
    fixed strides would alias with them); one value repeated."""
    rng = numpy.random.default_rng(n)
    spread = mostly_zeros(n, numpy.float32, seed=n, subnormals=False)
    spread[rng.random(n) < 0.5] = rng.standard_normal(int(numpy.sum(rng.random(n) < 0.5)))[0]
    periodic = numpy.tile(rng.standard_normal(49).astype(numpy.float32), n // 49 + 1)[:n]
    ordered = numpy.sort(rng.standard_normal(n).astype(numpy.float32))
    return {"spread": rng.standard_normal(n).astype(numpy.float32) * numpy.exp(rng.standard_normal(n)),
            "mostly zeros": mostly_zeros(n, numpy.float32, seed=n), "ties": spread,
            "sorted": ordered, "reversed": ordered[::-1].copy(), "periodic": periodic,
            "constant": numpy.full(n, 0.25, numpy.float32), "capped": capped(n, rng)}


def capped(n, rng):
    """An SNR at batch 2: a third placeholder zeros, 45% at the cap (its largest value),
    the rest spread below it."""
    values = numpy.minimum(numpy.abs(rng.standard_normal(n)), 3.0).astype(numpy.float32)
    values[rng.random(n) < 0.45] = numpy.float32(3.0)
    values[rng.random(n) < 1 / 3] = 0.0
    return values


@pytest.mark.parametrize("case", ["spread", "mostly zeros", "ties", "sorted", "reversed", "periodic", "constant",
                                  "capped"])
def test_select_bracketed_is_exact(case):
    """Exactly a sort's values at every kind of rank (both ends, the middle, neighbours,
    either side of the first of the largest value's ties), of one array and of the union
    of its pieces; never None on these (a bracket that missed would only cost a pass,
    but then the test could not tell the path ran)."""
    n = 300_007
    values = bracket_cases(n)[case]
    ordered = numpy.sort(values)
    first_top = int(numpy.searchsorted(ordered, ordered[-1]))
    ranks = [0, n - 1, n // 2, n // 2 + 1, n // 10, (9 * n) // 10, 1, n - 2, 17]
    expected = ordered[ranks].astype(numpy.float64).tolist()
    assert bracket.select_bracketed([values], ranks) == expected
    parts = [values[:5], values[5 : n // 3], values[n // 3 :]]
    assert bracket.select_bracketed(parts, ranks) == expected
    # Ranks at the first of the largest value's ties, apart from the ends' ranks (whose
    # brackets, reaching past the sample, would merge with theirs): "capped" counts them.
    near = [max(first_top - 1, 0), first_top, (first_top + n) // 2]
    assert bracket.select_bracketed([values], near) == ordered[near].astype(numpy.float64).tolist()
    assert numpy.array_equal(values, bracket_cases(n)[case])  # not reordered


def test_ties_at_the_cap_are_counted_not_gathered():
    """The bracket of rank 0.8 n of an SNR with 30% of its elements at its cap ends at
    the cap: its ties are counted (the path of test_select_bracketed_is_exact's "capped"
    ranks at 0.9 n and at the first tie), the candidates gathered are the few below it.
    The bracket of 0.1 n, in the placeholder zeros, ends at 0: those are counted as zeros."""
    n = 300_007
    values = bracket_cases(n)["capped"]
    sample = bracket.sample_of([values], n)
    spans = bracket.brackets(sample, [0.8, 0.1])
    assert bracket.tied_tops(sample, spans) == [True, True] and [high for _, high in spans] == [0.0, 3.0]
    tally = bracket.Tally(spans, bracket.tied_tops(sample, spans))
    tally.add(values)
    assert tally.tops == [False, True] and tally.at_top == [0, int(numpy.sum(values == 3.0))]
    assert tally.zeros[0] == int(numpy.sum(values == 0))
    assert sum(part.size for part in tally.inside[1]) < n // 20


def test_a_tally_of_ties_at_a_brackets_top_gives_ranks_inside_it_only():
    """Zeros, values below the top and the ties at it, in order; a rank past the ties (or
    below the bracket) is not the bracket's: None, whatever the counts."""
    values = numpy.array([-1.0] * 3 + [0.0] * 4 + [0.5] * 2 + [1.0] * 5 + [2.0] * 6, numpy.float32)
    numpy.random.default_rng(0).shuffle(values)
    for spans, tops, first in (([(1.0, 1.0)], [True], 9), ([(-1.0, 1.0)], [True], 0)):
        tally = bracket.Tally(spans, tops)
        for piece in (values[:7], values[7:]):
            tally.add(piece)
        expected = numpy.sort(values)[first:14].astype(numpy.float64).tolist()
        assert [tally.at(rank) for rank in range(first, 14)] == expected
        assert tally.at(14) is None and tally.at(first - 1) is None and tally.at_top == [5]


def test_select_bracketed_refuses_nan_and_misses_without_a_margin(monkeypatch):
    n = 300_007
    values = bracket_cases(n)["spread"]
    with_nan = values.copy()
    with_nan[n - 3] = math.nan  # not in the sample: found by the pass
    with pytest.raises(ValueError, match="NaN"):
        bracket.select_bracketed([with_nan], [n // 2])
    # Brackets of a single sample value: a rank outside them is None, not a wrong value;
    # select_in_place then takes its other paths, and stays exact.
    monkeypatch.setattr(bracket, "_MARGIN", 0.0)
    ranks = [n // 2, n // 3 + 1, n // 7]
    assert bracket.select_bracketed([values], ranks) is None
    monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 1000)
    assert order_statistics.select_in_place(values.copy(), ranks) == numpy.sort(values)[ranks].tolist()


@pytest.mark.parametrize("missed", [False, True])
def test_quantile_summaries_in_place_by_brackets(monkeypatch, missed):
    """The union's quantiles by brackets (and, where they miss, made to here, by the
    buckets' shared passes), with placeholder zeros, as numpy.quantile of the kept values."""
    monkeypatch.setattr(partition, "BRACKET_AT_LEAST", 1000)
    if missed:
        monkeypatch.setattr(partition, "select_bracketed", lambda arrays, ranks: None)
        monkeypatch.setattr(partition, "select_bracketed_with_union",
                            lambda arrays, ranks, own: (None, {}, [None] * len(arrays)))
    test_quantile_summaries_in_place_with_many_zeros_equal_numpy_on_the_kept_values()
    rng = numpy.random.default_rng(3)
    arrays = [numpy.abs(rng.standard_normal(n)).astype(numpy.float32) for n in (200_000, 3, 90_000)]
    levels = (0.0, 0.25, 0.5, 1.0)
    each, union = order_statistics.quantile_summaries_in_place([a.copy() for a in arrays], levels)
    everything = numpy.concatenate(arrays).astype(numpy.float64)
    assert union[:4] == numpy.quantile(everything, levels).tolist()
    assert [row[:4] for row in each] == [numpy.quantile(a.astype(numpy.float64), levels).tolist() for a in arrays]
