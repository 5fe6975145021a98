"""Embeddings that build their own index: learned positions looked up from ``arange``.

BART, mBART, PLBart, BigBird-Pegasus, Blenderbot, BioGPT and ProphetNet learn
their positions with a subclass of ``nn.Embedding`` whose ``forward`` takes the
tokens (or only their shape, or the attention mask) and looks up positions it
builds itself::

    positions = torch.arange(past, past + T).expand(B, -1)   # or position_ids.unsqueeze(0)
    return super().forward(positions + self.offset)

The layer's argument is not its index, so ``nn.Embedding``'s rule cannot read
it, and the ``torch.func`` fallback refused the call whose index has no batch
dimension (BART's decoder: ``[1, T]``, broadcast over the batch by the
addition to the token embeddings). The function is still an embedding:
where the output of the call is ``F.embedding``'s own result on the layer's
weight (its autograd node is ``EmbeddingBackward0`` and its one input the
weight's accumulator), each example's contribution is ``nn.Embedding``'s with
the index autograd saved for that node (``_saved_indices``), the
``padding_idx`` and ``scale_grad_by_freq`` the layer holds. That is checked
per call, from the graph, never assumed from the class: :func:`index_of`
gives the index, or ``None`` (the call keeps its arguments, and the fallback
or the refusal stands).

The hooks then record the call with that index as its input
(:func:`.hooks._store_call`), so the rule reads it as ``module.input0``, and
:mod:`.uses` treats it as any embedding's index: read per example where it
leads with the batch and is added to the batch's tensor (BART's encoder:
``arange(T).expand(B, T) + 2``), or, without the batch (BART's decoder,
``[1, T]``), exact from each example's gradient where the output meets the
batch (:mod:`.batchless`): each example's contribution is its own output
gradient summed into the rows its positions look up.
"""

import weakref
from typing import Optional

from cockpit_gradnoise.extensions.subclasses import inherits_forward

from torch import Tensor, nn

#: The calls of the hooks (:class:`.hooks.Call`) recorded with the index their layer built.
_BUILT = weakref.WeakSet()
#: The layers that had such a call (for the checker's "how").
_LAYERS = weakref.WeakSet()

#: ``F.embedding`` saves ``padding_idx=None`` as -1, which the node shows unsigned.
_NO_PADDING = (-1, 2**64 - 1)


def index_of(module: nn.Module, output) -> Optional[Tensor]:
    """The index of the lookup whose result ``module``'s forward returned as ``output``, for
    an ``nn.Embedding`` subclass whose ``forward`` is not ``nn.Embedding``'s; ``None`` where
    ``output`` is not ``F.embedding(index, module.weight)`` itself, with the layer's
    ``padding_idx`` and ``scale_grad_by_freq``, or the layer is not such a subclass."""
    if not isinstance(module, nn.Embedding) or inherits_forward(type(module), nn.Embedding):
        return None
    node = getattr(output, "grad_fn", None)
    if node is None or node.name() != "EmbeddingBackward0" or len(node.next_functions) != 1:
        return None
    weight_node = node.next_functions[0][0]
    if getattr(weight_node, "variable", None) is not module.weight:
        return None
    padding = _NO_PADDING if module.padding_idx is None else (module.padding_idx,)
    if node._saved_padding_idx not in padding \
            or bool(node._saved_scale_grad_by_freq) != bool(module.scale_grad_by_freq):
        return None
    return node._saved_indices


def note(call, module: nn.Module) -> None:
    """``call`` (a :class:`.hooks.Call` of ``module``) holds the index the layer built as its input."""
    _BUILT.add(call)
    _LAYERS.add(module)


def builds_index(module: nn.Module) -> bool:
    """Whether a call of ``module`` was recorded with the index it built (:func:`note`)."""
    return module in _LAYERS


def built(call) -> bool:
    """Whether ``call`` was recorded with the index its layer built (:func:`note`)."""
    return call is not None and call in _BUILT
