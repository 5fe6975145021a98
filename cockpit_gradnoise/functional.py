"""Pure formulas on tensors: every statistic the package reports.

Nothing here knows about Cockpit or BackPACK. The quantities fetch what
BackPACK leaves on the parameters and call one of these functions; tests check
each function on its own against NumPy or a brute-force loop.

Notation (see ``DESIGN.md``): a mini-batch has ``N`` examples, ``x_i`` is
example ``i``'s contribution to ``param.grad`` (``param.grad = sum_i x_i``),
and ``g_i`` is the gradient of example ``i``'s own loss. For a loss that is
``c * sum_i loss_i`` (``c = 1/N`` for a mean, ``c = 1`` for a sum),
``x_i = c * g_i``.
"""

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy
import torch
from torch import Tensor

from cockpit_gradnoise.schema import ratio_or_inf  # noqa: F401  (a formula views share)

#: Multiple of ``eps * N * sum_i x_ij**2`` below which the centred sum of
#: squares ``sum_i (x_ij - mean_i x_ij)**2`` counts as zero. ``N * eps`` times a
#: sum of ``N`` non-negative terms bounds the rounding error of that sum; the
#: centred sum is a difference of two such sums, hence the factor 2.
VARIANCE_ROUNDING_FACTOR = 2.0


def check_quantile_levels(quantiles: Iterable[float]) -> Tuple[float, ...]:
    """Validate quantile levels and return them as a tuple of floats.

    Args:
        quantiles: Levels in ``[0, 1]``, at least one.

    Returns:
        The levels, in the given order.

    Raises:
        ValueError: If ``quantiles`` is empty, not numeric, or has a level
            outside ``[0, 1]``.
    """
    try:
        levels = tuple(float(q) for q in quantiles)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"quantiles must be an iterable of numbers in [0, 1], got {quantiles!r}"
        ) from error
    if not levels:
        raise ValueError("quantiles must not be empty: pass e.g. quantiles=(0.5,)")
    bad = [q for q in levels if not 0.0 <= q <= 1.0]
    if bad:
        raise ValueError(f"quantile levels must lie in [0, 1], got {bad}")
    return levels


def quantile_name(level: float) -> str:
    """Return the statistic name of a quantile level, ``q`` + ``%g``: ``q0.05``."""
    return f"q{level:g}"


def _quantile_ranks(levels: Sequence[float], n: int) -> Tuple[List[int], List[float]]:
    """Ranks and weights of ``numpy.quantile``'s linear method for ``n`` values.

    Returns:
        ``(ranks, fractions)``: the lower rank of every level, then the upper
        rank of every level; and the weight ``t`` of the upper one per level.
    """
    lower, upper, fractions = [], [], []
    for level in levels:
        position = float(level) * (n - 1)
        k = min(math.floor(position), n - 1)
        lower.append(k)
        upper.append(min(k + 1, n - 1))
        fractions.append(position - k)
    return lower + upper, fractions


def _interpolate(values: Sequence[float], fractions: Sequence[float]) -> List[float]:
    """One quantile per level from the values at the ranks of :func:`_quantile_ranks`.

    ``a + t (b - a)`` computed as NumPy's ``_lerp`` does (from ``b`` when
    ``t >= 0.5``), so results match ``numpy.quantile`` bit for bit.
    """
    quantiles = []
    for t, a, b in zip(fractions, values, values[len(fractions) :]):
        diff = b - a
        quantiles.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return quantiles


def exact_quantiles(values: Tensor, levels: Sequence[float]) -> Tensor:
    """Quantiles of all elements with linear interpolation, as ``numpy.quantile``.

    For sorted values ``v_0 <= ... <= v_{n-1}`` and level ``q``, let
    ``h = q (n - 1)``, ``k = floor(h)``, ``t = h - k``; the quantile is
    ``v_k + t (v_{k+1} - v_k)`` (computed as NumPy does, from the upper end
    when ``t >= 0.5``). One sort serves all levels; unlike older
    ``torch.quantile`` this accepts any number of elements.

    Args:
        values: Tensor of any shape with at least one element.
        levels: Quantile levels in ``[0, 1]``.

    Returns:
        Float64 tensor of shape ``[len(levels)]``.
    """
    flat = values.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        raise ValueError("cannot take quantiles of an empty tensor")
    ranks, fractions = _quantile_ranks(levels, n)
    quantiles = _interpolate(_order_statistics(flat, ranks), fractions)
    return torch.tensor(quantiles, dtype=torch.float64)


