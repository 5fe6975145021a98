"""The Step: one object per cockpit call, shared by its quantities, gone with the call."""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.step import Step

import pytest
import torch
from cockpit.context import CockpitCTX
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, run_step


class StepSpy(cgn.ParamGradRatio):
    """ParamGradRatio that remembers the Step it computed in."""

    seen = []

    def step_context(self, step, params):
        StepSpy.seen.append(step)
        return True


class OtherSpy(cgn.GradientVarianceQuantiles):
    seen = []

    def step_context(self, step, params):
        OtherSpy.seen.append(step)
        return super().step_context(step, params)


def test_the_quantities_of_one_call_share_one_step_and_the_next_call_gets_a_new_one():
    problem = build(MODELS[0], 4, "mean")
    StepSpy.seen, OtherSpy.seen = [], []
    quantities = [StepSpy(linear(1), param_names=problem.names),
                  OtherSpy(linear(1), param_names=problem.names)]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    for step in range(2):
        run_step(problem, quantities, step=step, cockpit=cockpit)
    assert StepSpy.seen[0] is OtherSpy.seen[0]
    assert StepSpy.seen[1] is OtherSpy.seen[1]
    assert StepSpy.seen[0] is not StepSpy.seen[1]
    assert [s.global_step for s in StepSpy.seen] == [0, 1]
    # Cockpit erases its storage of the call when the call ends: the Step with it.
    assert all(not isinstance(v, Step) for v in CockpitCTX.INFO.values())


