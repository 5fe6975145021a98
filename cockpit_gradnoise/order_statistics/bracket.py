"""Exact selection in large arrays by a sample's brackets: one pass of comparisons, few candidates.

Floyd and Rivest's idea (1975, "Expected time bounds for selection", CACM 18(3)):
the sorted values of a random sample of ``m`` elements bracket the value at rank
``r`` of all ``n`` between the sample's values at ``r m / n -+ d``, with ``d``
a few standard deviations of that sample rank (:data:`_MARGIN` times ``sqrt(m)``).
One pass over the elements, in pieces, counts those below each bracket and
gathers those inside it (a comparison costs a tenth of a nanosecond per element
in NumPy, against about one for a 14-bit ``bincount``), and the rank is read
from the candidates by a partition. Exact whatever the sample: a rank that falls outside
its bracket's candidates (an unlucky sample) returns None, and the caller selects
another way. Exact zeros (of either sign) inside a bracket are counted, never
gathered: a layer's sd is often mostly zeros (dead units); so are the elements
equal to a bracket's upper end where the sample holds that value twice or more:
an SNR's ties at its cap (VGG-11 at batch 2) would otherwise fill the median's
bracket and its partition.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise.order_statistics.ranks import check_no_nan

import numpy

#: Elements of the sample: one in ``2**_SAMPLE_SHIFT``, at least ``_SAMPLE_AT_LEAST`` and at
#: most ``_SAMPLE`` (drawn and sorted: 10-20 ms at most).
_SAMPLE = 1 << 18
_SAMPLE_SHIFT = 7
_SAMPLE_AT_LEAST = 1 << 12

#: A bracket reaches ``_MARGIN * sqrt(m)`` sample ranks either side: the sample
#: rank of a value has a standard deviation of at most ``sqrt(m) / 2``, so a
#: rank falls outside its bracket about once in 10**9 (6 standard deviations),
#: while a bracket holds about ``2 * _MARGIN / sqrt(m)`` (1.2%) of the elements.
_MARGIN = 3.0

#: Elements per piece of the pass (a piece's masks stay in the cache's reach).
_PIECE = 1 << 18


def select_bracketed(arrays: Sequence[numpy.ndarray], ranks: Sequence[int]) -> Optional[List[float]]:
    """Values at 0-based ``ranks`` of the union of 1d float arrays, or None where a rank
    falls outside its bracket (select another way then). The arrays are not changed.

    Args:
        arrays: 1d float32 or float64 arrays (together at least ``_SAMPLE`` elements).
        ranks: Each ``0 <= rank <`` their total size, any order, repeats allowed.

    Raises:
        ValueError: If an element is NaN (no order).
    """
    n = sum(values.size for values in arrays)
    sample = sample_of(arrays, n)
    spans = brackets(sample, [rank / n for rank in ranks])
    tally = Tally(spans, tied_tops(sample, spans))
    for values in arrays:
        for start in range(0, values.size, _PIECE):
            tally.add(values[start : start + _PIECE])
    found = [tally.at(rank) for rank in ranks]
    return None if None in found else found


def select_bracketed_with_union(
    arrays: Sequence[numpy.ndarray], union_ranks: Sequence[int], own_ranks: Dict[int, Sequence[int]],
) -> Tuple[Optional[List[float]], Dict[int, Optional[List[float]]], List[Optional[float]]]:
    """:func:`select_bracketed` of the union of 1d float arrays at ``union_ranks`` and of some
    of the arrays alone at their ``own_ranks``, in one pass over each array.

    An array with ranks of its own is counted once against its brackets and the union's
    together (those that overlap merged into one: a large layer's quantiles often lie near
    the network's); the union's counts and candidates are then read off each array's
    (:meth:`Tally.within`), not from a second pass over it (VGG-11's 103M-element weight
    holds most of the network's elements). The same values as :func:`select_bracketed`
    of the union and of each array: exact order statistics whatever the brackets.

    Args:
        arrays: 1d float32 or float64 arrays (together at least ``_SAMPLE`` elements).
        union_ranks: 0-based ranks of the union, as :func:`select_bracketed`'s.
        own_ranks: ``{index of an array: its ranks}`` (each at least ``_SAMPLE`` elements).

    Returns:
        ``(the union's values or None, {index: the array's values or None}, totals)``, None
        where a rank fell outside its bracket; ``totals``: per array, the float64 sum of a
        float32 array's elements, taken in the same pass (:func:`carried_sum`: the number
        ``values.sum(dtype=numpy.float64)`` gives), None for other dtypes.

    Raises:
        ValueError: If an element is NaN (no order).
    """
    n = sum(values.size for values in arrays)
    union_sample = sample_of(arrays, n)
    union_spans = brackets(union_sample, [rank / n for rank in union_ranks])
    tallies = []
    for k, values in enumerate(arrays):
        spans, samples = union_spans, [union_sample]
        if k in own_ranks:
            samples.append(sample_of([values], values.size))
            spans = merged(union_spans + brackets(samples[-1], [rank / values.size for rank in own_ranks[k]]))
        tops = [any(tied) for tied in zip(*(tied_tops(sample, spans) for sample in samples))]
        tally = Tally(spans, tops, summing=values.dtype == numpy.float32)
        for start in range(0, values.size, _PIECE):
            tally.add(values[start : start + _PIECE])
        tallies.append(tally)
    own = {}
    for k, ranks in own_ranks.items():
        found = [tallies[k].at(rank) for rank in ranks]
        own[k] = None if None in found else found
    union = Tally(union_spans)
    for j, (low, high) in enumerate(union_spans):
        for tally in tallies:
            below, inside, zeros, at_top = tally.within(low, high)
            union.below[j] += below
            union.inside[j].append(inside)
            union.zeros[j] += zeros
            union.at_top[j] += at_top
    found = [union.at(rank) for rank in union_ranks]
    totals = [tally.total if tally.summing else None for tally in tallies]
    return (None if None in found else found), own, totals


def carried_sum(piece: numpy.ndarray, total: float) -> float:
    """``total`` plus the float64 sum of a float32 ``piece``, as NumPy carries its sum of a whole
    array over its buffers: summed piece by piece from 0.0 over pieces of a multiple of
    NumPy's buffer (8192 elements; :data:`_PIECE`), it equals ``values.sum(dtype=float64)``
    bit for bit (each buffer cast, added pairwise, and added to the running sum in turn;
    ``tests/test_shared_brackets.py`` checks sizes around the pieces). Not for float64
    arrays, whose sum NumPy takes pairwise over the whole array. Not finite where an element
    is NaN or infinite (a float32 sum in float64 cannot overflow)."""
    return float(piece.sum(dtype=numpy.float64, initial=total))


def merged(spans: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Brackets ``(low, high)`` in ascending order, those that overlap joined into one."""
    joined: List[Tuple[float, float]] = []
    for low, high in sorted(spans):
        if joined and low <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(joined[-1][1], high))
        else:
            joined.append((low, high))
    return joined


