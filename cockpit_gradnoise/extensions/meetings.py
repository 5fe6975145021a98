"""Where an output computed without the batch meets the batch, and each example's gradient.

A layer applied without the batch dimension (T5's relative position bias table on a
``[q, k]`` bucket index, nanoGPT's ``wpe(torch.arange(T))``) has an output shared
by every example. Its per-example gradient exists where that output, after any
number of batch-free operations, first meets the batch: an operation whose result
leads with the batch size ``B`` while the shared operand has size 1 there (or
fewer dimensions). Hugging Face's T5 (``transformers`` 5) computes
``table(buckets)`` (``[q, k, H]``), ``.permute(2, 0, 1).unsqueeze(0)``
(``[1, H, q, k]``), and every layer of the stack reuses it: added to its scores
(``[B, H, q, k]``, eager attention or SDPA's math path), or first merged with a
padding mask by ``torch.where(mask [B, 1, 1, k], bias, min)`` (the meeting), or
with a causal mask ``[1, 1, q, k]`` (batch-free) and then added.

:func:`follow` walks the autograd graph forward from the layer's output through
the operations below and returns every :class:`Meeting`, or ``None`` where some
path goes elsewhere (then nothing is proven: the caller refuses). The meeting's
operand broadcasts from size 1 to the batch, so it is unambiguous whatever ``T``
and ``B``: no shape coincidence (``q = k = B``) can make a batch-free operand look
broadcast. At a meeting, example ``i``'s gradient of the operand is the meeting's
own vector-Jacobian product with the batch sum left out (the ``i``-th slice of its
output gradient, times its multiplier, summed over the other broadcast
dimensions); the batch-free operations between the layer and the meeting are
the same linear map for every example, so their vector-Jacobian products, applied
with a leading example dimension (:class:`_Step`), carry it back exactly to the
layer's output: ``[B, *output shape]``, one layer's numbers, never a whole network's.

Batch-free operations followed: views and copies that take no other tensor
(unsqueeze, squeeze, view, reshape, permute, transpose, contiguous, dtype
casts, negation, expand) whatever the shapes, and element-wise ``+``, ``-``,
``*`` and ``torch.where`` whose result still leads with 1 (every operand has
size 1 there), or whose other operand is a single number. Meetings: ``+``,
``-``, ``*``, ``torch.where`` and ``expand`` whose result leads with the batch
size and whose operand leads with 1 (or has fewer dimensions).
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

#: Operations that keep the elements in order: the per-example vjp is a reshape.
_RESHAPES = {
    "UnsqueezeBackward0", "UnsqueezeBackward1", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
    "AliasBackward0", "CloneBackward0", "ToCopyBackward0",
}
_PERMUTES = {"PermuteBackward0", "TransposeBackward0", "TBackward0"}
#: Element-wise with broadcasting (the factor of their vjp: :func:`_multiplier`).
_ELEMENTWISE = {"AddBackward0", "SubBackward0", "MulBackward0", "WhereBackward0",
                "ExpandBackward0", "NegBackward0"}
#: Autograd's node of an operation done in place on a view (named ``torch::autograd::CopySlices``).
IN_PLACE_ON_VIEW = "CopySlices"
#: The backward nodes between a base and its view that the probe may pass through.
_VIEW_STEPS = _RESHAPES | _PERMUTES | {"AsStridedBackward0", "ExpandBackward0", "SliceBackward0",
                                       "SelectBackward0", "NarrowBackward0", "DiagonalBackward0"}
#: Operations done in place on a view that are followed: their operand's factor is a
#: number (an in-place product's saved operands are not the ones ``_multiplier`` reads).
_IN_PLACE_OPERATIONS = {"AddBackward0", "SubBackward0"}
#: At most this many nodes between a base and its view.
_MAX_VIEW_STEPS = 16
#: At most this many meetings per layer (a path count that explodes means a graph
#: that is not a small batch-free chain: refused).
MAX_MEETINGS = 4096


def output_shape(node) -> Optional[torch.Size]:
    """The shape of the forward output of a single-output autograd ``node``."""
    metadata = getattr(node, "_input_metadata", None)
    return torch.Size(metadata[0].shape) if metadata and len(metadata) == 1 else None


def _padded(shape: Sequence[int], rank: int) -> Tuple[int, ...]:
    return (1,) * (rank - len(shape)) + tuple(shape)


def sum_to(gradient: Tensor, shape: Sequence[int]) -> Tensor:
    """``[B, *out]`` to ``[B, *shape]``: each example's gradient summed over the
    dimensions that ``shape`` broadcasts from (size 1 or absent)."""
    out = gradient.shape[1:]
    padded = _padded(shape, len(out))
    dims = [j + 1 for j, (p, o) in enumerate(zip(padded, out)) if p == 1 and o != 1]
    if dims:
        gradient = gradient.sum(dims, keepdim=True)
    return gradient.reshape(gradient.shape[0], *shape)


def _multiplier(node, position: int) -> Callable[[Tensor], Tensor]:
    """The element-wise factor of ``node``'s vjp for its operand ``position``,
    read when the backward pass reaches ``node`` (its saved tensors still held)."""
    name = node.name()
    if name == "WhereBackward0":  # where(condition, self, other): self at 0, other at 1
        return lambda g: torch.where(node._saved_condition == (position == 0), g, 0.0)
    if name == "MulBackward0":
        return lambda g: g * (node._saved_other if position == 0 else node._saved_self)
    if name == "NegBackward0" or (name == "SubBackward0" and position == 1):
        sign = -1.0 if name == "NegBackward0" else -float(node._saved_alpha)
        return lambda g: sign * g
    if name == "AddBackward0" and position == 1 and float(node._saved_alpha) != 1.0:
        return lambda g: float(node._saved_alpha) * g
    return lambda g: g


class _Step:
    """One batch-free operation between the layer and a meeting: its vjp for every
    example at once (``[B, *out]`` to ``[B, *in]``)."""

    def __init__(self, node, position: int, in_shape: torch.Size):
        self.node, self.position, self.in_shape = node, position, in_shape

    def __call__(self, gradient: Tensor) -> Tensor:
        name, rank = self.node.name(), len(self.in_shape)
        if name == "PermuteBackward0":
            inverse = torch.argsort(torch.tensor([d % rank for d in self.node._saved_dims]))
            return gradient.permute(0, *(1 + int(d) for d in inverse))
        if name == "TransposeBackward0":
            first, second = self.node._saved_dim0 % rank, self.node._saved_dim1 % rank
            return gradient.transpose(first + 1, second + 1)
        if name == "TBackward0":
            return gradient.transpose(1, 2) if rank == 2 else gradient
        if name in _RESHAPES:
            return gradient.reshape(gradient.shape[0], *self.in_shape)
        return sum_to(_multiplier(self.node, self.position)(gradient), self.in_shape)


class Meeting:
    """An operation where the layer's output (through ``path``) meets the batch.

    ``node`` is where its output gradient is read (hooked); ``operation`` the operation
    itself, ``node`` but for one done in place on a view (``CopySlices``: ``node`` gives
    the base's gradient, of which ``view`` takes the view's elements).
    """

    def __init__(self, node, position: int, operand_shape: torch.Size, path: Tuple[_Step, ...],
                 operation=None, view: Optional["_View"] = None):
        self.node, self.position, self.operand_shape, self.path = node, position, operand_shape, path
        self.operation = node if operation is None else operation
        self.view = view

    def per_example(self, grad_outputs) -> Tensor:
        """``[B, *layer output shape]``: each example's gradient of the layer's output
        through this meeting, from the meeting's output gradient ``[B, ...]``."""
        gradient = grad_outputs[0] if self.view is None else self.view(grad_outputs[0])
        gradient = _multiplier(self.operation, self.position)(gradient).unsqueeze(1)
        gradient = sum_to(gradient, self.operand_shape)
        for step in reversed(self.path):
            gradient = step(gradient)
        return gradient


