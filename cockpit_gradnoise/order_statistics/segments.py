"""Order statistics of many tensors of different sizes at once: one sort for a group of them.

On a GPU each small op is a kernel launch of 10-40 us whatever its size.
:class:`~cockpit_gradnoise.GradientVarianceQuantiles` and
:class:`~cockpit_gradnoise.ParamGradRatio` took each parameter's quantiles by a sort
of its own values and a dozen 0-dim ops (``benchmarks/benchmark_op_count.py``). Here
the tensors of a group (*segments*: one dtype, one device) are joined and sorted by
the key ``(segment, value)``, NaN last in each segment as ``numpy.sort`` puts it:
a sort of the values (NaN as ``+inf``), then a stable sort of ``2 segment + isnan``
in that order, which keeps each segment's values in order and its NaN after its
``+inf``. Every segment's ranks are then read with one gather per rank, its
quantiles with the arithmetic of
:func:`~cockpit_gradnoise.order_statistics.on_device.quantiles_of_counted` with one count per segment
(the same ranks from the same counts, the same interpolation: ``numpy.quantile``
bit for bit), and its float64 sum with one ``segment_reduce``. Nothing is read by
the host: the counts, offsets and lengths are device tensors (copied once per
layout, from pinned memory on CUDA, without waiting).

Memory: a group holds at most :data:`GROUP_AT_MOST` elements; in flight, at most
about 60 bytes per element of a group (the joined values, the sort's values and
int64 indices, the segment keys, the float64 copy for the sums): 250 MB for a full
group of float32 values. A tensor larger than that is sorted alone, as
:func:`~cockpit_gradnoise.order_statistics.sorted_on_device` always did. For other
devices than the CPU (the CPU's path partitions in NumPy).
"""

import math
from typing import Dict, List, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.order_statistics.on_device import (
    kept_quantile_summary,
    quantiles_of_counted,
    sorted_on_device,
    summary_of_sorted,
)

import torch
from torch import Tensor

#: The most elements a group of segments holds (``2**22``); a larger tensor is sorted alone.
GROUP_AT_MOST = 1 << 22


def segment_groups(tensors: Sequence[Tensor]) -> List[List[int]]:
    """Indices of ``tensors`` (with elements) in groups to sort together: one dtype and
    device each, in order, at most :data:`GROUP_AT_MOST` elements, a larger tensor alone."""
    groups: List[List[int]] = []
    open_groups: Dict[Tuple[torch.dtype, torch.device], Tuple[List[int], List[int]]] = {}
    for k, tensor in enumerate(tensors):
        n = tensor.numel()
        key = (tensor.dtype, tensor.device)
        found = open_groups.get(key)
        if found is None or found[1][0] + n > GROUP_AT_MOST:
            found = ([], [0])
            groups.append(found[0])
            open_groups[key] = found
        found[0].append(k)
        found[1][0] += n
    return groups


