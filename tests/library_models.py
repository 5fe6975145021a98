"""Models of other libraries for the case matrix, from tiny configs with random weights.

Hugging Face models take token ids and return a ``ModelOutput``: the wrappers
here return its logits, so the token loss of ``tests/models.py`` applies.
"""

import warnings

import torch
from torch import nn


class Logits(nn.Module):
    """``model(input_ids).logits`` of a Hugging Face causal language model.

    ``batch_positions``: pass ``position_ids`` of shape ``(N, T)``, so that
    GPT-2's ``wpe`` sees every example (by default HF passes ``(1, T)``,
    which is applied without the batch dimension).
    """

    def __init__(self, model, batch_positions=False):
        super().__init__()
        self.model, self.batch_positions = model, batch_positions

    def forward(self, input_ids):
        n, length = input_ids.shape
        kwargs = {}
        if self.batch_positions:
            kwargs["position_ids"] = torch.arange(length, device=input_ids.device).expand(n, length)
        with warnings.catch_warnings():
            # torch's full backward hooks (BackPACK's) on modules returning a ModelOutput
            # warn that they are never called: those modules have no parameters of their own.
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            return self.model(input_ids=input_ids, use_cache=False, **kwargs).logits


def llama(vocabulary, width, heads, layers=2):
    """``LlamaForCausalLM``, untied head: RMSNorm layers (native rule), no biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocabulary, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
        max_position_embeddings=16, tie_word_embeddings=False,
    )
    return Logits(LlamaForCausalLM(config)).eval()


def gpt2(vocabulary, width, heads, layers=2, batch_positions=True, attention_bias=False):
    """``GPT2LMHeadModel``, untied head: HF ``Conv1D`` projections (native rule), no dropout.

    ``attention_bias=False`` freezes the fused ``c_attn.bias``: its key part has a
    gradient of exactly zero (softmax ignores a constant added to every score of a
    query), computed as rounding noise, whose sd no reference can match
    (structural zeros are issue 19's numerics part).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocabulary, n_positions=16, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
    )
    model = GPT2LMHeadModel(config)
    for block in model.transformer.h:
        block.attn.c_attn.bias.requires_grad_(attention_bias)
    return Logits(model, batch_positions=batch_positions).eval()


def timm_vit(image=8, patch=4, width=8, heads=2, classes=3, training=False):
    """timm ``VisionTransformer``: class token and position table added in the model's own
    ``forward``, layer-scale ``gamma`` (``init_values``), timm's LayerNorm. In training
    mode with dropout 0.3 (after the position table, on the attention weights, after
    each projection, before the head) and drop path 0.5 (per example)."""
    from timm.models.vision_transformer import VisionTransformer

    dropout = dict(drop_rate=0.3, pos_drop_rate=0.3, attn_drop_rate=0.3, proj_drop_rate=0.3,
                   drop_path_rate=0.5) if training else {}
    return VisionTransformer(
        img_size=image, patch_size=patch, in_chans=2, num_classes=classes, embed_dim=width,
        depth=1, num_heads=heads, mlp_ratio=2.0, init_values=0.5, qkv_bias=False, **dropout,
    ).train(training)


def timm_convnext_train(classes=3):
    """timm ``ConvNeXt`` (``convnext_atto``'s layout, four stages of one block) in training
    mode: layer-scale ``gamma`` used directly in each block's forward, then drop path 0.5
    (per example), head dropout 0.3; ``LayerNorm2d`` and timm's ``LayerNorm``."""
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(num_classes=classes, depths=(1, 1, 1, 1), dims=(4, 8, 8, 8),
                    conv_mlp=True, ls_init_value=0.5, drop_path_rate=0.5, drop_rate=0.3).train()
