"""Tables applied without the batch, followed to where they meet it, against float64 loops.

T5's relative position bias: ``table(buckets [q, k])`` permuted and unsqueezed to
``[1, H, q, k]`` and met by the batch in an addition, a ``torch.where`` with a padding
mask, a product, a subtraction with ``alpha`` or an ``expand``, after batch-free
operations (a causal ``torch.where``, a product by a number); or added (subtracted) in
place to a view of the batch's tensor, whole or a slice, once or twice (RoCBERT's
``embedding_in += position_embeddings``). Written small here, and
Hugging Face's ``T5EncoderModel`` and ``T5ForConditionalGeneration`` (the case matrix
has ``hf-t5``: padded encoder, SDPA, batch sizes 2 and ``q = k = B``): every
statistic of every parameter at batch sizes equal to the positions and not, and an
operation the package does not follow refused by name.

T5's LayerNorm computes in float32 even in a float64 model, also backwards, so its
batch gradient and ``c g_i`` round alike only where ``c`` is a power of two: odd
batches of the real T5 are compared at ``reduction="sum"``.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import batchless

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests import matrix_models
from tests.cases import Problem, classification_losses, run_step
from tests.helpers import assert_statistics_match
from tests.models import TokenCrossEntropy
from tests.test_tied import assert_left_out_by_name, assert_matches_references

LENGTH, VOCABULARY, WIDTH, HEADS = 4, 11, 6, 2


class BiasedAttention(nn.Module):
    """One attention layer with T5's relative position table on a ``[T, T]`` bucket index,
    ``[1, H, T, T]`` after ``permute`` and ``unsqueeze``, met by the batch as ``how`` says."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.wte, self.table = nn.Embedding(VOCABULARY, WIDTH), nn.Embedding(5, HEADS)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)  # a key bias: gradient 0
        self.head = nn.Linear(WIDTH, VOCABULARY)

    def forward(self, idx):
        n, length = idx.shape
        positions = torch.arange(length)
        buckets = (positions[None, :] - positions[:, None]).clamp(-2, 2) + 2
        bias = self.table(buckets).permute(2, 0, 1).unsqueeze(0)
        x = self.wte(idx)
        q, k, v = self.qkv(x).view(n, length, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = self._met(q @ k.transpose(-1, -2), bias, idx, positions)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, length, WIDTH)
        return self.head(torch.tanh(x + y))

    def _met(self, scores, bias, idx, positions):
        if self.how == "added, reused":  # as T5 reuses it in every layer, one scaled
            return scores + bias + (bias * 0.5).transpose(-1, -2)
        # T5 with SDPA: the batch's padding mask meets it (the encoder), or a batch-free causal
        # mask comes first (the decoder). T5 puts the dtype's minimum where masked, whose
        # scores then have a zero gradient; 0 here, so that the mask matters.
        if self.how == "padding where":
            return scores + torch.where((idx != 0)[:, None, None, :], bias, 0.0)
        if self.how == "causal where, added":
            causal = (positions[:, None] >= positions[None, :]).view(1, 1, *scores.shape[-2:])
            return scores + torch.where(causal, bias, 0.0).contiguous()
        if self.how == "multiplied":
            return scores * bias
        if self.how == "subtracted":
            return torch.sub(scores, bias, alpha=0.5)
        if self.how == "expanded":
            return scores + bias.expand(len(idx), -1, -1, -1)
        if self.how == "sigmoid":  # batch-free, but not an operation the package follows
            return scores + bias.sigmoid()
        return self._met_in_place(scores, bias)

    def _met_in_place(self, scores, bias):
        """Added in place to a view of the batch's tensor, as RoCBERT adds its position table
        to its Linear's output (autograd's ``CopySlices``; a second in-place operation sees
        the view through the ``as_strided`` autograd regenerates)."""
        if self.how in ("added in place to a view", "subtracted in place twice"):
            view = (scores * 1.0).reshape(-1).view(scores.shape)
            if self.how == "added in place to a view":
                view += bias
            else:
                view -= bias
                view.sub_(bias * 0.5, alpha=2.0)
            return view
        if self.how == "added in place to a slice":  # a view of part of its base
            both = torch.cat([scores, scores[:, :1]], 1)
            both[:, :HEADS] += bias
            return both[:, :HEADS] * both[:, HEADS:]
        if self.how == "multiplied in place":  # not followed
            view = (scores * 1.0).reshape(-1).view(scores.shape)
            view *= bias
            return view
        raise ValueError(self.how)


def _token_problem(model, n, reduction):
    torch.manual_seed(0)
    model = cgn.prepare_model(model.double())
    idx = torch.randint(0, VOCABULARY, (n, LENGTH))
    idx[0, 1] = 0  # a padded key in every batch
    return Problem(model, extend(TokenCrossEntropy(reduction)),
                   TokenCrossEntropy("none", per_token=reduction), idx,
                   torch.randint(0, VOCABULARY, (n, LENGTH)), reduction)


@pytest.mark.parametrize("how", ["added, reused", "padding where", "causal where, added",
                                 "multiplied", "subtracted", "expanded", "added in place to a view",
                                 "subtracted in place twice", "added in place to a slice"])
