"""The BackPACK extensions the quantities request.

Three first-order extensions, built as BackPACK builds its own: an explicit
table from module class to module extension, and ``fail_mode`` passed to
BackPACK. Compared with BackPACK's ``BatchL2Grad`` and ``SumGradSquared``:

- their own savefields, so they never collide with (or get deleted by) the
  same extensions that Cockpit's own quantities request in one backward pass;
- unsupported layers are skipped silently (``FAIL_SILENT``: the quantities
  warn once, naming the parameters) instead of failing on every step;
- ``BatchNorm`` in training mode gives each example's contribution through
  the batch and records that examples interact (:mod:`.batchnorm`);
- ``Embedding`` works for any dtype (:mod:`.embedding`);
- convolution weights get exact per-example norms for any ``groups`` and the
  cheaper of two computations, and their gradient from torch's own
  convolution backward (:mod:`.convolution`);
- ``Linear`` weights on sequences (``[N, L, in]`` inputs) get per-example
  norms by the cheaper of Gram matrices and formation, and when
  :class:`SumsOfContributions` runs in the same backward pass, both results
  from one formation of the per-example gradients (:mod:`.linear`);
- ``LayerNorm``, ``GroupNorm`` and ``RMSNorm`` are supported
  (:mod:`.normalization`; :func:`register_extensions` gives BackPACK's own
  extensions, and so Cockpit's quantities, the same rows);
- :class:`SumsOfContributions` saves ``sum_i x_i`` with ``sum_i x_i**2``,
  both from one computation of the contributions (:mod:`.sums`), so that
  identical examples give a variance of exactly 0.

The fourth, :class:`LocalGradient`, is requested only under distributed
training, where ``param.grad`` is not this process's own gradient.

A new layer is supported by adding one row to a table below.
"""

from cockpit_gradnoise.extensions import (
    batchnorm,
    convolution,
    embedding,
    facts,
    linear,
    normalization,
    sums,
)
from cockpit_gradnoise.extensions.savefields import (  # noqa: F401 (the package's names)
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUM_GRAD_SQUARED_SAVEFIELD,
    SUMS_SAVEFIELD,
)

from backpack.extensions import BatchL2Grad, SumGradSquared
from backpack.extensions.backprop_extension import FAIL_SILENT
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.firstorder.batch_l2_grad import rnn as l2_rnn
from backpack.extensions.firstorder.gradient import linear as grad_linear
from backpack.extensions.firstorder.gradient import rnn as grad_rnn
from backpack.extensions.firstorder.sum_grad_squared import linear as sgs_linear
from backpack.extensions.firstorder.sum_grad_squared import rnn as sgs_rnn
from torch import nn

_CONVOLUTIONS = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d
)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _normalization_rows(extension_class):
    """LayerNorm, GroupNorm and RMSNorm rows of one BackPACK extension (:mod:`.normalization`)."""
    rows = normalization.NORMALIZATION_MODULE_EXTENSIONS[extension_class]
    return {module_class: module_extension() for module_class, module_extension in rows.items()}


def per_example_squared_norm_table():
    """Module class -> module extension computing ``||x_i||^2`` (``[N]``) per parameter."""
    return {
        nn.Linear: linear.SquaredNormsLinear(),
        nn.Conv1d: convolution.SquaredNormsConv(),
        nn.Conv2d: convolution.SquaredNormsConv(),
        nn.Conv3d: convolution.SquaredNormsConv(),
        nn.ConvTranspose1d: convolution.SquaredNormsConv(),
        nn.ConvTranspose2d: convolution.SquaredNormsConv(),
        nn.ConvTranspose3d: convolution.SquaredNormsConv(),
        nn.RNN: l2_rnn.BatchL2RNN(),
        nn.LSTM: l2_rnn.BatchL2LSTM(),
        nn.BatchNorm1d: batchnorm.BatchL2BatchNormAnyMode(),
        nn.BatchNorm2d: batchnorm.BatchL2BatchNormAnyMode(),
        nn.BatchNorm3d: batchnorm.BatchL2BatchNormAnyMode(),
        nn.Embedding: embedding.BatchL2EmbeddingAnyDtype(),
        **_normalization_rows(BatchL2Grad),
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
        nn.BatchNorm1d: batchnorm.SGSBatchNormAnyMode(),
        nn.BatchNorm2d: batchnorm.SGSBatchNormAnyMode(),
        nn.BatchNorm3d: batchnorm.SGSBatchNormAnyMode(),
        nn.Embedding: embedding.SGSEmbeddingAnyDtype(),
        **_normalization_rows(SumGradSquared),
    }


