"""The front door declares the loss's reduction and the batch; the explicit API infers them
from the values (issue 36): the same numbers, with the inference counted."""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.quantities.presets import ALL

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from cockpit.utils.schedules import linear

from tests.tracking_runs import STEPS, assert_same_numbers, batches, by_hand, classes_of, front_door, tiny_model


def counting(monkeypatch, module, name, calls):
    """Replace ``module.name`` by a wrapper that appends ``name`` to ``calls``."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def inference_counted(monkeypatch):
    """The calls of the two functions that infer the loss's scale from the values."""
    from cockpit_gradnoise import accumulation, functional

    calls = []
    counting(monkeypatch, functional, "loss_scale", calls)
    counting(monkeypatch, accumulation, "micro_batch_loss_scale", calls)
    return calls


@pytest.mark.parametrize("reduction", [None, "sum"])
def test_the_front_door_declares_the_batch_and_infers_nothing(reduction, monkeypatch):
    calls = inference_counted(monkeypatch)
    tracker = front_door(tiny_model(), batches(), reduction=reduction)
    assert calls == []
    explicit_calls = inference_counted(monkeypatch)
    cockpit = by_hand(tiny_model(), batches(), linear(1), classes_of(ALL), reduction=reduction or "mean")
    assert explicit_calls == ["loss_scale"] * STEPS  # the explicit API infers, once per step
    assert_same_numbers(tracker, cockpit)


def accumulated(front, data, reduction="mean"):
    """Two steps of two micro-batches each, through the front door or the explicit API."""
    model = tiny_model()
    if front:
        model, tracker = cgn.track(model, every=1)
    else:
        model = extend(model)
        names = [n for n, _ in model.named_parameters()]
        tracker = cgn.Cockpit(list(model.parameters()),
                              quantities=[cls(linear(1), param_names=names) for cls in classes_of(ALL)])
    for step in range(2):
        model.zero_grad()
        for k in range(2):
            x, y = data[2 * step + k]
            losses = F.cross_entropy(model(x), y, reduction="none")
            if front:
                block = tracker(step, losses, micro_batch=k, micro_batches=2,
                                reduction=None if reduction == "mean" else reduction)
            else:
                loss = losses.mean() / 2 if reduction == "mean" else losses.sum()
                block = tracker(step, info={"individual_losses": losses, "loss": loss,
                                            "micro_batch": k, "micro_batches": 2})
            with block:
                (loss if not front else block.info["loss"]).backward()
    return tracker.frame() if front else cgn.to_frame(tracker)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_under_accumulation_the_front_door_declares_each_micro_batch(reduction, monkeypatch):
    data = batches(steps=4)
    calls = inference_counted(monkeypatch)
    got = accumulated(True, data, reduction)
    assert calls == []
    expected = accumulated(False, data, reduction)
    assert calls == ["micro_batch_loss_scale"] * 4  # the explicit API infers each micro-batch's
    assert len(got) > 0 and got.equals(expected)


def test_a_loss_given_is_checked_once_and_its_scale_declared(monkeypatch):
    model, tracker = cgn.track(tiny_model(), every=1)
    x, y = batches(steps=1)[0]
    calls = inference_counted(monkeypatch)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with tracker(0, losses, loss=losses.sum()) as loss:
        loss.backward()
    assert calls == ["loss_scale"]  # the tracker's check, not the quantities' inference
    assert set(tracker.frame().quantity) == set(ALL) - {"UpdateSize"}


def test_the_losses_are_checked_once_per_tracked_step(monkeypatch):
    from cockpit_gradnoise import step as step_module
    from cockpit_gradnoise import tracking

    calls = []
    counting(monkeypatch, step_module, "check_individual_losses", calls)
    counting(monkeypatch, tracking, "check_individual_losses", calls)
    front_door(tiny_model(), batches())
    assert calls == ["check_individual_losses"] * STEPS
    calls.clear()
    by_hand(tiny_model(), batches(), linear(1), classes_of(ALL))
    assert len(calls) > STEPS  # the explicit API checks info as each quantity reads it


def minus_inf_logit(model, x, y):
    """Per-example losses with example 0's loss +inf (its label's logit -inf), gradients finite."""
    outputs = model(x)
    mask = torch.zeros_like(outputs, dtype=torch.bool)
    mask[0, y[0]] = True
    return F.cross_entropy(outputs.masked_fill(mask, -float("inf")), y, reduction="none")


@pytest.mark.parametrize("forced", [False, True], ids=["cpu", "other-devices-paths"])
def test_losses_that_are_not_finite_give_what_the_explicit_api_gives(forced, monkeypatch):
    """The declared scale is NaN where the losses are not finite, as the inferred one is;
    on other devices that is read with the step's values, and the scale-free statistics
    are formed with the declared scale: the same to rounding."""
    from cockpit_gradnoise import _device

    if forced:
        monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    frames, told = [], []
    for front in (True, False):
        model = tiny_model()
        x, y = batches(steps=1)[0]
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            if front:
                model, tracker = cgn.track(model, every=1)
                with tracker(0, minus_inf_logit(model, x, y)) as loss:
                    loss.backward()
                frames.append(tracker.frame())
            else:
                model = extend(model)
                names = [n for n, _ in model.named_parameters()]
                cockpit = cgn.Cockpit(list(model.parameters()),
                                      quantities=[cls(linear(1), param_names=names)
                                                  for cls in classes_of(ALL)])
                losses = minus_inf_logit(model, x, y)
                with cockpit(0, info={"individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward()
                frames.append(cgn.to_frame(cockpit))
        told.append([str(r.message) for r in records if "not finite at step 0" in str(r.message)])
    got, expected = frames
    assert got[["quantity", "param", "statistic"]].equals(expected[["quantity", "param", "statistic"]])
    assert got.value.isna().equals(expected.value.isna()) and got.value.isna().any()
    finite = expected.value.notna()
    assert got.value[finite].to_numpy() == pytest.approx(
        expected.value[finite].to_numpy(), rel=0 if not forced else 1e-12)
    assert len(told[0]) == len(told[1]) == 1
