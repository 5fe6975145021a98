"""Issue 32: models whose layers run sequence-first (``[T, N, C]``), XLNet's and FSMT's.

``transformers``' XLNet transposes ``input_ids`` to ``[T, N]`` before its word embedding
and runs every layer on ``[T, N, C]`` (its attention by einsum ``ibnd,jbnd->bnij``); FSMT's
encoder and decoder layers take ``[T, N, C]``. Their first tracked step was lost: most
layers' rows lead with ``T``, the count check took that for the batch
(``info['individual_losses'] has 4 values but the batch has 7 examples``). The run one
example larger (``extensions/fallback/regroup.py``) finds those layers, the embedding on the
transposed indices among them (its output ``[T, N, C]`` grows in its second dimension: not
a table without the batch), and the smallest module around them that takes and returns the
batch first, holding every layer of a tied weight (the LM head sharing the word embedding),
is run again on each example alone (``extensions/fallback/blocks.py``): every parameter exact
against one backward pass per example in float64, at ``N = 2``, odd and ``N = T``.
"""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch
from torch import nn

from experiments import architecture_sweep
from tests.cases import token_losses
from tests.helpers import rows
from tests.library_models import Logits
from tests.test_regroup import VOCAB, assert_exact_with_structural_zeros, perturbed, tokens

LENGTH = 5


def xlnet(tie=True, dropout=0.0):
    """A tiny ``XLNetLMHeadModel`` (head tied to the word embedding by default); the
    parameters a plain LM step never reaches (``mask_emb`` for ``target_mapping``,
    ``seg_embed`` and ``r_s_bias`` for ``token_type_ids``) frozen."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    config = XLNetConfig(vocab_size=VOCAB, d_model=4, n_layer=1, n_head=2, d_head=2, d_inner=8,
                         dropout=dropout, tie_word_embeddings=tie)
    model = perturbed(XLNetLMHeadModel(config))
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith(("mask_emb", "seg_embed", "r_s_bias")))
    return Logits(model)


@pytest.mark.parametrize("examples, tie", [(2, True), (LENGTH, True), (3, False)])
def test_xlnet_is_exact(examples, tie):
    inputs, targets = tokens(examples, length=LENGTH)
    assert_exact_with_structural_zeros(xlnet(tie), inputs, targets, token_losses("mean"), inner_terms=LENGTH)


def _tracked_step(model, inputs, targets, losses_of):
    """One step of ``cgn.track(model, every=1)`` (PerExampleGradNorm alone) with the losses
    ``losses_of(logits)``; its PerExampleGradNorm rows and the warnings it gave."""
    model, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
    logits = model(*inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tracker(0, losses_of(logits)) as loss:
            loss.backward()
    return rows(tracker.cockpit, "PerExampleGradNorm"), [str(w.message) for w in caught]


def _per_example(logits, targets):
    return token_losses("none")[0](logits, targets)


@pytest.mark.parametrize("examples", [2, 3, LENGTH])
def test_xlnet_in_training_mode_with_dropout_is_exact(examples):
    """Dropout draws other masks for an example alone than in the batch: the block run again on
    each example is given its part of the batch's masks (``extensions/fallback/draws.py``; the
    masks are sequence-first, ``[T, N, C]``, sliced along their second dimension). Every
    parameter exact against ``check_model``'s reference, which replays the batch's draws."""
    model = xlnet(dropout=0.3).train()
    inputs, targets = tokens(examples, length=LENGTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(model, (inputs,), targets, token_losses("mean")[0], verbose=False)
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert frame.max_rel_error.max() < 1e-10
    assert frame[frame.param != "model.lm_loss.bias"].how.str.contains("block").all()


def test_xlnet_in_training_mode_tracks_every_parameter():
    """A tracked step in training mode with dropout: every trained parameter has rows, no
    warning, the step kept."""
    model = xlnet(dropout=0.1).train()
    inputs, targets = tokens(3, length=LENGTH)
    got, messages = _tracked_step(model, (inputs,), targets, lambda logits: _per_example(logits, targets))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trained | {cgn.NETWORK}
    assert not [m for m in messages if "cockpit-gradnoise" in m], messages


@pytest.mark.parametrize("count", ["tokens", "length"])
def test_a_loss_count_that_is_not_the_batch_still_raises(count):
    """The count check stays: per-token losses (``N*T`` values) or ``T`` values (the leading
    size of XLNet's layers) are refused, naming the batch's ``N`` from the layers' rows,
    which the blocks give one row per example. It cannot pass a wrong count silently: every
    row comes from a layer whose output led with ``N`` and then ``N + 1`` in the survey's
    run one example larger (``regroup.rows_are_examples``), or from a block run on ``N``
    examples alone."""
    examples = 2
    model = xlnet()
    inputs, targets = tokens(examples, length=LENGTH)

    def wrong(logits):
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return per_token if count == "tokens" else per_token.view(examples, LENGTH).mean(0)

    values = examples * LENGTH if count == "tokens" else LENGTH
    with pytest.raises(ValueError, match=rf"has {values} values but the batch has {examples} examples"):
        _tracked_step(model, (inputs,), targets, wrong)


class Translation(nn.Module):
    """``model(input_ids, decoder_input_ids).logits`` of a Hugging Face seq2seq model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False).logits


