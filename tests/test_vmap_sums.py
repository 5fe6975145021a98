"""Issue 32: the fallback's ``vmap`` route checked once per module: do the examples' contributions add up?

A module without a rule is recomputed per example under ``torch.func.vmap``, each example
alone (``replay.per_example_gradients``). A module whose examples interact in its backward
pass only, with each example's output alone its row of the batch's (a term zero in value,
``h + (h - h.detach()).mean(0)``; a custom ``autograd.Function`` whose backward mixes the
rows), got rows that do not add up to its gradient, with no warning. At its first tracked
step on this route the module now runs once more on the whole batch, its children replayed
(``replay.batch_gradients``), and each parameter's contributions must add up to that gradient
(``sum_check``); where they do not, its parameters are left out by name, the others keep
their rows. Exactness against ``cgn.check_model``'s float64 per-example reference (one
backward pass per example through the batch's forward pass, the batch's dropout draws).
"""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch
from torch import nn

from tests.helpers import quiet_check, rows, sequence_batch, token_check

#: What the refusal says (``sum_check.not_summing_under_vmap``).
NOT_SUMMING = "do not add up to its gradient from the batch"


class RowMixingGradient(torch.autograd.Function):
    """The identity whose backward hands every row the batch's mean gradient: the examples
    interact in the backward pass only. ``vmap`` runs it (``setup_context``, a vmap rule
    generated), one example at a time, where the mean is the example's own gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.mean(0, keepdim=True).expand_as(grad).clone()


class Mixer(nn.Module):
    """A layer with parameters of its own (no rule: the fallback), its examples interacting
    in its backward pass only by ``mixing``, a dropout of its own as a child (replayed)."""

    def __init__(self, mixing: str = "", p: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.mixing = mixing
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        h = self.dropout(x) @ self.weight
        if self.mixing == "detached mean":  # zero in value
            h = h + (h - h.detach()).mean(0, keepdim=True)
        elif self.mixing == "function":
            h = RowMixingGradient.apply(h)
        return torch.tanh(h) * self.scale


class Net(nn.Module):
    def __init__(self, mixing: str = "", p: float = 0.0):
        super().__init__()
        self.mixer = Mixer(mixing, p)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.mixer(x).mean(1))


def _check(model: nn.Module, examples: int):
    torch.manual_seed(0)
    x, y = sequence_batch(examples)
    return quiet_check(model.double(), (x,), y, nn.CrossEntropyLoss())


@pytest.mark.parametrize("examples", [2, 3, 5])
def test_backward_only_mixing_refused_by_name(examples):
    """Each example's output alone is its row of the batch's; its gradient alone is not its
    share of the batch's: the mixer's parameters are left out, named, with why and what to do;
    the head keeps exact rows."""
    torch.manual_seed(0)
    frame = _check(Net("detached mean"), examples).set_index("param")
    mixer = frame.loc[["mixer.weight", "mixer.scale"]]
    assert not mixer.rows.any(), mixer.to_string()
    assert mixer.note.str.contains(NOT_SUMMING).all(), mixer.note.tolist()
    assert mixer.note.str.contains("torch.func.vmap").all()
    assert mixer.note.str.contains("treat each example's rows alone").all()  # what to do
    head = frame.loc[["head.weight", "head.bias"]]
    assert head.rows.all() and (head.max_rel_error <= 1e-10).all(), head.to_string()


def test_function_mixing_rows_in_its_backward_refused():
    torch.manual_seed(0)
    frame = _check(Net("function"), 3).set_index("param")
    assert not frame.loc["mixer.weight"].rows
    assert NOT_SUMMING in frame.loc["mixer.weight"].note
    assert frame.loc["head.weight"].rows


@pytest.mark.parametrize("examples", [2, 3, 5])
def test_independent_examples_exact(examples):
    """The same layer without the mixing: every parameter exact (the check passes)."""
    torch.manual_seed(0)
    frame = _check(Net(), examples)
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()
    assert frame.set_index("param").loc["mixer.weight"].how.startswith("fallback")


class KeyBias(nn.Module):
    """Attention with its own key bias (no rule: the fallback): the bias's gradient is zero by
    structure (the softmax over the keys ignores what every key adds alike), rounding noise in
    the batch's gradient and in the examples' contributions alike (CvT, I-BERT, CaiT, XCiT)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.key = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.key_bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        # (F.linear: the examples' terms of its bias are watched, the exact zeros kept: .replay)
        scores = (x @ self.query) @ nn.functional.linear(x, self.key, self.key_bias).transpose(1, 2)
        return torch.softmax(scores, -1) @ x


@pytest.mark.parametrize("examples", [3, 5])
def test_a_gradient_zero_by_structure_is_not_refused(examples):
    """Compared at the module's scale, not its own (noise against noise): no refusal."""
    torch.manual_seed(0)
    model = nn.Sequential(KeyBias(), nn.Flatten(), nn.Linear(20, 3))
    frame = _check(model, examples).set_index("param")
    assert frame.rows.all(), frame.note.tolist()
    assert frame.loc["0.key_bias"].reference_scale < 1e-12 * frame.reference_scale.max()  # zero by structure
    assert (frame.drop(index="0.key_bias").max_rel_error <= 1e-10).all(), frame.to_string()


