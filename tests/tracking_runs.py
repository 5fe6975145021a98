"""Tiny training runs through the front door (``cgn.track``) and through the explicit API
(quantities built by hand), and the comparison of their numbers: the two run the very same
computation (the same forward, the same ``losses.mean()``, the same BackPACK extensions)."""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.quantities.presets import ALL

import torch
import torch.nn.functional as F
from backpack import extend
from torch import nn

from tests.helpers import without_quantities

STEPS = 4
BATCH = 8


def tiny_model(seed=0, frozen=()):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return model


def batches(n=BATCH, steps=STEPS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator))
            for _ in range(steps)]


def front_door(model, data, every=1, quantities="all", reduction=None, **kwargs):
    """Train ``model`` on ``data`` through the front door; return the tracker."""
    model, tracker = cgn.track(model, every=every, quantities=quantities, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=opt, reduction=reduction) as loss:
            loss.backward()
        opt.step()
    return tracker


def by_hand(model, data, schedule, classes, reduction="mean", quantiles=None):
    """The same training with quantities built by hand (the explicit API); return the Cockpit."""
    model = extend(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    quantities = [
        cls(schedule, param_names=names,
            **({"quantiles": quantiles} if quantiles and cls.__name__ == ALL[0] else {}))
        for cls in classes
    ]
    cockpit = cgn.Cockpit([p for p in model.parameters() if p.requires_grad], quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"batch_size": len(x), "individual_losses": losses, "loss": loss, "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return cockpit


def classes_of(names):
    return [getattr(cgn, name) for name in names]


def assert_same_numbers(tracker, cockpit):
    got, expected = tracker.frame(), cgn.to_frame(cockpit)
    assert len(got) > 0
    assert set(got.quantity) - set(expected.quantity) <= {"Optimizer"}
    assert without_quantities(got).equals(expected)
