"""Exact quantiles of tensors, and of the union of several, by selection.

One implementation serves every quantile the package reports (the
quantities, :mod:`cockpit_gradnoise.minibatch`): :func:`select` finds the
values at given ranks of all elements of one or several tensors, and
:func:`quantiles` interpolates between them exactly as ``numpy.quantile``
does with its default ``"linear"`` method, so the results equal
``numpy.quantile(values.astype(numpy.float64), levels)`` bit for bit.

How :func:`select` avoids sorting every element: the order of floats of one
sign is the order of their bit patterns read as integers, so the top 14
bits of each value as a float32 (sign, exponent, leading mantissa bits) name
a bucket, and the buckets are ordered like the values.
One ``torch.bincount`` over the buckets of every tensor, and a cumulative
sum, say which bucket holds each wanted rank; only the elements of those few
buckets are gathered and sorted (a few percent of them for a spread of values
like a layer's). A union of tensors is never concatenated, and the passes go
through pieces of :data:`~cockpit_gradnoise._device.CHUNK` elements, so the
extra memory is under 1 MiB whatever the size. The quantiles of each layer
and of the whole network (:func:`select_each_and_union`) share both passes:
the network's counts are the sum of the layers', and one gathering serves
both. Small unions (:data:`SORT_WHOLE_AT_MOST`) are sorted whole, which is
faster there.
``benchmarks/benchmark_order_statistics.py`` measures both against sorting
and partitioning.

Where the caller owns the values and may have them reordered (the arrays a
quantity formed for this step: :func:`select_in_place`,
:func:`quantile_summaries_in_place`), NumPy's partitions are cheaper still:
no bucket passes, nothing gathered; the union is then one joined array.

That is the CPU's path. On other devices (GPUs) the union is sorted with
``torch.sort``, and :func:`quantile_summary` (``defer=True``) and
:func:`kept_quantile_summary` leave their results there as tensors: no
result whose size depends on the data, nothing read back by the host until
the step's one transfer (``docs/quantities.md``).
"""

import math
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

from cockpit_gradnoise import _device
from cockpit_gradnoise.logs.schema import MEAN, quantile_name

import numpy
import torch
from torch import Tensor

Tensors = Union[Tensor, Sequence[Tensor]]

#: Unions of at most this many elements are sorted whole: a sort that small
#: costs no more than a bucket selection's fixed overhead, with or without
#: NumPy's SIMD sort (``benchmarks/benchmark_order_statistics.py`` times both).
SORT_WHOLE_AT_MOST = 1 << 12


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


def check_quantile_levels(quantiles: Iterable[float]) -> Tuple[float, ...]:
    """Validate quantile levels and return them as a tuple of floats.

    Args:
        quantiles: Levels in ``[0, 1]``, at least one.

    Returns:
        The levels, in the given order.

    Raises:
        ValueError: If ``quantiles`` is empty, not numeric, or has a level
            outside ``[0, 1]``.
    """
    try:
        levels = tuple(float(q) for q in quantiles)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"quantiles must be an iterable of numbers in [0, 1], got {quantiles!r}"
        ) from error
    if not levels:
        raise ValueError("quantiles must not be empty: pass e.g. quantiles=(0.5,)")
    bad = [q for q in levels if not 0.0 <= q <= 1.0]
    if bad:
        raise ValueError(f"quantile levels must lie in [0, 1], got {bad}")
    return levels


def quantile_ranks(levels: Sequence[float], n: int) -> Tuple[List[int], List[int], List[float]]:
    """Ranks and weights of ``numpy.quantile``'s linear method for ``n`` values.

    For sorted values ``v_0 <= ... <= v_{n-1}`` and level ``q``: ``h = (n - 1) q``,
    ``k = floor(h)``; the quantile lies between ``v_k`` and ``v_{k+1}`` (both
    ``v_{n-1}`` at the top) with weight ``t = h - k`` on the upper one.

    Returns:
        ``(lower ranks, upper ranks, weights)``, one entry per level.
    """
    lower, upper, weights = [], [], []
    for level in levels:
        position = (n - 1) * float(level)
        k = min(math.floor(position), n - 1)
        lower.append(k)
        upper.append(min(k + 1, n - 1))
        weights.append(position - k)
    return lower, upper, weights


def interpolate(
    lower: Sequence[float], upper: Sequence[float], weights: Sequence[float]
) -> List[float]:
    """``a + t (b - a)`` per level, computed as NumPy's ``_lerp`` does.

    From ``b`` when ``t >= 0.5`` (``b - (1 - t)(b - a)``), so results equal
    ``numpy.quantile``'s bit for bit.
    """
    result = []
    for a, b, t in zip(lower, upper, weights):
        diff = b - a
        result.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return result