class Twice(nn.Module):
    """The mixer called twice in one forward pass (its calls summed per example: ``.several``),
    side by side (one call's output into the other would mix before it: ``.mixing`` sees that)."""

    def __init__(self, mixing: str = ""):
        super().__init__()
        self.mixer = Mixer(mixing)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head((self.mixer(x) + self.mixer(x.flip(1))).mean(1))


@pytest.mark.parametrize("mixing", ["", "detached mean"])
def test_a_module_called_twice_checked_over_its_calls(mixing):
    torch.manual_seed(0)
    frame = _check(Twice(mixing), 3).set_index("param")
    mixer = frame.loc[["mixer.weight", "mixer.scale"]]
    if mixing:
        assert not mixer.rows.any() and mixer.note.str.contains(NOT_SUMMING).all(), mixer.note.tolist()
        assert mixer.note.str.contains("called 2 times").all()
    else:
        assert mixer.rows.all() and (mixer.max_rel_error <= 1e-10).all(), mixer.to_string()
    assert frame.loc["head.weight"].rows


def test_dropout_inside_replayed_by_the_check():
    """Training mode, a dropout child inside the module (``p = 0.5``): the check's run on the
    batch replays the child's recorded output. Drawing again would give other masks, a sum
    far from the gradient, and the module refused."""
    torch.manual_seed(0)
    model = Net(p=0.5).train()
    frame = _check(model, 5)
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()


def _refusals(model, tracker, step: int, examples: int):
    """One tracked step of ``examples`` sequences (``cgn.track``'s ``with``): the messages of
    the warnings that say the contributions do not add up, and the parameters with rows."""
    x, y = sequence_batch(examples)
    model.zero_grad()
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracker(step, losses) as loss:
            loss.backward()
    named = [str(w.message) for w in caught if NOT_SUMMING in str(w.message)]
    return named, set(rows(tracker.cockpit, "PerExampleGradNorm", step))


def test_tracker_warns_and_keeps_the_step(monkeypatch):
    """The tracker (not only ``check_model``) leaves the mixer out with a warning naming it,
    keeps the head's rows, and at the next step refuses again without recomputing (the
    reason is kept: the check ran at the first step only)."""
    from cockpit_gradnoise.extensions.fallback import capture, sum_check

    torch.manual_seed(0)
    model, tracker = cgn.track(Net("detached mean").double(), every=1, quantities=["PerExampleGradNorm"])
    for step in (0, 1):
        named, got = _refusals(model, tracker, step, 3)
        assert (not named) if step else ("Mixer (weight, scale)" in named[0] and "to weight" in named[0]), named
        assert not got & {"mixer.weight", "mixer.scale"} and {"head.weight", "head.bias"} <= got, got
        if step == 0:  # the batch is not run again at later steps
            state = getattr(model.mixer, capture.ATTRIBUTE)
            assert state.sums_checked and NOT_SUMMING in state.not_summing
            monkeypatch.setattr(sum_check, "not_summing_under_vmap", None)  # (a call would raise)


def test_mobilebert_nonorm_through_the_check_still_exact(monkeypatch):
    """MobileBERT's ``NoNorm`` (``x * weight + bias``, no rule: the fallback's ``vmap`` route)
    in ``transformers``' own class, tiny, float64: every ``NoNorm`` checked, none refused, every
    parameter exact (no new refusal)."""
    from cockpit_gradnoise.extensions.fallback import sum_check

    from transformers import MobileBertConfig, MobileBertForMaskedLM

    from experiments.architecture_sweep import classify

    checked = []
    original = sum_check.not_summing_under_vmap

    def recording(module, *args):
        checked.append((type(module).__name__, original(module, *args)))
        return checked[-1][1]

    monkeypatch.setattr(sum_check, "not_summing_under_vmap", recording)
    torch.manual_seed(0)
    config = MobileBertConfig(vocab_size=61, hidden_size=16, embedding_size=8, intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, intra_bottleneck_size=8,
                              true_hidden_size=8, num_feedforward_networks=1)
    frame = token_check(Logits(MobileBertForMaskedLM(config).double().eval()), 61)
    # (the sweep's verdict: an attention key's bias, zero by structure, against the network's scale)
    verdict = classify(frame, set())
    assert verdict["status"] == "exact" and verdict["coverage"] == 1.0, verdict
    assert "fallback (torch.func, NoNorm)" in verdict["how"]
    assert checked and {name for name, _ in checked} >= {"NoNorm"}
    assert all(why is None for _, why in checked), checked


class Logits(nn.Module):
    """A masked language model's logits."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(tokens).logits


def test_a_first_batch_of_one_example_is_no_check():
    """At one example the contribution is the gradient: the check waits for a larger batch."""
    torch.manual_seed(0)
    model, tracker = cgn.track(Net("detached mean").double(), every=1, quantities=["PerExampleGradNorm"])
    for step, examples in enumerate((1, 3)):
        named, got = _refusals(model, tracker, step, examples)
        assert bool(named) == (examples > 1), named
    assert "mixer.weight" not in got
