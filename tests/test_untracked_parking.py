"""Untracked steps run the modules without the package's hooks: they are parked (issue 21).

While the tracker keeps the hooks idle, they are out of the modules' hook
tables (``nn.Module.__call__`` takes its fast path); they come back, in their
places and with their flags, for the forward passes that record.
"""

import copy
import pickle

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import hooks

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import TokenCrossEntropy
from tests.test_untracked import data, nano

TABLES = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def ours(model):
    """How many of the package's hooks the modules' tables hold."""
    return sum(isinstance(hook, hooks.eager_under_compile)
               for m in model.modules() for table in TABLES[:2] for hook in getattr(m, table).values())


def tables(model):
    """Every module's hook tables: keys in order, and each hook's function (flags as they are)."""
    return [[[(key, _function(value)) for key, value in getattr(m, table).items()] for table in TABLES]
            for m in model.modules()]


def _function(hook):
    hook = getattr(hook, "hook", hook)  # eager_under_compile's
    return getattr(hook, "func", hook)  # a functools.partial's


def user_hook(module, args, output):
    """A hook of the user's (module-level: the model pickles)."""


def test_untracked_forward_passes_run_without_the_hooks_and_they_come_back_in_place():
    model, tracker = cgn.track(nano(), every=3)
    first = model.transformer.h[0].c_attn
    before, after = first.register_forward_hook(user_hook, prepend=True), None
    prepared, count = tables(model), ours(model)
    assert count > 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = TokenCrossEntropy("none")
    in_tables = []
    for step, idx in enumerate(data(7)):
        opt.zero_grad()
        in_tables.append(ours(model))
        if step == 0:
            assert tables(model) == prepared
        if step == 2:  # registered while parked: after the parked ones once they are back
            after = first.register_forward_hook(user_hook)
        with tracker(step, loss_fn(model(idx), idx), optimizer=opt) as loss:
            loss.backward()
        opt.step()
    # Forward passes of steps 0, 3, 6 record (tracked); the others run without the hooks.
    assert in_tables == [count, 0, 0, count, 0, 0, count]
    hooks.switch_of(model).armed = True  # parked after step 6: back
    keys = list(first._forward_hooks)
    assert keys[0] == before.id and keys[-1] == after.id and len(keys) == 3
    after.remove()
    assert tables(model) == prepared


def test_a_copy_of_a_parked_model_has_its_hooks_and_records():
    model, tracker = cgn.track(nano(), every=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, idx in enumerate(data(2)):  # after step 1 the hooks are parked (step 2 needs none)
        opt.zero_grad()
        with tracker(step, TokenCrossEntropy("none")(model(idx), idx), optimizer=opt) as loss:
            loss.backward()
        opt.step()
    assert not hooks.switch_of(model).armed and ours(model) == 0
    copies = (copy.deepcopy(model), pickle.loads(pickle.dumps(model)))
    hooks.switch_of(model).armed = True
    for copied in copies:
        assert hooks.switch_of(copied).armed
        assert tables(copied) == tables(model)  # keys, order, flags
        assert all(m.__dict__.get(hooks.PARKED_ATTR) is None for m in copied.modules())
    # The copy records: its numbers at a tracked step are those of the original.
    idx = data(1)[0]
    frames = []
    for net in (model, copies[0]):
        _, tracked = cgn.track(net, every=1, quantities=["PerExampleGradNorm"])
        net.zero_grad()
        with tracked(0, TokenCrossEntropy("none")(net(idx), idx)) as loss:
            loss.backward()
        frames.append(tracked.frame())
    assert len(frames[0]) > 0 and frames[0].equals(frames[1])


def test_a_compiled_model_whose_hooks_park_has_the_numbers_of_the_uncompiled_one():
    """Parking changes the hook tables TorchDynamo guards on (``prepare_model`` makes it):
    the graphs without the hooks never run a recording forward pass. The eager backend runs
    the same operations; bound as in tests/test_track_compiled.py."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    twin = copy.deepcopy(plain)
    compiled, tracker = cgn.track(torch.compile(plain, backend="eager"), every=3,
                                  quantities=["PerExampleGradNorm"])
    _, by_hand = cgn.track(twin, every=3, quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for tracked, net in ((tracker, compiled), (by_hand, twin)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(7):
            opt.zero_grad()
            with tracked(step, F.cross_entropy(net(x), y, reduction="none"), optimizer=opt) as loss:
                loss.backward()
            opt.step()
    got, expected = tracker.frame(), by_hand.frame()
    assert set(got.step) == {0, 3, 6} and len(got) == len(expected)
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=2 * 25 * 2.0**-52, atol=0)
