"""The CPU's selection by buckets of bit patterns: two passes, a few candidates sorted.

The order of floats of one sign is the order of their bit patterns read as
integers, so the top 14 bits of each value as a float32 name a bucket, and the
buckets are ordered like the values: one ``torch.bincount`` over the buckets,
and a cumulative sum, say which bucket holds each wanted rank; only the
elements of those few buckets are gathered and sorted.
"""

from typing import Iterator, List, NamedTuple, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.order_statistics.ranks import SORT_WHOLE_AT_MOST, check_no_nan

import numpy
import torch
from torch import Tensor

# Buckets: the top 14 bits of each value as a float32 (sign, 8 exponent bits,
# 5 mantissa bits: 32 buckets per octave). 16 bits would gather fewer
# candidates where values crowd, but cost as much in tables of 65536 counts
# per tensor as they save. Rounding
# float64 to float32 keeps the order (ties aside), so float64 values are
# bucketed the same way, with small tables. Buckets >= _SIGN hold negative
# values, the largest magnitude last; _SPECIAL (+inf) and those above it, of
# either sign, hold inf and NaN.
_BUCKET_BITS = 14
_BUCKETS = 1 << _BUCKET_BITS
_SIGN = _BUCKETS // 2
_SPECIAL = 0x7F800000 >> (32 - _BUCKET_BITS)


def _chunks(flats: List[Tensor]) -> Iterator[Tensor]:
    for flat in flats:
        yield from _device.pieces(flat)


def _buckets(flat: Tensor) -> Tensor:
    """The bucket of each element, in ``[0, _BUCKETS)``: top bits of its float32 pattern
    (int32). A logical shift of the unsigned pattern in NumPy, one pass: torch's shift of
    int32 carries the sign along and needs a mask after it (a second pass: 52 against 20 us
    for 2**17 elements here)."""
    bits = flat.to(torch.float32).numpy().view(numpy.uint32)
    return torch.from_numpy((bits >> (32 - _BUCKET_BITS)).view(numpy.int32))


def select_on_host(
    flats_of: List[List[Tensor]], ranks: Sequence[Sequence[int]], union_ranks: Sequence[int] = ()
) -> Tuple[List[List[float]], List[float]]:
    """:func:`select_each_and_union` on the CPU (ranks already checked).

    Bucket "positions" are in value order: buckets of non-negative values
    (``0 .. B/2 - 1`` of ``B``) are ordered like their values, those of
    negative values (sign bit set) in reverse; position ``p`` is bucket
    ``B - 1 - p`` for ``p < B/2`` and bucket ``p - B/2`` above. The buckets of
    infinities and NaN are always gathered, so that a NaN is always seen.

    Exact zeros are counted, not gathered, where their two buckets (of
    ``+0.0`` and ``-0.0``, which also hold the tiniest subnormals) hold
    nothing else: a layer's sd is often mostly zeros (resnet18's last
    convolutions: 93-95%, from units no example activates), and gathering
    them would copy and sort most of the layer.
    """
    small = [small_group(flats) for flats in flats_of]
    # Small groups are sorted whole for their own ranks; for the union's they
    # are counted and filtered as one (a pass per tiny group, e.g. a
    # LayerNorm's 128 elements, cost more than its elements).
    smalls = [flat.numpy() for flats, is_small in zip(flats_of, small) if is_small
              for flat in flats]
    joined = numpy.concatenate(smalls) if smalls and union_ranks else None
    # First pass: count. Per large group, the counts of its non-empty buckets.
    counts = [None if is_small else _position_counts(flats)
              for flats, is_small in zip(flats_of, small)]
    wanted = _always_wanted()
    if union_ranks:
        union_count = numpy.zeros(_BUCKETS, dtype=numpy.int64)
        union_parts = [count for count in counts if count is not None]
        if smalls:
            union_parts.append(_position_counts([torch.from_numpy(joined)]))
        for count in union_parts:
            union_count[count.nonempty] += count.count
        union_counts = _Counts(numpy.arange(_BUCKETS), union_count, 0)
        union_holding = _holding(union_counts, union_ranks)
        wanted[union_counts.nonempty[union_holding]] = True
        _zeros_together(wanted)
    # Second pass: gather the candidates of the group's and the union's ranks.
    values, union_candidates, union_zeros = [], [], 0
    for flats, group_ranks, count, is_small in zip(flats_of, ranks, counts, small):
        if is_small:
            values.append(sorted_whole(flats)[list(group_ranks)].tolist())
            continue
        group_wanted = wanted.copy()
        holding = _holding(count, group_ranks)
        group_wanted[count.nonempty[holding]] = True
        _zeros_together(group_wanted)
        zeros_only = _zeros_only(count)
        gather = group_wanted.copy()
        if zeros_only:
            gather[_ZERO_POSITIONS] = False
        candidates = numpy.concatenate(list(_gathered(flats, gather)))
        candidates.sort()  # in place; NaN last (every NaN is a candidate)
        if candidates.size:
            check_no_nan(float(candidates[-1]))
        zeros = count.zeros if zeros_only and group_wanted[_ZERO_POSITIONS[0]] else 0
        indices = _indices(group_ranks, count, group_wanted, holding)
        values.append(with_zeros(candidates, zeros, indices).tolist())
        if union_ranks:
            union_candidates.append(candidates[wanted[_positions(candidates)]])
            union_zeros += count.zeros if zeros_only and wanted[_ZERO_POSITIONS[0]] else 0
    if not union_ranks:
        return values, []
    if smalls:
        union_candidates.append(joined[wanted[_positions(joined)]])
    candidates = numpy.concatenate(union_candidates)
    candidates.sort()
    indices = _indices(union_ranks, union_counts, wanted, union_holding)
    return values, with_zeros(candidates, union_zeros, indices).tolist()


