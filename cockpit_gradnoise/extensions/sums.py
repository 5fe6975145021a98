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
Linear layers are in :mod:`.linear`, convolutions in :mod:`.convolution`.
"""

from cockpit_gradnoise.extensions.batchnorm import SGSBatchNormAnyMode
from cockpit_gradnoise.extensions.embedding import SGSEmbeddingAnyDtype

import torch
from backpack.extensions.firstorder.sum_grad_squared.rnn import SGSLSTM, SGSRNN
from torch import Tensor


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


class SumsRNN(SumsFromContributionsMixin, SGSRNN):
    """``RNN``."""


class SumsLSTM(SumsFromContributionsMixin, SGSLSTM):
    """``LSTM``."""


class SumsBatchNormAnyMode(SumsFromContributionsMixin, SGSBatchNormAnyMode):
    """``BatchNorm1d/2d/3d``, in any mode (:mod:`.batchnorm`)."""


class SumsEmbeddingAnyDtype(SumsFromContributionsMixin, SGSEmbeddingAnyDtype):
    """``Embedding``, any dtype (:mod:`.embedding`)."""
