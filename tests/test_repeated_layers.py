"""Issue 32, class 2: a layer called several times in one forward pass, its calls summed per example.

ALBERT's encoder calls one layer group ``num_hidden_layers`` times, LayoutLM one
position table for two edges of each box, a T5-style model its shared embedding
twice. Example ``i``'s contribution is the sum over the calls, ``x_i = sum_c x_i^(c)``
(``extensions/repeated.py``); before, the layers were left out ("ran several times
in one forward pass"). Here every parameter is exact against one backward pass per
example through a float64 forward pass of the batch on an un-prepared copy, for
GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale, with no
warning, at batch sizes 2, odd and the sequence length; the real ``transformers``
classes from tiny configurations; with gradient accumulation; and what stays refused.
"""

import copy
import dataclasses
import pickle
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import PerExampleSquaredNorms, SumsOfContributions
from cockpit_gradnoise.tracking import Tracker

import pytest
import torch
from backpack import backpack, extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.test_accumulation import accumulate, assert_steps_match, quantities, stored
from tests.test_silent_inexact import assert_exact
from tests.test_tied import assert_left_out_by_name

SEQUENCE, VOCAB, WIDTH = 5, 11, 6


class Tokens(nn.Module):
    """Token embeddings and a head over the mean of the positions."""

    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 3)


class ThreeCalls(Tokens):
    """A Linear, a LayerNorm and a Conv1d called three times, an Embedding twice."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)

    def forward(self, idx):
        h = self.embedding(idx) + self.embedding(idx.flip(1))
        for _ in range(3):
            h = torch.tanh(self.norm(self.lin(h)))
            h = h + torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h.mean(1))


class LinearThreeTimes(nn.Module):
    """The plain toy: one Linear called three times in a row."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        for _ in range(3):
            x = torch.tanh(self.lin(x))
        return self.head(x)


def tokens(examples, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, examples, SEQUENCE), generator=generator)


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_a_linear_called_three_times_is_exact(examples):
    torch.manual_seed(0)
    model = LinearThreeTimes().double()
    inputs, targets = torch.randn(examples, 4, dtype=torch.float64), torch.randint(0, 3, (examples,))
    assert_exact(model, inputs, targets)


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_linear_norm_convolution_and_embedding_called_several_times_are_exact(examples):
    torch.manual_seed(0)
    (inputs, _), targets = tokens(examples), torch.randint(0, 3, (examples,))
    assert_exact(ThreeCalls().double(), inputs, targets, inner_terms=3 * SEQUENCE)


class MaskedLM(nn.Module):
    """``logits`` of a ``transformers`` masked language model; ``boxes``: LayoutLM's
    ``bbox``, computed from the tokens inside the forward pass (each example its own)."""

    def __init__(self, model, boxes=False):
        super().__init__()
        self.model, self.boxes = model, boxes

    def forward(self, input_ids):
        kwargs = {}
        if self.boxes:
            left, top = input_ids % 8, (input_ids * 3) % 8  # (right, bottom below 16, never less)
            kwargs["bbox"] = torch.stack([left, top, left + 2 + input_ids % 3, top + 5], -1)
        return self.model(input_ids=input_ids, **kwargs).logits


class Pooled(nn.Module):
    """``AlbertModel``'s pooled output, for a classification loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).pooler_output


def without_key_biases(model):
    """``model`` with its attention keys' biases frozen: structural zeros (softmax ignores a
    shift of all of a query's scores), exact zeros here and rounding noise in the loop."""
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith("key.bias"))
    return model


def albert(head):
    """A tiny float64 ALBERT in evaluation mode: 3 layers sharing one group."""
    import transformers

    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=4, hidden_size=8, intermediate_size=12,
        num_hidden_layers=3, num_hidden_groups=1, num_attention_heads=2,
        max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(0)
    if head == "masked-lm":
        return without_key_biases(MaskedLM(transformers.AlbertForMaskedLM(config).double().eval()))
    return without_key_biases(Pooled(transformers.AlbertModel(config).double().eval()))


def layoutlm():
    import transformers

    config = transformers.LayoutLMConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16, max_2d_position_embeddings=16,
        attn_implementation="eager")
    torch.manual_seed(0)
    return without_key_biases(MaskedLM(transformers.LayoutLMForMaskedLM(config).double().eval(), boxes=True))


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_albert_masked_lm_sharing_one_layer_group_is_exact(examples):
    inputs, targets = tokens(examples)
    model = albert("masked-lm")
    names = [name for name, _ in model.named_parameters()]
    assert any("albert_layer_groups.0" in name for name in names)
    assert_exact(model, inputs, targets, token_losses("mean"), inner_terms=3 * SEQUENCE)


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_albert_model_pooled_is_exact(examples):
    (inputs, _), targets = tokens(examples), torch.randint(0, 3, (examples,))
    assert_exact(albert("model"), inputs, targets, inner_terms=3 * SEQUENCE)


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_layoutlm_position_tables_used_for_two_edges_are_exact(examples):
    inputs, targets = tokens(examples)
    assert_exact(layoutlm(), inputs, targets, token_losses("mean"), inner_terms=2 * SEQUENCE)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_of_a_layer_called_three_times_give_one_batch_of_all_their_examples(reduction):
    """Gradient accumulation (test_accumulation's recipe): 3 and 4 examples per step."""
    sizes, steps = (3, 4), 2
    torch.manual_seed(0)
    model = cgn.prepare_model(ThreeCalls().double())
    inputs, _ = tokens(steps * sum(sizes))
    targets = torch.randint(0, 3, (steps * sum(sizes),))
    loss_fn, per_example_loss = classification_losses(reduction)
    problem = Problem(model, extend(loss_fn), per_example_loss, inputs, targets, reduction)
    initial = dataclasses.replace(problem, model=copy.deepcopy(problem.model))
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem.names)), problem.names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumulate(problem, tracker, reduction, sizes)
    assert_steps_match(stored(tracker), initial, reduction, sizes, len(sizes))


