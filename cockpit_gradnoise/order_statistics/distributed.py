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
all processes, found by a search on ``K`` between the global smallest and
largest key: each round counts, at :data:`POINTS` keys spread over the
remaining range, with ``searchsorted`` on every process, adds the counts with
one ``all_reduce`` for all wanted ranks of all groups together, and narrows
the range 64-fold (at most 11 rounds for the keys' 64 bits). The key found is
an element's own, so the value is exact;
:func:`~cockpit_gradnoise.order_statistics.interpolate` then gives
``numpy.quantile``'s numbers.

Memory: this process's keys, sorted in place (8 bytes per local element; a tensor in
several groups, a layer in the network's union, sorted once), and nothing else of
that size: the values are read as they are, widened to float64 one piece at a time. Communication
per call: two ``all_reduce`` (sizes, NaN flags and float64 sums of every
process, in rank order for the means; the keys' range), then one per round
of ``64`` counts per wanted rank. Collective: every process must call with
the same number of groups and the same levels.
"""

import math
from typing import List, Optional, Sequence

from cockpit_gradnoise.order_statistics.ranks import (
    Tensors,
    check_no_nan,
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
    bits = values.to(torch.float64, copy=True).add_(0.0).view(torch.int64)  # -0.0 + 0.0 is 0.0
    bits[bits < 0] ^= _LOW_BITS  # in place: no second tensor of 8 bytes per element
    return bits


def values_of_keys(keys: Tensor) -> Tensor:
    """The float64 values of :func:`order_keys`' keys (its inverse)."""
    return torch.where(keys < 0, keys ^ _LOW_BITS, keys).view(torch.float64)


def quantile_summaries_across(
    groups: Sequence[Tensors], levels: Sequence[float], group=None,
    group_levels: Optional[Sequence[Sequence[float]]] = None,
) -> List[Optional[List[float]]]:
    """Per group, the quantiles at ``levels`` and the mean of the union over processes.

    As :func:`~cockpit_gradnoise.order_statistics.quantile_summary` of each
    group's elements on all processes together: ``[q(levels[0]), ..., mean]``,
    identical on every process; ``None`` for a group without elements on any
    process. A process may hold no element of a group (an empty shard). A
    tensor in several groups (a layer, and the network's union of layers) is
    sorted once.

    Args:
        groups: This process's elements of each group: a tensor or a sequence of
            tensors (any device, any float dtype; compared as float64).
        levels: Quantile levels in ``[0, 1]``.
        group: The process group (the default one if None).
        group_levels: Per group, its own levels instead of ``levels`` (groups of
            different levels share the rounds of one search).

    Raises:
        ValueError: On every process, if an element is NaN on any process.
    """
    import torch.distributed as dist

    pieces, members = _pieces(groups)
    flats = [piece.detach().reshape(-1) for piece in pieces]  # widened one at a time below
    device = _device_of(groups)
    # Sizes, NaN flags and float64 sums of every process (rank order: the same sums everywhere).
    local = torch.tensor(
        [[float(f.numel()) for f in flats], [float(bool(f.isnan().any())) for f in flats],
         [float64_sum(f) if f.numel() else 0.0 for f in flats]],
        dtype=torch.float64, device=device,
    ).reshape(3, len(flats))
    table = torch.zeros(dist.get_world_size(group), *local.shape, dtype=torch.float64, device=device)
    table[dist.get_rank(group)] = local
    dist.all_reduce(table, group=group)
    table = table.cpu()
    if table[:, 1].sum() > 0:
        check_no_nan(math.nan)
    sizes = [int(table[:, 0, list(m)].sum()) for m in members]
    totals = [_total(table[:, 2, list(m)].reshape(-1).tolist()) for m in members]
    keys = [_sorted(order_keys(f)) for f in flats]
    levels_of = list(group_levels) if group_levels is not None else [levels] * len(groups)
    wanted = [(g, quantile_ranks(levels_of[g], n)) for g, n in enumerate(sizes) if n > 0]
    targets = [(members[g], rank) for g, (lower, upper, _) in wanted for rank in lower + upper]
    found = iter(select_across(keys, targets, group))
    summaries: List[Optional[List[float]]] = [None] * len(groups)
    for g, (_, _, weights) in wanted:
        k = len(weights)
        values = [next(found) for _ in range(2 * k)]
        summaries[g] = interpolate(values[:k], values[k:], weights) + [totals[g] / sizes[g]]
    return summaries


#: Points counted per wanted rank and round: each round narrows the keys' range 64-fold
#: (at most 11 rounds for 64-bit keys).
POINTS = 64


def select_across(sorted_keys: Sequence[Tensor], targets: Sequence[tuple], group=None) -> List[float]:
    """The values at global ranks of unions of pieces spread over processes, exactly.

    A search on the keys: each round counts, at :data:`POINTS` keys spread over
    each target's remaining range, the elements ``<=`` them on every process
    (``searchsorted`` on the sorted pieces), adds the counts with one
    ``all_reduce`` for all targets, and keeps the part of the range where the
    count first reaches the rank plus one; it ends at a key that is an element's.

    Args:
        sorted_keys: Per piece, this process's :func:`order_keys`, sorted ascending.
        targets: ``(piece indices, 0-based rank into the union of those pieces over
            every process)`` pairs, each rank inside its union (the same pairs on
            every process).
        group: The process group.

    Returns:
        One float per target, identical on every process.
    """
    import torch.distributed as dist

    if not targets:
        return []
    device = sorted_keys[0].device
    big, small = torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min
    # The global smallest and largest key of each piece: the search's first range.
    ends = torch.tensor([[-int(k[0]) if k.numel() else small + 1, int(k[-1]) if k.numel() else small]
                         for k in sorted_keys], dtype=torch.int64, device=device).reshape(-1, 2)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group)
    ends = ends.tolist()
    lo = [min((-ends[p][0] for p in pieces), default=big) for pieces, _ in targets]
    hi = [max((ends[p][1] for p in pieces), default=small) for pieces, _ in targets]
    by_piece: dict = {}
    for t, (pieces, _) in enumerate(targets):
        for p in pieces:
            by_piece.setdefault(p, []).append(t)
    while any(a < b for a, b in zip(lo, hi)):
        # Points lo + s j, j < POINTS, s = ceil((hi - lo + 1) / POINTS): never past hi + POINTS,
        # inside int64 (the keys of +-inf leave room).
        steps = [(b - a) // POINTS + 1 for a, b in zip(lo, hi)]
        points = torch.tensor([[a + s * j for j in range(POINTS)] for a, s in zip(lo, steps)],
                              dtype=torch.int64, device=device)
        counts = torch.zeros_like(points)
        for p, indices in by_piece.items():
            index = torch.tensor(indices, device=device)
            counts[index] += torch.searchsorted(sorted_keys[p], points[index], right=True)
        dist.all_reduce(counts, group=group)
        for t, (row, (_, rank)) in enumerate(zip(counts.tolist(), targets)):
            if lo[t] < hi[t]:
                # The first point j whose count reaches the rank: the key lies in
                # (point j - 1, point j], or past the last point (j = POINTS) up to hi.
                j = next((j for j, count in enumerate(row) if count >= rank + 1), POINTS)
                start = lo[t]
                if j < POINTS:
                    hi[t] = min(hi[t], start + steps[t] * j)
                if j > 0:
                    lo[t] = start + steps[t] * (j - 1) + 1
    return values_of_keys(torch.tensor(lo, dtype=torch.int64)).tolist()


def _pieces(groups: Sequence[Tensors]):
    """The distinct tensors of the groups (by identity), and each group's indices into them."""
    pieces: List[Tensor] = []
    index: dict = {}
    members = []
    for g in groups:
        tensors = [g] if isinstance(g, Tensor) else list(g)
        for t in tensors:
            if id(t) not in index:
                index[id(t)] = len(pieces)
                pieces.append(t)
        members.append(sorted({index[id(t)] for t in tensors}))
    return pieces, members


def _sorted(keys: Tensor) -> Tensor:
    """``keys`` sorted ascending: by NumPy on the CPU (several times faster there), in place
    (``keys`` is :func:`order_keys`' own tensor), else torch."""
    if keys.device.type == "cpu":
        keys.numpy().sort()
        return keys
    return torch.sort(keys).values


def _total(values) -> float:
    """``math.fsum``, which raises on ``inf - inf``: then the plain sum (NaN or an infinity)."""
    values = list(values)
    return math.fsum(values) if all(map(math.isfinite, values)) else sum(values)


def _device_of(groups) -> torch.device:
    for g in groups:
        for t in [g] if isinstance(g, Tensor) else g:
            return t.device
    return torch.device("cpu")
