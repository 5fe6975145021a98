"""Tensor parallelism (``torch.distributed.tensor.parallel``): exact per-example results of split layers.

``parallelize_module`` with ``ColwiseParallel`` or ``RowwiseParallel``
replaces a Linear's weight (and bias) by a ``DTensor`` split across the
processes of a tensor-parallel mesh (Colwise: the output rows,
``Shard(0)``; Rowwise: the input columns, ``Shard(1)``, its bias
replicated), and the layer computes on DTensors. Every process of the mesh
sees the same examples. This package's rules run on this process's local
tensors (:func:`local_call`, from the hooks' dispatch): the layer's input
and output gradient as this process holds them (whole, or split along the
features), so a rule's results are those of this process's shard of the
weight, ``x_i`` restricted to its elements. Then (:func:`collect`, after the
backward pass, before the quantities read them):

- a split parameter's per-example squared norms are **added** over the
  mesh (its elements are disjoint across processes:
  ``||x_i||^2 = sum_r ||x_i^(r)||^2``), one ``all_reduce`` per dtype;
- its local gradient (``sum_i x_i`` of this shard) is gathered whole, for
  ``GradientNoiseScale``'s ``||sum_i g_i||^2``;
- a replicated parameter (Rowwise's bias) has the whole result on every
  process already: nothing is added (counted once).

The processes of the mesh hold one copy of the examples: only the first
(:func:`duplicate_examples` is ``False`` there) contributes them to the
reduction across processes, the others contribute none.

Inside FSDP2 (``fully_shard`` on ``dp`` of a ``("dp", "tp")`` mesh, after
``parallelize_module`` on ``tp``) the same holds along ``tp``: the layer computes
with FSDP2's unsharded parameter, a DTensor split over ``tp`` whose spec
(:func:`split_parameters`) says what to add and gather; the ``dp`` groups hold
distinct examples, whose sums the reduction across processes adds as under FSDP2.

The two-batch noise scale, which runs no rule, reads this process's local gradients:
:func:`norm_counts` says which of their squared norms each process adds over the mesh.

Refused by name (:func:`unsupported_call`, :func:`unsupported_layout`):
layers other than ``nn.Linear`` with DTensor parameters or inputs (a
``RowwiseParallel`` Embedding: its rule reads global row indices), an input
or output gradient split along positions (``SequenceParallel`` and
``Shard(1)`` layouts: each process's per-example gradients are partial sums
over its positions, whose squared norms do not add) or partial, and a mesh of
more than one dimension or not over every process (but FSDP2's ``dp`` x ``tp``:
:func:`.sharded.unsupported_layout`).
"""

from typing import Optional

from cockpit_gradnoise.extensions import facts, sharded
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD

from torch import nn

# A result already combined over the mesh in this backward pass (collect runs once per
# quantity): an attribute of the result tensor, which the next backward pass replaces.
_COMBINED = "_cgn_tensor_parallel_combined"


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (by class name: nothing is imported)."""
    return type(tensor).__name__ == "DTensor"


def unsupported_layout(param) -> Optional[str]:
    """Why a tensor-parallel ``DTensor`` parameter cannot be made exact here, or ``None``."""
    import torch.distributed as dist

    mesh = param.device_mesh
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.ndim != 1:
        return (f"tensor parallelism on a {mesh.ndim}-D device mesh (only a 1-D mesh is "
                "supported without FSDP2)")
    if mesh.size() != world:
        return (f"tensor parallelism over {mesh.size()} of the {world} processes (the "
                "tensor-parallel mesh must span every process)")
    if world < 2:
        return "tensor parallelism on one process"
    if any(not (p.is_shard() or p.is_replicate()) for p in param.placements):
        return f"a DTensor parameter placed {param.placements} (only Shard and Replicate)"
    return None


def unsupported_call(module: nn.Module, inputs: tuple, g_out: tuple) -> Optional[str]:
    """Why a call with DTensors cannot give exact per-example results, or ``None``."""
    if not isinstance(module, nn.Linear):
        return (f"tensor parallelism on a {type(module).__name__} (only nn.Linear layers "
                "split by ColwiseParallel or RowwiseParallel are supported)")
    for what, tensor in (("input", inputs[0] if inputs else None), ("output gradient", g_out[0])):
        for placement in getattr(tensor, "placements", ()) if is_dtensor(tensor) else ():
            if placement.is_partial():
                return f"its {what} is a partial sum over processes ({placement})"
            if placement.is_shard() and placement.dim % tensor.ndim != tensor.ndim - 1:
                return (f"its {what} is split along positions ({placement}: SequenceParallel "
                        "or a sequence-sharded layout), where each process's per-example "
                        "gradients are partial sums whose squared norms do not add")
    return None


def local_call(module: nn.Module, inputs: tuple, output, g_out: tuple):
    """``(inputs, output, g_out)`` with each DTensor as this process's local tensor.

    Unchanged where none is a DTensor. ``None`` where the call cannot give
    exact results (:func:`unsupported_call`): its parameters are refused by
    name in the backward pass's facts (the quantities leave them out, warning)
    and no rule runs.
    """
    if not any(map(is_dtensor, (*inputs, output, *g_out))):
        return inputs, output, g_out
    why = unsupported_call(module, inputs, g_out)
    if why is not None:
        recording = facts.recording()
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                recording.refuse(param, why)
        return None
    return tuple(map(local, inputs)), local(output), tuple(map(local, g_out))


def local(tensor):
    """This process's part of a DTensor; anything else as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def splits(module: nn.Module) -> bool:
    """Whether ``module`` holds a DTensor parameter of its own."""
    return any(map(is_dtensor, module.parameters(recurse=False)))


