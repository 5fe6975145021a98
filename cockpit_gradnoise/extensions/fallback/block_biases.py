"""The biases of a block's linear layers, whose structural zeros are exact zeros, as the rule's.

A block run again on each example alone (:mod:`.blocks`) gives each parameter its
contributions by ``torch.autograd.grad``. An attention key's bias has a gradient of
zero by structure (softmax does not change when one number is added to every
score): its contributions are rounding noise, 1e-18 where the reference's is 1e-17,
whose quantiles and standard deviations mean nothing; the native Linear rule makes
them exact zeros (:func:`.sums.structural_zeros`). Here too: a bias of an
``nn.Linear`` the block computes, called once in the recomputation, is the sum of the
rows of that call's output gradient ``g``, so each contribution comes with its
terms' magnitudes ``sum |g|`` over those rows; an element all of whose contributions
are within rounding of them is set to exactly 0 (:func:`.reduce.with_structural_zeros`,
the fallback's own).

Those magnitudes must be read at the layer's own output. An operation that changes
that tensor in place (``ReLU(inplace=True)``: Swinv2's position-bias MLP) rebases it
to its own output, whose gradient is not zero where the ReLU is off, although the
bias's terms are there: a unit on only where a sigmoid saturates (contributions of
1e-88, each one exact term) then looked like rounding of terms of 1e-4 and was set to
0 (issue 32). So the rest of the block gets a copy of each output (:func:`kept`),
and the captured tensor is never changed.

A layer whose parent passes its weight and bias to ``F.linear`` itself, never calling it
(:data:`.window_map.FUNCTIONAL`: torchvision's Swin attention's ``qkv``, whose key third is
such a zero), has its output read at that call instead (:class:`_FunctionalOutputs`).
"""

from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions.fallback.window_map import FUNCTIONAL

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


def kept(calls: List[Tensor], output: Tensor) -> Tensor:
    """Appends a linear layer's ``output`` to ``calls`` and returns a copy of it for the
    rest of the block (a forward hook's result replaces the output): an in-place change
    downstream changes the copy, and the gradient at ``output`` stays that at the layer's
    output, whose rows are the bias's terms (the module docstring)."""
    calls.append(output)
    return output.clone()


class _FunctionalOutputs(TorchFunctionMode):
    """During a recomputation: the output of each ``F.linear`` call given a :data:`FUNCTIONAL`
    layer's weight and its own bias, kept (:func:`kept`) as a forward hook of the layer would."""

    def __init__(self, seen: Dict[int, List[Tensor]], layers: List[nn.Linear]):
        super().__init__()
        self.seen, self.layers = seen, layers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.nn.functional.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            for layer in self.layers:  # (under own_parameters, the layer's attributes are the copies)
                if weight is layer.weight and bias is not None and bias is layer.bias:
                    return kept(self.seen[id(layer)], out)
        return out

    def remove(self) -> None:
        """Leave the mode (a handle among the hooks' handles)."""
        self.__exit__(None, None, None)


def watch(seen: Dict[int, List[Tensor]], layers: List[nn.Linear]) -> list:
    """Handles (``remove()``) of forward hooks on ``layers`` that keep their outputs in ``seen``
    (:func:`kept`), and of the mode that keeps those of the :data:`FUNCTIONAL` ones, entered."""
    handles = [layer.register_forward_hook(lambda m, a, out: kept(seen[id(m)], out)) for layer in layers]
    functional = [layer for layer in layers if layer.__dict__.get(FUNCTIONAL)]
    if functional:
        mode = _FunctionalOutputs(seen, functional)
        mode.__enter__()
        handles.append(mode)
    return handles


class LinearBiases:
    """The outputs of the block's linear layers whose biases it computes, in one recomputation.

    Use: :meth:`install` (inside the block's hooks switched off: the hooks go with them),
    run the block, :meth:`outputs` to add to ``torch.autograd.grad``'s inputs, then
    :meth:`terms` with their gradients.
    """

    def __init__(self, module: nn.Module, params: Dict[str, nn.Parameter]):
        ids = {id(p): name for name, p in params.items()}
        self.layers: List[Tuple[str, nn.Linear]] = [
            (ids[id(sub.bias)], sub) for sub in module.modules()
            if isinstance(sub, nn.Linear) and sub.bias is not None and id(sub.bias) in ids]
        self.seen: Dict[int, List[Tensor]] = {}

    def install(self) -> list:
        self.seen = {id(layer): [] for _, layer in self.layers}
        return watch(self.seen, [layer for _, layer in self.layers])

    def outputs(self) -> List[Tensor]:
        """The output of each layer called once (the others get no magnitudes)."""
        return [calls[0] for calls in self.seen.values() if len(calls) == 1 and calls[0].requires_grad]

    def terms(self, grads: List[Optional[Tensor]]) -> Dict[str, Optional[Tuple[Tensor, int]]]:
        """``{bias name: (sum |g| over the rows [out], rows)}``, ``None`` where unknown."""
        found, k = {}, 0
        for name, layer in self.layers:
            calls = self.seen[id(layer)]
            if len(calls) != 1 or not calls[0].requires_grad:
                found[name] = None
                continue
            g, k = grads[k], k + 1
            found[name] = None if g is None else (
                g.abs().reshape(-1, g.shape[-1]).sum(0), g.numel() // max(g.shape[-1], 1))
        return found
