"""Issue 32, class 5: a module ``torch.func.vmap`` cannot run, run on each example alone.

RecurrentGemma's RG-LRU (``RecurrentGemmaRglru``) uses its parameters in its own forward and
calls ``SqrtBoundDerivative``, a custom ``autograd.Function`` whose ``forward`` takes ``ctx``
(no ``setup_context``), which ``vmap`` cannot run; its parameters were left out by name. Now
a module ``vmap`` cannot run is run on each example alone, without ``vmap``, each example's
output checked against its row of the batch's (``running._vmap_failed``): one whose examples
interact is still refused by name.

The RG-LRU also keeps its scan's last state on itself (``self.recurrent_states``: ``None`` at
the call, the batch's last state after it). A recomputation in the backward pass would start
from the batch's end; it now runs with the attributes the call set as the call found them
(``parameters.attributes_as_called``), under ``vmap`` too. Exact against ``cgn.check_model``'s
float64 per-example reference.
"""

import pytest
import torch
from torch import nn

from tests.helpers import CausalLogits, quiet_check, sequence_batch, token_check


def _recurrent_gemma() -> nn.Module:
    """A tiny RecurrentGemmaForCausalLM (one recurrent layer), float64, eval mode."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    torch.manual_seed(0)
    config = RecurrentGemmaConfig(vocab_size=61, hidden_size=16, lru_width=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=8, attention_window_size=8, block_types=["recurrent"])
    return CausalLogits(RecurrentGemmaForCausalLM(config).double().eval())


def test_recurrent_gemma_rg_lru_exact():
    frame = token_check(_recurrent_gemma(), 61)
    lru = frame[frame.param.str.contains("rg_lru")]
    assert len(lru) == 5 and lru.rows.all(), frame[~frame.rows][["param", "note"]].to_string()
    assert frame.attrs["coverage"] == 1.0
    assert (lru.max_rel_error <= 1e-10).all(), lru.to_string()


class OldStyleSqrt(torch.autograd.Function):
    """``sqrt``, its ``forward`` taking ``ctx`` (RecurrentGemma's ``SqrtBoundDerivative``)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (2 * torch.sqrt(x))


class Scan(nn.Module):
    """A gated linear scan that keeps its last state on itself (the RG-LRU's way)."""

    def __init__(self, old_style: bool, mixing: str = ""):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, 4))
        self.old_style, self.mixing = old_style, mixing
        self.state = None

    def forward(self, x):
        gate = torch.sigmoid(x @ self.weight + self.bias)
        sqrt = OldStyleSqrt.apply if self.old_style else torch.sqrt
        inputs = x * sqrt(1 - gate**2)
        if self.mixing == "forward":  # the batch's mean: examples interact
            inputs = inputs + inputs.mean(0, keepdim=True)
        elif self.mixing == "backward":  # zero in value: each output alone is its row, not its gradient
            inputs = inputs + (inputs - inputs.detach()).mean(0, keepdim=True)
        state = torch.zeros_like(inputs[:, 0]) if self.state is None else self.state
        states = []
        for t in range(x.shape[1]):
            state = gate[:, t] * state + inputs[:, t]
            states.append(state)
        self.state = state
        return torch.stack(states, 1)


class Head(nn.Module):
    def __init__(self, old_style: bool, mixing: str = ""):
        super().__init__()
        self.scan = Scan(old_style, mixing)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        self.scan.state = None  # a new sequence (RecurrentGemma's block without a cache)
        return self.head(self.scan(x).mean(1))


@pytest.mark.parametrize("old_style", [False, True], ids=["vmap", "alone"])
@pytest.mark.parametrize("examples", [2, 3, 5])
def test_state_kept_on_the_module_exact(old_style, examples):
    torch.manual_seed(0)
    frame = quiet_check(Head(old_style).double(), *sequence_batch(examples), nn.CrossEntropyLoss())
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()


@pytest.mark.parametrize("mixing, why", [
    ("forward", "its output for one example alone differs"),
    ("backward", "do not add up to its gradient from the batch"),
])
def test_examples_interacting_refused_by_name(mixing, why):
    """Examples that interact in the forward pass (each output alone differs from its row of
    the batch's) or in the backward pass only (the contributions alone do not add up to the
    gradient from the batch): left out, named."""
    torch.manual_seed(0)
    x, y = sequence_batch(3)
    frame = quiet_check(Head(True, mixing=mixing).double(), (x,), y, nn.CrossEntropyLoss())
    own = frame[frame.param.isin(["scan.weight", "scan.bias"])]
    assert not own.rows.any(), own.to_string()
    assert own.note.str.contains("nor can it run on each example alone").all(), own.note.tolist()
    assert own.note.str.contains(why).all(), own.note.tolist()
    assert frame.set_index("param").loc["head.weight"].rows
