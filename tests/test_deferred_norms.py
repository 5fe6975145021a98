"""Squared norms unscaled for all layers at the end of the backward pass (issue 32, launches).

On other devices, the rules on the plain path hand their float32 norms at their scale over
(``extensions/deferred_norms.py``), and one set of operations per pass unscales and marks
them all. The numbers must be those each rule gave alone: the same elementwise operations
on the same float32 norms, each exact (a product by a power of two, a comparison, a clamp, a
choice), so the saved tensors are compared for equality, not within a tolerance; the norms
themselves come from the same rule code on both paths. The models hold examples whose norms
underflow at the layer's scale (2**-80 times the others in an input: the mark of a 0 beside
nonzero rows; 2**-66: a nonzero norm below the floor) and an example with a zero input (a
true 0, unmarked). A placeholder read before the pass's end would be a silently wrong
number: here every placeholder starts as NaN, so such a read shows.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import PerExampleSquaredNorms, SumsOfContributions, deferred_norms, facts
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD
from cockpit_gradnoise.functional.underflow import UNRESOLVED

import pytest
import torch
from backpack import backpack
from torch import nn

TINY = 2.0**-80  # squares 2**-160 of the largest: 0 in float32, marked beside nonzero rows
SMALL = 2.0**-66  # squares 2**-132: nonzero below the floor, marked


class Sequence(nn.Module):
    """Linear on ``[B, T, C]`` and on ``[B, C]``, LayerNorm, GroupNorm on a convolution, an
    Embedding read per example and one broadcast over the batch (nanoGPT's positions);
    ``tied``: two Linears sharing their weight (combined in the pass)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.positions = nn.Embedding(3, 6)  # applied to arange(3): broadcast over the batch
        self.seq = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.conv = nn.Conv2d(1, 3, 2)
        self.group = nn.GroupNorm(1, 3)
        self.head = nn.Linear(5 + 12, 4)
        self.mid = nn.Linear(4, 4, bias=False)
        self.again = nn.Linear(4, 4, bias=False)
        if tied:
            self.again.weight = self.mid.weight
        self.out = nn.Linear(4, 6, bias=False)

    def forward(self, index, image, scale):
        tokens = (self.embed(index) + self.positions(torch.arange(3))) * scale
        hidden = self.norm(self.seq(tokens)).mean(1)  # [B, 5]
        pooled = self.group(self.conv(image)).flatten(1)  # [B, 12]
        return self.out(self.again(torch.tanh(self.mid(self.head(torch.cat([hidden, pooled], 1))))))


def _data(examples=5):
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 7, (examples, 3), generator=generator)
    image = torch.randn(examples, 1, 3, 3, generator=generator)
    scale = torch.ones(examples, 1, 1)
    scale[1], scale[4] = TINY, SMALL  # examples 1 and 4: inputs tiny in every layer
    image[1] *= TINY
    image[4] *= SMALL
    scale[3] = 0.0  # example 3's first layers get a zero input: true zeros, not marked
    return index, image, scale


def _saved(model, deferring: bool, monkeypatch, extensions) -> dict:
    """``{(name, field): tensor}`` after one backward pass on the paths of other devices."""
    monkeypatch.setattr(deferred_norms, "ENABLED", deferring)
    for param in model.parameters():
        for field in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD):
            param.__dict__.pop(field, None)
    index, image, scale = _data()
    facts.begin()
    with backpack(*extensions):
        model(index, image, scale).square().sum().backward()
    return {(name, field): getattr(param, field).clone() for name, param in model.named_parameters()
            for field in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD) if hasattr(param, field)}


