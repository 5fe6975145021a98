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