def select(tensors: Tensors, ranks: Sequence[int]) -> List[float]:
    """Values at 0-based ``ranks`` of all elements of ``tensors``, in ascending order.

    Exact, for one tensor or the union of several (never concatenated when
    large). Any sign, ``-0.0`` (equal to ``0.0``) and infinities are handled.
    Float16 and bfloat16 are compared as float32, other non-float32 dtypes,
    and unions of mixed dtypes, as float64 (exact).

    On other devices than the CPU the union is sorted there with torch
    (fast on a GPU) and the host waits once, for the values and the NaN
    check together (see :func:`quantile_summary` for no wait at all).

    Args:
        tensors: A tensor of any shape, or a sequence of them.
        ranks: Each ``0 <= rank <`` the total number of elements.

    Returns:
        One Python float per rank.

    Raises:
        ValueError: If there are no elements, a rank is out of range, or an
            element is NaN (no order; ``numpy.quantile`` returns NaN then).
    """
    flats = _flat_tensors(tensors)
    _check_ranks(flats, ranks)
    if not _device.on_host(flats[0]):
        ordered = _sorted_on_device(flats)
        # NaN sorts last: the last value tells whether there is one.
        *values, last = _device.transfer([ordered[r] for r in ranks] + [ordered[-1]])
        _check_no_nan(last)
        return values
    (values,), _ = _select_on_host([flats], [ranks])
    return values


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
    about 1.5 ns per element on one core, against 6.5 for a sort.

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
        _check_no_nan(float(values[-1]))
        return values[list(ranks)].tolist()
    zeros = count_where(values, numpy.equal, 0)
    if zeros > values.size >> _MANY_ZEROS_SHIFT:
        return _select_around_zeros(values, ranks, zeros)
    found: Dict[int, float] = {}
    largest = values.max()  # NaN if any is (NumPy's max propagates it)
    _check_no_nan(float(largest))
    found[values.size - 1] = float(largest)
    _select_within(values, 0, sorted(set(ranks) - {values.size - 1}), found)
    return [found[rank] for rank in ranks]


def count_where(values: numpy.ndarray, test, *args) -> int:
    """``numpy.count_nonzero(test(values, *args))`` of a 1d array, counted in pieces of
    :data:`COUNT_PIECE` elements: no mask of the array's size (a network's
    elements: as much memory as a layer's sums), at a few percent of the time."""
    return sum(int(numpy.count_nonzero(test(values[start : start + COUNT_PIECE], *args)))
               for start in range(0, values.size, COUNT_PIECE))


#: Elements per piece of :func:`count_where`.
COUNT_PIECE = 1 << 16


#: :func:`select_in_place` takes the zeros out first where more than
#: ``1 / 2**_MANY_ZEROS_SHIFT`` of the values are 0: NumPy's partition slows
#: down tenfold to twentyfold on a value repeated that often (a layer's sd
#: where most units are dead: resnet18's last convolutions, 93-95% zeros),
#: and taking them out costs about one copy.
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
        _check_no_nan(float(rest.max()))
    return [0.0 if negative <= r < negative + zeros
            else found[r if r < negative else r - zeros] for r in ranks]


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


def select_each_and_union(
    groups: Sequence[Tensors], ranks: Sequence[Sequence[int]], union_ranks: Sequence[int]
) -> Tuple[List[List[float]], List[float]]:
    """:func:`select` of each group, and of the union of all groups, sharing the work.

    What the network's statistics need beside its layers': every element is
    counted once, the union's counts are the sum of the groups', and each
    element is read once more to gather the candidates of both its group's
    ranks and the union's.

    Args:
        groups: Each a tensor or a sequence of tensors (with elements).
        ranks: Per group, ranks into its elements.
        union_ranks: Ranks into the elements of all groups.

    Returns:
        ``(values of each group's ranks, values of the union's ranks)``.
    """
    flats_of = [_flat_tensors(group) for group in groups]
    for flats, group_ranks in zip(flats_of, ranks):
        _check_ranks(flats, group_ranks)
    _check_ranks([flat for flats in flats_of for flat in flats], union_ranks)
    if not _device.on_host(flats_of[0][0]):
        union = _flat_tensors([flat for flats in flats_of for flat in flats])
        return [select(f, r) for f, r in zip(flats_of, ranks)], select(union, union_ranks)
    return _select_on_host(flats_of, ranks, union_ranks)


