"""``Linear`` weights: both sums of the contributions and per-example squared norms.

Applied to ``[N, L, in]`` (``L`` positions of a sequence; any extra dimensions
are flattened into ``L``), a Linear's weight contributions are sums over
positions, ``x_i = sum_l g_il a_il^T``: the convolution's case with one group
(:mod:`.convolution`), ``C_b = out``, ``C_a = in``. Without extra dimensions
each is one product, and BackPACK's identities are exact and cheap: the
sums are :func:`linear_weight_sums`' two matrix products, the norms
``(sum_j g_ij^2)(sum_k a_ik^2)`` by BackPACK's ``BatchL2Linear``.

With positions, two exact ways to get ``||x_i||^2``, chosen per layer by the
convolutions' cost model (``formation_is_cheaper(gram_cost, out, in, L)``,
which ``convolution.FORCE_METHOD`` overrides as it does for convolutions):

- **Gram matrices**: ``||x_i||^2 = sum_{l,l'} (g_il . g_il') (a_il . a_il')``
  (:func:`gram_squared_norms`), ``2 L^2 (out + in)`` operations per example;
- **formation**: form ``x_i`` and square it (:func:`formed_squared_norms`),
  ``2 L out in`` operations and ``out in`` numbers written and read.

BackPACK's ``BatchL2Linear`` contracts the Gram form as one four-operand
``einsum``, slower than the two ``bmm`` here (a path search every call,
another order of products). The sums need the formed ``x_i`` whatever the
cost (:mod:`.sums`). So when ``SumsOfContributions`` and
``PerExampleSquaredNorms`` both run in one backward pass, whichever reaches
the layer first forms each chunk of ``x_i`` once and takes both results from
it (:func:`linear_weight_sums_and_squared_norms`); the other's result is
handed over (:func:`hand_over`, :func:`take_over`) and the second extension
computes nothing. Its norms then come from formation, not the Gram matrices
it would use alone: the same numbers up to rounding, not bit for bit.
"""

import weakref
from typing import Iterator, Optional, Tuple

from cockpit_gradnoise.extensions import convolution
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD
from cockpit_gradnoise.extensions.sums import SumsFromContributionsMixin, stacked

import torch
from backpack.context import CTX
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions.firstorder.batch_l2_grad.linear import BatchL2Linear
from backpack.extensions.firstorder.sum_grad_squared.sgs_base import SGSBase
from torch import Tensor

#: Bytes of temporaries (per-example contributions, or Gram matrices) formed
#: at once for a Linear on sequences (as :data:`.convolution.CHUNK_BYTES`).
CHUNK_BYTES = 16 * 2**20


