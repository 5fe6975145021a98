"""Elementwise ratios ``|a_j| / |b_j|`` (``theta / grad``) and their statistics, and zero counts."""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.functional.norms import scalar
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.order_statistics import bracket, partition
from cockpit_gradnoise.order_statistics.ranks import check_no_nan

import numpy
import torch
from torch import Tensor


def zero_count(tensor: Tensor):
    """The number of elements exactly 0: an int on the CPU, a 0-dim tensor elsewhere.

    On the CPU NumPy counts ``x == 0`` in a third of the time of
    ``torch.count_nonzero``, in pieces (:func:`~cockpit_gradnoise.order_statistics.count_where`:
    no mask of the tensor's size); elsewhere the count stays on the device for
    the step's one transfer (:func:`scalar`).
    """
    if _device.on_host(tensor) and tensor.dtype in (torch.float32, torch.float64):
        return order_statistics.count_where(tensor.detach().reshape(-1).numpy(), numpy.equal, 0)
    return scalar(tensor.numel() - tensor.count_nonzero().double())


def abs_ratio_statistics(
    numerator: Tensor, denominator: Tensor, *, defer: bool = False, all_finite: bool = False
) -> Dict[str, float]:
    """Statistics of ``|a_j| / |b_j|`` over the elements with ``b_j != 0`` and both finite:
    the first result of :func:`abs_ratio_statistics_and_zeros`."""
    return abs_ratio_statistics_and_zeros(numerator, denominator, defer=defer, all_finite=all_finite)[0]


def abs_ratio_statistics_and_zeros(
    numerator: Tensor, denominator: Tensor, *, defer: bool = False, all_finite: bool = False
) -> Tuple[Dict[str, float], Any]:
    """Statistics of ``|a_j| / |b_j|`` over the elements with ``b_j != 0`` and both finite,
    and the number of ``b_j == 0`` (:func:`zero_count`, from the same pass where it can).

    The per-element ratio of :class:`~cockpit_gradnoise.ParamGradRatio`
    (``a = theta``, ``b = grad``): how many steps of size ``lr * |grad_j|``
    it takes to move ``theta_j`` by its own size. Elements with a zero or
    non-finite gradient, or a non-finite parameter, are left out, so no
    statistic is a NaN from 0/0. A ratio too large for the dtype is ``inf``.

    Args:
        numerator: ``a``, any shape.
        denominator: ``b``, same number of elements.
        defer: Leave the results on the device (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).
        all_finite: The caller knows every element of both to be finite
            (e.g. both sums of squares are: a NaN or inf would make them
            non-finite), which saves a pass over each; ``False`` checks.

    Returns:
        ``mean``, ``median`` (as ``numpy.median``: the mean of the two middle
        values for an even count), ``min`` and ``max``, an empty dict when no
        element qualifies; and the zero count.
    """
    # Ratios of bfloat16 or float16 numbers in float32: float16's range ends at
    # 65504, below many |theta_j| / |grad_j| (exact widening; one rounding per ratio).
    a, b = _widened(numerator, denominator)
    if not _device.on_host(a):
        result = {"ratio": _abs_ratio_statistics_on_device(a, b)}
        return (result if defer else _device.resolve(result)), zero_count(b)
    # A finite sum proves every element finite (NaN and inf propagate): then
    # only b = 0 is left out.
    finite = all_finite or (bool(torch.isfinite(a.sum())) and bool(torch.isfinite(b.sum())))
    if a.dtype not in (torch.float32, torch.float64):  # _widened's dtype is wider still: exact
        a, b = a.double(), b.double()
    if a.numel() >= partition.BRACKET_AT_LEAST:  # no array of the layer's size
        found = _statistics_by_brackets(a.numpy(), b.numpy(), finite)
        if found is not None:
            return found
    ratio, left_out, zeros, smallest = _ratios_by_pieces(a.numpy(), b.numpy(), finite)
    n = ratio.size - left_out
    if n == 0:
        return {}, zeros
    # The left-out ratios are 0 in ``ratio``, where they sort first (tied at
    # worst with a kept 0) and add nothing to the sum: the kept ratios are
    # ranks left_out .. end.
    total = float(ratio.sum(dtype=numpy.float64))
    # Nested partitions of the fresh array, or buckets where many are 0
    # (order_statistics.select_in_place): no sort.
    lower, upper, largest = order_statistics.select_in_place(
        ratio, [*_middle_ranks(left_out, n), left_out + n - 1]
    )
    return _statistics(total, n, smallest, lower, upper, largest), zeros


