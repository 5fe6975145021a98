"""Exact global-batch statistics under DistributedDataParallel, with ``torch.distributed``.

Under DDP every process runs the same model on its own local batch; DDP
averages ``param.grad`` across processes while BackPACK's per-example
results cover the local batch only. The quantities' declared sums
(:attr:`~cockpit_gradnoise.ParameterQuantity.sums`) are what combine: each
process puts its sums into per-example-gradient units (``g_i``, the gradient
of example ``i``'s own loss), and :func:`reduce_step` adds them across
processes (``"sum"``) or joins their rows (``"cat"``) before any ratio or
quantile is formed. Every process then holds the statistics of the global
batch, identical on every rank (see ``docs/distributed.md``).

Communication per tracked step, for all quantities of a cockpit together: one
``all_reduce`` of a small fixed-size header (each process's example count,
loss reduction, an error flag, a layout code, its step number and which
parameters have results), then one ``all_reduce`` per dtype of the sums, flattened into one
buffer (the "cat" rows zero-padded to the largest local batch, each process
writing its own block). The header comes first so that a process that failed,
whose sums are laid out differently, or that is at another step, makes every
process raise the same error instead of hanging, aborting in a mismatched
collective, or adding the sums of different steps.

Nothing here imports ``torch`` at module level, so that :func:`is_writer`
costs nothing where torch was never imported (reading logs, the command line):
without an initialised default process group, nothing here communicates.
"""

import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from cockpit_gradnoise._ranks import WRITER_RANK, is_writer, process_group, rank, world_size  # noqa: F401

# The header: one row per process, then one column per (quantity, parameter) slot.
_EXAMPLES, _MEAN, _SUM, _FAILED, _LAYOUT, _STEP = range(6)
_HEADER_FIELDS = 6

# What holds parameters that are not full per-process copies (sharded data,
# tensor or pipeline parallelism), by class name: nothing is imported to detect it.
_SHARDED_PARAMETER_CLASSES = {
    "FlatParameter": "FSDP (FullyShardedDataParallel)",
    "DTensor": "FSDP2 (fully_shard) or tensor parallelism",
}
_SHARDED_MODULE_CLASSES = {
    "FullyShardedDataParallel": "FSDP (FullyShardedDataParallel)",
    "FSDPModule": "FSDP2 (fully_shard)",
    "DeepSpeedEngine": "DeepSpeed",
    "PipelineStage": "pipeline parallelism",
    "Pipe": "pipeline parallelism",
}
# "Pipe" is a common word: only torch's own pipelining classes count.
_QUALIFIED = {"Pipe": "torch.distributed.pipelining", "PipelineStage": "torch.distributed.pipelining"}


#: The quantities exact under FSDP2 (``fully_shard`` on a 1-D mesh), named in refusals; all
#: six also on HSDP's replicate x shard mesh and under tensor parallelism.
FSDP2_QUANTITIES = ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
                    "GradientVarianceQuantiles", "PreconditionedNoiseScale")
#: The quantities exact under HSDP (``fully_shard`` on a replicate x shard mesh, alone or over
#: tensor parallelism), each counting a shard once, not once per replica (``supports_hsdp``).
HSDP_QUANTITIES = FSDP2_QUANTITIES
#: The quantities exact under tensor parallelism (``ColwiseParallel``, ``RowwiseParallel``).
TENSOR_PARALLEL_QUANTITIES = FSDP2_QUANTITIES
#: The quantities exact under FSDP2 over tensor parallelism (a ``("dp", "tp")`` mesh).
FSDP2_TENSOR_PARALLEL_QUANTITIES = TENSOR_PARALLEL_QUANTITIES


