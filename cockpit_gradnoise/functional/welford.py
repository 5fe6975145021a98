"""Welford's running mean and sum of squared deviations, and the sd from them."""

import torch
from torch import Tensor


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