class Tally:
    """One pass over pieces: per bracket ``(low, high)``, the elements below it counted, those
    inside gathered (exact zeros counted, not gathered; where ``tops[k]``, the elements
    equal to ``high`` too); then values at ranks (:meth:`at`)."""

    def __init__(self, spans: List[Tuple[float, float]], tops: Optional[Sequence[bool]] = None,
                 summing: bool = False):
        self.spans = spans
        # Ties at the upper end counted apart only where it is not 0 (zeros are counted
        # already); a bracket of one value holds nothing else: all its elements are ties.
        self.tops = [(bool(top) or low == high) and high != 0.0 for top, (low, high) in
                     zip(tops if tops is not None else [False] * len(spans), spans)]
        self.below = [0] * len(spans)
        self.zeros = [0] * len(spans)
        self.at_top = [0] * len(spans)
        self.inside: List[List[numpy.ndarray]] = [[] for _ in spans]
        self._masks = numpy.empty((2, 0), dtype=bool)  # a piece's masks, reused
        #: Where ``summing`` (float32 pieces): the float64 sum of the elements added, carried
        #: from piece to piece (:func:`carried_sum`).
        self.summing, self.total = summing, 0.0

    def add(self, piece: numpy.ndarray):
        """Count and gather the elements of a 1d piece. Raises ValueError on NaN."""
        if self.summing:  # while the piece is in the cache; its max only where the sum is not finite
            self.total = carried_sum(piece, self.total)
            if not math.isfinite(self.total) and numpy.isnan(piece.max()):
                check_no_nan(math.nan)
        elif numpy.isnan(piece.max()):  # NumPy's max propagates NaN
            check_no_nan(math.nan)
        if self._masks.shape[1] < piece.size:
            self._masks = numpy.empty((2, piece.size), dtype=bool)
        below, kept = self._masks[:, : piece.size]
        for k, (low, high) in enumerate(self.spans):
            numpy.less(piece, low, out=below)
            self.below[k] += int(numpy.count_nonzero(below))
            if low == high:  # one value: its elements counted (as zeros or ties), none gathered
                numpy.equal(piece, high, out=kept)
                count = int(numpy.count_nonzero(kept))
                self.zeros[k] += count if high == 0.0 else 0
                self.at_top[k] += 0 if high == 0.0 else count
                self.inside[k].append(piece[:0])
                continue
            if self.tops[k]:  # the ties at high counted: the largest of the bracket
                numpy.equal(piece, high, out=kept)
                self.at_top[k] += int(numpy.count_nonzero(kept))
                numpy.less(piece, high, out=kept)
            else:
                numpy.less_equal(piece, high, out=kept)
            numpy.greater(kept, below, out=kept)  # and not below low (no NaN here)
            if low <= 0.0 <= high:  # zeros counted, not gathered
                numpy.equal(piece, 0, out=below)
                self.zeros[k] += int(numpy.count_nonzero(below))
                numpy.greater(kept, below, out=kept)
            self.inside[k].append(piece[kept])

    def candidates(self, k: int) -> numpy.ndarray:
        """The elements gathered inside bracket ``k``, as one array."""
        if isinstance(self.inside[k], list):
            self.inside[k] = numpy.concatenate(self.inside[k])
        return self.inside[k]

    def within(self, low: float, high: float) -> Tuple[int, numpy.ndarray, int, int]:
        """What a tally of the bracket ``(low, high)`` would hold of the elements added, read off
        the bracket of this one that contains it (there must be one): the elements below
        ``low``, those inside gathered (not 0, and not equal to ``high`` where ties at it are
        counted), the zeros inside, the ties at ``high`` counted apart."""
        k = next(k for k, (lower, upper) in enumerate(self.spans) if lower <= low and high <= upper)
        lower, upper = self.spans[k]
        candidates = self.candidates(k)
        below = self.below[k] + int(numpy.count_nonzero(candidates < low))
        zeros = 0
        if lower <= 0.0 <= upper:  # this bracket's zeros were counted apart
            if 0.0 < low:
                below += self.zeros[k]
            elif low <= 0.0 <= high:
                zeros = self.zeros[k]
        # Ties at this bracket's top (counted apart) are the new one's where the tops agree,
        # above it otherwise (upper > high).
        at_top = self.at_top[k] if upper == high else 0
        return below, candidates[(candidates >= low) & (candidates <= high)], zeros, at_top

    def at(self, rank: int) -> Optional[float]:
        """The value at ``rank`` of all elements added, or None where no bracket holds it."""
        for k in range(len(self.spans)):
            self.candidates(k)
            index, below_top = rank - self.below[k], self.inside[k].size + self.zeros[k]
            if 0 <= index - below_top < self.at_top[k]:
                return self.spans[k][1]
            value = _at(self.inside[k], self.zeros[k], index)
            if value is not None:
                return value
        return None


