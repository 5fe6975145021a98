"""``BatchNorm`` in training mode: each example's contribution through the batch.

In training mode a BatchNorm layer normalizes with the batch's own mean and
variance, so examples interact and there are no independent per-example
gradients. What stays well defined is each example's contribution ``x_i`` to
``param.grad``, backpropagated through the batch (``sum_i x_i = param.grad``):
for a BatchNorm weight ``sum over positions of (grad_output_i * x_hat_i)``
with ``x_hat`` normalized by the batch statistics, and for every other layer its
usual per-example formula applied to the output gradient of the whole batch's
loss. BackPACK computes exactly these once its training-mode check is off.

The module extensions below turn the check off and record in
:func:`~cockpit_gradnoise.extensions.facts.recording` that a layer in
training mode was met, so that the quantities can say so.
"""

from cockpit_gradnoise.extensions import facts

from backpack.extensions.firstorder.batch_l2_grad.batchnorm_nd import BatchL2BatchNorm
from backpack.extensions.firstorder.gradient.batchnorm_nd import GradBatchNormNd
from backpack.extensions.firstorder.sum_grad_squared.batchnorm_nd import SGSBatchNormNd


class _AnyModeMixin:
    """Accepts training mode, recording it instead of raising."""

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):
        if module.training:
            facts.recording().examples_interact = True


class BatchL2BatchNormAnyMode(_AnyModeMixin, BatchL2BatchNorm):
    """Squared norms of each example's contribution to a BatchNorm's parameters."""


class SGSBatchNormAnyMode(_AnyModeMixin, SGSBatchNormNd):
    """Sum of squared contributions to a BatchNorm's parameters, in any mode."""


class GradBatchNormAnyMode(_AnyModeMixin, GradBatchNormNd):
    """The gradient of a BatchNorm's parameters, in any mode."""