def _check_ranks(flats: List[Tensor], ranks: Sequence[int]):
    n = sum(flat.numel() for flat in flats)
    if n == 0:
        raise ValueError("no elements to take quantiles of: pass at least one value")
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"ranks must lie in [0, {n}), got {bad}")


def _check_no_nan(largest: float):
    if math.isnan(largest):
        raise ValueError(
            "values contain NaN, which has no order: quantiles are undefined; "
            "leave them out first, e.g. values[~values.isnan()]"
        )


def quantiles(tensors: Tensors, levels: Sequence[float]) -> List[float]:
    """``numpy.quantile`` (linear method) of all elements of ``tensors``, exactly.

    Args:
        tensors: A tensor, or a sequence of tensors whose union is meant.
        levels: Quantile levels in ``[0, 1]``.

    Returns:
        One Python float per level: ``numpy.quantile(union.astype(float64), levels)``.
    """
    flats = _flat_tensors(tensors)
    lower, upper, weights = quantile_ranks(levels, sum(flat.numel() for flat in flats))
    values = select(flats, lower + upper)
    return interpolate(values[: len(levels)], values[len(levels) :], weights)


def quantile_summary(
    tensors: Tensors, levels: Sequence[float], prefix: str = "", *, defer: bool = False
) -> Dict[str, float]:
    """Quantiles ``q<level>`` and ``mean`` of all elements of ``tensors``.

    Args:
        tensors: A tensor with at least one element, or a sequence of tensors
            whose union is meant.
        levels: Quantile levels in ``[0, 1]``.
        prefix: Prepended to every statistic name (e.g. ``"snr_"``).
        defer: On other devices than the CPU, return 0-dim float64 tensors
            left on the device (the host does not wait; a NaN then gives NaN
            instead of an error), for one transfer with the step's other
            statistics (:func:`cockpit_gradnoise._device.resolve`). No
            effect on CPU tensors.

    Returns:
        ``{prefix + "q<level>": float, ..., prefix + "mean": float}``; the
        mean is summed in float64.
    """
    flats = _flat_tensors(tensors)
    if flats and not _device.on_host(flats[0]):
        ordered = _sorted_on_device(flats)
        summary = _summary_of_sorted(ordered, flats, len(ordered), levels, prefix)
        if defer:
            return summary
        summary, last = _device.resolve((summary, ordered[-1]))
        _check_no_nan(last)
        return summary
    _check_ranks(flats, [0])
    n = sum(flat.numel() for flat in flats)
    lower, upper, weights = quantile_ranks(levels, n)
    if _small(flats):
        # A batch's per-example norms, a LayerNorm's sd: one sort, no bucket passes.
        ordered = _sorted_whole(flats)
        values = ordered[lower + upper].tolist()
        mean = float(ordered.sum(dtype=numpy.float64)) / n
    else:
        (values,), _ = _select_on_host([flats], [lower + upper])
        mean = sum(map(float64_sum, flats)) / n
    k = len(levels)
    return _named(levels, prefix, interpolate(values[:k], values[k:], weights), mean)


def quantile_summaries(
    groups: Sequence[Tensors], levels: Sequence[float], prefix: str = "", *, defer: bool = False
) -> Tuple[List[Dict[str, float]], Dict[str, float]]:
    """:func:`quantile_summary` of each group, and of the union of all groups.

    A network's statistics beside its layers': on the CPU each element is
    counted and summed once for both (:func:`select_each_and_union`); the
    union's mean adds the groups' float64 sums.

    Args:
        groups: Each a tensor or a sequence of tensors, with elements.
        levels: Quantile levels in ``[0, 1]``.
        prefix: Prepended to every statistic name.
        defer: As for :func:`quantile_summary`.

    Returns:
        ``(summary of each group, summary of the union)``.
    """
    flats_of = [_flat_tensors(group) for group in groups]
    if not _device.on_host(flats_of[0][0]):
        union = [flat for flats in flats_of for flat in flats]
        each = [quantile_summary(flats, levels, prefix, defer=defer) for flats in flats_of]
        return each, quantile_summary(union, levels, prefix, defer=defer)
    sizes = [sum(flat.numel() for flat in flats) for flats in flats_of]
    totals = [sum(map(float64_sum, flats)) for flats in flats_of]
    ranks = [quantile_ranks(levels, n) for n in sizes]
    union_ranks = quantile_ranks(levels, sum(sizes))
    values, union_values = select_each_and_union(
        flats_of, [lower + upper for lower, upper, _ in ranks], union_ranks[0] + union_ranks[1]
    )
    k = len(levels)
    each = [
        _named(levels, prefix, interpolate(found[:k], found[k:], weights), total / n)
        for found, (_, _, weights), total, n in zip(values, ranks, totals, sizes)
    ]
    union = interpolate(union_values[:k], union_values[k:], union_ranks[2])
    return each, _named(levels, prefix, union, sum(totals) / sum(sizes))


