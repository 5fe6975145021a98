"""One buffer for the ``[T, S]`` sums of all layers of a backward pass, so that their union is one array.

GradientVarianceQuantiles needs, per element, ``sd_j`` and ``SNR_j`` from the
sums ``T_j = sum_i x_ij`` and ``S_j = sum_i x_ij**2``, and quantiles over
each layer and over the whole network. Each layer's sums are a tensor of
their own (``[2, *param.shape]``), so the network's union needed two new
buffers of all its elements for sd and SNR: on an MLP, whose gradients are
most of its step's memory, 4.8 times a plain step's peak (issue 21).

Here the sums that :func:`.sums.stacked` writes (a Linear's weight from
two matrix products, every sum of per-example contributions: biases, norms,
embeddings) are written side by side into one ``[2, total]`` buffer of the
backward pass, ``T`` in its first row, ``S`` in its second. When the layers
of the network tile it, sd and SNR are formed in place over the two rows
(:func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise` with ``union``)
and their quantiles taken on the rows themselves: no buffer beyond the sums.

The buffer's size is what the same model's previous backward pass wrote
through :func:`.sums.stacked` (the model: the first layer whose sums it
placed), confirmed by the quantity that can use it (:func:`confirm`: one
batch on one process, on the CPU). Until then, and where a layer's sums do
not fit, each is a tensor of its own as before. A slot the plan had and this
backward pass did not use is the only memory this costs. sd and SNR are the
same numbers either way; the network's means, float64 sums of the union in
another order, may differ in their last bits. On other devices than the CPU
nothing changes. (A layer's own ``[2, *shape]`` sums tile their storage too:
a network of one layer needs no buffer of the backward pass.)
"""

import contextlib
import math
import weakref
from collections import Counter
from typing import Dict, Optional, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import facts as backward_facts

import torch
from torch import Tensor

#: ``{layer: {(device, dtype): elements}}``, as confirmed, by the first layer whose sums a
#: backward pass placed (the model's last: it names the model). Weak: a new model, even one
#: alike, starts without a plan, so that two runs alike compute alike. Module-level, and not
#: on the backward pass (:mod:`.facts`): a plan outlives its pass, for the model's next one.
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Backward:
    """What :func:`.sums.stacked` needs of the backward pass in progress (its ``arena``)."""

    def __init__(self):
        self.layer = None  # the layer being served (None: no sums rule runs)
        self.first: Optional[weakref.ref] = None  # the first layer whose sums were placed
        self.plan: Optional[Dict[Tuple[torch.device, torch.dtype], int]] = None  # from it
        self.kept: Counter = Counter()  # (device, dtype) -> elements of stacked's saved results
        self.buffers: Dict[Tuple[torch.device, torch.dtype], list] = {}  # -> [weakref, used]
        self.made: Dict[int, Tensor] = {}  # data_ptr -> result of stacked, in the current rule


@contextlib.contextmanager
def serving(facts, module, savefield: str):
    """While a sums rule runs on ``module`` in the backward pass that ``facts`` records:
    :func:`place` may give slots of the backward pass's buffer. Afterwards, the
    results of :func:`place` that ``module``'s parameters keep as ``savefield`` count
    towards the plan :func:`confirm` makes. :func:`serve` and :func:`served` are the
    same without the generator, for the rules' per-layer path."""
    serve(facts, module)
    try:
        yield
    finally:
        served(facts, module, savefield)


def serve(facts, module) -> None:
    """A sums rule begins on ``module``: :func:`place` may give slots of the buffer."""
    if facts.arena is None:
        facts.arena = _Backward()
    facts.arena.layer = module


def served(facts, module, savefield: str) -> None:
    """The sums rule on ``module`` is over (also when it raised): count what its
    parameters keep of what :func:`place` gave."""
    backward = facts.arena
    backward.layer = None
    if not backward.made:  # nothing placed (the GPU's paths place nothing)
        return
    for param in module._parameters.values():
        kept = getattr(param, savefield, None) if param is not None else None
        made = backward.made.get(kept.data_ptr()) if isinstance(kept, Tensor) else None
        if made is not None and made.dtype == kept.dtype and made.shape == kept.shape:
            backward.kept[(kept.device, kept.dtype)] += kept[0].numel()
    backward.made.clear()


def place(like: Tensor, shape: Sequence[int]) -> Tensor:
    """A new ``[2, *shape]`` tensor of ``like``'s dtype and device, for ``[T, S]``.

    In a served backward pass on the CPU, with a plan: a view of the pass's
    buffer, its next free elements (while it has room).
    """
    backward = backward_facts.recording().arena
    if backward is not None and backward.layer is None:  # not served now
        backward = None
    if backward is not None and backward.plan is None:  # the first layer placed: the model's plan
        backward.first, backward.plan = weakref.ref(backward.layer), _PLANS.get(backward.layer, {})
    result = _slot(backward, like, shape) if backward is not None else None
    if result is None:
        result = like.new_empty(2, *shape)
    if backward is not None:
        backward.made[result.data_ptr()] = result
    return result


def _slot(backward: _Backward, like: Tensor, shape: Sequence[int]) -> Optional[Tensor]:
    """:func:`place`'s view of the buffer, or ``None``."""
    key = (like.device, like.dtype)
    total = backward.plan.get(key, 0)
    if not _device.on_host(like) or total == 0:
        return None
    if key not in backward.buffers:
        buffer = torch.empty(2, total, dtype=like.dtype)
        # Held by the slots' views only: freed with the savefields after the step.
        backward.buffers[key] = [weakref.ref(buffer), 0]
    reference, used = backward.buffers[key]
    buffer, numel = reference(), math.prod(shape)
    if buffer is None or used + numel > total:
        return None
    backward.buffers[key][1] = used + numel
    return buffer[:, used : used + numel].view(2, *shape)


def confirm(facts) -> None:
    """Plan the next backward pass of the same model after this one (``facts``'s):
    a buffer of the sums of :func:`.sums.stacked` it kept. Called by the quantity that forms
    sd and SNR in place, where it can (one batch on one process)."""
    backward = facts.arena
    layer = None if backward is None or backward.first is None else backward.first()
    if layer is not None:
        _PLANS[layer] = dict(backward.kept)


def union_of(layers: Sequence[Tuple[Tensor, ...]]) -> Optional[Tuple[Tensor, Tensor]]:
    """``(S, T)``: the rows of one ``[2, total]`` storage that the layers' ``(S, T)`` tile
    exactly, else ``None`` (also where a layer has ``R``).

    Tiling: every ``T`` a contiguous piece of the first row and its ``S`` the same
    piece of the second, the pieces disjoint and covering the row. Then forming
    sd and SNR over the rows forms every layer's, and nothing else.
    """
    if not layers:
        return None
    storage = layers[0][1].untyped_storage()
    total, odd = divmod(storage.nbytes() // layers[0][1].element_size(), 2)
    if odd:
        return None
    pieces = []
    for layer in layers:
        if len(layer) != 2:  # R of sums expanded over positions
            return None
        squares, grad = layer
        if not (squares.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
                == storage.data_ptr() and squares.dtype == grad.dtype == layers[0][1].dtype
                and grad.is_contiguous() and squares.is_contiguous()
                and squares.storage_offset() == grad.storage_offset() + total):
            return None
        pieces.append((grad.storage_offset(), grad.numel()))
    end = 0
    for offset, size in sorted(pieces):
        if offset != end:
            return None
        end += size
    if end != total:
        return None
    rows = [layers[0][1].new_empty(0).set_(storage, k * total, (total,)) for k in (1, 0)]
    return rows[0], rows[1]
