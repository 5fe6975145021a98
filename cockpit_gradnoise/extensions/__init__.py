"""The BackPACK extensions the quantities request.

Three first-order extensions, built as BackPACK builds its own: an explicit
table from module class to module extension, and ``fail_mode`` passed to
BackPACK. Compared with BackPACK's ``BatchL2Grad`` and ``SumGradSquared``:

- their own savefields, so they never collide with (or get deleted by) the
  same extensions that Cockpit's own quantities request in one backward pass;
- unsupported layers are skipped silently (``FAIL_SILENT``: the quantities
  warn once, naming the parameters) instead of failing on every step;
- ``Embedding`` works for any dtype (:mod:`.embedding`);
- convolution weights get exact per-example norms for any ``groups`` and the
  cheaper of two computations, and their gradient from torch's own
  convolution backward (:mod:`.convolution`).

The third, :class:`LocalGradient`, is requested only under distributed
training, where ``param.grad`` is not this process's own gradient.

A new layer is supported by adding one row to a table below.
"""

from backpack.extensions.backprop_extension import FAIL_SILENT
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.firstorder.batch_l2_grad import batchnorm_nd as l2_batchnorm
from backpack.extensions.firstorder.batch_l2_grad import linear as l2_linear
from backpack.extensions.firstorder.batch_l2_grad import rnn as l2_rnn
from backpack.extensions.firstorder.gradient import batchnorm_nd as grad_batchnorm
from backpack.extensions.firstorder.gradient import linear as grad_linear
from backpack.extensions.firstorder.gradient import rnn as grad_rnn
from backpack.extensions.firstorder.sum_grad_squared import (
    batchnorm_nd as sgs_batchnorm,
)
from backpack.extensions.firstorder.sum_grad_squared import (
    conv1d,
    conv2d,
    conv3d,
    convtranspose1d,
    convtranspose2d,
    convtranspose3d,
)
from backpack.extensions.firstorder.sum_grad_squared import linear as sgs_linear
from backpack.extensions.firstorder.sum_grad_squared import rnn as sgs_rnn
from torch import nn

from cockpit_gradnoise.extensions import convolution, embedding

BATCH_L2_SAVEFIELD = "cgn_batch_l2"
SUM_GRAD_SQUARED_SAVEFIELD = "cgn_sum_grad_squared"
LOCAL_GRADIENT_SAVEFIELD = "cgn_local_grad"


def per_example_squared_norm_table():
    """Module class -> module extension computing ``||x_i||^2`` (``[N]``) per parameter."""
    return {
        nn.Linear: l2_linear.BatchL2Linear(),
        nn.Conv1d: convolution.BatchL2Conv1dExact(),
        nn.Conv2d: convolution.BatchL2Conv2dExact(),
        nn.Conv3d: convolution.BatchL2Conv3dExact(),
        nn.ConvTranspose1d: convolution.BatchL2ConvTranspose1dExact(),
        nn.ConvTranspose2d: convolution.BatchL2ConvTranspose2dExact(),
        nn.ConvTranspose3d: convolution.BatchL2ConvTranspose3dExact(),
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
        nn.Conv1d: conv1d.SGSConv1d(),
        nn.Conv2d: conv2d.SGSConv2d(),
        nn.Conv3d: conv3d.SGSConv3d(),
        nn.ConvTranspose1d: convtranspose1d.SGSConvTranspose1d(),
        nn.ConvTranspose2d: convtranspose2d.SGSConvTranspose2d(),
        nn.ConvTranspose3d: convtranspose3d.SGSConvTranspose3d(),
        nn.RNN: sgs_rnn.SGSRNN(),
        nn.LSTM: sgs_rnn.SGSLSTM(),
        nn.BatchNorm1d: sgs_batchnorm.SGSBatchNormNd(),
        nn.BatchNorm2d: sgs_batchnorm.SGSBatchNormNd(),
        nn.BatchNorm3d: sgs_batchnorm.SGSBatchNormNd(),
        nn.Embedding: embedding.SGSEmbeddingAnyDtype(),
    }


def local_gradient_table():
    """Module class -> module extension computing ``sum_i x_i`` (the gradient) per parameter."""
    return {
        nn.Linear: grad_linear.GradLinear(),
        nn.Conv1d: convolution.GradConv1dFast(),
        nn.Conv2d: convolution.GradConv2dFast(),
        nn.Conv3d: convolution.GradConv3dFast(),
        nn.ConvTranspose1d: convolution.GradConvTranspose1dFast(),
        nn.ConvTranspose2d: convolution.GradConvTranspose2dFast(),
        nn.ConvTranspose3d: convolution.GradConvTranspose3dFast(),
        nn.RNN: grad_rnn.GradRNN(),
        nn.LSTM: grad_rnn.GradLSTM(),
        nn.BatchNorm1d: grad_batchnorm.GradBatchNormNd(),
        nn.BatchNorm2d: grad_batchnorm.GradBatchNormNd(),
        nn.BatchNorm3d: grad_batchnorm.GradBatchNormNd(),
        nn.Embedding: embedding.GradEmbeddingAnyDtype(),
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


class LocalGradient(FirstOrderBackpropExtension):
    """``sum_i x_i`` of this backward pass on this process, saved as ``param.cgn_local_grad``.

    What ``param.grad`` holds on one process. Under DistributedDataParallel
    ``param.grad`` is averaged across processes (and inside ``no_sync()`` it
    accumulates micro-batches), so the quantities that need this process's
    own gradient request it there (one more weight-gradient product per layer).
    """

    def __init__(self):
        super().__init__(
            savefield=LOCAL_GRADIENT_SAVEFIELD,
            module_exts=local_gradient_table(),
            fail_mode=FAIL_SILENT,
        )
