"""Exact quantiles of elements that live on different processes (FSDP2's shards).

Each process holds some elements of each group (its shard of a layer's
per-element statistics, say); the quantiles wanted are those of the union of
every process's elements, identical on every process, equal bit for bit to
:func:`~cockpit_gradnoise.order_statistics.quantiles` of the gathered union
(``numpy.quantile``'s linear method), without gathering anything.

How: a float64's bit pattern read as an ``int64`` orders like the value once
the negative ones have their 63 low bits flipped (:func:`order_keys`; ``-0.0``
is ``0.0`` first). Each process sorts its keys once; the value at global rank
``k`` is the smallest key ``K`` with at least ``k + 1`` elements ``<= K`` over
all processes, found by bisection on ``K`` between the global smallest and
largest key: each round counts with ``searchsorted`` on every process and adds
the counts with one ``all_reduce`` for all wanted ranks of all groups
together, at most 64 rounds (the keys' width). The key found is an element's
own, so the value is exact; :func:`~cockpit_gradnoise.order_statistics.interpolate`
then gives ``numpy.quantile``'s numbers.

Memory: this process's keys, sorted (8 bytes per local element, per group).
Communication per call: 3 ``all_reduce`` plus one per round (a few numbers per
wanted rank), and one of every process's float64 sums (the means). Collective:
every process must call with the same number of groups and the same levels.
"""

import math
from typing import List, Optional, Sequence

from cockpit_gradnoise.order_statistics.ranks import (
    Tensors,
    check_no_nan,
    flat_tensors,
    interpolate,
    quantile_ranks,
)
from cockpit_gradnoise.order_statistics.selection import float64_sum

import torch
from torch import Tensor

#: Flips the 63 low bits of a negative float64's pattern (its order reversed).
_LOW_BITS = (1 << 63) - 1


def order_keys(values: Tensor) -> Tensor:
    """``int64`` keys of float64 ``values`` whose order is the values' (``-0.0`` as ``0.0``).

    NaN has no order: leave it out first (its key is past infinity's).
    """
    bits = (values.to(torch.float64) + 0.0).view(torch.int64)  # -0.0 + 0.0 is 0.0
    return torch.where(bits < 0, bits ^ _LOW_BITS, bits)


def values_of_keys(keys: Tensor) -> Tensor:
    """The float64 values of :func:`order_keys`' keys (its inverse)."""
    return torch.where(keys < 0, keys ^ _LOW_BITS, keys).view(torch.float64)


def quantile_summaries_across(
    groups: Sequence[Tensors], levels: Sequence[float], group=None
) -> List[Optional[List[float]]]:
    """Per group, the quantiles at ``levels`` and the mean of the union over processes.

    As :func:`~cockpit_gradnoise.order_statistics.quantile_summary` of each
    group's elements on all processes together: ``[q(levels[0]), ..., mean]``,
    identical on every process; ``None`` for a group without elements on any
    process. A process may hold no element of a group (an empty shard).

    Args:
        groups: This process's elements of each group: a tensor or a sequence of
            tensors (any device, any float dtype; compared as float64).
        levels: Quantile levels in ``[0, 1]``.
        group: The process group (the default one if None).

    Raises:
        ValueError: On every process, if an element is NaN on any process.
    """
    import torch.distributed as dist

    flats_of = [[flat.double() for flat in flat_tensors(g)] for g in groups]
    device = _device_of(groups)
    world = dist.get_world_size(group)
    # Sizes, NaN flags and float64 sums of every process (rank order: the same sums everywhere).
    local = torch.tensor(
        [[sum(f.numel() for f in flats) for flats in flats_of],
         [float(any(bool(f.isnan().any()) for f in flats)) for flats in flats_of],
         [_total(map(float64_sum, flats)) for flats in flats_of]],
        dtype=torch.float64, device=device,
    )
    table = torch.zeros(world, *local.shape, dtype=torch.float64, device=device)
    table[dist.get_rank(group)] = local
    dist.all_reduce(table, group=group)
    table = table.cpu()
    if table[:, 1].sum() > 0:
        check_no_nan(math.nan)
    sizes = [int(n) for n in table[:, 0].sum(0).tolist()]
    totals = [_total(column) for column in table[:, 2].T.tolist()]
    keys = [torch.sort(order_keys(torch.cat(flats)) if flats else
                       torch.empty(0, dtype=torch.int64, device=device)).values for flats in flats_of]
    wanted = [(g, quantile_ranks(levels, n)) for g, n in enumerate(sizes) if n > 0]
    targets = [(g, rank) for g, (lower, upper, _) in wanted for rank in lower + upper]
    found = iter(select_across(keys, targets, group))
    summaries: List[Optional[List[float]]] = [None] * len(groups)
    k = len(levels)
    for g, (_, _, weights) in wanted:
        values = [next(found) for _ in range(2 * k)]
        summaries[g] = interpolate(values[:k], values[k:], weights) + [totals[g] / sizes[g]]
    return summaries


def select_across(sorted_keys: Sequence[Tensor], targets: Sequence[tuple], group=None) -> List[float]:
    """The values at global ranks of groups spread over processes, by bisection on the keys.

    Args:
        sorted_keys: Per group, this process's :func:`order_keys`, sorted ascending.
        targets: ``(group index, 0-based rank into the group's union)`` pairs,
            every rank inside the union (the same pairs on every process).
        group: The process group.

    Returns:
        One float per target, identical on every process.
    """
    import torch.distributed as dist

    if not targets:
        return []
    device = sorted_keys[0].device
    big, small = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
    # The global smallest and largest key of each group: the bisection's bounds.
    ends = torch.tensor([[-(int(k[0]) if k.numel() else big), int(k[-1]) if k.numel() else small]
                         for k in sorted_keys], dtype=torch.int64, device=device)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group)
    lo = [-int(ends[g, 0]) for g, _ in targets]
    hi = [int(ends[g, 1]) for g, _ in targets]
    by_group: dict = {}
    for t, (g, _) in enumerate(targets):
        by_group.setdefault(g, []).append(t)
    while any(a < b for a, b in zip(lo, hi)):
        mids = [a + (b - a) // 2 for a, b in zip(lo, hi)]
        counts = torch.zeros(len(targets), dtype=torch.int64, device=device)
        mid_tensor = torch.tensor(mids, dtype=torch.int64, device=device)
        for g, indices in by_group.items():
            index = torch.tensor(indices, device=device)
            counts[index] = torch.searchsorted(sorted_keys[g], mid_tensor[index], right=True)
        dist.all_reduce(counts, group=group)
        for t, (count, (_, rank)) in enumerate(zip(counts.tolist(), targets)):
            if lo[t] < hi[t]:
                if count >= rank + 1:
                    hi[t] = mids[t]
                else:
                    lo[t] = mids[t] + 1
    return values_of_keys(torch.tensor(lo, dtype=torch.int64)).tolist()


def _total(values) -> float:
    """``math.fsum``, which raises on ``inf - inf``: then the plain sum (NaN or an infinity)."""
    values = list(values)
    return math.fsum(values) if all(map(math.isfinite, values)) else sum(values)


def _device_of(groups) -> torch.device:
    for g in groups:
        for t in [g] if isinstance(g, Tensor) else g:
            return t.device
    return torch.device("cpu")