class _View:
    """The elements of a base's gradient that its view holds, in the view's order:
    ``base_gradient.reshape(-1)[positions].reshape(shape)`` (what ``CopySlices`` hands
    the operation done in place on the view)."""

    def __init__(self, positions: Tensor, shape: torch.Size):
        self.positions, self.shape = positions, shape

    def __call__(self, base_gradient: Tensor) -> Tensor:
        positions = self.positions.to(base_gradient.device)
        return base_gradient.reshape(-1)[positions].reshape(self.shape)


def _view_steps(view_node, base_node) -> Optional[List]:
    """The backward nodes from a view's (``view_node``) down to its base's
    (``base_node``), each of one input; ``None`` if any other node is on the way."""
    steps, node = [], view_node
    while node is not base_node:
        if (node is None or node.name() not in _VIEW_STEPS or len(node.next_functions) != 1
                or len(steps) >= _MAX_VIEW_STEPS):
            return None
        steps.append(node)
        node = node.next_functions[0][0]
    return steps


def _view_positions(copy_slices, view_shape: torch.Size) -> Optional[_View]:
    """Where each element of the view that an operation done in place was applied to
    lies in its base (``copy_slices``' output), or ``None`` where that is not proven.

    ``CopySlices`` keeps the view's strides to itself, but the view's own backward nodes
    (a reshape, or the ``as_strided`` autograd regenerates after an earlier in-place
    operation) map the view's gradient onto the base's with the same geometry: a probe
    ``1, 2, ..., n`` (float64: every integer exact) pushed through them lands element
    ``k`` of the view at its place in the base. Proven only where every element lands
    once, alone and unchanged (no expanded view, whose elements share a place; no cast
    that rounds the probe).
    """
    base_shape = output_shape(copy_slices)
    view_node = copy_slices._wrapped_node.next_functions[0][0]
    steps = _view_steps(view_node, copy_slices.next_functions[0][0])
    if base_shape is None or steps is None:
        return None
    count = torch.Size(view_shape).numel()
    device = copy_slices._input_metadata[0].device
    probe = torch.arange(1, count + 1, dtype=torch.float64, device=device).reshape(view_shape)
    with torch.no_grad():
        for step in steps:
            probe = step(probe)
            probe = probe[0] if isinstance(probe, tuple) else probe
    if probe is None or tuple(probe.shape) != tuple(base_shape):
        return None
    probe = probe.reshape(-1).to(torch.float64)
    places = torch.nonzero(probe).reshape(-1)
    landed = probe[places]
    if len(places) != count or not torch.equal(torch.sort(landed).values, torch.arange(
            1, count + 1, dtype=torch.float64, device=device)):
        return None
    positions = torch.empty(count, dtype=torch.long, device=device)
    positions[landed.long() - 1] = places
    return _View(positions, torch.Size(view_shape))


