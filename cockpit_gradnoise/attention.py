"""``nn.MultiheadAttention`` computed by ``nn.Linear`` layers, for per-example quantities.

``nn.MultiheadAttention`` uses its projection weights directly in
``F.multi_head_attention_forward`` (its ``out_proj`` too, through
``F.linear``), so BackPACK has no per-example results for it, and neither for
``nn.TransformerEncoderLayer`` / ``DecoderLayer``. :class:`LinearAttention`
computes exactly the same function with the same parameters: the input
projection is an ``nn.Linear`` (``in_proj``) whose weight and bias *are*
``in_proj_weight`` and ``in_proj_bias``, and ``out_proj`` is called as a
module; both see (batch, sequence, features) inputs, which BackPACK supports;
attention itself is ``torch.nn.functional.scaled_dot_product_attention``.

The conversion keeps the parameter tensors themselves (an optimizer built
before it still holds them), their names (``attn.in_proj_weight``,
``attn.in_proj_bias``, ``attn.out_proj.weight``, ``attn.out_proj.bias``), and
``state_dict`` keys: ``in_proj``'s own entries are left out of it (they are
``in_proj_weight`` and ``in_proj_bias``) and filled in on loading, so
checkpoints of either layout load into the other.
:func:`~cockpit_gradnoise.prepare_model` (and so
:func:`~cockpit_gradnoise.track`) converts every ``nn.MultiheadAttention``
it can; those with ``kdim``/``vdim`` other than ``embed_dim``,
``add_bias_kv`` or ``add_zero_attn`` stay as they are (no per-example rows;
the quantities' warning names them).

Self-attention (``query is key is value``) projects its input once. Otherwise
the distinct inputs are concatenated along the sequence and projected in one
call (so that ``in_proj`` is one layer applied once, as per-example results
require), and each of query, key and value takes its positions and its third
of the features: the weight rows of the query get no gradient from key
positions, exactly as in ``nn.MultiheadAttention``; the projection costs up
to three times as much.

Attention written from ``nn.Linear`` layers on (batch, sequence, features)
needs no conversion.
"""

import itertools
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LinearAttention(nn.Module):
    """Multi-head attention from ``nn.Linear`` layers; same call, results, parameters and
    ``state_dict`` as ``nn.MultiheadAttention`` with ``embed_dim == kdim == vdim``.

    Args:
        embed_dim: Model width ``E``.
        num_heads: Number of heads (``E`` divisible by it).
        dropout: Dropout probability on the attention weights (training only).
        bias: Whether the projections have biases.
        batch_first: Inputs are (batch, sequence, features) if ``True``, else
            (sequence, batch, features). Internally always batch first, so that
            BackPACK sees the batch in the leading dimension of every projection.
        device, dtype: Of the parameters (initialized as ``nn.MultiheadAttention``'s).
    """

    # nn.TransformerEncoderLayer's fast path (evaluation without gradients) calls it.
    merge_masks = nn.MultiheadAttention.merge_masks

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, batch_first=False,
                 device=None, dtype=None):
        super().__init__()
        self._adopt(nn.MultiheadAttention(embed_dim, num_heads, dropout, bias,
                                          batch_first=batch_first, device=device, dtype=dtype))

    @classmethod
    def of(cls, attention: nn.MultiheadAttention) -> "LinearAttention":
        """A :class:`LinearAttention` with ``attention``'s parameters (the tensors themselves).

        Raises:
            ValueError: For ``kdim``/``vdim`` other than ``embed_dim``,
                ``add_bias_kv`` or ``add_zero_attn``.
        """
        converted = cls.__new__(cls)
        nn.Module.__init__(converted)
        converted._adopt(attention)
        return converted

    def _adopt(self, attention: nn.MultiheadAttention):
        """Take ``attention``'s parameters (the tensors themselves) and settings."""
        if not attention._qkv_same_embed_dim:
            raise ValueError("only nn.MultiheadAttention with kdim == vdim == embed_dim is supported")
        if attention.bias_k is not None or attention.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        self.embed_dim, self.num_heads = attention.embed_dim, attention.num_heads
        self.dropout, self.batch_first = attention.dropout, attention.batch_first
        self.head_dim = attention.head_dim
        # Read by nn.TransformerEncoderLayer's fast-path checks.
        self._qkv_same_embed_dim = True
        self.in_proj_weight = attention.in_proj_weight
        if attention.in_proj_bias is None:
            self.register_parameter("in_proj_bias", None)
        else:
            self.in_proj_bias = attention.in_proj_bias
        self.out_proj = attention.out_proj
        # Registered after the parameters, so they keep their names (named_parameters
        # yields a shared tensor once, under its first name).
        self.in_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim, bias=False, device="meta")
        self.in_proj.weight = self.in_proj_weight
        self.in_proj.bias = self.in_proj_bias
        self._register_state_dict_hook(_without_in_proj)
        self._register_load_state_dict_pre_hook(_with_in_proj, with_module=True)
        self.train(attention.training)

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
        # Shapes read by index, not unpacked: torch.fx (BackPACK's converter) can trace it.
        q, k, v = (self._heads(x) for x in self._projections(query, key, value))
        batch, target, source = q.shape[0], q.shape[2], k.shape[2]
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

    def _projections(self, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, ...]:
        """``(q, k, v)``, batch first, from one call of ``in_proj`` (see the module's docstring)."""
        inputs = (query, key, value)
        # Each role's first identical input, and the distinct inputs in order.
        first = [next(j for j in range(3) if inputs[j] is x) for x in inputs]
        distinct = sorted(set(first))
        tensors = [inputs[j] if self.batch_first else inputs[j].transpose(0, 1) for j in distinct]
        projected = self.in_proj(tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1))
        ends = list(itertools.accumulate(x.shape[1] for x in tensors))
        starts = [0, *ends[:-1]]
        result = []
        for role in range(3):
            d = distinct.index(first[role])
            features = slice(role * self.embed_dim, (role + 1) * self.embed_dim)
            positions = slice(None) if len(tensors) == 1 else slice(starts[d], ends[d])
            result.append(projected[:, positions, features])
        return tuple(result)

    def _heads(self, x: Tensor) -> Tensor:
        """(batch, sequence, E) -> (batch, heads, sequence, E / heads)."""
        return x.reshape(x.shape[0], x.shape[1], self.num_heads, -1).transpose(1, 2)