def check_not_sharded(params: Iterable, model=None, fsdp2: bool = False,
                      tensor_parallel: bool = False, fsdp2_tensor_parallel: bool = False,
                      hsdp: bool = False, quantity: Optional[str] = None):
    """Raise if the parameters (or any module of the model) are sharded in a way not supported.

    Every quantity needs each process to hold the full parameters and
    gradients, as DistributedDataParallel does; FSDP (FullyShardedDataParallel,
    with or without ``use_orig_params``), FSDP2 (``fully_shard``), tensor
    parallelism (DTensor parameters), DeepSpeed and pipeline parallelism shard
    them, wrap them or split the model. Detected by class name (of the model,
    every submodule and every parameter) and FSDP's ``_fsdp_flattened`` mark,
    without importing any of them.

    Args:
        params: The parameters (DTensors are checked against the flags below).
        model: The model, whose modules are checked too.
        fsdp2: Allow parameters sharded by FSDP2 over a 1-D device mesh of every
            process, two or more (a quantity exact under FSDP2: :data:`FSDP2_QUANTITIES`).
        tensor_parallel: Allow DTensor parameters split by tensor parallelism over a 1-D
            mesh of every process (:data:`TENSOR_PARALLEL_QUANTITIES`,
            :func:`.extensions.tensor_parallel.unsupported_layout`).
        fsdp2_tensor_parallel: With ``fsdp2``, allow FSDP2 on ``dp`` of a ``("dp", "tp")``
            mesh over tensor parallelism on ``tp`` (:data:`FSDP2_TENSOR_PARALLEL_QUANTITIES`,
            :func:`.extensions.sharded.unsupported_layout`).
        hsdp: With ``fsdp2``, allow HSDP's replicate x shard mesh (a quantity marked
            ``supports_hsdp``: :data:`HSDP_QUANTITIES` and TwoBatchNoiseScale; else refused
            with a message naming ``quantity``).
        quantity: The quantity asking, named in the refusal.

    Raises:
        TypeError: Naming the quantity, what was found and what is supported.
    """
    found = None
    allowed = {"FSDPModule"} if fsdp2 else set()
    if model is not None:
        found = next(filter(None, (_sharded_class(type(module), _SHARDED_MODULE_CLASSES, allowed)
                                   for module in model.modules())), None)
    managed, over_tp, params = None, None, list(params)
    for param in params:
        if found is not None:
            break
        if getattr(param, "_fsdp_flattened", False):
            found = ("a parameter flattened by FSDP", "FSDP (FullyShardedDataParallel)")
            continue
        found = _sharded_class(type(param), _SHARDED_PARAMETER_CLASSES)
        if found is not None and (fsdp2 or tensor_parallel):
            managed = _fsdp2_managed() if managed is None else managed
            if over_tp is None:  # the dp meshes of FSDP2 over tensor parallelism
                over_tp = [managed[id(p)].mesh_info.mesh for p in params if fsdp2_tensor_parallel
                           and getattr(managed.get(id(p)), "_unsharded_dtensor_spec", None) is not None]
            found = _fsdp2_refusal(param, managed, fsdp2, tensor_parallel, fsdp2_tensor_parallel,
                                   hsdp, over_tp)
    asking = "" if quantity is None else f"{quantity} is refused: "
    if found == _HSDP:
        raise TypeError(
            f"{quantity or 'this quantity'} {'are' if ', ' in (quantity or '') else 'is'} not "
            "marked exact under HSDP (fully_shard on a replicate x shard mesh; supports_hsdp): "
            "a sum over each process's shard would count a shard once per replica. Exact under "
            f"HSDP: {', '.join(HSDP_QUANTITIES)} and TwoBatchNoiseScale (every preset of "
            "cgn.track); or shard on a 1-D mesh; see docs/distributed.md"
        )
    if found is not None:
        what, parallelism = found
        raise TypeError(
            f"{asking}cockpit_gradnoise found {what}, from {parallelism}, which is not "
            "supported: every quantity needs each process to hold the full parameters "
            "and gradients. Supported: one process, or "
            "torch.nn.parallel.DistributedDataParallel (every process holds the full "
            "model; the statistics are those of the global batch); and FSDP2 "
            "(fully_shard on a 1-D device mesh, or HSDP's 2-D one, over two processes or more; "
            "cgn.track(model) after fully_shard, or cgn.prepare_model before it and a Cockpit "
            f"over the sharded parameters) for {', '.join(FSDP2_QUANTITIES)} and "
            "TwoBatchNoiseScale only; and tensor parallelism "
            "(ColwiseParallel and RowwiseParallel on nn.Linear layers, a 1-D mesh over every "
            "process, or inside FSDP2 on a (\"dp\", \"tp\") mesh, or HSDP's (\"replicate\", "
            "\"shard\", \"tp\") one; cgn.prepare_model first, then "
            f"a Cockpit) for {', '.join(TENSOR_PARALLEL_QUANTITIES)} and TwoBatchNoiseScale only; "
            "see docs/distributed.md"
        )


