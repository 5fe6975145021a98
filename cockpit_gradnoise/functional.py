"""Pure formulas on tensors: every statistic the package reports.

Nothing here knows about Cockpit or BackPACK. The quantities fetch what
BackPACK leaves on the parameters and call one of these functions; tests check
each function on its own against NumPy or a brute-force loop. Quantiles come
from :mod:`cockpit_gradnoise.order_statistics`.

Notation (see ``DESIGN.md``): a mini-batch has ``N`` examples, ``x_i`` is
example ``i``'s contribution to ``param.grad`` (``param.grad = sum_i x_i``),
and ``g_i`` is the gradient of example ``i``'s own loss. For a loss that is
``c * sum_i loss_i`` (``c = 1/N`` for a mean, ``c = 1`` for a sum),
``x_i = c * g_i``.
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.order_statistics import Tensors

import numpy
import torch
from torch import Tensor


def scalar(tensor: Tensor):
    """A one-element tensor as a Python float on the CPU (no wait there); on
    other devices the tensor itself, left there for the step's one transfer
    (:func:`cockpit_gradnoise._device.resolve`)."""
    return tensor.item() if _device.on_host(tensor) else tensor


def zero_count(tensor: Tensor):
    """The number of elements exactly 0: an int on the CPU, a 0-dim tensor elsewhere.

    On the CPU NumPy counts ``x == 0`` in a third of the time of
    ``torch.count_nonzero``, in pieces (:func:`~cockpit_gradnoise.order_statistics.count_where`:
    no mask of the tensor's size); elsewhere the count stays on the device for
    the step's one transfer (:func:`scalar`).
    """
    if _device.on_host(tensor) and tensor.dtype in (torch.float32, torch.float64):
        return order_statistics.count_where(tensor.detach().reshape(-1).numpy(), numpy.equal, 0)
    return scalar(tensor.numel() - tensor.count_nonzero().double())


def norm_ratio(squared_numerator, squared_denominator):
    """``sqrt(a) / sqrt(b)`` (:func:`~cockpit_gradnoise.schema.ratio_or_inf`), floats or tensors."""
    if isinstance(squared_numerator, Tensor):
        return schema.ratio_or_inf(squared_numerator.sqrt(), squared_denominator.sqrt())
    return schema.ratio_or_inf(math.sqrt(squared_numerator), math.sqrt(squared_denominator))


def variance_rounding_bound(
    sum_of_squares: Tensor, n: int, inner_terms: int = 1, dtype: Optional[torch.dtype] = None
) -> Tensor:
    """Bound on the rounding error of ``S - T**2 / N``, per element: ``(3N + 4L) eps S``.

    ``S = sum_i x_i**2`` and ``T = sum_i x_i`` are rounded sums; their
    centred difference is rounding noise (or slightly negative) where all
    ``x_i`` agree. To first order in ``eps`` (the dtype's), with the usual
    bound ``(m - 1) eps sum_k |a_k|`` on a sum of ``m`` terms in any order of
    depth ``m - 1`` (Higham 2002, "Accuracy and Stability of Numerical
    Algorithms", ch. 4), when each contribution ``x_i`` is itself computed as a
    sum of ``L`` terms ``t_il`` of one sign (``L = inner_terms``: output
    positions of a convolution, steps of a sequence, ``1`` for a plain
    ``Linear``):

    - ``S``: each ``x_i`` is off by at most ``(L - 1) eps |x_i|``, its square by
      twice that, and squaring and summing ``N`` of them add ``N eps S``:
      ``|dS| <= (N + 2L - 2) eps S``.
    - ``T``, computed from the same ``x_i`` or by another order over all
      ``N L`` terms (autograd's ``param.grad``), nested to depth at most
      ``N + L - 2``: ``|dT| <= (N + L - 2) eps sum_i |x_i|``, so
      ``|d(T**2 / N)| <= 2 (N + L - 2) eps (sum_i |x_i|)**2 / N <= 2 (N + L - 2) eps S``
      (Cauchy-Schwarz).
    - The subtraction adds ``eps S``.

    Together less than ``(3N + 4L) eps S``. A bound, not an estimate: errors
    of long sums grow more like the square root of the number of terms, and
    measured centred sums of identical examples reach about ``0.5 N eps S``
    at most when ``T`` is summed from the same ``x_i`` as ``S``.

    Where the terms of one contribution cancel (``sum_l |t_il|`` much larger
    than ``|x_i|``), the rounding of ``x_i`` is relative to ``sum_l |t_il|``,
    which ``S`` and ``T`` do not show: with ``T`` from another reduction than
    ``S`` (``param.grad``), identical examples can then leave rounding noise
    above the bound. Summing ``T`` from the same computed ``x_i`` as ``S``
    avoids it (identical examples then give identical ``x_i``), with
    ``L = 1``.

    Args:
        sum_of_squares: ``S``.
        n: ``N``.
        inner_terms: ``L >= 1``.
        dtype: The dtype ``S`` and ``T`` were summed in, whose ``eps`` the
            bound takes; ``S``'s by default. The package's extensions sum
            float32 contributions in float32 (at a power-of-two scale) and
            keep the sums in float64 (:mod:`cockpit_gradnoise.extensions.sums`):
            their rounding is float32's.
    """
    return sum_of_squares * _relative_rounding(n, inner_terms, dtype or sum_of_squares.dtype)


def _relative_rounding(n: int, inner_terms: int, dtype: torch.dtype) -> float:
    """``(3N + 4L) eps``: :func:`variance_rounding_bound` relative to ``S``."""
    if inner_terms < 1:
        raise ValueError(f"inner_terms must be at least 1, got {inner_terms}")
    return (3 * n + 4 * inner_terms) * torch.finfo(dtype).eps


def expansion_rounding_bound(
    magnitudes: Tensor, n: int, dtype: Optional[torch.dtype] = None, *,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Bound on the rounding error of ``S - T**2 / N`` where ``S`` expands squares: ``N eps R``.

    Where ``sum_i x_i**2`` of a convolution's weight is summed over products
    of positions, ``S = sum_i sum_{l,l'} (b_il b_il') (a_il a_il')^T``
    (:func:`cockpit_gradnoise.extensions._conv_math.expanded_sums`), no
    ``x_i`` is formed, and the error of ``S`` and of ``T`` is relative to the
    absolute terms ``A = sum_i (sum_l |b_il| |a_il|^T)**2 >= S``, not to ``S``:
    ``|d(S - T**2 / N)| <= N w(L) eps A`` (the derivation is in
    :mod:`cockpit_gradnoise.extensions._conv_math`), saved as ``R = w(L) A``,
    the savefield's third row. It is added to :func:`variance_rounding_bound`
    (so that sums of micro-batches of which only some were expanded stay
    covered), and every element the sum keeps has an SNR below
    :func:`resolvable_snr` (``R >= 12 S``). An element it sets to 0 may have
    a smaller SNR than that where its contributions' terms cancel
    (``A >> S``): the expansion cannot resolve its variance.

    Args:
        magnitudes: ``R``, summed over the examples (and over processes and
            micro-batches, where ``N`` counts all of them).
        n: ``N``.
        dtype: The dtype the sums were accumulated in, whose ``eps`` the
            bound takes; ``R``'s by default.
        out: Where to write the bound (e.g. a buffer about to be overwritten);
            a new tensor if None.
    """
    return torch.mul(magnitudes, n * torch.finfo(dtype or magnitudes.dtype).eps, out=out)


def resolvable_snr(n: int, dtype: torch.dtype, inner_terms: int = 1) -> float:
    """The largest ``|grad_j| / sd_j`` that :func:`gradient_sd` resolves: ``sqrt((N - 1) / ((3N + 4L) eps))``.

    ``sd_j`` is kept only where the centred sum exceeds the rounding bound,
    ``C_j > (3N + 4L) eps S_j`` (:func:`variance_rounding_bound`), and
    ``S_j = sum_i x_ij**2 >= T_j**2 / N`` (Cauchy-Schwarz), so a kept element has

    .. math::

        \\mathrm{snr}_j^2 = \\frac{T_j^2 (N - 1)}{N C_j}
        < \\frac{N - 1}{(3N + 4L)\\,\\varepsilon} = R^2 .

    An element whose centred sum is at or below the bound (its ``sd_j`` set
    to 0) with ``T_j != 0`` has examples that agree to rounding:
    ``C_j <= (3N + 4L) eps S_j`` gives ``S_j <= T_j**2 / (N (1 - (3N + 4L) eps))``
    and so ``|T_j| / sqrt(N / (N - 1) (3N + 4L) eps S_j) >= R sqrt(1 - (3N + 4L) eps)``:
    its SNR is at least about ``R``, more than any kept element's. ``R`` is
    about ``1.6e3`` in float32 and ``3.7e7`` in float64 at ``N = 32``.

    Args:
        n: ``N >= 2``.
        dtype: The dtype the sums were accumulated in (see :func:`variance_rounding_bound`).
        inner_terms: ``L``, as there.
    """
    return math.sqrt((n - 1) / _relative_rounding(n, inner_terms, dtype))


def centred_sum_of_squares(
    sum_of_squares: Tensor, total: Tensor, n: int, *, inner_terms: int = 1, in_place: bool = False,
    dtype: Optional[torch.dtype] = None, extra_rounding: Optional[Tensor] = None,
) -> Tensor:
    """``sum_i (x_i - mean_i x_i)**2`` per element from ``sum_i x_i**2`` and ``sum_i x_i``.

    ``sum_i (x_i - xbar)**2 = sum_i x_i**2 - (sum_i x_i)**2 / n``, set to 0
    where it does not exceed the rounding bound of :func:`variance_rounding_bound`
    (so also where it comes out negative).

    Args:
        sum_of_squares: ``sum_i x_i**2`` (BackPACK's ``SumGradSquared``).
        total: ``sum_i x_i`` (``param.grad``, or better summed from the same
            per-example values as ``sum_of_squares``).
        n: Number of examples ``N``.
        inner_terms: Terms summed into each ``x_i`` where ``total`` comes from
            another computation than ``sum_of_squares`` (see
            :func:`variance_rounding_bound`); 1 where it comes from the same.
        in_place: Overwrite ``sum_of_squares`` with the result (saves one copy).
        dtype: The dtype the sums were accumulated in (see
            :func:`variance_rounding_bound`); ``total`` is converted to
            ``sum_of_squares``' dtype first, so that its square cannot underflow
            where that is wider.
        extra_rounding: A bound added to :func:`variance_rounding_bound`'s
            (:func:`expansion_rounding_bound`), in ``sum_of_squares``' dtype.

    Returns:
        Non-negative tensor shaped like ``total``, in ``sum_of_squares``' dtype.
    """
    rounding = variance_rounding_bound(sum_of_squares, n, inner_terms, dtype)
    if extra_rounding is not None:
        rounding += extra_rounding
    total = total.to(sum_of_squares.dtype)
    if in_place:
        centred = sum_of_squares.addcmul_(total, total, value=-1.0 / n)
    else:
        centred = torch.addcmul(sum_of_squares, total, total, value=-1.0 / n)
    return _zero_where_at_most(centred, rounding)


def _zero_where_at_most(values: Tensor, bound: Tensor) -> Tensor:
    """``values.masked_fill_(values <= bound, 0)``.

    On the CPU through NumPy where it can: faster there than torch's
    comparison and ``masked_fill_``.
    """
    plain = values.dtype in (torch.float32, torch.float64) and bound.dtype == values.dtype
    if _device.on_host(values) and plain and not values.requires_grad:
        array = values.numpy()
        numpy.putmask(array, array <= bound.numpy(), 0.0)
        return values
    return values.masked_fill_(values <= bound, 0.0)


def gradient_sd(
    sum_of_squares: Tensor, total: Tensor, n: int, *, inner_terms: int = 1, in_place: bool = False,
    dtype: Optional[torch.dtype] = None, extra_rounding: Optional[Tensor] = None,
) -> Tensor:
    """Per-element standard deviation of the mini-batch gradient, from one batch.

    .. math::

        \\mathrm{sd}_j = \\sqrt{\\frac{N}{N-1} \\sum_{i=1}^N (x_{ij} - \\bar x_j)^2}

    where ``x_ij`` is example ``i``'s contribution to ``param.grad[j]``. This
    estimates the standard deviation of ``param.grad[j]`` over independent
    mini-batches of size ``N`` (what :func:`~cockpit_gradnoise.minibatch_gradient_stats`
    measures by repetition). Units: those of ``param.grad``.

    Args:
        sum_of_squares: ``sum_i x_ij**2``.
        total: ``sum_i x_ij``, best summed from the same computed ``x_ij`` as
            ``sum_of_squares`` (``param.grad`` sums them in another order).
        n: Batch size ``N >= 2``.
        inner_terms: See :func:`centred_sum_of_squares`.
        in_place: Overwrite ``sum_of_squares`` with the result (saves one copy).
        dtype: The dtype the sums were accumulated in (see
            :func:`variance_rounding_bound`). Where ``sum_of_squares`` is wider
            (float64 sums of float32 contributions, kept so that their squares
            cannot underflow), sd is computed in ``dtype`` at a power-of-two
            scale (:func:`_at_a_scale`): the same numbers, bit for bit, as from
            sums kept in ``dtype`` wherever those hold them.
        extra_rounding: See :func:`centred_sum_of_squares` (in ``sum_of_squares``' dtype).

    Returns:
        Tensor shaped like ``total``, in ``sum_of_squares``' dtype (or ``dtype``);
        exactly 0 where the examples agree to rounding (see
        :func:`variance_rounding_bound`).
    """
    if n < 2:
        raise ValueError(f"the gradient variance needs at least 2 examples, got {n}")
    if dtype is not None and torch.finfo(dtype).bits < torch.finfo(sum_of_squares.dtype).bits:
        squares, total, scale = _at_a_scale(sum_of_squares, total, dtype)
        if extra_rounding is not None:
            extra_rounding = (extra_rounding * scale.to(extra_rounding.dtype).square()).to(dtype)
        return gradient_sd(
            squares, total, n, inner_terms=inner_terms, in_place=True,
            extra_rounding=extra_rounding,
        ).div_(scale)
    # In place on the fresh result: this runs on every element of the network.
    centred = centred_sum_of_squares(
        sum_of_squares, total, n, inner_terms=inner_terms, in_place=in_place, dtype=dtype,
        extra_rounding=extra_rounding,
    )
    return centred.mul_(n / (n - 1)).sqrt_()


def _at_a_scale(sum_of_squares: Tensor, total: Tensor, dtype: torch.dtype):
    """``(S s**2, T s, s)`` in ``dtype``, ``s = 2**m >= 1`` the largest with ``max S s**2 < 1``.

    Scaling up by a power of two changes no rounding and cannot overflow
    (``|T| s <= sqrt(N max S) s``), so :func:`gradient_sd` of the scaled sums,
    divided by ``s``, gives the numbers it gives in ``dtype`` wherever ``S`` is
    a normal number of ``dtype``, and a defined result where only the wider
    dtype holds ``S`` (float32 squares of contributions below ``1e-19``).
    On the tensors' device, without waiting for it.
    """
    _, exponent = torch.frexp(sum_of_squares.amax())
    half = torch.div(-exponent, 2, rounding_mode="floor").clamp(min=0)
    scale = torch.ldexp(torch.ones((), dtype=sum_of_squares.dtype, device=half.device), half)
    squares = (sum_of_squares * scale.square()).to(dtype)
    return squares, (total.to(sum_of_squares.dtype) * scale).to(dtype), scale.to(dtype)


def signal_to_noise(grad: Tensor, sd: Tensor, limit: Optional[float] = None) -> Tensor:
    """``|grad_j| / sd_j`` per element (flattened), capped at ``limit``.

    With ``limit`` (:func:`resolvable_snr`, for :func:`gradient_sd`'s ``sd``):
    ``min(|grad_j| / sd_j, limit)``, so an element with ``sd_j = 0`` and
    ``grad_j != 0`` (examples that agree to rounding: the most consistent
    elements of the layer) gets ``limit``, at the top of the order, and every
    other element keeps its ratio (below ``limit`` by construction). Only
    ``0 / 0`` (``grad_j = sd_j = 0``: a dead unit, a structurally zero
    gradient) has no ratio and is left out. Without ``limit``, every element
    with ``sd_j = 0`` is left out (for standard deviations that are not
    thresholded, e.g. across mini-batches). The result never holds an inf or
    NaN from a zero denominator; it may be empty. ``sd`` must be
    non-negative, without NaN (as :func:`gradient_sd` gives), in ``grad``'s dtype.

    On other devices than the CPU, where a result whose size depends on the
    data would make the host wait, the left-out elements are NaN instead
    (the result has ``grad``'s number of elements); :func:`sd_statistics`
    leaves NaN out.
    """
    grad, sd = grad.detach().reshape(-1), sd.detach().reshape(-1)
    if not _device.on_host(grad):
        ratio = grad.abs().div_(sd)
        if limit is None:
            return ratio.masked_fill_(sd == 0, math.nan)
        # x / 0 = inf becomes the limit; 0 / 0 = NaN stays NaN (left out).
        return ratio.clamp_(max=limit)
    # Dividing everywhere and selecting once is faster than two selections;
    # the inf/NaN where sd_j = 0 are never selected. NumPy compares and
    # selects several times faster than torch on CPU; by pieces, no
    # temporary the size of the layer.
    result, start = numpy.empty(grad.numel(), dtype=grad.numpy().dtype), 0
    for g, s in zip(_device.pieces(grad), _device.pieces(sd)):
        g, s = g.numpy(), s.numpy()
        with numpy.errstate(divide="ignore", invalid="ignore"):
            ratio = numpy.abs(g) / s
        if limit is None:
            kept = numpy.compress(s > 0, ratio)
        else:
            numpy.minimum(ratio, limit, out=ratio)  # NaN (0 / 0) stays NaN
            kept = numpy.compress(ratio == ratio, ratio)
        result[start : start + kept.size] = kept
        start += kept.size
    return torch.from_numpy(result[:start])


def sd_and_signal_to_noise(
    sums: Sequence[Tuple[Tensor, ...]], n: int, limit: float,
    union: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor, List[Tensor], List[Tensor], List[int]]:
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

    Returns:
        ``(sd, snr, sds, snrs, z)``: the two buffers; per layer, 1d views of
        them (``T``'s elements in the order they lie in memory: the
        statistics do not depend on it); per layer the number of ``0.0`` in
        its SNR that stand for left-out elements.
    """
    if n < 2:
        raise ValueError(f"the gradient variance needs at least 2 examples, got {n}")
    flat = [tuple(_memory_order(x) for x in layer) for layer in sums]
    if union is not None:
        return _sd_and_snr_over_union(flat, union, n, limit)
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
    rounding = _relative_rounding(n, 1, dtype)
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
                     _relative_rounding(n, 1, squares.dtype), scratch=scratch)
    starts = [t.storage_offset() - total.storage_offset() for _, t in flat]
    left_out = _left_out_counted(total, starts, [t.numel() for _, t in flat])
    return squares, total, [layer[0] for layer in flat], [layer[1] for layer in flat], left_out


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

    With a ``scratch`` tensor, ``sd`` and ``snr`` may be ``S`` and ``T`` themselves
    (without ``R``): the clamp's bound goes to the scratch, in pieces of its size.
    """
    if scratch is not None and magnitudes is not None:
        raise ValueError("sums expanded over positions (R) are formed into buffers")
    piece = _PIECE if scratch is None else scratch.numel()
    tensors = (squares, grad, sd, snr) + (() if magnitudes is None else (magnitudes,))
    pieces = zip(*(x.split(piece) for x in tensors))
    for s, t, out, ratio, *r in pieces if squares.numel() > piece else [tensors]:
        # In place in the two results, the SNR's serving first for the clamp
        # (or the scratch): no temporaries (fresh memory costs more in page
        # faults than the work here).
        bound = ratio if scratch is None else scratch[: s.numel()]
        torch.mul(s, rounding, out=bound)  # (3N + 4) eps S
        if r:  # plus N eps R, formed in sd's place first
            bound.add_(expansion_rounding_bound(r[0], n, s.dtype, out=out))
        torch.addcmul(s, t, t, value=-1.0 / n, out=out)  # C = S - T**2 / N
        # 1 where C exceeds the bound, else 0: C - bound > 0 exactly when C >
        # bound (a difference of floats is 0 only when they are equal).
        kept = torch.sub(out, bound, out=bound).clamp_(min=0.0).sign_()
        out.clamp_(min=0.0).mul_(n / (n - 1)).sqrt_().mul_(kept)
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


def _memory_order(tensor: Tensor) -> Tensor:
    """A 1d view of a dense tensor's elements in the order they lie in memory.

    For the permuted layouts of convolutions' sums: a view, not a copy (a
    copy when the tensor is not dense).
    """
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    return tensor.permute(order).reshape(-1)


def loss_tolerance(*dtypes: torch.dtype) -> float:
    """Relative distance allowed between a loss and ``c sum_i l_i`` (:func:`loss_scale`).

    ``max(1e-4, 8 eps)`` for the coarsest of ``dtypes``, relative to
    ``c sum_i |l_i|``. The loss and the per-example losses often come from
    different computations (a fused mean over tokens, per-token losses
    averaged per example), each rounded to its dtype at least once, with
    float32 sums in between under autocast: a few ``eps`` of the dtype
    (float16: ``eps = 2**-10``, bfloat16: ``2**-7``), or ``1e-4`` where the
    dtype is finer. A mean and a sum differ by a factor ``N >= 2``, far more.
    """
    eps = max(torch.finfo(dtype).eps for dtype in dtypes)
    return max(1e-4, 8 * eps)


def matching_loss_scale(
    loss: Tensor, individual_losses: Tensor, scales: Sequence[float]
) -> Tuple[Optional[float], float, float]:
    """The first of ``scales`` with ``loss = scale * sum_i individual_losses[i]``.

    Compared within the coarsest dtype's rounding (:func:`loss_tolerance`),
    relative to ``scale * sum_i |l_i|``; one device-to-host transfer (the host
    must know the reduction).

    Returns:
        ``(scale, sum_i l_i, loss)``: ``scale`` NaN when the losses are not
        finite, ``None`` when no scale matches.
    """
    total, absolute, value = _device.transfer([
        individual_losses.detach().double().sum(),
        individual_losses.detach().double().abs().sum(),
        loss.detach().double(),
    ])
    if not (math.isfinite(value) and math.isfinite(total)):
        return math.nan, total, value
    tolerance = loss_tolerance(loss.dtype, individual_losses.dtype)
    for scale in scales:
        if abs(value - scale * total) <= tolerance * scale * absolute:
            return scale, total, value
    return None, total, value


def loss_scale(loss: Tensor, individual_losses: Tensor) -> float:
    """Return ``c`` with ``loss = c * sum_i individual_losses[i]``: ``1/N`` or ``1``.

    Per-example gradients from BackPACK are ``x_i = c * g_i``; this is how the
    package tells a mean-reduced loss from a sum-reduced one.

    Args:
        loss: Scalar mini-batch loss that was differentiated.
        individual_losses: Per-example losses, shape ``[N]``.

    Returns:
        ``1 / N`` for a mean, ``1.0`` for a sum (identical when ``N = 1``);
        NaN when the losses are not finite (no reduction can be told; the
        gradients are then not finite either, and the quantities report NaN).

    Raises:
        ValueError: If ``individual_losses`` is not one value per example, or
            ``loss`` is neither their mean nor their sum.
    """
    if individual_losses.dim() != 1:
        raise ValueError(
            "info['individual_losses'] must hold one loss per example (shape [N]), "
            f"got shape {tuple(individual_losses.shape)}: reduce the other "
            "dimensions, e.g. loss_fn_none(out, y).mean(dim=1)"
        )
    n = individual_losses.numel()
    if n == 1:
        return 1.0
    scale, total, value = matching_loss_scale(loss, individual_losses, (1.0 / n, 1.0))
    if scale is not None:
        return scale
    raise ValueError(
        f"info['loss'] = {value:.6g} is neither the mean ({total / n:.6g}) nor the "
        f"sum ({total:.6g}) of info['individual_losses']: pass per-example losses "
        "of the same loss function with reduction='none'"
    )


def per_example_norm_statistics(
    squared_norms: Tensor, levels: Sequence[float], *, defer: bool = False
) -> Dict[str, float]:
    """Statistics over a batch of per-example gradient norms.

    Args:
        squared_norms: ``||g_i||^2`` for each example, shape ``[N]``.
        levels: Quantile levels.
        defer: Leave the results on the device as 0-dim tensors (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).

    Returns:
        ``q<level>``, ``mean`` and ``max`` of ``||g_i||``.
    """
    norms = squared_norms.detach().clamp(min=0).sqrt_()
    result = order_statistics.quantile_summary(norms, levels, defer=True)
    result[schema.MAX] = scalar(norms.max())
    return result if defer else _device.resolve(result)


def welford_update_(mean: Tensor, m2: Tensor, value, count: int, delta: Tensor):
    """Add the ``count``-th sample to a running mean and ``M2``, in place.

    Welford's update (B. P. Welford 1962, "Note on a method for calculating
    corrected sums of squares and products"), in the form

    .. math::

        \\delta = x_n - \\mu_{n-1}, \\quad
        \\mu_n = \\mu_{n-1} + \\delta / n, \\quad
        M_{2,n} = M_{2,n-1} + \\frac{n-1}{n} \\delta^2,

    which equals the textbook ``M2 += delta * (x_n - mu_n)`` and never
    subtracts two large sums, so it keeps its accuracy when the samples are
    nearly equal (unlike ``sum x**2 - (sum x)**2 / n``). ``M2`` stays
    non-negative by construction. Start from ``mean = m2 = 0`` with
    ``count = 1``; a sample of zeros may be passed as ``value=0``.

    Args:
        mean: Running mean ``mu_{n-1}``, updated to ``mu_n``.
        m2: Running ``sum_k (x_k - mu_{n-1})**2``, updated to ``M_{2,n}``.
        value: The sample ``x_n`` (tensor broadcastable to ``mean``, or ``0``);
            any dtype, computed in ``mean``'s dtype.
        count: ``n >= 1``, the number of samples including this one.
        delta: Scratch tensor shaped and typed like ``mean``; overwritten.
            It may be ``value`` itself, which then ends up holding ``delta``.
    """
    if isinstance(value, Tensor):
        torch.sub(value, mean, out=delta)
    else:
        torch.sub(torch.as_tensor(value, dtype=mean.dtype, device=mean.device), mean, out=delta)
    mean.add_(delta, alpha=1.0 / count)
    m2.addcmul_(delta, delta, value=(count - 1) / count)


def welford_sd(m2: Tensor, count: int, *, in_place: bool = False) -> Tensor:
    """Sample standard deviation ``sqrt(M2 / (n - 1))`` from Welford's ``M2``.

    Args:
        m2: ``sum_k (x_k - mean)**2`` over ``n`` samples (non-negative).
        count: ``n >= 2``.
        in_place: Overwrite ``m2`` with the result (saves one copy).
    """
    if count < 2:
        raise ValueError(f"a standard deviation needs at least 2 samples, got {count}")
    if in_place:
        return m2.div_(count - 1).sqrt_()
    return (m2 / (count - 1)).sqrt()


def sd_statistics(
    sd: Tensors, snr: Tensors, levels: Sequence[float], *, defer: bool = False
) -> Dict[str, float]:
    """The statistics of :class:`~cockpit_gradnoise.GradientVarianceQuantiles`.

    ``q<level>`` and ``mean`` of ``sd_j``; ``snr_q0.5`` and ``snr_mean`` of
    the signal-to-noise ratios (absent when there are none).

    Args:
        sd: Per-element standard deviations of the gradient: a tensor, or a
            sequence of tensors (the network's layers) whose union is meant.
        snr: :func:`signal_to_noise` of the same elements, likewise.
        levels: Quantile levels.
        defer: Leave the results on the device as 0-dim tensors (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).
    """
    snrs = [snr] if isinstance(snr, Tensor) else list(snr)
    sds = [sd] if isinstance(sd, Tensor) else list(sd)
    if sds and not _device.on_host(sds[0]):
        # SNR's left-out elements are NaN here (signal_to_noise).
        result = order_statistics.quantile_summary(sds, levels, defer=True)
        result[schema.SNR_PREFIX] = order_statistics.kept_quantile_summary(
            snrs, (0.5,), prefix=schema.SNR_PREFIX
        )
        return result if defer else _device.resolve(result)
    result = order_statistics.quantile_summary(sd, levels)
    if any(s.numel() > 0 for s in snrs):
        result.update(order_statistics.quantile_summary(snrs, (0.5,), prefix=schema.SNR_PREFIX))
    return result


def sd_statistics_of_layers(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], levels: Sequence[float], network: bool
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`sd_statistics` of each layer and, if ``network``, of their union.

    On the CPU the layers' and the network's quantiles share their passes
    over the elements (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries`);
    elsewhere the results stay on the device (``defer``).

    Args:
        sds: Per layer, :func:`gradient_sd` (a tensor with elements).
        snrs: Per layer, :func:`signal_to_noise` of the same elements.
        levels: Quantile levels.
        network: Whether to compute the union's statistics too.
    """
    if not network or not _device.on_host(sds[0]):
        rows = [sd_statistics(sd, snr, levels, defer=True) for sd, snr in zip(sds, snrs)]
        return rows, sd_statistics(sds, snrs, levels, defer=True) if network else None
    rows, union = order_statistics.quantile_summaries(sds, levels)
    with_snr = [k for k, snr in enumerate(snrs) if snr.numel() > 0]
    if with_snr:
        snr_rows, snr_union = order_statistics.quantile_summaries(
            [snrs[k] for k in with_snr], (0.5,), prefix=schema.SNR_PREFIX
        )
        for k, snr_row in zip(with_snr, snr_rows):
            rows[k].update(snr_row)
        union.update(snr_union)
    return rows, union


def sd_statistics_in_place(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], left_out: Sequence[int],
    levels: Sequence[float], network: bool, joined: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`sd_statistics_of_layers` of :func:`sd_and_signal_to_noise`'s results, on the CPU.

    ``snrs`` hold ``left_out`` placeholder zeros each; the tensors are
    reordered (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries_in_place`:
    each layer's quantiles by nested partitions of its own values, the
    network's of ``joined``, the buffers of all layers' sd and SNR, or of a
    copy).

    Returns:
        ``(statistics of each layer, of the network or None)``.
    """
    unions = [None, None] if joined is None else [buffer.numpy() for buffer in joined]
    rows, union = order_statistics.quantile_summaries_in_place(
        [sd.reshape(-1).numpy() for sd in sds], levels, union=network, joined=unions[0]
    )
    snr_rows, snr_union = order_statistics.quantile_summaries_in_place(
        [snr.numpy() for snr in snrs], (0.5,), schema.SNR_PREFIX, left_out, union=network,
        joined=unions[1],
    )
    for row, snr_row in zip(rows, snr_rows):
        row.update(snr_row)
    if network:
        union.update(snr_union)
    return rows, union


#: The dtypes NumPy takes from torch as they are.
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
#: :func:`squared_norm` of at most this many elements on the CPU is one NumPy dot
#: (8 us against 62 for the torch calls, on a 128-element bias here); below
#: OpenBLAS's threshold for threads in a dot (10,000).
_NUMPY_NORM_AT_MOST = 1 << 13


def squared_norm(tensor: Tensor, *, defer: bool = False) -> float:
    """``sum_j tensor_j**2``, accumulated in float64, as a Python float.

    Dot products of float64 copies of pieces of the tensor
    (:func:`~cockpit_gradnoise._device.float64_pieces`: never all of it in
    float64 at once). Squares of float32 and narrower values are exact in
    float64, so only the sum rounds: the result is off by at most
    ``n 2**-53`` relative for ``n`` elements (``(n + 1) 2**-53`` for float64
    input), whatever order the CPU's kernels add in (Higham 2002, ch. 4):
    ``1.1e-10`` for a million elements. A float32 dot product's error depends
    on the CPU's kernel (``1e-6`` to ``1e-5`` relative on a million elements).

    With ``defer``, on other devices than the CPU: a 0-dim float64 tensor
    left on the device (the same number).
    """
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= _NUMPY_NORM_AT_MOST and _device.on_host(flat) and flat.dtype in _NUMPY_FLOATS:
        # One NumPy float64 dot: a few torch calls cost more than the work on a
        # small tensor (a bias, a norm's weight).
        values = flat.numpy().astype(numpy.float64)
        return float(numpy.dot(values, values))
    parts = [torch.dot(piece, piece) for piece in _device.float64_pieces(flat)]
    result = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
    if defer and not _device.on_host(flat):
        return result
    return result.item()


def abs_ratio_statistics(
    numerator: Tensor, denominator: Tensor, *, defer: bool = False, all_finite: bool = False
) -> Dict[str, float]:
    """Statistics of ``|a_j| / |b_j|`` over the elements with ``b_j != 0`` and both finite:
    the first result of :func:`abs_ratio_statistics_and_zeros`."""
    return abs_ratio_statistics_and_zeros(numerator, denominator, defer=defer, all_finite=all_finite)[0]


def abs_ratio_statistics_and_zeros(
    numerator: Tensor, denominator: Tensor, *, defer: bool = False, all_finite: bool = False
) -> Tuple[Dict[str, float], Any]:
    """Statistics of ``|a_j| / |b_j|`` over the elements with ``b_j != 0`` and both finite,
    and the number of ``b_j == 0`` (:func:`zero_count`, from the same pass where it can).

    The per-element ratio of :class:`~cockpit_gradnoise.ParamGradRatio`
    (``a = theta``, ``b = grad``): how many steps of size ``lr * |grad_j|``
    it takes to move ``theta_j`` by its own size. Elements with a zero or
    non-finite gradient, or a non-finite parameter, are left out, so no
    statistic is a NaN from 0/0. A ratio too large for the dtype is ``inf``.

    Args:
        numerator: ``a``, any shape.
        denominator: ``b``, same number of elements.
        defer: Leave the results on the device (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).
        all_finite: The caller knows every element of both to be finite
            (e.g. both sums of squares are: a NaN or inf would make them
            non-finite), which saves a pass over each; ``False`` checks.

    Returns:
        ``mean``, ``median`` (as ``numpy.median``: the mean of the two middle
        values for an even count), ``min`` and ``max``, an empty dict when no
        element qualifies; and the zero count.
    """
    a, b = numerator.detach().reshape(-1), denominator.detach().reshape(-1)
    # Ratios of bfloat16 or float16 numbers in float32: float16's range ends at
    # 65504, below many |theta_j| / |grad_j| (exact widening; one rounding per ratio).
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    a, b = a.to(wide), b.to(wide)
    if not _device.on_host(a):
        result = {"ratio": _abs_ratio_statistics_on_device(a, b)}
        return (result if defer else _device.resolve(result)), zero_count(b)
    # A finite sum proves every element finite (NaN and inf propagate): then
    # only b = 0 is left out.
    finite = all_finite or (bool(torch.isfinite(a.sum())) and bool(torch.isfinite(b.sum())))
    plain = a.dtype == b.dtype and b.dtype in (torch.float32, torch.float64)
    if plain:
        # NumPy divides, compares and counts several times faster than torch
        # on CPU (torch's division slows down on subnormal gradients).
        with numpy.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ratio = numpy.divide(a.numpy(), b.numpy())
            numpy.abs(ratio, out=ratio)  # in place: one array of the layer's size
    else:
        ratio = torch.div(a, b).abs_().numpy()
    if finite and plain:
        left_out = b.numpy() == 0
    else:
        left_out = (~(torch.isfinite(a) & torch.isfinite(b)) | (b == 0)).numpy()
    # The left-out elements by index (few, usually): a mask applied to every
    # element (compress, putmask) costs several ns per element when the kept
    # and left-out ones alternate irregularly.
    out = numpy.flatnonzero(left_out)
    z, n = out.size, ratio.size - out.size
    zeros = z if finite and plain else zero_count(b)  # left out: exactly the zeros
    if n == 0:
        return {}, zeros
    # The smallest kept ratio with the left-out ones at inf, then at 0, where
    # they sort first (tied at worst with a kept 0) and add nothing to the
    # sum: the kept ratios are ranks z .. end.
    ratio[out] = numpy.inf
    smallest = float(ratio.min())
    ratio[out] = 0.0
    mean = float(ratio.sum(dtype=numpy.float64)) / n
    # Nested partitions of the fresh array (order_statistics.select_in_place):
    # no bucket passes and no sort.
    lower, upper, largest = order_statistics.select_in_place(
        ratio, [z + (n - 1) // 2, z + n // 2, z + n - 1]
    )
    return {
        schema.MEAN: mean,
        schema.MEDIAN: (lower + upper) / 2,
        schema.MIN: smallest,
        schema.MAX: largest,
    }, zeros


def _abs_ratio_statistics_on_device(a: Tensor, b: Tensor) -> _device.PresentIfPositive:
    """:func:`abs_ratio_statistics` without waiting for the device.

    Left-out elements become NaN, which sorts last, and the ranks come from
    the number kept, on the device.
    """
    left_out = ~(torch.isfinite(a) & torch.isfinite(b)) | (b == 0)
    ratio = torch.div(a, b).abs_().masked_fill_(left_out, math.nan)
    n = ratio.numel() - left_out.sum()
    ordered = torch.sort(ratio).values
    last = (n - 1).clamp(min=0)

    def at(rank):
        return ordered.gather(0, rank.clamp(min=0).reshape(1))[0].double()

    lower, upper = at(torch.div(n - 1, 2, rounding_mode="floor")), at(n // 2)
    return _device.PresentIfPositive(
        n,
        {
            schema.MEAN: _device.float64_total(ratio, skip_nan=True) / n,
            schema.MEDIAN: (lower + upper) / 2,
            schema.MIN: at(torch.zeros_like(n)),
            schema.MAX: at(last),
        },
    )


def noise_scale_estimates(
    mean_squared_norm: float, squared_norm_of_mean: float, n: int
) -> Tuple[float, float]:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from the gradients of one batch.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
    Training", appendix A.1. With ``g_i`` the gradient of example ``i``'s own
    loss, ``S = mean_i ||g_i||^2`` and ``M = ||mean_i g_i||^2``:

    .. math::

        |G|^2 \\approx \\frac{N M - S}{N - 1}, \\qquad
        \\mathrm{tr}(\\Sigma) \\approx \\frac{N (S - M)}{N - 1},

    unbiased for ``N`` examples drawn independently from the data
    distribution, whose mean gradient is ``G`` and per-example covariance
    ``Sigma``. The first equals the mean of ``g_i . g_j`` over pairs
    ``i != j`` and can be negative; the second is the sample variance
    ``sum_i ||g_i - mean g||^2 / (N - 1)`` (non-negative up to rounding).

    Args:
        mean_squared_norm: ``S``.
        squared_norm_of_mean: ``M``.
        n: Batch size ``N >= 2``.

    Returns:
        ``(grad_sq, trace_cov)``.
    """
    if n < 2:
        raise ValueError(f"the gradient noise scale needs at least 2 examples, got {n}")
    grad_sq = (n * squared_norm_of_mean - mean_squared_norm) / (n - 1)
    trace_cov = n * (mean_squared_norm - squared_norm_of_mean) / (n - 1)
    return grad_sq, trace_cov


def two_batch_noise_scale_estimates(
    small: Sequence[Tuple[float, float]], big_squared_norm: float, big_examples: float
) -> Tuple[float, float]:
    """Unbiased ``|G|^2`` and ``tr(Sigma)`` from the norms of small-batch and big-batch gradients.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
    Training", appendix A.1: the mean gradient ``G_b`` of ``b`` independent
    examples has ``E |G_b|^2 = |G|^2 + tr(Sigma) / b``. Two batch sizes
    ``b < B`` give two equations; for each small batch ``j`` (a micro-batch
    or one process's share of the big batch ``B``, ``M_j = |G_{b_j}|^2``,
    ``M = |G_B|^2``):

    .. math::

        |G|^2 \\approx \\frac{B M - b_j M_j}{B - b_j}, \\qquad
        \\mathrm{tr}(\\Sigma) \\approx \\frac{M_j - M}{1 / b_j - 1 / B},

    each unbiased (linear in ``M_j`` and ``M``, whatever their correlation),
    and so is their mean over ``j``, which is returned. No per-example
    gradient is needed. ``B`` may be an effective size: a weighted mean
    ``sum_i w_i g_i`` (``sum_i w_i = 1``) has ``E|.|^2 = |G|^2 + tr(Sigma)
    sum_i w_i^2``, i.e. ``B = 1 / sum_i w_i^2``.

    Args:
        small: ``(M_j, b_j)`` for every small batch; ``M_j`` (and ``M``) may
            be tensors, one squared norm per element (elementwise estimates).
        big_squared_norm: ``M``.
        big_examples: ``B``, unequal to every ``b_j`` (usually larger: with
            ``b_j`` close to ``B`` the estimates have a large variance).

    Returns:
        ``(grad_sq, trace_cov)``.

    Raises:
        ValueError: If there is no small batch, or one has ``B`` examples.
    """
    if not small or any(b == big_examples for _, b in small):
        raise ValueError(
            f"the two-batch estimate needs small batches of another size than the big one "
            f"({big_examples} examples), got sizes {[b for _, b in small]}: use at least 2 "
            "micro-batches or processes"
        )
    grad_sq = trace_cov = 0.0
    for squared_norm, b in small:
        grad_sq += (big_examples * big_squared_norm - b * squared_norm) / (big_examples - b)
        trace_cov += (squared_norm - big_squared_norm) / (1 / b - 1 / big_examples)
    return grad_sq / len(small), trace_cov / len(small)


def exponential_moving_average(previous: Optional[float], value: float, smoothing: float) -> float:
    """``smoothing * previous + (1 - smoothing) * value``; ``value`` when ``previous`` is None.

    Starting at the first value (no bias towards 0, no correction needed).
    ``smoothing`` in ``[0, 1)`` is the weight of the past: about
    ``1 / (1 - smoothing)`` recent values dominate.
    """
    if previous is None:
        return value
    return smoothing * previous + (1 - smoothing) * value