def sums_table():
    """Module class -> module extension computing ``[sum_i x_i, sum_i x_i**2]`` (:mod:`.sums`)."""
    return {
        nn.Linear: linear.SumsLinear(),
        **dict.fromkeys(_CONVOLUTIONS, convolution.SumsConv()),
        nn.RNN: sums.SumsRNN(),
        nn.LSTM: sums.SumsLSTM(),
        **dict.fromkeys(_BATCH_NORMS, sums.SumsBatchNormAnyMode()),
        nn.Embedding: sums.SumsEmbeddingAnyDtype(),
        **{module: ext() for module, ext in normalization.SUMS_MODULE_EXTENSIONS.items()},
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
        nn.BatchNorm1d: batchnorm.GradBatchNormAnyMode(),
        nn.BatchNorm2d: batchnorm.GradBatchNormAnyMode(),
        nn.BatchNorm3d: batchnorm.GradBatchNormAnyMode(),
        nn.Embedding: embedding.GradEmbeddingAnyDtype(),
        **{module: ext() for module, ext in normalization.GRADIENT_MODULE_EXTENSIONS.items()},
    }


class _RecordingExtension(FirstOrderBackpropExtension):
    """Records which parameters it wrote on, and from which layers (:mod:`.facts`)."""

    def __call__(self, module, g_inp, g_out):
        super().__call__(module, g_inp, g_out)
        facts.recording().record(self, module, g_out)


class PerExampleSquaredNorms(_RecordingExtension):
    """``||x_i||^2`` per example and parameter, saved as ``param.cgn_batch_l2`` (``[N]``)."""

    def __init__(self):
        super().__init__(
            savefield=BATCH_L2_SAVEFIELD,
            module_exts=per_example_squared_norm_table(),
            fail_mode=FAIL_SILENT,
        )


class SumOfSquaredContributions(_RecordingExtension):
    """``sum_i x_i**2`` per element, saved as ``param.cgn_sum_grad_squared``."""

    def __init__(self):
        super().__init__(
            savefield=SUM_GRAD_SQUARED_SAVEFIELD,
            module_exts=sum_of_squares_table(),
            fail_mode=FAIL_SILENT,
        )


class SumsOfContributions(_RecordingExtension):
    """``[sum_i x_i, sum_i x_i**2]`` per element, saved as ``param.cgn_sums_of_contributions``.

    Shape ``[2, *param.shape]``. Both sums come from one computation of the
    contributions ``x_i`` (:mod:`.sums`), so that identical examples give a
    variance of exactly 0; ``sum_i x_i`` is this backward pass's own gradient
    on this process, also under distributed training.
    """

    def __init__(self):
        super().__init__(
            savefield=SUMS_SAVEFIELD,
            module_exts=sums_table(),
            fail_mode=FAIL_SILENT,
        )


class LocalGradient(_RecordingExtension):
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


def register_extensions() -> None:
    """Give BackPACK's own first-order extensions this package's layer support.

    After this call, every ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``
    and ``Variance`` constructed (by you, by Cockpit's own quantities) supports
    ``LayerNorm``, ``GroupNorm`` and ``RMSNorm``, so Cockpit's quantities stop
    failing on models with these layers. Importing the package changes nothing
    in BackPACK; only this call does. Undo it with :func:`unregister_extensions`.
    This package's own quantities do not need it.
    """
    normalization.register_normalization_extensions_globally()


def unregister_extensions() -> None:
    """Undo :func:`register_extensions` for extensions constructed from now on."""
    normalization.unregister_normalization_extensions_globally()
