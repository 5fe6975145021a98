"""A block's per-example gradients for a chunk of examples at once, under ``vmap``.

:mod:`.blocks` runs a block again on each example alone: ``N`` forward passes
and ``N`` calls of ``torch.autograd.grad`` on one example each, whose small
operations cost far more than their share of the batch's (Swin's window
attention: 32 examples of 16 windows, 0.23 s against 0.10 s for the same
work in chunks, CPU, one thread). Where every operation of the block has a
batching rule, the same vector-Jacobian products come from one pass per
chunk of examples: the block's forward under ``torch.func.vmap`` over the
examples, each example with its own copy of every parameter the block computes
(``p.expand(n, *p.shape)``, in place of ``p``, :func:`.parameters.own_parameters`),
then one ``torch.autograd.grad`` to those copies at the output gradients
``G_i``: the gradient of example ``i``'s copy is

.. math::

    x_i(p) = \\Big(\\frac{\\partial f(a_i; \\theta)}{\\partial p}\\Big)^{\\top} G_i ,

what the loop computes, in the same operations batched (equal to rounding).

``vmap``'s slow fallback (a loop over the examples for an operation without a
batching rule: ``torch._grouped_mm``, a mixture of experts' grouped products,
took 0.80 s where the loop took 0.30 s) is switched off inside, so such an
operation raises, as do data-dependent shapes (``nonzero``: the eager
experts' routing) and random operations (their draws cannot be replayed under ``vmap``: in
training mode the loop replays them, :mod:`.draws`). Where the first chunk raises, or its
outputs differ from the batch's, :func:`chunks` returns ``None`` and
:mod:`.blocks`' loop runs and checks, now and at every later step
(:attr:`.blocks.Block.vectorized` ``False``). A later chunk is checked the same
way (:class:`.blocks.Interacting`: the block's parameters refused by name). The
linear biases the block computes keep their structural zeros: each example's
output gradient of the layer, called once, gives its terms' magnitudes, as in
the loop, read at the layer's own output (:mod:`.block_biases`).

An embedding with a ``padding_idx`` inside the block runs under :func:`.padding.padding_kept`:
the batching rule of the embedding's backward pass ignores ``padding_idx`` for every example
but the first (torch 2.14: a padding token's row gets that example's gradient, where it gets
none), so the lookup's gradient is stopped at the padding positions explicitly, as in every
other recomputation (:mod:`.replay`, :mod:`..repeated`).
"""

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from cockpit_gradnoise.extensions import precision
from cockpit_gradnoise.extensions.fallback.block_biases import watch
from cockpit_gradnoise.extensions.fallback.capture import Call, first_tensor
from cockpit_gradnoise.extensions.fallback.padding import padding_kept
from cockpit_gradnoise.extensions.fallback.parameters import own_parameters
from cockpit_gradnoise.extensions.fallback.replay import math_attention

import torch
from torch import Tensor, nn
from torch.utils import _pytree

#: ``(contributions {name: [n, *shape]}, {bias name: (magnitudes [n, out], rows) or None})``
Chunk = Tuple[Dict[str, Tensor], Dict[str, Optional[Tuple[Tensor, int]]]]


@contextlib.contextmanager
def _no_slow_fallback():
    """``vmap`` without its per-example loop for operations lacking a batching rule: they raise."""
    functorch = torch._C._functorch
    enabled = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        functorch._set_vmap_fallback_enabled(enabled)


def chunk(module: nn.Module, call: Call, batched: Sequence[int], params: Dict[str, nn.Parameter],
          biases: List[Tuple[str, nn.Linear]], output: Tensor, grad: Tensor, start: int, stop: int,
          check: Callable[[Tensor, Tensor], None]) -> Chunk:
    """The contributions of examples ``start:stop`` (module docstring); ``biases`` the
    ``(name, layer)`` of the linear layers whose biases the block computes; ``check(output
    of the chunk, its rows of the batch's output)`` raises where they differ.

    Raises:
        Exception: Whatever ``vmap`` raises where it cannot run the block batched, or ``check``.
    """
    n = stop - start
    names = list(params)
    with torch.enable_grad():  # (called where the backward pass ends: grad mode may be off)
        copies = [p.expand(n, *p.shape) for p in params.values()]
    examples = [call.leaves[k][start:stop] for k in batched]
    seen: Dict[int, List[Tensor]] = {}

    def forward(*flat):
        leaves = list(call.leaves)
        for k, example in zip(batched, flat[len(names):]):
            leaves[k] = example.unsqueeze(0)
        args, kwargs = _pytree.tree_unflatten(leaves, call.spec)
        seen.update({id(layer): [] for _, layer in biases})
        handles = watch(seen, [layer for _, layer in biases])
        try:
            with own_parameters(module, dict(zip(names, flat[: len(names)]))):
                result = first_tensor(module(*args, **kwargs))
        finally:
            for handle in handles:
                handle.remove()
        # (run once, while vmap traces it: a layer called more than once gets no terms)
        return (result, *(calls[0] for calls in seen.values() if len(calls) == 1))

    with math_attention(), torch.enable_grad(), precision.autocast_as(call.autocast), \
            _no_slow_fallback(), padding_kept(module):
        results = torch.func.vmap(forward)(*copies, *examples)
    first = results[0]
    expected = output[start:stop].unsqueeze(1)
    check(first.detach(), expected)
    found = torch.autograd.grad(first, copies + list(results[1:]),
                                grad[start:stop].unsqueeze(1).to(first.dtype), allow_unused=True)
    contributions = {name: torch.zeros_like(copy) if g is None else g
                     for name, copy, g in zip(names, copies, found)}
    terms: Dict[str, Optional[Tuple[Tensor, int]]] = {}
    spread = iter(found[len(copies):])
    for name, layer in biases:
        g = next(spread) if len(seen[id(layer)]) == 1 else None
        terms[name] = None if g is None else (
            g.abs().reshape(n, -1, g.shape[-1]).sum(1), g[0].numel() // max(g.shape[-1], 1))
    return contributions, terms


def chunks(run_chunk: Callable[[int, int], Chunk], examples: int, size: int) -> Optional[Iterator[Chunk]]:
    """The chunks of ``size`` examples by ``run_chunk(start, stop)``, the first computed now:
    ``None`` where it raises (``vmap`` cannot run the block, or its check failed: the loop
    decides), with nothing yielded; a later chunk's exception goes up."""
    try:
        first = run_chunk(0, min(size, examples))
    except Exception:  # noqa: BLE001 - no batching rule, data-dependent shapes, randomness
        return None

    def rest():
        yield first
        for start in range(size, examples, size):
            yield run_chunk(start, min(start + size, examples))

    return rest()
