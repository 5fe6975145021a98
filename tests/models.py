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


# nanoGPT's patterns, and one embedding used three times (tied parameters, issue 19) ----


class NanoLayerNorm(nn.Module):
    """nanoGPT's pattern: a LayerNorm class with an optional bias, through ``F.layer_norm``."""

    def __init__(self, width, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _NanoBlock(nn.Module):
    """Pre-norm block with a fused ``c_attn`` (query, key, value in one Linear), split,
    and ``F.scaled_dot_product_attention``."""

    def __init__(self, width, heads, bias, norm):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = norm(width, bias), norm(width, bias)
        self.c_attn = nn.Linear(width, 3 * width, bias=bias)
        self.c_proj = nn.Linear(width, width, bias=bias)
        self.c_fc, self.gelu = nn.Linear(width, 4 * width, bias=bias), nn.GELU()
        self.mlp_proj = nn.Linear(4 * width, width, bias=bias)

    def forward(self, x):
        n, length, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(n, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(n, length, width))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's patterns: the head tied to the token embedding
    (``transformer.wte.weight = lm_head.weight``), positions ``wpe(torch.arange(t))``
    without the batch dimension, ``bias`` in every Linear and LayerNorm or in none.

    ``norm="nanogpt"`` is nanoGPT's :class:`NanoLayerNorm`; ``"torch"`` is
    ``nn.LayerNorm`` (same numbers; a layer BackPACK's extensions support).
    Logits of every position, ``[N, T, vocabulary]``.
    """

    def __init__(self, vocabulary, context, width, heads, layers, bias=True, norm="nanogpt"):
        super().__init__()
        norm = NanoLayerNorm if norm == "nanogpt" else (lambda w, b: nn.LayerNorm(w, bias=b))
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocabulary, width),
            wpe=nn.Embedding(context, width),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([_NanoBlock(width, heads, bias, norm) for _ in range(layers)]),
            ln_f=norm(width, bias),
        ))
        self.lm_head = nn.Linear(width, vocabulary, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        positions = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class ThreeUses(nn.Module):
    """One ``[V, d]`` matrix used three times, as T5 shares it: the encoder's embedding,
    the decoder's embedding (three distinct layers holding one parameter) and the head.

    The encoder reads the tokens, the decoder the tokens shifted right (token 0
    first) with the encoder's mean state added; logits ``[N, T, V]``.
    """

    def __init__(self, vocabulary, width):
        super().__init__()
        self.encoder_embedding = nn.Embedding(vocabulary, width)
        self.decoder_embedding = nn.Embedding(vocabulary, width)
        self.encoder = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.decoder = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.encoder_embedding.weight = self.decoder_embedding.weight = self.head.weight

    def forward(self, idx):
        context = self.encoder(self.encoder_embedding(idx)).mean(1, keepdim=True)
        shifted = torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], dim=1)
        return self.head(self.decoder(self.decoder_embedding(shifted) + context))


class LogitsOf(nn.Module):
    """A Hugging Face causal language model returning its logits (``[N, T, V]``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(input_ids=idx).logits


def hf_gpt2(vocabulary, context, width, heads, layers):
    """Hugging Face's ``GPT2LMHeadModel`` from a tiny config (head tied to ``wte`` by
    default, ``wpe(position_ids)`` with ``position_ids`` of shape ``(1, T)``), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocabulary, n_positions=context, n_embd=width, n_layer=layers,
                        n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    return LogitsOf(GPT2LMHeadModel(config))
