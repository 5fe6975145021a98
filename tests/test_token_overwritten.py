"""An embedding that writes a parameter into the rows of one token: T5Gemma2's own class.

``T5Gemma2TextScaledWordEmbedding`` scales its lookup and then assigns its
``eoi_embedding`` to every position holding ``eoi_token_index`` (a boolean mask). Its
probe at random indices took it for a scaled lookup, so its weight got the
``Embedding`` rule, whose rows give the eoi token's row the gradient of the output
that overwrote it: silently wrong wherever an example holds that token (1.2 relative,
measured); and ``eoi_embedding`` had no rule (tied: left out by name). Now the probe
looks at every row and a module holding more than its weight is no scaled lookup
(``extensions/scaled_embedding.py``): the fallback recomputes it per example, also for
its tied uses (``extensions/repeated.py``: each example alone where ``vmap`` cannot
batch the mask's assignment). Exact against one backward pass per example on a float64
copy, the token present, and absent from the vocabulary (the sweep's tiny T5Gemma2).
"""

import pytest
import torch
from torch import nn

from tests.cases import token_losses
from tests.test_silent_inexact import assert_exact

VOCABULARY, WIDTH, LENGTH, EOI = 11, 4, 5, 7


class TwoEmbeddings(nn.Module):
    """Two ``T5Gemma2TextScaledWordEmbedding`` sharing their weight and ``eoi_embedding`` (as
    T5Gemma2's encoder and decoder do), the head tied to the weight, on ``[N, 2, T]``."""

    def __init__(self, eoi_token_index):
        super().__init__()
        from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextScaledWordEmbedding

        self.encoder = T5Gemma2TextScaledWordEmbedding(VOCABULARY, WIDTH, 0, 2.0, eoi_token_index)
        self.decoder = T5Gemma2TextScaledWordEmbedding(VOCABULARY, WIDTH, 0, 2.0, eoi_token_index)
        self.decoder.weight, self.decoder.eoi_embedding = self.encoder.weight, self.encoder.eoi_embedding
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.head.weight = self.encoder.weight

    def forward(self, tokens):
        memory = torch.tanh(self.encoder(tokens[:, 0])).mean(1, keepdim=True)
        return self.head(torch.tanh(self.decoder(tokens[:, 1]) + memory))


@pytest.mark.parametrize("eoi_token_index, examples", [(EOI, 3), (EOI, LENGTH), (256_000, 3)])
def test_t5gemma2s_embedding_with_its_eoi_embedding_is_exact(eoi_token_index, examples):
    pytest.importorskip("transformers.models.t5gemma2")
    torch.manual_seed(examples)
    model = TwoEmbeddings(eoi_token_index).double().eval()
    with torch.no_grad():
        model.encoder.eoi_embedding.normal_()  # initialized to zeros
    tokens = torch.randint(1, VOCABULARY, (examples, 2, LENGTH))
    tokens[0, 0, 1] = tokens[1, 1, 2] = tokens[-1, 1, 0] = EOI  # in both calls, several examples
    targets = torch.randint(0, VOCABULARY, (examples, LENGTH))
    assert_exact(model, tokens, targets, token_losses("mean"), inner_terms=LENGTH)
