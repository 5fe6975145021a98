"""FSDP2 (``fully_shard``): where the per-example results of a sharded parameter land.

FSDP2 registers on each module a sharded ``DTensor`` parameter (what
``model.parameters()`` returns and what a Cockpit holds) and, around the
module's forward and backward pass, swaps it for the unsharded plain
parameter (``FSDPParam._unsharded_param``, one object kept for the whole
run). This package's rules run in the module's backward pass on each
process's local examples, from the layer's input and output gradient, which
are whole there: their results are those of the full parameter. They are
written on whichever parameter the module holds when the rule runs, the
unsharded one or (for a layer whose output gradient arrives before FSDP2
unshards it, a first layer say) the sharded one.

:func:`reduce_in_backward` reduce-scatters a layer's per-element sums (those of
GradientVarianceQuantiles and PreconditionedNoiseScale) and GradientNoiseScale's local
gradient inside the backward pass, as soon as its gradient is accumulated, so that each
process keeps only its :func:`torch.chunk` rows of them between layers (:func:`reduced_rows`).

:func:`collect` moves them, after the backward pass, from the unsharded
parameter onto the sharded one, with the backward pass's facts
(:class:`~.facts.BackwardFacts`, keyed by the parameter's ``id``), so the
quantities find them where they look. :func:`clear` drops what a failed
backward pass left there, before the next tracked one.

FSDP2's parameters are found through torch's registry of composable states
(``torch.distributed._composable_state``): private, read here only.
:func:`unsupported_layout` names what is refused: a mesh of more than one
dimension but HSDP's (replicate x shard), a mesh that does not span every
process, tensor parallelism inside FSDP2 (a DTensor parameter before
sharding) unless the quantity is exact there (FSDP2 on ``dp`` of a
``("dp", "tp")`` mesh, :mod:`.tensor_parallel` completes the split layers' results), and a
``MixedPrecisionPolicy`` that casts the parameters to another dtype than bfloat16, or to
bfloat16 with HSDP or tensor parallelism (not examined). Under ``param_dtype=torch.bfloat16``
the rules see the module's bfloat16 parameter, input and output gradient as in a bfloat16
model (:mod:`.precision`), so the statistics are those of the bfloat16 pass's per-example
gradients, each process's rounded after its own loss scale (``docs/distributed.md``).
"""

import functools
import math
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

from cockpit_gradnoise.extensions import facts
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)

#: The results this package's extensions write on a parameter.
SAVEFIELDS = (BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD, SUMS_SAVEFIELD)


def fsdp2_parameters() -> Dict[int, object]:
    """``{id(sharded parameter): FSDPParam}`` of every FSDP2 module alive in this process."""
    try:
        from torch.distributed import _composable_state
    except ImportError:  # torch without distributed support
        return {}
    found = {}
    for ref in list(_composable_state._module_state_mapping.values()):
        state = ref()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fsdp_param in group.fsdp_params:
                found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def class_before_sharding(module) -> type:
    """``module``'s class before ``fully_shard``: FSDP2 gives a module it shards the class
    ``FSDP<name>`` of bases ``(FSDPModule, <its class>)`` (seen through here, by name:
    nothing is imported); any other module's class as it is."""
    kind = type(module)
    bases = kind.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and kind.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return kind


