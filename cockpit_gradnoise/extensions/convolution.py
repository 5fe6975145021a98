"""Per-example squared norms of convolution weights, exact for any ``groups``.

BackPACK's ``BatchL2Grad`` contracts Gram matrices over output positions,
about ``L^2 (C_out + C_in k)`` operations per example for ``L`` output
positions; forming the layer's per-example gradients costs about
``L * weight.numel()``. For convolutions (not transposed) with ``groups == 1``
the cheaper one is used. BackPACK 1.7.1 is 40-65% wrong for grouped
convolutions (``groups > 1``, Conv and ConvTranspose), which therefore always
form the per-example gradients (memory: one layer's per-example gradients).
"""

from backpack.extensions.firstorder.batch_l2_grad import convnd, convtransposend
from torch import nn

_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class _ConvWeightNormsMixin:
    """Chooses, per layer, between BackPACK's Gram contraction and direct formation."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        if module.groups == 1 and not direct_is_cheaper(module, g_out[0]):
            return super().weight(ext, module, g_inp, g_out, backproped)
        per_example = self.derivatives.param_mjp(
            "weight", module, g_inp, g_out, g_out[0], sum_batch=False
        )
        return per_example.pow(2).flatten(start_dim=1).sum(1)


def direct_is_cheaper(module: nn.Module, grad_output) -> bool:
    """Whether forming per-example weight gradients costs less than Gram matrices."""
    if isinstance(module, _TRANSPOSED):
        return False
    positions = grad_output[0, 0].numel()
    c_out = module.weight.shape[0]
    return module.weight.numel() < positions * (c_out + module.weight[0].numel())


class BatchL2Conv1dExact(_ConvWeightNormsMixin, convnd.BatchL2Conv1d):
    """``Conv1d``."""


class BatchL2Conv2dExact(_ConvWeightNormsMixin, convnd.BatchL2Conv2d):
    """``Conv2d``."""


class BatchL2Conv3dExact(_ConvWeightNormsMixin, convnd.BatchL2Conv3d):
    """``Conv3d``."""


class BatchL2ConvTranspose1dExact(_ConvWeightNormsMixin, convtransposend.BatchL2ConvTranspose1d):
    """``ConvTranspose1d``."""


class BatchL2ConvTranspose2dExact(_ConvWeightNormsMixin, convtransposend.BatchL2ConvTranspose2d):
    """``ConvTranspose2d``."""


class BatchL2ConvTranspose3dExact(_ConvWeightNormsMixin, convtransposend.BatchL2ConvTranspose3d):
    """``ConvTranspose3d``."""
