"""Models shared by the experiments, the benchmark and the tests."""

from cockpit_gradnoise import convert_attention

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    """GPT-style causal self-attention written from ``nn.Linear`` (no conversion needed).

    The input projection has no bias by default: a key bias adds a constant to
    every score of a query, which softmax removes, so its gradient is exactly
    zero and computed as rounding noise.
    """

    def __init__(self, width, heads, qkv_bias=False):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, -1).transpose(1, 2)
            for t in self.qkv(x).split(width, 2)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, LayerNorm, MLP with GELU."""

    def __init__(self, width, heads):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-style language model (nanoGPT's layout): logits ``[N, T, vocabulary]``.

    Token and position embeddings (positions expanded over the batch, so that
    every layer sees the batch first), pre-norm blocks, a final LayerNorm and
    a linear head.

    Args:
        vocabulary: Number of tokens.
        context: Longest sequence.
        width: Model width.
        heads: Attention heads.
        layers: Number of blocks.
        blocks: ``"gpt"`` for :class:`Block`, ``"encoder"`` for
            ``nn.TransformerEncoderLayer`` (causal, pre-norm, no biases),
            converted with ``cockpit_gradnoise.convert_attention``.
        tied: The head shares the token embedding matrix.
    """

    def __init__(self, vocabulary, context, width, heads, layers, blocks="gpt", tied=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocabulary, width), nn.Embedding(context, width)
        if blocks == "gpt":
            self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        else:
            self.blocks = convert_attention(
                nn.Sequential(
                    *(
                        # bias=False: a key bias's gradient is rounding noise (see above).
                        nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                   batch_first=True, norm_first=True, bias=False)
                        for _ in range(layers)
                    )
                )
            )
        self.causal = blocks != "gpt"
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        batch, length = idx.shape
        positions = torch.arange(length, device=idx.device).expand(batch, length)
        x = self.wte(idx) + self.wpe(positions)
        if self.causal:
            mask = torch.ones(length, length, dtype=torch.bool, device=idx.device).triu(1)
            for layer in self.blocks:
                x = layer(x, src_mask=mask)
        else:
            x = self.blocks(x)
        return self.head(self.ln_f(x))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of every token; an example's own loss is the mean (or sum) of its tokens'.

    ``reduction="mean"``: the mean over all tokens, which is the mean over
    examples of their mean over tokens; ``"sum"``: the sum over all tokens;
    ``"none"``: one loss per example, the mean over its tokens
    (``per_token="mean"``) or their sum (``"sum"``), to pair with the reduction.
    """

    def __init__(self, reduction="mean", per_token="mean"):
        super().__init__()
        self.reduction, self.per_token = reduction, per_token

    def forward(self, logits, targets):
        tokens = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, reduction="none"
        )
        if self.reduction == "mean":
            return tokens.mean()
        if self.reduction == "sum":
            return tokens.sum()
        return tokens.mean(1) if self.per_token == "mean" else tokens.sum(1)
