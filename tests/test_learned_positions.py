"""Issue 32, class 4 (a): learned positions that an embedding subclass looks up from ``arange``.

BART's and mBART's ``BartLearnedPositionalEmbedding`` / ``MBartLearnedPositionalEmbedding``
(``nn.Embedding`` subclasses) take the tokens and look up ``arange(T) + 2``: expanded over
the batch in the encoder, ``[1, T]`` in the decoder (its ``position_ids``), broadcast over
the batch by the addition to the token embeddings. The decoder's table was left out
("none of its inputs leads with the batch dimension"). Its call returns ``F.embedding``'s own
result on its weight, so it now gets ``nn.Embedding``'s rule with the index its forward built
(``extensions/own_index.py``) and, without the batch, each example's gradient where the output
meets the batch (``extensions/batchless.py``): exact against one backward pass per example on
an un-prepared float64 copy, for GradientVarianceQuantiles, PerExampleGradNorm and
GradientNoiseScale, at batch sizes 2, 3 and the sequence length, with no warning.
"""

import cockpit_gradnoise as cgn

import pytest
import torch

from tests.cases import token_losses
from tests.test_embedding_subclasses import Seq2Seq
from tests.test_regroup import assert_exact_with_structural_zeros, perturbed

SEQUENCE, VOCAB = 5, 13


def seq2seq(family):
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager")
    return Seq2Seq(perturbed(getattr(transformers, f"{family}ForConditionalGeneration")(config)))


def tokens(examples):
    generator = torch.Generator().manual_seed(examples)
    source_and_target = torch.randint(3, VOCAB, (examples, 2, SEQUENCE), generator=generator)
    return source_and_target, source_and_target[:, 1]


@pytest.mark.parametrize("family", ["Bart", "MBart"])
@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_learned_positions_built_from_arange_are_exact(family, examples):
    inputs, targets = tokens(examples)
    assert_exact_with_structural_zeros(seq2seq(family), inputs, targets, token_losses("mean"),
                                       inner_terms=SEQUENCE)


def test_the_checker_says_how_the_positions_are_computed():
    inputs, targets = tokens(3)
    frame = cgn.check_model(seq2seq("Bart"), inputs, targets, token_losses("mean")[0], verbose=False)
    positions = frame[frame.param.str.endswith("embed_positions.weight")]
    assert len(positions) == 2 and positions.rows.all()
    assert (positions.how == "native (Embedding, the index BartLearnedPositionalEmbedding's forward builds)").all()
    assert (positions.max_rel_error < 1e-12).all()


def prophetnet():
    from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration

    config = ProphetNetConfig(
        vocab_size=32, hidden_size=8, encoder_ffn_dim=12, decoder_ffn_dim=12, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=2, num_decoder_attention_heads=2,
        max_position_embeddings=16, ngram=2, num_buckets=4, relative_max_distance=8, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)
    return Seq2Seq(ProphetNetForConditionalGeneration(config)).eval()


# ProphetNet's decoder calls its position table (the index built inside: its rule applies) and
# looks it up again through ``_forward``, outside any call a hook sees: the rule alone would
# miss that use (silently inexact). The decoder's n-gram table is read directly (``.weight``).
# Both were left out by name; now the decoder is their block, run on each example alone, which
# follows its second output (the loss reads it, not the first: tests/test_block_outputs.py).
# The encoder's table, called once, keeps its rule. N = 6: the batch as long as the sequence.
@pytest.mark.parametrize("examples", [3, 6])
def test_a_table_also_used_outside_its_call_gets_rows_from_its_block(examples):
    batch = torch.randint(2, 32, (examples, 2, 6), generator=torch.Generator().manual_seed(4))
    model = perturbed(prophetnet())
    frame = cgn.check_model(model, batch, batch[:, 1], token_losses("mean")[0], verbose=False)
    table = frame.set_index("param")
    decoder, encoder = (f"model.prophetnet.{part}.position_embeddings.weight" for part in ("decoder", "encoder"))
    ngram = "model.prophetnet.decoder.ngram_embeddings.weight"
    assert table.rows.all(), table.note[~table.rows]
    assert "its block ProphetNetDecoder" in table.how[decoder] and "its block ProphetNetDecoder" in table.how[ngram]
    assert "its block" not in table.how[encoder] and table.max_rel_error[encoder] < 1e-12
    # every row exact; a gradient zero by structure (a key's bias) against the network's scale
    errors = table.max_rel_error * table.reference_scale / table.reference_scale.max()
    relative = table.max_rel_error.where(table.reference_scale > 1e-8 * table.reference_scale.max(), errors)
    assert (relative[table.rows] < 1e-10).all(), relative[table.rows].sort_values().tail()
