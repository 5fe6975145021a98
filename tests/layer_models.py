"""Models of the case matrix for layers of issue 19: ``padding_idx``, attention, subclasses."""

import torch
from torch import nn

PADDING = 0


class Gate(nn.Module):
    """``x * sigmoid(gate)``: a parameter used directly, no rule and no look-alike: the
    fallback's ``torch.func`` path."""

    def __init__(self, width):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * torch.sigmoid(self.gate)


def embedding_padding():
    """An embedding with a padding row: its gradient is exactly 0 by definition."""
    return nn.Sequential(
        nn.Embedding(10, 4, padding_idx=PADDING), nn.Flatten(), nn.Tanh(), nn.Linear(4 * 4, 3)
    )


def padded_tokens(n):
    """``n`` sequences of 4 tokens; every other one ends in two padding tokens."""
    tokens = torch.randint(1, 10, (n, 4))
    tokens[::2, -2:] = PADDING
    return tokens


class Attention(nn.Module):
    """``nn.TransformerEncoderLayer`` (self-attention), then ``nn.MultiheadAttention`` from
    the sequence to a memory (key is value, sequence first), unconverted: ``prepare_model``
    converts them.

    Without biases by default: a key bias's gradient is exactly zero (softmax ignores a
    constant added to all of a query's scores), computed as rounding noise.
    """

    def __init__(self, vocabulary=11, width=8, heads=2, length=4, bias=False):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.encoder = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0,
                                                  batch_first=True, bias=bias)
        self.memory = nn.Linear(width, width)
        self.cross = nn.MultiheadAttention(width, heads, bias=bias)
        self.head = nn.Linear(length * width, 3)

    def forward(self, idx):
        x = self.encoder(self.embed(idx))
        memory = torch.tanh(self.memory(x[:, :2])).transpose(0, 1)
        y, _ = self.cross(x.transpose(0, 1), memory, memory, need_weights=False)
        return self.head(y.transpose(0, 1).flatten(1))


def timm_convnext():
    """timm's ``convnext_atto`` layout, small: ``LayerNorm2d`` (channels first) in every block.

    Without layer scale (``ls_init_value=None``; ``create_model`` drops ``None``
    arguments, so the class itself): its ``gamma`` is used directly in forward.
    """
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(num_classes=3, depths=(1, 1, 1, 1), dims=(4, 8, 8, 8), conv_mlp=True,
                    ls_init_value=None)


def timm_vit():
    """timm's ViT, small: timm's ``LayerNorm``; no class token or position table (used
    directly in forward), no query/key/value bias (the key bias's gradient is zero)."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4,
                             num_classes=3, depth=1, embed_dim=8, num_heads=2, class_token=False,
                             global_pool="avg", pos_embed="none", qkv_bias=False)
