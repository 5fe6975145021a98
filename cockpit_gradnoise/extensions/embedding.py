"""``Embedding`` for any dtype and with ``padding_idx``.

BackPACK 1.7.1 builds a float32 one-hot tensor, so its per-example results
fail on float64 models, and it refuses ``padding_idx`` (``NotImplementedError``
in the backward pass). The derivatives below build the one-hot tensor in the
gradient's dtype and leave the padding row out of it: torch's embedding
backward never writes that row, so its gradient, and every example's
contribution to it, is exactly 0 by definition (not a sum that rounds to 0), and the
padding positions' output gradients are left out before the sum (a NaN there, as torch
ignores it, never reaches another row).

The per-example squared norms and ``[T, S]`` never form the ``[N, V, d]``
contributions (GPT-2's ``V = 50257``: 1.2 GB and a ``V x P x d`` product per example
at sequence 256, batch 8, where the tokens touch at most ``P`` rows of each example).
Example ``i``'s contribution is nonzero only on the rows of its tokens,
``x_i[v] = sum_{p: idx_ip = v} e_ip`` (``e`` the output gradient), so
:func:`first_use_contributions` writes ``x_i[idx_ip]`` at the first position ``p`` of
example ``i`` that uses row ``idx_ip`` and 0 at the others (``[N, P, d]``, sorting
``N P`` keys, no wait for the device): the same nonzero numbers as the dense
contributions, each once per example, and exact zeros elsewhere. So

- ``||x_i||^2`` is the squared norm of its row of that tensor
  (:func:`embedding_squared_norms`: squares of exact zeros add exactly 0, and its
  largest magnitude, the scale of :mod:`._squares`, is the dense one's);
- ``T[v] = sum_i x_i[v]`` and ``S[v] = sum_i x_i[v]**2`` add the tensor's rows, and
  their squares, into row ``idx_ip`` (:func:`embedding_sums`): each ``x_i[v]`` once,
  zeros elsewhere; rows no token uses are exactly 0, as dense.

Where both extensions run on a layer (GradientVarianceQuantiles beside PerExampleGradNorm or
GradientNoiseScale), :func:`first_use_contributions` is formed once, by whichever reaches the
layer first, and taken from the backward pass's layer cache (:mod:`._layer_cache`) by the
other: one sort of ``N P`` keys and one ``index_add_`` of ``N P d`` numbers per layer, not two.

The gradient alone (:func:`embedding_gradient`) adds the output gradients into their rows.
Only the order in which float32 adds the terms of one ``x_i[v]`` differs from the
dense product's (``tests/test_embedding_rows.py`` compares the two and float64 brute force).
"""

from typing import Tuple

from cockpit_gradnoise.extensions import arena, facts
from cockpit_gradnoise.extensions._squares import (
    SquaredNormsFromContributionsMixin,
    contributions_scale,
    saved_dtype,
    scaled,
    squared_norms_of,
)
from cockpit_gradnoise.extensions.linear import is_active
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD
from cockpit_gradnoise.extensions.sums import SumsFromContributionsMixin, unscaled_or_wide

import torch
from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.extensions.firstorder.batch_l2_grad.embedding import BatchL2Embedding
from backpack.extensions.firstorder.gradient.embedding import GradEmbedding
from backpack.extensions.firstorder.sum_grad_squared.embedding import SGSEmbedding
from backpack.utils.subsampling import subsample
from torch import Tensor


