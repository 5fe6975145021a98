"""Issue 32: a module that returns a ``transformers`` ``ModelOutput`` and uses its parameters directly.

Its backward hooks see no tensor in a dict, so no extension ever reached it: ZayaModel's
``input_hidden_states_scale`` and ``input_hidden_states_bias`` (``(embeddings + bias) * scale``
in its own forward) were left out as "reached another way". Now the ``ModelOutput``'s one
floating-point tensor hands its gradient over by its own tensor hook
(``extensions/fallback/capture.py``), and where ``vmap`` cannot run the module (Zaya's experts:
``nonzero``), it is run on each example alone, each output checked against its row of the
batch's (``running._vmap_failed``). Exact against ``cgn.check_model``'s float64 per-example
reference. A ``ModelOutput`` with a second floating-point tensor is still refused by name.
"""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput


def _checked(model, inputs, targets, loss):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cgn.check_model(model, inputs, targets, loss, verbose=False)


class ZayaLogits(nn.Module):
    """ZayaForCausalLM's logits, the way the sweep calls it."""

    def __init__(self):
        super().__init__()
        from transformers import ZayaConfig, ZayaForCausalLM

        torch.manual_seed(0)
        config = ZayaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=1, router_hidden_size=16, layer_types=["hybrid"],
                            max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=2,
                            experts_implementation="eager")
        self.lm = ZayaForCausalLM(config).double().eval()  # (as the sweep checks it)

    def forward(self, tokens):
        return self.lm(tokens, use_cache=False).logits


def test_zaya_model_parameters_exact():
    model = ZayaLogits()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.lm.config.vocab_size, (3, 6), generator=generator)
    targets = torch.randint(0, model.lm.config.vocab_size, (3, 6), generator=generator)

    def loss(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    frame = _checked(model, (tokens,), targets, loss)
    own = frame[frame.param.str.contains("input_hidden_states")]
    assert len(own) == 2 and own.rows.all(), frame[~frame.rows][["param", "note"]].to_string()
    assert frame.attrs["coverage"] == 1.0
    assert (frame.max_rel_error.dropna() <= 1e-10).all()


class Routed(nn.Module):
    """Rows picked by ``nonzero`` (a size that depends on the values: vmap cannot run it)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        out = torch.zeros_like(x)
        picked = (x[..., 0] > 0).nonzero(as_tuple=True)
        out[picked] = self.linear(x[picked])
        return out + x


class Scaled(nn.Module):
    """Parameters used in its own forward, a ``ModelOutput`` returned (ZayaModel's way)."""

    def __init__(self, routed: bool, second: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.3, 4))
        self.inner = Routed() if routed else nn.Linear(4, 4)
        self.second = second

    def forward(self, x):
        hidden = self.inner(torch.tanh((x + self.bias) * self.scale))
        more = (hidden * self.scale,) if self.second else None
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=more)


class Head(nn.Module):
    def __init__(self, routed: bool, second: bool = False):
        super().__init__()
        self.body = Scaled(routed, second)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        out = self.body(x)
        pooled = out.last_hidden_state.mean(1)
        if out.hidden_states is not None:
            pooled = pooled + out.hidden_states[0].mean(1)
        return self.head(pooled)


def _inputs(examples):
    generator = torch.Generator().manual_seed(examples)
    return torch.randn(examples, 5, 4, generator=generator, dtype=torch.float64), torch.arange(examples) % 3


@pytest.mark.parametrize("routed", [False, True], ids=["vmap", "alone"])
@pytest.mark.parametrize("examples", [2, 3, 5])
def test_model_output_parameters_exact(routed, examples):
    torch.manual_seed(0)
    x, y = _inputs(examples)
    frame = _checked(Head(routed).double(), (x,), y, nn.CrossEntropyLoss())
    own = frame[frame.param.isin(["body.scale", "body.bias"])]
    assert own.rows.all(), frame[~frame.rows][["param", "note"]].to_string()
    assert frame.attrs["coverage"] == 1.0
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()


def test_model_output_with_a_second_tensor_refused_by_name():
    """A second floating-point tensor reaching the loss carries gradient no hook sees."""
    torch.manual_seed(0)
    x, y = _inputs(3)
    frame = _checked(Head(False, second=True).double(), (x,), y, nn.CrossEntropyLoss())
    own = frame[frame.param.isin(["body.scale", "body.bias"])]
    assert not own.rows.any() and own.note.str.len().min() > 0
    assert (frame.max_rel_error.dropna() <= 1e-10).all()
