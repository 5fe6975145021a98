"""Selection in 1d NumPy arrays the caller owns, by NumPy's partitions, reordering them.

No bucket passes, nothing gathered: where the caller may have its values
reordered (the arrays a quantity formed for this step), nested partitions
cost less than :mod:`~cockpit_gradnoise.order_statistics.buckets`' passes
where NumPy's selection runs at SIMD speed. Where it does not (the median of
a million values in about 6 ns per element on one AMD EPYC, against 1.5 elsewhere), the buckets'
passes cost a third to a fifth of the partitions from :data:`BUCKETS_AT_LEAST`
elements on: which of the two is cheaper is measured once per process
(:func:`partitions_cheaper`). The other exception, where partitions cost more: arrays (and unions) of
:data:`BRACKET_AT_LEAST` elements or more are selected by a sample's brackets
first (:mod:`~cockpit_gradnoise.order_statistics.bracket`: one pass of
comparisons), or where those miss and many values are 0, by the buckets (which
count zeros, never gather them): no copy of the array's size.
"""

import time
from typing import Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise.order_statistics.bracket import select_bracketed, select_bracketed_with_union
from cockpit_gradnoise.order_statistics.buckets import select_on_host
from cockpit_gradnoise.order_statistics.ranks import (
    SORT_WHOLE_AT_MOST,
    check_no_nan,
    interpolate,
    quantile_ranks,
)

import numpy
import torch

#: :func:`select_in_place` selects in arrays of at least this many elements by a sample's
#: brackets first (:mod:`~cockpit_gradnoise.order_statistics.bracket`: one pass of
#: comparisons, no partition, whatever the zeros), and the union of
#: :func:`quantile_summaries_in_place` likewise. Below it (resnet18's 11M elements and
#: its layers) the partitions cost less: the sample's fixed cost, 10-20 ms, is not
#: repaid, and copies of under 64 MB reuse freed memory instead of fresh pages.
BRACKET_AT_LEAST = 1 << 24

#: Arrays (and unions) of at least this many elements are selected by the buckets
#: (:func:`~cockpit_gradnoise.order_statistics.buckets.select_on_host`) where
#: :func:`partitions_cheaper` finds NumPy's partitions the dearer way on this machine: on one
#: AMD EPYC without NumPy's SIMD selection, 0.22 against 0.18 ms for the median and largest of
#: 2**15 elements, 2.5 against 0.5 ms for five levels' ranks of 147456, 20 against 3.8 ms of
#: 1.27M; below it the buckets' fixed cost (a table per array) is not repaid.
BUCKETS_AT_LEAST = 1 << 15

#: Whether NumPy's partitions select more cheaply than the buckets on this machine: None until
#: :func:`partitions_cheaper` has measured it (tests set it, to take either way).
PARTITIONS_CHEAPER: Optional[bool] = None