def _order_statistics(flat: Tensor, ranks: Sequence[int]) -> list:
    """Values at 0-based ``ranks`` of ``flat`` in ascending order, as Python floats."""
    if flat.device.type != "cpu":
        ordered = torch.sort(flat).values
        return ordered[torch.tensor(ranks, device=flat.device)].double().tolist()
    native = flat.dtype in (torch.float32, torch.float64)
    array = (flat if native else flat.double()).numpy()
    distinct = sorted(set(ranks))
    if distinct[-1] - distinct[0] <= 1:
        # One level (the median, say): select its lower rank in O(n); the upper
        # rank is the smallest value above it (fmin skips NaN, sorted last).
        k = distinct[0]
        selected = numpy.partition(array, k)
        found = {k: selected[k], k + 1: numpy.fmin.reduce(selected[k + 1 :], initial=numpy.nan)}
        return [float(found[r]) for r in ranks]
    # numpy's vectorized sort is over 10x faster than torch.sort on CPU
    # (400k float32: 1.2 ms against 39 ms, numpy 2.4, torch 2.14).
    return numpy.sort(array)[list(ranks)].tolist()


def summarize(values: Tensor, levels: Sequence[float], prefix: str = "") -> Dict[str, float]:
    """Quantiles ``q<level>`` and ``mean`` of all elements of ``values``.

    Args:
        values: Tensor with at least one element.
        levels: Quantile levels in ``[0, 1]``.
        prefix: Prepended to every statistic name (e.g. ``"snr_"``).

    Returns:
        ``{prefix + "q<level>": float, ..., prefix + "mean": float}``.
    """
    result = {
        prefix + quantile_name(level): value
        for level, value in zip(levels, exact_quantiles(values, levels).tolist())
    }
    result[prefix + "mean"] = torch.mean(values, dtype=torch.float64).item()
    return result


def centred_sum_of_squares(
    sum_of_squares: Tensor, total: Tensor, n: int, *, in_place: bool = False
) -> Tensor:
    """``sum_i (x_i - mean_i x_i)**2`` per element from ``sum_i x_i**2`` and ``sum_i x_i``.

    ``sum_i (x_i - xbar)**2 = sum_i x_i**2 - (sum_i x_i)**2 / n``. The
    difference of two rounded sums can come out slightly negative, or as
    rounding noise where all ``x_i`` are equal; values at or below
    ``VARIANCE_ROUNDING_FACTOR * eps * n * sum_i x_i**2`` (the worst-case
    rounding error of those sums, ``eps`` of the tensor's dtype) are set to 0.

    Args:
        sum_of_squares: ``sum_i x_i**2`` (BackPACK's ``SumGradSquared``).
        total: ``sum_i x_i`` (``param.grad``).
        n: Number of examples ``N``.
        in_place: Overwrite ``sum_of_squares`` with the result (saves one copy).

    Returns:
        Non-negative tensor shaped like ``total``.
    """
    eps = torch.finfo(sum_of_squares.dtype).eps
    rounding = sum_of_squares * (VARIANCE_ROUNDING_FACTOR * eps * n)
    if in_place:
        centred = sum_of_squares.addcmul_(total, total, value=-1.0 / n)
    else:
        centred = torch.addcmul(sum_of_squares, total, total, value=-1.0 / n)
    return centred.masked_fill_(centred <= rounding, 0.0)


def gradient_sd(sum_of_squares: Tensor, total: Tensor, n: int, *, in_place: bool = False) -> Tensor:
    """Per-element standard deviation of the mini-batch gradient, from one batch.

    .. math::

        \\mathrm{sd}_j = \\sqrt{\\frac{N}{N-1} \\sum_{i=1}^N (x_{ij} - \\bar x_j)^2}

    where ``x_ij`` is example ``i``'s contribution to ``param.grad[j]``. This
    estimates the standard deviation of ``param.grad[j]`` over independent
    mini-batches of size ``N`` (what :func:`~cockpit_gradnoise.minibatch_gradient_stats`
    measures by repetition). Units: those of ``param.grad``.

    Args:
        sum_of_squares: ``sum_i x_ij**2``.
        total: ``sum_i x_ij`` (``param.grad``).
        n: Batch size ``N >= 2``.
        in_place: Overwrite ``sum_of_squares`` with the result (saves one copy).

    Returns:
        Tensor shaped like ``total``; exactly 0 where the examples agree to
        rounding (see :func:`centred_sum_of_squares`).
    """
    if n < 2:
        raise ValueError(f"the gradient variance needs at least 2 examples, got {n}")
    # In place on the fresh result: this runs on every element of the network.
    centred = centred_sum_of_squares(sum_of_squares, total, n, in_place=in_place)
    return centred.mul_(n / (n - 1)).sqrt_()