def _middle_ranks(left_out: int, n: int) -> Tuple[int, int]:
    """The ranks of the two middle kept ratios among all, the ``left_out`` ones 0 and sorted
    first: one rank twice for an odd ``n``; their mean is the median, as ``numpy.median``'s."""
    return left_out + (n - 1) // 2, left_out + n // 2


def _statistics(total: float, n: int, smallest: float, lower: float, upper: float,
                largest: float) -> Dict[str, float]:
    """The ratio statistics of ``n`` kept ratios: their float64 ``total``, smallest, two
    middle ones (:func:`_middle_ranks`) and largest."""
    return {schema.MEAN: total / n, schema.MEDIAN: (lower + upper) / 2,
            schema.MIN: smallest, schema.MAX: largest}


def _ratios_by_pieces(a: numpy.ndarray, b: numpy.ndarray, finite: bool) -> Tuple[numpy.ndarray, int, int, float]:
    """``|a_j / b_j|`` of 1d float arrays of one dtype, 0 where left out (``b_j = 0``, or either
    not finite unless ``finite``); the number left out, the number of ``b_j = 0``, and the
    smallest kept ratio (``inf`` where none is kept).

    Formed piece by piece (:data:`_RATIO_PIECE` elements) into one array of
    ``a``'s size: the masks are a piece's, never the layer's (a mask and the
    indices of its left-out elements, for VGG-11's 103M-element classifier
    weight at batch 2 with 53% of its gradient 0, were 0.5 GB of fresh pages
    each step, more time than the ratios). NumPy divides, compares and counts
    several times faster than torch on CPU (torch's division slows down on
    subnormal gradients).
    """
    ratio = numpy.empty_like(a)
    mask = numpy.empty(min(a.size, _RATIO_PIECE), dtype=bool)
    left_out = zeros = 0
    smallest = math.inf
    with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, a.size, _RATIO_PIECE):
            piece, over = slice(start, start + _RATIO_PIECE), mask[: min(_RATIO_PIECE, a.size - start)]
            r = ratio[piece]
            numpy.divide(a[piece], b[piece], out=r)
            numpy.abs(r, out=r)
            numpy.equal(b[piece], 0, out=over)
            piece_zeros = int(numpy.count_nonzero(over))
            zeros += piece_zeros
            if not finite:
                over |= ~(numpy.isfinite(a[piece]) & numpy.isfinite(b[piece]))
            piece_left_out = piece_zeros if finite else int(numpy.count_nonzero(over))
            left_out += piece_left_out
            if piece_left_out:
                # At inf for the smallest kept, then at 0: a piece's mask, twice.
                numpy.copyto(r, numpy.inf, where=over)
                smallest = min(smallest, float(r.min()))
                numpy.copyto(r, 0.0, where=over)
            else:
                smallest = min(smallest, float(r.min()))
    return ratio, left_out, zeros, smallest


