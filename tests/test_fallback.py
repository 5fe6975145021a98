"""The torch.func fallback and the model checker, against float64 per-example references.

The case matrix (``tests/cases.py``: HF Llama and GPT-2, timm's ViT) checks
every quantity on real libraries' models; here the fallback's own edges:
keyword and unbatched arguments, tuple outputs, and the modules it must
refuse rather than give a wrong number.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.check import reference_contributions
from cockpit_gradnoise.extensions import LocalGradient, PerExampleSquaredNorms, SumsOfContributions

import pytest
import torch
from backpack import backpack
from torch import nn

from tests.helpers import rows

RTOL = 1e-12


class Scaled(nn.Module):
    """``x * gamma + shift``, ``shift`` a keyword argument without the batch dimension;
    returns a tuple (the scaled tensor, an integer tensor)."""

    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(width))

    def forward(self, x, *, shift):
        return x * self.gamma + shift, torch.zeros(len(x), dtype=torch.long)


class WithToken(nn.Module):
    """A class token and a position table used directly in ``forward``, a layer scale
    called with a keyword argument inside."""

    def __init__(self, width=4, length=3, classes=3):
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, width))
        self.positions = nn.Parameter(torch.randn(1, length + 1, width))
        self.shift = torch.randn(width)
        self.linear, self.scale = nn.Linear(width, width), Scaled(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = torch.cat([self.token.expand(len(x), -1, -1), x], 1) + self.positions
        x = x + self.scale(torch.tanh(self.linear(x)), shift=self.shift)[0]
        return self.head(x[:, 0])


def _run(model, x, y, loss_fn):
    """The package's three results on a prepared float64 copy: ``{name: (norms, sums, grad)}``."""
    prepared = cgn.prepare_model(copy.deepcopy(model))
    with backpack(PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient()):
        loss_fn(prepared(x), y).backward()
    return {
        name: tuple(getattr(p, f, None) for f in ("cgn_batch_l2", "cgn_sums_of_contributions", "cgn_local_grad"))
        for name, p in prepared.named_parameters()
    }


def _close(got, expected):
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= RTOL * scale


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_token_position_table_and_keyword_layer_scale_are_exact(reduction):
    torch.manual_seed(0)
    model = WithToken().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="cockpit-gradnoise")
        got = _run(model, x, y, loss_fn)
    expected = reference_contributions(model, (x,), y, loss_fn)
    assert set(got) == set(expected)
    for name, c in expected.items():
        norms, sums, grad = got[name]
        _close(norms, c.square().flatten(1).sum(1))
        _close(sums, torch.stack([c.sum(0), c.square().sum(0)]))
        _close(grad, c.sum(0))


class Mixing(nn.Module):
    """Direct parameter, and a BatchNorm inside that mixes the examples in training mode."""

    def __init__(self):
        super().__init__()
        self.gamma, self.norm = nn.Parameter(torch.ones(4)), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(x) * self.gamma


class Dropped(nn.Module):
    """Drops features with a mask of one row more than the batch: no example's part of the
    batch's draws to replay (``extensions/fallback/draws.py``; a mask per example, flattened
    by example or drawn once for all, is replayed). Each example alone draws 2 rows and is
    handed the next 2 of the batch's, which are not the batch's rows of it: its output alone
    differs (refused there), and the rows would run out at the fourth example."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(4))

    def forward(self, x):
        keep = (torch.rand(len(x) + 1, *x.shape[1:], dtype=x.dtype) < 0.5)[1:]
        return x * self.gamma * keep / 0.5


class Table(nn.Module):
    """A position table applied without the batch dimension (its output leads with T)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, positions):
        return self.table[positions]


class UsesTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.table, self.head = Table(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head((x + self.table(torch.arange(3))).sum(1))


class Twice(nn.Module):
    """A layer scale called on the batch and on a batch-free table of as many rows as the
    batch has examples (6): one call has no per-example rows, so the module is refused (its
    calls are summed per example where each has them: ``tests/test_fallback_several_calls.py``)."""

    def __init__(self):
        super().__init__()
        self.scale, self.head = Scaled(4), nn.Linear(4, 3)
        self.table = torch.randn(6, 4)

    def forward(self, x):
        zero = torch.zeros(4)
        return self.head(self.scale(x, shift=zero)[0] + self.scale(self.table.to(x), shift=zero)[0])


class Shift(nn.Module):
    def forward(self, x):
        return x + 0.5


class ChangedInPlace(nn.Module):
    """A child's output changed in place, then multiplied by the parameter: the recorded
    output is not what the child returned, and it is needed. (A child of ``replay.ROW_WISE``,
    a Linear, would be run again: ``tests/test_changed_in_place.py``; this one is not.)"""

    def __init__(self):
        super().__init__()
        self.gamma, self.linear, self.shift = nn.Parameter(torch.randn(4)), nn.Linear(4, 4), Shift()

    def forward(self, x):
        out = self.shift(self.linear(x))
        out += 1.0
        return out * torch.sigmoid(self.gamma)


class Cached(nn.Module):
    """A layer scale whose forward appends its keys to the key/value cache of ``transformers``
    it is given (GraniteMoE-SWA's attention with its ``sinks``)."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(4))

    def forward(self, x, cache):
        keys, _ = cache.update((x * self.gamma)[:, None, None], x[:, None, None], 0)
        return keys.reshape(len(x), -1)


class GivesACache(nn.Module):
    def __init__(self):
        super().__init__()
        self.cached = Cached()

    def forward(self, x):
        from transformers import DynamicCache

        return self.cached(x, cache=DynamicCache())


@pytest.mark.parametrize(
    "model, name, reason",
    [
        (nn.Sequential(Mixing(), nn.Linear(4, 3)), "0.gamma", "BatchNorm in training mode"),
        (nn.Sequential(GivesACache(), nn.Linear(4, 3)), "0.cached.gamma", "use_cache=False"),
        (nn.Sequential(Dropped(), nn.Linear(4, 3)), "0.gamma", "differs from its output in the batch"),
        (Twice(), "scale.gamma", "called 2 times in one forward pass, and one of them"),
        (nn.Sequential(ChangedInPlace(), nn.Linear(4, 3)), "0.gamma", "changed in place is needed"),
    ],
    ids=["batchnorm-inside", "key-value-cache", "dropout", "called-twice", "child-output-changed-in-place"],
)
def test_the_fallback_refuses_what_it_cannot_compute_exactly(model, name, reason):
    torch.manual_seed(0)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with pytest.warns(UserWarning, match=reason):
        got = _run(model.train(), x, y, nn.CrossEntropyLoss())
    assert got[name] == (None, None, None)


@pytest.mark.parametrize(
    "model, name, reason",
    [
        (nn.Sequential(Dropped(), nn.Linear(4, 3)), "0.gamma", "differs from its output in the batch"),
        (Twice(), "scale.gamma", "called 2 times in one forward pass, and one of them"),
        (nn.Sequential(ChangedInPlace(), nn.Linear(4, 3)), "0.gamma", "changed in place is needed"),
    ],
    ids=["dropout", "called-twice", "child-output-changed-in-place"],
)
def test_the_quantities_name_the_fallbacks_reason_and_keep_the_other_rows(model, name, reason):
    """The tracker's warning about the parameters left out gives the fallback's reason
    (not "no per-example rule"), and the step keeps the other parameters' rows."""
    torch.manual_seed(0)
    model, tracker = cgn.track(model.double().train(), every=1, quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with tracker(0, losses) as loss:
            loss.backward()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "no per-example rule" in m], messages
    assert [m for m in messages if repr(name) in m and reason in m and "left out" in m], messages
    got = set(rows(tracker.cockpit, "PerExampleGradNorm"))
    head = "head.weight" if isinstance(model, Twice) else "1.weight"
    assert name not in got and head in got


class Gated(nn.Module):
    """``y = x * sigmoid(g)`` feeds a child and the output, and a dropout child after the
    parameter: the recomputation replays the children, their inputs carrying the gradient
    that flowed into them (``y``'s other use must not be counted twice), and the dropout
    gives what it drew."""

    def __init__(self, width=4):
        super().__init__()
        self.g = nn.Parameter(torch.randn(width))
        self.linear, self.drop = nn.Linear(width, width), nn.Dropout(0.5)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = x * torch.sigmoid(self.g)
        return self.act(self.drop(self.linear(y))) + y * self.g


class WithGated(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.gated, self.head = nn.Linear(3, 4), Gated(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.gated(torch.tanh(self.first(x)))).sum(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_children_are_replayed_exactly_through_random_and_in_place_ones(reduction):
    torch.manual_seed(0)
    model = WithGated().double().train()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    prepared = cgn.prepare_model(copy.deepcopy(model))  # its probe draws random numbers
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="cockpit-gradnoise")
        got = _run(prepared, x, y, loss_fn)
    torch.set_rng_state(state)  # the same dropout, through one pass of the batch
    c = reference_contributions(model, (x,), y, loss_fn)["gated.g"]
    norms, sums, grad = got["gated.g"]
    _close(norms, c.square().flatten(1).sum(1))
    _close(sums, torch.stack([c.sum(0), c.square().sum(0)]))
    _close(grad, c.sum(0))


@pytest.mark.parametrize("examples", [6, 3])  # 3: the table's T
def test_a_table_applied_without_the_batch_dimension_is_exact_through_its_block(examples):
    """Its output leads with T = 3, not the batch size, and its input ``arange(3)`` does not
    depend on the batch: the fallback refused it; the module around it that takes and
    returns the batch first (here the model) is now run again on each example alone
    (.fallback.regroup), and the checker finds its rows exact."""
    torch.manual_seed(0)
    model = UsesTable()
    x, y = torch.randn(examples, 3, 4), torch.randint(0, 3, (examples,))
    frame = cgn.check_model(model, x, y, nn.CrossEntropyLoss(), verbose=False)
    row = frame.set_index("param").loc["table.table"]
    assert row.rows and row.max_rel_error < 1e-10 and row.how.startswith("per example")


class Shared(nn.Module):
    """A table looked up by each example's own positions, without any input leading
    with the batch: ``forward(n)`` takes the batch size as a number."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, n):
        return self.table.expand(n, 3, 4)


def test_a_module_expanding_its_parameter_over_the_batch_is_exact():
    """No input leads with the batch (the fallback used to refuse it), but its output is its
    parameter expanded over the batch, whose rows the survey saw follow the batch: example
    ``i``'s contribution is its row of the output's gradient (Perceiver's latents)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = Shared(), nn.Linear(4, 3)

        def forward(self, x):
            return self.head((x + self.shared(len(x))).sum(1))

    torch.manual_seed(0)
    x, y = torch.randn(6, 3, 4), torch.randint(0, 3, (6,))
    frame = cgn.check_model(Model().double(), x.double(), y, nn.CrossEntropyLoss(), verbose=False)
    row = frame.set_index("param").loc["shared.table"]
    assert row.rows and row.max_rel_error < 1e-10


def test_check_model_reports_rows_rule_and_error(capsys):
    torch.manual_seed(0)
    model = WithToken()
    model.unused = nn.Linear(2, 2)  # never called
    x, y = torch.randn(4, 3, 4), torch.randint(0, 3, (4,))
    frame = cgn.check_model(model, x, y, nn.CrossEntropyLoss())
    table = frame.set_index("param")
    assert table.loc["token", "how"].startswith("fallback (torch.func, WithToken")
    assert table.loc["scale.gamma", "how"].startswith("fallback (torch.func, Scaled")
    assert table.loc["linear.weight", "how"] == "native (Linear)"
    with_rows = table[table.rows]
    assert (with_rows.max_rel_error < 1e-12).all()
    assert set(table.index[~table.rows]) == {"unused.weight", "unused.bias"}
    assert table.loc["unused.weight", "note"].startswith("no gradient")
    used = table.elements[table.rows].sum()
    assert frame.attrs["coverage"] == used / table.elements.sum()
    printed = capsys.readouterr().out
    assert "token" in printed and "elements with rows" in printed


def test_check_model_leaves_the_model_alone():
    model = WithToken()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cgn.check_model(model, torch.randn(3, 3, 4), torch.randint(0, 3, (3,)), nn.CrossEntropyLoss(),
                    verbose=False)
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not model._forward_hooks


class NanoLayerNorm(nn.Module):
    """nanoGPT's ``LayerNorm``: weight and optional bias used directly in ``F.layer_norm``."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(ndim))
        self.bias = nn.Parameter(torch.randn(ndim)) if bias else None

    def forward(self, input):
        return nn.functional.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class AlmostScale(nn.Module):
    """Not a layer scale: ``x * gamma`` plus a little more."""

    def __init__(self, width):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.gamma + 1e-9 * x.square()


@pytest.mark.parametrize(
    "layer, how",
    [
        (lambda: NanoLayerNorm(4, bias=True), "native (NanoLayerNorm behaves as F.layer_norm, eps=1e-05)"),
        (lambda: NanoLayerNorm(4, bias=False), "native (NanoLayerNorm behaves as F.layer_norm, eps=1e-05)"),
        (lambda: AlmostScale(4), "fallback (torch.func, AlmostScale)"),
    ],
    ids=["nanogpt-layernorm", "nanogpt-layernorm-nobias", "almost-a-layer-scale"],
)
def test_look_alikes_get_the_closed_form_and_the_others_the_vmap(layer, how):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), layer(), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randn(5, 3, 4), torch.randint(0, 3, (5,))
    frame = cgn.check_model(model, x, y, nn.CrossEntropyLoss(), verbose=False).set_index("param")
    own = frame[frame.index.str.startswith("1.")]
    assert (own.how == how).all() and own.rows.all()
    assert (frame.max_rel_error < RTOL).all()


def test_a_prepared_model_with_the_fallback_copies_and_pickles():
    import pickle

    model = cgn.prepare_model(nn.Sequential(NanoLayerNorm(4, bias=True), Scaled(4)))
    copied = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert copied[0].cgn_fallback.closed_form == model[0].cgn_fallback.closed_form
    assert copied[0]._forward_hooks  # the capture hook came along


def test_check_model_compares_with_the_random_draws_of_the_batch():
    """In training mode with dropout: the reference runs through one pass of the batch,
    drawn from the same random state as the package's pass (a per-example rerun would
    draw other masks and report errors of order 1)."""
    torch.manual_seed(0)
    model = WithGated().train()
    x, y = torch.randn(5, 6, 3), torch.randint(0, 2, (5,))
    frame = cgn.check_model(model, x, y, nn.CrossEntropyLoss(), verbose=False)
    assert frame.rows.all()
    assert frame.max_rel_error.max() < 1e-12


def test_swin_attention_parameters_used_through_f_linear_get_exact_rows():
    """torchvision's ``ShiftedWindowAttention`` calls ``F.linear`` on its ``qkv`` and
    ``proj`` Linears' parameters and never the Linears (68.5% of swin_t's elements had rows
    before): on windows, the attention is its own block, computed with its
    ``relative_position_bias_table`` (recomputed per example at this first tracked step; from
    the batch's pass later: ``tests/test_swin_windows_torchvision.py``)."""
    from tests import matrix_models

    torch.manual_seed(0)
    model = matrix_models.torchvision_swin()
    x, y = torch.randn(3, 3, 16, 16), torch.randint(0, 3, (3,))
    frame = cgn.check_model(model, x, y, nn.CrossEntropyLoss(), verbose=False)
    assert frame.rows.all() and frame.attrs["coverage"] == 1.0
    assert frame.max_rel_error.max() < 1e-12
    borrowed = frame[frame.param.str.contains(r"attn\.(?:qkv|proj)\.")]
    assert len(borrowed) == 8 and borrowed.how.str.contains("its block ShiftedWindowAttention").all()


class EmbeddingDecoder(nn.Module):
    """Perceiver's ``PerceiverEmbeddingDecoder``: logits from the input embedding's weight,
    the layer passed in as an argument, plus a bias of its own (``mixing``: the batch's mean
    added, examples interact)."""

    def __init__(self, vocabulary, mixing=False):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(vocabulary))
        self.mixing = mixing

    def forward(self, hidden, embedding_layer):
        logits = hidden @ embedding_layer.weight.T + self.bias
        return logits + logits.mean(0, keepdim=True) if self.mixing else logits


class TiedThroughArgument(nn.Module):
    def __init__(self, vocabulary=7, width=4, mixing=False):
        super().__init__()
        self.embeddings, self.linear = nn.Embedding(vocabulary, width), nn.Linear(width, width)
        self.decoder = EmbeddingDecoder(vocabulary, mixing)

    def forward(self, tokens):
        return self.decoder(torch.tanh(self.linear(self.embeddings(tokens))), embedding_layer=self.embeddings)


def _tokens_loss(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("examples", [2, 5, 3])  # 3: the sequence length
def test_a_layer_passed_as_an_argument_to_a_module_is_exact_through_their_block(examples):
    """The decoder uses the embedding's weight directly, a use the embedding's rule does not
    see: the smallest batch-first module around both (the model) is run again on each example
    alone and gives both their rows (``regroup._receivers``); the other layers keep theirs."""
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 7, (examples, 3)), torch.randint(0, 7, (examples, 3))
    frame = cgn.check_model(TiedThroughArgument(), tokens, targets, _tokens_loss, verbose=False)
    rows = frame.set_index("param")
    assert frame.rows.all() and frame.attrs["coverage"] == 1.0, frame[["param", "note"]]
    assert (frame.max_rel_error < 1e-10).all(), frame
    assert rows.loc[["embeddings.weight", "decoder.bias"]].how.str.contains("its block").all()
    assert not rows.loc[["linear.weight", "linear.bias"]].how.str.contains("its block").any()


def test_a_layer_passed_to_a_module_mixing_the_examples_is_left_out_by_name():
    """Where the examples interact, the block's output for one alone differs: left out, named."""
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 7, (3, 3)), torch.randint(0, 7, (3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(TiedThroughArgument(mixing=True), tokens, targets, _tokens_loss, verbose=False)
    rows = frame.set_index("param")
    assert not rows.loc[["embeddings.weight", "decoder.bias"]].rows.any()
    assert rows.loc["embeddings.weight"].note
