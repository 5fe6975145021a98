"""sd and SNR of many layers at once on the CPU, into buffers of all their elements.

The formulas of :mod:`~cockpit_gradnoise.functional.variance`, formed by
:func:`sd_and_signal_to_noise` with no step whose cost depends on which
elements are kept, small layers together.
"""

import math
from typing import List, Optional, Sequence, Tuple

from cockpit_gradnoise import order_statistics
from cockpit_gradnoise.functional.layout import memory_order  # noqa: F401 (also its public name here)
from cockpit_gradnoise.functional.variance import expansion_rounding_bound, relative_rounding

import numpy
import torch
from torch import Tensor


def sd_and_signal_to_noise(
    sums: Sequence[Tuple[Tensor, ...]], n: int, limit: float,
    union: Optional[Tuple[Tensor, Tensor]] = None, *, over_sums: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor], List[Tensor], List[Tensor], List[int]]:
    """:func:`gradient_sd` and :func:`signal_to_noise` (with ``limit``) of several layers, on the CPU.

    The same formulas, into two buffers of all the layers' elements (the
    network's union, with no copy), with no step whose cost depends on which
    elements are kept: the rounding clamp multiplies by ``1`` where
    ``C_j = S_j - T_j**2 / N`` exceeds the bound ``(3N + 4) eps S_j`` and by
    ``0`` elsewhere (``sd_j = sqrt(max(C_j, 0) N / (N - 1))`` where kept)
    instead of filling a mask, and the SNR's left-out elements (``0 / 0``,
    NaN) become ``0.0`` instead of being compressed out: they sort first and
    add nothing to a sum, so statistics of the kept ratios are those of ranks
    ``z`` and above (``z`` left out). Applying a boolean mask that keeps and
    drops elements in no regular pattern costs several nanoseconds per
    element on this CPU; these products a fraction of one. Small layers
    (biases, norms) are computed together, in one call per operation: a torch
    call on a few hundred elements costs several microseconds.

    Args:
        sums: Per layer ``(S, T)``: ``sum_i x_ij**2`` and ``sum_i x_ij``, on
            the CPU, one dtype (float32 or float64) and the same strides
            within a layer (the two halves of the package's sums savefield),
            one dtype for all; or ``(S, T, R)`` for sums expanded over
            positions, whose bound adds :func:`expansion_rounding_bound` of
            ``R`` (the savefield's third row), as :func:`gradient_sd`'s
            ``extra_rounding`` does.
        n: ``N >= 2``.
        limit: :func:`resolvable_snr` of ``N`` and the dtype.
        union: ``(S, T)``, two 1d tensors that the layers' ``(S, T)`` (without
            ``R``) tile: each layer's are disjoint pieces of them, together
            all of them (:func:`~cockpit_gradnoise.extensions.arena.union_of`).
            Then sd is formed over ``S`` and SNR over ``T``, in place: the
            layers' sums are overwritten, and no buffer is made.
        over_sums: Form each layer's sd over its own ``S`` and SNR over its own ``T``
            (the bound's ``N eps R`` over its ``R``), the small layers' over one joined
            copy of theirs: the layers' sums are overwritten, and no buffer of the
            network's elements is made (:func:`_sd_and_snr_over_sums`). The caller
            proves that nothing reads the sums afterwards; where two layers' sums
            overlap in memory, they are formed into buffers instead (:func:`disjoint`).

    Returns:
        ``(sd, snr, sds, snrs, z)``: the two buffers (``None`` where formed over each
        layer's sums: no buffer holds them all); per layer, 1d views of
        them (``T``'s elements in the order they lie in memory: the
        statistics do not depend on it); per layer the number of ``0.0`` in
        its SNR that stand for left-out elements.
    """
    if n < 2:
        raise ValueError(f"the gradient variance needs at least 2 examples, got {n}")
    flat = [tuple(memory_order(x) for x in layer) for layer in sums]
    if union is not None:
        return _sd_and_snr_over_union(flat, union, n, limit)
    if over_sums and disjoint([x for layer in flat for x in layer]):
        return _sd_and_snr_over_sums(flat, n, limit)
    dtype = flat[0][0].dtype
    sizes = [layer[1].numel() for layer in flat]
    # Expanded sums (with R) are formed alone, whatever their size.
    small = [k for k, size in enumerate(sizes) if size < _JOINED_BELOW and len(flat[k]) == 2]
    large = [k for k, size in enumerate(sizes) if size >= _JOINED_BELOW or len(flat[k]) == 3]
    # The buffers hold the large layers, then the small ones, each contiguous.
    sd, snr = torch.empty(sum(sizes), dtype=dtype), torch.empty(sum(sizes), dtype=dtype)
    offsets, start = [0] * len(sizes), 0
    for k in large + small:
        offsets[k], start = start, start + sizes[k]
    rounding = relative_rounding(n, 1, dtype)
    for k in large:
        region = slice(offsets[k], offsets[k] + sizes[k])
        squares, total, *magnitudes = flat[k]
        _sd_and_snr_into(squares, total, sd[region], snr[region], n, limit, rounding,
                         magnitudes[0] if magnitudes else None)
    if small:
        joined = [torch.cat([flat[k][side] for k in small]) for side in (0, 1)]
        region = slice(offsets[small[0]], sd.numel())
        _sd_and_snr_into(*joined, sd[region], snr[region], n, limit, rounding)
    left_out = _left_out_counted(snr, offsets, sizes)
    views = [[buffer[o : o + size] for o, size in zip(offsets, sizes)] for buffer in (sd, snr)]
    return sd, snr, views[0], views[1], left_out


