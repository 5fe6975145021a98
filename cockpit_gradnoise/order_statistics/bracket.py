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
from typing import List, Optional, Sequence, Tuple

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


class Tally:
    """One pass over pieces: per bracket ``(low, high)``, the elements below it counted, those
    inside gathered (exact zeros counted, not gathered; where ``tops[k]``, the elements
    equal to ``high`` too); then values at ranks (:meth:`at`)."""

    def __init__(self, spans: List[Tuple[float, float]], tops: Optional[Sequence[bool]] = None):
        self.spans = spans
        # Ties at the upper end counted apart only where it is not 0 (zeros are counted already).
        self.tops = [bool(top) and high != 0.0 for top, (_, high) in
                     zip(tops if tops is not None else [False] * len(spans), spans)]
        self.below = [0] * len(spans)
        self.zeros = [0] * len(spans)
        self.at_top = [0] * len(spans)
        self.inside: List[List[numpy.ndarray]] = [[] for _ in spans]

    def add(self, piece: numpy.ndarray):
        """Count and gather the elements of a 1d piece. Raises ValueError on NaN."""
        if numpy.isnan(piece.max()):  # NumPy's max propagates NaN
            check_no_nan(math.nan)
        for k, (low, high) in enumerate(self.spans):
            self.below[k] += int(numpy.count_nonzero(piece < low))
            if self.tops[k]:  # the ties at high counted: the largest of the bracket
                self.at_top[k] += int(numpy.count_nonzero(piece == high))
                kept = (piece >= low) & (piece < high)
            else:
                kept = (piece >= low) & (piece <= high)
            if low <= 0.0 <= high:  # zeros counted, not gathered
                is_zero = piece == 0
                self.zeros[k] += int(numpy.count_nonzero(is_zero))
                kept &= ~is_zero
            self.inside[k].append(piece[kept])

    def at(self, rank: int) -> Optional[float]:
        """The value at ``rank`` of all elements added, or None where no bracket holds it."""
        for k in range(len(self.spans)):
            if isinstance(self.inside[k], list):
                self.inside[k] = numpy.concatenate(self.inside[k])
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