def partitions_cheaper() -> bool:
    """Whether NumPy's partitions select more cheaply than the buckets here, measured once per process.

    NumPy's selection runs at SIMD speed on some machines (one rank in about the time of two
    copies) and four times slower or more on others (on one AMD EPYC, NumPy 2.4.6: 7.9 ms
    for the median of 1.27M float32, a 160th of it for a copy); the buckets' passes
    (``bincount``, a gather) cost about the same everywhere. So both select the median
    and largest of a fixed array of ``2**17`` elements, alternately, three times each (about
    5 ms once, here), and the faster by its best time is taken. Exact either way: the same values
    at the same ranks, whichever is taken; only the time depends on it.
    """
    global PARTITIONS_CHEAPER
    if PARTITIONS_CHEAPER is None:
        values = numpy.random.default_rng(0).random(1 << 17, dtype=numpy.float32)
        ranks = [values.size // 2 - 1, values.size // 2, values.size - 1]
        best = {_select_by_partitions: float("inf"), _select_by_buckets: float("inf")}
        for _ in range(3):
            for way in best:
                copy = values.copy()
                start = time.process_time()
                way(copy, ranks)
                best[way] = min(best[way], time.process_time() - start)
        PARTITIONS_CHEAPER = best[_select_by_partitions] <= best[_select_by_buckets]
    return PARTITIONS_CHEAPER


def select_in_place(values: numpy.ndarray, ranks: Sequence[int]) -> List[float]:
    """Values at 0-based ``ranks`` of a 1d NumPy array the caller owns, reordering it.

    Exact, as :func:`select`, by nested partitions: ``ndarray.partition`` at
    one rank at a time (NumPy's SIMD selection does one rank in about the
    time of two copies; several ranks in one call fall back to a scalar
    introselect, ten times slower), the middle rank first, then the ranks
    below it in the part below, those above in the part above. A rank next
    to one already found is the largest (smallest) of the part beside it, and
    the smallest and largest ranks of a part are its ``min`` and ``max``:
    no partition for those. For the median and extremes of a million values,
    about 1.5 ns per element on one core, against 6.5 for a sort. Arrays of
    :data:`BRACKET_AT_LEAST` elements or more by a sample's brackets first
    (:func:`~cockpit_gradnoise.order_statistics.bracket.select_bracketed`: the sd of
    VGG-11's 129M elements at batch 2, 55% of them 0, in 0.11-0.12 s of one core,
    against 0.3 s by the buckets and 0.5-1.9 s by partitions after taking the zeros
    out), those of many zeros by the buckets; arrays of :data:`BUCKETS_AT_LEAST` elements
    or more that are not 0 (:func:`nonzero_at_least`) by the buckets where partitions are the
    dearer way here (:func:`partitions_cheaper`), fewer around their zeros.

    Args:
        values: 1d, float32 or float64, at least one element; reordered in
            place (the multiset is unchanged).
        ranks: Each ``0 <= rank < values.size``, any order, repeats allowed.

    Returns:
        One Python float per rank.

    Raises:
        ValueError: If an element is NaN (no order).
    """
    if values.size <= SORT_WHOLE_AT_MOST:  # a sort costs less than the calls then
        values.sort()
        check_no_nan(float(values[-1]))
        return values[list(ranks)].tolist()
    if by_brackets(values.size):
        found = select_bracketed([values], ranks)
        if found is not None:
            return found
    by_buckets = values.size >= BUCKETS_AT_LEAST and not partitions_cheaper()
    # Around its zeros where fewer than n/8 + 2**13 are not 0: the buckets read each element
    # twice, about 3 ns each, taking the zeros out reads it once, the rest's partitions cost
    # about 13 ns an element where they are the dearer way (on one AMD EPYC: even at half of
    # 2**15 not 0, the zeros' way still cheaper at half of 2**16 and an eighth of 2**18).
    if by_buckets and nonzero_at_least([values], (values.size >> 3) + (BUCKETS_AT_LEAST >> 2)):
        return _select_by_buckets(values, ranks)
    zeros = count_where(values, numpy.equal, 0)
    if zeros > values.size >> _MANY_ZEROS_SHIFT:
        if values.size >= BRACKET_AT_LEAST:  # no copy of the array's size
            return _select_by_buckets(values, ranks)
        return _select_around_zeros(values, ranks, zeros)
    if by_buckets:  # (the sample saw more zeros than there are)
        return _select_by_buckets(values, ranks)
    return _select_by_partitions(values, ranks)


def _select_by_partitions(values: numpy.ndarray, ranks: Sequence[int]) -> List[float]:
    """:func:`select_in_place` by nested partitions alone (:func:`_select_within`), the
    largest value by ``max``."""
    found: Dict[int, float] = {}
    largest = values.max()  # NaN if any is (NumPy's max propagates it)
    check_no_nan(float(largest))
    found[values.size - 1] = float(largest)
    _select_within(values, 0, sorted(set(ranks) - {values.size - 1}), found)
    return [found[rank] for rank in ranks]


def by_brackets(size: int) -> bool:
    """Whether :func:`select_in_place` selects in an array of ``size`` elements by a sample's
    brackets first (not by a sort, nor by partitions only)."""
    return size > SORT_WHOLE_AT_MOST and size >= BRACKET_AT_LEAST


def count_where(values: numpy.ndarray, test, *args) -> int:
    """``numpy.count_nonzero(test(values, *args))`` of a 1d array, counted in pieces of
    :data:`COUNT_PIECE` elements: no mask of the array's size (a network's
    elements: as much memory as a layer's sums), at a few percent of the time."""
    if values.size <= COUNT_PIECE:  # one piece (most layers): no generator of pieces
        return int(numpy.count_nonzero(test(values, *args)))
    return sum(int(numpy.count_nonzero(test(values[start : start + COUNT_PIECE], *args)))
               for start in range(0, values.size, COUNT_PIECE))


#: Elements per piece of :func:`count_where`.
COUNT_PIECE = 1 << 16


def nonzero_at_least(arrays: Sequence[numpy.ndarray], count: int) -> bool:
    """Whether about ``count`` elements of ``arrays`` or more are not 0: an array of more than
    :data:`SAMPLE_AT_MOST` elements is taken to hold its size times the share of nonzero
    elements in an evenly strided sample of at most that many, a smaller one its size (not
    read); the largest arrays first, until ``count`` is reached.

    Which exact way selects depends on it, no value does: both ways leave zeros out of the
    selection (the buckets count them, the partitions take them out first), so the buckets'
    fixed cost (tables of their counts) is repaid by the elements that are not 0. A table of
    positions mostly unused (GPT-2's position embedding past the sequence length: 94% of its
    sd 0) is selected around its zeros in a third of the buckets' time."""
    total = 0
    for values in sorted(arrays, key=lambda values: -values.size):
        if values.size <= SAMPLE_AT_MOST:
            total += values.size
        else:
            sample = values[:: -(-values.size // SAMPLE_AT_MOST)]
            total += values.size * int(numpy.count_nonzero(sample)) // sample.size
        if total >= count:
            return True
    return False


#: Elements read of each array by :func:`nonzero_at_least`, at most.
SAMPLE_AT_MOST = 1 << 10


#: :func:`select_in_place` takes the zeros out first where more than
#: ``1 / 2**_MANY_ZEROS_SHIFT`` of the values are 0: NumPy's partition slows
#: down tenfold to twentyfold on a value repeated that often (a layer's sd
#: where most units are dead: resnet18's last convolutions, 93-95% zeros),
#: and taking them out costs about one copy. Arrays of :data:`BRACKET_AT_LEAST`
#: elements or more whose brackets missed are selected by the buckets instead: the
#: copy's fresh pages cost more than the selection there (VGG-11's 129M sd at
#: batch 2, 55% zeros: 1.5 s of page faults, 0.1 s of copying).
_MANY_ZEROS_SHIFT = 4


def _select_around_zeros(values: numpy.ndarray, ranks: Sequence[int], zeros: int) -> List[float]:
    """:func:`select_in_place` of ``values`` holding ``zeros`` zeros (of either sign), by the others.

    The zeros hold the ranks from the number of negative values on; the other
    ranks are those of the values that are not 0, shifted past the zeros.
    """
    negative = int(numpy.count_nonzero(values < 0))
    rest = numpy.compress(values != 0, values)  # NaN is kept (and refused there)
    others = sorted({r if r < negative else r - zeros for r in ranks
                     if not negative <= r < negative + zeros})
    found = dict(zip(others, select_in_place(rest, others))) if others else {}
    if not others and rest.size:
        check_no_nan(float(rest.max()))
    return [0.0 if negative <= r < negative + zeros
            else found[r if r < negative else r - zeros] for r in ranks]


def _select_by_buckets(values: numpy.ndarray, ranks: Sequence[int]) -> List[float]:
    """:func:`select_in_place` of a large array of many zeros (of either sign): the same
    values, by :func:`~cockpit_gradnoise.order_statistics.buckets.select_on_host` (a count
    of the buckets of the values' top bits, then the few candidates of the wanted ranks'
    buckets gathered and sorted; the zeros counted, never gathered: memory of a piece,
    not of the array). ``values`` is left as it is."""
    (found,), _ = select_on_host([[torch.from_numpy(values)]], [list(ranks)])
    return found


def _select_within(part: numpy.ndarray, offset: int, ranks: List[int], found: Dict[int, float]):
    """:func:`select_in_place` on ``part``, whose smallest element has rank ``offset``.

    ``ranks``: sorted, distinct, within the part, none found yet.
    """
    if not ranks:
        return
    if ranks[0] == offset:  # the part's smallest
        found[offset] = float(part.min())
        ranks = ranks[1:]
    if ranks and ranks[-1] == offset + part.size - 1:  # its largest
        found[ranks[-1]] = float(part.max())
        ranks = ranks[:-1]
    if not ranks:
        return
    middle = len(ranks) // 2
    k = ranks[middle] - offset
    part.partition(k)
    found[ranks[middle]] = float(part[k])
    below, above = ranks[:middle], ranks[middle + 1 :]
    if below and below[-1] == ranks[middle] - 1:  # beside it: the largest below
        found[below.pop()] = float(part[:k].max())
    if above and above[0] == ranks[middle] + 1:  # the smallest above
        found[above.pop(0)] = float(part[k + 1 :].min())
    _select_within(part[:k], offset, below, found)
    _select_within(part[k + 1 :], offset + k + 1, above, found)


def quantile_summaries_in_place(
    arrays: Sequence[numpy.ndarray], levels: Sequence[float],
    left_out: Optional[Sequence[int]] = None, *, union: bool = True,
    joined: Optional[numpy.ndarray] = None,
) -> Tuple[List[List[float]], Optional[List[float]]]:
    """:func:`quantile_summaries` of 1d NumPy arrays the caller owns, reordering them.

    Each array's quantiles by :func:`select_in_place` on the array itself;
    the union's, after the arrays' own, on ``joined`` or else on one joined
    copy (each element copied once). Where partitions are the dearer way here
    (:func:`partitions_cheaper`) and the union holds :data:`BUCKETS_AT_LEAST` elements or
    more that are not 0 (:func:`nonzero_at_least`), all by the buckets' two shared passes
    instead (:func:`_summaries_by_buckets`: the same values). The means are float64 sums taken before any reordering.

    Args:
        arrays: 1d float32 or float64 arrays, non-negative where ``left_out``
            is given.
        levels: Quantile levels in ``[0, 1]``.
        left_out: Per array, how many of its elements are placeholders
            ``0.0`` for values left out (which sort first and add nothing to
            a sum: :func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise`);
            the statistics are those of the other elements. None: 0 each.
        union: Whether to compute the union's summary.
        joined: The union of ``arrays``, in any order (e.g. the buffer they
            are views of), reordered too; None: a copy is joined.

    Returns:
        ``(summary of each array, summary of the union)``, each as
        :func:`quantile_summary`'s: an empty list for
        an array with no kept element; the union's is ``None`` if not asked
        for, empty if no element is kept.
    """
    left_out = list(left_out) if left_out is not None else [0] * len(arrays)
    kept = [values.size - z for values, z in zip(arrays, left_out)]
    if union and sum(kept) and sum(values.size for values in arrays) >= BRACKET_AT_LEAST:
        union_summary, own, totals = _union_by_brackets(arrays, left_out, kept, levels)
        if union_summary is not None:
            return [_summary_in_place(values, z, n, total, levels, own.get(k))
                    for k, (values, z, n, total) in enumerate(zip(arrays, left_out, kept, totals))], union_summary
    else:
        totals = [float(values.sum(dtype=numpy.float64)) for values in arrays]
    size = sum(values.size for values in arrays)
    if union and (size >= BRACKET_AT_LEAST and _many_zeros(arrays)
                  or size >= BUCKETS_AT_LEAST and not partitions_cheaper()
                  and nonzero_at_least(arrays, BUCKETS_AT_LEAST)):
        return _summaries_by_buckets(arrays, left_out, kept, totals, levels)
    each = [_summary_in_place(values, z, n, total, levels)
            for values, z, n, total in zip(arrays, left_out, kept, totals)]
    if not union:
        return each, None
    if joined is None:
        joined = numpy.concatenate(arrays) if arrays else numpy.zeros(0)
    return each, _summary_in_place(joined, sum(left_out), sum(kept), sum(totals), levels)


def _union_by_brackets(arrays, left_out, kept, levels
                       ) -> Tuple[Optional[List[float]], Dict[int, List[float]], List[float]]:
    """The union's summary by brackets (one pass over the arrays, no joined copy), None where a
    rank fell outside its bracket; the values at the ranks of each array of
    :data:`BRACKET_AT_LEAST` elements or more that :func:`select_in_place` would select by
    brackets, found in the same pass
    (:func:`~cockpit_gradnoise.order_statistics.bracket.select_bracketed_with_union`: such an
    array is not read a second time), ``{index: values}`` where all its ranks were found; and
    each array's float64 sum (of a float32 array taken in the same pass: the same number)."""
    present = [k for k, values in enumerate(arrays) if values.size]
    own_ranks = {}
    for j, k in enumerate(present):
        if by_brackets(arrays[k].size) and kept[k]:
            own_lower, own_upper, _ = quantile_ranks(levels, kept[k])
            own_ranks[j] = [left_out[k] + rank for rank in own_lower + own_upper]
    lower, upper, weights = quantile_ranks(levels, sum(kept))
    found, own, summed = select_bracketed_with_union(
        [arrays[k] for k in present], [sum(left_out) + rank for rank in lower + upper], own_ranks)
    totals = [0.0] * len(arrays)
    for k, total in zip(present, summed):
        totals[k] = float(arrays[k].sum(dtype=numpy.float64)) if total is None else total
    if found is None:
        return None, {}, totals
    k = len(levels)
    return (interpolate(found[:k], found[k:], weights) + [sum(totals) / sum(kept)],
            {present[j]: values for j, values in own.items() if values is not None}, totals)


def _many_zeros(arrays: Sequence[numpy.ndarray]) -> bool:
    """Whether more than ``1 / 2**_MANY_ZEROS_SHIFT`` of the arrays' elements are 0, and they
    are more than a sort's worth (:data:`SORT_WHOLE_AT_MOST`)."""
    size = sum(values.size for values in arrays)
    return size > SORT_WHOLE_AT_MOST and (
        sum(count_where(values, numpy.equal, 0) for values in arrays) > size >> _MANY_ZEROS_SHIFT)


def _summaries_by_buckets(arrays, left_out, kept, totals, levels) -> Tuple[List[List[float]], List[float]]:
    """:func:`quantile_summaries_in_place` (with the union) where many values are 0: each
    array's and the union's quantiles in the buckets' two shared passes
    (:func:`~cockpit_gradnoise.order_statistics.buckets.select_on_host`: each element
    counted once and read once more for the candidates of its array's ranks and the
    union's; the zeros counted, never gathered), not a selection of each array and then
    one of the union (VGG-11 at batch 2: 53% of its sd 0). The arrays are left as they are;
    the same values at the same ranks, the means from ``totals``."""
    present = [k for k, values in enumerate(arrays) if values.size]
    ranks = {k: quantile_ranks(levels, kept[k]) for k in present if kept[k]}
    union_ranks = quantile_ranks(levels, sum(kept)) if sum(kept) else ([], [], [])
    found, union_found = select_on_host(
        [[torch.from_numpy(arrays[k])] for k in present],
        [[left_out[k] + rank for rank in ranks[k][0] + ranks[k][1]] if k in ranks else [] for k in present],
        [sum(left_out) + rank for rank in union_ranks[0] + union_ranks[1]],
    )
    by_array = dict(zip(present, found))
    each = [_summary_of_found(by_array.get(k, []), kept[k], totals[k], ranks.get(k), levels)
            for k in range(len(arrays))]
    return each, _summary_of_found(union_found, sum(kept), sum(totals), union_ranks, levels)


def _summary_of_found(found, kept, total, ranks, levels) -> List[float]:
    """Quantiles and mean from the values ``found`` at the lower and upper ``ranks``
    (:func:`~cockpit_gradnoise.order_statistics.ranks.quantile_ranks`); [] where none is kept."""
    if kept == 0:
        return []
    k = len(levels)
    return interpolate(found[:k], found[k:], ranks[2]) + [total / kept]


def _summary_in_place(values, left_out, kept, total, levels, found=None) -> List[float]:
    """Quantiles and mean of the ``kept`` elements of ``values`` above its ``left_out`` zeros
    (``found``: the values at their lower and upper ranks where known, else selected here)."""
    if kept == 0:
        return []
    lower, upper, weights = quantile_ranks(levels, kept)
    if found is None:
        found = select_in_place(values, [left_out + rank for rank in lower + upper])
    k = len(levels)
    return interpolate(found[:k], found[k:], weights) + [total / kept]
