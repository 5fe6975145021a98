"""Bad input at the call: refused with the key and the fix, or a defined result and one warning.

What a cockpit call is handed (``info["batch_size"]``, ``info["individual_losses"]``,
the step) and what changed in the model between calls (a module replaced, a
parameter frozen): never a silently wrong or lost record.
"""

import copy
import math
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.tracking import Tracker

import numpy as np
import pytest
import torch
from backpack import extend
from cockpit.context import CockpitCTX
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, build

SUMS = (cgn.GradientVarianceQuantiles, cgn.PerExampleGradNorm, cgn.GradientNoiseScale)
ALL = (*SUMS, cgn.ParamGradRatio, cgn.UpdateSize)
SUMS_NAMES = [cls.__name__ for cls in SUMS]


def ours(records):
    return [str(r.message) for r in records if "cockpit-gradnoise" in str(r.message)]


def quantities(problem, classes=ALL):
    return [cls(linear(1), param_names=problem.model) for cls in classes]


def call(problem, cockpit, step, **changes):
    """One tracked backward pass with ``info`` changed by ``changes`` (None removes a key)."""
    problem.model.zero_grad()
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    info = {"batch_size": len(problem.inputs), "loss": loss,
            "individual_losses": problem.per_example_loss(outputs, problem.targets)}
    info.update(changes)
    info = {k: v for k, v in info.items() if v is not None}
    with cockpit(step, info=info):
        loss.backward()


# info["batch_size"] ------------------------------------------------------------------


@pytest.mark.parametrize("quantity_class", SUMS)
@pytest.mark.parametrize("wrong", [2, 64])
def test_a_batch_size_that_disagrees_with_the_losses_is_refused_naming_both(quantity_class, wrong):
    problem = build(MODELS[0], 32, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, [quantity_class]))
    with pytest.raises(ValueError, match=rf"info\['batch_size'\] is {wrong} but "
                                         r"info\['individual_losses'\] has 32 values"):
        call(problem, cockpit, 0, batch_size=wrong)


@pytest.mark.parametrize("bad", [0, -5, True, 32.7, "32", 32.0, torch.tensor(32.0)],
                         ids=repr)
@pytest.mark.parametrize("with_losses", [True, False])
def test_a_batch_size_that_is_not_a_positive_int_is_refused_naming_the_key(bad, with_losses):
    problem = build(MODELS[0], 32, "mean")
    classes = SUMS if with_losses else SUMS[:1]  # GradientVarianceQuantiles takes batch_size alone
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, classes))
    losses = {} if with_losses else {"individual_losses": None}
    with pytest.raises((TypeError, ValueError), match=r"info\['batch_size'\] must be .* pass len\(x\)"):
        call(problem, cockpit, 0, batch_size=bad, **losses)


@pytest.mark.parametrize("size", [np.int64(32), np.int32(32), torch.tensor(32)], ids=repr)
def test_numpy_and_tensor_integer_batch_sizes_are_taken_as_ints(size):
    tables = []
    for batch_size in (32, size):
        problem = build(MODELS[0], 32, "mean")
        cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, SUMS))
        call(problem, cockpit, 0, batch_size=batch_size)
        tables.append(cgn.to_frame(cockpit))
    assert len(tables[0]) > 0 and tables[0].equals(tables[1])


# info["individual_losses"] -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "numpy", "0-dim", "empty", "2-dim"])
@pytest.mark.parametrize("quantity_class", SUMS)
def test_individual_losses_that_are_not_a_1d_tensor_are_refused_naming_key_and_fix(kind, quantity_class):
    problem = build(MODELS[0], 6, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, [quantity_class]))
    losses = problem.per_example_loss(problem.model(problem.inputs), problem.targets).detach()
    bad = {"list": losses.tolist(), "numpy": losses.numpy(), "0-dim": losses.sum(),
           "empty": losses[:0], "2-dim": losses[:, None]}[kind]
    with pytest.raises((TypeError, ValueError), match=r"info\['individual_losses'\] must .*"
                                                      r"loss_fn\(reduction='none'\)\(outputs, targets\)"):
        call(problem, cockpit, 0, individual_losses=bad)


# The step -----------------------------------------------------------------------------


@pytest.mark.parametrize("step", [2.0, np.float64(2), torch.tensor(2), True, np.bool_(True), "2"],
                         ids=repr)