# What _fsdp2_refusal returns for a parameter sharded by HSDP where HSDP is not allowed.
_HSDP = ("a parameter sharded by HSDP", "HSDP")


def _fsdp2_managed() -> dict:
    from cockpit_gradnoise.extensions import sharded

    return sharded.fsdp2_parameters()


def _fsdp2_refusal(param, managed, fsdp2, tensor_parallel, fsdp2_tensor_parallel, hsdp,
                   over_tp) -> Optional[Tuple[str, str]]:
    """``None`` where ``param`` is sharded by FSDP2 or split by tensor parallelism as
    supported (and allowed), else what to refuse (:data:`_HSDP` for HSDP not allowed)."""
    from cockpit_gradnoise.extensions import sharded
    from cockpit_gradnoise.extensions import tensor_parallel as split

    fsdp_param = managed.get(id(param))
    if fsdp_param is None and tensor_parallel:
        why = split.unsupported_layout(param)
        return None if why is None else (f"a parameter split by {why}", "tensor parallelism")
    if fsdp_param is None:
        return "a DTensor parameter not sharded by FSDP2", "tensor parallelism"
    if not fsdp2:
        return "a parameter sharded by FSDP2", "FSDP2 (fully_shard)"
    why = sharded.unsupported_layout(fsdp_param, tensor_parallel=fsdp2_tensor_parallel, over_tp=over_tp)
    if why is not None:
        return f"a parameter sharded by {why}", "FSDP2 (fully_shard)"
    if world_size() < 2:
        return "FSDP2 on one process", "FSDP2 (fully_shard)"
    if not hsdp and sharded.is_hsdp(fsdp_param):
        return _HSDP
    return None


def _sharded_class(cls, names, allowed=frozenset()) -> Optional[Tuple[str, str]]:
    """``(what was found, parallelism)`` for the first of ``cls``'s classes in ``names``
    (those in ``allowed`` pass)."""
    for base in cls.__mro__:
        if base.__name__ in allowed:
            return None
        if base.__name__ in names and base.__module__.startswith(_QUALIFIED.get(base.__name__, "")):
            return f"the class {base.__name__}", names[base.__name__]
    return None


def unwrap(model):
    """The module inside a ``DistributedDataParallel`` wrapper (else ``model`` itself).

    Raises:
        TypeError: If the model is sharded (FSDP), see :func:`check_not_sharded`.
    """
    check_not_sharded(model.parameters(), model)
    import torch

    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


# One tracked step: the quantities' sums, reduced together -------------------------


@dataclass
class Contribution:
    """One process's part of a tracked step, before the reduction.

    Attributes:
        examples: Examples in the local batch.
        scale: The local loss scale ``c`` (``x_i = c g_i``): ``1/N`` for a
            mean, ``1`` for a sum or one example, NaN when not finite.
        slots: Names of the (quantity, parameter) slots, for messages.
        available: Per slot, whether this process has its results.
        sums: The sums of the available slots, in order, in per-example units,
            each with its reduction (``"sum"`` or ``"cat"``, rows = examples).
        error: The exception raised while forming them, if any.
    """

    examples: int = 0
    scale: float = math.nan
    slots: Sequence[str] = ()
    available: Sequence[bool] = ()
    sums: List[Tuple[object, str]] = field(default_factory=list)
    error: Optional[Exception] = None


