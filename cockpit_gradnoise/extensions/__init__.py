"""The BackPACK extensions the quantities request.

Two first-order extensions, built as BackPACK builds its own: an explicit
table from module class to module extension, and ``fail_mode`` passed to
BackPACK. Compared with BackPACK's ``BatchL2Grad`` and ``SumGradSquared``:

- their own savefields, so they never collide with (or get deleted by) the
  same extensions that Cockpit's own quantities request in one backward pass;
- unsupported layers are skipped silently (``FAIL_SILENT``: the quantities
  warn once, naming the parameters) instead of failing on every step;
- ``Embedding`` works for any dtype (:mod:`.embedding`);
- convolution weights get exact per-example norms for any ``groups`` and the
  cheaper of two computations (:mod:`.convolution`).

A new layer is supported by adding one row to a table below.
"""

from backpack.extensions.backprop_extension import FAIL_SILENT
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.firstorder.batch_l2_grad import batchnorm_nd as l2_batchnorm
from backpack.extensions.firstorder.batch_l2_grad import linear as l2_linear
from backpack.extensions.firstorder.batch_l2_grad import rnn as l2_rnn
from backpack.extensions.firstorder.sum_grad_squared import (
    batchnorm_nd as sgs_batchnorm,
)
from backpack.extensions.firstorder.sum_grad_squared import linear as sgs_linear
from backpack.extensions.firstorder.sum_grad_squared import rnn as sgs_rnn
from torch import nn

from cockpit_gradnoise.extensions import convolution, embedding

BATCH_L2_SAVEFIELD = "cgn_batch_l2"
SUM_GRAD_SQUARED_SAVEFIELD = "cgn_sum_grad_squared"


def per_example_squared_norm_table():
    """Module class -> module extension computing ``||x_i||^2`` (``[N]``) per parameter."""
    return {
        nn.Linear: l2_linear.BatchL2Linear(),
        nn.Conv1d: convolution.SquaredNormsConv(),
        nn.Conv2d: convolution.SquaredNormsConv(),
        nn.Conv3d: convolution.SquaredNormsConv(),
        nn.ConvTranspose1d: convolution.SquaredNormsConv(),
        nn.ConvTranspose2d: convolution.SquaredNormsConv(),
        nn.ConvTranspose3d: convolution.SquaredNormsConv(),
        nn.RNN: l2_rnn.BatchL2RNN(),
        nn.LSTM: l2_rnn.BatchL2LSTM(),
        nn.BatchNorm1d: l2_batchnorm.BatchL2BatchNorm(),
        nn.BatchNorm2d: l2_batchnorm.BatchL2BatchNorm(),
        nn.BatchNorm3d: l2_batchnorm.BatchL2BatchNorm(),
        nn.Embedding: embedding.BatchL2EmbeddingAnyDtype(),
    }


def sum_of_squares_table():
    """Module class -> module extension computing ``sum_i x_i**2`` per parameter."""
    return {
        nn.Linear: sgs_linear.SGSLinear(),
        nn.Conv1d: convolution.SumOfSquaresConv(),
        nn.Conv2d: convolution.SumOfSquaresConv(),
        nn.Conv3d: convolution.SumOfSquaresConv(),
        nn.ConvTranspose1d: convolution.SumOfSquaresConv(),
        nn.ConvTranspose2d: convolution.SumOfSquaresConv(),
        nn.ConvTranspose3d: convolution.SumOfSquaresConv(),
        nn.RNN: sgs_rnn.SGSRNN(),
        nn.LSTM: sgs_rnn.SGSLSTM(),
        nn.BatchNorm1d: sgs_batchnorm.SGSBatchNormNd(),
        nn.BatchNorm2d: sgs_batchnorm.SGSBatchNormNd(),
        nn.BatchNorm3d: sgs_batchnorm.SGSBatchNormNd(),
        nn.Embedding: embedding.SGSEmbeddingAnyDtype(),
    }


class PerExampleSquaredNorms(FirstOrderBackpropExtension):
    """``||x_i||^2`` per example and parameter, saved as ``param.cgn_batch_l2`` (``[N]``)."""

    def __init__(self):
        super().__init__(
            savefield=BATCH_L2_SAVEFIELD,
            module_exts=per_example_squared_norm_table(),
            fail_mode=FAIL_SILENT,
        )


class SumOfSquaredContributions(FirstOrderBackpropExtension):
    """``sum_i x_i**2`` per element, saved as ``param.cgn_sum_grad_squared``."""

    def __init__(self):
        super().__init__(
            savefield=SUM_GRAD_SQUARED_SAVEFIELD,
            module_exts=sum_of_squares_table(),
            fail_mode=FAIL_SILENT,
        )