def _in_place_meeting(copy_slices, position: int, shape: torch.Size, path: Tuple[_Step, ...],
                      examples: Optional[int]) -> Optional[Meeting]:
    """The meeting where a batch-free tensor of ``shape`` is the operand ``position`` of an
    operation done in place on a view of a batch's tensor (``x.view(...) += table``), or
    ``None`` where it is not one (the operand the base itself, the view batch-free, an
    operation other than ``+`` and ``-``, a view not proven)."""
    operation = getattr(copy_slices, "_wrapped_node", None)
    # CopySlices' inputs are the base's, then the operation's own but its first (the view).
    if (operation is None or operation.name() not in _IN_PLACE_OPERATIONS or position == 0
            or position >= len(operation.next_functions)
            or operation.next_functions[position][0] is not copy_slices.next_functions[position][0]):
        return None
    view_shape = output_shape(operation)
    if _kind(operation, position, shape, view_shape, examples) != "meeting":
        return None
    view = _view_positions(copy_slices, view_shape)
    return None if view is None else Meeting(copy_slices, position, shape, path, operation, view)


def _single_number(node, position: int) -> bool:
    """Whether ``node``'s other operand is a single number (``bias * 0.5``)."""
    if node.name() != "MulBackward0":
        return False
    other = node._saved_self if position == 1 else node._saved_other
    return other is not None and other.numel() == 1


def _kind(node, position: int, shape: torch.Size, out: Optional[torch.Size],
          examples: Optional[int]) -> Optional[str]:
    """``"meeting"``, ``"batch-free"`` or ``None`` (not proven) for ``node`` consuming
    a batch-free tensor of ``shape`` at operand ``position``."""
    name = node.name()
    if out is None:
        return None
    if name in _RESHAPES or name in _PERMUTES:
        return "batch-free"
    if name not in _ELEMENTWISE or len(shape) > len(out) or not out:
        return None
    leading = _padded(shape, len(out))[0]
    if leading == 1 and out[0] != 1:
        return "meeting" if examples in (None, out[0]) else None
    unary = name in ("NegBackward0", "ExpandBackward0") or _single_number(node, position)
    return "batch-free" if out[0] == 1 or unary else None


def follow(node, shape: torch.Size, consumers: Dict[object, List[Tuple[object, int]]],
           examples: Optional[int]) -> Tuple[Optional[List[Meeting]], object]:
    """Every meeting of the output of ``node`` (of ``shape``) with the batch; or ``None``
    and the operation where a path from it is not proven batch-free up to a meeting
    (``None`` for a path that leaves the walked graph, or one of too many meetings).

    ``consumers``: ``{node: [(consumer, operand position)]}`` over the graph.
    """
    meetings: List[Meeting] = []
    stack = [(node, shape, ())]
    while stack:
        node, shape, path = stack.pop()
        found = consumers.get(node, [])
        if not found:  # an output of the network itself, or of a graph not walked
            return None, None
        for consumer, position in found:
            if IN_PLACE_ON_VIEW in consumer.name():
                meeting = _in_place_meeting(consumer, position, shape, path, examples)
                if meeting is None:
                    return None, consumer
                meetings.append(meeting)
                continue
            out = output_shape(consumer)
            kind = _kind(consumer, position, shape, out, examples)
            if kind is None:
                return None, consumer
            if kind == "meeting":
                meetings.append(Meeting(consumer, position, shape, path))
            else:
                stack.append((consumer, out, path + (_Step(consumer, position, shape),)))
        if len(meetings) + len(stack) > MAX_MEETINGS:
            return None, None
    return meetings, None
