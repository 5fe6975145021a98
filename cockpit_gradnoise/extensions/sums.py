"""``sum_i x_i`` and ``sum_i x_i**2`` from one computation of the contributions ``x_i``.

The standard deviation of the gradient comes from ``S - T**2 / N`` with
``S = sum_i x_i**2`` and ``T = sum_i x_i``
(:func:`~cockpit_gradnoise.functional.centred_sum_of_squares`). Where all
``x_i`` agree the difference is rounding noise, which
:func:`~cockpit_gradnoise.functional.variance_rounding_bound` sets to 0. That
bound is tight (``inner_terms = 1``) only if ``T`` adds up the very computed
``x_i`` that are squared into ``S``: ``param.grad`` sums the same numbers in
another order (for a convolution or a Linear on sequences, over examples and
positions in one matrix product), and where the terms of one contribution
cancel, identical examples then give an sd far above 0 (an SNR of ~3e7).

So the module extensions here return both sums, stacked as
``[2, *param.shape]`` (``[T, S]``), computed from the same contributions:
one result and one savefield per parameter, which Cockpit frees after the
step as it frees every savefield. The contributions are formed wherever
each is a sum of several terms; where each is one product (a Linear layer
without extra dimensions, a convolution with one output position) the two
sums are two matrix products, within the bound with ``inner_terms = 1``.
"""

from cockpit_gradnoise.extensions.batchnorm import SGSBatchNormAnyMode
from cockpit_gradnoise.extensions.embedding import SGSEmbeddingAnyDtype

import torch
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions.firstorder.sum_grad_squared.rnn import SGSLSTM, SGSRNN
from backpack.extensions.firstorder.sum_grad_squared.sgs_base import SGSBase
from torch import Tensor

#: Bytes of per-example contributions a Linear on sequences forms at once
#: (as the convolutions' formation, :data:`.convolution.CHUNK_BYTES`).
CHUNK_BYTES = 16 * 2**20


def stacked(op, first: tuple, second: tuple, shape) -> Tensor:
    """``torch.stack([op(*first), op(*second)])``, each written in place where autograd allows.

    Under ``create_graph`` the operands require grad and ``out=`` is refused;
    otherwise writing into the result saves a copy of it.
    """
    if torch.is_grad_enabled():
        return torch.stack([op(*first), op(*second)])
    result = first[0].new_empty(2, *shape)
    op(*first, out=result[0])
    op(*second, out=result[1])
    return result


def sums_of(contributions: Tensor, axis: int = 0) -> Tensor:
    """``[T, S]``: ``sum_i x_i`` and ``sum_i x_i**2`` over ``axis`` of the contributions."""
    shape = contributions.shape[:axis] + contributions.shape[axis + 1 :]
    return stacked(torch.sum, (contributions, axis), (contributions.square(), axis), shape)


def linear_weight_sums(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S]`` of a Linear's weight, with inputs ``[N, ..., in]``.

    Without extra dimensions each contribution is one product, ``x_i = g_i a_i^T``:
    ``T = G^T A`` and ``S = (G**2)^T (A**2)`` are two matrix products (no
    ``N x |W|`` tensor), exact to the bound with ``inner_terms = 1``. With extra
    dimensions (positions of a sequence), ``x_i = sum_l g_il a_il^T`` is formed
    for chunks of examples of at most :data:`CHUNK_BYTES`, and both sums taken
    from it.
    """
    if grad_output.dim() == 2:
        shape = (grad_output.shape[1], inputs.shape[1])
        return stacked(
            torch.mm, (grad_output.T, inputs), (grad_output.square().T, inputs.square()), shape
        )
    g, a = grad_output.flatten(1, -2), inputs.flatten(1, -2)  # [N, L, out], [N, L, in]
    per_example = g.shape[2] * a.shape[2] * inputs.element_size()
    size = max(1, CHUNK_BYTES // per_example)
    result = inputs.new_zeros(2, g.shape[2], a.shape[2])
    for start in range(0, g.shape[0], size):
        result += sums_of(torch.bmm(g[start : start + size].transpose(1, 2), a[start : start + size]))
    return result


class SumsFromContributionsMixin:
    """Turns a BackPACK ``SumGradSquared`` rule (an ``SGSBase``) into ``[T, S]`` of the
    contributions it forms: ``class Sums(SumsFromContributionsMixin, SGSRule)``."""

    def _make_param_function(self, param_str):
        def param_function(ext, module, g_inp, g_out, bp_quantities):
            contributions = self.derivatives.param_mjp(
                param_str, module, g_inp, g_out, g_out[0], sum_batch=False
            )
            return sums_of(contributions, self.N_axis)

        return param_function


class SumsLinear(SumsFromContributionsMixin, SGSBase):
    """``Linear``: weight by :func:`linear_weight_sums`, bias from its contributions."""

    def __init__(self):
        super().__init__(derivatives=LinearDerivatives(), params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        return linear_weight_sums(module.input0, g_out[0])


class SumsRNN(SumsFromContributionsMixin, SGSRNN):
    """``RNN``."""


class SumsLSTM(SumsFromContributionsMixin, SGSLSTM):
    """``LSTM``."""


class SumsBatchNormAnyMode(SumsFromContributionsMixin, SGSBatchNormAnyMode):
    """``BatchNorm1d/2d/3d``, in any mode (:mod:`.batchnorm`)."""


class SumsEmbeddingAnyDtype(SumsFromContributionsMixin, SGSEmbeddingAnyDtype):
    """``Embedding``, any dtype (:mod:`.embedding`)."""