@pytest.mark.parametrize("n", [LENGTH, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_relative_position_table_is_exact_where_it_meets_the_batch(how, n, reduction):
    problem = _token_problem(BiasedAttention(how), n, reduction)
    assert_matches_references(problem, inner_terms=LENGTH * LENGTH)


@pytest.mark.parametrize("how, reason", [
    ("sigmoid", r"index \(shape \(4, 4\)\).*does not follow \(SigmoidBackward0\)"),
    ("multiplied in place", r"index \(shape \(4, 4\)\).*in-place operation on a view.*CopySlices")])
@pytest.mark.parametrize("n", [LENGTH, 3])
def test_a_table_through_an_operation_not_followed_is_refused_by_name(how, reason, n):
    problem = _token_problem(BiasedAttention(how), n, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, "table.weight", r"\['table.weight'\].*" + reason)


def test_a_fused_attention_kernel_is_named_with_the_fix():
    reason = batchless._why_not((4, 4), "ScaledDotProductEfficientAttentionBackward0")
    assert "fused attention kernel (ScaledDotProductEfficientAttentionBackward0)" in reason
    assert "SDPBackend.MATH" in reason and "attn_implementation='eager'" in reason


# Hugging Face's T5 ---------------------------------------------------------------------------
T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH = 13, 4, 3


class T5Classifier(nn.Module):
    """``T5EncoderModel`` on ``[N, 2, T]`` (ids, attention mask), a Linear on its mean state."""

    def __init__(self):
        super().__init__()
        from transformers import T5EncoderModel

        self.encoder = T5EncoderModel(matrix_models.t5_config(T5_VOCABULARY))
        self.head = nn.Linear(16, matrix_models.CLASSES)

    def forward(self, batch):
        ids, mask = batch.unbind(1)
        return self.head(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.mean(1))


@pytest.mark.parametrize("n, reduction", [(2, "mean"), (T5_LENGTH, "mean"), (T5_LENGTH, "sum"),
                                          (7, "sum")])
def test_t5_encoder_with_padding_is_exact(n, reduction):
    torch.manual_seed(0)
    model = cgn.prepare_model(T5Classifier().double().eval())
    batch = matrix_models.t5_batch(n, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH)[:, :2]
    loss_fn, per_example_loss = classification_losses(reduction)
    problem = Problem(model, extend(loss_fn), per_example_loss, batch,
                      torch.randint(0, matrix_models.CLASSES, (n,)), reduction)
    assert_matches_references(problem, inner_terms=T5_LENGTH * T5_LENGTH)


@pytest.mark.parametrize("attention, n", [("eager", T5_DECODER_LENGTH), ("eager", T5_LENGTH),
                                          ("sdpa", 5)])
def test_t5_for_conditional_generation_is_exact(attention, n):
    """Eager attention adds the bias to the scores; SDPA at an odd batch size (the case
    matrix has 2 and q = k = B)."""
    torch.manual_seed(0)
    model = cgn.prepare_model(
        matrix_models.t5(T5_VOCABULARY, T5_DECODER_LENGTH, attention).double())
    batch = matrix_models.t5_batch(n, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH)
    problem = Problem(model, extend(TokenCrossEntropy("sum")),
                      TokenCrossEntropy("none", per_token="sum"), batch,
                      torch.randint(0, T5_VOCABULARY, (n, T5_DECODER_LENGTH)), "sum")
    assert_matches_references(problem, inner_terms=3 * T5_LENGTH)


def test_t5_bias_meets_the_batch_once_in_every_layer():
    """The bias of each stack is reused by its two layers: two meetings each."""
    torch.manual_seed(0)
    model = cgn.prepare_model(matrix_models.t5(T5_VOCABULARY, T5_DECODER_LENGTH).double())
    model(matrix_models.t5_batch(3, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH))
    uses = model.__dict__[cgn.extensions.uses.USES_ATTR]
    tables = {name: module for name, module in model.named_modules()
              if name.endswith("relative_attention_bias")}
    assert len(tables) == 2
    for module in tables.values():
        assert len(uses.broadcasts[module].meetings) == 2


@pytest.mark.parametrize("how", ["added, reused", "padding where"])
def test_one_example_has_the_batch_gradient_for_its_own(how):
    """A batch of one: nothing to follow; the table's per-example norm is its gradient's."""
    problem = _token_problem(BiasedAttention(how), 1, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), quantiles=(0.5,), param_names=problem.names)
    got = run_step(problem, [quantity]).get_output()[0]["PerExampleGradNorm"]
    expected = references.per_example_grad_norm(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets, quantiles=(0.5,))
    assert_statistics_match(got, expected)


def test_the_checker_finds_t5_exact():
    """``cgn.check_model`` on T5 as published: every row (T5's 12 LayerNorms by their
    native rule), and its reference counts the encoder once although the outputs hold
    both the logits and the encoder's last state."""
    torch.manual_seed(0)
    model = matrix_models.t5(T5_VOCABULARY, T5_DECODER_LENGTH).model.double()
    batch = matrix_models.t5_batch(3, T5_VOCABULARY, T5_LENGTH, T5_DECODER_LENGTH)
    inputs = (batch[:, 0], batch[:, 1], batch[:, 2, :T5_DECODER_LENGTH])
    targets = torch.randint(0, T5_VOCABULARY, (3, T5_DECODER_LENGTH))

    def loss_fn(outputs, targets):
        return nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())

    table = cgn.check_model(model, inputs, targets, loss_fn, verbose=False)
    assert table.rows.all() and (table.max_rel_error < 1e-12).all()
    assert table.attrs["coverage"] == 1.0
    norms = table[table.param.str.contains("layer_norm")]
    assert len(norms) == 12 and (norms.how == "native (T5LayerNorm, transformers rule)").all()