def sharded_by_fsdp2(module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``module`` (its class changed:
    :func:`class_before_sharding`)."""
    return class_before_sharding(module) is not type(module)


def unsupported_layout(fsdp_param, tensor_parallel: bool = False, over_tp=()) -> Optional[str]:
    """Why an FSDP2 parameter's results cannot be made exact here, or ``None``.

    With ``tensor_parallel``, FSDP2 over tensor parallelism (a ``("dp", "tp")`` mesh) passes,
    and so does a parameter not split by it, sharded on one of ``over_tp`` (the ``dp`` meshes
    of the parameters over tensor parallelism): the processes of a ``tp`` group hold the same
    shard of it, and the same examples.
    """
    tp_spec = getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    inside = tp_spec is not None or getattr(fsdp_param, "is_dtensor", False)
    if inside and not tensor_parallel:
        return "tensor parallelism inside FSDP2 (a DTensor parameter sharded again)"
    mesh = fsdp_param.mesh_info.mesh
    if inside:
        return _unsupported_inside(fsdp_param, mesh, tp_spec) or _mixed_precision_refusal(fsdp_param)
    # HSDP (a 2-D mesh: replicate x shard): every process runs its own examples, as on a 1-D mesh.
    if mesh.ndim != 1 and not (mesh.ndim == 2 and is_hsdp(fsdp_param)):
        return (f"a {mesh.ndim}-D device mesh other than HSDP's (only a 1-D mesh, or HSDP's "
                "replicate x shard mesh, is supported)")
    if mesh.size() != dist_world_size() and not any(mesh == dp for dp in over_tp):
        return (f"a device mesh of {mesh.size()} of the {dist_world_size()} processes "
                "(the mesh must span every process, or be the dp mesh of parameters split by "
                "tensor parallelism among the tracked ones)")
    return _mixed_precision_refusal(fsdp_param)


def is_hsdp(fsdp_param) -> bool:
    """Whether FSDP2 shards ``fsdp_param`` on HSDP's replicate x shard mesh (its mesh info's
    class, by name: nothing is imported)."""
    return type(fsdp_param.mesh_info).__name__ == "HSDPMeshInfo"


def shard_position(fsdp_param) -> Tuple[int, int, bool]:
    """``(index, shards, first replica)`` of an FSDP2 parameter on this process: its shard's
    index among the shards (the ``torch.chunk`` part FSDP2 gives it), their number, and
    whether this process holds the first copy of that shard along HSDP's replicate dimension
    (always, on a 1-D mesh): each element of a sum over every process's shard is counted by
    that copy only."""
    info = fsdp_param.mesh_info
    return info.shard_mesh_rank, info.shard_mesh_size, getattr(info, "replicate_mesh_rank", 0) == 0


def first_replica(param, managed: Optional[Dict[int, object]] = None) -> bool:
    """Whether this process counts its shard of ``param`` along HSDP's replicate dimension
    (:func:`shard_position`; ``True`` for a parameter not sharded by HSDP). ``managed``:
    :func:`fsdp2_parameters`, if known."""
    fsdp_param = (fsdp2_parameters() if managed is None else managed).get(id(param))
    return fsdp_param is None or shard_position(fsdp_param)[2]


def _unsupported_inside(fsdp_param, dp_mesh, tp_spec) -> Optional[str]:
    """Why FSDP2 on ``dp_mesh`` over tensor parallelism (``tp_spec``) is refused, or ``None``:
    supported is a 1-D ``dp`` mesh, or HSDP's replicate x shard one, over a 1-D tensor-parallel
    one, together every process (every process of a ``dp`` mesh, replicas included, runs its
    own examples; the processes of a ``tp`` group the same ones)."""
    tp_mesh = getattr(tp_spec, "mesh", None)
    dp_dims = 2 if is_hsdp(fsdp_param) else 1
    if (getattr(fsdp_param.mesh_info, "is_spmd_mesh", False) or tp_mesh is None
            or dp_mesh.ndim != dp_dims or tp_mesh.ndim != 1):
        return ("tensor parallelism inside FSDP2 other than FSDP2 on a 1-D dp mesh or HSDP's "
                "replicate x shard mesh over a 1-D tp mesh (expert parallelism or "
                "dp_mesh_dims are not supported)")
    if dp_mesh.size() * tp_mesh.size() != dist_world_size():
        return (f"a dp x tp mesh of {dp_mesh.size()} x {tp_mesh.size()} of the "
                f"{dist_world_size()} processes (the mesh must span every process)")
    if any(not (p.is_shard() or p.is_replicate()) for p in tp_spec.placements):
        return f"a tensor-parallel parameter placed {tp_spec.placements} (only Shard and Replicate)"
    return None


def _mixed_precision_refusal(fsdp_param) -> Optional[str]:
    """Why a ``MixedPrecisionPolicy``'s cast of the parameters is refused, or ``None``: only
    ``param_dtype=torch.bfloat16`` on a 1-D mesh without tensor parallelism is examined
    (``tests/test_fsdp2_bf16.py``)."""
    import torch

    # None: no cast (FSDP2 sets both at its first forward pass; absent before).
    param_dtype = getattr(fsdp_param, "param_dtype", None)
    if param_dtype in (None, getattr(fsdp_param, "orig_dtype", None)):
        return None
    if param_dtype != torch.bfloat16:
        return (f"a MixedPrecisionPolicy casting the parameters to {param_dtype} (supported: "
                "param_dtype=torch.bfloat16, whose statistics are those of the bfloat16 pass's "
                "per-example gradients; float16 training needs a gradient scaler, not examined)")
    if fsdp_param.mesh_info.mesh.ndim != 1 or getattr(fsdp_param, "is_dtensor", False) \
            or getattr(fsdp_param, "_unsharded_dtensor_spec", None) is not None:
        return ("a MixedPrecisionPolicy (param_dtype=torch.bfloat16) with HSDP or tensor "
                "parallelism (not examined: supported on a 1-D mesh of FSDP2 alone)")
    return None


def dist_world_size() -> int:
    """The default process group's size (a name the tests replace)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dist_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collect(params: Iterable) -> None:
    """Move the per-example results of FSDP2's unsharded parameters onto the sharded ones.

    Where both hold one (a layer run several times in one forward pass, whose
    uses' results landed on both), neither is complete: the parameter is
    refused (left out with a warning naming it), never half counted.
    """
    disarm()  # the backward pass is over
    managed = fsdp2_parameters()
    recording = facts.recording()
    for param in params:
        fsdp_param = managed.get(id(param))
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is None or unsharded is param:
            continue
        found = [field for field in SAVEFIELDS if field in unsharded.__dict__]
        if not found:
            continue
        recording.alias(unsharded, param)
        if any(field in param.__dict__ for field in found):
            for field in SAVEFIELDS:
                param.__dict__.pop(field, None)
                unsharded.__dict__.pop(field, None)
            recording.refuse(param, "its layer ran several times in one pass under FSDP2, and "
                             "the uses' results landed on both its sharded and unsharded "
                             "copies (not combined yet)")
            continue
        for field in found:
            setattr(param, field, unsharded.__dict__.pop(field))


