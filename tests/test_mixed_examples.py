"""Issue 32, class 3: a model that mixes its examples is found by one gradient, and left out by name.

Every rule gives example ``i`` the rows ``i`` of its layer's output gradient, which are example
``i``'s own only where the examples are independent. timm's ``csatv2`` attends over the batch
(``(B, B)`` scores) behind a ``LayerNorm(1)``: its forward outputs are each example's own, its
gradients are not, and ``norm1``, the position convolution and ``qkv`` had rows 83% to 99.9% off
with no warning. The check of ``extensions/fallback/mixing.py`` (one gradient of one example's
outputs, before the first tracked step) finds those layers; with no module around them whose
rows are examples (the toys here), they are left out by name, every other parameter keeping its
exact rows, against the float64 contributions of a per-example loop
(``check.reference_contributions``); models whose examples are independent are not touched.
csatv2's are run in their ``SpatialTransformerBlock`` on each example: ``tests/test_mixed_blocks.py``.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check, references
from cockpit_gradnoise.extensions.fallback import mixing

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn
from torch.nn import functional as F

from tests.cases import CONTEXT, VOCABULARY, Problem, classification_losses, gpt, mlp
from tests.test_regroup import swin
from tests.test_tied import assert_left_out_by_name, assert_matches_references

MIXES = r"mixes the examples of the batch"


def flagged(model):
    """The names of the modules whose rows the check found mixed."""
    return {name for name, module in model.named_modules() if mixing.MIXED in module.__dict__}


def surveyed(model, inputs):
    """``model`` prepared, after one forward pass with gradients (the check runs there)."""
    model = cgn.prepare_model(model)
    model(inputs)
    return model


@pytest.fixture
def guard_off(monkeypatch):
    monkeypatch.setattr(mixing, "check", lambda *args, **kwargs: (set(), set()))


class BackwardMixing(nn.Module):
    """Mixes the examples in the backward pass only, as csatv2 does: ``h - h.detach()`` is zero
    in value, so each example's output is its own, but its mean over the batch takes every
    example's gradient to every other's rows of ``first``."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h + (h - h.detach()).mean(0))


class ForwardMixing(BackwardMixing):
    """Mixes the examples in the forward pass: each example's hidden state gets the batch's mean."""

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(h + h.mean(0, keepdim=True))


def batch(examples=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(examples, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (examples,), generator=generator))


def contributions(model, inputs, targets):
    """``{name: g_i}`` (the mean's ``x_i = g_i / N``): example ``i``'s contribution, by one
    backward pass per example through the batch's forward pass (float64)."""
    found = check.reference_contributions(copy.deepcopy(model), (inputs,), targets, nn.CrossEntropyLoss())
    return {name: x * len(inputs) for name, x in found.items()}


def assert_left_out_and_others_exact(model, inputs, targets, left_out, grads=None):
    """``left_out`` named in the warning and without rows; every other parameter exact
    (GradientVarianceQuantiles, PerExampleGradNorm, GradientNoiseScale)."""
    grads = contributions(model, inputs, targets) if grads is None else grads
    loss_fn, per_example_loss = classification_losses("mean")
    problem = Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs, targets, "mean")
    assert_left_out_by_name(problem, cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
                            tuple(left_out), MIXES)
    assert_matches_references(problem, 1, grads={n: g for n, g in grads.items() if n not in left_out})


@pytest.mark.parametrize("make", [BackwardMixing, ForwardMixing])
def test_a_layer_whose_rows_mix_is_left_out_by_name_the_others_exact(make):
    torch.manual_seed(0)
    model = make().double()
    inputs, targets = batch()
    assert_left_out_and_others_exact(model, inputs, targets, ["first.weight", "first.bias"])


def tracked_norms(model, inputs, targets, name, quantities=("PerExampleGradNorm",)):
    """One step of ``cgn.track(model)``, no warning allowed; PerExampleGradNorm of ``name``."""
    model, tracker = cgn.track(model, every=1, quantities=list(quantities))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = F.cross_entropy(model(inputs), targets, reduction="none")
        with tracker(0, losses) as loss:
            loss.backward()
    return tracker.get_output()[0]["PerExampleGradNorm"][name]


def assert_silently_wrong(model, inputs, targets, name):
    """What the guard is for: with it off, the shapes agree, the numbers do not, and nothing warns."""
    expected = references.per_example_grad_norm(None, None, inputs, None, gradients={
        name: contributions(model, inputs, targets)[name]})[name]
    assert tracked_norms(model, inputs, targets, name)["max"] != pytest.approx(expected["max"], rel=1e-3)


def test_without_the_guard_the_mixed_rows_are_silently_wrong(guard_off):
    torch.manual_seed(0)
    assert_silently_wrong(BackwardMixing().double(), *batch(), "first.weight")


# timm's csatv2 -------------------------------------------------------------------------------


def csatv2():
    """One stage of 8 channels (16 pixels: 2 x 2 positions, pooled to the spatial attention's
    7 x 7), float64, evaluation mode, every parameter drawn. ``LayerNorm(1)``'s weights have a
    gradient of zero by structure (its normalized input is 0), rounding noise in the reference:
    ``norm2``'s is frozen (``norm1``'s where its rows are compared: ``tests/test_mixed_blocks.py``)."""
    from timm.models.csatv2 import CSATv2

    torch.manual_seed(0)
    model = CSATv2(num_classes=3, dims=(8,), depths=(1,), transformer_depths=(0,)).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    model.stages[0][0].attn.attn.norm2.weight.requires_grad_(False)
    return model


