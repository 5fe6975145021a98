"""FSDP2: this process's shard of a parameter's per-element sums, cut where FSDP2 cuts the parameter.

FSDP2 (``fully_shard``) keeps on each process a ``DTensor`` parameter of one
placement, ``Shard(dim)`` (``dim = 0`` unless a ``shard_placement_fn`` says
otherwise), cut with :func:`torch.chunk`: process ``r`` of ``W`` holds the
rows ``[r c, (r + 1) c)`` of ``dim`` (``c = ceil(size / W)``, clipped at the
size: the last processes may hold fewer rows, or none). The per-element sums
of a parameter (reduced over the processes, identical on each) are cut the
same way (:func:`local_part`), so that every element is held by exactly one
process, beside the optimizer's state and the gradient of the same elements.
A parameter that is not sharded (outside every ``fully_shard`` module) is held
whole by process 0 and by no other, so that no element counts twice. Under HSDP
(``fully_shard`` on a replicate x shard mesh, placed ``(Replicate(), Shard(dim))``) the
rows are cut over the shard dimension, and the replicas of a shard after the first hold
none of them (an empty cut): every element is held by one process, its shard's first
replica.
"""

import math
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise import distributed
from cockpit_gradnoise.extensions import sharded, tensor_parallel

import torch
from torch import Tensor

#: ``(dim, start, stop)`` of this process's rows, or ``None`` for a parameter that is
#: not sharded (whole on process 0, nothing elsewhere).
Cut = Optional[Tuple[int, int, int]]


def cuts(named_params: List[Tuple[str, Tensor]], presharded=frozenset()) -> Optional[Dict[str, Cut]]:
    """``{name: Cut}`` where some parameter is a ``DTensor``, else ``None`` (nothing sharded).

    A parameter whose ``id`` is in ``presharded`` has its sums reduce-scattered in the
    backward pass (:func:`.extensions.sharded.reduce_in_backward`): they are this
    process's rows already, and its cut is all of them.

    Tensor parallelism (``quantities/_sums.py``): a split parameter's sums are
    this process's already, of its shard: alone, its cut is all of them; inside
    FSDP2 (reduce-scattered over ``dp`` in the backward pass, or added over it after)
    their rows cut by the ``dp`` rank as ``torch.chunk``
    does. A parameter whose sums are whole on every process of a ``tp`` group
    (replicated, or sharded on ``dp`` only) is held by the first of the group.

    Raises:
        RuntimeError: Where a parameter's local shard is not the rows FSDP2's
            ``torch.chunk`` gives this process (a layout this module does not know).
    """
    if not any(type(param).__name__ == "DTensor" for _, param in named_params):
        return None
    split = tensor_parallel.split_parameters([param for _, param in named_params])
    tp = (split[0][1].get_local_rank(), split[0][1].size()) if split else (0, 1)
    managed = sharded.fsdp2_parameters() if split else {}
    placed = {id(param): placements for param, _, placements in split}
    return {name: _own(_cut(name, param, placed.get(id(param)), managed.get(id(param)), tp),
                       id(param) in presharded)
            for name, param in named_params}


def _own(cut: Cut, presharded: bool) -> Cut:
    """``cut`` of sums that are this process's rows already where ``presharded`` (an empty
    cut stays empty: a replica after the first, under HSDP)."""
    return (cut[0], 0, cut[2] - cut[1]) if presharded and cut is not None else cut


_rows = sharded.chunk_rows