@pytest.mark.parametrize("classes", [ALL, (cgn.UpdateSize,)], ids=["all", "two-step-only"])
def test_a_step_that_is_not_an_int_is_refused_at_the_call(step, classes):
    problem = build(MODELS[0], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, classes))
    loss = problem.loss_fn(problem.model(problem.inputs), problem.targets)
    with pytest.raises(TypeError, match=r"the step must be an int .* pass int\(step\)"):
        cockpit(step, info={"loss": loss})  # before the backward pass
    assert CockpitCTX.INFO == {}  # nothing left behind
    call(problem, cockpit, 2)  # the same cockpit works with an int
    assert list(cockpit.get_output()) == ([2] if classes == ALL else [])


@pytest.mark.parametrize("step", [np.int64(2), np.int32(2), np.uint8(2)], ids=repr)
def test_the_explicit_api_takes_a_numpy_integer_step_under_its_int(step, tmp_path):
    """Steps taken from an array (issue 32): records keyed by the plain int, written and read."""
    problem = build(MODELS[0], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem))
    call(problem, cockpit, step)
    call(problem, cockpit, step + 1)  # UpdateSize's record is stored at its start step
    assert [type(k) for k in cockpit.get_output()] == [int, int]
    assert all(type(k) is int for q in cockpit.quantities for k in q.output)
    cockpit.write(str(tmp_path / "log"))
    assert set(cgn.to_frame(str(tmp_path / "log.json")).step) == {2, 3}


@pytest.mark.parametrize("step", [np.int64(3), torch.tensor(3), torch.tensor(3, dtype=torch.int32)],
                         ids=repr)
def test_the_tracker_converts_numpy_and_tensor_integer_steps(step, tmp_path):
    problem = build(MODELS[0], 4, "mean")
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem)), problem.names)
    for current in (step, step + 1):
        problem.model.zero_grad()
        losses = problem.per_example_loss(problem.model(problem.inputs), problem.targets)
        with tracker(current, losses) as loss:
            loss.backward()
    assert [type(k) for k in tracker.get_output()] == [int, int]
    written = tracker.write(tmp_path / "log")
    assert set(cgn.to_frame(written).step) == {3, 4}


@pytest.mark.parametrize("step", [3.0, True, torch.tensor(3.0), torch.tensor([3])], ids=repr)
def test_the_tracker_refuses_a_step_that_is_no_integer(step):
    problem = build(MODELS[0], 4, "mean")
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem)), problem.names)
    losses = problem.per_example_loss(problem.model(problem.inputs), problem.targets)
    with pytest.raises(TypeError, match=r"pass int\(step\)"):
        tracker(step, losses)


def test_steps_that_restart_every_epoch_keep_the_first_records_with_one_warning():
    """8 tracked calls, steps 0-3 twice: the second epoch overwrites nothing."""
    problem = build(MODELS[0], 5, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem))
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for epoch in range(2):
            for step in range(4):
                call(problem, cockpit, step)
                optimizer.step()
            if epoch == 0:
                first, first_frame = copy.deepcopy(cockpit.get_output()), cgn.to_frame(cockpit)
    messages = ours(records)
    assert len(messages) == 1, messages
    assert "step 0 comes after step 3 was recorded" in messages[0]
    assert "global step counter" in messages[0] and "micro_batch=k, micro_batches=K" in messages[0]
    assert sorted(first) == [0, 1, 2, 3]
    assert set(first[3]) == set(SUMS_NAMES + ["ParamGradRatio"])  # UpdateSize of 3 needs step 4
    assert cgn.to_frame(cockpit).equals(first_frame)




def test_a_repeated_step_skips_the_backpack_extensions_of_the_call():
    problem = build(MODELS[0], 5, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, SUMS))
    call(problem, cockpit, 7)
    with pytest.warns(UserWarning, match="step 7 comes after step 7 was recorded"):
        call(problem, cockpit, 7)
    assert not any(hasattr(p, "cgn_batch_l2") for p in problem.params)
    assert list(cockpit.get_output()) == [7]
    call(problem, cockpit, 8)  # the next step is tracked again
    assert list(cockpit.get_output()) == [7, 8]


# A non-finite loss with finite gradients ------------------------------------------------