@pytest.fixture
def handed(monkeypatch):
    """Every placeholder NaN until settled; the names of what was handed over, counted."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    counted = []
    add = deferred_norms.DeferredNorms.add

    def add_nan(self, at_scale, powers, rows, terms):
        counted.append(tuple(at_scale.shape))
        return add(self, at_scale, powers, rows, terms).fill_(math.nan)

    monkeypatch.setattr(deferred_norms.DeferredNorms, "add", add_nan)
    return counted


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("both", [False, True], ids=["norms", "norms and sums"])
def test_deferred_norms_are_the_norms_each_rule_gave_alone(tied, both, handed, monkeypatch):
    torch.manual_seed(1)
    model = cgn.prepare_model(Sequence(tied))
    extensions = (PerExampleSquaredNorms(), SumsOfContributions()) if both else (PerExampleSquaredNorms(),)
    alone = _saved(model, False, monkeypatch, extensions)
    assert not handed
    together = _saved(model, True, monkeypatch, extensions)
    # Handed over: every norm of a float32 rule on the plain path (the tied weight's uses are
    # combined in the pass: not handed over), the LayerNorm's and GroupNorm's two at once.
    # embed; seq, conv, head: weight and bias; mid, again, out: weight; LayerNorm and GroupNorm:
    # both at once. Not the position table (broadcast: its results are read per example in the
    # pass), nor a tied weight's uses (combined in the pass).
    assert len(handed) == (10 if tied else 12), handed
    assert alone.keys() == together.keys()
    for key, value in alone.items():
        assert value.dtype == together[key].dtype and torch.equal(value.isnan(), together[key].isnan()), key
        assert torch.equal(value.nan_to_num(), together[key].nan_to_num()), key
    norms = {name: value for (name, field), value in together.items() if field == BATCH_L2_SAVEFIELD}
    assert not any(bool(value.isnan().any()) for value in norms.values())
    # The marks themselves: example 1 underflowed (UNRESOLVED) in every layer it reaches with
    # nonzero rows; example 3's zero input gives true zeros in the layers it reaches first.
    for example in (1, 4):
        assert norms["seq.weight"][example] == UNRESOLVED and norms["conv.weight"][example] == UNRESOLVED
    assert norms["seq.weight"][3] == 0.0 and norms["seq.bias"][3] > 0.0
    assert bool((norms["head.weight"] > UNRESOLVED).all())


def test_nothing_is_handed_over_on_the_cpus_paths():
    """The CPU's path checks the values at once (and forms lost norms again in float64)."""
    model = cgn.prepare_model(Sequence(False))
    index, image, scale = _data()
    facts.begin()
    recorded = []
    with backpack(PerExampleSquaredNorms()):
        model(index, image, scale).square().sum().backward()
        recorded.append(facts.recording())
    assert not recorded[0].deferred.groups and not recorded[0].deferring
    assert model.seq.weight.cgn_batch_l2[1] > UNRESOLVED  # formed again in float64, exact


def _two_passes(model):
    """The squared norms of ``seq.weight`` and ``group.bias`` after each of two backward passes
    in one ``backpack`` context, the second at inputs twice as large."""
    index, image, scale = _data()
    facts.begin()
    found = []
    with backpack(PerExampleSquaredNorms()):
        for factor in (1.0, 2.0):
            model(index, image * factor, scale * factor).square().sum().backward()
            found.append([model.seq.weight.cgn_batch_l2.clone(), model.group.bias.cgn_batch_l2.clone()])
    return found


def test_settled_at_the_end_of_each_backward_pass(handed, monkeypatch):
    """Each pass's norms settled at its own end (none left over for the next), on its own values."""
    model = cgn.prepare_model(Sequence(False))
    monkeypatch.setattr(deferred_norms, "ENABLED", False)
    alone = _two_passes(model)
    monkeypatch.setattr(deferred_norms, "ENABLED", True)
    together = _two_passes(model)
    assert len(handed) == 2 * 12 and not facts.recording().deferred.groups
    for pass_alone, pass_together in zip(alone, together):
        for value, deferred in zip(pass_alone, pass_together):
            assert torch.equal(value, deferred)
    assert not torch.equal(together[0][0], together[1][0])


