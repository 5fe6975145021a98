"""Issue 32: random draws on flattened tokens, and one draw shared by every example, in training mode.

Where a module or block is run again on each example alone in training mode, each example is
handed its part of the batch's random draws (``extensions/fallback/draws.py``). A random tensor
of a batch flattened example-major (OPT's dropout on its tokens as ``[N * T, C]``) gives each
example its block of ``T`` rows; one whose size does not depend on the batch (timm's
relative-position MLP: one dropout mask for every example) is handed whole to each. Both were
left out by name; each example's output alone is still checked against its row of the batch's.
Exact against ``cgn.check_model`` (float64), whose reference is one backward pass per example
through the batch's own forward pass (the batch's draws).
"""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch
from torch import nn


def _checked(model, inputs, targets, loss):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cgn.check_model(model, inputs, targets, loss, verbose=False)


def _exact(frame):
    """Every element with rows, exact to 1e-10, as the sweep judges it (a key's bias, zero by
    structure, measured against the network's largest contribution)."""
    from experiments.architecture_sweep import classify

    found = classify(frame, set())
    assert found["status"] == "exact" and found["coverage"] == 1.0, found


class OPTLogits(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import OPTConfig, OPTForCausalLM

        torch.manual_seed(0)
        config = OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=24,
                           num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                           dropout=0.3, attention_dropout=0.0, pad_token_id=1)
        self.lm = OPTForCausalLM(config).double().train()

    def forward(self, tokens):
        return self.lm(tokens, use_cache=False).logits


def _tokens_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("examples", [3])
def test_opt_dropout_on_flattened_tokens_exact(examples):
    """OPT's decoder layer drops out its ``fc1``/``fc2`` rows as ``[N * T, C]``."""
    model = OPTLogits()
    generator = torch.Generator().manual_seed(examples)
    tokens = torch.randint(2, 50, (examples, 5), generator=generator)
    frame = _checked(model, (tokens,), torch.randint(0, 50, (examples, 5), generator=generator), _tokens_loss)
    layer = frame[frame.param.str.contains("layers.0.fc1")]
    assert len(layer) == 2 and layer.rows.all()
    _exact(frame)


@pytest.mark.parametrize("examples", [3])
def test_timm_relpos_mlp_dropout_shared_by_every_example_exact(examples):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_relpos_small_patch16_224", pretrained=False, img_size=16, patch_size=8,
                              depth=1, embed_dim=16, num_heads=2, num_classes=3).double().train()
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    generator = torch.Generator().manual_seed(examples)
    images = torch.randn(examples, 3, 16, 16, generator=generator, dtype=torch.float64)
    frame = _checked(model, (images,), torch.arange(examples) % 3, nn.CrossEntropyLoss())
    assert frame[frame.param.str.contains("rel_pos")].rows.all()
    _exact(frame)


class SparseMLP(nn.Module):
    """Switch Transformers' own mixture of experts (4 experts, top 1) in training mode, its
    experts' dropout on the rows routed to each, a head on the mean token."""

    def __init__(self):
        super().__init__()
        from transformers import SwitchTransformersConfig
        from transformers.models.switch_transformers.modeling_switch_transformers import (
            SwitchTransformersSparseMLP,
        )

        torch.manual_seed(0)
        config = SwitchTransformersConfig(d_model=8, d_ff=12, num_experts=4, expert_capacity=64,
                                          dropout_rate=0.3)
        self.mlp = SwitchTransformersSparseMLP(config).double().train()
        # Its router computes in float32 whatever the model's dtype (rounding, not this subject).
        self.mlp.router.classifier.weight.requires_grad_(False)
        self.head = nn.Linear(8, 3).double()

    def forward(self, tokens):
        return self.head(self.mlp(tokens).mean(1))


class Routed(nn.Module):
    """Two experts, each on the rows routed to it by a fixed rule (every token whose first
    feature is positive), gathered example-major as Switch Transformers does, or token-major."""

    def __init__(self, token_major):
        super().__init__()
        self.token_major = token_major
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.4)) for _ in range(2))
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        rows = (tokens.transpose(0, 1) if self.token_major else tokens).reshape(-1, 4)
        out = torch.zeros_like(rows)
        for expert, chosen in zip(self.experts, (rows[:, 0] > 0, rows[:, 0] <= 0)):
            out[chosen] = expert(rows[chosen])
        out = out.view(tokens.shape[1], len(tokens), 4).transpose(0, 1) if self.token_major else out.view_as(tokens)
        return self.head(out.mean(1))


@pytest.mark.parametrize("examples", [3, 5])
def test_switch_transformers_experts_dropout_on_their_routed_rows_exact(examples):
    """Each expert's dropout mask has as many rows as tokens routed to it (``[4, 12]`` in the
    batch, ``[2, 12]`` for one example): each example alone is handed its tokens' rows, those
    after the examples before it, matched to the batch's draw by the module that drew it (an
    example skips the experts none of its tokens reached). They were left out by name."""
    generator = torch.Generator().manual_seed(examples)
    tokens = torch.randn(examples, 5, 8, generator=generator, dtype=torch.float64)
    frame = _checked(SparseMLP(), (tokens,), torch.arange(examples) % 3, nn.CrossEntropyLoss())
    experts = frame[frame.param.str.contains("experts") & frame.rows]
    assert len(experts) >= 4
    _exact(frame)


@pytest.mark.parametrize("token_major", [False, True])
def test_rows_routed_token_major_are_refused_by_name(token_major):
    """Gathered token-major, an example's rows are not one block of the expert's: refused by
    name by the output check (each example's rows alone are those of the examples before it)."""
    torch.manual_seed(0)
    model = Routed(token_major).double().train()
    tokens = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    frame = _checked(model, (tokens,), torch.arange(3) % 3, nn.CrossEntropyLoss()).set_index("param")
    if not token_major:
        _exact(frame.reset_index())
        return
    note = frame.loc["experts.0.0.weight", "note"]
    assert not frame.loc["experts.0.0.weight", "rows"] and "random" in note, note
