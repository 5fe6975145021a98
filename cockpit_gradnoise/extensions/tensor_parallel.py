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
- its local gradient (``sum_i x_i`` of this shard), for ``GradientNoiseScale``'s
  ``||sum_i g_i||^2``, stays this process's shard where the backward pass kept it so
  (:func:`.sharded.reduce_in_backward`: ``||sum_i g_i||^2`` adds the shards' squared
  norms), else is gathered whole;
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

``SequenceParallel`` on ``nn.LayerNorm``, ``nn.RMSNorm`` (:data:`SEQUENCE_NORMS`) and Hugging
Face's RMSNorm of Llama, Qwen2 and Mistral (:data:`.hf_names.RMS_NORMS`, by name): the
weight is replicated and the input split along positions (``Shard(1)``), so each
process's contributions ``x_i^(r) = sum_{p in r} x_hat_ip G_ip`` are partial sums
over its positions, ``x_i = sum_r x_i^(r)``, and squares do not add. The output
gradient is brought to the input's placements (:func:`local_call`), and the
normalization rule adds each example's contributions over the mesh
(:func:`whole_contributions`, one ``all_reduce`` of ``[N, *param.shape]`` per
parameter and backward pass) before any extension reduces them: norms, sums and
the local gradient are then whole and the same on every process, as a replicated
parameter's (counted once). Its ``param.grad`` is a ``Partial`` DTensor (torch
leaves the sum to whoever reads it): :func:`local_values` completes it for the
two-batch noise scale.

