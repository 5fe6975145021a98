"""The front door and the cheap preset on a model already sharded with FSDP2 (``fully_shard``).

The user's usual order is: build the model, ``fully_shard`` it, then add
tracking (``cgn.track``). FSDP2 keeps the module tree (it changes each
sharded module's class and registers hooks on it) and replaces the
parameters by sharded ``DTensor`` s, so what :func:`~cockpit_gradnoise.prepare_model`
does can also be done afterwards, with two differences that this module
takes care of:

- **Hook order** (:func:`hooks_as_if_prepared_first`): FSDP2's forward hook
  (``FSDPState._post_forward``: reshard, hook the output for the backward's
  unshard) is registered with ``prepend=False``; the package's forward hooks
  added after ``fully_shard`` would run after it, when the module already
  holds its sharded parameter again. They are moved in front of FSDP2's, so
  every module's hooks run in the order of the recipe ``prepare_model``,
  then ``fully_shard``.
- **What cannot be done after sharding** (:func:`check_preparable`): converting
  an ``nn.MultiheadAttention`` (a new module, which FSDP2 does not know) and
  BackPACK's converter (a new ``torch.fx`` module) are refused with the
  recipe that does them first.

For the two-batch noise scale (``quantities="norms"``) the gradient of a
backward pass before FSDP2's reduce-scatter is the gradient of FSDP2's
unsharded parameter (``FSDPParam._unsharded_param``, a leaf created at the
first all-gather and kept for the run): :func:`hook_unsharded` hooks it.
:func:`squared_norms` gives the norms of sharded gradients (sums over the
processes' shards).
"""

import contextlib
import functools
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from cockpit_gradnoise import distributed, functional
from cockpit_gradnoise.extensions import sharded

import torch
from torch import Tensor, nn

#: Where FSDP2's own hooks are defined (their functions' ``__module__``), and tensor
#: parallelism's (``distribute_module``'s input and output functions, by ``parallelize_module``).
FSDP2_HOOK_MODULE = ("torch.distributed.fsdp", "torch.distributed.tensor")

#: What to write instead, in the refusals below.
RECIPE = ("model = cgn.prepare_model(build_model()); fully_shard(...) on the blocks and the root; "
          "model, tracker = cgn.track(model, ...)")


def fully_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``model`` or to one of its modules
    (:func:`.extensions.sharded.sharded_by_fsdp2`)."""
    return any(map(sharded.sharded_by_fsdp2, model.modules()))


def check_preparable(model: nn.Module, use_converter) -> None:
    """Refuse what ``prepare_model`` cannot do to a model already sharded by FSDP2.

    Raises:
        TypeError: Naming what was found and the recipe that does it before ``fully_shard``.
    """
    if use_converter:
        raise TypeError(
            "BackPACK's converter (use_converter=True) rewrites the model into a new torch.fx "
            "module, which FSDP2 does not know: leave use_converter off for a model sharded "
            "with fully_shard"
        )
    attention = next((name for name, module in model.named_modules()
                      if isinstance(module, nn.MultiheadAttention)), None)
    if attention is not None:
        raise TypeError(
            f"the model is already sharded with fully_shard and holds an nn.MultiheadAttention "
            f"({attention!r}), which cgn.prepare_model replaces by a LinearAttention: a new "
            "module FSDP2 does not know. Prepare the model before sharding it: " + RECIPE
        )


def replaced_after_tracking(model: nn.Module, tracked: Dict[str, Tensor]) -> Optional[str]:
    """Why ``tracked`` (``{name: parameter}`` at ``cgn.track``) are no longer ``model``'s, or ``None``.

    ``fully_shard`` applied after ``cgn.track`` (as Accelerate's ``prepare`` does with an
    FSDP2 plugin, or a Trainer that prepares the model it was given) replaces every
    parameter of the sharded modules by a ``DTensor``: the tracker would read the old ones,
    which get no gradient and never change (an update size of 0, silently). Under FSDP2 a
    module holds its unsharded parameters between the forward and the backward pass, so
    parameters tracked after sharding are not compared by identity; without FSDP2 they are,
    by name (``load_state_dict(assign=True)`` and a module replaced also leave the tracker
    with parameters the model no longer has).
    """
    if fully_sharded(model):
        if is_sharded(tracked.values()):
            return None
        return ("the model was sharded with fully_shard after cgn.track (Accelerate's "
                "accelerator.prepare with an FSDP2 plugin does so, and a transformers Trainer "
                "with FSDP2, which TrackingTrainer does not support yet): its parameters are new "
                "DTensors and the tracker holds the old ones. Call cgn.track on the model that "
                "accelerator.prepare returns (or after fully_shard); see docs/distributed.md")
    current = dict(model.named_parameters())
    replaced = [name for name, param in tracked.items() if current.get(name) is not param]
    if not replaced:
        return None
    return (f"parameters {replaced[:5]}{' ...' if len(replaced) > 5 else ''} of the model are not "
            "those cgn.track found (replaced since: load_state_dict(assign=True), a new module): "
            "the tracker would read the old ones. Call cgn.track on the model as it is trained")


def _is_fsdp2_hook(hook) -> bool:
    function = getattr(hook, "__func__", hook)
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__module__", "").startswith(FSDP2_HOOK_MODULE)


@contextlib.contextmanager
def hooks_as_if_prepared_first(model: nn.Module):
    """Around preparing a sharded model: FSDP2's forward hooks end up after those added.

    FSDP2's forward pre-hooks are prepended (they run first either way).
    Its forward hooks are moved to the end of each module's table, in their
    order, where they would be had the model been prepared before
    ``fully_shard``. Hooks of others keep their place.
    """
    try:
        yield
    finally:
        for module in model.modules():
            table = module._forward_hooks
            for key in [key for key, hook in table.items() if _is_fsdp2_hook(hook)]:
                table.move_to_end(key)


def _name(quantity) -> str:
    return quantity.__name__ if isinstance(quantity, type) else type(quantity).__name__


def check_trackable(model: nn.Module, quantities: Sequence) -> None:
    """Refuse, at ``cgn.track`` and before anything changes, a sharded layout not supported
    (:func:`~cockpit_gradnoise.distributed.check_not_sharded`) and the quantities (classes or
    instances) not exact under FSDP2 (``supports_fsdp2``), or under tensor parallelism
    (alone or inside FSDP2: ``supports_tensor_parallel``) where a parameter is split.

    Raises:
        TypeError: Naming what was found, or the quantities, the exact ones and the preset.
    """
    from cockpit_gradnoise.extensions import tensor_parallel

    split = bool(tensor_parallel.split_parameters(list(model.parameters())))
    layouts = {"fsdp2": True, "tensor_parallel": split, "fsdp2_tensor_parallel": split}
    distributed.check_not_sharded(model.parameters(), model, hsdp=True, **layouts)
    refuse_quantities(quantities, "supports_tensor_parallel" if split else "supports_fsdp2")
    not_hsdp = [_name(q) for q in quantities if not getattr(q, "supports_hsdp", False)]
    if not_hsdp:
        distributed.check_not_sharded(model.parameters(), quantity=", ".join(not_hsdp), **layouts)


def refuse_quantities(quantities: Sequence, exact_if: str = "supports_fsdp2") -> None:
    """Refuse, at ``cgn.track``, the quantities (classes or instances) not exact under FSDP2
    (``supports_fsdp2``), or not marked ``exact_if``.

    Raises:
        TypeError: Naming them, the exact ones among those asked for, and the preset.
    """
    refused = [_name(q) for q in quantities if not getattr(q, exact_if, False)]
    if not refused:
        return
    exact = [_name(q) for q in quantities if getattr(q, exact_if, False)]
    where = "FSDP2 (fully_shard)" if exact_if == "supports_fsdp2" else "tensor parallelism"
    raise TypeError(
        f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not exact under {where} "
        f"yet. Exact: {', '.join(distributed.FSDP2_QUANTITIES)}, and "
        "TwoBatchNoiseScale (the preset quantities=\"norms\"). Pass "
        f"quantities=\"norms\" or a list{' such as ' + repr(exact) if exact else ''}; "
        "see docs/distributed.md"
    )


def is_sharded(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is a ``DTensor`` (FSDP2's sharded parameters)."""
    return any(type(p).__name__ == "DTensor" for p in params)


