"""The fallback's ``vmap`` route checked once per module: do its examples' contributions add up?

:func:`.replay.per_example_gradients` runs a module on each example alone under
``vmap``. A module whose examples interact in its forward pass gives other outputs
alone; one whose examples interact in its backward pass only gives the same outputs
and gradients per example that are not the example's share of the batch's:
``h + (h - h.detach()).mean(0)`` (zero in value, ``1/N`` of every row's gradient to
each row in the batch, the row's own alone), or a custom ``autograd.Function`` whose
backward mixes the rows. Issue 32: silently wrong rows, which ``cgn.check_model``
showed (0.90 off on partial15's toy) and the tracker did not. The per-example loop of a module ``vmap``
cannot run has the same check (:func:`.running._not_summing`).
"""

import math
from typing import Collection, Dict, Iterator, List, Optional, Tuple

from cockpit_gradnoise.extensions import precision
from cockpit_gradnoise.extensions.fallback.capture import Call, Fallback
from cockpit_gradnoise.extensions.fallback.reduce import reduce_chunks, with_structural_zeros
from cockpit_gradnoise.extensions.fallback.replay import Refused, batch_gradients
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD

import torch
from torch import Tensor, nn

#: One call's share of the check: ``(call, the children's calls whose outputs depend on the
#: batch, {output position: gradient})``, as :func:`.replay.per_example_gradients` took them.
Part = Tuple[Call, Collection[int], Dict[int, Tensor]]


def reduced_and_checked(module: nn.Module, state: Fallback, params: Dict[str, Tensor], parts: List[Part],
                        chunks: Iterator[Tuple[Dict[str, Tensor], Dict]], savefields) -> Dict:
    """:func:`.reduce.reduce_chunks` of ``vmap``'s ``chunks`` for ``savefields``; at the
    module's first step on this route, checked to add up (:func:`not_summing_under_vmap`,
    its sum and ``||x_i||^2`` reduced too). ``parts``: the calls the chunks sum per example
    (one; several for a module called several times, :mod:`.several`).

    Raises:
        Refused: Where they do not add up: then, and at every later step without computing.
    """
    if state.not_summing is not None:
        raise Refused(state.not_summing)
    # (A batch of one example tells nothing: its one contribution is the gradient.)
    checking = not state.sums_checked and next(iter(parts[0][2].values())).shape[0] > 1
    fields = sorted({*savefields, LOCAL_GRADIENT_SAVEFIELD, BATCH_L2_SAVEFIELD}) if checking else savefields
    results = reduce_chunks(with_structural_zeros(chunks), fields)
    if checking:
        state.not_summing = not_summing_under_vmap(module, parts, params, results)
        state.sums_checked = True
        if state.not_summing is not None:
            raise Refused(state.not_summing)
    return {field: results[field] for field in savefields}


