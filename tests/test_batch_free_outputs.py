"""Modules with the torch.func fallback whose outputs include one without a gradient per example.

Transformers' ``GPTNeoXJapaneseAttention`` returns ``(output, weights, self.dense_bias)``
and its parent adds the bias to the hidden states. The hooks hand the fallback the first
output's gradient only, and the bias's gradient there would be the whole batch's sum
anyway (the bias has no batch dimension): the fallback gave ``dense_bias`` zeros as its
rows, a wrong number with no warning. A parameter that reaches such an output is now
left out with a warning naming it; the others keep exact rows (float64 references:
``check.reference_contributions``). A parameter returned as it is (``self.dense_bias``)
is seen by the model run on one example more (``extensions/fallback/regroup.py``): the
smallest module around it that takes and returns the batch first (GPT-NeoX-Japanese's
layer) is run again on each example alone, and it is exact too. Also: a later output of a tuple that is per example
(exact: its gradient is kept by a tensor hook), and a first output without the batch
dimension whose leading size equals the batch size (refused).
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.library_models import Logits
from tests.test_silent_inexact import assert_exact
from tests.test_tied import assert_left_out_by_name, assert_matches_references

BLIND = r"reaches an output of its module that has no gradient per example"


class ReturnsBias(nn.Module):
    """A layer scale that returns its bias for the parent to add (as GPT-NeoX-Japanese's
    attention); ``per_example_second``: returns ``x * gamma * beta`` instead, per example."""

    def __init__(self, width, per_example_second=False, computed=False):
        super().__init__()
        self.gamma, self.beta = nn.Parameter(torch.randn(width)), nn.Parameter(torch.randn(width))
        self.per_example_second, self.computed = per_example_second, computed

    def forward(self, x):
        if self.per_example_second:
            return x * self.gamma, x * self.gamma * self.beta
        return x * self.gamma, 2 * self.beta if self.computed else self.beta


class AddsBias(nn.Module):
    def __init__(self, width=5, per_example_second=False, uses_second=True, computed=False):
        super().__init__()
        self.block, self.head = ReturnsBias(width, per_example_second, computed), nn.Linear(width, 3)
        self.uses_second = uses_second

    def forward(self, x):
        y, b = self.block(x)
        return self.head(torch.tanh(y + b.expand_as(y) if self.uses_second else y))


class Table(nn.Module):
    """Returns a learned table ``[rows, width]`` whatever its input (its output has no batch
    dimension); with ``rows`` the batch size, its gradient there looks per example."""

    def __init__(self, rows, width):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, width))

    def forward(self, x):
        return self.table


class AddsTable(nn.Module):
    def __init__(self, rows=4, width=5):
        super().__init__()
        self.scale, self.table, self.head = nn.Parameter(torch.randn(width)), Table(rows, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.tanh(x * self.scale + self.table(x)[None, 0]))


def assert_exact_but(model, inputs, targets, left_out, match, losses=None):
    """``left_out`` is left out by the quantities with a warning matching ``match``, the step
    kept; every other parameter's GradientVarianceQuantiles, PerExampleGradNorm and
    GradientNoiseScale equal their float64 references."""
    loss_fn, per_example_loss = losses or classification_losses("mean")
    contributions = check.reference_contributions(copy.deepcopy(model), (inputs,), targets, loss_fn)
    grads = {name: x * len(inputs) for name, x in contributions.items() if name != left_out}
    problem = Problem(cgn.prepare_model(model), loss_fn, per_example_loss, inputs, targets, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, left_out, match)
    assert_matches_references(problem, inner_terms=1, grads=grads)


@pytest.mark.parametrize("batch", [3, 5])
def test_a_bias_computed_for_the_parent_to_add_is_left_out_by_name(batch):
    """Computed (``2 * beta``: its gradient, ``[5]``, leads with the batch size at batch 5,
    and is the batch's sum all the same)."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(batch, 5, dtype=torch.float64), torch.randint(0, 3, (batch,))
    assert_exact_but(AddsBias(computed=True).double(), inputs, targets, "block.beta",
                     r"ReturnsBias\.beta.*" + BLIND)


@pytest.mark.parametrize("batch", [3, 5])
def test_a_bias_returned_as_it_is_is_exact_through_its_parents_block(batch):
    """Returned as it is (a leaf: no hook on it), at batch 5 its own size."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(batch, 5, dtype=torch.float64), torch.randint(0, 3, (batch,))
    assert_exact(AddsBias().double(), inputs, targets)


@pytest.mark.parametrize("uses_it", [True, False])
@pytest.mark.parametrize("batch", [3, 5])
def test_a_later_output_per_example_is_exact_used_or_not(batch, uses_it):
    """``x * gamma * beta`` as a second output: its gradient (kept by a tensor hook; the hooks
    hand over the first output's only) gives exact rows; unused by the parent, it reaches
    no loss and takes nothing (``gamma`` exact through the first output, ``beta`` unused)."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(batch, 5, dtype=torch.float64), torch.randint(0, 3, (batch,))
    assert_exact(AddsBias(per_example_second=True, uses_second=uses_it).double(), inputs, targets)


class SinkAttention(nn.Module):
    """Attention with a learned sink logit per head (gpt-oss, DeepSeek-V4, HY-V4), returning
    ``(output, weights)`` as transformers' attention modules do: the weights, a later output,
    also lead to the first output inside the module."""

    def __init__(self, heads=2, head_width=3):
        super().__init__()
        self.heads, self.head_width = heads, head_width
        self.q = nn.Linear(heads * head_width, heads * head_width)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, self.heads, self.head_width).transpose(1, 2)
        logits = q @ q.transpose(-1, -2)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        weights = torch.cat([logits, sinks], -1).softmax(-1)[..., :-1]
        return (weights @ q).transpose(1, 2).reshape(batch, length, -1), weights


class UsesAttention(nn.Module):
    def __init__(self, uses_weights):
        super().__init__()
        self.attention, self.head, self.uses_weights = SinkAttention(), nn.Linear(6, 3), uses_weights

    def forward(self, x):
        out, weights = self.attention(x)
        pooled = out.mean(1) + (weights.sum((1, 2, 3))[:, None] if self.uses_weights else 0)
        return self.head(pooled)


@pytest.mark.parametrize("uses_weights", [False, True])
@pytest.mark.parametrize("batch", [3, 4])
def test_a_later_output_that_leads_to_the_first_is_counted_once(batch, uses_weights):
    """The weights' gradient is kept from outside the module only (a hook on the tensor
    itself also saw the gradient flowing back through the output: the sinks' rows were
    twice their value, relative error 3.0, in DeepSeek-V4 and HY-V4)."""
    torch.manual_seed(0)
    inputs = torch.randn(batch, 5, 6, dtype=torch.float64)
    assert_exact(UsesAttention(uses_weights).double(), inputs, torch.randint(0, 3, (batch,)))


@pytest.mark.parametrize("batch", [4, 3])
def test_a_first_output_without_the_batch_dimension_is_exact_through_its_block(batch):
    """At batch 4 the table's gradient ``[4, 5]`` leads with the batch size: never taken for
    rows (it was refused; .fallback.regroup now finds the output without the batch, and the
    smallest module around it that takes and returns the batch first, here the model, is run
    again on each example alone)."""
    torch.manual_seed(0)
    inputs, targets = torch.randn(batch, 5, dtype=torch.float64), torch.randint(0, 3, (batch,))
    assert_exact(AddsTable().double(), inputs, targets)


def gpt_neox_japanese():
    """``GPTNeoXJapaneseForCausalLM``, two layers: the last one's attention has ``dense_bias``."""
    from transformers import GPTNeoXJapaneseConfig, GPTNeoXJapaneseForCausalLM

    config = GPTNeoXJapaneseConfig(
        vocab_size=13, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_multiple_size=2, max_position_embeddings=16, attention_dropout=0.0,
        hidden_dropout=0.0)
    torch.manual_seed(0)
    model = GPTNeoXJapaneseForCausalLM(config).double()
    with torch.no_grad():  # away from the zeros of its initialization
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return Logits(model)


# 2, odd, the sequence length (6).
@pytest.mark.parametrize("batch", [2, 3, 6])
def test_gpt_neox_japanese_dense_bias_is_exact(batch):
    torch.manual_seed(1)
    inputs, targets = torch.randint(0, 13, (batch, 6)), torch.randint(0, 13, (batch, 6))
    model = gpt_neox_japanese()
    assert "model.gpt_neox_japanese.layers.1.attention.dense_bias" in dict(model.named_parameters())
    assert_exact(model, inputs, targets, losses=token_losses("mean"))


def test_the_checker_names_why_a_returned_bias_has_no_rows():
    torch.manual_seed(0)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match=BLIND):
        frame = cgn.check_model(AddsBias(computed=True), x, y, nn.CrossEntropyLoss(), verbose=False)
    rows = frame.set_index("param")
    assert not rows.loc["block.beta"].rows and "no gradient per example" in rows.loc["block.beta"].note
    assert rows.loc["block.gamma"].rows and rows.loc["block.gamma"].max_rel_error < 1e-10