def _problem(model, n):
    torch.manual_seed(0)
    loss_fn, per_example_loss = classification_losses("mean")
    (inputs, _), targets = tokens(n), torch.randint(0, 3, (n,))
    return Problem(cgn.prepare_model(model.double()), extend(loss_fn), per_example_loss,
                   inputs, targets, "mean")


class Positions(Tokens):
    """A position table called twice on ``arange(T)`` (applied without the batch dimension)."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Embedding(SEQUENCE, WIDTH)

    def forward(self, idx):
        steps = torch.arange(idx.shape[1])
        h = self.embedding(idx) + self.positions(steps) + self.positions(steps.flip(0))
        return self.head(torch.tanh(h).mean(1))


class TiedAndCalledTwice(Tokens):
    """An embedding called twice whose weight is also the head's (tied): each call one use of
    the tie (exact: tests/test_tied_calls.py)."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.embedding.weight

    def forward(self, idx):
        h = torch.tanh(self.embedding(idx) + self.embedding(idx.flip(1)))
        return self.head(self.out(h).mean(1)[:, :WIDTH])


@pytest.mark.parametrize("model, name, reason", [
    (Positions, "positions.weight", "ran several times .* applied without the batch dimension"),
])
@pytest.mark.parametrize("n", [3, SEQUENCE])
def test_calls_that_cannot_be_summed_are_left_out_by_name(model, name, reason, n):
    problem = _problem(model(), n)
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, name, rf"\['{name}'\].*{reason}")


def test_calls_of_two_forward_passes_are_not_summed():
    """Two forward passes, one backward pass of both losses: the calls of different forward
    passes are different examples, never added per row; the layer is left out by name."""
    problem = _problem(LinearThreeTimes(), 3)
    problem = dataclasses.replace(problem, inputs=torch.randn(3, 4, dtype=torch.float64))
    model = problem.model
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    first, second = model(problem.inputs), model(problem.inputs.flip(0))
    losses = problem.per_example_loss(first, problem.targets) + problem.per_example_loss(second, problem.targets)
    with pytest.warns(UserWarning) as caught:
        with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    message = " ".join(str(warning.message) for warning in caught)
    assert "['head.bias', 'head.weight', 'lin.bias', 'lin.weight']" in message
    assert "'lin.weight': its layer (Linear) ran several times in one forward pass, and its " \
        "calls belong to several forward passes" in message
    assert not cockpit.get_output()[0]["PerExampleGradNorm"]


def test_a_prepared_model_called_several_times_copies_and_pickles():
    model = cgn.prepare_model(LinearThreeTimes().double())
    x = torch.randn(3, 4, dtype=torch.float64)
    model(x).sum().backward()
    output = model(x)  # a pending forward pass: its calls stay with this model
    twin = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    assert torch.equal(twin(x), output)


def test_the_key_bias_of_a_shared_layer_is_an_exact_structural_zero():
    """As the native Linear rule gives it: sums over positions and calls that are rounding
    noise are exact zeros (sd 0), the query's bias, used, is not."""
    model = cgn.prepare_model(albert("masked-lm"))
    layer = model.model.albert.encoder.albert_layer_groups[0].albert_layers[0].attention
    layer.key.bias.requires_grad_(True)
    inputs, targets = tokens(3)
    loss = token_losses("mean")[0](model(inputs), targets)
    with backpack(SumsOfContributions(), PerExampleSquaredNorms()):
        loss.backward()
    assert not layer.key.bias.cgn_sums_of_contributions.any()
    assert not layer.key.bias.cgn_batch_l2.any()
    assert layer.query.bias.cgn_sums_of_contributions[1].all()


def test_backward_passes_in_a_row_without_a_tracker_each_sum_their_own_calls():
    """``with backpack(...)`` alone (no tracker starts a new record of the pass): each backward
    pass's results are its own, ``||x_i||^2`` the loop's, ``sum_i x_i`` the gradient."""
    torch.manual_seed(0)
    model = cgn.prepare_model(LinearThreeTimes().double())
    loss_fn, per_example_loss = classification_losses("sum")
    for step in range(3):
        x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
        model.zero_grad()
        with backpack(SumsOfContributions(), PerExampleSquaredNorms()):
            loss_fn(model(x), y).backward()
        weight = model.lin.weight
        torch.testing.assert_close(weight.cgn_sums_of_contributions[0], weight.grad, rtol=1e-12, atol=0)
        expected = torch.stack([torch.autograd.grad(per_example_loss(model(x[i : i + 1]), y[i : i + 1]).sum(),
                                                    weight)[0].square().sum() for i in range(3)])
        torch.testing.assert_close(weight.cgn_batch_l2, expected, rtol=1e-12, atol=0)
