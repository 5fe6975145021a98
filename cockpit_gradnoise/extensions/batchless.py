"""Embeddings applied without the batch dimension and broadcast over it.

nanoGPT adds ``wpe(torch.arange(T))`` (``[T, d]``) to the token embeddings
(``[B, T, d]``); Hugging Face's GPT-2 and BERT add ``wpe(position_ids)`` with
``position_ids`` of shape ``(1, T)``. Autograd sums the broadcast gradient over
the batch before the embedding sees it, so BackPACK takes the positions (or
the single leading 1) for examples: wrong rows, and when ``T`` equals the
batch size no shape shows it.

The per-example gradient is still available where the broadcast output meets
the batch: the add. So nothing of the model is changed (no values, no
shapes): after each forward pass, for every ``nn.Embedding`` whose index has
no batch dimension by its shape (0 or 1 dimensions, or a leading size other
than the batch's), :func:`find_broadcasts` looks in the autograd graph for the
node that consumed its output. If that is an addition or a subtraction, a
pre-hook on it keeps the gradient of its result (``[B, ...]``) in the
backward pass. Then if the output was broadcast over the batch (fewer
dimensions than the result, or a leading 1 against the batch's ``B``), example
``i``'s output gradient is that gradient's ``i``-th slice summed over the other
broadcast dimensions, and the embedding's per-example contributions are exact
(:func:`embedding_results`): every example uses the same rows, so they are
``[B, R, d]`` numbers for the ``R`` distinct indices.

An index without a batch dimension by its shape whose output meets the batch
elsewhere (a product, a permutation first: T5's relative position buckets) is
refused with an error at the first tracked step, naming the parameter. A
one-dimensional index of the batch's length whose output is not broadcast by
an addition is taken as one index per example (a label embedding), as
BackPACK takes it.
"""

import functools
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)

import torch
from torch import Tensor, nn

_HOOK_NODE = "BackwardHookFunctionBackward"  # BackPACK's module hooks wrap outputs in one
_ADDITIONS = {"AddBackward0": 1.0, "SubBackward0": -1.0}  # sign of the second operand


class Broadcast:
    """An embedding call of this forward pass whose index has no batch dimension by shape.

    Attributes:
        index: The index tensor.
        output_shape: The shape of the embedding's output.
        gradient: The gradient of the addition's result (``[B, ...]``), once the
            backward pass reached it; times the sign of the embedding's operand.
    """

    def __init__(self, index: Tensor, output_shape: torch.Size, node, examples: Optional[int]):
        self.index, self.output_shape, self.node = index, output_shape, node
        self.gradient: Optional[Tensor] = None
        #: No batch dimension for certain: no dimension, or a leading size not the batch's.
        self.clearly = index.dim() == 0 or (examples is not None and index.shape[0] != examples)

    def refusal(self) -> Optional[str]:
        """Why its rows cannot be computed, or ``None``: exact (broadcast), or per example."""
        if self.gradient is not None and self.broadcast_over_batch() or not self.clearly:
            return None
        return (
            f"its index (shape {tuple(self.index.shape)}) has no batch dimension and its "
            "output meets the batch elsewhere than in an addition: apply the embedding "
            "to every example's indices (index.expand(B, *index.shape)), or add its "
            "output to a tensor of the batch"
        )

    def keep(self, sign: float, grad_outputs):
        """Node pre-hook of the addition: keep the gradient of its result."""
        self.gradient = grad_outputs[0] if sign == 1.0 else sign * grad_outputs[0]

    def broadcast_over_batch(self) -> bool:
        """Whether the output was broadcast over the batch (known in the backward pass)."""
        shape, result = self.output_shape, self.gradient.shape
        return len(shape) < len(result) or (shape[0] == 1 and result[0] != 1)

    def per_example_output_gradients(self) -> Tensor:
        """``[B, P, d]``: example ``i``'s gradient of the output, positions flattened."""
        result = self.gradient.shape
        padded = (1,) * (len(result) - len(self.output_shape)) + tuple(self.output_shape)
        summed = [j for j in range(1, len(result)) if padded[j] == 1 and result[j] != 1]
        gradient = self.gradient.sum(summed, keepdim=True) if summed else self.gradient
        return gradient.reshape(result[0], -1, self.output_shape[-1])


def suspect(index: Tensor, examples: Optional[int]) -> bool:
    """Whether an embedding's index may lack the batch dimension: 0 or 1 dimensions, or a
    leading size other than the batch's ``examples`` (``None``: unknown, so any)."""
    return examples is None or index.dim() <= 1 or index.shape[0] != examples


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


def find_broadcasts(output, calls: Dict[nn.Module, Broadcast]):
    """Find each call's consumer in the graph of ``output`` and hook it if it is an addition.

    One walk over the autograd graph, done only when a forward pass had such a call.
    """
    wanted = {call.node: call for call in calls.values()}
    consumers: Dict[Broadcast, List[Tuple[object, int]]] = {call: [] for call in calls.values()}
    seen, stack = set(), _graph_roots(output)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for position, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            stack.append(child)
            call = wanted.get(_resolved(child))
            if call is not None and node.name() != _HOOK_NODE:
                consumers[call].append((node, position))
    for call, found in consumers.items():
        if len(found) == 1 and found[0][0].name() in _ADDITIONS:
            node, position = found[0]
            alpha = float(getattr(node, "_saved_alpha", 1.0))
            sign = 1.0 if position == 0 else _ADDITIONS[node.name()] * alpha
            node.register_prehook(functools.partial(call.keep, sign))


def embedding_results(module: nn.Embedding, call: Broadcast, savefield: str) -> Tensor:
    """The savefield value of an embedding broadcast over the batch, per example exact.

    Every example uses the same ``P`` indices, with their own output
    gradients ``E_i`` (``[P, d]``): ``x_i`` is nonzero on the ``R`` distinct
    rows only, ``x_i[r] = sum_{p: idx_p = r} E_ip`` (``[B, R, d]``), from which
    ``sum_i x_i``, ``sum_i x_i**2`` and ``||x_i||^2`` follow directly.
    """
    gradient = call.per_example_output_gradients()
    index = call.index.reshape(-1)
    if module.padding_idx is not None:
        gradient = gradient * (index != module.padding_idx).reshape(1, -1, 1)
    rows, inverse = torch.unique(index, return_inverse=True)
    contributions = gradient.new_zeros(gradient.shape[0], len(rows), gradient.shape[2])
    contributions.index_add_(1, inverse, gradient)
    if savefield == BATCH_L2_SAVEFIELD:
        return contributions.square().sum((1, 2))
    weight = module.weight
    total = weight.new_zeros(weight.shape).index_put_((rows,), contributions.sum(0))
    if savefield == LOCAL_GRADIENT_SAVEFIELD:
        return total
    assert savefield == SUMS_SAVEFIELD
    squares = weight.new_zeros(weight.shape).index_put_((rows,), contributions.square().sum(0))
    return torch.stack([total, squares])