class EmbeddingDerivativesAnyDtype(EmbeddingDerivatives):
    """BackPACK's Embedding derivatives with the one-hot tensor in the gradient's dtype."""

    def _weight_jac_t_mat_prod(
        self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None
    ):
        self._check_parameters(module)
        input0 = subsample(module.input0, subsampling=subsampling)
        # [num_embeddings, N, ...]: which examples and positions use each row.
        # By comparison, not F.one_hot, which reads the largest index back to
        # the host (a wait for the device on a GPU); the forward pass checked them.
        rows = torch.arange(module.num_embeddings, device=input0.device)
        one_hot = (input0.unsqueeze(0) == rows.reshape(-1, *[1] * input0.dim())).to(mat.dtype)
        if module.padding_idx is not None:  # non-negative: nn.Embedding normalizes it
            one_hot[module.padding_idx] = 0
            # The padding positions' output gradients reach nothing, not even as 0 * NaN (LED's
            # encoder pads its input with the padding token, whose attention rows are NaN).
            mat = torch.where((input0 != module.padding_idx).unsqueeze(0).unsqueeze(-1), mat, 0)
        equation = f"sn...,vn...h->v{'' if sum_batch else 'n'}sh"
        return torch.einsum(equation, one_hot, mat)

    def _check_parameters(self, module):
        """BackPACK's checks, less ``padding_idx`` (supported above)."""
        if module.max_norm is not None:
            raise NotImplementedError("Only max_norm=None supported.")
        if module.scale_grad_by_freq:
            raise NotImplementedError("Only scale_grad_by_freq=False supported.")
        if module.sparse:
            raise NotImplementedError("Only sparse=False supported.")