def save_local_gradient(extension, module: nn.Module, g_out: tuple) -> bool:
    """A split Linear's ``sum_i x_i`` on this process's shards (``LocalGradient``'s rule there:
    BackPACK's checks the result against the parameter's global shape). ``True``."""
    grads = g_out[0].reshape(-1, g_out[0].shape[-1])
    results = {"weight": lambda: grads.T @ module.input0.reshape(-1, module.input0.shape[-1]),
               "bias": lambda: grads.sum(0)}
    for name, param in module.named_parameters(recurse=False):
        if param.requires_grad:
            setattr(param, extension.savefield, results[name]())
    return True


def split_parameters(params) -> list:
    """``(param, mesh, placements)`` of each parameter split by tensor parallelism, with the
    tensor-parallel mesh and placements: a DTensor's own where FSDP2 does not shard it; where
    FSDP2 shards it over tensor parallelism (a ``("dp", "tp")`` mesh), those of FSDP2's
    unsharded parameter (``FSDPParam._unsharded_dtensor_spec``, what the layer computes with)."""
    found = [p for p in params if is_dtensor(p)]
    managed = sharded.fsdp2_parameters() if found else {}
    split = []
    for param in found:
        fsdp_param = managed.get(id(param))
        spec = param if fsdp_param is None else getattr(fsdp_param, "_unsharded_dtensor_spec", None)
        if spec is not None:
            split.append((param, spec.device_mesh if fsdp_param is None else spec.mesh, spec.placements))
    return split


def collect(params) -> None:
    """Complete the results of the split parameters over their mesh (module docstring).

    Collective over each split parameter's mesh: every process calls it with
    the same parameters in the same order (every quantity does, once per
    tracked step; a second call finds the results combined and does nothing).
    """
    import torch
    import torch.distributed as dist

    pending = {}
    for param, mesh, placements in split_parameters(params):
        if not any(p.is_shard() for p in placements):
            continue  # replicated: the whole result on every process already
        norms = param.__dict__.get(BATCH_L2_SAVEFIELD)
        if norms is not None and not norms.__dict__.get(_COMBINED):
            pending.setdefault((mesh, norms.dtype), []).append(norms)
        gradient = param.__dict__.get(LOCAL_GRADIENT_SAVEFIELD)
        if gradient is not None and not gradient.__dict__.get(_COMBINED):
            whole = _gathered(gradient, param, mesh, placements)
            whole.__dict__[_COMBINED] = True
            setattr(param, LOCAL_GRADIENT_SAVEFIELD, whole)
    for (mesh, _), tensors in pending.items():
        buffer = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(buffer, group=mesh.get_group())
        for tensor, part in zip(tensors, buffer.split([t.numel() for t in tensors])):
            tensor.copy_(part.view_as(tensor))
            tensor.__dict__[_COMBINED] = True


def _gathered(local_result, param, mesh, placements):
    """A shard's result (this process's part of ``param`` split by ``placements`` over the
    tensor-parallel ``mesh``) gathered whole, shaped like ``param``."""
    from torch.distributed.tensor import DTensor

    spread = DTensor.from_local(local_result, mesh, placements,
                                run_check=False, shape=param.shape, stride=param.stride())
    return spread.full_tensor()


def norm_counts(params) -> Optional[tuple]:
    """``(mesh, counted, first)`` where some of ``params`` is split by tensor parallelism
    (alone or inside FSDP2), else ``None``: the tensor-parallel mesh, per parameter whether
    this process counts the squared norm of its local gradient, and whether it is the mesh's
    first process. A split parameter's elements are disjoint across the mesh: counted on
    every process (the squares add); any other's local gradient (whole, or FSDP2's ``dp``
    shard) is the same on every process of the mesh: counted on the first only."""
    split = split_parameters(params)
    if not split:
        return None
    mesh = split[0][1]
    first = mesh.get_local_rank() == 0
    shards = {id(param) for param, _, placements in split if any(p.is_shard() for p in placements)}
    return mesh, [first or id(param) in shards for param in params], first


def duplicate_examples(params) -> bool:
    """Whether this process's examples are another's: not the first of a tensor-parallel mesh.

    Every process of the mesh runs the same examples; the first contributes
    them to the reduction across processes, the others none.
    """
    split = split_parameters(params)
    return bool(split) and split[0][1].get_local_rank() != 0
