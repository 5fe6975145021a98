"""Untracked steps: the hooks stay idle unless the tracker arms them (issue 21).

The numbers of a run whose hooks idle on untracked steps are compared with
those of the same run whose hooks record every forward pass (a tracker whose
arming is switched off): the same computation at every tracked step, so the
frames must be equal. The model has the three kinds of hooks: the package's
own (every module with parameters), the fallback's (nanoGPT's LayerNorm class)
and the tied uses' (the head tied to ``wte``, ``wpe(torch.arange(T))``).
"""

import copy
import gc
import pickle
import weakref

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import batchless, hooks
from cockpit_gradnoise.extensions.fallback import capture

import pytest
import torch
from backpack import disable

from tests.models import NanoGPT, TokenCrossEntropy

VOCABULARY, CONTEXT, BATCH = 11, 4, 5


def nano():
    torch.manual_seed(0)
    return NanoGPT(VOCABULARY, CONTEXT, 8, 2, layers=1, bias=True, norm="nanogpt")


def data(steps):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCABULARY, (BATCH, CONTEXT), generator=generator) for _ in range(steps)]


class Recorded:
    """Counts what the hooks record per forward pass: the package's calls, the
    fallback's captures, the walks for broadcast embeddings."""

    def __init__(self, monkeypatch):
        self.counts = {"calls": 0, "captures": 0, "walks": 0}
        counts = self.counts

        class CountedCall(hooks.Call):
            __slots__ = ()

            def __init__(self, *args):
                counts["calls"] += 1
                super().__init__(*args)

        class CountedFallbackCall(capture.Call):
            def __init__(self, *args, **kwargs):
                counts["captures"] += 1
                super().__init__(*args, **kwargs)

        walk = batchless.find_broadcasts

        def counted_walk(*args):
            counts["walks"] += 1
            return walk(*args)

        monkeypatch.setattr(hooks, "Call", CountedCall)
        monkeypatch.setattr(capture, "Call", CountedFallbackCall)
        monkeypatch.setattr(batchless, "find_broadcasts", counted_walk)

    def take(self):
        taken = dict(self.counts)
        self.counts.update(calls=0, captures=0, walks=0)
        return taken


def train(steps, every=3, always_armed=False, optimizer=True, arm=False, recorded=None):
    """Train the nanoGPT-style model at the given step numbers; the tracker, and what the
    hooks recorded in each step's forward pass."""
    model, tracker = cgn.track(nano(), every=every)
    if always_armed:
        tracker.arming.switch = None  # the model's switch stays on: every forward is recorded
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = TokenCrossEntropy("none")
    per_step = []
    for step, idx in zip(steps, data(len(steps))):
        opt.zero_grad()
        if arm:
            tracker.arm(step)
        losses = loss_fn(model(idx), idx)
        per_step.append(recorded.take() if recorded is not None else None)
        with tracker(step, losses, optimizer=opt if optimizer else None) as loss:
            loss.backward()
        opt.step()
    return tracker, per_step


def test_untracked_forward_passes_record_nothing_and_tracked_steps_are_unchanged(monkeypatch):
    recorded = Recorded(monkeypatch)
    tracker, per_step = train(range(5), recorded=recorded)
    for step, counts in enumerate(per_step):
        if step % 3 == 0:  # tracked: every kind of hook recorded
            assert counts["calls"] > 0 and counts["captures"] > 0 and counts["walks"] == 1, step
        else:  # step 3k+1 is UpdateSize's end: it needs no extension either
            assert counts == {"calls": 0, "captures": 0, "walks": 0}, step
    reference, armed = train(range(5), always_armed=True, recorded=recorded)
    assert all(counts["calls"] > 0 for counts in armed)
    assert set(tracker.frame().step) == {0, 3}
    assert tracker.frame().equals(reference.frame())


def test_a_tracked_step_whose_forward_pass_was_not_recorded_is_refused_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"step 6 is tracked, but its forward pass was not "
                                           r"recorded.*set for step 2.*tracker\.arm\(step\)"):
        train([0, 1, 6])


