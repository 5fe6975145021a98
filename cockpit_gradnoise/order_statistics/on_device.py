"""Quantiles on other devices than the CPU (GPUs): ``torch.sort``, results left on the device.

No result whose size depends on the data, nothing read back by the host
until the step's one transfer (:func:`cockpit_gradnoise._device.resolve`).
"""

import math
from typing import Any, List, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.order_statistics.ranks import (
    Tensors,
    flat_tensors,
    interpolate,
    quantile_ranks,
)

import torch
from torch import Tensor


def kept_quantile_summary(tensors: Tensors, levels: Sequence[float]) -> Tuple[Any, List[Tensor]]:
    """:func:`quantile_summary` of the elements that are not NaN, left on the device.

    For data-dependent selections without data-dependent shapes (which make
    the host wait): the elements left out are marked NaN, which sorts last,
    and the ranks are computed on the device from the number kept. Exact as
    :func:`quantile_summary` on the kept elements. For tensors on any device
    (used on devices other than the CPU).

    Returns:
        ``(number kept, summary)``: the number a 0-dim tensor (0 when there are
        no tensors, with an empty summary), the summary as
        :func:`quantile_summary`'s, which exists only when some element is
        kept (:class:`~cockpit_gradnoise._device.PresentIfPositive`).
    """
    flats = flat_tensors(tensors)
    if not flats:
        return 0, []
    ordered = sorted_on_device(flats)
    kept = ordered.numel() - ordered.isnan().sum()
    return kept, summary_of_sorted(ordered, kept, levels)


def sorted_on_device(flats: List[Tensor]) -> Tensor:
    """The union sorted ascending with torch, every NaN last: no data-dependent shape.

    ``torch.sort`` alone does not put NaN last on every device: CUDA's radix sort orders
    a float by its bits, so a NaN whose sign bit is set sorts before ``-inf`` (seen on an
    H200: the median of the SNR, whose left-out elements are ``0 / 0``, came out low).
    So the NaNs are sorted as ``+inf`` and written back over the last places.
    """
    joined = flats[0] if len(flats) == 1 else torch.cat(flats)
    nan = joined.isnan()
    ordered = torch.sort(joined.masked_fill(nan, math.inf)).values
    places = torch.arange(ordered.numel(), device=ordered.device)
    return ordered.masked_fill_(places >= ordered.numel() - nan.sum(), math.nan)


def summary_of_sorted(ordered, count, levels) -> List[Tensor]:
    """Quantiles and mean of the first ``count`` of ``ordered`` (a union, sorted).

    ``count``: the number of elements (an int), or a 0-dim tensor with the
    number that are not NaN (the others sort last). 0-dim float64 tensors,
    computed as :func:`quantile_ranks` and :func:`interpolate` compute them,
    so equal to ``numpy.quantile`` bit for bit. The mean's float64 sum is taken
    over ``ordered``, the union already joined (a few pieces, not one sum per
    tensor of the union: on a GPU a few launches each).
    """
    if isinstance(count, int):
        lower, upper, weights = quantile_ranks(levels, count)
        a = [ordered[k].double() for k in lower]
        b = [ordered[k].double() for k in upper]
        values = interpolate(a, b, weights)
        total = _device.float64_total(ordered)
    else:
        values = quantiles_of_counted(
            count, levels, lambda ranks: ordered.gather(0, ranks.long().reshape(-1)).reshape(ranks.shape).double())
        total = _device.float64_total(ordered, skip_nan=True)
    return values + [total / count]


def quantiles_of_counted(counts: Tensor, levels, at) -> List[Tensor]:
    """``numpy.quantile`` (linear) of the first ``counts`` sorted values, per level, without
    the host: ``h = (c - 1) q``, ``k = floor(h)``, ``t = h - k``, from the upper value where
    ``t >= 0.5``, as :func:`quantile_ranks` and :func:`interpolate` compute it on the host, so
    equal bit for bit. ``counts``: a tensor (0-dim, or one count per segment); ``at(ranks)``:
    the float64 values at those ranks (a tensor of the ranks' shape, ``counts``' with one more
    dimension, the levels, last). All levels at once (on a GPU a dozen launches, not a dozen
    per level): the same elementwise operations on the same numbers."""
    last = (counts - 1).clamp(min=0).unsqueeze(-1)
    position = (counts - 1).double().unsqueeze(-1) * _levels_on(tuple(float(level) for level in levels), counts.device)
    k = torch.minimum(position.floor(), last).clamp(min=0)
    t = position - k
    a, b = at(k), at(torch.minimum(k + 1, last))
    diff = b - a
    return list(torch.where(t >= 0.5, b - diff * (1 - t), a + diff * t).unbind(-1))


#: ``{(levels, device): float64 [L]}`` of :func:`_levels_on`: a quantity's few levels, copied once.
_LEVELS: dict = {}


def _levels_on(levels: Tuple[float, ...], device: torch.device) -> Tensor:
    """``levels`` as a float64 vector on ``device``, made once (the host not waiting)."""
    found = _LEVELS.get((levels, device))
    if found is None:
        found = _LEVELS[(levels, device)] = _device.copied_without_waiting(
            torch.tensor(levels, dtype=torch.float64), device)
    return found