def not_summing_under_vmap(module: nn.Module, parts: List[Part], params: Dict[str, Tensor],
                           results: Dict) -> Optional[str]:
    """Why the contributions ``x_i`` that ``vmap`` gave (``results``: their sum and
    ``||x_i||^2``) are not the module's per-example gradients: their sum differs from the
    gradient ``G`` of the module run once more on the whole batch (at each of its calls,
    ``parts``), its children replayed as ``vmap``'s recomputation replays them
    (:func:`.replay.batch_gradients`: a dropout inside draws nothing new); ``None`` where they
    add up, for every parameter.

    ``vmap`` runs each example alone: a module whose examples interact in its backward pass
    only (a term zero in value, ``(h - h.detach()).mean(0)``, or a custom
    ``autograd.Function`` whose backward mixes the rows) gives each example's output as its row
    of the batch's, and contributions that do not add up to ``G``: the gradient each example
    alone sees is not its share of the batch's. Checked once per module, at its first step on
    this route (:func:`.running.compute`: the result is kept; later steps cost nothing more): whether a
    module's backward pass mixes its examples is a property of its code.

    Tolerance: ``||sum_i x_i - G|| <= sqrt(eps) S`` for each parameter, ``eps`` that of the
    narrowest dtype the batch's recomputation computes in (a float64 model whose norm computes
    in float32 rounds to float32), ``S`` the module's scale (:func:`module_scale`). Both sides
    are the same sums of products in another order; each carries at most ``(m - 1) eps`` times
    the sum of its terms' magnitudes (Higham 2002, ch. 3-4), a few thousand ``eps S`` at most
    (by far less in practice); ``sqrt(eps)`` leaves ``1 / sqrt(eps)`` (``6.7e7`` in float64,
    ``2.9e3`` in float32) above that and below a difference of the gradient's own size, which
    mixing makes (:func:`.precision.rounding_bound` says why). The module's scale, not the
    parameter's: a gradient zero by structure (an attention key's bias, SwiftFormer's ``w_g``)
    is rounding noise of terms of the module's size, both ways (``8.7e-17`` off against a
    gradient of ``8.7e-17``, CvT's key bias in float64). What it cannot see: a mixing term
    smaller than ``sqrt(eps)`` of the module's scale, or one whose contributions happen to add
    up to ``G``.
    """
    call, _, grads = parts[0]
    narrowest = precision.NarrowestResult(call.autocast[1] if call.autocast else next(iter(grads.values())).dtype)
    totals: Dict[str, Optional[Tensor]] = {name: None for name in params}
    output_scale = 0.0
    try:
        with narrowest:
            for call, batched_children, grads in parts:  # (a module called several times: their sum)
                found, scale = batch_gradients(module, params, call, batched_children, grads)
                totals = {name: _added(totals[name], found[name]) for name in totals}
                output_scale += scale
    except Exception as error:  # noqa: BLE001 - not checked: no rows rather than unchecked ones
        return (f"the sum of its contributions computed under torch.func.vmap could not be checked "
                f"against its gradient from the batch ({type(error).__name__}: {error})")
    tolerance = math.sqrt(torch.finfo(narrowest.dtype).eps) * module_scale(totals, results, params, output_scale)
    for name, summed in results[LOCAL_GRADIENT_SAVEFIELD].items():
        total = totals.get(name)
        off = float((summed.double() - (0 if total is None else total.double())).norm())
        if not off <= tolerance:
            scale = 0.0 if total is None else float(total.double().norm())
            return (f"the contributions of each example to {name}, computed under torch.func.vmap "
                    f"one example at a time, do not add up to its gradient from the batch ({off:.2g} "
                    f"off, against a gradient norm of {scale:.2g}): its examples interact in its "
                    "backward pass (a term zero in value, such as (h - h.detach()).mean(0), or a "
                    "custom autograd.Function whose backward mixes the rows), so no per-example "
                    "gradient of its parameters exists: make the module's backward pass treat each "
                    "example's rows alone at tracked steps to give them rows")
    return None


def module_scale(totals: Dict[str, Optional[Tensor]], results: Dict, params: Dict[str, Tensor],
                 output_scale: float) -> float:
    """The size of the terms a module's parameter gradients sum: ``max_p (||G_p|| +
    sqrt(sum_i ||x_ip||^2))`` over its parameters ``p``, plus ``sum ||y|| ||g|| / ||theta||``
    (``output_scale``, :func:`.replay.batch_gradients`).

    The first is the largest gradient of the module and its examples' contributions. The
    second is for a module whose every parameter's gradient is zero by structure (SwiftFormer's
    attention holds one, ``w_g``): its terms' size, from its outputs ``y`` and their gradients
    ``g``, in the parameters' units (``<G, theta> = <g, y>`` where ``y`` is linear in
    ``theta``: Euler's theorem), ``theta`` all the module's parameters (left out if zero).
    """
    largest = 0.0
    for name, summed in results[LOCAL_GRADIENT_SAVEFIELD].items():
        total = totals.get(name)
        own = 0.0 if total is None else float(total.double().norm())
        largest = max(largest, own + float(results[BATCH_L2_SAVEFIELD][name].double().sum().sqrt()))
    size = math.sqrt(sum(float(p.double().square().sum()) for p in params.values()))
    return largest + (output_scale / size if size > 0 else 0.0)


def _added(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    """``a + b``, ``None`` standing for no gradient (zeros)."""
    return b if a is None else a if b is None else a + b