def signal_to_noise(grad: Tensor, sd: Tensor) -> Tensor:
    """``|grad_j| / sd_j`` for the elements with ``sd_j > 0`` (flattened).

    Elements with ``sd_j = 0`` have no defined ratio and are left out, so the
    result never holds an inf or NaN from a zero denominator. It may be empty.
    """
    # Dividing everywhere and selecting once is ~3x faster than two boolean
    # indexings; the inf/NaN where sd_j = 0 are never selected.
    return torch.masked_select(grad.abs().div_(sd), sd > 0)


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
    total = individual_losses.detach().double().sum().item()
    value = float(loss.detach().double().item())
    if n == 1:
        return 1.0
    if not (math.isfinite(value) and math.isfinite(total)):
        return math.nan
    for scale in (1.0 / n, 1.0):
        if math.isclose(value, scale * total, rel_tol=1e-4, abs_tol=1e-12):
            return scale
    raise ValueError(
        f"info['loss'] = {value:.6g} is neither the mean ({total / n:.6g}) nor the "
        f"sum ({total:.6g}) of info['individual_losses']: pass per-example losses "
        "of the same loss function with reduction='none'"
    )


def batch_norm_statistics(
    squared_norms: Tensor, levels: Sequence[float]
) -> Dict[str, float]:
    """Statistics over a batch of per-example gradient norms.

    Args:
        squared_norms: ``||g_i||^2`` for each example, shape ``[N]``.
        levels: Quantile levels.

    Returns:
        ``q<level>``, ``mean`` and ``max`` of ``||g_i||``.
    """
    # One small sorted NumPy array serves every statistic (torch calls on N
    # values cost more in overhead than in work).
    norms = sort_values_(squared_norms.clamp(min=0).sqrt_())
    result = sorted_summary([norms], levels)
    result["max"] = float(norms[-1])
    return result


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


def sd_statistics(sd: Tensor, grad: Tensor, levels: Sequence[float]) -> Dict[str, float]:
    """The statistics of :class:`~cockpit_gradnoise.GradientVarianceQuantiles`.

    ``q<level>`` and ``mean`` of ``sd_j``; ``snr_q0.5`` and ``snr_mean`` of
    ``|grad_j| / sd_j`` over the elements with ``sd_j > 0`` (absent when there
    are none; see :func:`signal_to_noise`).

    Args:
        sd: Per-element standard deviation of the gradient.
        grad: The gradient, same number of elements.
        levels: Quantile levels.
    """
    result = summarize(sd, levels)
    snr = signal_to_noise(grad, sd)
    if snr.numel() > 0:
        result.update(summarize(snr, (0.5,), prefix="snr_"))
    return result


def sd_statistic_names(levels: Sequence[float]) -> list:
    """Every name :func:`sd_statistics` can return, in order."""
    return [quantile_name(q) for q in levels] + ["mean", "snr_q0.5", "snr_mean"]


def squared_norm(tensor: Tensor) -> float:
    """``sum_j tensor_j**2`` as a Python float.

    One BLAS dot product, the fastest reduction here. In float32 it is off by
    about ``1e-6`` relative on a million elements (better than ``1e-5``;
    ``linalg.vector_norm(...)**2`` is off by ``~3e-5``, see ``DESIGN.md``).
    Half precision is summed in float32.
    """
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    return torch.dot(flat, flat).item()