def images(examples=3):
    generator = torch.Generator().manual_seed(examples)
    return (torch.randn(examples, 3, 16, 16, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (examples,), generator=generator))


def test_csatv2_without_the_guard_is_silently_inexact(guard_off):
    assert_silently_wrong(csatv2(), *images(), "stages.0.0.attn.attn.norm1.bias")


# What the check must not see -------------------------------------------------------------------


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=12, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForSequenceClassification(config).double().eval(), torch.randint(0, 11, (3, 5))


def checked_layers(monkeypatch, model, inputs):
    """The names of the layers whose output gradients the check saw, none of them mixed."""
    seen = []
    note = mixing._note

    def counted(module, *args):
        seen.append(module)
        note(module, *args)

    monkeypatch.setattr(mixing, "_note", counted)
    model = surveyed(model, inputs)
    assert not flagged(model)
    return {name for name, module in model.named_modules() if module in seen}


def test_independent_examples_are_not_touched(monkeypatch):
    """An MLP, a GPT, BERT (a ``ModelOutput``) and a regrouped Swin (windows ``[N*W, ...]``,
    its block run on each example): every layer with rows per example checked, none found."""
    torch.manual_seed(0)
    assert checked_layers(monkeypatch, mlp().double(), torch.randn(3, 6, dtype=torch.float64)) == {"0", "2"}
    layers = checked_layers(monkeypatch, gpt().double(), torch.randint(0, VOCABULARY, (3, CONTEXT)))
    assert {"wte", "blocks.1.qkv", "blocks.1.ln_2"} <= layers
    model, tokens = bert()
    assert "classifier" in checked_layers(monkeypatch, model, tokens)
    layers = checked_layers(monkeypatch, swin("Swin"), torch.randn(4, 3, 16, 16, dtype=torch.float64))
    assert "model.classifier" in layers


def test_an_mlp_keeps_its_exact_rows_and_warns_nothing():
    torch.manual_seed(0)
    model = mlp().double()
    inputs = torch.randn(3, 6, dtype=torch.float64)
    targets = torch.randint(0, 3, (3,))
    loss_fn, per_example_loss = classification_losses("mean")
    problem = Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs, targets, "mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert_matches_references(problem, 1)


class Squares(nn.Module):
    """Examples independent; an infinite input makes ``0 * inf`` in other examples' rows."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.second(self.first(x) ** 2)


def test_non_finite_rows_tell_nothing():
    torch.manual_seed(0)
    inputs = torch.randn(3, 4, dtype=torch.float64)
    inputs[0, 0] = float("inf")
    assert not flagged(surveyed(Squares().double(), inputs))


def test_non_finite_entries_hide_no_mixed_row():
    """``0 * inf`` (NaN) and an infinite entry on other examples' rows tell nothing, and do not
    hide a finite one: the largest magnitudes are those of the finite entries."""
    grad = torch.zeros(4, 3, dtype=torch.float64)
    grad[3] = 1.0  # the example's own row
    grad[0, 0], grad[1, 1] = float("nan"), float("inf")
    assert not mixing.mixes(grad, 3)
    grad[2, 2] = 1e-3
    assert mixing.mixes(grad, 3)
    grad[2, 2] = 1e-9  # below sqrt(eps) of the largest: a rounding residue
    assert not mixing.mixes(grad, 3)


def test_batchnorm_in_training_mode_is_told_as_before_not_as_mixed():
    """Its mixing is told apart (``examples_interact``): the check runs it in evaluation mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = surveyed(model, torch.randn(3, 4, dtype=torch.float64))
    assert not flagged(model) and model[1].training


class Outputs(nn.Module):
    """``BackwardMixing`` returning a dict, a tuple, or a loss only."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.inner = kind, BackwardMixing()

    def forward(self, x):
        out = self.inner(x)
        if self.kind == "dict":
            return {"loss": out.square().mean(), "logits": out}
        if self.kind == "tuple":
            return out.sum(), out
        return out.square().mean()


@pytest.mark.parametrize("kind, found", [
    ("dict", {"inner.first"}), ("tuple", {"inner.first"}), ("loss", set())])
def test_outputs_that_are_not_batch_first(kind, found):
    """The rows per example of a dict or a tuple (a scalar loss beside them has none); a model
    whose output is a loss only has none to start from, and is not checked. Found, ``first`` is
    a member of the block around it, ``inner``, whose rows are not mixed (its checks refuse it
    then: ``tests/test_mixed_blocks.py``)."""
    torch.manual_seed(0)
    model = surveyed(Outputs(kind).double(), batch()[0])
    block = model.inner.__dict__.get(mixing.BLOCK_ATTRIBUTE)
    members = {name for name, m in model.named_modules() if block is not None and m in block.members}
    assert not flagged(model) and members == found


def test_checked_once_per_shape_of_the_inputs(monkeypatch):
    calls = []
    monkeypatch.setattr(mixing, "check", lambda model, real, larger, examples, around=(): (
        calls.append(examples), (set(), set()))[1])
    model = cgn.prepare_model(BackwardMixing().double())
    for examples in (1, 3, 3, 5):  # one example is checked again with more
        model(batch(examples)[0])
    model(torch.randn(2, 3, 4, dtype=torch.float64))
    assert calls == [1, 3, 2]
