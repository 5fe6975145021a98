"""Users extend the package: a new per-layer quantity in a few lines."""

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references

import pytest
from backpack.extensions import BatchGrad
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, run_step


class SignDisagreement(cgn.ParameterQuantity):
    """Fraction of (example, element) pairs whose per-example gradient has the
    opposite sign of the batch gradient."""

    extension_classes = (BatchGrad,)

    def parameter_value(self, param, context):
        product = param.grad_batch * param.grad
        return (product < 0).sum().item(), product.numel()

    def network_value(self, values):
        return tuple(map(sum, zip(*values)))

    def statistics(self, value):
        return {"fraction": value[0] / value[1]}

    def statistic_names(self):
        return ["fraction"]


@pytest.mark.parametrize("case", [MODELS[0], MODELS[2]], ids=lambda c: c.name)
def test_custom_quantity_rows_in_frame(case):
    problem = build(case, 7, "sum")
    quantities = [
        SignDisagreement(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
    ]
    cockpit = run_step(problem, quantities)
    frame = cgn.to_frame(cockpit)
    rows = frame[frame.quantity == "SignDisagreement"].set_index("param").value
    grads = references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    counts = {}
    for name, g in grads.items():
        product = g * g.sum(0)
        counts[name] = ((product < 0).sum().item(), product.numel())
        assert rows[name] == pytest.approx(counts[name][0] / counts[name][1])
    total = [sum(c) for c in zip(*counts.values())]
    assert rows["all"] == pytest.approx(total[0] / total[1])
    assert 0 < rows["all"] < 1
