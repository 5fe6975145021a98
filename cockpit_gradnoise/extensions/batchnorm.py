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
from cockpit_gradnoise.extensions.normalization import scale_contributions, shift_contributions
from cockpit_gradnoise.extensions.sums import SumsFromContributionsMixin

import torch
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from backpack.extensions.firstorder.batch_l2_grad.batchnorm_nd import BatchL2BatchNorm
from backpack.extensions.firstorder.gradient.batchnorm_nd import GradBatchNormNd
from backpack.extensions.firstorder.sum_grad_squared.batchnorm_nd import SGSBatchNormNd
from torch import Tensor, nn

#: The layer cache's slot (:mod:`._layer_cache`) of a BatchNorm parameter's contributions, by name.
_CONTRIBUTIONS = "a BatchNorm parameter's per-example contributions"


class _SharedContributions(BatchNormNdDerivatives):
    """BackPACK's BatchNorm derivatives, whose per-example contributions of a layer's parameter
    (``param_mjp`` with ``sum_batch=False``) are formed once in a backward pass for every rule
    that reads them (the norms' and the sums': each normalized the input again, six ops, and
    multiplied it by the output gradient): served from the layer cache (:mod:`._layer_cache`)
    for these very tensors, unchanged (the layer, its input, the output gradient, and the
    contributions themselves: a reader that changed them in place is served fresh ones). The
    same tensor, so the same numbers."""

    def param_mjp(self, param_str, module, g_inp, g_out, mat, sum_batch=True, subsampling=None):
        if sum_batch or subsampling is not None:
            return super().param_mjp(param_str, module, g_inp, g_out, mat, sum_batch=sum_batch,
                                     subsampling=subsampling)
        cache, sources = facts.recording().layer_cache, (module, module.input0, mat)
        found = cache.get((_CONTRIBUTIONS, param_str), sources, module.training)
        if found is not None and found[0]._version == found[1]:
            return found[0]
        contributions = super().param_mjp(param_str, module, g_inp, g_out, mat, sum_batch=False)
        cache.put((_CONTRIBUTIONS, param_str), sources, (contributions, contributions._version), module.training)
        return contributions


class _AnyModeMixin:
    """Accepts training mode, recording it instead of raising; its contributions shared
    between the rules (:class:`_SharedContributions`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.derivatives = _SHARED

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out):
        if module.training:
            facts.recording().examples_interact = True


_SHARED = _SharedContributions()


class BatchL2BatchNormAnyMode(_AnyModeMixin, BatchL2BatchNorm):
    """Squared norms of each example's contribution to a BatchNorm's parameters."""


class SGSBatchNormAnyMode(_AnyModeMixin, SGSBatchNormNd):
    """Sum of squared contributions to a BatchNorm's parameters, in any mode."""


class GradBatchNormAnyMode(_AnyModeMixin, GradBatchNormNd):
    """The gradient of a BatchNorm's parameters, in any mode."""


class SumsBatchNormAnyMode(SumsFromContributionsMixin, SGSBatchNormAnyMode):
    """``[T, S]`` of a BatchNorm's parameters (``BatchNorm1d/2d/3d``), in any mode (:mod:`.sums`)."""


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm layer normalizes with the batch's statistics (as ``F.batch_norm`` decides)."""
    return module.training or module.running_mean is None


def normalized_as_batch_norm(module: nn.Module, input: Tensor) -> Tensor:
    """``x_hat``: ``input`` normalized per channel as the layer's forward does, in any mode.

    With the batch's mean and biased variance where :func:`uses_batch_statistics`
    (without updating the running statistics), else with the running ones.
    """
    dims = (0, *range(2, input.dim()))
    if uses_batch_statistics(module):
        var, mean = torch.var_mean(input, dim=dims, correction=0)
    else:
        mean, var = module.running_mean, module.running_var
    shape = (1, -1, *[1] * (input.dim() - 2))
    return (input - mean.reshape(shape)) * torch.rsqrt(var + module.eps).reshape(shape)


def batch_norm_act_contributions(module: nn.Module, input: Tensor, grad_output: Tensor,
                                 name: str) -> Tensor:
    """timm's ``BatchNormAct2d``: batch normalization, then its ``drop`` and ``act`` modules.

    The output gradient ``G`` BackPACK hands the layer is taken after ``act``;
    the BatchNorm contributions ``sum_p x_hat_ip G'_ip`` (weight) and
    ``sum_p G'_ip`` (bias) need ``G'``, the gradient at the normalization's
    output ``y = x_hat * w + b``: the vector-Jacobian product of
    ``act(drop(y))`` with ``G``, from their ``forward`` (not their hooks). Where
    ``drop`` is random (training, not ``nn.Identity``) ``G'`` cannot be
    recomputed: see :func:`batch_norm_act_applies`. In training mode these are
    each example's contributions through the batch, as for ``nn.BatchNorm2d``.
    """
    normalized = normalized_as_batch_norm(module, input)
    with torch.enable_grad():
        output = (normalized * module.weight.reshape(1, -1, 1, 1)
                  + module.bias.reshape(1, -1, 1, 1)).detach().requires_grad_(True)
        # clone: an in-place activation must not overwrite the tensor differentiated
        activated = module.act.forward(module.drop.forward(output.clone()))
        (grad_normalization,) = torch.autograd.grad(activated, output, grad_output)
    dims = tuple(range(2, input.dim()))
    if name == "bias":
        return shift_contributions(grad_normalization, dims)
    return scale_contributions(normalized, grad_normalization, dims)


def batch_norm_act_applies(module: nn.Module) -> bool:
    """Whether :func:`batch_norm_act_contributions` can compute: ``drop`` is not random now."""
    return isinstance(module.drop, nn.Identity) or not module.drop.training
