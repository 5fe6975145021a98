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

import pytest

from tests.cases import token_losses
from tests.library_models import Logits
from tests.test_regroup import VOCAB, assert_exact_with_structural_zeros, perturbed, tokens

LENGTH = 5


def xlnet(tie=True):
    """A tiny ``XLNetLMHeadModel`` (head tied to the word embedding by default); the
    parameters a plain LM step never reaches (``mask_emb`` for ``target_mapping``,
    ``seg_embed`` and ``r_s_bias`` for ``token_type_ids``) frozen."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    config = XLNetConfig(vocab_size=VOCAB, d_model=4, n_layer=1, n_head=2, d_head=2, d_inner=8,
                         dropout=0.0, tie_word_embeddings=tie)
    model = perturbed(XLNetLMHeadModel(config))
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith(("mask_emb", "seg_embed", "r_s_bias")))
    return Logits(model)


@pytest.mark.parametrize("examples, tie", [(2, True), (LENGTH, True), (3, False)])
def test_xlnet_is_exact(examples, tie):
    inputs, targets = tokens(examples, length=LENGTH)
    assert_exact_with_structural_zeros(xlnet(tie), inputs, targets, token_losses("mean"), inner_terms=LENGTH)