def clear() -> None:
    """Drop results left on FSDP2's unsharded parameters (by a backward pass that failed)."""
    for fsdp_param in fsdp2_parameters().values():
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for field in SAVEFIELDS if unsharded is not None else ():
            unsharded.__dict__.pop(field, None)


def gathered(param):
    """A plain tensor holding a DTensor parameter's full values, its ``.grad`` the full gradient.

    Collective (two all-gathers over the parameter's mesh): every process must
    ask for the same parameters in the same order. Memory: one parameter and its
    gradient unsharded, as FSDP2 itself holds them around a layer's backward pass.
    Any other tensor is returned as it is.
    """
    if type(param).__name__ != "DTensor":
        return param
    import torch

    with torch.no_grad():
        full = param.full_tensor()
        if param.grad is not None:
            full.grad = param.grad.full_tensor()
    return full


def counted_here(param) -> bool:
    """Whether this process counts ``param``'s local shard in a sum over every process: a
    DTensor replicated along a mesh dimension (HSDP's replicate dimension, a replicated
    tensor-parallel bias) is counted by the first process along it only; any other tensor,
    a whole copy on every process, by the first process."""
    if type(param).__name__ != "DTensor":
        return dist_rank() == 0
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    # A mesh over some processes (FSDP2's dp part of a ("dp", "tp") mesh): its copies hold the
    # same shards; the copy holding process 0 counts.
    return bool((mesh.mesh == 0).any()) and all(
        c == 0 for c, p in zip(coordinate, param.placements) if p.is_replicate())


