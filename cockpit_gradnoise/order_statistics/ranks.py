"""Quantile levels, the ranks and weights that give ``numpy.quantile``, and the checks.

Shared by every path of the selection: :func:`quantile_ranks` and
:func:`interpolate` reproduce ``numpy.quantile``'s linear method bit for bit.
"""

import math
from typing import Iterable, List, Sequence, Tuple, Union

import torch
from torch import Tensor

Tensors = Union[Tensor, Sequence[Tensor]]

#: Unions of at most this many elements are sorted whole: a sort that small
#: costs no more than a bucket selection's fixed overhead, with or without
#: NumPy's SIMD sort (``benchmarks/benchmark_order_statistics.py`` times both).
SORT_WHOLE_AT_MOST = 1 << 12


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


def quantile_ranks(levels: Sequence[float], n: int) -> Tuple[List[int], List[int], List[float]]:
    """Ranks and weights of ``numpy.quantile``'s linear method for ``n`` values.

    For sorted values ``v_0 <= ... <= v_{n-1}`` and level ``q``: ``h = (n - 1) q``,
    ``k = floor(h)``; the quantile lies between ``v_k`` and ``v_{k+1}`` (both
    ``v_{n-1}`` at the top) with weight ``t = h - k`` on the upper one.

    Returns:
        ``(lower ranks, upper ranks, weights)``, one entry per level.
    """
    lower, upper, weights = [], [], []
    for level in levels:
        position = (n - 1) * float(level)
        k = min(math.floor(position), n - 1)
        lower.append(k)
        upper.append(min(k + 1, n - 1))
        weights.append(position - k)
    return lower, upper, weights


def interpolate(
    lower: Sequence[float], upper: Sequence[float], weights: Sequence[float]
) -> List[float]:
    """``a + t (b - a)`` per level, computed as NumPy's ``_lerp`` does.

    From ``b`` when ``t >= 0.5`` (``b - (1 - t)(b - a)``), so results equal
    ``numpy.quantile``'s bit for bit.
    """
    result = []
    for a, b, t in zip(lower, upper, weights):
        diff = b - a
        result.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return result


def check_ranks(flats: List[Tensor], ranks: Sequence[int]):
    """Raise a ValueError unless ``flats`` have elements and every rank lies among them."""
    n = sum(flat.numel() for flat in flats)
    if n == 0:
        raise ValueError("no elements to take quantiles of: pass at least one value")
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"ranks must lie in [0, {n}), got {bad}")


def check_no_nan(largest: float):
    """Raise a ValueError if ``largest``, the largest of some values (NaN sorts last), is NaN."""
    if math.isnan(largest):
        raise ValueError(
            "values contain NaN, which has no order: quantiles are undefined; "
            "leave them out first, e.g. values[~values.isnan()]"
        )


def flat_tensors(tensors: Tensors) -> List[Tensor]:
    """Detached 1d float32 or float64 views (or copies) of the non-empty tensors."""
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    flats = [t.detach().reshape(-1) for t in tensors if t.numel() > 0]
    dtypes = {flat.dtype for flat in flats}
    if dtypes <= {torch.float32} or dtypes <= {torch.float64}:
        return flats
    # Converting to a wider float is exact and keeps the order.
    narrow = {torch.float16, torch.bfloat16, torch.float32}
    common = torch.float32 if dtypes <= narrow else torch.float64
    return [flat.to(common) for flat in flats]
