"""Which inputs of a module's call are per example: learned from a forward pass one example larger.

The recomputation (:mod:`.replay`) gives each example its part of the
inputs that are per example and the whole of every other one. No shape tells
them apart: Funnel's ``cls_mask`` is ``[L, T]`` with ``L`` the pooled length,
and where ``L`` equals the batch size it leads with the batch size like the
attention mask beside it, so the old guess ("leads with the batch size")
gave each example one row of it, a wrong number with no warning. A trace of
the data that flows from the model's inputs does not tell either: masks are
built as ``torch.ones(input_ids.shape)``, from a size, not from the inputs.

What does tell is a second forward pass of the model on a batch one example
larger (:func:`learn`), the first time a call of a module with the fallback
is recorded with a new structure of arguments: a tensor whose leading size
changes with the batch depends on it (a per-example input, a mask built
from the batch's shape); one whose size stays is batch-free, whatever its
size. The pass runs once per structure, on the model's own inputs with their
first example repeated, under ``torch.no_grad`` and without any hook (if that fails, with
the model's own hooks: ``transformers`` collects the routers' logits by hooks), with
the random state and every buffer restored afterwards (a BatchNorm in training
mode keeps its running statistics), so training goes on as if it had not run.
The layout of the arguments (:class:`Layout`) is kept per module and
structure; :func:`.running.compute` reads it, and refuses a module whose
layout could not be learned, naming why.
"""

import contextlib
import warnings
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

from cockpit_gradnoise.extensions.fallback.capture import (
    ATTRIBUTE,
    BLOCK_ATTRIBUTE,
    PARENT_ATTRIBUTE,
    Call,
    Fallback,
    output_sizes,
)
from cockpit_gradnoise.extensions.fallback.parameters import foreign, hooks_off

import torch
from torch import Tensor, nn
from torch.utils import _pytree


@dataclass(frozen=True)
class Layout:
    """Which tensors of a call depend on the batch (their leading size changes with it).

    Attributes:
        leaves: Indices of the call's flattened arguments (:class:`.capture.Call`'s
            ``leaves``) that depend on the batch.
        children: Indices of the children's calls whose output depends on it.
        outputs: Positions of the output's tensors (:func:`.capture.tensor_positions`)
            that depend on it: one that does not (a bias returned for the parent to add)
            has no gradient per example.
        refusal: Why no layout could be learned (``None`` if it was).
    """

    leaves: FrozenSet[int] = frozenset()
    children: FrozenSet[int] = frozenset()
    outputs: FrozenSet[int] = frozenset()
    refusal: Optional[str] = None


def structure(call: Call) -> str:
    """The key of a call's layout: the structure of its arguments, not their sizes."""
    return str(call.spec)


def key_of(state, call: Call) -> str:
    """The key of ``call``'s layout among ``state``'s: its structure; for a module called
    several times in the forward pass (:mod:`.several`), with its place among the calls, as
    one call may be per example and another not (a bias table and a batch of the same
    structure)."""
    calls = getattr(state, "calls", ())
    if len(calls) <= 1:
        return structure(call)
    place = next((k for k, other in enumerate(calls) if other is call), None)
    return f"{structure(call)} (call {place} of {len(calls)})"


def layout_of(state: Fallback, call: Optional[Call] = None) -> Layout:
    """The layout learned for ``call`` (``state``'s last by default; a refusal if none was)."""
    call = state.call if call is None else call
    found = state.layouts.get(key_of(state, call))
    if found is None:
        return Layout(refusal=(
            "which of its inputs are per example was not learned: the model's forward pass "
            "did not run through the prepared model with its batch as tensor arguments"))
    return found


def _leading(value) -> Optional[int]:
    return value.shape[0] if isinstance(value, Tensor) and value.dim() > 0 else None


def _larger(value, examples: int):
    """``value`` with its first example repeated at the end, if it leads with the batch."""
    if _leading(value) == examples:
        return torch.cat([value, value[:1]])
    return value


class _Sizes:
    """The leading sizes of the pending modules' arguments and children's outputs in a pass."""

    def __init__(self):
        self.leaves: Dict[nn.Module, List[List[Optional[int]]]] = {}
        self.children: Dict[nn.Module, List[List[Optional[int]]]] = {}
        self.outputs: Dict[nn.Module, List[List[Optional[int]]]] = {}
        self.active: Dict[nn.Module, List[Optional[int]]] = {}

    def install(self, modules: List[nn.Module]) -> list:
        """Hook ``modules`` and their children; the handles."""
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(self._begin))
            handles.append(module.register_forward_hook(self._end, with_kwargs=True))
            handles.extend(child.register_forward_hook(self._child) for child in module.children())
        return handles

    def _begin(self, module, args):
        self.active[module] = []

    def _end(self, module, args, kwargs, output):
        leaves, _ = _pytree.tree_flatten((args, kwargs))  # one entry per call, in order
        self.leaves.setdefault(module, []).append([_leading(leaf) for leaf in leaves])
        self.children.setdefault(module, []).append(self.active.pop(module, []))
        self.outputs.setdefault(module, []).append(output_sizes(output))

    def _child(self, child, args, output):
        parent = getattr(child, PARENT_ATTRIBUTE, None)
        if parent is None:  # a child of a block (.blocks) only: no call of it is replayed
            return
        for module, calls in self.active.items():
            if getattr(module, ATTRIBUTE, None) is parent:
                calls.append(_leading(output))