def local_tensor(tensor):
    """This process's shard of a ``DTensor`` (``to_local()``), any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) and type(tensor).__name__ == "DTensor" else tensor


# Per-element sums reduce-scattered inside the backward pass ---------------------------

#: ``(armed step, {field: hook handles})`` of :func:`reduce_in_backward`, until the backward
#: pass ends.
_armed: Tuple[object, Dict[str, list]] = (None, {})

#: What :func:`reduce_in_backward` sends of a parameter: ``(value [k, *shape], units, note)``,
#: or ``None`` (left alone), from the parameter holding the field.
Prepare = Callable[[object], Optional[Tuple[object, Sequence[float], object]]]


def chunk_rows(size: int, parts: int, index: int) -> Tuple[int, int]:
    """``[start, stop)`` of part ``index`` of ``size`` rows cut in ``parts`` by :func:`torch.chunk`
    (as FSDP2 cuts a parameter: the last parts may be short, or empty)."""
    rows = -(-size // parts)
    start = min(index * rows, size)
    return start, min(start + rows, size)


def reduce_in_backward(step, field: str, prepare: Prepare, done: dict, params=(), split: bool = False,
                       alone: bool = True) -> None:
    """Arm, for the coming backward pass, the reduction of ``field`` over the processes as
    soon as each parameter's gradient is accumulated.

    For each FSDP2 parameter sharded ``Shard(dim)`` on a 1-D mesh of every process, or on
    HSDP's replicate x shard mesh of every process (no tensor parallelism), a hook on its
    unsharded copy (``register_post_accumulate_grad_hook``: after the module's rules ran,
    before FSDP2's own reduce-scatter) asks ``prepare(holder)`` (holder: whichever parameter
    holds ``field``) what to send: ``(value, units, note)``, ``value`` ``[k, *shape]`` in
    this process's units (``None``: left alone, on every process alike;
    :func:`sums_in_units` for per-element sums). It reduce-scatters ``value[j] / units[j]``
    with :func:`torch.chunk`'s rows of ``dim`` over the shard dimension, then adds them over
    HSDP's replicate dimension (:func:`reduced_rows`, empty shards included: every process
    holds its rows of the sum over every process, the replicas the same) and leaves this
    process's rows in this process's units (multiplied back by ``units[j]``) on the holder,
    shaped as ``field`` was (``[k, *rows]``, or ``rows`` for a field of the parameter's
    shape sent as ``[1, *shape]``), so that the quantities read them as before;
    ``done[id(sharded parameter)] = note``. Memory: one layer's ``value`` twice, for the
    collective, instead of every layer's until the backward pass ends.
    Idempotent for one ``step`` and ``field``; several fields are reduced in the order armed.

    With ``split``, parameters split by tensor parallelism too (:func:`split_over_tp`):
    GradientNoiseScale's local gradient, and (``alone`` false: inside FSDP2 only, a split
    parameter's sums staying with their shard under tensor parallelism alone) the per-element
    sums of GradientVarianceQuantiles and PreconditionedNoiseScale. Inside FSDP2, on ``dp`` of a ``("dp", "tp")``
    mesh or HSDP's replicate x shard over ``tp``, the hook on FSDP2's unsharded parameter (a
    DTensor split over ``tp``) reduce-scatters this process's ``tp`` shard's value over the
    data-parallel mesh as above, the rows :func:`torch.chunk` gives it of the shard's ``dim``;
    alone (one of ``params``, a DTensor split over a 1-D mesh of every process, whose
    processes run the same examples), the hook on the parameter keeps the shard's value as
    it is (nothing to add: every example is on every process). Inside FSDP2 a parameter not
    split (replicated on ``tp``, or sharded on the data-parallel mesh only) is reduce-scattered
    likewise, the processes of a ``tp`` group keeping the same rows. A split parameter's rows
    are disjoint elements of the global sum (across ``tp`` and across the data-parallel
    shards), never gathered whole: O(parameters / processes). A ``note`` (a tuple of numbers, each a
    sum over this process's elements: the squared norm of its local gradient) is added over
    ``tp`` (one ``all_reduce`` over the ``tp`` group), so that it is that of the whole
    parameter's.

    Collective in the backward pass: every process reduces the same parameters in the same
    order (the autograd engine's, the same graph on every process), as FSDP2's own
    reduce-scatters need. Disarmed by :func:`collect` (the backward pass is over) and by
    arming the next step.
    """
    global _armed
    if _armed[0] is not step:
        disarm()
        _armed = (step, {})
    if field in _armed[1]:
        return
    world, handles = dist_world_size(), []
    managed = fsdp2_parameters()
    # FSDP2's data-parallel meshes over tensor parallelism: a layer not split is sharded on one.
    dp_of_tp = [p.mesh_info.mesh for p in managed.values() if getattr(p, "_unsharded_dtensor_spec", None)]
    for fsdp_param in managed.values():
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        param = fsdp_param.sharded_param
        kept = _kept_in_backward(fsdp_param, world, split, dp_of_tp)
        if unsharded is None or not unsharded.requires_grad or param.dim() == 0 or kept is None:
            continue
        info, hsdp = fsdp_param.mesh_info, is_hsdp(fsdp_param)
        over = (fsdp_param.fsdp_placement.dim, info.mesh, info.shard_mesh_dim if hsdp else None,
                info.replicate_mesh_dim if hsdp else None)
        hook = functools.partial(_reduce_field, field, prepare, param, over, kept[0], done)
        handles.append(unsharded.register_post_accumulate_grad_hook(hook))
    for param in params if split and alone and world > 1 else ():
        if (type(param).__name__ == "DTensor" and id(param) not in managed and param.requires_grad
                and param.device_mesh.size() == world and split_over_tp(param.device_mesh, param.placements)):
            hook = functools.partial(_reduce_field, field, prepare, param, None, param.device_mesh, done)
            handles.append(param.register_post_accumulate_grad_hook(hook))
    _armed[1][field] = handles


def _kept_in_backward(fsdp_param, world: int, split: bool, dp_of_tp) -> Optional[tuple]:
    """``(tp mesh or None,)`` where :func:`reduce_in_backward` hooks ``fsdp_param`` (the tensor-
    parallel mesh of a split one, over which its notes add), else ``None``: FSDP2 or HSDP of
    every process; with ``split``, also over tensor parallelism (a parameter split or
    replicated on ``tp``, or not split, sharded on one of ``dp_of_tp``)."""
    mesh, tp_spec = fsdp_param.mesh_info.mesh, getattr(fsdp_param, "_unsharded_dtensor_spec", None)
    if tp_spec is not None:
        if not split or _unsupported_inside(fsdp_param, mesh, tp_spec) is not None:
            return None
        return (tp_spec.mesh if split_over_tp(tp_spec.mesh, tp_spec.placements) else None,)
    if mesh.ndim != (2 if is_hsdp(fsdp_param) else 1):
        return None
    return (None,) if mesh.size() == world or (split and any(mesh == dp for dp in dp_of_tp)) else None


def split_over_tp(mesh, placements) -> bool:
    """Whether a tensor-parallel DTensor on ``mesh`` placed ``placements`` is split (some
    ``Shard``), on a 1-D mesh of two processes or more, whose other placements are
    ``Replicate``: the layouts whose shards :func:`reduce_in_backward` keeps."""
    return (mesh.ndim == 1 and mesh.size() > 1 and any(p.is_shard() for p in placements)
            and all(p.is_shard() or p.is_replicate() for p in placements))


def armed_in_backward() -> bool:
    """Whether hooks of :func:`reduce_in_backward` are armed for the coming or running backward
    pass (they read the layers' results inside it)."""
    return any(_armed[1].values())


def disarm() -> None:
    """Remove the hooks of :func:`reduce_in_backward`."""
    global _armed
    for handles in _armed[1].values():
        for handle in handles:
            handle.remove()
    _armed = (None, {})


def loss_scale_or_nan(scale: Callable[[], Optional[float]]) -> Optional[float]:
    """``scale()`` as a float (``None``: not wanted); NaN where it raises (raised again after
    the backward pass, on every process together)."""
    try:
        c = scale()
    except Exception:
        return math.nan
    return None if c is None else float(c)


def sums_in_units(field: str, scale: Callable[[], Optional[float]]) -> Prepare:
    """The ``prepare`` of :func:`reduce_in_backward` for per-element sums ``[k, *shape]`` of
    ``field``: row 0 in units of this process's loss scale ``c = scale()``, the other rows
    (sums of squares) in units of ``c**2``."""
    def prepare(holder):
        c = loss_scale_or_nan(scale)
        if c is None:  # not wanted in this call (on every process alike)
            return None
        value = holder.__dict__[field]
        return value, [c] + [c * c] * (value.shape[0] - 1), None
    return prepare


def _reduce_field(field, prepare, param, over, tp_mesh, done, hooked) -> None:
    """The hook of :func:`reduce_in_backward` on ``hooked`` (FSDP2's unsharded parameter, or
    a tensor-parallel ``param`` itself): ``over`` the arguments of :func:`reduced_rows` but
    the value and units (``None``: kept as it is), ``tp_mesh`` the tensor-parallel mesh of
    a split parameter (its note added over it) or ``None``."""
    holders = [p for p in {id(hooked): hooked, id(param): param}.values() if field in p.__dict__]
    if len(holders) != 1:  # none, or both (refused by collect): on every process alike
        return
    sent = prepare(holders[0])
    if sent is None:
        return
    value, units, note = sent
    rows = value if over is None else reduced_rows(value, units, *over)
    if note is not None and tp_mesh is not None:
        note = added_over(note, tp_mesh)
    # Shaped as the field was: [k, *rows], or rows where it was sent as [1, *shape].
    holders[0].__dict__[field] = rows if holders[0].__dict__[field].dim() == rows.dim() else rows[0]
    done[id(param)] = note


def added_over(numbers: tuple, mesh) -> tuple:
    """``numbers`` (0-dim tensors or floats) each added over the 1-D ``mesh``'s processes, as
    float64 0-dim tensors (one ``all_reduce``; collective)."""
    import torch
    import torch.distributed as dist

    buffer = torch.stack([torch.as_tensor(number, dtype=torch.float64) for number in numbers])
    dist.all_reduce(buffer, group=mesh.get_group())
    return tuple(buffer.unbind())


#: Elements of one collective's buffer in :func:`reduced_rows` (8 MiB of float64), so that
#: what it adds to a layer's sums and this process's rows of them stays small.
PIECE = 2**20


def reduced_rows(value, units, dim: int, mesh, shard_dim: Optional[int] = None,
                 replicate_dim: Optional[int] = None):
    """This process's :func:`torch.chunk` rows of ``dim`` of ``value[j] / units[j]`` summed
    over ``mesh``'s processes, multiplied back by ``units[j]``, for each ``j`` of ``value``'s
    first dimension: ``[k, *rows]``.

    The rows are cut over ``mesh`` (1-D), or over its dimension ``shard_dim``; with
    ``replicate_dim`` (HSDP's), the rows are then added over that dimension too, so that
    every process holds its rows of the sum over every process of ``mesh``.

    Collective: ``reduce_scatter_tensor`` of each process's ``k`` blocks one after the other,
    zero-padded to the largest, in pieces of at most :data:`PIECE` elements (the same pieces
    on every process: one collective for a layer of fewer elements); with ``replicate_dim``,
    one ``all_reduce`` of this process's rows over it.
    """
    import torch.distributed as dist

    world, me = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    cuts = [chunk_rows(value.shape[dim + 1], world, r) for r in range(world)]
    out = value.new_empty(value.shape[0], *value[0].narrow(dim, *_span(cuts[me])).shape)
    blocks = [[row.narrow(dim, *_span(cut)).reshape(-1) for row in value] for cut in cuts]
    most = max(sum(block.numel() for block in rows) for rows in blocks)
    piece, received = max(PIECE // world, 1), out.view(-1)
    for offset in range(0, most, piece):
        size = min(piece, most - offset)
        buffer = value.new_zeros(world, size)
        for into, rows in zip(buffer, blocks):
            _scaled_part(into, rows, units, offset)
        got = value.new_empty(size)
        dist.reduce_scatter_tensor(got, buffer.view(-1), group=mesh.get_group(shard_dim))
        kept = received[offset : offset + size]
        kept.copy_(got[: kept.numel()])
    if replicate_dim is not None and mesh.size(replicate_dim) > 1:
        dist.all_reduce(out, group=mesh.get_group(replicate_dim))
    return out.mul_(out.new_tensor(units).view(-1, *[1] * (out.dim() - 1)))


def _scaled_part(into, rows, units, offset) -> None:
    """``into`` = elements ``[offset, offset + len(into))`` of ``rows`` one after the other,
    each row divided by its unit (what lies past them stays 0)."""
    import torch

    start = 0
    for row, unit in zip(rows, units):
        low, high = max(offset, start), min(offset + into.numel(), start + row.numel())
        if low < high:
            torch.div(row[low - start : high - start], unit, out=into[low - offset : high - offset])
        start += row.numel()


def _span(cut) -> Tuple[int, int]:
    """``(start, length)`` of ``[start, stop)``."""
    return cut[0], cut[1] - cut[0]
