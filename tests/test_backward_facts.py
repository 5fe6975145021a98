"""One :class:`~cockpit_gradnoise.extensions.facts.BackwardFacts` per backward pass, also
for backward passes no cockpit began (the extensions used with ``backpack()`` alone).

The facts' keys are ``id()`` of parameters and layers. A pass that recorded into an
earlier pass's facts counted a layer run again as a second use (its parameters refused
as "ran several times"), and a new layer whose ``id`` a freed one had held inherited
the freed one's facts: CI met a LayerNorm whose rule was skipped, its savefield
missing, because a freed block's layer had held its ``id``.
"""

from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions, facts

import torch
from backpack import backpack, extend
from torch import nn


def _model() -> nn.Module:
    return extend(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, bias=False), nn.Linear(5, 3)))


def _backward(model: nn.Module):
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    with backpack(SumsOfContributions()):
        loss.backward()
    return facts.recording()


def test_each_pass_under_backpack_alone_records_into_its_own_facts():
    torch.manual_seed(0)
    model = _model()
    first = _backward(model)
    second = _backward(model)
    assert second is not first
    assert second.refusals == {}, "the layers' second pass taken for a second call"
    assert set(second.uses.values()) == {1}
    assert {key for _, key in second.uses} == {id(p) for p in model.parameters()}


def test_a_new_layer_never_inherits_a_freed_layers_facts():
    torch.manual_seed(0)
    earlier = _backward(_model())
    model = _model()
    # What the freed block's facts held where a new layer reuses its id.
    earlier.inside_blocks.update(id(module) for module in model.modules())
    _backward(model)
    assert all(hasattr(p, SUMS_SAVEFIELD) for p in model.parameters())


def test_a_pass_a_cockpit_began_is_kept_through_its_backward_pass():
    torch.manual_seed(0)
    model = _model()
    begun = facts.begin()
    assert _backward(model) is begun
    assert begun.finished and begun.graph_task is not None
    assert facts.recording() is begun  # read after the pass: the same facts