def sequence_factors(inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``(g, a)``: output gradients ``[N, L, out]`` and inputs ``[N, L, in]``."""
    return grad_output.flatten(1, -2), inputs.flatten(1, -2)


def examples_per_chunk(numbers_per_example: int, itemsize: int) -> int:
    """How many examples' temporaries fit in :data:`CHUNK_BYTES` (at least one)."""
    return max(1, CHUNK_BYTES // (numbers_per_example * itemsize))


def formed_contributions(g: Tensor, a: Tensor) -> Iterator[Tensor]:
    """``x_i = g_i^T a_i`` (``[n, out, in]``) for consecutive chunks of examples."""
    size = examples_per_chunk(g.shape[2] * a.shape[2], a.element_size())
    for start in range(0, g.shape[0], size):
        yield torch.bmm(g[start : start + size].transpose(1, 2), a[start : start + size])


def gram_squared_norms(g: Tensor, a: Tensor) -> Tensor:
    """``||x_i||^2 = sum_{l,l'} (g_il . g_il') (a_il . a_il')``, ``[N]``, chunk by chunk."""
    positions = g.shape[1]
    size = examples_per_chunk(2 * positions**2, a.element_size())
    norms = []
    for start in range(0, g.shape[0], size):
        g_chunk, a_chunk = g[start : start + size], a[start : start + size]
        gram_g = torch.bmm(g_chunk, g_chunk.transpose(1, 2))
        gram_a = torch.bmm(a_chunk, a_chunk.transpose(1, 2))
        norms.append(gram_g.mul_(gram_a).sum((1, 2)))
    return torch.cat(norms)


def formed_squared_norms(g: Tensor, a: Tensor) -> Tensor:
    """``||x_i||^2`` from the formed ``x_i``, ``[N]``."""
    return torch.cat([x.square_().sum((1, 2)) for x in formed_contributions(g, a)])


def linear_weight_squared_norms(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2`` of a Linear's weight on sequences (inputs ``[N, ..., in]``), ``[N]``.

    By the Gram matrices or by formation, whichever the cost model finds cheaper.
    """
    g, a = sequence_factors(inputs, grad_output)
    if convolution._use_formation(convolution.gram_cost, g.shape[2], a.shape[2], g.shape[1]):
        return formed_squared_norms(g, a)
    return gram_squared_norms(g, a)


def linear_weight_sums_and_squared_norms(inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``([T, S], ||x_i||^2)`` of a Linear's weight on sequences, from one formation of ``x_i``.

    ``[T, S] = [sum_i x_i, sum_i x_i**2]`` (``[2, out, in]``, :mod:`.sums`) and
    the per-example squared norms (``[N]``) are sums of the same squared
    contributions, over examples and over elements.
    """
    g, a = sequence_factors(inputs, grad_output)
    sums = inputs.new_zeros(2, g.shape[2], a.shape[2])
    norms = []
    for x in formed_contributions(g, a):
        sums[0] += x.sum(0)
        squares = x.square_()
        sums[1] += squares.sum(0)
        norms.append(squares.sum((1, 2)))
    return sums, torch.cat(norms)


def linear_weight_sums(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S]`` of a Linear's weight, with inputs ``[N, ..., in]``.

    Without extra dimensions each contribution is one product, ``x_i = g_i a_i^T``:
    ``T = G^T A`` and ``S = (G**2)^T (A**2)`` are two matrix products (no
    ``N x |W|`` tensor), exact to the bound with ``inner_terms = 1``. With extra
    dimensions (positions of a sequence), ``x_i = sum_l g_il a_il^T`` is formed
    for chunks of examples of at most :data:`CHUNK_BYTES`, and both sums
    taken from it, by :func:`linear_weight_sums_and_squared_norms` (so that
    ``T`` and ``S`` are the same numbers, alone or beside the norms).
    """
    if grad_output.dim() == 2:
        shape = (grad_output.shape[1], inputs.shape[1])
        return stacked(
            torch.mm, (grad_output.T, inputs), (grad_output.square().T, inputs.square()), shape
        )
    return linear_weight_sums_and_squared_norms(inputs, grad_output)[0]


# Handing one extension's result over to the other, within one layer's hook ----------

#: ``{savefield: (module, grad_output, result)}`` (weak references to the
#: first two): a result formed for the extension that saves ``savefield``,
#: which it takes within the same layer's hook (BackPACK runs every active
#: extension on a layer before going on to the next layer).
_HANDED_OVER: dict = {}


def hand_over(savefield: str, module, grad_output: Tensor, result: Tensor) -> None:
    """Leave ``result`` for the extension saving ``savefield``, for this layer and call only."""
    _HANDED_OVER[savefield] = (weakref.ref(module), weakref.ref(grad_output), result)


def take_over(savefield: str, module, grad_output: Tensor) -> Optional[Tensor]:
    """The result left for ``savefield`` by :func:`hand_over` for this very layer and
    output gradient (the same tensor object, so only within this backward call), or
    ``None``. Taking it clears it."""
    entry = _HANDED_OVER.pop(savefield, None)
    if entry is None or entry[0]() is not module or entry[1]() is not grad_output:
        return None
    return entry[2]


def is_active(savefield: str) -> bool:
    """Whether an extension saving ``savefield`` runs in the current backward pass."""
    return any(getattr(ext, "savefield", None) == savefield for ext in CTX.get_active_exts())


def _shared_weight_result(ext, module, grad_output: Tensor, other_savefield: str, alone):
    """This extension's weight result for a Linear on sequences (``ext.savefield`` is
    :data:`SUMS_SAVEFIELD` or :data:`BATCH_L2_SAVEFIELD`, the other one
    ``other_savefield``): handed over, formed with the other's, or ``alone(inputs,
    grad_output)`` when the other does not run."""
    result = take_over(ext.savefield, module, grad_output)
    if result is not None:
        return result
    if not is_active(other_savefield):
        return alone(module.input0, grad_output)
    sums, norms = linear_weight_sums_and_squared_norms(module.input0, grad_output)
    if ext.savefield == SUMS_SAVEFIELD:
        hand_over(other_savefield, module, grad_output, norms)
        return sums
    hand_over(other_savefield, module, grad_output, sums)
    return norms


class SumsLinear(SumsFromContributionsMixin, SGSBase):
    """``[T, S]`` of a ``Linear``: weight by :func:`linear_weight_sums`, bias from its contributions."""

    def __init__(self):
        super().__init__(derivatives=LinearDerivatives(), params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        if g_out[0].dim() == 2:
            return linear_weight_sums(module.input0, g_out[0])
        return _shared_weight_result(ext, module, g_out[0], BATCH_L2_SAVEFIELD, linear_weight_sums)


class SquaredNormsLinear(BatchL2Linear):
    """``||x_i||^2`` of a ``Linear``: BackPACK's ``BatchL2Linear`` without extra
    dimensions and for the bias; on sequences :func:`linear_weight_squared_norms`."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        if g_out[0].dim() == 2:
            return super().weight(ext, module, g_inp, g_out, backproped)
        return _shared_weight_result(
            ext, module, g_out[0], SUMS_SAVEFIELD, linear_weight_squared_norms
        )
