"""Issue 32: a block that follows every output with rows per example, not its first only.

ProphetNet's decoder reads ``ngram_embeddings.weight`` directly, and looks its positions up
again outside its ``position_embeddings``' calls (``position_embeddings._forward``): uses no
rule sees, so both were left out by name. A block around the decoder (the smallest batch-first
module around the layers and the module that uses them: ``regroup._ancestor_users``) gives
them rows, but a block followed its first output only, and the decoder's first output (its
main stream) does not reach ProphetNet's loss: its logits come from the second
(``last_hidden_state_ngram``). A block now hooks each output the survey found with rows per
example (``blocks._hook_later_outputs``), each through an alias as the fallback's later
outputs are, and differentiates each example's outputs alone at their gradients, each
checked against its row of the batch's (``block_alone._ends``). Exact against
``cgn.check_model``'s float64 per-example reference; examples that interact in a later output
are refused by name.
"""

import pytest
import torch
from torch import nn

from experiments import architecture_sweep
from experiments.sweep_wrappers import Logits
from tests.helpers import quiet_check, sequence_batch


def prophetnet() -> nn.Module:
    """A tiny ProphetNetForConditionalGeneration's logits (the sweep's wrapper), float64, eval mode."""
    from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration

    torch.manual_seed(0)
    config = ProphetNetConfig(vocab_size=37, hidden_size=16, encoder_ffn_dim=24, decoder_ffn_dim=24,
                              num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
                              num_decoder_attention_heads=2, ngram=2, num_buckets=8, relative_max_distance=16,
                              max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                              activation_dropout=0.0)
    model = ProphetNetForConditionalGeneration(config).double().eval()
    return Logits(model, ["input_ids", "decoder_input_ids"])


def test_prophetnet_decoder_positions_and_ngram_embeddings_exact():
    generator = torch.Generator().manual_seed(0)
    tokens, decoder_tokens = (torch.randint(3, 37, (3, n), generator=generator) for n in (6, 4))
    targets = torch.randint(0, 37, (3, 4), generator=generator)

    def loss(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    frame = quiet_check(prophetnet(), (tokens, decoder_tokens), targets, loss)
    found = architecture_sweep.classify(frame, set())
    assert found["status"] == "exact" and found["coverage"] == 1.0, found
    decoder = frame[frame.param.str.endswith(("decoder.position_embeddings.weight", "ngram_embeddings.weight"))]
    assert len(decoder) == 2 and decoder.how.str.contains("its block ProphetNetDecoder").all(), decoder.to_string()


class TwoStreams(nn.Module):
    """ProphetNet's decoder in small: its positions looked up by its layer and read again outside
    its calls; two outputs, the first (``main``) unused by the loss, or used with the second,
    which is computed from it (``"from first"``); ``"mixed"``: the second adds the batch's mean."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.positions, self.main = nn.Embedding(8, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = x + self.positions(torch.arange(x.shape[1]))
        again = self.positions.weight[: x.shape[1]] * 2  # a use outside the layer's calls
        main = self.main(h)
        second = torch.tanh((main if self.kind == "from first" else h) + again)
        if self.kind == "mixed":
            second = second + second.mean(0, keepdim=True)
        return main, second


class Streams(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.streams, self.head = kind, TwoStreams(kind), nn.Linear(4, 3)

    def forward(self, x):
        main, second = self.streams(x)
        return self.head(second + main if self.kind == "from first" else second).mean(1)


@pytest.mark.parametrize("kind", ["second only", "from first"])
@pytest.mark.parametrize("examples", [2, 5])
def test_a_block_whose_loss_reads_a_later_output_is_exact(kind, examples):
    torch.manual_seed(0)
    frame = quiet_check(Streams(kind).double(), *sequence_batch(examples), nn.CrossEntropyLoss())
    used = frame[~frame.note.str.startswith("no gradient")]  # ("second only": main's unused)
    assert len(used) == (3 if kind == "second only" else 5) and used.rows.all(), frame.to_string()
    assert (used.max_rel_error <= 1e-10).all(), frame.to_string()
    positions = used[used.param == "streams.positions.weight"]  # (main keeps its rule: rows per example)
    assert positions.how.str.contains("its block TwoStreams").all(), positions.to_string()


def test_examples_that_interact_in_a_later_output_are_refused_by_name():
    torch.manual_seed(0)
    frame = quiet_check(Streams("mixed").double(), *sequence_batch(3), nn.CrossEntropyLoss())
    left_out = frame[~frame.rows & ~frame.note.str.startswith("no gradient")]
    assert set(left_out.param) == {"streams.positions.weight"}, frame.to_string()
    assert left_out.note.str.contains("differs from its output in the batch").all(), left_out.note.tolist()