def test_tracker_arm_records_the_forward_pass_of_the_step_it_names():
    tracker, _ = train([0, 2, 6, 8], arm=True)
    reference, _ = train([0, 2, 6, 8], always_armed=True)
    assert set(tracker.frame().step) == {0, 6}
    assert tracker.frame().equals(reference.frame())


def test_without_an_optimizer_the_hooks_stay_armed_while_the_tracked_step_may_go_on():
    """Without ``optimizer=`` the tracker cannot tell the next micro-batch of step ``s`` from
    step ``s + 1``: it arms for both; with it, ``optimizer.step()`` ends the step."""
    model, tracker = cgn.track(nano(), every=3)
    switch = hooks.switch_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = TokenCrossEntropy("none")
    idx = data(1)[0]
    armed = []
    for step, given in [(0, None), (1, None), (2, opt), (3, opt), (4, opt)]:
        with tracker(step, loss_fn(model(idx), idx), optimizer=given) as loss:
            loss.backward()
        armed.append(switch.armed)
        opt.step()
        armed.append(switch.armed)
    # Step 0 may go on (no optimizer given); after step 1 neither 1 nor 2 needs the
    # extensions; 3 does, and after its optimizer step 4 does not.
    assert armed == [True, True, False, False, True, True, True, False, False, False]


def test_an_untracked_step_enters_only_backpack_disable_and_still_checks_the_backward():
    model, tracker = cgn.track(nano(), every=3)
    loss_fn = TokenCrossEntropy("none")
    idx = data(1)[0]
    tracked_calls = []
    track = tracker.cockpit.track
    tracker.cockpit.track = lambda step, **kwargs: (tracked_calls.append(step), track(step, **kwargs))
    for step in range(3):
        with tracker(step, loss_fn(model(idx), idx)) as loss:
            # BackPACK's context at step 0, disable() at the others, as Cockpit's own
            assert disable.should_store_io() == (step == 0)
            loss.backward()
    assert tracked_calls == [0, 1]  # step 1: UpdateSize's end; step 2: nothing computes
    assert disable.should_store_io()
    with pytest.raises(RuntimeError, match=r"step 5: call loss.backward\(\) inside"):
        with tracker(5, loss_fn(model(idx), idx)):
            pass


def test_a_copy_of_a_prepared_model_starts_armed():
    model = cgn.prepare_model(nano())
    switch = hooks.switch_of(model)
    switch.armed = False
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copied_switch = hooks.switch_of(copied)
        assert copied_switch is not switch and copied_switch.armed
        # one switch for all modules of the copy
        assert all(m.__dict__[hooks.SWITCH_ATTR] is copied_switch for m in copied.modules())


def test_the_optimizer_does_not_keep_the_tracker_alive():
    tracker, _ = train([0, 1])
    opt = torch.optim.SGD(tracker.cockpit.params, lr=0.1)
    with tracker(2, torch.ones(3, requires_grad=True) * 1.0, optimizer=opt) as loss:
        loss.backward()
    alive = weakref.ref(tracker)
    del tracker, loss
    gc.collect()
    assert alive() is None
    opt.step()  # its hook finds no tracker and does nothing


def test_an_optimizer_without_torchs_step_hooks_leaves_the_hooks_armed_for_both():
    class Wrapper:  # as some trainers wrap the optimizer: no register_step_post_hook
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

    model, tracker = cgn.track(nano(), every=3)
    switch = hooks.switch_of(model)
    wrapper = Wrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn = TokenCrossEntropy("none")
    idx = data(1)[0]
    armed = []
    for step in range(3):
        with tracker(step, loss_fn(model(idx), idx), optimizer=wrapper) as loss:
            loss.backward()
        wrapper.step()
        armed.append(switch.armed)
    assert armed == [True, False, True]  # as without an optimizer: for s and s + 1
