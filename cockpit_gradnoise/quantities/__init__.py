"""Cockpit quantities of this package, one per file."""

from cockpit_gradnoise.quantities._base import NETWORK, ParameterQuantity
from cockpit_gradnoise.quantities.gradient_variance import GradientVarianceQuantiles
from cockpit_gradnoise.quantities.per_example_grad_norm import PerExampleGradNorm

__all__ = [
    "NETWORK",
    "ParameterQuantity",
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
]
