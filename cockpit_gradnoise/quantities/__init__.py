"""Cockpit quantities of this package, one per file."""

from cockpit_gradnoise.quantities._base import ParameterQuantity
from cockpit_gradnoise.quantities._two_step import TwoStepParameterQuantity
from cockpit_gradnoise.quantities.gradient_noise_scale import GradientNoiseScale
from cockpit_gradnoise.quantities.gradient_variance import GradientVarianceQuantiles
from cockpit_gradnoise.quantities.param_grad_ratio import ParamGradRatio
from cockpit_gradnoise.quantities.per_example_grad_norm import PerExampleGradNorm
from cockpit_gradnoise.quantities.preconditioned_noise_scale import PreconditionedNoiseScale
from cockpit_gradnoise.quantities.two_batch import TwoBatchNoiseScale
from cockpit_gradnoise.quantities.update_size import UpdateSize
from cockpit_gradnoise.step import Batch, Step

__all__ = [
    "Batch",
    "ParameterQuantity",
    "TwoStepParameterQuantity",
    "Step",
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "ParamGradRatio",
    "UpdateSize",
    "GradientNoiseScale",
    "TwoBatchNoiseScale",
    "PreconditionedNoiseScale",
]