def _statistics_by_brackets(a: numpy.ndarray, b: numpy.ndarray, finite: bool) -> Optional[Tuple[Dict[str, float], int]]:
    """:func:`abs_ratio_statistics_and_zeros` of a large layer with no array of its size: the
    ratios formed piece by piece into one piece's buffer, the median by the brackets of a
    sample of the kept ratios (:class:`~cockpit_gradnoise.order_statistics.bracket.Tally`);
    None where a rank misses its bracket (then the layer's ratios are formed whole).

    The same numbers: left-out ratios are 0 in each piece, as in :func:`_ratios_by_pieces`'s
    array; max, min and the median are those of the whole array. The mean's float64 sum is
    carried from piece to piece (``initial=``): for float32 ratios that is how NumPy sums the
    whole array too (cast in buffers that divide a piece, added in turn), for float64 ones
    NumPy's pairwise tree over the whole array differs from it by rounding only (about
    ``log2(n)`` units in the last place relative to the sum of the ratios).
    """
    with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
        at = bracket.sample_positions(a.size)
        sample = numpy.abs(a[at] / b[at])
        kept = (b[at] != 0) if finite else (b[at] != 0) & numpy.isfinite(a[at]) & numpy.isfinite(b[at])
    sample = numpy.sort(sample[kept])
    if sample.size == 0:
        return None
    tally = bracket.Tally(bracket.brackets(sample, [0.5]))
    total, largest = 0.0, 0.0
    left_out = zeros = 0
    smallest = math.inf
    for start in range(0, a.size, _RATIO_PIECE):
        r, piece_left_out, piece_zeros, piece_smallest = _ratios_by_pieces(
            a[start : start + _RATIO_PIECE], b[start : start + _RATIO_PIECE], finite)
        left_out, zeros, smallest = left_out + piece_left_out, zeros + piece_zeros, min(smallest, piece_smallest)
        total = r.sum(dtype=numpy.float64, initial=total)
        largest = max(largest, float(r.max()))
        tally.add(r)
    n = a.size - left_out
    if n == 0:
        return {}, zeros
    lower, upper = (tally.at(rank) for rank in _middle_ranks(left_out, n))
    if lower is None or upper is None:
        return None
    return _statistics(total, n, smallest, lower, upper, largest), zeros


#: Elements per piece of :func:`_ratios_by_pieces`: its masks stay in the cache's reach.
_RATIO_PIECE = 1 << 16


def abs_ratio_statistics_of_small(
    pairs: Sequence[Tuple[Tensor, Tensor, bool]],
) -> List[Tuple[Dict[str, float], int]]:
    """:func:`abs_ratio_statistics_and_zeros` of each ``(a, b, all_finite)`` on the CPU, where
    each pair has at most :data:`~cockpit_gradnoise.order_statistics.SORT_WHOLE_AT_MOST`
    elements (whose selection is a sort of the ratios anyway): the pairs of one size and
    dtype as one table ``[pairs, size]``, divided, counted, summed and sorted row by row in a
    few NumPy calls, not a dozen calls per pair (a network's biases and norms' weights).

    The same numbers: the same ratios (left-out ones 0, sorting first), each row's float64
    sum (NumPy's pairwise sum of a row of a table, as of the row alone: bit for bit here) and
    the values at the same ranks of each sorted row.

    Args:
        pairs: ``(numerator, denominator, all_finite)``: tensors of one size each (at
            least one element) and whether the caller knows every element of both finite.

    Returns:
        Per pair, the ratio statistics (empty where no element qualifies) and its zero count.

    Raises:
        ValueError: If a ratio is NaN although ``all_finite`` was claimed (no order).
    """
    groups: Dict[Tuple[int, torch.dtype], List[Tuple[int, Tensor, Tensor, bool]]] = {}
    for k, (numerator, denominator, all_finite) in enumerate(pairs):
        a, b = _widened(numerator, denominator)
        if a.dtype not in (torch.float32, torch.float64):  # as abs_ratio_statistics_and_zeros
            a, b = a.double(), b.double()
        groups.setdefault((a.numel(), a.dtype), []).append((k, a, b, all_finite))
    results: List[Tuple[Dict[str, float], int]] = [({}, 0)] * len(pairs)
    for members in groups.values():
        a = torch.stack([a for _, a, _, _ in members]).numpy()
        b = torch.stack([b for _, _, b, _ in members]).numpy()
        ratio, left_out, zeros = _ratio_table(a, b, all(finite for *_, finite in members))
        totals = ratio.sum(axis=1, dtype=numpy.float64).tolist()  # before the sort: as the pair alone
        ratio.sort(axis=1)
        check_no_nan(float(ratio[:, -1].max()))
        size = ratio.shape[1]
        for row, (k, *_) in enumerate(members):
            z = left_out[row]
            n = size - z
            if n == 0:
                results[k] = ({}, zeros[row])
                continue
            smallest, lower, upper, largest = ratio[row, [z, *_middle_ranks(z, n), size - 1]].tolist()
            results[k] = (_statistics(totals[row], n, smallest, lower, upper, largest), zeros[row])
    return results


