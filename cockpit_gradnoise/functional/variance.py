"""Per-element standard deviation and signal-to-noise ratio of the gradient, from one batch.

``sd_j`` from the sums ``S = sum_i x_ij**2`` and ``T = sum_i x_ij`` of the
examples' contributions (:func:`gradient_sd`), zero where the centred sum does
not exceed its rounding bound (:func:`variance_rounding_bound`,
:func:`expansion_rounding_bound`), and ``|grad_j| / sd_j`` capped at the largest
ratio that bound lets it resolve (:func:`signal_to_noise`, :func:`resolvable_snr`).
"""

import math
from typing import Optional

from cockpit_gradnoise import _device
from cockpit_gradnoise.functional.underflow import lost_to_underflow, underflow_floor

import numpy
import torch
from torch import Tensor


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
    return sum_of_squares * relative_rounding(n, inner_terms, dtype or sum_of_squares.dtype)


def relative_rounding(n: int, inner_terms: int, dtype: torch.dtype) -> float:
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
    (:func:`cockpit_gradnoise.extensions.conv_math.expanded_sums`), no
    ``x_i`` is formed, and the error of ``S`` and of ``T`` is relative to the
    absolute terms ``A = sum_i (sum_l |b_il| |a_il|^T)**2 >= S``, not to ``S``:
    ``|d(S - T**2 / N)| <= N w(L) eps A`` (the derivation is in
    :mod:`cockpit_gradnoise.extensions.conv_math`), saved as ``R = w(L) A``,
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
    return math.sqrt((n - 1) / relative_rounding(n, inner_terms, dtype))


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
    return _gradient_sd(sum_of_squares, total, n, inner_terms=inner_terms, in_place=in_place, dtype=dtype,
                        extra_rounding=extra_rounding)


def _gradient_sd(
    sum_of_squares: Tensor, total: Tensor, n: int, *, inner_terms: int = 1, in_place: bool = False,
    dtype: Optional[torch.dtype] = None, extra_rounding: Optional[Tensor] = None,
    scale: Optional[Tensor] = None,
) -> Tensor:
    """:func:`gradient_sd`; where ``S`` is wider than ``dtype``, at the power-of-two ``scale``
    given (per element: :func:`gradient_sd_of_many`'s, each tensor's own), else at ``S``'s."""
    if n < 2:
        raise ValueError(f"the gradient variance needs at least 2 examples, got {n}")
    if dtype is not None and torch.finfo(dtype).bits < torch.finfo(sum_of_squares.dtype).bits:
        squares, narrow, scale = _at_a_scale(sum_of_squares, total, dtype, scale)
        # Elements far below the layer's largest (by 2**-126 in float32) whose S underflows
        # at this scale, though it is not an exact 0 of exact zeros: formed in the wide
        # dtype (with dtype's bound), which holds every S of float32 contributions.
        lost = lost_to_underflow(squares, underflow_floor(n, dtype), sum_of_squares, total)
        wide_extra = extra_rounding
        if extra_rounding is not None:
            extra_rounding = (extra_rounding * scale.to(extra_rounding.dtype).square()).to(dtype)
        sd = _gradient_sd(
            squares, narrow, n, inner_terms=inner_terms, in_place=True,
            extra_rounding=extra_rounding,
        ).div_(scale)
        if _device.on_host(sd) and not bool(lost.any()):
            return sd
        wide = centred_sum_of_squares(sum_of_squares, total, n, inner_terms=inner_terms, dtype=dtype,
                                      extra_rounding=wide_extra)
        return torch.where(lost, wide.mul_(n / (n - 1)).sqrt_().to(dtype), sd)
    # In place on the fresh result: this runs on every element of the network.
    centred = centred_sum_of_squares(
        sum_of_squares, total, n, inner_terms=inner_terms, in_place=in_place, dtype=dtype,
        extra_rounding=extra_rounding,
    )
    return centred.mul_(n / (n - 1)).sqrt_()