@contextlib.contextmanager
def state_kept(model: nn.Module, devices: List[int]):
    """The random state, every buffer and the modules' attributes restored after the block:
    the block runs on copies of the buffers, the originals (which the real pass may have
    saved for its backward pass, version counters included) are put back untouched; an
    attribute a forward pass sets (a block keeping its auxiliary loss, ``self.aux_loss =
    ...``) gets the real pass's value back, one it added is removed."""
    saved = [(m._buffers, dict(m._buffers)) for m in model.modules() if m._buffers]
    attributes = [(m.__dict__, dict(m.__dict__)) for m in model.modules()]
    with torch.random.fork_rng(devices=devices):
        try:
            for buffers, originals in saved:
                for name, value in originals.items():
                    if value is not None:
                        buffers[name] = value.clone()
            yield
        finally:
            for now, before in attributes:
                for name in [name for name in now if name not in before]:
                    del now[name]
                now.update((name, value) for name, value in before.items()
                           if now.get(name, state_kept) is not value)
            for buffers, originals in saved:
                buffers.update(originals)


def _depends(real: List[Optional[int]], probe: List[Optional[int]]) -> Optional[FrozenSet[int]]:
    if len(real) != len(probe):
        return None
    return frozenset(k for k, (r, p) in enumerate(zip(real, probe)) if r is not None and r != p)


def _pending(model: nn.Module) -> List[Tuple[nn.Module, object, Call, str]]:
    """``(module, state, call, key)`` of each call of the pass whose layout is not known; the
    fallbacks' calls of the pass sealed (the next call begins another pass's)."""
    found = []
    for module in model.modules():
        fallback = getattr(module, ATTRIBUTE, None)
        if isinstance(fallback, Fallback):
            fallback.sealed = True
        # A block's (.blocks) is learned as a Fallback's, from the same call.
        for state in (fallback if isinstance(fallback, Fallback) else None,
                      module.__dict__.get(BLOCK_ATTRIBUTE)):
            if state is None or state.call is None:
                continue
            several = isinstance(state, Fallback) and any(c is state.call for c in state.calls)
            calls = state.calls if several else [state.call]
            for call in calls:
                if key_of(state, call) not in state.layouts:
                    found.append((module, state, call, key_of(state, call)))
    return found


def _sizes_of(state, call: Call, sizes: List[list]) -> Optional[list]:
    """The larger pass's sizes of the call that corresponds to ``call``: the same place among
    the calls of a module called several times, the last call's for the last call (as for
    one call: what a block around the module reads, :func:`.blocks.takes_over`); ``None``
    where the larger pass called it another number of times (a call but the last)."""
    calls = getattr(state, "calls", ())
    if len(calls) <= 1 or call is calls[-1]:
        return sizes[-1] if sizes else []
    if len(sizes) != len(calls):
        return None
    return sizes[next(k for k, other in enumerate(calls) if other is call)]


def learn(model: nn.Module, args: tuple, kwargs: dict, examples: Optional[int]) -> None:
    """After a recorded forward pass of ``model``: learn the layout of each call of a module
    with the fallback whose structure is new, from a pass one example larger."""
    pending = _pending(model)
    if not pending:
        return
    if not examples:
        for _, state, _, key in pending:
            state.layouts[key] = Layout(refusal="the model's forward pass had no batch argument")
        return
    larger_args, larger_kwargs = _pytree.tree_map(lambda v: _larger(v, examples), (args, kwargs))
    devices = sorted({leaf.device.index or 0 for leaf in _pytree.tree_leaves((args, kwargs))
                      if isinstance(leaf, Tensor) and leaf.device.type == "cuda"})
    modules = list({id(module): module for module, _, _, _ in pending}.values())
    # Without any hook; if that fails, with the model's own (.parameters.foreign):
    # transformers collects the routers' logits for the auxiliary loss by hooks.
    for keep in (None, foreign):
        sizes = _Sizes()
        try:
            with hooks_off(model, keep=keep), state_kept(model, devices), torch.no_grad(), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the model's own warnings came with the real pass
                handles = sizes.install(modules)
                try:
                    getattr(model, "_orig_mod", model)(*larger_args, **larger_kwargs)
                finally:
                    for handle in handles:
                        handle.remove()
            break
        except Exception as error:  # a model that takes one batch size only, say
            failed = error
    else:
        reason = ("which of its inputs are per example could not be learned: a forward pass "
                  f"with one example more failed ({type(failed).__name__}: {failed})")
        for _, state, _, key in pending:
            state.layouts[key] = Layout(refusal=reason)
        return
    for module, state, call, key in pending:
        probes = [_sizes_of(state, call, table.get(module, []))
                  for table in (sizes.leaves, sizes.children, sizes.outputs)]
        if any(probe is None for probe in probes):
            leaves = None
        else:
            real_leaves = [_leading(leaf) for leaf in call.leaves]
            real_children = [_leading(child.output) for child in call.children]
            leaves = _depends(real_leaves, probes[0])
            children = _depends(real_children, probes[1]) \
                if isinstance(state, Fallback) else frozenset()  # a block replays no child
            outputs = _depends(call.output_sizes, probes[2]) \
                if isinstance(state, Fallback) else frozenset()  # a block's output is read otherwise
        if leaves is None or children is None or outputs is None:
            state.layouts[key] = Layout(refusal=(
                "which of its inputs are per example could not be learned: a forward pass "
                "with one example more called it differently"))
        else:
            state.layouts[key] = Layout(leaves, children, outputs)