def _at(candidates: numpy.ndarray, zeros: int, index: int) -> Optional[float]:
    """The value at ``index`` of ``candidates`` and ``zeros`` zeros in ascending order, by a
    partition of ``candidates`` in place (a bracket's few percent of the elements);
    None where ``index`` lies outside them."""
    if not 0 <= index < candidates.size + zeros:
        return None
    if zeros:
        negative = int(numpy.count_nonzero(candidates < 0))
        if negative <= index < negative + zeros:
            return 0.0
        index = index if index < negative else index - zeros
    candidates.partition(index)
    return float(candidates[index])


def sample_of(arrays: Sequence[numpy.ndarray], n: int) -> numpy.ndarray:
    """A sample (:data:`_SAMPLE`) of the union's elements at positions drawn with a fixed seed (the same
    numbers at every call: no data-dependent randomness), sorted; NaN refused."""
    parts, start = [], 0
    positions = sample_positions(n)
    for values in arrays:
        mine = positions[(positions >= start) & (positions < start + values.size)] - start
        parts.append(values[mine])
        start += values.size
    sample = numpy.sort(numpy.concatenate(parts))
    check_no_nan(float(sample[-1]))  # NaN sorts last
    return sample


def sample_positions(n: int) -> numpy.ndarray:
    """The positions of :func:`sample_of`'s sample among ``n`` elements (fixed seed)."""
    size = min(max(n >> _SAMPLE_SHIFT, _SAMPLE_AT_LEAST), _SAMPLE)
    return numpy.random.default_rng(0).integers(0, n, size=size)


def tied_tops(sample: numpy.ndarray, spans: Sequence[Tuple[float, float]]) -> List[bool]:
    """Per bracket of a sorted ``sample``, whether the sample holds its upper end twice or
    more: then many elements may tie there (an SNR's cap), which :class:`Tally` counts."""
    ends = numpy.array([high for _, high in spans], dtype=sample.dtype)
    counts = numpy.searchsorted(sample, ends, "right") - numpy.searchsorted(sample, ends, "left")
    return [bool(count >= 2) for count in counts]


def brackets(sample: numpy.ndarray, fractions: Sequence[float]) -> List[Tuple[float, float]]:
    """The brackets ``(low, high)`` of the values at ``fractions`` (rank / size) of the
    elements a sorted ``sample`` was drawn from.

    A fraction's own bracket spans the sample's values ``_MARGIN sqrt(m)`` sample ranks
    below and above its place ``fraction m`` (``-inf``/``inf`` past the sample's ends);
    brackets that overlap are merged into one.
    """
    m, reach = sample.size, _MARGIN * math.sqrt(sample.size)
    merged: List[Tuple[float, float]] = []
    for fraction in sorted(set(fractions)):  # the spans' ends ascend with the fractions
        place = fraction * m
        lower, upper = math.floor(place - reach), math.ceil(place + reach)
        low = float(sample[lower]) if lower >= 0 else -math.inf
        high = float(sample[upper]) if upper < m else math.inf
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged
