"""Embeddings applied without the batch dimension and broadcast over it.

nanoGPT adds ``wpe(torch.arange(T))`` (``[T, d]``) to the token embeddings
(``[B, T, d]``); Hugging Face's GPT-2 and BERT add ``wpe(position_ids)`` with
``position_ids`` of shape ``(1, T)``. Autograd sums the broadcast gradient over
the batch before the embedding sees it, so BackPACK takes the positions (or
the single leading 1) for examples: wrong rows, and when ``T`` equals the
batch size no shape shows it.

The per-example gradient is still available where the shared output meets
the batch. So nothing of the model is changed (no values, no shapes): after
each forward pass, for every ``nn.Embedding`` whose index is not a model input
of two or more dimensions leading with the batch size (:func:`suspect`),
:func:`find_broadcasts` follows its output in the autograd graph through
batch-free operations to every operation where it meets the batch, broadcast
from size 1 (:func:`.meetings.follow`: nanoGPT's addition, T5's relative
position bias permuted, unsqueezed and met by every layer's scores or padding
mask, RoCBERT's table added in place to a view of a ``Linear``'s output), and
puts a pre-hook on each that adds, in the backward pass, each example's
gradient of the output through it (``[B, *output shape]``). The embedding's per-example contributions are then exact
(:func:`embedding_results`): every example uses the same rows, so they are
``[B, R, d]`` numbers for the ``R`` distinct indices. A batch of one example
needs none of this: its gradient is the example's.

Otherwise the index is read as BackPACK reads it (its leading dimension the
batch) where it leads with the batch size and either is a model input (a
label per example, or an index whose rows the model run on one example more
saw follow the batch: :func:`.regroup.embedding_rows_are_examples`) or its
output was added to a tensor of that leading size;
any other index is refused (:meth:`Broadcast.refusal`) with an error at the
first tracked step naming the parameter and the operation where following
stopped: no shape tells the batch from the positions when ``T`` equals the
batch size.
"""

import functools
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions import meetings, scaled_embedding
from cockpit_gradnoise.extensions._squares import squared_norms_of
from cockpit_gradnoise.extensions.precision import widened
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.extensions.sums import sums_of

import torch
from torch import Tensor, nn

