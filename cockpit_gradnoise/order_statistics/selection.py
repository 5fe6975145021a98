"""Values at ranks, quantiles and summaries of tensors and unions, on any device.

Each function takes the CPU's path (:mod:`~cockpit_gradnoise.order_statistics.buckets`)
or other devices' (:mod:`~cockpit_gradnoise.order_statistics.on_device`), by
:func:`cockpit_gradnoise._device.on_host`.
"""

import math
from typing import List, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.order_statistics.buckets import select_on_host, small_group, sorted_whole
from cockpit_gradnoise.order_statistics.on_device import sorted_on_device, summary_of_sorted
from cockpit_gradnoise.order_statistics.ranks import (
    Tensors,
    check_no_nan,
    check_ranks,
    flat_tensors,
    interpolate,
    quantile_ranks,
)

import numpy
import torch
from torch import Tensor


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
    flats = flat_tensors(tensors)
    check_ranks(flats, ranks)
    if not _device.on_host(flats[0]):
        ordered = sorted_on_device(flats)
        # NaN sorts last: the last value tells whether there is one.
        *values, last = _device.transfer([ordered[r] for r in ranks] + [ordered[-1]])
        check_no_nan(last)
        return values
    (values,), _ = select_on_host([flats], [ranks])
    return values


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
    flats_of = [flat_tensors(group) for group in groups]
    for flats, group_ranks in zip(flats_of, ranks):
        check_ranks(flats, group_ranks)
    check_ranks([flat for flats in flats_of for flat in flats], union_ranks)
    if not _device.on_host(flats_of[0][0]):
        union = flat_tensors([flat for flats in flats_of for flat in flats])
        return [select(f, r) for f, r in zip(flats_of, ranks)], select(union, union_ranks)
    return select_on_host(flats_of, ranks, union_ranks)


def quantiles(tensors: Tensors, levels: Sequence[float]) -> List[float]:
    """``numpy.quantile`` (linear method) of all elements of ``tensors``, exactly.

    Args:
        tensors: A tensor, or a sequence of tensors whose union is meant.
        levels: Quantile levels in ``[0, 1]``.

    Returns:
        One Python float per level: ``numpy.quantile(union.astype(float64), levels)``.
    """
    flats = flat_tensors(tensors)
    lower, upper, weights = quantile_ranks(levels, sum(flat.numel() for flat in flats))
    values = select(flats, lower + upper)
    return interpolate(values[: len(levels)], values[len(levels) :], weights)


def quantile_summary(
    tensors: Tensors, levels: Sequence[float], *, defer: bool = False
) -> List[float]:
    """The quantiles at ``levels`` and the mean of all elements of ``tensors``.

    Numbers only, in level order: the quantities' formulas name them
    (:func:`cockpit_gradnoise.logs.schema.quantile_name`).

    Args:
        tensors: A tensor with at least one element, or a sequence of tensors
            whose union is meant.
        levels: Quantile levels in ``[0, 1]``.
        defer: On other devices than the CPU, return 0-dim float64 tensors
            left on the device (the host does not wait; a NaN then gives NaN
            instead of an error), for one transfer with the step's other
            statistics (:func:`cockpit_gradnoise._device.resolve`). No
            effect on CPU tensors.

    Returns:
        ``[quantile at levels[0], ..., quantile at levels[-1], mean]``; the
        mean is summed in float64.
    """
    flats = flat_tensors(tensors)
    if flats and not _device.on_host(flats[0]):
        ordered = sorted_on_device(flats)
        summary = summary_of_sorted(ordered, len(ordered), levels)
        if defer:
            return summary
        summary, last = _device.resolve((summary, ordered[-1]))
        check_no_nan(last)
        return summary
    check_ranks(flats, [0])
    n = sum(flat.numel() for flat in flats)
    lower, upper, weights = quantile_ranks(levels, n)
    if small_group(flats):
        # A batch's per-example norms, a LayerNorm's sd: one sort, no bucket passes.
        ordered = sorted_whole(flats)
        values = ordered[lower + upper].tolist()
        mean = float(ordered.sum(dtype=numpy.float64)) / n
    else:
        (values,), _ = select_on_host([flats], [lower + upper])
        mean = sum(map(float64_sum, flats)) / n
    k = len(levels)
    return interpolate(values[:k], values[k:], weights) + [mean]


def quantile_summaries(
    groups: Sequence[Tensors], levels: Sequence[float], *, defer: bool = False
) -> Tuple[List[List[float]], List[float]]:
    """:func:`quantile_summary` of each group, and of the union of all groups.

    A network's statistics beside its layers': on the CPU each element is
    counted and summed once for both (:func:`select_each_and_union`); the
    union's mean adds the groups' float64 sums.

    Args:
        groups: Each a tensor or a sequence of tensors, with elements.
        levels: Quantile levels in ``[0, 1]``.
        defer: As for :func:`quantile_summary`.

    Returns:
        ``(summary of each group, summary of the union)``.
    """
    flats_of = [flat_tensors(group) for group in groups]
    if not _device.on_host(flats_of[0][0]):
        union = [flat for flats in flats_of for flat in flats]
        each = [quantile_summary(flats, levels, defer=defer) for flats in flats_of]
        return each, quantile_summary(union, levels, defer=defer)
    sizes = [sum(flat.numel() for flat in flats) for flats in flats_of]
    totals = [sum(map(float64_sum, flats)) for flats in flats_of]
    ranks = [quantile_ranks(levels, n) for n in sizes]
    union_ranks = quantile_ranks(levels, sum(sizes))
    values, union_values = select_each_and_union(
        flats_of, [lower + upper for lower, upper, _ in ranks], union_ranks[0] + union_ranks[1]
    )
    k = len(levels)
    each = [
        interpolate(found[:k], found[k:], weights) + [total / n]
        for found, (_, _, weights), total, n in zip(values, ranks, totals, sizes)
    ]
    union = interpolate(union_values[:k], union_values[k:], union_ranks[2])
    return each, union + [sum(totals) / sum(sizes)]


def float64_sum(tensor: Tensor) -> float:
    """Sum of all elements, accumulated in float64, as a Python float."""
    if _device.on_host(tensor):
        # By pieces: torch converts the whole input to float64 first (8 bytes
        # per element at once); pieces keep that small and take half the
        # time of NumPy's blockwise float64 sum.
        return math.fsum(piece.sum(dtype=torch.float64).item() for piece in _device.pieces(tensor))
    return _device.float64_total(tensor.reshape(-1)).item()