def _at_a_scale(sum_of_squares: Tensor, total: Tensor, dtype: torch.dtype, scale: Optional[Tensor] = None):
    """``(S s**2, T s, s)`` in ``dtype``, ``s = 2**m >= 1`` the largest with ``max S s**2 < 1``
    (:func:`_scale_below_one`; or ``scale``, given per element).

    Scaling up by a power of two changes no rounding and cannot overflow
    (``|T| s <= sqrt(N max S) s``), so :func:`gradient_sd` of the scaled sums,
    divided by ``s``, gives the numbers it gives in ``dtype`` wherever ``S`` is
    a normal number of ``dtype``, and a defined result where only the wider
    dtype holds ``S`` (float32 squares of contributions below ``1e-19``).
    On the tensors' device, without waiting for it.
    """
    scale = _scale_below_one(sum_of_squares.amax()) if scale is None else scale
    squares = (sum_of_squares * scale.square()).to(dtype)
    return squares, (total.to(sum_of_squares.dtype) * scale).to(dtype), scale.to(dtype)


def _scale_below_one(largest: Tensor) -> Tensor:
    """``2**m >= 1``, the largest with ``largest * 2**(2m) < 1``, in ``largest``'s dtype and shape
    (of each element: one tensor's largest ``S`` each, :func:`gradient_sd_of_many`)."""
    _, exponent = torch.frexp(largest)
    half = torch.div(-exponent, 2, rounding_mode="floor").clamp(min=0)
    return torch.ldexp(torch.ones(half.shape, dtype=largest.dtype, device=half.device), half)


def gradient_sd_of_many(
    squares: Tensor, total: Tensor, lengths: Tensor, n: int, *,
    dtype: Optional[torch.dtype] = None, magnitudes: Optional[Tensor] = None,
) -> Tensor:
    """:func:`gradient_sd` of several tensors' sums joined (``in_place``, ``inner_terms`` 1): each
    run of ``lengths[k]`` consecutive elements of ``squares`` and ``total`` (1d) one tensor's
    ``S_k`` and ``T_k``. Each tensor's own numbers (bit for bit where the kernels round alike):
    the same elementwise operations on the same numbers, each tensor's at its own power-of-two
    scale where ``S`` is wider than ``dtype`` (its largest ``S`` by one ``segment_reduce`` for
    all, taken to its elements by each element's tensor, found by ``searchsorted`` in the
    tensors' ends: ``repeat_interleave`` would make the host wait, or check that it need not, and
    a GPU's ``cat`` of expanded views copies them one by one); a few launches for all, where
    :func:`gradient_sd` takes about forty for each on other devices than the CPU. ``squares`` is
    overwritten where it is not wider than ``dtype``.

    Args:
        squares: The ``S_k`` joined (float64 sums of float32 contributions, say).
        total: The ``T_k`` joined, in the dtype each was accumulated in.
        lengths: ``[P]`` int64, on ``squares``' device: each tensor's number of elements, all
            positive, summing to ``squares.numel()`` (not checked: no wait for the device).
        n: ``N``.
        dtype: See :func:`gradient_sd`.
        magnitudes: ``R`` of sums expanded over positions, joined, for every tensor or none:
            :func:`expansion_rounding_bound` of it, in ``total``'s dtype, is each element's extra rounding.
    """
    extra = None if magnitudes is None else expansion_rounding_bound(magnitudes, n, total.dtype)
    scale = None
    if dtype is not None and torch.finfo(dtype).bits < torch.finfo(squares.dtype).bits:
        if lengths.numel() == 1:  # one tensor (a large one, in a part alone): its scale, not expanded
            scale = _scale_below_one(squares.amax())
        else:  # each element's tensor by a search of the tensors' ends: a fixed few launches
            largest = torch.segment_reduce(squares, "max", lengths=lengths, unsafe=True)
            owner = torch.searchsorted(lengths.cumsum(0), torch.arange(squares.numel(), device=squares.device),
                                       right=True)
            scale = _scale_below_one(largest)[owner]
    return _gradient_sd(squares, total, n, in_place=True, dtype=dtype, extra_rounding=extra, scale=scale)


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