_HOOK_NODE = "BackwardHookFunctionBackward"  # BackPACK's module hooks wrap outputs in one
_ADDITIONS = {"AddBackward0", "SubBackward0"}
#: Views between the output and the addition that keep the elements in order.
_VIEWS = {"UnsqueezeBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}


class Broadcast:
    """An embedding call of this forward pass whose index has no batch dimension by shape.

    Attributes:
        index: The index tensor.
        output_shape: The shape of the embedding's output.
        meetings: Where its output meets the batch (:func:`.meetings.follow`), found
            after the forward pass; ``None`` where that is not proven.
        gradient: ``[B, *output_shape]``, each example's gradient of the output, summed
            over the meetings the backward pass reached.
    """

    def __init__(self, index: Tensor, output_shape: torch.Size, node, examples: Optional[int],
                 from_inputs: bool):
        self.index, self.output_shape, self.node = index, output_shape, node
        self.meetings: Optional[List[meetings.Meeting]] = None
        self.gradient: Optional[Tensor] = None
        #: Its output is added to a tensor of its own leading size (through views that
        #: keep the elements in order): read per example where the index leads with the batch.
        self.added = False
        #: The operation where following its output stopped (:func:`.meetings.follow`).
        self.stopped_at: Optional[str] = None
        #: A batch of one example: its gradient is that example's.
        self.single = examples == 1
        #: No batch dimension for certain: no dimension, or a leading size not the batch's.
        self.clearly = index.dim() == 0 or (examples is not None and index.shape[0] != examples)
        #: The index is (a view of) a tensor the model was called with.
        self.from_inputs = from_inputs
        #: The index was built by the layer's own forward, whose output is the lookup's
        #: (:mod:`.own_index`): its output gradient is the lookup's.
        self.built = False
        #: The index is expanded over a leading dimension of the batch's size (stride 0),
        #: ``index.expand(B, *index.shape)``: every example's own indices.
        self.expanded = (index.dim() >= 2 and index.stride(0) == 0
                         and examples is not None and index.shape[0] == examples)

    @property
    def exact(self) -> bool:
        """Whether its rows are computed here, exact per example: its output meets the
        batch only where proven broadcast (or the batch has one example)."""
        return self.single or bool(self.meetings)

    def refusal(self) -> Optional[str]:
        """Why its rows cannot be computed, or ``None``: exact (broadcast), or per example.

        Exact where every path from its output meets the batch broadcast from size 1
        (:attr:`meetings`); per example (BackPACK's reading of the leading dimension)
        where the index leads with the batch's size and either its output is added to a
        tensor of the same leading size, or the index comes from the model's inputs (a
        label per example), or it is expanded over that dimension (``index.expand(B, T)``,
        stride 0: what the fix below asks for, and what ``torch.compile``'s graphs may
        hide the addition of); refused otherwise, since no shape tells the batch from the
        positions (``T`` equal to the batch size).
        """
        if self.exact:
            return None
        if not self.clearly and (self.added or self.from_inputs or self.expanded):
            return None
        return _why_not(tuple(self.index.shape), self.stopped_at)

    def keep(self, meeting: "meetings.Meeting", grad_outputs):
        """Node pre-hook of a meeting: add each example's gradient through it."""
        if grad_outputs[0] is None:
            return
        gradient = meeting.per_example(grad_outputs)
        self.gradient = gradient if self.gradient is None else self.gradient + gradient

    def per_example_output_gradients(self, width: int) -> Tensor:
        """``[B, P, width]``: example ``i``'s gradient of the output, positions flattened."""
        return self.gradient.reshape(self.gradient.shape[0], -1, width)


def _why_not(shape: Tuple[int, ...], stopped_at: Optional[str]) -> str:
    """The refusal of an index of ``shape`` whose output could not be followed to the
    batch, past the operation ``stopped_at`` (an autograd node's name, or ``None``)."""
    start = f"its index (shape {shape}) is not an input of the model, and its output "
    if stopped_at is not None and "ScaledDotProduct" in stopped_at:
        return start + (
            f"meets the batch inside a fused attention kernel ({stopped_at}), which sums "
            "the attention mask's gradient over the batch: run the attention with the math "
            "kernel at tracked steps (torch.nn.attention.sdpa_kernel(SDPBackend.MATH) "
            "around the forward pass, or attn_implementation='eager' in transformers)")
    if stopped_at is not None and "CompiledFunction" in stopped_at:
        return start + (
            "goes into a graph compiled by torch.compile, where the package cannot see "
            "whether it is broadcast over the batch or taken per example: run the "
            "uncompiled module (compiled._orig_mod) at tracked steps")
    if stopped_at is not None and "CopySlices" in stopped_at:
        return start + (
            f"is used by an in-place operation on a view ({stopped_at}) that the package "
            "does not follow (it follows += and -= on a view whose place in its base its "
            "backward nodes show, as RoCBERT's `embedding_in += position_embeddings`), so its "
            "broadcast over the batch is not proven: write it out of place "
            "(x = x + table(positions)), or apply the embedding to every example's indices "
            "(index.expand(B, *index.shape))")
    through = "" if stopped_at is None else f" ({stopped_at})"
    return start + (
        f"reaches the batch's tensors through an operation the package does not follow{through} "
        "(it follows views, permutes, +, -, * and torch.where to the operations that "
        "broadcast it over the batch): apply the embedding to every example's indices "
        "(index.expand(B, *index.shape)), or add its output to a tensor of the batch")


def suspect(index: Tensor, examples: Optional[int], from_inputs: bool) -> bool:
    """Whether an embedding's index may lack the batch dimension: anything but an input
    of the model (or a view of one) of 2 or more dimensions that leads with the batch's
    size ``examples`` (``None``: unknown)."""
    return not (from_inputs and index.dim() >= 2 and index.shape[0] == examples)


def _resolved(node):
    """``node``, seen through BackPACK's hook nodes."""
    while node is not None and node.name() == _HOOK_NODE and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    return node


def _graph_roots(output) -> List:
    if isinstance(output, Tensor):
        return [output.grad_fn] if output.grad_fn is not None else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [root for item in output for root in _graph_roots(item)]
    return []


def consumers_of(output) -> Dict[object, List[Tuple[object, int]]]:
    """``{node: [(consumer, operand position)]}`` over the autograd graph of ``output``."""
    return _consumers(output)


def _consumers(output) -> Dict[object, List[Tuple[object, int]]]:
    """``{node: [(consumer, operand position)]}`` over the autograd graph of ``output``,
    BackPACK's hook nodes seen through."""
    consumers: Dict[object, List[Tuple[object, int]]] = {}
    seen, stack = set(), _graph_roots(output)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for position, (child, _) in enumerate(node.next_functions):
            if child is not None:
                stack.append(child)
                if node.name() != _HOOK_NODE:
                    consumers.setdefault(_resolved(child), []).append((node, position))
    return consumers


def _added_per_example(node, consumers) -> bool:
    """Whether ``node``'s output, through views that keep its elements in order
    (unsqueeze, view), is added to a tensor of its own leading size (not broadcast)."""
    shape = meetings.output_shape(node)
    while True:
        found = consumers.get(node, [])
        if len(found) != 1:
            return False
        consumer, _ = found[0]
        if consumer.name() in _ADDITIONS:
            result = meetings.output_shape(consumer)
            return (shape is not None and result is not None and len(shape) == len(result)
                    and shape[0] == result[0])
        if consumer.name() not in _VIEWS:
            return False
        node, shape = consumer, meetings.output_shape(consumer)


def find_broadcasts(output, calls: Dict[nn.Module, "Broadcast"], examples: Optional[int]):
    """Find where each call's output meets the batch in the graph of ``output``
    (:func:`.meetings.follow`), and hook every meeting.

    One walk over the autograd graph, done only when a forward pass had such a call.
    Returns the consumers it found (``{node: [(consumer, operand position)]}``).
    """
    consumers = _consumers(output)
    for call in calls.values():
        if call.single:
            continue
        node = _resolved(call.node)
        call.meetings, stopped = meetings.follow(node, call.output_shape, consumers, examples)
        for meeting in call.meetings or ():
            meeting.node.register_prehook(functools.partial(call.keep, meeting))
        if not call.meetings:
            call.meetings = None
            call.added = _added_per_example(node, consumers)
            call.stopped_at = None if stopped is None else stopped.name()
    return consumers


def embedding_results(module: nn.Embedding, call: Broadcast, savefield: str) -> Tensor:
    """The savefield value of an embedding broadcast over the batch, per example exact.

    Every example uses the same ``P`` indices, with their own output
    gradients ``E_i`` (``[P, d]``): ``x_i`` is nonzero on the ``R`` distinct
    rows only, ``x_i[r] = sum_{p: idx_p = r} E_ip`` (``[B, R, d]``), from which
    ``sum_i x_i``, ``sum_i x_i**2`` and ``||x_i||^2`` follow directly.
    """
    # Widened to float32 where narrower (a meeting under autocast): results to be summed;
    # at the lookup's output (a scaled embedding's, times its scale: .scaled_embedding).
    gradient = widened(call.per_example_output_gradients(module.embedding_dim))
    gradient = gradient if call.built else scaled_embedding.lookup_gradient(module, gradient)
    index = call.index.reshape(-1)
    if module.padding_idx is not None:
        gradient = gradient * (index != module.padding_idx).reshape(1, -1, 1)
    rows, inverse = torch.unique(index, return_inverse=True)
    contributions = gradient.new_zeros(gradient.shape[0], len(rows), gradient.shape[2])
    contributions.index_add_(1, inverse, gradient)
    if savefield == BATCH_L2_SAVEFIELD:
        return squared_norms_of(contributions)  # at a scale: no underflow (._squares)
    shape = module.weight.shape
    if savefield == LOCAL_GRADIENT_SAVEFIELD:
        return gradient.new_zeros(shape).index_put_((rows,), contributions.sum(0))
    assert savefield == SUMS_SAVEFIELD
    sums = sums_of(contributions)  # [2, R, d], at a scale where squares could underflow
    result = sums.new_zeros(2, *shape)
    result[:, rows] = sums
    return result