def test_settle_marks_each_norm_as_unscaled_norms_does_at_its_own_floor(monkeypatch):
    """Norms at the edges, in entries of different terms, scales and numbers of factors (one,
    two, and two parameters in one entry): just below and at each entry's float32 floor, 0
    beside nonzero and zero rows, NaN, and a normal norm; each settled as
    :func:`._squares.unscaled_norms` gives it alone (the factors' powers multiplied, their
    rows' smallest taken, there as here)."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    from cockpit_gradnoise.extensions._squares import Scale, scale_powers, unscaled_norms
    from cockpit_gradnoise.functional.underflow import underflow_floor

    entries = []
    for terms, scales in ((3, (2.0**40,)), (4000, (2.0**-3, 2.0**-90)), (70, (1.0,)), (9, (2.0**100, 2.0**7))):
        floor = torch.tensor(underflow_floor(terms, torch.float32), dtype=torch.float32)
        below = torch.nextafter(floor, torch.zeros(()))
        at_scale = torch.stack([below, floor, floor.new_zeros(()), floor.new_zeros(()),
                                floor.new_tensor(math.nan), floor.new_tensor(0.75)])
        rows = torch.tensor([[1.0, 1.0, 2.0**-149, 0.0, 1.0, 1.0], [1.0, 3.0, 1.0, 1.0, 1.0, 2.0**-140]])
        powers = torch.stack([scale_powers(scale) for scale in scales])
        entries.append((at_scale, Scale(factor_powers=powers, factor_rows=rows[:len(scales)]), terms))
    # Two parameters in one entry ([2, N], as a normalization layer's), at the floor of 3 terms.
    (first, first_scale, _), (third, third_scale, _) = entries[0], entries[2]
    pair = (torch.stack([first, third]), Scale(torch.stack([first_scale.powers, third_scale.powers]),
                                               torch.stack([first_scale.rows, third_scale.rows])), 3)
    pending = deferred_norms.DeferredNorms()
    placeholders = [pending.add(a, *s.handed_over(), t) for a, s, t in entries]
    placeholders.append(pending.add(pair[0], pair[1].powers.unsqueeze(1), pair[1].rows.unsqueeze(1), 3))
    pending.settle()
    for placeholder, (at_scale, scale, terms) in zip(placeholders, entries + [pair]):
        expected = unscaled_norms(at_scale, scale, terms)
        assert torch.equal(placeholder.isnan(), expected.isnan())
        assert torch.equal(placeholder.nan_to_num(), expected.nan_to_num()), (terms, placeholder, expected)
    marked = placeholders[0]
    assert marked[0] == UNRESOLVED and marked[1] > UNRESOLVED and marked[2] == UNRESOLVED and marked[3] == 0
    assert placeholders[3][5] == 0.75 * 2.0**-214  # times 1 / (2**100 2**7)**2: the factors' product


def test_nothing_is_handed_over_while_fsdp2_reads_norms_in_the_pass(handed, monkeypatch):
    """FSDP2's hooks of ``sharded.reduce_in_backward`` read a layer's per-example norms inside
    the backward pass (GradientNoiseScale's gradient sent there): while they are armed, every
    rule keeps its norms itself, as on the CPU's paths."""
    from cockpit_gradnoise.extensions import sharded

    model = cgn.prepare_model(Sequence(False))
    monkeypatch.setattr(sharded, "_armed", (object(), {"cgn_local_gradient": [object()]}))
    assert sharded.armed_in_backward()
    _saved(model, True, monkeypatch, (PerExampleSquaredNorms(),))
    assert not handed
    monkeypatch.setattr(sharded, "_armed", (None, {}))
    _saved(model, True, monkeypatch, (PerExampleSquaredNorms(),))
    assert len(handed) == 12


def test_a_pass_after_one_that_raised_hands_nothing_over_to_no_end(handed, monkeypatch):
    """A backward pass that raises never reaches its end (torch drops its queued callbacks):
    its facts stay unfinished, and the next pass with BackPACK's extensions alone records
    into them. Its norms must not be handed over to that end which never comes (they stayed
    placeholders: NaN here, uninitialised memory on a GPU); they are given at once, the
    numbers of the path that hands nothing over."""
    torch.manual_seed(1)
    model = cgn.prepare_model(Sequence(False))
    extensions = (PerExampleSquaredNorms(), SumsOfContributions())
    alone = _saved(model, False, monkeypatch, extensions)
    monkeypatch.setattr(deferred_norms, "ENABLED", True)

    def out_of_memory(grad):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    def raising_hook(module, args, output):
        output.register_hook(out_of_memory)

    raising = model.head.register_forward_hook(raising_hook)
    index, image, scale = _data()
    facts.begin()
    with pytest.raises(RuntimeError, match="out of memory"), backpack(*extensions):
        model(index, image, scale).square().sum().backward()
    raising.remove()
    assert handed  # the layers after the head had handed their norms over
    for param in model.parameters():
        for field in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD):
            param.__dict__.pop(field, None)
    with backpack(*extensions):  # no facts.begin(): the extensions used directly
        model(index, image, scale).square().sum().backward()
    for (name, field), value in alone.items():
        param = model.get_parameter(name)
        assert torch.equal(value.nan_to_num(), getattr(param, field).nan_to_num()), (name, field)
        assert torch.equal(value.isnan(), getattr(param, field).isnan()), (name, field)
