"""Per-element sums unscaled for many layers at the end of the backward pass (issue 32, launches).

On other devices, the rules in :func:`.uses.run`'s window hand their float32 ``[T, S]`` at
their scale over (``extensions/deferred_sums.py``), and one set of operations per batch
unscales and marks them. The numbers must be those each rule gave alone: the same
elementwise operations on the same float32 sums, each exact (a product by a power of two,
comparisons, a fill), so the saved tensors are compared for equality; the sums themselves
come from the same rule code on both paths. The inputs hold features whose squares underflow
at the layer's scale (2**-80 and 2**-66 times the others in every example: sums marked
UNRESOLVED), a feature that is 0 in every example (a dead unit, ``T = S = 0``, unmarked), and
an attention key whose bias is a structural zero (``T = S = 0`` written by the rule). A
placeholder read before the pass's end would be a silently wrong number: here every
placeholder starts as NaN, so such a read shows; each guard of the window has a test here
that fails without it.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import SumsOfContributions, cost_model, deferred_sums, facts
from cockpit_gradnoise.extensions.savefields import SUMS_SAVEFIELD
from cockpit_gradnoise.functional.underflow import UNRESOLVED

import pytest
import torch
from backpack import backpack
from torch import nn


class Attention(nn.Module):
    """One attention head over ``[B, T, 4]`` (its key's bias a structural zero), a LayerNorm, a
    convolution over 2 positions (its sums permuted in memory), a head on ``[B, C]``; an
    Embedding read per example and one broadcast over the batch (nanoGPT's positions);
    ``tied``: the head shares its weight with ``again`` (combined in the pass)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(7, 1)
        self.positions = nn.Embedding(3, 1)  # applied to arange(3): broadcast over the batch
        self.query, self.key, self.value = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv2d(4, 3, (2, 1))  # its sums permuted in memory
        self.head = nn.Linear(6, 6)
        self.again = nn.Linear(6, 6, bias=False)
        if tied:
            self.again.weight = self.head.weight

    def forward(self, index, features):
        # The tables on feature 0 only: the others keep their sizes in every example.
        first = features[..., :1] + self.embed(index) + self.positions(torch.arange(3))
        tokens = torch.cat([first, features[..., 1:]], -1)
        scores = self.query(tokens) @ self.key(tokens).transpose(1, 2)
        mixed = self.norm(scores.softmax(-1) @ self.value(tokens))  # [B, 3, 4]
        pooled = self.conv(mixed.transpose(1, 2).unsqueeze(-1)).flatten(1)  # [B, 6]
        return self.again(torch.tanh(self.head(pooled)))


def _data(examples=5):
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, 7, (examples, 3), generator=generator)
    features = torch.randn(examples, 3, 4, generator=generator)
    # In every example: feature 1 tiny (squares 0 in float32 at the scale: S = 0 beside T != 0),
    # feature 2 small (squares below the floor), feature 3 zero (a dead unit of the first layers).
    features[..., 1] *= 2.0**-80
    features[..., 2] *= 2.0**-66
    features[..., 3] = 0.0
    return index, features


def _saved(model, deferring: bool, monkeypatch, create_graph: bool = False) -> dict:
    """``{name: sums}`` after one backward pass on the paths of other devices."""
    monkeypatch.setattr(deferred_sums, "ENABLED", deferring)
    for param in model.parameters():
        param.__dict__.pop(SUMS_SAVEFIELD, None)
    index, features = _data()
    facts.begin()
    with backpack(SumsOfContributions()):
        model(index, features).square().sum().backward(create_graph=create_graph)
    return {name: getattr(param, SUMS_SAVEFIELD) for name, param in model.named_parameters()
            if hasattr(param, SUMS_SAVEFIELD)}


@pytest.fixture
def handed(monkeypatch):
    """Every placeholder NaN until settled; the placeholders handed out, kept."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    placeholders = []
    add = deferred_sums.DeferredSums.add

    def add_nan(self, at_scale, powers, terms):
        placeholder = add(self, at_scale, powers, terms)
        if placeholder is not None:
            placeholders.append(placeholder.fill_(math.nan))
        return placeholder

    monkeypatch.setattr(deferred_sums.DeferredSums, "add", add_nan)
    return placeholders


def _names(saved: dict, placeholders) -> set:
    return {name for name, value in saved.items() if any(value is p for p in placeholders)}


def _equal(alone: dict, together: dict) -> None:
    assert alone.keys() == together.keys()
    for key, value in alone.items():
        other = together[key]
        assert value.dtype == other.dtype and value.stride() == other.stride(), key
        assert torch.equal(value.isnan(), other.isnan()), key
        assert torch.equal(value.nan_to_num(), other.nan_to_num()), key


#: Handed over: every [T, S] of a float32 rule in the window. Not the position table
#: (broadcast: read per example in the pass), nor a layer holding a tied weight (its uses
#: combined in the pass: test with ``tied``).
HANDED = {"embed.weight", "query.weight", "query.bias", "key.weight", "key.bias", "value.weight",
          "value.bias", "norm.weight", "norm.bias", "conv.weight", "conv.bias", "head.weight", "head.bias",
          "again.weight"}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_deferred_sums_are_the_sums_each_rule_gave_alone(tied, handed, monkeypatch):
    torch.manual_seed(1)
    model = cgn.prepare_model(Attention(tied))
    alone = _saved(model, False, monkeypatch)
    assert not handed
    together = _saved(model, True, monkeypatch)
    assert _names(together, handed) == (HANDED - {"head.weight", "head.bias", "again.weight"} if tied else HANDED)
    _equal(alone, together)
    assert not together["conv.weight"].is_contiguous()  # handed over in memory order
    # The marks and zeros themselves: the tiny and small features' columns marked, the dead
    # unit's and the key's bias (a structural zero) exactly 0, the rest resolved.
    squares = together["query.weight"][1]
    assert bool((squares[:, 1] == UNRESOLVED).all()) and bool((squares[:, 2] == UNRESOLVED).all())
    assert bool((together["query.weight"][:, :, 3] == 0).all()) and bool((squares[:, 0] > UNRESOLVED).all())
    assert bool((together["key.bias"] == 0).all()) and bool((together["query.bias"][1] > UNRESOLVED).all())


def test_nothing_is_handed_over_on_the_cpus_paths(monkeypatch):
    """The CPU's path checks the values at once (and forms lost sums again in float64)."""
    model = cgn.prepare_model(Attention(False))
    found = []
    monkeypatch.setattr(deferred_sums.DeferredSums, "add", lambda *args: found.append(args))
    saved = _saved(model, True, monkeypatch)
    assert not found
    assert bool((saved["query.weight"][1, :, 1] > UNRESOLVED).all())  # formed again in float64, exact


def test_nothing_is_handed_over_while_fsdp2_reads_results_in_the_pass(handed, monkeypatch):
    """FSDP2's hooks of ``sharded.reduce_in_backward`` reduce-scatter the sums inside the
    backward pass: while they are armed, every rule keeps its sums itself."""
    from cockpit_gradnoise.extensions import sharded

    model = cgn.prepare_model(Attention(False))
    monkeypatch.setattr(sharded, "_armed", (object(), {SUMS_SAVEFIELD: [object()]}))
    _saved(model, True, monkeypatch)
    assert not handed
    monkeypatch.setattr(sharded, "_armed", (None, {}))
    assert _names(_saved(model, True, monkeypatch), handed) == HANDED


def test_nothing_is_handed_over_under_create_graph(handed, monkeypatch):
    """With ``create_graph`` the sums carry their graph: a placeholder would carry none."""
    model = cgn.prepare_model(Attention(False))
    saved = _saved(model, True, monkeypatch, create_graph=True)
    assert not handed and saved["query.weight"].grad_fn is not None


def test_large_layers_keep_their_own_unscaling(handed, monkeypatch):
    """A parameter of more than ``LARGEST`` elements is unscaled by its rule (held at its scale
    until the pass ends it would cost memory); the others are handed over, in batches of at
    most ``SETTLE_ELEMENTS`` (here two parameters' worth), with the same numbers."""
    monkeypatch.setattr(deferred_sums, "LARGEST", 16)
    monkeypatch.setattr(deferred_sums, "SETTLE_ELEMENTS", 40)
    settled, settle = [], deferred_sums._settled
    monkeypatch.setattr(deferred_sums, "_settled", lambda entries, device: (
        settled.append(sum(entry[0].shape[1] for entry in entries)), settle(entries, device)))
    model = cgn.prepare_model(Attention(False))
    alone = _saved(model, False, monkeypatch)
    together = _saved(model, True, monkeypatch)
    large = {name for name, param in model.named_parameters() if param.numel() > 16}
    assert _names(together, handed) == HANDED - large and large & HANDED
    _equal(alone, together)
    assert max(settled) <= 40 and sum(settled) == sum(p[0].numel() for p in handed) and len(settled) > 2


def test_forced_formation_expansion(handed, monkeypatch):
    """The sequence Linears' weights expanded over positions ([T, S, R]: not handed over) and
    formed (handed over): the same numbers either way."""
    model = cgn.prepare_model(Attention(False))
    for method, kept in (("expansion", {"query.weight", "key.weight", "value.weight"}), ("formation", set())):
        monkeypatch.setattr(cost_model, "FORCE_METHOD", method)
        alone = _saved(model, False, monkeypatch)
        handed.clear()
        together = _saved(model, True, monkeypatch)
        assert kept <= {name for name, value in together.items() if len(value) == 3}
        assert _names(together, handed) & kept == set()
        _equal(alone, together)


def test_settle_marks_each_sum_as_unscaled_sums_does(monkeypatch):
    """Sums at the edges, in entries of different terms, sizes, scales and numbers of factors:
    ``S`` just below and at its float32 floor, ``S = 0`` beside ``T != 0`` and beside ``T = 0``,
    NaN and infinity, normal sums; settled in batches (``SETTLE_ELEMENTS``) as
    :func:`._squares.unscaled_sums` gives each alone."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    monkeypatch.setattr(deferred_sums, "SETTLE_ELEMENTS", 14)  # batches of one and two entries
    from cockpit_gradnoise.extensions._squares import Scale, scale_powers, unscaled_sums
    from cockpit_gradnoise.functional.underflow import underflow_floor

    entries = []
    for terms, scales, shape in ((3, (2.0**40,), (7,)), (4000, (2.0**-3, 2.0**-90), (2, 3)), (3, (1.0,), (1,)),
                                 (9, (2.0**100, 2.0**7), (7,)), (3, (2.0**-20, 2.0), (3, 2))):
        floor = torch.tensor(underflow_floor(terms, torch.float32), dtype=torch.float32)
        below = torch.nextafter(floor, torch.zeros(()))
        squares = torch.tensor([below, floor, 0.0, 0.0, math.nan, math.inf, 0.75])
        totals = torch.tensor([0.0, -2.0, 3.0, 0.0, 1.0, 2.0, -0.5])  # S below the floor beside T = 0: marked
        numel = math.prod(shape)
        at_scale = torch.stack([totals[:numel], squares[:numel]]).reshape(2, *shape).contiguous()
        powers = torch.stack([scale_powers(scale) for scale in scales])
        entries.append((at_scale, Scale(factor_powers=powers), terms))
    pending = deferred_sums.DeferredSums()
    placeholders = [pending.add(a, s.handed_over()[0], t) for a, s, t in entries]
    assert all(p is not None for p in placeholders)
    pending.settle()
    for placeholder, (at_scale, scale, terms) in zip(placeholders, entries):
        expected = unscaled_sums(at_scale, scale, terms)
        assert torch.equal(placeholder.isnan(), expected.isnan())
        assert torch.equal(placeholder.nan_to_num(), expected.nan_to_num()), (terms, placeholder, expected)
    marked = placeholders[0][1]
    assert marked[0] == UNRESOLVED and marked[1] > UNRESOLVED and marked[2] == UNRESOLVED and marked[3] == 0
    assert placeholders[3][1, 6] == 0.75 * 2.0**-214  # times 1 / (2**100 2**7)**2: the factors' product
    assert placeholders[3][0, 6] == -0.5 * 2.0**-107


def test_hugging_face_gpt2_sums_are_those_each_rule_gave_alone(handed, monkeypatch):
    """Hugging Face's GPT-2 (tiny config, random weights): its ``Conv1D`` weights' sums saved as a
    transposed view of the placeholder, its biases' with their structural zeros (the attention
    keys'), its LayerNorms': handed over, the same numbers; its tied ``wte`` and broadcast
    ``wpe`` not."""
    from tests.models import hf_gpt2

    torch.manual_seed(0)
    model = cgn.prepare_model(hf_gpt2(vocabulary=11, context=4, width=8, heads=2, layers=1))
    index = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(0))
    found = {}
    for deferring in (False, True):
        monkeypatch.setattr(deferred_sums, "ENABLED", deferring)
        facts.begin()
        with backpack(SumsOfContributions()):
            model(index).square().sum().backward()
        found[deferring] = {name: param.__dict__.pop(SUMS_SAVEFIELD) for name, param in model.named_parameters()
                            if SUMS_SAVEFIELD in param.__dict__}
    _equal(found[False], found[True])
    names = {name for name, value in found[True].items() if any(value._base is p or value is p for p in handed)}
    layers = {name for name in found[True] if ".h.0." in name or "ln_f" in name}
    assert names == layers and len(layers) == 14, names
    attention = found[True]["model.transformer.h.0.attn.c_attn.bias"]
    assert bool((attention[:, 8:16] == 0).all()) and bool((attention[1, :8] > 0).all())  # keys' bias: 0
