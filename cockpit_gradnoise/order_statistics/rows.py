"""Quantiles of every row of a table at once: many parameters' batches in a few vector ops.

On a GPU each small op is a kernel launch of 10-40 us whatever its size, and on
any device each is a Python call: the per-example norms of ``P`` parameters,
one row of ``B`` values each, are summarised here with a constant number of
ops instead of a handful per parameter (``benchmarks/benchmark_op_count.py``).
The results are those of :func:`~cockpit_gradnoise.order_statistics.quantile_summary`
on each row: the same ranks and weights (:func:`quantile_ranks`) and the same
interpolation (:func:`interpolate`, applied to columns), so ``numpy.quantile``'s
linear method bit for bit.
"""

import math
from typing import List, Sequence

from cockpit_gradnoise.order_statistics.ranks import interpolate, quantile_ranks

import torch
from torch import Tensor


def sorted_rows(table: Tensor) -> Tensor:
    """Each row of a 2-d tensor sorted ascending, every NaN last (a new tensor).

    As :func:`~cockpit_gradnoise.order_statistics.sorted_on_device` row by row:
    NaN sorts as ``+inf`` and is written back over the row's last places (CUDA's
    radix sort would put a NaN with its sign bit set first).
    """
    nan = table.isnan()
    ordered = torch.sort(table.masked_fill(nan, math.inf), dim=1).values
    places = torch.arange(table.shape[1], device=table.device)
    return ordered.masked_fill_(places >= table.shape[1] - nan.sum(dim=1, keepdim=True), math.nan)


def quantiles_of_sorted_rows(ordered: Tensor, levels: Sequence[float]) -> List[Tensor]:
    """``numpy.quantile(row, level)`` of each row of ``ordered`` ``[R, n]`` (rows sorted,
    ``n >= 1``), one float64 column ``[R]`` per level.

    With ``h = (n - 1) q``, ``k = floor(h)``, ``t = h - k``: ``v_k + t (v_{k+1} - v_k)``,
    the ranks and weights of :func:`quantile_ranks` (the same for every row, which
    all have ``n`` values) and :func:`interpolate`'s arithmetic on whole columns.
    """
    lower, upper, weights = quantile_ranks(levels, ordered.shape[1])
    wide = ordered.double()  # exact; one conversion for every rank read
    return interpolate([wide[:, k] for k in lower], [wide[:, k] for k in upper], weights)