def quantile_summaries_in_place(
    arrays: Sequence[numpy.ndarray], levels: Sequence[float], prefix: str = "",
    left_out: Optional[Sequence[int]] = None, *, union: bool = True,
    joined: Optional[numpy.ndarray] = None,
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`quantile_summaries` of 1d NumPy arrays the caller owns, reordering them.

    Each array's quantiles by :func:`select_in_place` on the array itself;
    the union's, after the arrays' own, on ``joined`` or else on one joined
    copy (each element copied once). The means are float64 sums taken
    before any reordering.

    Args:
        arrays: 1d float32 or float64 arrays, non-negative where ``left_out``
            is given.
        levels: Quantile levels in ``[0, 1]``.
        prefix: Prepended to every statistic name.
        left_out: Per array, how many of its elements are placeholders
            ``0.0`` for values left out (which sort first and add nothing to
            a sum: :func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise`);
            the statistics are those of the other elements. None: 0 each.
        union: Whether to compute the union's summary.
        joined: The union of ``arrays``, in any order (e.g. the buffer they
            are views of), reordered too; None: a copy is joined.

    Returns:
        ``(summary of each array, summary of the union)``: an empty dict for
        an array with no kept element; the union's is ``None`` if not asked
        for, empty if no element is kept.
    """
    left_out = list(left_out) if left_out is not None else [0] * len(arrays)
    each, totals, kept = [], [], []
    for values, z in zip(arrays, left_out):
        kept.append(values.size - z)
        totals.append(float(values.sum(dtype=numpy.float64)))
        each.append(_summary_in_place(values, z, kept[-1], totals[-1], levels, prefix))
    if not union:
        return each, None
    if joined is None:
        joined = numpy.concatenate(arrays) if arrays else numpy.zeros(0)
    return each, _summary_in_place(joined, sum(left_out), sum(kept), sum(totals), levels, prefix)


def _summary_in_place(values, left_out, kept, total, levels, prefix) -> Dict[str, float]:
    """Quantiles and mean of the ``kept`` elements of ``values`` above its ``left_out`` zeros."""
    if kept == 0:
        return {}
    lower, upper, weights = quantile_ranks(levels, kept)
    found = select_in_place(values, [left_out + rank for rank in lower + upper])
    k = len(levels)
    return _named(levels, prefix, interpolate(found[:k], found[k:], weights), total / kept)


def _named(levels, prefix, quantile_values, mean) -> Dict[str, float]:
    """``{prefix + "q<level>": value, ..., prefix + "mean": mean}``."""
    result = {quantile_name(level, prefix): v for level, v in zip(levels, quantile_values)}
    result[prefix + MEAN] = mean
    return result


def kept_quantile_summary(
    tensors: Tensors, levels: Sequence[float], prefix: str = ""
) -> _device.PresentIfPositive:
    """:func:`quantile_summary` of the elements that are not NaN, left on the device.

    For data-dependent selections without data-dependent shapes (which make
    the host wait): the elements left out are marked NaN, which sorts last,
    and the ranks are computed on the device from the number kept. Exact as
    :func:`quantile_summary` on the kept elements. For tensors on any device
    (used on devices other than the CPU).

    Returns:
        A :class:`~cockpit_gradnoise._device.PresentIfPositive` over the number
        kept: the summary exists only when some element is kept.
    """
    flats = _flat_tensors(tensors)
    if not flats:
        return _device.PresentIfPositive(0, {})
    ordered = _sorted_on_device(flats)
    kept = torch.stack([(~flat.isnan()).sum() for flat in flats]).sum()
    return _device.PresentIfPositive(kept, _summary_of_sorted(ordered, flats, kept, levels, prefix))


def _sorted_on_device(flats: List[Tensor]) -> Tensor:
    """The union sorted ascending with torch, NaN last: no data-dependent shape."""
    return torch.sort(flats[0] if len(flats) == 1 else torch.cat(flats)).values


def _summary_of_sorted(ordered, flats, count, levels, prefix) -> Dict[str, Tensor]:
    """Quantiles and mean of the first ``count`` of ``ordered`` (the union of ``flats``).

    ``count``: the number of elements (an int), or a 0-dim tensor with the
    number that are not NaN (the others sort last). 0-dim float64 tensors,
    computed as :func:`quantile_ranks` and :func:`interpolate` compute them,
    so equal to ``numpy.quantile`` bit for bit.
    """
    if isinstance(count, int):
        lower, upper, weights = quantile_ranks(levels, count)
        a = [ordered[k].double() for k in lower]
        b = [ordered[k].double() for k in upper]
        values = interpolate(a, b, weights)
        total = sum(_device.float64_total(flat) for flat in flats)
    else:
        last = (count - 1).clamp(min=0)
        values = []
        for level in levels:
            position = (count - 1).double() * float(level)
            k = torch.minimum(position.floor(), last).clamp(min=0)
            t = position - k
            a = ordered.gather(0, k.long().reshape(1))[0].double()
            b = ordered.gather(0, torch.minimum(k + 1, last).long().reshape(1))[0].double()
            diff = b - a
            values.append(torch.where(t >= 0.5, b - diff * (1 - t), a + diff * t))
        total = sum(_device.float64_total(flat, skip_nan=True) for flat in flats)
    result = {quantile_name(level, prefix): value for level, value in zip(levels, values)}
    result[prefix + MEAN] = total / count
    return result


def float64_sum(tensor: Tensor) -> float:
    """Sum of all elements, accumulated in float64, as a Python float."""
    if _device.on_host(tensor):
        # By pieces: torch converts the whole input to float64 first (8 bytes
        # per element at once); pieces keep that small and take half the
        # time of NumPy's blockwise float64 sum.
        return math.fsum(piece.sum(dtype=torch.float64).item() for piece in _device.pieces(tensor))
    return _device.float64_total(tensor.reshape(-1)).item()


def _flat_tensors(tensors: Tensors) -> List[Tensor]:
    """Detached 1d float32 or float64 views (or copies) of the non-empty tensors."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    flats = [t.detach().reshape(-1) for t in tensors if t.numel() > 0]
    dtypes = {flat.dtype for flat in flats}
    if dtypes <= {torch.float32} or dtypes <= {torch.float64}:
        return flats
    # Converting to a wider float is exact and keeps the order.
    narrow = {torch.float16, torch.bfloat16, torch.float32}
    common = torch.float32 if dtypes <= narrow else torch.float64
    return [flat.to(common) for flat in flats]


def _chunks(flats: List[Tensor]) -> Iterator[Tensor]:
    for flat in flats:
        yield from _device.pieces(flat)


def _buckets(flat: Tensor) -> Tensor:
    """The bucket of each element, in ``[0, _BUCKETS)``: top bits of its float32 pattern."""
    bits = flat.to(torch.float32).view(torch.int32)
    return (bits >> (32 - _BUCKET_BITS)).bitwise_and_(_BUCKETS - 1)


def _select_on_host(
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
    small = [_small(flats) for flats in flats_of]
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
            values.append(_sorted_whole(flats)[list(group_ranks)].tolist())
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
            _check_no_nan(float(candidates[-1]))
        zeros = count.zeros if zeros_only and group_wanted[_ZERO_POSITIONS[0]] else 0
        indices = _indices(group_ranks, count, group_wanted, holding)
        values.append(_with_zeros(candidates, zeros, indices).tolist())
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
    return values, _with_zeros(candidates, union_zeros, indices).tolist()


class _Counts(NamedTuple):
    """A group's elements by bucket: the positions of the non-empty buckets
    (ascending), their numbers of elements, and the number of exact zeros."""

    nonempty: numpy.ndarray
    count: numpy.ndarray
    zeros: int


#: The positions of the buckets of +0.0 and -0.0.
_ZERO_POSITIONS = numpy.array([_SIGN, _SIGN - 1])


def _sorted_whole(flats: List[Tensor]) -> numpy.ndarray:
    """All elements of a small group, sorted; an error if one is NaN (NaN sorts last)."""
    ordered = numpy.sort(numpy.concatenate([flat.numpy() for flat in flats]))
    _check_no_nan(float(ordered[-1]))
    return ordered


def _small(flats: List[Tensor]) -> bool:
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


def _with_zeros(candidates: numpy.ndarray, zeros: int, indices: numpy.ndarray) -> numpy.ndarray:
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
    if _small(flats):
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
