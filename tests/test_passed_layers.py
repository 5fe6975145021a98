"""Issue 32: a layer passed as an argument to a module whose forward uses its weight directly.

Perceiver's masked-LM head (``PerceiverEmbeddingDecoder``) is given the input embedding and
computes ``hidden @ embedding_layer.weight.T``: a second use of the embedding's weight that
its rule does not see. It was left out by name. The survey now notes which modules were given
a layer as an argument and computed with its parameters (``regroup._receivers``), and the
smallest batch-first module around the layer and them is run again on each example alone,
giving both their rows (the block's checks: each example's output, the contributions' sum).
Exact against ``cgn.check_model``'s float64 per-example reference; toys (exact, and refused
where the examples interact) in ``tests/test_fallback.py``.
"""

import torch
from torch import nn

from experiments import architecture_sweep
from tests.helpers import token_check


class PerceiverLogits(nn.Module):
    """A tiny PerceiverForMaskedLM's logits, float64, eval mode."""

    def __init__(self):
        super().__init__()
        from transformers import PerceiverConfig, PerceiverForMaskedLM

        torch.manual_seed(0)
        config = PerceiverConfig(num_latents=4, d_latents=16, d_model=16, num_blocks=1,
                                 num_self_attends_per_block=1, num_self_attention_heads=2,
                                 num_cross_attention_heads=1, vocab_size=37, max_position_embeddings=6)
        self.lm = PerceiverForMaskedLM(config).double().eval()

    def forward(self, tokens):
        return self.lm(inputs=tokens).logits


def test_perceiver_input_embedding_and_decoder_exact():
    frame = token_check(PerceiverLogits(), 37, length=6)
    # (The sweep's judgement: its attention's key biases have a gradient of zero by structure,
    # rounding noise in the reference, measured against the network's largest contribution.)
    found = architecture_sweep.classify(frame, set())
    assert found["status"] == "exact" and found["coverage"] == 1.0, found
    shared = frame[frame.param.str.endswith(("input_preprocessor.embeddings.weight", "embedding_decoder.bias"))]
    assert len(shared) == 2 and shared.how.str.contains("its block").all(), shared.to_string()
