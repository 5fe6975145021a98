"""cockpit-gradnoise: is my batch too noisy for my learning rate, layer by layer?

Importing this package first makes ``import cockpit`` work on setuptools >= 82.
"""

from cockpit_gradnoise._compat import import_cockpit

_cockpit = import_cockpit()
Cockpit = _cockpit.Cockpit
CockpitPlotter = _cockpit.CockpitPlotter

from cockpit_gradnoise import functional, references  # noqa: E402
from cockpit_gradnoise.frame import read_log, to_frame, write_log  # noqa: E402
from cockpit_gradnoise import panels, report  # noqa: E402
from cockpit_gradnoise.dashboard import plot  # noqa: E402
from cockpit_gradnoise.minibatch import dataset_gradient, minibatch_gradient_stats  # noqa: E402
from cockpit_gradnoise.quantities import (  # noqa: E402
    NETWORK,
    GradientNoiseScale,
    GradientVarianceQuantiles,
    ParameterQuantity,
    ParamGradRatio,
    PerExampleGradNorm,
    UpdateSize,
)

__all__ = [
    "Cockpit",
    "CockpitPlotter",
    "functional",
    "references",
    "read_log",
    "to_frame",
    "write_log",
    "plot",
    "panels",
    "report",
    "minibatch_gradient_stats",
    "dataset_gradient",
    "NETWORK",
    "ParameterQuantity",
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "ParamGradRatio",
    "UpdateSize",
    "GradientNoiseScale",
]