def test_a_step_tested_for_finiteness_again_after_an_in_place_change():
    """Quantities of one step share the finiteness of a tensor (param.grad); a
    tensor changed in place since (its version moved) is tested again."""
    step = Step(0)
    grad = torch.ones(5)
    assert step.finite([grad]) and step.finite([grad])
    grad[2] = float("inf")
    assert not step.finite([grad])
    grad[2] = float("nan")
    assert not step.finite([grad])
    grad[2] = 1.0
    assert step.finite([grad])
    overflowing = torch.full((3,), 3e38)  # the sum overflows, every element is finite
    assert step.finite([overflowing])
    assert not step.finite([grad, torch.tensor([float("-inf")])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_device_paths_finiteness_is_isfinite_all(dtype, monkeypatch):
    """The paths of other devices (run on the CPU): one float64 sum per tensor and step,
    shared by the quantities, gives ``isfinite(t).all()`` for every tensor of the list,
    including the largest finite values (whose sum in their own dtype overflows)."""
    from cockpit_gradnoise import _device

    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    step = Step(0)
    largest = torch.finfo(dtype).max
    grad = torch.ones(5, dtype=dtype)
    big = torch.full((4,), largest, dtype=dtype)
    cases = [[grad], [big], [-big, big, grad], [torch.zeros(0, dtype=dtype)]]
    for value in [float("inf"), float("-inf"), float("nan")]:
        cases += [[torch.tensor([1.0, value], dtype=dtype)], [big, torch.tensor([value, -largest], dtype=dtype)]]
    for tensors in cases:
        expected = all(bool(torch.isfinite(t).all()) for t in tensors)
        for _ in range(2):  # the second answer from what the first computed
            answer = step.finite(tensors)
            assert isinstance(answer, torch.Tensor) and bool(answer) == expected, tensors
    grad[2] = float("nan")  # in place: its version moved, tested again
    assert not bool(step.finite([grad]))
    grad[2] = 1.0
    assert bool(step.finite([grad])) and bool(step.finite([big, grad]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_each_on_the_cpu_joins_small_tensors_and_answers_as_each_alone(dtype, monkeypatch):
    """On the CPU, ``finite_each`` checks the small tensors of each dtype together (one joined
    sum): every group's answer is ``isfinite(t).all()`` of its tensors, with NaN, inf and -inf
    among many finite small tensors, the largest finite values (whose joined sum overflows:
    each then checked alone, finite), integer and large tensors beside them, one group
    asked twice, and a tensor changed in place after its answer."""
    from cockpit_gradnoise import _device

    monkeypatch.setattr(_device, "on_host", lambda tensor: tensor.device.type == "cpu")
    largest = torch.finfo(dtype).max
    finite = [torch.randn(48, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(6)]
    big = torch.full((4,), largest, dtype=dtype)
    groups = [[finite[0], finite[1]], [finite[2], torch.tensor([1.0, float("nan")], dtype=dtype)],
              [finite[3], torch.tensor([float("inf")], dtype=dtype)], [big, big.clone()],
              [finite[4], torch.tensor([-float("inf"), 0.0], dtype=dtype)], [finite[5], torch.arange(3)],
              [torch.ones(1 << 15, dtype=dtype), finite[0]], [finite[0], finite[1]]]
    for _ in range(2):  # the second time from what the first remembered
        step = Step(0)
        answers = step.finite_each(groups)
        assert answers == [all(bool(torch.isfinite(t).all()) for t in group) for group in groups]
        assert answers == [True, False, False, True, False, True, True, True]
    finite[1][3] = float("nan")  # in place: its version moved, tested again
    assert step.finite_each(groups[:1]) == [False]


def test_batch_size_and_individual_losses_that_disagree_are_refused():
    problem = build(MODELS[0], 6, "mean")
    quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    info = {"batch_size": 5, "individual_losses": problem.per_example_loss(outputs, problem.targets),
            "loss": loss}
    with pytest.raises(ValueError, match=r"info\['batch_size'\] is 5 but info\['individual_losses'\] has 6"):
        with cockpit(0, info=info):
            loss.backward()


def test_names_are_found_by_identity_from_the_model_whatever_the_order_of_the_cockpit_params():
    problem = build(MODELS[2], 3, "sum")
    reordered = list(reversed(problem.params))
    by_model = cgn.ParamGradRatio(linear(1), param_names=problem.model)
    cockpit = cgn.Cockpit(reordered, quantities=[by_model])
    run_step(problem, [by_model], cockpit=cockpit)
    rows = cockpit.get_output()[0]["ParamGradRatio"]
    names = dict(problem.model.named_parameters())
    assert list(rows) == [n for p in reordered for n, q in names.items() if q is p] + ["all"]
    for name, param in names.items():
        expected = (param.detach().double().norm() / param.grad.double().norm()).item()
        # Both sides in float64 (u = 2**-53) from the same m elements, in other orders: a sum of
        # m squares is within (m + 1) u relative (Higham 2002, ch. 4), its root within half
        # that plus u, the quotient of two roots within (m + 1) u + 3 u; twice that apart.
        tolerance = 2 * (param.numel() + 4) * 2.0**-53
        assert rows[name]["norm_ratio"] == pytest.approx(expected, rel=tolerance, abs=0)


def test_a_cockpit_param_missing_from_the_model_is_named():
    problem = build(MODELS[0], 3, "sum")
    stranger = torch.nn.Parameter(torch.ones(2))
    stranger.grad = torch.ones(2)
    quantity = cgn.ParamGradRatio(linear(1), param_names=problem.model)
    with pytest.raises(ValueError, match=r"parameters \[%d\] \(by position\) are not in the model"
                       % len(problem.params)):
        run_step(problem, [quantity], cockpit=cgn.Cockpit(problem.params + [stranger], quantities=[quantity]))


def test_a_fact_of_the_step_is_warned_once_for_all_quantities():
    """Three quantities meet the same unused layer: one warning, not three, and not again."""
    case = next(c for c in MODELS if c.name == "unused-frozen")
    problem = build(case, 3, "mean")
    quantities = [cls(linear(1), param_names=problem.names) for cls in
                  (cgn.GradientVarianceQuantiles, cgn.PerExampleGradNorm, cgn.GradientNoiseScale)]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for step in range(3):
            run_step(problem, quantities, step=step, cockpit=cockpit)
    ours = [str(r.message) for r in records if "cockpit-gradnoise" in str(r.message)]
    assert len(ours) == 1 and "have no gradient" in ours[0], ours


def test_an_old_prepare_hook_is_refused_with_its_new_name():
    with pytest.raises(TypeError, match=r"prepare\(global_step, params\) is now step_context"):

        class Old(cgn.ParamGradRatio):
            def prepare(self, global_step, params):
                return True