def _cut(name: str, param, split=None, fsdp_param=None, tp=(0, 1)) -> Cut:
    """The cut of ``param`` (``split``: its tensor-parallel placements; ``tp``: this
    process's rank in its tensor-parallel mesh, and the mesh's size)."""
    if type(param).__name__ != "DTensor":
        return None
    tp_rank, tp_size = tp
    dim = next((p.dim for p in split or () if p.is_shard()), None)
    if split is not None and fsdp_param is None:  # tensor parallelism alone: this process's sums
        return None if dim is None else (dim, 0, param.to_local().shape[dim])
    if split is not None:  # inside FSDP2: the tp shard's sums (or whole ones), rows by dp
        rows = _rows(param.shape[0], tp_size, tp_rank) if dim == 0 else (0, param.shape[0])
        index, shards, first = sharded.shard_position(fsdp_param)
        start, stop = _rows(rows[1] - rows[0], shards, index)
        return (0, start, stop) if first and (dim is not None or tp_rank == 0) else (0, 0, 0)
    placements, mesh = param.placements, param.device_mesh
    # FSDP2's Shard(dim) on a 1-D mesh, or HSDP's (Replicate(), Shard(dim)) on a 2-D one.
    dim = getattr(placements[-1], "dim", None)
    if dim is None or mesh.ndim > 2 or not all(p.is_replicate() for p in placements[:-1]):
        raise RuntimeError(
            f"cockpit_gradnoise: parameter {name!r} is a DTensor placed {placements} on a "
            f"{mesh.ndim}-D mesh; only FSDP2's one Shard(dim) on a 1-D mesh, or HSDP's "
            "(Replicate(), Shard(dim)), is supported"
        )
    rank = mesh.get_local_rank(mesh.ndim - 1)
    start, stop = _rows(param.shape[dim], mesh.size(mesh.ndim - 1), rank)
    local = param.to_local().shape[dim]
    if local != stop - start:
        raise RuntimeError(
            f"cockpit_gradnoise: parameter {name!r}'s shard on process {rank} has {local} rows "
            f"of dim {dim}, not the {stop - start} that torch.chunk gives: a layout not supported"
        )
    # On the dp part of a ("dp", "tp") mesh, a layer not split: held by the first tp group;
    # under HSDP by the shard's first replica.
    first = all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim - 1))
    return (dim, start, stop) if tp_rank == 0 and first else (dim, 0, 0)


def local_part(full: Tensor, cut: Cut, rank: int) -> Tensor:
    """This process's part of ``full`` (shaped as the parameter): a copy of its rows.

    A 0-dim tensor (a per-parameter number, not per element) is returned as it is.
    """
    if full.dim() == 0:
        return full
    if cut is None:
        return full.clone() if rank == 0 else full.reshape(-1)[:0]
    dim, start, stop = cut
    return full.narrow(dim, start, stop - start).clone()  # the reduced buffer can then be freed


def local_weights(local: Tensor, cut: Cut, rank: int) -> Tensor:
    """This process's part of a per-element tensor held like the parameter (``local``: the
    local tensor of a DTensor placed as it, or a plain tensor), on the elements of ``cut``.

    Where another process holds them (a parameter not split by tensor parallelism, on a
    ``tp`` rank other than the first: an empty cut), none; a plain tensor as
    :func:`local_part` cuts the sums.
    """
    if cut is None:
        return local_part(local, None, rank)
    dim, start, stop = cut
    if local.shape[dim] == stop - start:
        return local
    if stop == start:
        return local.narrow(dim, 0, 0)
    raise RuntimeError(
        f"cockpit_gradnoise: a shard of {local.shape[dim]} rows of dim {dim} where this "
        f"process's sums hold {stop - start}: a layout not supported")


def added_across_processes(values: List[Tuple[float, float, int]],
                           added: Optional[List[Tuple[bool, bool]]] = None) -> List[Tuple[float, float, int]]:
    """``(S, M, N)`` per parameter with ``S`` and ``M`` (sums over elements, each process's
    over its own) added over the processes, in rank order: the same floats on every process.

    ``added``: per parameter, which of ``S`` and ``M`` are this process's part (the others,
    the same on every process already, are kept); default both.

    Collective (one ``all_reduce`` of ``W x 2P`` float64 numbers).
    """
    added = [(True, True)] * len(values) if added is None else added
    local = torch.tensor([float(v) if a else 0.0 for value, flags in zip(values, added)
                          for v, a in zip(value[:2], flags)], dtype=torch.float64)
    table = distributed.gather_rows(local).tolist()
    totals = [math.fsum(column) for column in zip(*table)]
    return [tuple(totals[2 * k + j] if flags[j] else value[j] for j in (0, 1)) + (value[2],)
            for k, (value, flags) in enumerate(zip(values, added))]
