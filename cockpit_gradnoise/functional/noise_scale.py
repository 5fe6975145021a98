"""The gradient noise scale's estimates of ``|G|^2`` and ``tr(Sigma)``, and their smoothing."""

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