def fsmt():
    """A tiny ``FSMTForConditionalGeneration`` in float32 (its ``fill_with_neg_inf`` overflows
    in float64: the sweep's ``FLOAT32_ONLY``), away from its initialization's zeros."""
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    config = FSMTConfig(langs=["en", "de"], src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, d_model=8,
                        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8,
                        max_position_embeddings=16, dropout=0.0)
    torch.manual_seed(0)
    model = FSMTForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return Translation(model)


def test_fsmt_keeps_its_first_step_with_every_row_exact_to_float32():
    """Its encoder and decoder layers take ``[T, N, C]``: each of the two is run again on each
    example alone. The tracked step is kept with no warning, every parameter has rows, and the
    checker agrees (float32 per-example loop, the sweep's classification: ``FLOAT32_TOLERANCE``
    relative, structural zeros against the network's scale)."""
    generator = torch.Generator().manual_seed(1)
    examples = 3
    inputs = (torch.randint(3, VOCAB, (examples, LENGTH), generator=generator),
              torch.randint(3, VOCAB, (examples, LENGTH - 1), generator=generator))
    targets = torch.randint(0, VOCAB, (examples, LENGTH - 1), generator=generator)
    frame = cgn.check_model(fsmt(), inputs, targets, token_losses("mean")[0], verbose=False,
                            dtype=torch.float32)
    model = fsmt()
    record = architecture_sweep.classify(frame, architecture_sweep.float32_model(model))
    assert record["status"] == "exact to float32" and record["coverage"] == 1.0, record
    got, messages = _tracked_step(model, inputs, targets, lambda logits: _per_example(logits, targets))
    assert not messages
    trained = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    assert set(got) == trained | {cgn.NETWORK}


class PaddedLookup(nn.Module):
    """An embedding that is no ``nn.Embedding`` (as I-BERT's ``QuantEmbedding``)."""

    def __init__(self, vocab, width, padding_idx):
        super().__init__()
        self.weight, self.padding_idx = nn.Parameter(torch.randn(vocab, width)), padding_idx

    def forward(self, idx):
        return nn.functional.embedding(idx, self.weight, self.padding_idx)


class PaddedSequenceFirst(nn.Module):
    """XLNet's pattern in a few lines: the indices transposed to ``[T, N]`` before an
    embedding with a ``padding_idx``, a layer on ``[T, N, C]``; batch-first outside."""

    def __init__(self, width=4, lookup=nn.Embedding):
        super().__init__()
        self.embed = lookup(VOCAB, width, padding_idx=0)
        self.inner = nn.Linear(width, width)

    def forward(self, idx):  # [N, T]
        hidden = self.embed(idx.t().contiguous())  # [T, N, C]
        return torch.tanh(self.inner(hidden.cumsum(0))).transpose(0, 1)


class WithPaddedSequenceFirst(nn.Module):
    def __init__(self, width=4, lookup=nn.Embedding):
        super().__init__()
        self.block, self.head = PaddedSequenceFirst(width, lookup), nn.Linear(width, 3)

    def forward(self, idx):
        return self.head(self.block(idx).mean(1))


@pytest.mark.parametrize("lookup", [nn.Embedding, PaddedLookup], ids=["Embedding", "other module"])
@pytest.mark.parametrize("examples", [3, LENGTH])
def test_an_embedding_on_transposed_indices_with_padding_is_exact_through_its_block(
        examples, lookup, monkeypatch):
    """The embedding's output ``[T, N, C]`` keeps its leading size in the run one example
    larger, but not its shape: its rows are not examples (not a table without the batch),
    and its block computes it, under ``vmap`` (a chunk of examples per pass: checked here).
    Its padding row's gradient is zero for every example, where ``vmap``'s batching rule
    of the lookup's backward pass gives that row each example's gradient but the first's:
    the block runs under ``fallback.padding.padding_kept``, which stops it explicitly, for
    any module with a ``padding_idx`` (I-BERT's ``QuantEmbedding`` is no ``nn.Embedding``).
    Index 0 occurs in every example."""
    from cockpit_gradnoise.extensions.fallback import block_vmap

    chunks, batched_chunk = [], block_vmap.chunk

    def counted_chunk(*args, **kwargs):
        chunks.append(batched_chunk(*args, **kwargs))  # (raises where vmap cannot run it)
        return chunks[-1]

    monkeypatch.setattr(block_vmap, "chunk", counted_chunk)
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, VOCAB, (examples, LENGTH), generator=generator)
    inputs[:, 0] = 0
    targets = torch.randint(0, 3, (examples,), generator=generator)
    assert_exact_with_structural_zeros(perturbed(WithPaddedSequenceFirst(lookup=lookup)), inputs, targets)
    assert chunks, "the block was not computed under vmap"
