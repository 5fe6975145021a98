"""The reduction: per-example contributions to the three results the extensions save.

``||x_i||^2`` per example, ``[sum_i x_i, sum_i x_i**2]`` and ``sum_i x_i``,
all from one square of each chunk of contributions (:func:`reduce_chunks`),
each chunk freed once reduced; the biases of :class:`.replay._LinearBiases`
are held back to the end for their structural zeros
(:func:`with_structural_zeros`).
"""

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import precision
from cockpit_gradnoise.extensions._squares import (
    SMALLEST_UNSCALED,
    contributions_scale,
    exact_where_lost,
    needs_scale,
    saved_dtype,
    scaled,
    unscaled_norms,
    unscaled_sums,
)
from cockpit_gradnoise.extensions.linear import exact, linear_weight_squared_norms, linear_weight_sums_and_squared_norms
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.extensions.sums import position_sums, structural_zeros

import torch
from torch import Tensor

#: Bytes of contributions reduced at a time (:func:`norms_and_sums`): a block of columns
#: and its squares stay in a core's L2 cache, and the squares' buffer is reused. Reducing
#: the per-example gradients of HF ``Conv1D(384, 128)`` (``[32, 49152]`` float32, just
#: written) whole took 3 to 10 ms, in blocks of 512 KiB 1.5 ms (CPU, one thread).
BLOCK_BYTES = 2**19