def _sd_and_snr_over_union(flat, union, n, limit):
    """:func:`sd_and_signal_to_noise` in place over ``union``, which the 1d ``flat`` tile."""
    squares, total = union
    # The clamp's bound in a scratch piece (T is in SNR's place): the only memory besides the sums.
    scratch = torch.empty(min(_IN_PLACE_PIECE, squares.numel()), dtype=squares.dtype)
    _sd_and_snr_into(squares, total, squares, total, n, limit,
                     relative_rounding(n, 1, squares.dtype), scratch=scratch)
    starts = [t.storage_offset() - total.storage_offset() for _, t in flat]
    left_out = _left_out_counted(total, starts, [t.numel() for _, t in flat])
    return squares, total, [layer[0] for layer in flat], [layer[1] for layer in flat], left_out


def _sd_and_snr_over_sums(flat, n, limit):
    """:func:`sd_and_signal_to_noise` over each layer's own 1d, disjoint ``(S, T[, R])``.

    The same operations on the same numbers as into buffers (:func:`_sd_and_snr_into`,
    its bound in a scratch piece): only where they are written differs. A large layer's
    sd goes over its ``S``, its SNR over its ``T``; the small layers are joined
    (:data:`_JOINED_BELOW`: one call per operation for all) into a copy, formed over
    that. The only memory besides the sums: the scratch piece and the small layers' copy.
    """
    dtype = flat[0][0].dtype
    sizes = [layer[1].numel() for layer in flat]
    small = [k for k, size in enumerate(sizes) if size < _JOINED_BELOW and len(flat[k]) == 2]
    scratch = torch.empty(min(_IN_PLACE_PIECE, max(sizes)), dtype=dtype)
    rounding = relative_rounding(n, 1, dtype)
    sds, snrs, left_out = [None] * len(flat), [None] * len(flat), [0] * len(flat)
    for k in (k for k in range(len(flat)) if k not in small):
        squares, total, *magnitudes = flat[k]
        _sd_and_snr_into(squares, total, squares, total, n, limit, rounding,
                         magnitudes[0] if magnitudes else None, scratch=scratch)
        sds[k], snrs[k] = squares, total
        left_out[k], = _left_out_counted(total, [0], [sizes[k]])
    if small:
        squares, total = (torch.cat([flat[k][side] for k in small]) for side in (0, 1))
        _sd_and_snr_into(squares, total, squares, total, n, limit, rounding, scratch=scratch)
        starts = numpy.cumsum([0] + [sizes[k] for k in small[:-1]]).tolist()
        for k, start, z in zip(small, starts, _left_out_counted(total, starts, [sizes[k] for k in small])):
            sds[k], snrs[k] = squares[start : start + sizes[k]], total[start : start + sizes[k]]
            left_out[k] = z
    return None, None, sds, snrs, left_out


