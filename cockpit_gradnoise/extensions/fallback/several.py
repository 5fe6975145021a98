"""A module with the fallback called several times in one forward pass: its calls summed per example.

T5Gemma2's merged attention normalizes its own keys and the encoder's with one
``k_norm``; a shared block may run its layer scale at every depth. Each call
``c`` of the module, with its inputs ``a^(c)`` and the gradient ``G^(c)`` at its
output, gives example ``i`` the contribution

.. math::

    x_i^{(c)} = \\Big(\\frac{\\partial f(a^{(c)}_i; \\theta)}{\\partial \\theta}\\Big)^{\\top} G^{(c)}_i ,

and the example's contribution is their sum ``x_i = sum_c x_i^(c)`` (the
chain rule through every use of ``theta``, as for tied weights and the layers
of :mod:`..repeated`), so ``||x_i||^2`` and ``[sum_i x_i, sum_i x_i**2]``
need the sum *before* squaring. Here, for a chunk of examples at a time
(:func:`.cost_model.examples_per_chunk`), each call's contributions
(:func:`.replay.per_example_gradients`, or the module's closed form,
:mod:`.closed_form`) are summed over the calls; :mod:`.running` reduces the
sums and saves them. The memory held is each call's arguments and output
gradient (kept through the backward pass) and one chunk's contributions.

Which calls, and when (:mod:`.running`): the calls of one forward pass of the
prepared model (:mod:`.capture` keeps them, :func:`.layout.learn` seals them at
its end, each with a layout of its own), summed at the end of the backward pass
once every call's gradient has arrived; their rows are taken for the examples
in order, as every rule takes them.
"""

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from cockpit_gradnoise.extensions.fallback.capture import Call, Fallback
from cockpit_gradnoise.extensions.fallback.replay import per_example_gradients

from torch import Tensor, nn


@dataclass
class Arrivals:
    """The calls of a module called several times that one backward pass reached.

    Attributes:
        grads: ``{id(call): (call, g_out)}``: the hooks' output gradients of each call reached.
        savefields: The savefields of the extensions that reached the module.
        stale: A hook of a call of another (earlier) forward pass came (its rows are other
            examples': refused).
    """

    grads: Dict[int, Tuple[Call, tuple]] = field(default_factory=dict)
    savefields: set = field(default_factory=set)
    stale: bool = False


@dataclass
class Part:
    """One call's share of the sum: what :func:`.replay.per_example_gradients` needs of it."""

    call: Call
    batched: Sequence[int]
    children: Sequence[int]
    grads: Dict[int, Tensor]
    blind_outputs: List[int]


def summed_contributions(module: nn.Module, state: Fallback, params: Dict[str, Tensor],
                         parts: List[Part], examples: int, size: int,
                         blind: Dict[str, str]) -> Iterator[Tuple[Dict[str, Tensor], Dict]]:
    """``({name: sum_c x_i^(c)}, terms)`` for ``size`` examples at a time, the calls
    (``parts``) summed per example; ``terms`` of an ``F.linear`` bias summed over the calls too
    (magnitudes and counts add: :func:`.reduce.with_structural_zeros`), ``None`` where
    one call gives none. ``blind`` collects the parameters a call could not give rows."""
    form = state.closed_form
    for start in range(0, examples, size):
        stop = min(start + size, examples)
        total: Dict[str, Tensor] = {}
        terms: Dict[str, Optional[Tuple[Tensor, int]]] = {}
        for k, part in enumerate(parts):
            if form is not None and part.call.one_input is not None:
                found = form.contributions(module, part.call.one_input[start:stop],
                                           part.grads[0][start:stop], form.eps)
                found_terms = {}
            else:
                found, found_terms = per_example_gradients(
                    module, params, part.call, part.batched, part.children, part.grads,
                    start, stop, part.blind_outputs, blind)
            for name, value in found.items():
                total[name] = value if name not in total else total[name] + value
            terms = found_terms if k == 0 else _summed_terms(terms, found_terms)
        kept = {name: value for name, value in total.items() if name not in blind}
        yield kept, {name: value for name, value in terms.items() if name in kept}


def _summed_terms(a: Dict, b: Dict) -> Dict:
    """Two calls' ``{name: (magnitudes, count)}`` added; ``None`` where either has none."""
    summed = {}
    for name in set(a) | set(b):
        x, y = a.get(name), b.get(name)
        summed[name] = None if x is None or y is None else (x[0] + y[0], x[1] + y[1])
    return summed
