"""Blocks run again on chunks of examples under ``vmap`` (``extensions/fallback/block_vmap.py``).

A block whose layers run on rows that are not examples (Swin's window attention, OPT's
flattened tokens) used to be run again one example at a time; where ``vmap`` can run it,
a chunk of examples is one pass now. Exact as the loop, against one backward pass per
example through a float64 forward pass of the batch, with the structural zeros of the
attention keys' biases, over several chunks (the last one shorter); a block ``vmap``
cannot batch (a mixture of experts' routing) is left to the loop; a block whose examples
interact is refused by name, as by the loop.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import cost_model
from cockpit_gradnoise.extensions.fallback import block_vmap, blocks

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.library_models import Logits
from tests.test_moe import mixtral
from tests.test_regroup import SEQUENCE, assert_exact_with_structural_zeros, opt, swin, tokens
from tests.test_silent_inexact import assert_exact
from tests.test_tied import assert_left_out_by_name


@pytest.fixture
def chunks(monkeypatch):
    """The ``(start, stop)`` of each chunk ``vmap`` computed (``("tried", start, stop)``
    where it raised), two examples per chunk; ``"loop"`` once per block run by the loop."""
    found = []
    chunk, loop = block_vmap.chunk, blocks.per_example_gradients

    def counted(*args):
        found.append(("tried", *args[-3:-1]))
        result = chunk(*args)
        found[-1] = args[-3:-1]
        return result

    def counted_loop(*args):
        found.append("loop")
        return loop(*args)

    monkeypatch.setattr(block_vmap, "chunk", counted)
    monkeypatch.setattr(blocks, "per_example_gradients", counted_loop)
    monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: 2)
    return found


@pytest.mark.parametrize("family, examples", [("Swin", 3), ("Swinv2", 4)])
def test_window_attention_in_chunks_is_exact(chunks, family, examples):
    torch.manual_seed(examples)
    inputs = torch.randn(examples, 3, 16, 16, dtype=torch.float64)
    assert_exact_with_structural_zeros(swin(family), inputs, torch.randint(0, 3, (examples,)))
    assert "loop" not in chunks
    assert set(chunks) == {(start, min(start + 2, examples)) for start in range(0, examples, 2)}


def test_flattened_tokens_in_chunks_are_exact(chunks):
    inputs, targets = tokens(5)
    assert_exact_with_structural_zeros(opt(), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert "loop" not in chunks and set(chunks) == {(0, 2), (2, 4), (4, 5)}


def test_a_mixture_of_experts_is_left_to_the_loop(chunks):
    """The eager experts' routing (``nonzero``) has a shape that depends on the data."""
    inputs, targets = tokens(3)
    assert_exact(Logits(mixtral()), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert chunks == [("tried", 0, 2), "loop"]


class Centred(nn.Module):
    """Its layer runs on the flattened tokens ``[N*T, C]``, whose mean over the whole
    batch it subtracts: an example alone gives another output than in the batch."""

    def __init__(self, width=4):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):  # [N, T, C]
        rows = self.inner(x.reshape(-1, x.shape[-1]))
        return torch.tanh(rows - rows.mean(0)).reshape(x.shape)


class WithCentred(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(3, width), Centred(width), nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))


def test_a_block_whose_examples_interact_is_refused_by_name(chunks):
    torch.manual_seed(0)
    inputs, targets = torch.randn(4, 5, 3, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss, per_example = classification_losses("mean")
    model = cgn.prepare_model(WithCentred().double())
    problem = Problem(model, extend(loss), per_example, inputs, targets, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    # The layer before the block gets every example's loss on each example's rows (through
    # the batch's mean): left out too (extensions/fallback/mixing.py), by its own warning.
    assert_left_out_by_name(problem, quantity, ("block.inner.bias", "block.inner.weight",
                                                "embed.bias", "embed.weight"),
                            r"\['block.inner.bias', 'block.inner.weight'\].*examples interact")
    assert chunks == [("tried", 0, 2), "loop"]  # vmap ran, its check failed: the loop decided