def hook_unsharded(params: Sequence[Tensor], hook: Callable[[int, Tensor], None],
                   hooked: Dict[int, tuple]) -> None:
    """Hook ``hook(index, grad)`` on FSDP2's unsharded copy of each of ``params``, once.

    The copy's gradient is this process's gradient of the backward pass, before
    FSDP2 reduce-scatters it (the hook runs before it is accumulated). A copy
    exists once its group has been all-gathered (after the first forward
    pass); one made anew (a copy not seen before) is hooked again, the old
    hook removed. ``hooked`` is ``{index: (copy, handle)}``, kept by the caller.
    """
    managed = sharded.fsdp2_parameters()
    copies = [getattr(managed.get(id(param)), "_unsharded_param", None) for param in params]
    if all(copy is None for copy in copies):  # never silently nothing: torch's internals moved?
        raise RuntimeError(
            "cockpit_gradnoise found none of FSDP2's unsharded parameters after the forward pass "
            "(FSDPParam._unsharded_param): the two-batch noise scale cannot see the gradients "
            "before FSDP2 reduce-scatters them with this torch version"
        )
    for index, copy in enumerate(copies):
        known = hooked.get(index)
        if copy is None or (known is not None and known[0] is copy):
            continue
        if known is not None:
            known[1].remove()
        hooked[index] = (copy, copy.register_hook(functools.partial(hook, index)))


def fsdp2_managed(params: Iterable[Tensor]) -> bool:
    """Whether any of ``params`` is sharded by FSDP2 (a ``DTensor`` may be tensor parallelism's alone)."""
    managed = sharded.fsdp2_parameters()
    return any(id(param) in managed for param in params)


def squared_norms(grads: List[Tensor], shards: bool, counted=None) -> Tensor:
    """``|g|^2`` of each gradient (at least one), in float64; with ``shards``, ``grads`` are
    this process's shards (or ``DTensor`` s) and the squares are summed over the processes,
    where given only those ``counted`` (per gradient: ``False`` where another process holds
    the same elements, under tensor parallelism or HSDP). The local squares are
    :func:`~cockpit_gradnoise.functional.squared_norm_tensors`' (a large CPU shard by float64 pieces).

    Collective with ``shards`` (one ``all_reduce``): every process must call it.
    """
    norms = functional.squared_norm_tensors([sharded.local_tensor(g.detach()) for g in grads])
    if counted is not None:
        norms *= torch.tensor(counted, dtype=norms.dtype, device=norms.device)
    if shards:
        distributed.all_reduce_([norms])
    return norms
