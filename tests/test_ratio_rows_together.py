"""ParamGradRatio's norm ratios and zero fractions of a step's parameters as vectors.

On other devices than the CPU (issue 32: each a handful of 0-dim launches per parameter
before): the same square roots, divisions and comparisons on the same numbers, each correctly
rounded (IEEE 754), so the same rows bit for bit, whatever the kernels.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device
from cockpit_gradnoise.logs.schema import ZERO_GRAD_FRACTION
from cockpit_gradnoise.quantities import param_grad_ratio

import pytest
import torch
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, run_step
from tests.test_values_of_many import launches_of

_CASES = [case for case in MODELS if case.name in ("mlp", "cnn", "embedding", "unused-frozen", "layernorm-sequence")]


def _rows(case, dtype, together: bool, monkeypatch, zero_inputs=False):
    """ParamGradRatio's output of one step of ``case`` (batch 3) on the paths of other devices."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    if not together:
        monkeypatch.setattr(param_grad_ratio, "_on_one_device", lambda values: False)
    problem = build(case, 3, "mean", dtype=dtype)
    if zero_inputs and problem.inputs.is_floating_point():
        problem.inputs = problem.inputs * 0  # first layer's weight gradients all 0: inf ratio, fraction 1
    quantity = cgn.ParamGradRatio(linear(1), param_names=problem.names)
    run_step(problem, [quantity])
    monkeypatch.undo()
    return quantity.output[0]


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("case", _CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("zero_inputs", [False, True])
def test_rows_together_are_each_parameters_own(case, dtype, zero_inputs, monkeypatch):
    together = _rows(case, dtype, True, monkeypatch, zero_inputs)
    alone = _rows(case, dtype, False, monkeypatch, zero_inputs)
    assert together.keys() == alone.keys() and len(together) > 1
    for name, row in together.items():
        assert row.keys() == alone[name].keys()
        assert all(_same(row[k], alone[name][k]) for k in row), (name, row, alone[name])
    if zero_inputs and case.name in ("mlp", "cnn"):
        assert together["0.weight"][ZERO_GRAD_FRACTION] == 1.0


def test_the_rows_take_fewer_launches_per_parameter(monkeypatch):
    """The rows' share no longer grows by seven launches a parameter."""
    quantity = cgn.ParamGradRatio
    grown = launches_of(quantity, 12, monkeypatch) - launches_of(quantity, 2, monkeypatch)
    monkeypatch.setattr(param_grad_ratio, "_on_one_device", lambda values: False)
    grown_alone = launches_of(quantity, 12, monkeypatch) - launches_of(quantity, 2, monkeypatch)
    assert grown_alone - grown >= 6 * 20, (grown, grown_alone)  # 20 more parameters