Refused by name (:func:`unsupported_call`, :func:`unsupported_layout`):
other layers with DTensor parameters or inputs (a ``RowwiseParallel`` Embedding:
its rule reads global row indices), a Linear whose input or output gradient is
split along positions (a Linear under ``SequenceParallel``: its per-example
gradients are partial sums over positions) or partial, a normalization layer
split along its examples or normalized dimensions, and a mesh of more than one
dimension or not over every process (but FSDP2's ``dp`` x ``tp``:
:func:`.sharded.unsupported_layout`).
"""

from typing import Optional

from cockpit_gradnoise.extensions import facts, sharded
from cockpit_gradnoise.extensions.hf_names import RMS_NORMS
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


#: Layers exact under ``SequenceParallel`` (by exact class: their rule is normalization's,
#: which adds the contributions over the mesh): the module docstring.
SEQUENCE_NORMS = tuple(c for c in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if c is not None)


def sequence_norm(module: nn.Module) -> bool:
    """Whether ``module`` is one of :data:`SEQUENCE_NORMS`, by exact class (FSDP2's class for
    it seen through: :func:`.sharded.class_before_sharding`), or a Hugging Face RMSNorm of
    :data:`.hf_names.RMS_NORMS` (Llama's, Qwen2's, Mistral's: by qualified name; their rule,
    :mod:`.hf`'s, is normalization's too, normalizing the last dimension)."""
    kind = sharded.class_before_sharding(module)
    return kind in SEQUENCE_NORMS or f"{kind.__module__}.{kind.__qualname__}" in RMS_NORMS


def _normalized_dims(module: nn.Module) -> int:
    """How many trailing dimensions ``module`` normalizes: ``normalized_shape``'s, or a
    Hugging Face RMSNorm's weight's (the last dimension)."""
    shape = getattr(module, "normalized_shape", None)
    return len(shape) if shape is not None else module.weight.dim()


def unsupported_call(module: nn.Module, inputs: tuple, g_out: tuple) -> Optional[str]:
    """Why a call with DTensors cannot give exact per-example results, or ``None``."""
    if sequence_norm(module):
        return _unsupported_norm_call(module, inputs, g_out)
    if not isinstance(module, nn.Linear):
        return (f"tensor parallelism on a {type(module).__name__} (only nn.Linear layers "
                "split by ColwiseParallel or RowwiseParallel, and nn.LayerNorm, nn.RMSNorm and "
                "the RMSNorm of Llama, Qwen2 and Mistral under SequenceParallel, are supported)")
    for what, tensor in (("input", inputs[0] if inputs else None), ("output gradient", g_out[0])):
        for placement in getattr(tensor, "placements", ()) if is_dtensor(tensor) else ():
            if placement.is_partial():
                return f"its {what} is a partial sum over processes ({placement})"
            if placement.is_shard() and placement.dim % tensor.ndim != tensor.ndim - 1:
                return (f"its {what} is split along positions ({placement}: SequenceParallel "
                        "or a sequence-sharded layout on a Linear), where each process's "
                        "per-example gradients are partial sums whose squared norms do not add "
                        "(only nn.LayerNorm and nn.RMSNorm are supported under SequenceParallel)")
    return None


def _unsupported_norm_call(module: nn.Module, inputs: tuple, g_out: tuple) -> Optional[str]:
    """Why a normalization layer's call with DTensors cannot be made exact, or ``None``: its
    input must be placed on a 1-D mesh, split along positions only (between the examples and
    ``normalized_shape``) or replicated, its parameters replicated."""
    x = inputs[0] if inputs else None
    if not is_dtensor(x):
        return "its input is not a DTensor while its parameters are (a layout not examined)"
    if x.device_mesh.ndim != 1:
        return f"its input is placed on a {x.device_mesh.ndim}-D mesh (only a 1-D one is supported)"
    positions = range(1, x.ndim - _normalized_dims(module))
    for placement in x.placements:
        if placement.is_partial():
            return f"its input is a partial sum over processes ({placement})"
        if placement.is_shard() and placement.dim % x.ndim not in positions:
            split = "examples" if placement.dim % x.ndim == 0 else "normalized dimensions"
            return f"its input is split along its {split} ({placement}; SequenceParallel splits positions)"
    for _, _, placements in split_parameters(module.parameters(recurse=False)):  # on tp (FSDP2: unsharded)
        if not all(p.is_replicate() for p in placements):
            return f"its parameters are placed {placements} (SequenceParallel replicates them)"
    if not is_dtensor(g_out[0]) and g_out[0].shape != x.to_local().shape:
        return "its output gradient is a plain tensor not placed as its input"
    return None


def local_call(module: nn.Module, inputs: tuple, output, g_out: tuple):
    """``(inputs, output, g_out)`` with each DTensor as this process's local tensor.

    Unchanged where none is a DTensor. ``None`` where the call cannot give
    exact results (:func:`unsupported_call`): its parameters are refused by
    name in the backward pass's facts (the quantities leave them out, warning)
    and no rule runs.
    """
    for tensor in (*inputs, output, *g_out):  # is_dtensor, inline: asked for every layer
        if type(tensor).__name__ == "DTensor":
            break
    else:
        return inputs, output, g_out
    why = unsupported_call(module, inputs, g_out)
    if why is not None:
        recording = facts.recording()
        for param in module.parameters(recurse=False):
            if param.requires_grad:
                recording.refuse(param, why)
        return None
    if sequence_norm(module) and is_dtensor(g_out[0]) and g_out[0].placements != inputs[0].placements:
        # The positions of this process's input: the same cut of the output gradient.
        g_out = (g_out[0].redistribute(inputs[0].device_mesh, inputs[0].placements), *g_out[1:])
    return tuple(map(local, inputs)), local(output), tuple(map(local, g_out))


def whole_contributions(module: nn.Module, contributions):
    """A normalization layer's per-example contributions ``[N, *param.shape]`` of this
    call, added over the tensor-parallel mesh where its input is split along positions
    (``SequenceParallel``: each process's are the sums over its positions); else as they are.

    Collective over the input's mesh (one ``all_reduce``): every process of the mesh runs the
    same layers' rules in the same order (the backward pass of the same model).
    """
    call = facts.recording().call
    x = call.inputs[0] if call is not None and call.inputs else None
    if not sequence_norm(module) or not is_dtensor(x) or not any(p.is_shard() for p in x.placements):
        return contributions
    import torch
    import torch.distributed as dist

    summed = contributions.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, group=x.device_mesh.get_group())
    return summed


def completed(tensor):
    """A DTensor with its partial sums over the mesh added (``Partial`` placements made
    ``Replicate``: a ``SequenceParallel`` norm's gradient, each process's the part of its
    positions; collective there); any other tensor as it is."""
    if not is_dtensor(tensor) or not any(p.is_partial() for p in tensor.placements):
        return tensor
    from torch.distributed.tensor import Replicate

    return tensor.redistribute(placements=[Replicate() if p.is_partial() else p for p in tensor.placements])


def local_values(tensor):
    """This process's values of a DTensor, :func:`completed` first; any other tensor as it is."""
    return completed(tensor).to_local() if is_dtensor(tensor) else tensor


def local(tensor):
    """This process's part of a DTensor; anything else as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def splits(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear holding a DTensor parameter of its own (its local
    gradient from :func:`save_local_gradient`; a norm's from its rule, :func:`whole_contributions`)."""
    return isinstance(module, nn.Linear) and any(map(is_dtensor, module.parameters(recurse=False)))


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


def collect(params, kept=()) -> None:
    """Complete the results of the split parameters over their mesh (module docstring).

    ``kept``: ids of parameters whose local gradient is this process's shard of the global
    one, kept so in the backward pass (:func:`.sharded.reduce_in_backward`): not gathered.

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
        if gradient is not None and id(param) not in kept and not gradient.__dict__.get(_COMBINED):
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
