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

from typing import Dict, Iterable, Optional

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
    if mesh.ndim != 1 and not (mesh.ndim == 2 and type(fsdp_param.mesh_info).__name__ == "HSDPMeshInfo"):
        return (f"a {mesh.ndim}-D device mesh other than HSDP's (only a 1-D mesh, or HSDP's "
                "replicate x shard mesh, is supported)")
    if mesh.size() != dist_world_size() and not any(mesh == dp for dp in over_tp):
        return (f"a device mesh of {mesh.size()} of the {dist_world_size()} processes "
                "(the mesh must span every process, or be the dp mesh of parameters split by "
                "tensor parallelism among the tracked ones)")
    return _mixed_precision_refusal(fsdp_param)


def _unsupported_inside(fsdp_param, dp_mesh, tp_spec) -> Optional[str]:
    """Why FSDP2 on ``dp_mesh`` over tensor parallelism (``tp_spec``) is refused, or ``None``:
    supported is a 1-D ``dp`` mesh over a 1-D tensor-parallel one, together every process."""
    tp_mesh = getattr(tp_spec, "mesh", None)
    if (getattr(fsdp_param.mesh_info, "is_spmd_mesh", False) or tp_mesh is None
            or dp_mesh.ndim != 1 or tp_mesh.ndim != 1):
        return ("tensor parallelism inside FSDP2 other than FSDP2 on a 1-D dp mesh over a "
                "1-D tp mesh (HSDP, expert parallelism or dp_mesh_dims are not supported)")
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
