"""A BatchNorm layer's per-example contributions formed once for the rules that read them.

The per-example squared norms' rule and the per-element sums' rule (every quantity
tracked) each normalized the layer's input again and multiplied it by the output
gradient (``extensions/batchnorm.py``, issue 32: on a GPU each op is a launch); the
second now reads the first's tensor from the layer cache: the same numbers, bit for bit.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import batchnorm

import pytest
import torch
from backpack.core.derivatives.batchnorm_nd import BatchNormNdDerivatives
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import ModelCase, build, run_step
from tests.helpers import rows

QUANTITIES = ["GradientVarianceQuantiles", "PerExampleGradNorm", "ParamGradRatio", "GradientNoiseScale"]


def _net():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))


def _tracked(training, dtype):
    """Rows of every quantity of one tracked step, and the times the layers' input was normalized."""
    problem = build(ModelCase("batchnorm", _net, lambda n: torch.randn(n, 2, 4, 4)), 6, "mean", dtype=dtype)
    problem.model.train(training)
    normalized = []
    original = BatchNormNdDerivatives._get_normalized_input_and_var

    def counted(self, module):
        normalized.append(module)
        return original(self, module)

    BatchNormNdDerivatives._get_normalized_input_and_var = counted
    try:
        cockpit = run_step(problem, [getattr(cgn, q)(linear(1), param_names=problem.names) for q in QUANTITIES])
    finally:
        BatchNormNdDerivatives._get_normalized_input_and_var = original
    return {q: rows(cockpit, q) for q in QUANTITIES}, normalized


@pytest.mark.filterwarnings("ignore:a BatchNorm layer is in training mode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_the_contributions_are_formed_once_per_layer_with_the_same_numbers(training, dtype, monkeypatch):
    shared, normalized = _tracked(training, dtype)
    # Each layer's weight once, for both rules (the bias's contributions need no normalized input).
    assert len(normalized) == 2
    with monkeypatch.context() as patch:  # every rule forms its own, as before
        patch.setattr(batchnorm._SharedContributions, "param_mjp", BatchNormNdDerivatives.param_mjp)
        alone, normalized_alone = _tracked(training, dtype)
    assert len(normalized_alone) == 4
    assert shared == alone
