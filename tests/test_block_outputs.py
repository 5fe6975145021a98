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
are refused by name. ProphetNet's own class (tiny, float64, at ``N = 3`` and ``N = 6``, the
sequence's length): ``tests/test_learned_positions.py``.
"""

import copy

import cockpit_gradnoise as cgn

import pytest
import torch
from backpack import extend
from torch import nn

from tests.cases import Problem, classification_losses
from tests.helpers import quiet_check, sequence_batch
from tests.test_tied import assert_matches_references


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


def test_a_copy_of_the_surveyed_model_follows_the_same_outputs():
    """What the survey found (which outputs have rows per example) is copied with the model,
    which is not surveyed again: the copy's block still follows the second output."""
    torch.manual_seed(0)
    inputs, targets = sequence_batch(3)
    surveyed = cgn.prepare_model(Streams("second only").double())
    surveyed(inputs)
    model = copy.deepcopy(surveyed)
    loss_fn, per_example_loss = classification_losses("mean")
    problem = Problem(model, extend(loss_fn), per_example_loss, inputs, targets, "mean")
    assert_matches_references(problem, 1)