def _ratio_table(a: numpy.ndarray, b: numpy.ndarray, finite: bool) -> Tuple[numpy.ndarray, List[int], List[int]]:
    """``|a / b|`` of 2d arrays of one shape and dtype, 0 where left out (``b = 0``, or either not
    finite unless ``finite``), as :func:`_ratios_by_pieces` forms each row; per row the number
    left out and the number of ``b = 0``."""
    with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = numpy.divide(a, b)
        numpy.abs(ratio, out=ratio)
    zero = b == 0
    zeros = numpy.count_nonzero(zero, axis=1).tolist()
    left = zero if finite else zero | ~(numpy.isfinite(a) & numpy.isfinite(b))
    numpy.copyto(ratio, 0.0, where=left)
    return ratio, (zeros if finite else numpy.count_nonzero(left, axis=1).tolist()), zeros


def abs_ratio_statistics_of_pairs(pairs: Sequence[Tuple[Tensor, Tensor]]) -> List[_device.PresentIfPositive]:
    """:func:`abs_ratio_statistics` (``defer``) of each pair ``(a, b)`` on other devices than
    the CPU, the pairs' sorts shared (:class:`~cockpit_gradnoise.order_statistics.Segments`:
    one group of pairs joined, divided and sorted at once, not one sort and a dozen 0-dim
    ops per pair); the same numbers, left on the device.

    Args:
        pairs: ``(numerator, denominator)`` tensors with elements, each pair the same size.
    """
    flat = [_widened(a, b) for a, b in pairs]
    results: List[_device.PresentIfPositive] = [None] * len(flat)  # type: ignore[list-item]
    for group in order_statistics.segment_groups([a for a, _ in flat]):
        if len(group) == 1:
            results[group[0]] = _abs_ratio_statistics_on_device(*flat[group[0]])
            continue
        ratio = _kept_ratios(torch.cat([flat[k][0] for k in group]), torch.cat([flat[k][1] for k in group]))
        segments = order_statistics.Segments(ratio, [flat[k][0].numel() for k in group])
        n = segments.kept_counts()  # a ratio is NaN exactly where it is left out
        columns = _ratio_columns(n, segments.at, segments.sums(skip_nan=True))
        for j, k in enumerate(group):
            results[k] = _device.PresentIfPositive(n[j], {name: c[j] for name, c in columns.items()})
    return results


def _widened(numerator: Tensor, denominator: Tensor) -> Tuple[Tensor, Tensor]:
    """Both flat, detached, in float32 or wider (:func:`abs_ratio_statistics_and_zeros`'s dtype)."""
    a, b = numerator.detach().reshape(-1), denominator.detach().reshape(-1)
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(wide), b.to(wide)


def _kept_ratios(a: Tensor, b: Tensor) -> Tensor:
    """``|a_j / b_j|``, NaN where left out (``b_j = 0``, or either not finite): a new tensor."""
    left_out = ~(torch.isfinite(a) & torch.isfinite(b)) | (b == 0)
    return torch.div(a, b).abs_().masked_fill_(left_out, math.nan)


def _abs_ratio_statistics_on_device(a: Tensor, b: Tensor) -> _device.PresentIfPositive:
    """:func:`abs_ratio_statistics` without waiting for the device.

    Left-out elements become NaN, which sorts last, and the ranks come from
    the number kept, on the device.
    """
    ratio = _kept_ratios(a, b)
    n = ratio.numel() - ratio.isnan().sum()
    ordered = order_statistics.sorted_on_device([ratio])

    def at(rank):
        return ordered.gather(0, rank.reshape(1))[0].double()

    return _device.PresentIfPositive(n, _ratio_columns(n, at, _device.float64_total(ratio, skip_nan=True)))


def _ratio_columns(n: Tensor, at, total: Tensor) -> Dict[str, Tensor]:
    """Mean, median, min and max of the ``n`` sorted ratios kept (``n`` a tensor: 0-dim, or one
    count per segment); ``at(ranks)``: the float64 ratios at those ranks; ``total``: their
    float64 sum. Ranks are clamped to 0 for ``n = 0`` (the values are then dropped)."""
    lower = at(torch.div(n - 1, 2, rounding_mode="floor").clamp(min=0))
    return {
        schema.MEAN: total / n,
        schema.MEDIAN: (lower + at(n // 2)) / 2,
        schema.MIN: at(torch.zeros_like(n)),
        schema.MAX: at((n - 1).clamp(min=0)),
    }
