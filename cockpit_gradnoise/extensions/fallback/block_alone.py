"""A block's contributions, from the block run again on each example alone (:mod:`.blocks`).

The state of a hooked block (:class:`Block`), and the two ways to run it per example: a
loop (:func:`per_example_gradients`) and ``vmap`` over chunks of examples
(:func:`vectorized`, :mod:`.block_vmap`). Each example's output alone is checked against its
row of the batch's (:class:`Interacting` where it differs by more than
:func:`output_tolerance`), at the unit of rounding of the narrowest dtype the block computes
in (:func:`rounding`). Moved out of :mod:`.blocks` (which hooks blocks and saves their results)
as it was, to leave that file room.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

from cockpit_gradnoise.extensions import cost_model, precision
from cockpit_gradnoise.extensions.fallback import block_vmap, draws
from cockpit_gradnoise.extensions.fallback.block_biases import LinearBiases
from cockpit_gradnoise.extensions.fallback.capture import Call, first_tensor
from cockpit_gradnoise.extensions.fallback.layout import layout_of

import torch
from torch import Tensor, nn
from torch.utils import _pytree


class Block:
    """A hooked block's state: its last call, and what its backward pass brings.

    Not copied with the model (a copy starts without a call): tensors of a
    forward pass and hook handles stay with the model that ran it.
    """

    def __init__(self, members=()):
        self.call: Optional[Call] = None
        self.output: Optional[Tensor] = None  # the first tensor output, detached
        self.version = 0
        self.layouts: Dict[str, object] = {}  # learned by .layout, as a Fallback's
        self.totals: Dict[int, Tensor] = {}  # id(param) -> this backward pass's gradient
        self.handles: list = []
        # The layers inside on rows that are not examples (.regroup), whose parameters it
        # always computes; all of them where a child with the fallback takes over.
        self.members: List[nn.Module] = list(members)
        self.covered: List[nn.Module] = []  # in this backward pass
        # The narrowest floating dtype the recomputation computes in (its first example's
        # operations): float32 inside a float64 model rounds there (:func:`rounding`).
        self.dtype: Optional[torch.dtype] = None
        self.vectorized: Optional[bool] = None  # whether vmap runs it (.block_vmap), once known
        self.rng: Optional[draws.Snapshot] = None  # at its call's start in training mode (.draws)
        self.random = False  # whether its forward was found to draw random numbers
        # The positions (among its output's tensors) of the outputs with rows per example, as
        # the survey found them (.regroup); the later of them that require grad, detached, and
        # their gradients in this backward pass; the first output's (``None``: it got none).
        self.example_outputs: frozenset = frozenset()
        self.later: Dict[int, Tensor] = {}
        self.later_grads: Dict[int, Tensor] = {}
        self.first_grad: Optional[Tensor] = None

    def __reduce__(self):  # what the survey found is kept (a copy is not surveyed again)
        return (Block, (self.members,), {"example_outputs": self.example_outputs})



def batched_leaves(call: Call, examples: int, leaves) -> List[int]:
    """The indices of the call's Tensor leaves that lead with ``examples`` and depend on the batch (``leaves``)."""
    return [k for k, leaf in enumerate(call.leaves) if isinstance(leaf, Tensor) and leaf.dim() > 0
            and leaf.shape[0] == examples and k in leaves]



class Interacting(Exception):
    """The block's output for an example alone is not its output in the batch."""