def norms_and_sums(contributions: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`norms_and_sums_at_a_scale`, exact where underflow lost a sum of squares of
    float32 contributions: then from their float64 squares (:func:`._squares.exact_where_lost`)."""
    return exact_where_lost(norms_and_sums_at_a_scale, "ns", len(contributions),
                            contributions[0].numel() if len(contributions) else 0, contributions)


def norms_and_sums_at_a_scale(contributions: Tensor) -> Tuple[Tensor, Tensor]:
    """``(||x_i||^2 [N], [sum_i x_i, sum_i x_i**2])`` of contributions ``[N, *shape]``
    from one square of them.

    The results of :func:`._squares.squared_norms_of` and :func:`.sums.sums_of`
    (squares at a power-of-two scale where they could underflow, saved in
    float64 as theirs are), with the scale decided and the contributions
    squared once for both, a block of :data:`BLOCK_BYTES` at a time on the
    CPU. There the scale is decided after the fact: the unscaled squares are
    kept where the largest per-example norm shows a largest magnitude of at
    least :data:`._squares.SMALLEST_UNSCALED` (``max_i ||x_i||^2 >= numel *
    SMALLEST_UNSCALED**2``, numel per example), which spares the max-reduction
    of every layer but the tiny ones.
    """
    if needs_scale(contributions.dtype) and _device.on_host(contributions) and len(contributions):
        norms, sums = _blockwise(contributions)
        if float(norms.max()) >= contributions[0].numel() * SMALLEST_UNSCALED**2:
            return unscaled_norms(norms, None, contributions[0].numel()), sums
    scale = contributions_scale(contributions, rows=True)
    norms, sums = _blockwise(scaled(contributions, scale))
    return (unscaled_norms(norms, scale, contributions[0].numel()),
            unscaled_sums(sums, scale, len(contributions)))


def _blockwise(contributions: Tensor) -> Tuple[Tensor, Tensor]:
    """``(sum_k x_ik**2 [N], [sum_i x_i, sum_i x_i**2])`` over blocks of columns
    (:data:`BLOCK_BYTES`, on the CPU; whole elsewhere), in the contributions' dtype."""
    flat = contributions.reshape(len(contributions), -1)
    width = flat.shape[1]
    if contributions.requires_grad or not _device.on_host(contributions):
        squares = flat.square()
        sums = torch.stack([flat.sum(0), squares.sum(0)])
        return squares.sum(1), sums.view(2, *contributions.shape[1:])
    block = max(1, BLOCK_BYTES // max(1, len(flat) * flat.element_size()))
    sums = flat.new_empty(2, width)
    norms = flat.new_zeros(len(flat))
    for start in range(0, width, block):
        part = flat[:, start : start + block]
        squares = part.square()
        torch.sum(part, 0, out=sums[0, start : start + block])
        torch.sum(squares, 0, out=sums[1, start : start + block])
        norms += squares.sum(1)
    return norms, sums.view(2, *contributions.shape[1:])


def _reduced(chunk: Dict[str, Tensor]) -> Dict[str, Tuple[Tensor, Tensor]]:
    """``{name: (norms, sums)}`` of one chunk: :func:`norms_and_sums`, and on the CPU
    small contributions (:data:`BLOCK_BYTES`) of one shape and dtype together
    (:func:`norms_and_sums_together`: a layer norm's weight and bias)."""
    found, groups = {}, {}
    for name, x in chunk.items():
        if _device.on_host(x) and x.numel() * x.element_size() <= BLOCK_BYTES:
            groups.setdefault((x.shape, x.dtype), []).append(name)
        else:
            found[name] = norms_and_sums(x)
    for names in groups.values():
        together = torch.stack([chunk[n] for n in names])
        found.update(zip(names, norms_and_sums_together(together)))
    return found


def norms_and_sums_together(contributions: Tensor) -> List[Tuple[Tensor, Tensor]]:
    """``(||x_i||^2 [N], [sum_i x_i, sum_i x_i**2])`` of ``contributions[k]`` for each
    ``k`` (``[K, N, *shape]``: ``K`` small parameters of one shape), in a few operations
    for all, in :func:`._squares.saved_dtype` (float64).

    The results of :func:`norms_and_sums` without a scale: a float32 (or
    narrower) number's square is exact in float64 (48 bits of significand of
    53) and cannot underflow there, and the sums are saved in float64 anyway.
    Summed in float64 they are within float32's rounding bound, which the
    quantities take for the parameter's dtype.
    """
    wide = contributions.to(saved_dtype(contributions.dtype))
    squares = wide.square()
    norms = squares.flatten(start_dim=2).sum(2)  # [K, N]
    sums = torch.stack([wide, squares], 1).sum(2)  # [K, 2, *shape]
    return [(norms[k], sums[k]) for k in range(len(sums))]


def reduce_chunks(chunks: Iterator[Dict[str, Tensor]], savefields: Sequence[str]) -> Dict[str, Dict[str, Tensor]]:
    """``{savefield: {name: result}}`` from chunks of per-example contributions.

    ``||x_i||^2`` per example (:data:`BATCH_L2_SAVEFIELD`, ``[N]``, at a scale,
    saved in float64: no underflow, as every rule's, :mod:`._squares`),
    ``[sum_i x_i, sum_i x_i**2]`` (:data:`SUMS_SAVEFIELD`, ``[2, *shape]``,
    both from the same contributions, :mod:`.sums`) and ``sum_i x_i``
    (:data:`LOCAL_GRADIENT_SAVEFIELD`), all from one square of each chunk
    (:func:`norms_and_sums`); each chunk is freed once reduced.
    """
    norms: Dict[str, List[Tensor]] = {}
    totals: Dict[str, Tensor] = {}
    squares = BATCH_L2_SAVEFIELD in savefields or SUMS_SAVEFIELD in savefields
    for chunk in chunks:
        # Summed in float32 or wider (.precision).
        chunk = {name: precision.widened(x) for name, x in chunk.items()}
        if squares:
            parts = _reduced(chunk)
        else:  # the gradient alone
            parts = {name: (None, x.sum(0, keepdim=True)) for name, x in chunk.items()}
        for name, (part_norms, part) in parts.items():
            norms.setdefault(name, []).append(part_norms)
            totals[name] = part if name not in totals else totals[name] + part
    results: Dict[str, Dict[str, Tensor]] = {}
    if BATCH_L2_SAVEFIELD in savefields:  # (not None: the squares were formed)
        results[BATCH_L2_SAVEFIELD] = {
            name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in norms.items()}
    if SUMS_SAVEFIELD in savefields:
        results[SUMS_SAVEFIELD] = totals
    if LOCAL_GRADIENT_SAVEFIELD in savefields:
        results[LOCAL_GRADIENT_SAVEFIELD] = {name: sums[0] for name, sums in totals.items()}
    return results


def with_structural_zeros(chunks: Iterator[Tuple[Dict[str, Tensor], Dict]]) -> Iterator[Dict[str, Tensor]]:
    """The chunks' contributions, with those that come with their terms' magnitudes
    (:class:`.replay._LinearBiases`) held back to a last chunk of all examples, where an element
    all of whose contributions are rounding noise (:func:`.sums.structural_zeros`) is set
    to exactly 0: gradient 0 and sd 0, as the native rules give (an attention key's bias)."""
    held: Dict[str, List[Tensor]] = {}
    found: Dict[str, List[Optional[tuple]]] = {}
    for contributions, terms in chunks:
        for name, magnitudes_and_count in terms.items():  # the same names in every chunk
            held.setdefault(name, []).append(contributions.pop(name))
            found.setdefault(name, []).append(magnitudes_and_count)
        yield contributions
    last = {}
    for name, parts in held.items():
        x = torch.cat(parts)
        counts = {None if part is None else part[1] for part in found[name]}
        if len(counts) != 1 or None in counts:  # terms unknown, or uses differing, somewhere
            last[name] = x
            continue
        magnitudes = torch.cat([part[0] for part in found[name]])
        eps = max(torch.finfo(x.dtype).eps, torch.finfo(magnitudes.dtype).eps)
        last[name] = x.masked_fill(structural_zeros(x, magnitudes, counts.pop(), eps), 0.0)
    if last:
        yield last


def linear_on_rows(inputs: Tensor, grad_output: Tensor, bias: bool,
                   squares: bool) -> Dict[str, Tuple[Tensor, Tensor]]:
    """``{"weight": (||x_i||^2 [N], sums), "bias": ...}`` of a linear layer from each example's
    rows of its input ``[N, L, in]`` and output gradient ``[N, L, out]`` (the fast ways of
    :mod:`.windows` and :mod:`.shared`), as the rule of an ``nn.Linear`` on sequences computes
    them: ``x_i(W) = sum_l g_il a_il^T``, ``x_i(b) = sum_l g_il`` (its structural zeros exactly
    0, :func:`.sums.position_sums`); ``sums`` ``[sum_i x_i, sum_i x_i**2]`` where ``squares``,
    else ``[sum_i x_i]`` (the norms then by Gram matrices or formation, whichever is cheaper:
    :func:`.linear.linear_weight_squared_norms`)."""
    if squares:
        sums, norms = exact(linear_weight_sums_and_squared_norms, "sn", inputs, grad_output)
    else:
        norms = exact(linear_weight_squared_norms, "n", inputs, grad_output)
        sums = (grad_output.flatten(0, 1).T @ inputs.flatten(0, 1)).unsqueeze(0)
    found = {"weight": (norms, sums)}
    if bias:
        norms, sums = norms_and_sums(position_sums(grad_output, 1))
        found["bias"] = (norms, sums if squares else sums[:1])
    return found


def squared_norms_agree(fast: Dict[str, Dict[str, Tensor]], recomputed: Dict[str, Dict[str, Tensor]],
                        eps: float) -> bool:
    """Whether a fast way's per-example squared norms agree with the per-example
    recomputation's, each within :func:`.precision.rounding_bound` of the latter at ``eps``
    (the first-step confirmation of :mod:`.experts` and :mod:`.windows`); ``False`` where the
    fast way gave none."""
    slow, quick = recomputed.get(BATCH_L2_SAVEFIELD, {}), fast.get(BATCH_L2_SAVEFIELD, {})
    return bool(quick) and all(
        name in slow and float((norms.double() - slow[name].double()).abs().max())
        <= precision.rounding_bound(slow[name], eps) for name, norms in quick.items())
