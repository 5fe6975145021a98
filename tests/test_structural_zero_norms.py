"""A bias whose every per-example gradient is zero by structure: its per-example norms and
its gradient noise scale are exactly 0, as its sums are (``extensions/sums.py``).

A layer's output centred over positions (``y - y.mean(positions)``) loses any constant
added to it, the bias: each example's bias gradient is a sum over positions that cancels
exactly, computed as rounding noise.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs import schema

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import ModelCase, build, run_step
from tests.helpers import rows

N = 5


class Centred(nn.Module):
    """``layer``'s output minus its mean over ``dims``, then a Linear head on all of it."""

    def __init__(self, layer, dims, features):
        super().__init__()
        self.layer, self.dims = layer, dims
        self.head = nn.Linear(features, 3)

    def forward(self, x):
        y = self.layer(x)
        return self.head(torch.tanh(y - y.mean(self.dims, keepdim=True)).flatten(1))


CASES = [
    ModelCase("linear-on-sequences", lambda: Centred(nn.Linear(4, 6), 1, 5 * 6),
              lambda n: torch.randn(n, 5, 4)),
    ModelCase("conv2d", lambda: Centred(nn.Conv2d(2, 3, 3, padding=1), (2, 3), 3 * 4 * 4),
              lambda n: torch.randn(n, 2, 4, 4)),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_norms_and_noise_scale_of_a_structurally_zero_bias_are_exactly_zero(case, reduction):
    problem = build(case, N, reduction)
    # What it guards against: autograd's per-example gradients of the bias are noise, not 0.
    losses = problem.per_example_loss(problem.model(problem.inputs), problem.targets)
    noise = torch.autograd.grad(losses[0], problem.model.layer.bias)[0]
    assert 0 < noise.abs().max() < 1e-15 * problem.model.layer.weight.abs().max()
    names = problem.names
    cockpit = run_step(problem, [cgn.PerExampleGradNorm(linear(1), param_names=names),
                                 cgn.GradientNoiseScale(linear(1), param_names=names)])
    norms = rows(cockpit, schema.PER_EXAMPLE_NORM)["layer.bias"]
    assert set(norms.values()) == {0.0}
    assert rows(cockpit, schema.PER_EXAMPLE_NORM)["layer.weight"]["max"] > 0
    noise_scale = rows(cockpit, schema.NOISE_SCALE)["layer.bias"]
    assert noise_scale[schema.GRAD_SQ] == noise_scale[schema.TRACE_COV] == 0.0