def per_example_gradients(module: nn.Module, block: Block, grad: Tensor, params: Dict[str, nn.Parameter],
                          drawn: Optional[list] = None) -> Iterator[Tuple[Dict[str, Tensor], Dict]]:
    """``{name: [x_i for i in a chunk]}``, chunk by chunk (:func:`.cost_model.examples_per_chunk`
    examples: one reduction per chunk), ``x_i`` from the block run again on example ``i``
    alone, ``torch.autograd.grad`` of its output at ``G_i`` (module docstring); with the
    terms' magnitudes of its linear layers' biases (:mod:`.block_biases`); ``drawn``: the
    batch's random draws, each example given its part of them (:mod:`.draws`).

    Raises:
        Interacting: Where the block's output for an example alone differs from its
            output in the batch by more than ``sqrt(eps)`` of the latter's largest magnitude.
    """
    call, examples = block.call, grad.shape[0]
    batched = set(batched_leaves(call, examples, layout_of(block).leaves))
    tensors = list(params.values())
    narrowest = precision.NarrowestResult(call.autocast[1] if call.autocast else block.output.dtype)
    numel = sum(p.numel() for p in tensors)
    size = min(examples, cost_model.examples_per_chunk(max(numel, 1), tensors[0].element_size()))
    chunk = {name: p.new_empty(size, *p.shape) for name, p in params.items()}
    biases, chunk_terms = LinearBiases(module, params), {}
    replay = draws.Replay(drawn, examples) if drawn else None
    for i in range(examples):
        leaves = [leaf[i : i + 1] if k in batched else leaf for k, leaf in enumerate(call.leaves)]
        args, kwargs = _pytree.tree_unflatten(leaves, call.spec)
        handles = biases.install()
        try:
            with torch.enable_grad(), precision.autocast_as(call.autocast), \
                    narrowest if i == 0 else contextlib.nullcontext(), draws.replaying(replay):
                output = module(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if i == 0:
            block.dtype = narrowest.dtype
            tolerance = output_tolerance(block)
        first = first_tensor(output)
        difference = (first.detach() - block.output[i : i + 1]).abs().max()
        if first.shape != block.output[i : i + 1].shape or not float(difference) <= tolerance:
            raise Interacting(
                "its output for one example alone differs from its output in the batch: its "
                "examples interact (a capacity limit, routing over the batch) or its forward pass "
                "is random (router jitter, dropout in training mode)")
        outputs = biases.outputs()
        ends, cotangents = _ends(block, output, first, grad, i)
        found = torch.autograd.grad(ends, tensors + outputs, cotangents, allow_unused=True)
        for (name, rows), g in zip(chunk.items(), found):
            if g is None:
                rows[i % size].zero_()
            else:
                rows[i % size].copy_(g)
        for name, terms in biases.terms(list(found[len(tensors):])).items():
            chunk_terms.setdefault(name, []).append(terms)
        if i == examples - 1 and replay is not None:
            replay.finished()  # (before the last chunk is handed on)
        if i % size == size - 1 or i == examples - 1:
            contributions = {name: rows[: i % size + 1] for name, rows in chunk.items()}
            yield contributions, _held_terms(contributions, chunk_terms)
            chunk_terms = {}


def _ends(block: Block, output, first: Tensor, grad: Tensor, i: int) -> Tuple[List[Tensor], List[Tensor]]:
    """The outputs of example ``i`` alone to differentiate, and their gradients: the first, and
    each later output that brought a gradient (:attr:`Block.later_grads`), each checked against
    its row of the batch's as the first is.

    Raises:
        Interacting: Where a later output alone differs from its row of the batch's.
    """
    ends, cotangents = [first], [grad[i : i + 1].to(first.dtype)]
    tensors = [leaf for leaf in _pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
    for t, later in sorted(block.later_grads.items()):
        alone, batch = tensors[t] if t < len(tensors) else None, block.later[t][i : i + 1]
        tolerance = precision.rounding_bound(block.later[t], rounding(block, batch.dtype))
        if alone is None or alone.shape != batch.shape or not float((alone.detach() - batch).abs().max()) <= tolerance:
            raise Interacting("its later output for one example alone differs from its output in the batch")
        ends.append(alone)
        cotangents.append(later[i : i + 1].to(alone.dtype))
    return ends, cotangents


def _held_terms(contributions: Dict[str, Tensor], chunk_terms: Dict[str, list]) -> Dict[str, Optional[tuple]]:
    """A chunk's ``{bias name: (magnitudes [chunk, out], rows) or None}`` for
    :func:`.reduce.with_structural_zeros`, which holds those contributions to the end
    (copied here: the chunk's buffers are filled again)."""
    held = {}
    for name, terms in chunk_terms.items():
        contributions[name] = contributions[name].clone()
        counts = {None if t is None else t[1] for t in terms}
        held[name] = None if len(counts) != 1 or None in counts else (
            torch.stack([t[0] for t in terms]), counts.pop())
    return held


def vectorized(module: nn.Module, block: Block, grad: Tensor,
               params: Dict[str, nn.Parameter]) -> Optional[Iterator[Tuple[Dict[str, Tensor], Dict]]]:
    """:func:`per_example_gradients`' chunks by :mod:`.block_vmap` (a chunk of examples per
    pass), or ``None`` where ``vmap`` cannot run the block or its first chunk's outputs
    differ from the batch's: then the loop runs and checks (at every later step too)."""
    if block.vectorized is False or not params or block.later_grads:  # (several outputs: the loop)
        return None
    call, examples = block.call, grad.shape[0]
    # The narrowest dtype the first chunk computes in, as the loop's first example: a float64
    # block computing in float32 inside (OLMo-Hybrid's gated delta rule) rounds to float32.
    narrowest = precision.NarrowestResult(call.autocast[1] if call.autocast else block.output.dtype)

    def check(output: Tensor, expected: Tensor) -> None:
        block.dtype = narrowest.dtype
        if not float((output - expected).abs().max()) <= output_tolerance(block):
            raise Interacting("its output for one example alone differs from its output in the batch: "
                              "its examples interact or its forward pass is random")

    def run(start: int, stop: int):
        with narrowest if start == 0 else contextlib.nullcontext():
            return block_vmap.chunk(module, call, batched, params, biases, block.output, grad,
                                    start, stop, check)

    tensors = list(params.values())
    size = min(examples, cost_model.examples_per_chunk(
        max(sum(p.numel() for p in tensors), 1), tensors[0].element_size()))
    batched = batched_leaves(call, examples, layout_of(block).leaves)
    biases = LinearBiases(module, params).layers
    found = block_vmap.chunks(run, examples, size)
    block.vectorized = found is not None
    return found



def rounding(block: Block, dtype: torch.dtype) -> float:
    """The unit of rounding of the block's computation: ``eps`` of the narrowest dtype its
    recomputation computed in (:attr:`Block.dtype`), of the autocast dtype of its call, or of
    ``dtype``. A float64 model whose router computes in float32 gives one example alone its
    output in the batch to float32's rounding only (the float32 products of 7 rows and of 28
    round differently), and its router's contributions add up to the gradient to it only."""
    narrow = block.dtype or (block.call.autocast[1] if block.call and block.call.autocast else dtype)
    return torch.finfo(narrow).eps


def output_tolerance(block: Block) -> float:
    """How far one example's output alone may lie from its row of the batch's output:
    :func:`.precision.rounding_bound` of the batch's output at :func:`rounding`'s ``eps``."""
    return precision.rounding_bound(block.output, rounding(block, block.output.dtype))