@dataclass
class ReducedStep:
    """The global batch of a tracked step, identical on every process.

    Attributes:
        examples: ``N``, examples on all processes.
        scale: The global loss scale ``c``: ``1/N`` for a mean, ``1`` for a sum.
        sums: The reduced sums, in the order of :attr:`Contribution.sums`.
    """

    examples: int
    scale: float
    sums: list


def reduce_step(contribution: Contribution, device, global_step=None) -> ReducedStep:
    """Add the sums of every process ("sum") or join their rows ("cat").

    Collective: every process of the default group must call it at the same
    tracked step, also one whose own part failed (``contribution.error``):
    then every process raises, the failed one its own exception.

    Args:
        contribution: This process's part.
        device: Where the collectives run (the parameters' device; CUDA for NCCL).
        global_step: For messages.

    Returns:
        The global batch and the reduced sums.

    Raises:
        ValueError / RuntimeError: Identically on every process when the
            processes are at different steps, a process
            failed, the loss is a mean on some processes and a sum on others,
            only some processes have results for a parameter, or the sums are
            laid out differently.
    """
    import torch
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    _check_rows(contribution)
    mean, total = _reduction_of(contribution.examples, contribution.scale)
    row = [
        contribution.examples,
        mean,
        total,
        contribution.error is not None,
        _layout_code(contribution.sums),
        math.nan if global_step is None else global_step,  # exact in float64 below 2**53
        *contribution.available,
    ]
    header = gather_rows(torch.tensor(row, dtype=torch.float64, device=device)).cpu()
    where = "" if global_step is None else f" at step {global_step}"
    _check_steps(header, me)
    _raise_if_failed(header, contribution, me, where)
    _check_available(header, contribution.slots, world, where)
    if len(set(header[:, _LAYOUT].tolist())) > 1:
        raise RuntimeError(
            f"cockpit_gradnoise: the quantities' sums are laid out differently on the "
            f"processes{where} (different models, quantities or parameter dtypes?): "
            "every process must track the same quantities of the same model"
        )
    examples_per_process = [int(n) for n in header[:, _EXAMPLES].tolist()]
    n = sum(examples_per_process)
    if header[:, _MEAN].sum() > 0 and header[:, _SUM].sum() > 0:
        raise ValueError(
            f"cockpit_gradnoise: the loss is a mean on some processes and a sum on "
            f"others{where}: use the same reduction on every process"
        )
    # A sum where any process shows one; else a mean (also when every process
    # has one example, where the two cannot be told apart: DDP's param.grad is
    # then the mean of the examples' gradients either way).
    scale = 1.0 if header[:, _SUM].sum() > 0 else 1.0 / max(n, 1)
    sums = _reduce_sums(contribution.sums, examples_per_process, me, device)
    return ReducedStep(n, scale, sums)


def _check_rows(contribution):
    """Record an error if a "cat" sum does not have one row per local example."""
    for value, how in contribution.sums:
        if how == "cat" and contribution.error is None and value.shape[0] != contribution.examples:
            contribution.error = ValueError(
                f"a 'cat' sum has {value.shape[0]} rows but the local batch has "
                f"{contribution.examples} examples: 'cat' sums hold one row per example"
            )


def _reduction_of(examples, scale) -> Tuple[bool, bool]:
    """``(is_mean, is_sum)`` of the local loss; neither for one example or a NaN scale."""
    if examples < 2 or not math.isfinite(scale):
        return False, False
    return scale == 1.0 / examples, scale == 1.0


def _layout_code(sums) -> int:
    """A checksum of the sums' reductions, dtypes and shapes (rows of "cat" left out)."""
    layout = [
        (how, str(value.dtype), tuple(value.shape[1:] if how == "cat" else value.shape))
        for value, how in sums
    ]
    return zlib.crc32(repr(layout).encode())


def _check_steps(header, me):
    """Raise on every process unless all are at the same step.

    A process that skipped a tracked call (or counts steps differently) would
    otherwise add its sums of another step to the others'.
    """
    steps = header[:, _STEP].tolist()
    if any(math.isnan(step) for step in steps) or len(set(steps)) == 1:
        return
    at = ", ".join(f"process {r} at step {int(step)}" for r, step in enumerate(steps))
    raise RuntimeError(
        f"cockpit_gradnoise: the processes are at different steps in one tracked call "
        f"({at}; this is process {me}): every process must make the same tracked cockpit "
        "calls with the same step numbers (did a process skip a tracked call, or count "
        "its steps differently?)"
    )