def _without_in_proj(module, state_dict, prefix, local_metadata):
    """``state_dict`` hook: ``in_proj``'s entries are ``in_proj_weight`` and ``in_proj_bias``."""
    for name in ("weight", "bias"):
        state_dict.pop(f"{prefix}in_proj.{name}", None)


def _with_in_proj(module, state_dict, prefix, *args):
    """``load_state_dict`` pre-hook: ``in_proj``'s entries from ``in_proj_weight`` and ``in_proj_bias``."""
    for name in ("weight", "bias"):
        if f"{prefix}in_proj_{name}" in state_dict:
            state_dict[f"{prefix}in_proj.{name}"] = state_dict[f"{prefix}in_proj_{name}"]


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
    """A :class:`LinearAttention` with ``attention``'s parameters (the tensors themselves)."""
    return LinearAttention.of(attention)


def to_multihead_attention(attention: LinearAttention) -> nn.MultiheadAttention:
    """The inverse of :func:`from_multihead_attention` (the parameter tensors themselves)."""
    original = nn.MultiheadAttention(
        attention.embed_dim, attention.num_heads, dropout=attention.dropout,
        bias=attention.in_proj_bias is not None, batch_first=attention.batch_first, device="meta",
    )
    original.in_proj_weight = attention.in_proj_weight
    original.in_proj_bias = attention.in_proj_bias
    original.out_proj = attention.out_proj
    original.train(attention.training)
    return original


def convert_attention(model: nn.Module) -> nn.Module:
    """Replace every ``nn.MultiheadAttention`` in ``model`` by a :class:`LinearAttention`.

    In place (``model`` is returned; ``model`` itself if it is one). The
    parameters stay the same tensors under the same names, so an optimizer
    built before keeps working. :func:`~cockpit_gradnoise.prepare_model` calls
    it. One that cannot be converted (``kdim``/``vdim`` other than
    ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``) stays as it is, with a
    warning: it gets no per-example rows. Undo with :func:`restore_attention`.
    """
    def convert(attention):
        try:
            return from_multihead_attention(attention)
        except ValueError as error:
            warnings.warn(f"cockpit-gradnoise: an nn.MultiheadAttention is left as it is ({error}); "
                          "its parameters get no per-example rows", stacklevel=4)
            return attention

    return _replace(model, nn.MultiheadAttention, convert)


def restore_attention(model: nn.Module) -> nn.Module:
    """Replace every :class:`LinearAttention` in ``model`` by ``nn.MultiheadAttention``."""
    return _replace(model, LinearAttention, to_multihead_attention)


def _replace(model, old_class, convert):
    if type(model) is old_class:
        return convert(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is old_class:
                setattr(parent, name, convert(child))
    return model
