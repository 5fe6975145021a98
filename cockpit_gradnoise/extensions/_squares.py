"""Squares of contributions that cannot underflow: a power-of-two scale, float64 results.

A float32 square below about ``1e-38`` (``1.4e-45`` as a
subnormal) is lost: contributions of ``1e-22`` (layers of a network at
initialization) would give sums of squares, norms and sd of 0. So squares
are formed at a power-of-two scale (:func:`power_of_two_scale`: one
max-reduction per layer, of the contributions or of their factors), which
changes no rounding, and the results are unscaled in float64
(:func:`unscaled`, :data:`saved_dtype`): the sums and the per-example squared
norms of a float32 (or narrower) parameter are saved as float64 tensors. Their
rounding is float32's (they were summed in float32):
:class:`~cockpit_gradnoise.GradientVarianceQuantiles` takes the bound of the
parameter's dtype. float64 parameters are summed as before (squares
underflow only below ``1e-308``).
"""

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor


def saved_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of squares of contributions in ``dtype`` are saved in: float64
    for float32 and narrower (no underflow), else ``dtype``."""
    return dtype if torch.finfo(dtype).bits >= 64 else torch.float64


def needs_scale(dtype: torch.dtype) -> bool:
    """Whether squares of ``dtype`` can underflow where the contributions are not tiny."""
    return saved_dtype(dtype) != dtype


def power_of_two_scale(*tensors: Tensor) -> Tensor:
    """``2**-e`` with ``max_k |t_k| = m 2**e``, ``m`` in ``[0.5, 1)``: a 0-dim float32 tensor.

    Multiplying by it brings the largest magnitude into ``[0.5, 1)`` exactly
    (a power of two changes no rounding), so that squares cannot underflow
    unless they are ``2**-126`` below the largest (``e`` is kept within
    ``[-125, 127]``, where ``2**-e`` is a normal float32). 1 when all are
    zero or one is not finite. On the tensors' device, without waiting for it.
    """
    largest = torch.zeros((), device=tensors[0].device)
    for tensor in tensors:
        if tensor.numel():
            largest = torch.maximum(largest, tensor.detach().abs().amax().float())
    _, exponent = torch.frexp(largest)
    exponent = torch.where(largest.isfinite(), exponent.clamp(-125, 127), 0)
    return torch.ldexp(torch.ones_like(largest), -exponent)


def scaled_factors(*factors: Tensor) -> Tuple[List[Tensor], Optional[Tensor]]:
    """The factors of products (``x_i = sum_l g_il a_il^T``) each at its own
    :func:`power_of_two_scale`, and the product of the scales; unchanged with
    scale ``None`` where squares of their dtype do not underflow (float64)."""
    if not needs_scale(factors[0].dtype):
        return list(factors), None
    scales = [power_of_two_scale(factor) for factor in factors]
    return [factor * scale for factor, scale in zip(factors, scales)], math.prod(scales)


def unscaled(at_scale: Tensor, scale: Optional[Tensor], power: int) -> Tensor:
    """``at_scale / scale**power`` in :func:`saved_dtype` (exact: a power of two,
    in float64); ``at_scale`` itself for scale ``None``."""
    if scale is None:
        return at_scale
    wide = saved_dtype(at_scale.dtype)
    return at_scale.to(wide) / scale.to(wide) ** power


def unscaled_sums(sums: Tensor, scale: Optional[Tensor]) -> Tensor:
    """``[T, S]`` formed from contributions times ``scale``: ``[T / scale, S / scale**2]``
    (:func:`unscaled`)."""
    if scale is None:
        return sums
    return torch.stack([unscaled(sums[0], scale, 1), unscaled(sums[1], scale, 2)])


def squared_norms_of(contributions: Tensor) -> Tensor:
    """``||x_i||^2`` of contributions ``[N, *shape]``, ``[N]``; at a scale for float32
    and narrower, saved in float64."""
    if not needs_scale(contributions.dtype):
        return contributions.square().flatten(start_dim=1).sum(1)
    scale = power_of_two_scale(contributions)
    squares = (contributions * scale).square_().flatten(start_dim=1).sum(1)
    return unscaled(squares, scale, 2)


class SquaredNormsFromContributionsMixin:
    """Turns a BackPACK ``BatchL2Grad`` rule (a ``BatchL2Base``) into
    :func:`squared_norms_of` the contributions it forms (no underflow)."""

    def _make_param_function(self, param_str):
        def param_function(ext, module, g_inp, g_out, bp_quantities):
            contributions = self.derivatives.param_mjp(
                param_str, module, g_inp, g_out, g_out[0], sum_batch=False
            )
            return squared_norms_of(contributions)

        return param_function