class _Counts(NamedTuple):
    """A group's elements by bucket: the positions of the non-empty buckets
    (ascending), their numbers of elements, and the number of exact zeros."""

    nonempty: numpy.ndarray
    count: numpy.ndarray
    zeros: int


#: The positions of the buckets of +0.0 and -0.0.
_ZERO_POSITIONS = numpy.array([_SIGN, _SIGN - 1])


def sorted_whole(flats: List[Tensor]) -> numpy.ndarray:
    """All elements of a small group, sorted; an error if one is NaN (NaN sorts last)."""
    ordered = numpy.sort(numpy.concatenate([flat.numpy() for flat in flats]))
    check_no_nan(float(ordered[-1]))
    return ordered


def small_group(flats: List[Tensor]) -> bool:
    """Whether a group is sorted whole (:data:`SORT_WHOLE_AT_MOST`)."""
    return sum(flat.numel() for flat in flats) <= SORT_WHOLE_AT_MOST


def _zeros_together(wanted: numpy.ndarray):
    """Gather both zero buckets or neither: zeros are counted for the two together."""
    if wanted[_SIGN] or wanted[_SIGN - 1]:
        wanted[_SIGN] = wanted[_SIGN - 1] = True


def _zeros_only(counts: _Counts) -> bool:
    """Whether the zero buckets hold nothing but zeros."""
    if counts.zeros == 0:
        return False
    return counts.count[_in_zero_buckets(counts.nonempty)].sum() == counts.zeros


def _in_zero_buckets(positions: numpy.ndarray) -> numpy.ndarray:
    """Which of ``positions`` are those of the zero buckets."""
    return (positions == _ZERO_POSITIONS[0]) | (positions == _ZERO_POSITIONS[1])


def with_zeros(candidates: numpy.ndarray, zeros: int, indices: numpy.ndarray) -> numpy.ndarray:
    """``sorted(candidates + [0.0] * zeros)[indices]`` without forming it."""
    if zeros == 0:
        return candidates[indices]
    if candidates.size == 0:
        return numpy.zeros(len(indices))
    negative = numpy.searchsorted(candidates, 0.0, side="left")
    is_zero = (indices >= negative) & (indices < negative + zeros)
    shifted = numpy.where(indices >= negative + zeros, indices - zeros, indices)
    # Indices of zeros may point past the candidates; they are replaced by 0.
    found = candidates[numpy.minimum(shifted, candidates.size - 1)]
    return numpy.where(is_zero, 0.0, found)


def _position_counts(flats: List[Tensor]) -> _Counts:
    """:class:`_Counts` of the elements of ``flats``."""
    if small_group(flats):
        positions = numpy.concatenate([_positions(flat.numpy()) for flat in flats])
        nonempty, count = numpy.unique(positions, return_counts=True)
    else:
        counts = None
        for chunk in _chunks(flats):
            chunk_counts = torch.bincount(_buckets(chunk), minlength=_BUCKETS)
            counts = chunk_counts if counts is None else counts.add_(chunk_counts)
        counts = counts.numpy()
        counts = numpy.concatenate([counts[_SIGN:][::-1], counts[:_SIGN]])
        # On a boolean array: flatnonzero of the int64 counts is several times slower.
        nonempty = numpy.flatnonzero(counts != 0)
        count = counts[nonempty]
    # Exact zeros lie in the zero buckets: counted only where those hold anything.
    zeros = 0
    if _in_zero_buckets(nonempty).any():
        zeros = sum(flat.numel() - numpy.count_nonzero(flat.numpy()) for flat in flats)
    return _Counts(nonempty, count, int(zeros))


def _holding(counts: _Counts, ranks: Sequence[int]) -> numpy.ndarray:
    """For each rank, the index into ``counts.nonempty`` of the bucket that holds it."""
    return numpy.searchsorted(numpy.cumsum(counts.count), ranks, side="right")


def _indices(
    ranks: Sequence[int], counts: _Counts, wanted: numpy.ndarray, holding: numpy.ndarray
) -> numpy.ndarray:
    """Where each rank lies among the sorted candidates (the elements of ``wanted`` buckets).

    A rank is preceded by every element of the buckets below its own
    (``holding``: :func:`_holding`); among the candidates, only by those of
    the gathered buckets: the elements of the buckets left out are subtracted.
    """
    left_out = numpy.cumsum(numpy.where(wanted[counts.nonempty], 0, counts.count))
    return numpy.asarray(ranks, dtype=numpy.int64) - left_out[holding]


def _always_wanted() -> numpy.ndarray:
    """By position: the buckets of infinities and NaN, of either sign (a fresh array)."""
    return _ALWAYS_WANTED.copy()


_ALWAYS_WANTED = numpy.zeros(_BUCKETS, dtype=bool)
_ALWAYS_WANTED[: _SIGN - _SPECIAL] = True
_ALWAYS_WANTED[_SIGN + _SPECIAL :] = True


def _gathered(flats: List[Tensor], wanted: numpy.ndarray) -> Iterator[numpy.ndarray]:
    """The elements of ``flats`` in the buckets at ``wanted`` positions, piece by piece."""
    by_bucket = torch.from_numpy(numpy.concatenate([wanted[_SIGN:], wanted[:_SIGN][::-1]]))
    for chunk in _chunks(flats):
        yield _device.masked(chunk, by_bucket.index_select(0, _buckets(chunk))).numpy()


def _positions(values: numpy.ndarray) -> numpy.ndarray:
    """The bucket position of each of a few values (NumPy)."""
    buckets = _buckets(torch.from_numpy(values)).numpy()
    return numpy.where(buckets >= _SIGN, _BUCKETS - 1 - buckets, buckets + _SIGN)
