"""Convolutions' module extensions: per-example norms, both sums and the gradient.

``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``, any ``groups``. The maths
(the factors of each example's contribution, the two exact methods and their
choice) is in :mod:`.conv_math` and :mod:`.cost_model`; here it is plugged into
BackPACK, one module extension per result.
"""

from typing import Callable

from cockpit_gradnoise.extensions import conv_math
from cockpit_gradnoise.extensions._squares import exact_where_lost, squared_norms_of
from cockpit_gradnoise.extensions.sums import position_sums, sums_of_position_sums

import torch
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.extensions.firstorder.gradient import (
    conv1d,
    conv2d,
    conv3d,
    convtranspose1d,
    convtranspose2d,
    convtranspose3d,
)


class _ConvolutionExtension(FirstOrderModuleExtension):
    """Weight and bias of ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``."""

    #: ``(module, inputs, grad_output) -> result`` for the weight.
    weight_result: Callable
    #: ``(module, output gradient [N, C_out, *positions]) -> result`` for the bias.
    bias_result: Callable

    def __init__(self):
        super().__init__(params=["bias", "weight"])

    #: What ``weight_result`` gives, as :func:`._squares.exact_where_lost` takes it.
    weight_kind: str

    def weight(self, ext, module, g_inp, g_out, backproped):
        # Formed again from float64 factors where a float32 layer's squares underflow.
        return exact_where_lost(lambda inputs, grad_output: type(self).weight_result(module, inputs, grad_output),
                                self.weight_kind, len(g_out[0]), module.weight.numel(), module.input0, g_out[0])

    def bias(self, ext, module, g_inp, g_out, backproped):
        return type(self).bias_result(module, g_out[0])


class SumsConv(_ConvolutionExtension):
    """``[sum_i x_i, sum_i x_i**2]`` of weight and bias (:mod:`.sums`)."""

    weight_result, weight_kind = staticmethod(conv_math.weight_sums), "s"
    # Sums over positions, with their structural zeros (e.g. before a BatchNorm).
    bias_result = staticmethod(
        lambda module, grad_output: sums_of_position_sums(grad_output.flatten(2), 2, (module, grad_output)))


class SquaredNormsConv(_ConvolutionExtension):
    """``||x_i||^2`` of weight and bias, ``[N]`` each."""

    weight_result, weight_kind = staticmethod(conv_math.weight_squared_norms), "n"
    # Structural zeros exactly 0, as in the sums.
    bias_result = staticmethod(
        lambda module, grad_output: squared_norms_of(position_sums(grad_output.flatten(2), 2, (module, grad_output)))
    )


# The gradient (LocalGradient, for distributed training) -------------------------


class _ConvGradientMixin:
    """The weight's gradient by ``aten.convolution_backward``, as autograd computes it."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        inputs, padding = module.input0, module.padding
        if isinstance(padding, str) or module.padding_mode != "zeros":
            # "same" pads asymmetrically for even kernels, other modes pad
            # before a convolution without padding.
            inputs = conv_math.padded_input(module, inputs)
            padding = (0,) * (module.weight.dim() - 2)
        transposed = isinstance(module, conv_math.TRANSPOSED)
        output_padding = module.output_padding if transposed else (0,) * (module.weight.dim() - 2)
        _, grad_weight, _ = torch.ops.aten.convolution_backward(
            # The weight's dtype as the inputs' (float32 for low-precision layers, .precision).
            g_out[0], inputs, module.weight.to(inputs.dtype), None, module.stride, padding,
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
