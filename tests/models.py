"""The tests' own small GPT-style model and token loss (the experiments keep theirs).

What the case matrix needs of a language model: token and position
embeddings, causal self-attention written from ``nn.Linear`` or PyTorch's
``nn.TransformerEncoderLayer`` (converted), pre-norm blocks with LayerNorm
and GELU, a linear head; logits ``[N, T, vocabulary]``.
"""

from cockpit_gradnoise import convert_attention

import torch
from torch import nn


class _Block(nn.Module):
    """Pre-norm block: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``.

    No bias on the query/key/value projection: a key bias adds a constant to
    each query's scores, which softmax removes, so its gradient is rounding noise.
    """

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        n, length, width = x.shape
        heads = self.qkv(self.ln_1(x)).reshape(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(n, length, width))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``blocks="gpt"``: :class:`_Block`; ``"encoder"``: causal pre-norm
    ``nn.TransformerEncoderLayer`` without biases, converted by ``convert_attention``."""

    def __init__(self, vocabulary, context, width, heads, layers, blocks="gpt"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocabulary, width), nn.Embedding(context, width)
        self.causal = blocks != "gpt"
        if self.causal:
            encoder = [nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                  norm_first=True, bias=False) for _ in range(layers)]
            self.blocks = convert_attention(nn.Sequential(*encoder))
        else:
            self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(layers)))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocabulary, bias=False)

    def forward(self, idx):
        n, length = idx.shape
        # Positions expanded over the batch: every layer sees the batch first.
        x = self.wte(idx) + self.wpe(torch.arange(length, device=idx.device).expand(n, length))
        if not self.causal:
            return self.head(self.ln_f(self.blocks(x)))
        mask = torch.ones(length, length, dtype=torch.bool, device=idx.device).triu(1)
        for layer in self.blocks:
            x = layer(x, src_mask=mask)
        return self.head(self.ln_f(x))


class TokenCrossEntropy(nn.Module):
    """Cross-entropy per token; ``"mean"`` over all tokens, ``"sum"``, or ``"none"``:
    per example, the mean of its tokens' (``per_token="mean"``) or their sum."""

    def __init__(self, reduction="mean", per_token="mean"):
        super().__init__()
        self.reduction, self.per_token = reduction, per_token

    def forward(self, logits, targets):
        tokens = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        if self.reduction != "none":
            return getattr(tokens, self.reduction)()
        return getattr(tokens, self.per_token)(1)