def test_a_minus_inf_logit_on_a_label_gives_defined_statistics_and_one_warning():
    problem = build(MODELS[0], 6, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for step in range(3):
            problem.model.zero_grad()
            outputs = problem.model(problem.inputs)
            if step < 2:  # example 0 has probability 0 on its label: its loss is +inf
                mask = torch.zeros_like(outputs, dtype=torch.bool)
                mask[0, problem.targets[0]] = True
                outputs = outputs.masked_fill(mask, -math.inf)
            losses = problem.per_example_loss(outputs, problem.targets)
            loss = problem.loss_fn(outputs, problem.targets)
            with cockpit(step, info={"loss": loss, "individual_losses": losses}):
                loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in problem.params)
    messages = ours(records)
    assert len(messages) == 1 and "not finite at step 0" in messages[0], messages
    frame = cgn.to_frame(cockpit)
    bad, good = frame[frame.step < 2], frame[frame.step == 2]
    assert good.value.notna().all()
    loss_free = bad.quantity.isin(["GradientVarianceQuantiles", "ParamGradRatio", "UpdateSize"]) | (
        (bad.quantity == "GradientNoiseScale") & bad.statistic.isin(["b_simple", "batch_size"]))
    assert bad[loss_free].value.notna().all() and len(bad[loss_free]) > 0
    assert bad[~loss_free].value.isna().all()
    assert set(bad[~loss_free].quantity) == {"PerExampleGradNorm", "GradientNoiseScale"}


def test_a_nan_info_loss_keeps_what_does_not_depend_on_it_exactly():
    """b_simple is a ratio of two sums scaled alike by the loss's reduction: formed
    without it, it is the number of a finite loss (to rounding)."""
    tables = {}
    for poisoned in (False, True):
        problem = build(MODELS[2], 7, "sum")
        cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem))
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            problem.model.zero_grad()
            outputs = problem.model(problem.inputs)
            loss = problem.loss_fn(outputs, problem.targets)
            info = {"loss": loss * math.nan if poisoned else loss,
                    "individual_losses": problem.per_example_loss(outputs, problem.targets)}
            with cockpit(0, info=info):
                loss.backward()
        assert len(ours(records)) == poisoned
        frame = cgn.to_frame(cockpit)
        tables[poisoned] = dict(zip(zip(frame.quantity, frame.param, frame.statistic), frame.value))
    assert tables[False].keys() == tables[True].keys()
    for (quantity, param, statistic), value in tables[False].items():
        got = tables[True][quantity, param, statistic]
        if quantity in ("GradientVarianceQuantiles", "ParamGradRatio"):
            assert got == value
        elif quantity == "GradientNoiseScale" and statistic in ("b_simple", "batch_size"):
            assert got == pytest.approx(value, rel=1e-12)
        else:
            assert math.isnan(got), (quantity, param, statistic)


# The model changed between calls ------------------------------------------------------


def test_a_replaced_module_is_named_once_and_never_repeats_a_stale_number():
    problem = build(MODELS[0], 6, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem, [*SUMS, cgn.ParamGradRatio]))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        call(problem, cockpit, 0)
        torch.manual_seed(1)
        problem.model[2] = extend(nn.Linear(5, 3).double())  # the old layer's .grad stays behind
        for step in (1, 2):
            call(problem, cockpit, step)
    messages = ours(records)
    assert len(messages) == 1, messages
    assert "['2.weight', '2.bias'] got no gradient from the backward pass of step 1" in messages[0]
    assert "replaced" in messages[0] and "rebuild the cockpit" in messages[0]
    output = cockpit.get_output()
    for step in (1, 2):
        for name, rows in output[step].items():
            assert set(rows) == {"0.weight", "0.bias", "all"}, (step, name)
            assert (rows["all"]["params_covered"], rows["all"]["params_total"]) == (2.0, 4.0)


def test_a_parameter_frozen_during_training_is_named_once():
    problem = build(MODELS[0], 6, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        call(problem, cockpit, 0)
        problem.model[0].weight.requires_grad_(False)
        call(problem, cockpit, 1)
        call(problem, cockpit, 2)
        problem.model[2].bias.requires_grad_(False)
        call(problem, cockpit, 3)
    messages = ours(records)
    assert len(messages) == 2, messages
    assert "['0.weight'] no longer require gradients at step 1" in messages[0]
    assert "['2.bias'] no longer require gradients at step 3" in messages[1]
    assert all("requires_grad_(False)" in m and "left out of 'all'" in m for m in messages)
    frame = cgn.to_frame(cockpit)
    single_step = frame[frame.quantity != "UpdateSize"]  # UpdateSize: a frozen layer moves by 0
    assert "0.weight" in set(single_step[single_step.step == 0].param)
    assert "0.weight" not in set(single_step[single_step.step == 1].param)