def _raise_if_failed(header, contribution, me, where):
    failed = [r for r, flag in enumerate(header[:, _FAILED].tolist()) if flag]
    if not failed:
        return
    if contribution.error is not None:
        raise contribution.error
    raise RuntimeError(
        f"cockpit_gradnoise: process(es) {failed} failed to compute their part of the "
        f"statistics{where} (see the error on those processes); process {me} stops too"
    )


def _check_available(header, slots, world, where):
    """Raise unless each slot has results on every process or on none."""
    counts = header[:, _HEADER_FIELDS:].sum(0).tolist()
    partial = [slot for slot, count in zip(slots, counts) if 0 < count < world]
    if partial:
        raise ValueError(
            f"cockpit_gradnoise: {partial} have per-example results on some processes "
            f"only{where} (parameters used in the forward pass of some processes, "
            "with find_unused_parameters=True?): every process must use the same "
            "parameters at a tracked step"
        )


def _reduce_sums(sums, examples_per_process, me, device) -> list:
    """One all_reduce per dtype: "sum" sums added, "cat" rows placed in this process's block."""
    import torch
    import torch.distributed as dist

    world, most = len(examples_per_process), max(examples_per_process)
    reduced: list = [None] * len(sums)
    groups: Dict[object, List[int]] = {}
    for index, (value, _) in enumerate(sums):
        groups.setdefault(value.dtype, []).append(index)
    for dtype, indices in groups.items():
        sizes = [_block_size(sums[i], world, most) for i in indices]
        buffer = torch.zeros(sum(sizes), dtype=dtype, device=device)
        blocks = [_shaped(block, sums[i], world, most) for i, block in zip(indices, buffer.split(sizes))]
        for i, block in zip(indices, blocks):
            value, how = sums[i]
            (block[me, : value.shape[0]] if how == "cat" else block).copy_(value)
        dist.all_reduce(buffer)
        for i, block in zip(indices, blocks):
            if sums[i][1] == "cat":
                block = torch.cat([block[r, :n] for r, n in enumerate(examples_per_process)])
            reduced[i] = block
    return reduced


def _shaped(block, entry, world, most):
    """A flat block viewed as the sum (``"sum"``) or as ``[world, most, *row]`` (``"cat"``)."""
    value, how = entry
    return block.view(world, most, *value.shape[1:]) if how == "cat" else block.view(value.shape)


def _block_size(entry, world, most) -> int:
    value, how = entry
    if how == "cat":
        return world * most * math.prod(value.shape[1:])
    return value.numel()


def gather_rows(row):
    """Every process's ``row`` (1d, same length everywhere): a ``[world, len(row)]`` tensor.

    One ``all_reduce`` of a zero matrix in which each process writes its own
    row (works on every backend and torch version, unlike ``all_gather``
    into one tensor).
    """
    import torch
    import torch.distributed as dist

    table = torch.zeros(dist.get_world_size(), row.numel(), dtype=row.dtype, device=row.device)
    table[dist.get_rank()] = row
    dist.all_reduce(table)
    return table


# Across mini-batches: each process takes its share --------------------------------


def share(batches: Iterable) -> Iterable:
    """This process's share of ``batches``: items ``rank, rank + W, rank + 2W, ...``."""
    size = world_size()
    if size == 1:
        return batches
    return itertools.islice(batches, rank(), None, size)


def gather_objects(value) -> list:
    """Every process's ``value`` (picklable), in rank order; ``[value]`` on one process."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def all_reduce_(tensors: Iterable) -> None:
    """Sum each tensor over the processes, in place (nothing outside distributed training)."""
    dist = process_group()
    if dist is None or dist.get_world_size() == 1:
        return
    for tensor in tensors:
        dist.all_reduce(tensor)
