"""``SumsOfContributions`` against a per-example loop, in float64, on every layer family.

It saves ``[sum_i x_i, sum_i x_i**2]`` from one computation of the
contributions ``x_i``; here both are compared with the contributions of one
backward pass per example, on the models of ``tests/cases.py`` and on RNN and
LSTM layers, which no case there has. It must cover every parameter that
``PerExampleSquaredNorms`` covers.
"""

from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
)

import pytest
import torch
from backpack import backpack
from torch import nn

from tests.cases import MODELS, ModelCase, build, reference_gradients
from tests.helpers import RTOL


class Recurrent(nn.Module):
    """An RNN or LSTM (batch first, as BackPACK needs), then a Linear on its last step."""

    def __init__(self, layer):
        super().__init__()
        self.recurrent, self.out = layer(3, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.recurrent(x)[0][:, -1])


CASES = MODELS + [
    ModelCase("rnn", lambda: Recurrent(nn.RNN), lambda n: torch.randn(n, 5, 3)),
    ModelCase("lstm", lambda: Recurrent(nn.LSTM), lambda n: torch.randn(n, 5, 3)),
]


def assert_sums_match(total, squares, x, name):
    """``[T, S]`` against the contributions ``x``, in norm: element by element,
    each ``x_i`` rounds relative to the sum of its terms' magnitudes (over
    positions, which may cancel, as may ``T``'s terms over examples), which
    neither computation shows."""
    expected = x.pow(2).sum(0)
    assert (squares - expected).norm() <= RTOL * expected.norm(), name
    assert (total - x.sum(0)).norm() <= RTOL * x.abs().sum(0).norm(), name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_sums_match_per_example_loop(case, reduction):
    # A case's own first batch size (Llama's float32 norms: a power of two), else 5.
    n = case.batch_sizes[0] if case.batch_sizes else 5
    problem = build(case, n, reduction)
    model = problem.model  # prepared by build (cgn.prepare_model)
    loss = problem.loss_fn(model(problem.inputs), problem.targets)
    with backpack(SumsOfContributions(), PerExampleSquaredNorms()):
        loss.backward()
    grads = reference_gradients(case, problem)
    scale = 1.0 / n if reduction == "mean" else 1.0
    params = dict(model.named_parameters())
    covered = [name for name in grads if hasattr(params[name], SUMS_SAVEFIELD)]
    assert covered, "the case must exercise the extension"
    assert covered == [n for n in grads if hasattr(params[n], BATCH_L2_SAVEFIELD)]
    for name in covered:
        sums = getattr(params[name], SUMS_SAVEFIELD)
        # A third row, R, on convolution weights whose square is expanded over few
        # positions (resnet18's layer3; checked in test_convolution_extensions).
        expanded = len(sums) == 3
        assert sums.shape == (2 + expanded, *params[name].shape), name
        assert not expanded or name.endswith("weight"), name
        assert_sums_match(sums[0], sums[1], scale * grads[name], name)