def abs_ratio_statistics(numerator: Tensor, denominator: Tensor) -> Dict[str, float]:
    """Statistics of ``|a_j| / |b_j|`` over the elements with ``b_j != 0`` and both finite.

    The per-element ratio of :class:`~cockpit_gradnoise.ParamGradRatio`
    (``a = theta``, ``b = grad``): how many steps of size ``lr * |grad_j|``
    it takes to move ``theta_j`` by its own size. Elements with a zero or
    non-finite gradient, or a non-finite parameter, are left out, so no
    statistic is a NaN from 0/0. A ratio too large for the dtype is ``inf``.

    Args:
        numerator: ``a``, any shape.
        denominator: ``b``, same number of elements.

    Returns:
        ``mean``, ``median`` (as ``numpy.median``: the mean of the two middle
        values for an even count), ``min`` and ``max``; an empty dict when no
        element qualifies.
    """
    a, b = numerator.detach().reshape(-1), denominator.detach().reshape(-1)
    # A finite sum proves every element finite (NaN and inf propagate): then
    # only b = 0 is left out, and it needs no mask; its ratio (inf, or NaN
    # for 0/0) becomes +inf and sorts after the n kept values.
    if bool(torch.isfinite(a.sum())) and bool(torch.isfinite(b.sum())):
        n = int(torch.count_nonzero(b))
        ratio = torch.div(a, b).abs_().nan_to_num_(nan=math.inf, posinf=math.inf)
    else:
        valid = torch.isfinite(a) & torch.isfinite(b) & (b != 0)
        ratio = torch.div(a[valid], b[valid]).abs_()
        n = ratio.numel()
    if n == 0:
        return {}
    ordered = _sort_(ratio)
    smallest, lower, upper, largest = ordered[[0, (n - 1) // 2, n // 2, n - 1]].tolist()
    kept = ordered[:n]
    # numpy sums in float64 blockwise; torch would first copy it all to float64.
    total = (
        float(kept.numpy().sum(dtype=numpy.float64))
        if kept.device.type == "cpu"
        else kept.sum(dtype=torch.float64).item()
    )
    return {
        "mean": total / n,
        "median": (lower + upper) / 2,
        "min": smallest,
        "max": largest,
    }


def _sort_(values: Tensor) -> Tensor:
    """``values`` (1d, a temporary) sorted ascending, in place where possible.

    On CPU numpy's vectorized sort, over 10x faster than ``torch.sort``.
    """
    if values.device.type != "cpu":
        return torch.sort(values).values
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    values.numpy().sort()
    return values


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


def exponential_moving_average(previous: Optional[float], value: float, smoothing: float) -> float:
    """``smoothing * previous + (1 - smoothing) * value``; ``value`` when ``previous`` is None.

    Starting at the first value (no bias towards 0, no correction needed).
    ``smoothing`` in ``[0, 1)`` is the weight of the past: about
    ``1 / (1 - smoothing)`` recent values dominate.
    """
    if previous is None:
        return value
    return smoothing * previous + (1 - smoothing) * value


def sort_values_(values: Tensor) -> numpy.ndarray:
    """Sort ``values`` ascending in place (on CPU) and return them as a 1d NumPy array.

    On CPU the tensor's own memory is sorted (no copy; NumPy's vectorized sort
    is over 10x faster than ``torch.sort``). Other devices are copied to the
    host first. The caller must own ``values``: its order is destroyed.
    """
    array = values.detach().reshape(-1).cpu().numpy()
    array.sort()
    return array


def union_order_statistics(
    sorted_arrays: Sequence[numpy.ndarray], ranks: Sequence[int]
) -> List[float]:
    """Values at 0-based ``ranks`` of the union of sorted non-negative arrays.

    No concatenation and no sort: for non-negative IEEE floats the order of
    the values is the order of their bit patterns read as integers, so a
    bisection over bit patterns, counting with ``searchsorted`` in each
    array, finds the exact values in at most 32 (float32) or 64 (float64)
    steps, all ranks at once.

    Args:
        sorted_arrays: Ascending 1d arrays of one float dtype, values >= 0
            (``+inf`` allowed, no NaN).
        ranks: Each ``0 <= rank <`` the total number of elements.
    """
    nonempty = [a for a in sorted_arrays if a.size]
    dtype = nonempty[0].dtype
    as_int = {4: numpy.int32, 8: numpy.int64}[dtype.itemsize]
    targets = numpy.asarray(ranks, dtype=numpy.int64)
    low = numpy.full(len(targets), min(a[:1].view(as_int)[0] for a in nonempty), dtype=as_int)
    high = numpy.full(len(targets), max(a[-1:].view(as_int)[0] for a in nonempty), dtype=as_int)
    while (low < high).any():
        middle = low + (high - low) // 2
        values = middle.view(dtype)
        counts = sum(numpy.searchsorted(a, values, side="right") for a in nonempty)
        above = counts > targets  # the rank-th value is <= middle
        high = numpy.where(above, middle, high)
        low = numpy.where(above, low, middle + 1)
    return low.view(dtype).astype(numpy.float64).tolist()


def sorted_summary(
    sorted_arrays: Sequence[numpy.ndarray], levels: Sequence[float], prefix: str = ""
) -> Dict[str, float]:
    """:func:`summarize` of the union of sorted non-negative arrays, without joining them.

    Quantiles exactly as ``numpy.quantile`` (linear interpolation) and the
    mean (summed in float64), of all elements of all arrays.
    """
    n = sum(a.size for a in sorted_arrays)
    if n == 0:
        raise ValueError("cannot take quantiles of no elements")
    ranks, fractions = _quantile_ranks(levels, n)
    if len(sorted_arrays) == 1:
        values = sorted_arrays[0][ranks].astype(numpy.float64).tolist()
    else:
        values = union_order_statistics(sorted_arrays, ranks)
    quantiles = _interpolate(values, fractions)
    result = {prefix + quantile_name(level): q for level, q in zip(levels, quantiles)}
    total = sum(float(numpy.add.reduce(a, dtype=numpy.float64)) for a in sorted_arrays)
    result[prefix + "mean"] = total / n
    return result


def sorted_signal_to_noise(grad: Tensor, sd: Tensor) -> numpy.ndarray:
    """:func:`signal_to_noise`, sorted ascending, as a NumPy array.

    Without a boolean selection (the slow part): elements with ``sd_j = 0``
    get ``+inf`` (``x/0`` and ``0/0`` alike), sort last and are cut off.
    """
    ratio = grad.detach().abs().div_(sd).nan_to_num_(nan=math.inf, posinf=math.inf)
    return sort_values_(ratio)[: int(torch.count_nonzero(sd))]
