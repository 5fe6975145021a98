"""Embeddings looked up at an index the forward builds from the input's shape.

MarkupLM builds its XPath indices as ``torch.full((N, T, depth), pad)`` when none are
given, RoCBERT its shape and pronunciation indices as ``torch.zeros(N, T)``; their outputs
are concatenated with the batch's (``torch.cat(..., -1)``), which the package does not
follow, so they were left out ("its index (shape (4, 7)) is not an input of the model"):
no shape tells that ``N`` from a ``T`` equal to it. The model run on one example more
(``extensions/fallback/regroup.py``, before the first tracked step) does: an embedding whose
output leads with ``N`` and then ``N + 1`` has one row per example, and its index is read
per example; one whose leading size stays (a table of the positions, ``T`` = ``N``) is
still refused by name. Exact against one backward pass per example on an un-prepared
float64 copy, for GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale, at
batch sizes 2, odd and the sequence length.
"""

import pytest
import torch
from torch import nn

from tests.models import LogitsOf
from tests.test_regroup import assert_exact_with_structural_zeros, perturbed

SEQUENCE, VOCAB = 5, 11


class BuiltIndex(nn.Module):
    """Token embeddings with a table looked up at an index the forward builds: per example
    (``torch.full((N, T), 2)``, concatenated), or of the positions (``(T, T)``), added to
    every example through a cumulative sum (an operation the package does not follow)."""

    def __init__(self, per_example: bool):
        super().__init__()
        self.per_example = per_example
        self.wte, self.table = nn.Embedding(VOCAB, 4), nn.Embedding(3, 4)
        self.head = nn.Linear(SEQUENCE * (8 if per_example else 4), 3)

    def forward(self, idx):
        n, length = idx.shape
        if self.per_example:
            built = self.table(torch.full((n, length), 2, dtype=torch.long))
            x = torch.cat([self.wte(idx), built], -1)
        else:
            positions = self.table(torch.ones(length, length, dtype=torch.long)).cumsum(0)[:, 0]
            x = self.wte(idx) + positions
        return self.head(torch.tanh(x).flatten(1))


def tokens(examples):
    generator = torch.Generator().manual_seed(examples)
    return (torch.randint(1, VOCAB, (examples, SEQUENCE), generator=generator),
            torch.randint(0, 3, (examples,), generator=generator))


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_an_index_built_per_example_is_read_per_example(examples):
    assert_exact_with_structural_zeros(perturbed(BuiltIndex(per_example=True)), *tokens(examples))


def test_an_index_of_the_positions_is_still_refused_where_t_equals_the_batch():
    assert_exact_with_structural_zeros(perturbed(BuiltIndex(per_example=False)), *tokens(SEQUENCE),
                                       left_out="table.weight", match=r"index \(shape \(5, 5\)\)")


def without_key_biases(model):
    """The attention keys' biases frozen: their gradient is zero by structure (softmax ignores
    a shift of every score of a query), rounding noise in the reference and in the rows alike,
    which no comparison of norms tells apart (not this test's subject)."""
    for name, param in model.named_parameters():
        if name.endswith("key.bias"):
            param.requires_grad_(False)
    return model


def markuplm():
    from transformers import MarkupLMConfig, MarkupLMForSequenceClassification

    config = MarkupLMConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8, max_position_embeddings=16, max_depth=2,
                            max_xpath_tag_unit_embeddings=4, max_xpath_subs_unit_embeddings=4,
                            xpath_unit_hidden_size=4, tag_pad_id=3, subs_pad_id=3, num_labels=3,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return without_key_biases(LogitsOf(perturbed(MarkupLMForSequenceClassification(config))))


def roc_bert():
    from transformers import RoCBertConfig, RoCBertForSequenceClassification

    config = RoCBertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=16, pronunciation_vocab_size=5,
                           pronunciation_embed_dim=4, shape_vocab_size=5, shape_embed_dim=4,
                           num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return without_key_biases(LogitsOf(perturbed(RoCBertForSequenceClassification(config))))


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_markuplm_xpath_embeddings_are_exact(examples):
    model = markuplm()
    assert any("xpath_tag_sub_embeddings" in name for name, _ in model.named_parameters())
    assert_exact_with_structural_zeros(model, *tokens(examples))


@pytest.mark.parametrize("examples", [2, SEQUENCE])
def test_roc_bert_shape_pronunciation_and_position_embeddings_are_exact(examples):
    """Its position table (index ``(1, T)``) is added in place to the projection's output, a
    view of its matrix product (``torch::autograd::CopySlices``, after the token types' own
    in-place addition): followed to that meeting (``extensions/meetings.py``), exact."""
    model = roc_bert()
    assert {"model.roc_bert.embeddings.shape_embed.weight",
            "model.roc_bert.embeddings.pronunciation_embed.weight",
            "model.roc_bert.embeddings.position_embeddings.weight"} <= dict(model.named_parameters()).keys()
    assert_exact_with_structural_zeros(model, *tokens(examples))