def lookups(module, inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``(idx [N, P], e [N, P, d])``: each example's indices and output gradients, any extra
    dimensions flattened into ``P``; ``e`` is 0 at the padding positions (by ``where``: a
    NaN there reaches nothing, as in torch's backward)."""
    examples = grad_output.shape[0]
    idx = inputs.reshape(examples, -1)
    grad = grad_output.reshape(examples, idx.shape[1], -1)
    if module.padding_idx is not None:  # non-negative: nn.Embedding normalizes it
        grad = torch.where((idx != module.padding_idx).unsqueeze(-1), grad, 0)
    return idx, grad


def first_use_contributions(idx: Tensor, grad: Tensor, rows: int) -> Tensor:
    """``c [N, P, d]``: ``c_ip = x_i[idx_ip]`` where ``p`` is the first position of example ``i``
    with index ``idx_ip``, 0 at the others.

    ``x_i[v] = sum_{p: idx_ip = v} e_ip``: the keys ``i V + idx_ip`` sorted, a run of equal
    keys is one ``(i, v)``; its positions' ``e`` are added into one slot (``index_add_``), and
    the slot is written back at the run's first position. Fixed sizes throughout (no
    ``unique``): nothing waits for the device. The sort is stable, so a run's first key is its
    first position.
    """
    examples, positions, width = grad.shape
    keys = (idx + torch.arange(examples, device=idx.device).unsqueeze(1) * rows).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    slot_in_order = torch.cumsum(starts, 0) - 1  # the run of each sorted key
    slot = torch.empty_like(slot_in_order).scatter_(0, order, slot_in_order)  # of each position
    first = torch.empty_like(starts).scatter_(0, order, starts)
    flat = grad.reshape(-1, width)
    summed = flat.new_zeros(flat.shape).index_add_(0, slot, flat)  # slots past the last run: 0
    return torch.where(first.unsqueeze(1), summed.index_select(0, slot), 0).reshape(grad.shape)


#: The layer cache's slot (:mod:`._layer_cache`) of an Embedding's ``(idx, first-use contributions)``.
_FIRST_USE = "embedding first-use contributions"


def shared_first_use(module, inputs: Tensor, grad_output: Tensor, other_savefield: str) -> Tuple[Tensor, Tensor]:
    """``(idx [N, P], first_use_contributions [N, P, d])`` of an Embedding's call: formed here
    when the extension saving ``other_savefield`` does not run in this backward pass, else
    formed by whichever of the two reaches the layer first and taken from the backward
    pass's layer cache by the second (only for these very tensors, unchanged: the cache's
    keys), so that the two read the same numbers, formed once."""
    if not is_active(other_savefield):
        idx, grad = lookups(module, inputs, grad_output)
        return idx, first_use_contributions(idx, grad, module.num_embeddings)
    sources = (module, inputs, grad_output)
    found = facts.recording().layer_cache.take(_FIRST_USE, sources)
    if found is None:
        idx, grad = lookups(module, inputs, grad_output)
        found = idx, first_use_contributions(idx, grad, module.num_embeddings)
        facts.recording().layer_cache.put(_FIRST_USE, sources, found)
    return found


def embedding_squared_norms(module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2`` of an Embedding's weight, ``[N]``: :func:`._squares.squared_norms_of` of
    :func:`first_use_contributions` (the module's docstring; :func:`shared_first_use` with the
    sums' extension). Its underflow floor counts the ``P d`` squares formed (the rows no token
    uses are exact zeros, never squared), as :func:`.batchless.embedding_results` counts its ``R d``."""
    _, contributions = shared_first_use(module, inputs, grad_output, SUMS_SAVEFIELD)
    return squared_norms_of(contributions)


def embedding_sums(module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S]`` of an Embedding's weight (``[2, V, d]``), from :func:`first_use_contributions`
    (:func:`shared_first_use` with the norms' extension) added by index: at the contributions'
    power-of-two scale, saved in float64, summed again from float64 where underflow lost an
    ``S`` (as :func:`.sums.sums_of` does with the dense contributions: the same scale, the
    same ``N`` terms per element)."""
    idx, contributions = shared_first_use(module, inputs, grad_output, BATCH_L2_SAVEFIELD)
    width, examples = contributions.shape[2], contributions.shape[0]
    index, flat = idx.flatten(), contributions.reshape(-1, width)
    shape = (module.num_embeddings, width)
    scale = contributions_scale(contributions)
    at_scale = scaled(flat, scale)
    sums = _added_by_index(index, at_scale, shape)
    return unscaled_or_wide(sums, scale, examples, lambda: _added_by_index(
        index, flat.to(saved_dtype(sums.dtype)), shape, placed=False))


def _added_by_index(index: Tensor, values: Tensor, shape, placed: bool = True) -> Tensor:
    """``[T, S]``: ``values`` and their squares added into rows ``index`` of zeros ``shape``;
    written in a slot of the pass's buffer (:func:`.arena.place`) outside autograd, as
    :func:`.sums.stacked` writes its sums."""
    squares = values.square()
    if torch.is_grad_enabled() or not placed:
        zeros = values.new_zeros(shape)
        return torch.stack([zeros.index_add(0, index, values), zeros.index_add(0, index, squares)])
    result = arena.place(values, shape)
    result.zero_()
    result[0].index_add_(0, index, values)
    result[1].index_add_(0, index, squares)
    return result


class BatchL2EmbeddingAnyDtype(SquaredNormsFromContributionsMixin, BatchL2Embedding):
    """Per-example squared norms of an Embedding's weight, any dtype, squares at a
    power-of-two scale (:mod:`._squares`), from each example's rows only
    (:func:`embedding_squared_norms`)."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()

    def weight(self, ext, module, g_inp, g_out, backproped):
        return embedding_squared_norms(module, module.input0, g_out[0])


class SGSEmbeddingAnyDtype(SGSEmbedding):
    """Sum of squared per-example contributions to an Embedding's weight, any dtype."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()


class SumsEmbeddingAnyDtype(SumsFromContributionsMixin, SGSEmbeddingAnyDtype):
    """``[T, S]`` of an Embedding's weight, any dtype (:mod:`.sums`), from each example's rows
    only (:func:`embedding_sums`)."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        return embedding_sums(module, module.input0, g_out[0])


class GradEmbeddingAnyDtype(GradEmbedding):
    """The gradient of an Embedding's weight, any dtype: the output gradients added into
    the rows of their indices (:func:`embedding_gradient`)."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()

    def weight(self, ext, module, g_inp, g_out, backproped):
        return embedding_gradient(module, module.input0, g_out[0])


def embedding_gradient(module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``sum_i x_i`` of an Embedding's weight (``[V, d]``): each position's output gradient
    added into the row of its index (``index_add_``, as torch's own backward), the padding
    positions' left out; no ``[V, N, P]`` one-hot tensor and its ``V N P d`` product."""
    idx, grad = lookups(module, inputs, grad_output)
    return grad.new_zeros(module.weight.shape).index_add_(0, idx.flatten(), grad.reshape(-1, grad.shape[2]))
