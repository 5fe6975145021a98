"""The gradient noise scale's estimates of ``|G|^2`` and ``tr(Sigma)``, and their smoothing."""

import math
from typing import Optional, Sequence, Tuple


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
        one_grad_sq, one_trace_cov = two_batch_noise_scale_terms(squared_norm, b, big_squared_norm, big_examples)
        grad_sq += one_grad_sq
        trace_cov += one_trace_cov
    return grad_sq / len(small), trace_cov / len(small)


def two_batch_noise_scale_terms(squared_norm, examples, big_squared_norm, big_examples):
    """One small batch's ``(|G|^2, tr(Sigma))`` of :func:`two_batch_noise_scale_estimates`.

    .. math::

        \\frac{B M - b_j M_j}{B - b_j}, \\qquad \\frac{M_j - M}{1 / b_j - 1 / B}.

    Elementwise, so that ``squared_norm`` (``M_j``) and ``examples`` (``b_j``) may be
    stacked, ``[K, ...]`` and ``[K, 1, ...]``: all ``K`` small batches' terms in a few
    tensor operations (what :class:`~cockpit_gradnoise.TwoBatchNoiseScale` does at
    each step), summed over the first dimension by the caller. ``examples`` unequal
    to ``big_examples`` (checked by :func:`two_batch_noise_scale_estimates`).
    """
    grad_sq = (big_examples * big_squared_norm - examples * squared_norm) / (big_examples - examples)
    trace_cov = (squared_norm - big_squared_norm) / (1 / examples - 1 / big_examples)
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


def scale_free_smoothed_noise_scale(
    averages: Optional[Tuple[float, float]], grad_sq: float, trace_cov: float,
    smoothing: float,
) -> Tuple[Optional[Tuple[float, float]], float]:
    """Smoothed ``B_simple`` over steps whose gradients are in different units.

    Each step's two estimates are divided by that step's mean per-example
    squared norm before they are averaged:

    .. math::

        S_t = \\widehat{|G|^2}_t + \\widehat{\\mathrm{tr}(\\Sigma)}_t
            = \\mathrm{mean}_i \\|g_{t,i}\\|^2 \\ge 0, \\qquad
        B_\\text{smoothed} = \\frac{\\mathrm{EMA}_t(\\widehat{\\mathrm{tr}(\\Sigma)}_t / S_t)}
                                  {\\mathrm{EMA}_t(\\widehat{|G|^2}_t / S_t)}

    (the identity for ``S_t`` is the algebra of
    :func:`noise_scale_estimates`: ``(N M - S)/(N - 1) + N (S - M)/(N - 1) =
    S``). Each step's own ratio ``b_simple_t`` is unchanged by the
    division, and every step weighs the same in the averages whatever the
    scale of its gradients. The scaled values are bounded, so no single
    step can hold the average: ``grad_sq / S`` lies in ``[-1/(N-1), 1]``
    (``M >= 0``) and ``trace_cov / S`` in ``[0, N/(N-1)]`` (``M <= S``).
    (Dividing by the batch gradient's ``M = grad_sq + trace_cov / N``
    instead would not bound them: a step whose mean gradient nearly
    cancels has ``grad_sq / M`` about ``-S / ((N-1) M)``, unbounded below;
    measured on the experiment's GPT, that kept the average below 0 for a
    whole run.)

    Why: under an adaptive optimizer the gradients are those of ``P_t g``
    with Adam's ``P_t = 1 / (sqrt(v_hat_t) + eps)``, which shrinks by orders
    of magnitude over the first steps as ``v`` fills (measured on the
    experiment's GPT: ``grad_sq`` ``-2.8e9`` at step 0, ``2.3e4`` at step 5).
    Moving averages of the raw estimates (McCandlish et al. 2018's ratio of
    averages, :func:`exponential_moving_average`) then let one early step
    outweigh the next hundred, and one negative ``grad_sq`` held the average
    below 0 (an infinite smoothed value) for ~110 steps whose own
    ``b_simple`` were often finite. The raw convention is kept where the
    units do not change (:class:`~cockpit_gradnoise.GradientNoiseScale`,
    ``P = I``; nanoGNS does the same).

    The averages start at 0 (``EMA_0 = (1 - smoothing) x_0``): step ``k``
    of ``t`` has weight ``(1 - smoothing) smoothing^(t - k)``, the first
    one too, and the ratio equals that of Adam-style bias-corrected averages
    (the correction ``1 - smoothing^(t + 1)`` is common to both and cancels).
    Started at the first value, as :func:`exponential_moving_average` is,
    the first step would weigh ``smoothing^t``, ten times the geometric
    weight at ``smoothing = 0.9``, and Adam's first step, sign descent
    (``v_hat = g^2``), is the one least like the others.

    Args:
        averages: ``(EMA of trace_cov / S, EMA of grad_sq / S)`` so far, or
            None before the first step averaged (then both start at 0).
        grad_sq: This step's ``|G|^2`` estimate.
        trace_cov: This step's ``tr(Sigma)`` estimate.
        smoothing: Weight of the past, in ``[0, 1)``.

    Returns:
        ``(averages, b_smoothed)``: ``b_smoothed`` is ``+inf`` when the
        averaged ``grad_sq / S`` is ``<= 0`` (no signal resolved). A step
        with a value that is not finite, or with ``S_t <= 0`` (every
        example's gradient 0: no units to measure it in, e.g. a parameter
        that receives no gradient), is skipped: ``averages`` are returned
        unchanged and ``b_smoothed`` is NaN.
    """
    scale = grad_sq + trace_cov
    if not (math.isfinite(grad_sq) and math.isfinite(trace_cov) and math.isfinite(scale)) \
            or scale <= 0:
        return averages, math.nan
    previous = averages if averages is not None else (0.0, 0.0)
    averages = tuple(smoothing * old + (1 - smoothing) * new / scale
                     for old, new in zip(previous, (trace_cov, grad_sq)))
    numerator, denominator = averages
    return averages, (numerator / denominator if denominator > 0 else math.inf)
