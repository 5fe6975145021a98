"""``nn.MultiheadAttention`` rebuilt from ``nn.Linear`` layers, for per-example quantities.

``nn.MultiheadAttention`` uses its projection weights directly in
``F.multi_head_attention_forward`` (and its ``out_proj`` is a ``Linear``
subclass BackPACK does not look up), so BackPACK has no per-example results
for it, and neither for ``nn.TransformerEncoderLayer`` / ``DecoderLayer``.
:class:`LinearAttention` computes exactly the same function from three input
projections and one output projection, each an ``nn.Linear`` applied to
(batch, sequence, features) inputs (which BackPACK supports), and
``torch.nn.functional.scaled_dot_product_attention``.

Parameter names, for a module converted at ``attn`` (both directions):

=================================  =========================================
``nn.MultiheadAttention``          :class:`LinearAttention`
=================================  =========================================
``attn.in_proj_weight[:E]``        ``attn.q_proj.weight``
``attn.in_proj_weight[E:2E]``      ``attn.k_proj.weight``
``attn.in_proj_weight[2E:]``       ``attn.v_proj.weight``
``attn.in_proj_bias[...]``         ``attn.q_proj.bias`` (``k_``, ``v_`` alike)
``attn.out_proj.weight``/``bias``  ``attn.out_proj.weight``/``bias``
=================================  =========================================

Attention written from ``nn.Linear`` layers on (batch, sequence, features)
needs no conversion.
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class LinearAttention(nn.Module):
    """Multi-head attention from ``nn.Linear`` layers; same call and results as
    ``nn.MultiheadAttention`` with ``embed_dim == kdim == vdim``.

    Args:
        embed_dim: Model width ``E``.
        num_heads: Number of heads (``E`` divisible by it).
        dropout: Dropout probability on the attention weights (training only).
        bias: Whether the projections have biases.
        batch_first: Inputs are (batch, sequence, features) if ``True``, else
            (sequence, batch, features). Internally always batch first, so that
            BackPACK sees the batch in the leading dimension of every projection.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, batch_first=False):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.dropout, self.batch_first = dropout, batch_first
        # Read by nn.TransformerEncoderLayer's fast-path checks (never taken in training).
        self._qkv_same_embed_dim = True
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    @property
    def in_proj_weight(self) -> Tensor:
        """The three input projections stacked as ``nn.MultiheadAttention`` stores them."""
        return torch.cat([getattr(self, p).weight for p in _PROJECTIONS])

    @property
    def in_proj_bias(self) -> Optional[Tensor]:
        """The three input biases stacked (``None`` without biases)."""
        if self.q_proj.bias is None:
            return None
        return torch.cat([getattr(self, p).bias for p in _PROJECTIONS])

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """As ``nn.MultiheadAttention.forward``."""
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, target, _ = query.shape
        source = key.shape[1]
        q, k, v = (
            self._heads(getattr(self, p)(x)) for p, x in zip(_PROJECTIONS, (query, key, value))
        )
        mask = _additive_mask(attn_mask, key_padding_mask, q.dtype, batch, source)
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                causal = torch.ones(target, source, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~causal, -math.inf)
            weights = F.dropout(scores.softmax(-1), dropout, training=self.training)
            heads = weights @ v
        else:
            weights = None
            heads = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None
            )
        output = self.out_proj(heads.transpose(1, 2).reshape(batch, target, self.embed_dim))
        if not self.batch_first:
            output = output.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        return output, weights

    def _heads(self, x: Tensor) -> Tensor:
        """(batch, sequence, E) -> (batch, heads, sequence, E / heads)."""
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, -1).transpose(1, 2)


def _additive_mask(attn_mask, key_padding_mask, dtype, batch, source) -> Optional[Tensor]:
    """``nn.MultiheadAttention``'s masks (``True`` = may not attend) as one additive mask."""
    mask = None
    if attn_mask is not None:
        mask = _as_additive(attn_mask, dtype)
        if mask.dim() == 3:  # (batch * heads, target, source)
            mask = mask.view(batch, -1, *mask.shape[1:])
    if key_padding_mask is not None:
        padding = _as_additive(key_padding_mask, dtype).view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask


def _as_additive(mask: Tensor, dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    return mask.to(dtype)


def from_multihead_attention(attention: nn.MultiheadAttention) -> LinearAttention:
    """A :class:`LinearAttention` with ``attention``'s parameter values (copied)."""
    if not attention._qkv_same_embed_dim:
        raise ValueError("only nn.MultiheadAttention with kdim == vdim == embed_dim is supported")
    if attention.bias_k is not None or attention.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn are not supported")
    bias = attention.in_proj_bias is not None
    converted = LinearAttention(
        attention.embed_dim, attention.num_heads, attention.dropout, bias, attention.batch_first
    ).to(attention.in_proj_weight)
    with torch.no_grad():
        for index, name in enumerate(_PROJECTIONS):
            rows = slice(index * attention.embed_dim, (index + 1) * attention.embed_dim)
            getattr(converted, name).weight.copy_(attention.in_proj_weight[rows])
            if bias:
                getattr(converted, name).bias.copy_(attention.in_proj_bias[rows])
        converted.out_proj.weight.copy_(attention.out_proj.weight)
        if bias:
            converted.out_proj.bias.copy_(attention.out_proj.bias)
    converted.train(attention.training)
    return converted


def to_multihead_attention(attention: LinearAttention) -> nn.MultiheadAttention:
    """The inverse of :func:`from_multihead_attention` (parameter values copied)."""
    bias = attention.q_proj.bias is not None
    original = nn.MultiheadAttention(
        attention.embed_dim,
        attention.num_heads,
        dropout=attention.dropout,
        bias=bias,
        batch_first=attention.batch_first,
    ).to(attention.q_proj.weight)
    with torch.no_grad():
        original.in_proj_weight.copy_(attention.in_proj_weight)
        if bias:
            original.in_proj_bias.copy_(attention.in_proj_bias)
        original.out_proj.weight.copy_(attention.out_proj.weight)
        if bias:
            original.out_proj.bias.copy_(attention.out_proj.bias)
    original.train(attention.training)
    return original


def convert_attention(model: nn.Module) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` in ``model`` by a :class:`LinearAttention`.

    In place (``model`` is returned); parameter values are kept and names
    mapped as in the table of this module. Convert before creating the
    optimizer and before :func:`~cockpit_gradnoise.prepare_model`. Undo with
    :func:`restore_attention` (e.g. to save a checkpoint in the original layout).
    """
    return _replace(model, nn.MultiheadAttention, from_multihead_attention)


def restore_attention(model: nn.Module) -> nn.Module:
    """Replace every :class:`LinearAttention` in ``model`` by ``nn.MultiheadAttention``."""
    return _replace(model, LinearAttention, to_multihead_attention)


def _replace(model, old_class, convert):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is old_class:
                setattr(parent, name, convert(child))
    return model
