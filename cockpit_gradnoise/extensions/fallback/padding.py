"""An embedding's ``padding_idx`` kept in a recomputation under ``vmap`` with a weight per example.

``F.embedding(idx, weight, padding_idx=p)`` gives the row ``p`` no gradient. Under
``torch.func.vmap`` with a copy of the weight per example and an ordinary backward
pass to the copies (the fallback's recomputation, :mod:`.replay`, and that of a
layer called several times, :mod:`..repeated`), torch 2.14 keeps that only for
the first example: the others' copies get the padding positions' gradients in
row ``p`` (``vmap`` of ``torch.func.vjp`` keeps it; measured here). I-BERT's
``QuantEmbedding`` (``F.embedding(x, self.weight, self.padding_idx)``) had its word
embedding's rows silently off wherever a batch held the padding token after its
first example.

:func:`padding_kept` makes the rule explicit inside a recomputation: the lookup
without ``padding_idx``, its value kept and its gradient stopped at the padding
positions,

.. math::

    y_t = W_{idx_t}, \\qquad \\frac{\\partial y_t}{\\partial W} = 0 \\text{ where } idx_t = p,

which is what ``padding_idx`` means for the gradient; the forward value is unchanged.
"""

import contextlib

from torch import Tensor, nn, where
from torch.nn import functional
from torch.overrides import TorchFunctionMode

#: ``F.embedding``'s arguments, in order.
_ARGUMENTS = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


class _PaddingKept(TorchFunctionMode):
    """``F.embedding`` with a ``padding_idx`` as a lookup whose gradient stops at the padding."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not functional.embedding:
            return func(*args, **kwargs)
        given = {**dict(zip(_ARGUMENTS, args)), **kwargs}
        padding = given.pop("padding_idx", None)
        if padding is None:
            return func(*args, **kwargs)
        index: Tensor = given["input"]
        padding = padding if padding >= 0 else given["weight"].shape[0] + padding
        looked_up = functional.embedding(**given)
        keep = (index != padding).unsqueeze(-1)
        return where(keep, looked_up, looked_up.detach())


def padding_kept(module: nn.Module):
    """A context in which every ``F.embedding`` with a ``padding_idx`` stops the gradient at
    the padding positions itself (exact under ``vmap`` with a weight per example); nothing
    (no function mode, whose Python call per operation costs) where no module inside
    ``module`` has a ``padding_idx`` (``nn.Embedding``'s, ``QuantEmbedding``'s)."""
    if not any(getattr(inner, "padding_idx", None) is not None for inner in module.modules()):
        return contextlib.nullcontext()
    return _PaddingKept()
