"""Convolution weights: per-example squared norms exact for any ``groups``, and the gradient.

BackPACK's ``BatchL2Grad`` contracts Gram matrices over output positions,
about ``L^2 (C_out + C_in k)`` operations per example for ``L`` output
positions; forming the layer's per-example gradients costs about
``L * weight.numel()``. For convolutions (not transposed) with ``groups == 1``
the cheaper one is used. BackPACK 1.7.1 is 40-65% wrong for grouped
convolutions (``groups > 1``, Conv and ConvTranspose), which therefore always
form the per-example gradients (memory: one layer's per-example gradients).

The gradient (:class:`~cockpit_gradnoise.extensions.LocalGradient`) comes from
torch's own convolution backward, as autograd computes it: BackPACK's costs
about four times as much on CPU (a 32-64 3x3 layer at 64x26x26: 90 ms against
25 ms).
"""

import torch
import torch.nn.functional as F
from backpack.extensions.firstorder.batch_l2_grad import convnd, convtransposend
from backpack.extensions.firstorder.gradient import (
    conv1d,
    conv2d,
    conv3d,
    convtranspose1d,
    convtranspose2d,
    convtranspose3d,
)
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


class _ConvGradientMixin:
    """The weight's gradient by ``aten.convolution_backward``, as autograd computes it."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        inputs, padding = module.input0, module.padding
        if isinstance(padding, str) or module.padding_mode != "zeros":
            # The input as the convolution saw it: "same" pads asymmetrically
            # for even kernels, other modes pad before a convolution without.
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            inputs = F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
            padding = (0,) * (module.weight.dim() - 2)
        transposed = isinstance(module, _TRANSPOSED)
        output_padding = module.output_padding if transposed else (0,) * (module.weight.dim() - 2)
        _, grad_weight, _ = torch.ops.aten.convolution_backward(
            g_out[0], inputs, module.weight, None, module.stride, padding,
            module.dilation, transposed, output_padding, module.groups, (False, True, False),
        )
        return grad_weight


class GradConv1dFast(_ConvGradientMixin, conv1d.GradConv1d):
    """``Conv1d``."""


class GradConv2dFast(_ConvGradientMixin, conv2d.GradConv2d):
    """``Conv2d``."""


class GradConv3dFast(_ConvGradientMixin, conv3d.GradConv3d):
    """``Conv3d``."""


class GradConvTranspose1dFast(_ConvGradientMixin, convtranspose1d.GradConvTranspose1d):
    """``ConvTranspose1d``."""


class GradConvTranspose2dFast(_ConvGradientMixin, convtranspose2d.GradConvTranspose2d):
    """``ConvTranspose2d``."""


class GradConvTranspose3dFast(_ConvGradientMixin, convtranspose3d.GradConvTranspose3d):
    """``ConvTranspose3d``."""