class Segments:
    """The values of a group sorted within each segment (NaN last), and where each lies.

    Attributes:
        ordered: ``[n]``, segment after segment, each ascending with its NaN last.
        starts: ``[P]`` int64, where each segment begins in ``ordered``.
        ends: ``[P]`` int64, where each segment ends (the next one begins).
        lengths: ``[P]`` int64, the segments' sizes.
        nan: ``[n]`` bool, which joined values are NaN (in the joined order).
        joined: ``[n]``, the values in the given order.
    """

    def __init__(self, joined: Tensor, sizes: Sequence[int]):
        self.joined = joined
        self.starts, self.ends, self.lengths = segment_layout(tuple(sizes), joined.device)
        self.nan = joined.isnan()
        order = torch.sort(joined.masked_fill(self.nan, math.inf)).indices
        # Stable: within a segment, the values stay in the order of the first sort, and NaN
        # (key 2 s + 1) follows every number (2 s), +inf included.
        segment = torch.searchsorted(self.ends, torch.arange(joined.numel(), device=joined.device),
                                     right=True)
        key = segment.mul_(2).add_(self.nan)[order]
        del segment
        order = order[torch.sort(key, stable=True).indices]
        self.ordered = joined[order]

    def kept_counts(self) -> Tensor:
        """``[P]`` int64: each segment's values that are not NaN."""
        return self.lengths - segment_sums(self.nan.double(), self.lengths).long()

    def at(self, ranks: Tensor) -> Tensor:
        """``[P, ...]`` float64: each segment's values at its ranks (``[P, ...]``, within the segment)."""
        starts = self.starts.reshape(self.starts.shape + (1,) * (ranks.dim() - 1))
        return self.ordered[starts + ranks.long()].double()

    def quantiles(self, counts: Tensor, levels: Sequence[float]) -> List[Tensor]:
        """``numpy.quantile`` (linear) of each segment's first ``counts`` values, per level
        a float64 ``[P]``: :func:`.on_device.quantiles_of_counted` with one count per segment,
        so equal to ``numpy.quantile`` bit for bit."""
        return quantiles_of_counted(counts, levels, self.at)

    def sums(self, *, skip_nan: bool) -> Tensor:
        """``[P]`` float64: each segment's sum in float64, NaN left out where ``skip_nan``."""
        wide = self.joined.double()
        return segment_sums(wide.masked_fill_(self.nan, 0.0) if skip_nan else wide, self.lengths)


def segment_sums(values: Tensor, lengths: Tensor) -> Tensor:
    """``[P]``: the sums of consecutive segments of ``values`` of ``lengths`` (one launch;
    ``unsafe``: the lengths are the package's own, and checking them would make the host wait)."""
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)


#: ``{(sizes, device): (starts, ends, lengths)}`` of :func:`segment_layout`: a model's layers
#: give the same few layouts every step.
_LAYOUTS: Dict[Tuple[Tuple[int, ...], torch.device], Tuple[Tensor, Tensor, Tensor]] = {}


def segment_layout(sizes: Tuple[int, ...], device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
    """Int64 ``(starts, ends, lengths)`` of segments of ``sizes`` on ``device``, made once."""
    found = _LAYOUTS.get((sizes, device))
    if found is None:
        ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
        host = (ends - torch.tensor(sizes, dtype=torch.int64), ends, torch.tensor(sizes, dtype=torch.int64))
        found = tuple(_device.copied_without_waiting(t, device) for t in host)
        _LAYOUTS[(sizes, device)] = found
    return found


def segment_summaries(
    flats: Sequence[Tensor], levels: Sequence[float], *, kept: bool = False
) -> List[Tuple[object, List[Tensor]]]:
    """Per 1d tensor (with elements), ``(count, [quantile per level..., mean])`` as
    :func:`.on_device.summary_of_sorted` gives it: of all its elements (``count`` its
    size, an int), or where ``kept`` of those that are not NaN (``count`` a 0-dim
    tensor), as :func:`.on_device.kept_quantile_summary`. 0-dim float64 tensors left
    on the device; groups of :func:`segment_groups` sorted together
    (:class:`Segments`), a group of one as before.
    """
    results: List[Tuple[object, List[Tensor]]] = [None] * len(flats)  # type: ignore[list-item]
    for group in segment_groups(flats):
        if len(group) == 1:
            flat = flats[group[0]]
            results[group[0]] = kept_quantile_summary([flat], levels) if kept else (
                flat.numel(), summary_of_sorted(sorted_on_device([flat]), flat.numel(), levels))
            continue
        members = [flats[k] for k in group]
        segments = Segments(torch.cat(members), [flat.numel() for flat in members])
        counts = segments.kept_counts() if kept else segments.lengths
        columns = segments.quantiles(counts, levels) + [segments.sums(skip_nan=kept) / counts]
        for j, k in enumerate(group):
            results[k] = (counts[j] if kept else members[j].numel(), [column[j] for column in columns])
    return results