def disjoint(tensors: Sequence[Tensor]) -> bool:
    """Whether no two of these 1d contiguous tensors share an element of memory.

    Forming one layer's sd over its sums must leave every other layer's sums as they
    were: each is read once, before it is overwritten, only where their memory is
    disjoint (the slots of :mod:`~cockpit_gradnoise.extensions.arena`'s buffer are;
    sums that one tensor of two layers' would share are not).
    """
    spans = sorted((x.data_ptr(), x.data_ptr() + x.numel() * x.element_size())
                   for x in tensors if x.numel())
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def _left_out_counted(snr: Tensor, starts: Sequence[int], sizes: Sequence[int]) -> List[int]:
    """Per layer, the NaNs (``0 / 0``) of its SNR ``snr[start : start + size]``; then every NaN
    of ``snr`` made ``0.0``, counted instead of compressed out."""
    ratios = snr.numpy()
    counts = [order_statistics.count_where(ratios[start : start + size], numpy.isnan)
              for start, size in zip(starts, sizes)]
    snr.nan_to_num_(nan=0.0, posinf=math.inf)
    return counts


def _sd_and_snr_into(squares, grad, sd, snr, n, limit, rounding, magnitudes=None, scratch=None):
    """:func:`sd_and_signal_to_noise` of one 1d ``(S, T)`` (and ``R``, if not None) into
    ``sd`` and ``snr`` (NaN for 0 / 0).

    With a ``scratch`` tensor, ``sd`` and ``snr`` may be ``S`` and ``T`` themselves:
    the clamp's bound goes to the scratch, in pieces of its size, and the expansion's
    ``N eps R`` over ``R`` (which is then overwritten too).
    """
    piece = _PIECE if scratch is None else scratch.numel()
    tensors = (squares, grad, sd, snr) + (() if magnitudes is None else (magnitudes,))
    pieces = zip(*(x.split(piece) for x in tensors))
    for s, t, out, ratio, *r in pieces if squares.numel() > piece else [tensors]:
        # In place in the two results, the SNR's serving first for the clamp
        # (or the scratch): no temporaries (fresh memory costs more in page
        # faults than the work here).
        bound = ratio if scratch is None else scratch[: s.numel()]
        torch.mul(s, rounding, out=bound)  # (3N + 4) eps S
        if r:  # plus N eps R, formed in sd's place first (in place: over R, as sd is S)
            bound.add_(expansion_rounding_bound(r[0], n, s.dtype, out=out if scratch is None else r[0]))
        torch.addcmul(s, t, t, value=-1.0 / n, out=out)  # C = S - T**2 / N
        # 1 where C exceeds the bound, else 0: C - bound > 0 exactly when C >
        # bound (a difference of floats is 0 only when they are equal).
        kept = torch.sub(out, bound, out=bound).clamp_(min=0.0).sign_()
        # |C| (where kept, C > bound >= 0: C itself) rather than max(C, 0), which keeps a
        # -0.0: C's fused multiply-add gives -0.0 where S = 0 and T**2 / N underflows
        # (squares of contributions below 1e-162 in float64), and |T| / -0.0 = -inf
        # would become an SNR of -1.8e308, at the bottom of the order.
        out.abs_().mul_(n / (n - 1))
        # Where not kept, 1 or more under the root (then times 0: the same 0): torch's sqrt of
        # float32 costs 5-10 times as much on pieces holding zeros (0.34 ns per element on
        # positive values, 1.6 on zeros, 3.3 on half zeros; VGG-11: 55% of its sd is 0).
        # Kept elements (C > bound >= 0) keep their value: max(C, 0) = C.
        flipped = kept.neg_().add_(1.0)  # 1 - kept, in kept's place: exact for 0 and 1
        torch.maximum(out, flipped, out=out).sqrt_().mul_(flipped.neg_().add_(1.0))
        # x / 0 = inf becomes the limit; 0 / 0 stays NaN (torch's clamp:
        # a third of the time of NumPy's minimum here).
        torch.abs(t, out=ratio).div_(out).clamp_(max=limit)


#: Elements per piece in :func:`sd_and_signal_to_noise`: each piece costs
#: about ten calls of a few microseconds each, which pieces of
#: :data:`~cockpit_gradnoise._device.CHUNK` elements made 20% of the time
#: on the benchmark MLP.
_PIECE = 1 << 20

#: Elements per piece of :func:`sd_and_signal_to_noise` in place: its scratch
#: piece stays in the cache beside the two pieces it is formed from.
_IN_PLACE_PIECE = 1 << 16

#: Layers with fewer elements are computed together by
#: :func:`sd_and_signal_to_noise` (their sums copied into one pair first).
_JOINED_BELOW = 1 << 14
