"""Elementwise ratios ``|a_j| / |b_j|`` (``theta / grad``) and their statistics, and zero counts."""

import math
from typing import Any, Dict, List, Sequence, Tuple

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.functional.norms import scalar
from cockpit_gradnoise.logs import schema

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
    plain = a.dtype == b.dtype and b.dtype in (torch.float32, torch.float64)
    if plain:
        # NumPy divides, compares and counts several times faster than torch
        # on CPU (torch's division slows down on subnormal gradients).
        with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = numpy.divide(a.numpy(), b.numpy())
            numpy.abs(ratio, out=ratio)  # in place: one array of the layer's size
    else:
        ratio = torch.div(a, b).abs_().numpy()
    if finite and plain:
        left_out = b.numpy() == 0
    else:
        left_out = (~(torch.isfinite(a) & torch.isfinite(b)) | (b == 0)).numpy()
    # The left-out elements by index (few, usually): a mask applied to every
    # element (compress, putmask) costs several ns per element when the kept
    # and left-out ones alternate irregularly.
    out = numpy.flatnonzero(left_out)
    z, n = out.size, ratio.size - out.size
    zeros = z if finite and plain else zero_count(b)  # left out: exactly the zeros
    if n == 0:
        return {}, zeros
    # The smallest kept ratio with the left-out ones at inf, then at 0, where
    # they sort first (tied at worst with a kept 0) and add nothing to the
    # sum: the kept ratios are ranks z .. end.
    ratio[out] = numpy.inf
    smallest = float(ratio.min())
    ratio[out] = 0.0
    mean = float(ratio.sum(dtype=numpy.float64)) / n
    # Nested partitions of the fresh array (order_statistics.select_in_place):
    # no bucket passes and no sort.
    lower, upper, largest = order_statistics.select_in_place(
        ratio, [z + (n - 1) // 2, z + n // 2, z + n - 1]
    )
    return {
        schema.MEAN: mean,
        schema.MEDIAN: (lower + upper) / 2,
        schema.MIN: smallest,
        schema.MAX: largest,
    }, zeros


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
