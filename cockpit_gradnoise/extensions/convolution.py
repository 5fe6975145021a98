"""Convolutions' module extensions: per-example norms, both sums and the gradient.

``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``, any ``groups``. The maths
(the factors of each example's contribution, the two exact methods and their
choice) is in :mod:`.conv_math` and :mod:`.cost_model`; here it is plugged into
BackPACK, one module extension per result. Where ``SumsOfContributions`` and
``PerExampleSquaredNorms`` both run and the sums form ``x_i``, the weight's two
results come from one formation (:func:`shares_formation`), as a sequence
Linear's do (:mod:`.linear`).
"""

from typing import Callable

from cockpit_gradnoise.extensions import conv_math, cost_model, facts
from cockpit_gradnoise.extensions._squares import exact_where_lost, squared_norms_of
from cockpit_gradnoise.extensions.linear import is_active
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD
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
        if shares_formation(module, g_out[0]):
            sums, norms = _sums_and_norms(module, g_out[0])
            return sums if self.weight_kind == "s" else norms
        return _exact(type(self).weight_result, self.weight_kind, module, g_out[0])

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


# Sharing one formation between the two extensions, within one layer's hook ----------

#: The layer cache's slot (:mod:`._layer_cache`) of a convolution's ``([T, S], ||x_i||^2)``.
_SUMS_AND_NORMS = "convolution weight sums and squared norms"


def shares_formation(module, grad_output) -> bool:
    """Whether both weight results of a convolution come from one formation of ``x_i``
    (:func:`.conv_math.weight_sums_and_squared_norms`): ``SumsOfContributions`` and
    ``PerExampleSquaredNorms`` both run in this backward pass, and the sums form
    ``x_i`` (:func:`.conv_math.forms` with :func:`.cost_model.expansion_cost`). The norms
    then come from the formed ``x_i`` (one more read of its squares) instead of a second
    formation or the Gram matrices: on resnet18 (batch 64) 38 ms of a step were its
    norms computed apart (``benchmarks/README.md``, "The noise scale Adam sees")."""
    if not (is_active(SUMS_SAVEFIELD) and is_active(BATCH_L2_SAVEFIELD)):
        return False
    _, c_b, c_a, positions = conv_math.layer_shape(module, module.input0, grad_output)
    return conv_math.forms(module, cost_model.expansion_cost, c_b, c_a, positions)


def _sums_and_norms(module, grad_output):
    """``([T, S], ||x_i||^2)`` of the weight: formed by whichever extension reaches the layer
    first, taken from the backward pass's layer cache by the second."""
    sources = (module, module.input0, grad_output)
    both = facts.recording().layer_cache.take(_SUMS_AND_NORMS, sources)
    if both is None:
        both = _exact(conv_math.weight_sums_and_squared_norms, "sn", module, grad_output)
        facts.recording().layer_cache.put(_SUMS_AND_NORMS, sources, both)
    return both


def _exact(compute, kinds: str, module, grad_output):
    """``compute(module, inputs, grad_output)`` of the weight, formed again from float64 factors
    where a float32 layer's squares underflow (:func:`._squares.exact_where_lost`)."""
    return exact_where_lost(lambda inputs, g: compute(module, inputs, g), kinds, len(grad_output),
                            module.weight.numel(), module.input0, grad_output)


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
