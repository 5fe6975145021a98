"""Squares of contributions that cannot underflow: a power-of-two scale, float64 results.

A float32 square below about ``1e-38`` (``1.4e-45`` as a
subnormal) is lost: contributions of ``1e-22`` (layers of a network at
initialization) would give sums of squares, norms and sd of 0. So squares
are formed at a power-of-two scale (:func:`power_of_two_scale`: one
max-reduction per layer, of the contributions or of their factors), which
changes no rounding, and the results are unscaled in float64
(:func:`unscaled_sums`, :func:`unscaled_norms`, :func:`saved_dtype`): the sums and the per-example squared
norms of a float32 (or narrower) parameter are saved as float64 tensors
(on the CPU only for layers below :data:`SMALLEST_UNSCALED`). Their
rounding is float32's (they were summed in float32):
:class:`~cockpit_gradnoise.GradientVarianceQuantiles` takes the bound of the
parameter's dtype. float64 parameters are summed as before (squares
underflow only below ``1e-308``).
"""

import math
from typing import List, Optional, Tuple

from cockpit_gradnoise import _device

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
    # One pass each, no copy (abs() would write one).
    extremes = [torch.aminmax(tensor.detach()) for tensor in tensors if tensor.numel()]
    if _device.on_host(tensors[0]):
        # In Python: a handful of tiny torch operations cost more on the CPU.
        largest = max((max(float(high), -float(low)) for low, high in extremes), default=0.0)
        exponent = math.frexp(largest)[1] if math.isfinite(largest) else 0
        return torch.tensor(2.0 ** -min(max(exponent, -125), 127))
    if not extremes:
        return torch.ones((), device=tensors[0].device)  # 2**-0, as frexp(0) gives
    # In few launches (each small op is one on a GPU): max(high, -low) = max(|high|, |low|),
    # amax and maximum propagate NaN, and rounding to float32 is monotone, so the
    # float32 maximum of the rounded extremes is the rounded maximum.
    largest = torch.stack([bound.float() for pair in extremes for bound in pair]).abs().amax()
    _, exponent = torch.frexp(largest)
    exponent = torch.where(largest < math.inf, exponent.clamp(-125, 127), 0)  # not NaN nor inf
    return torch.ldexp(torch.ones_like(largest), -exponent)


#: On the CPU, a layer whose largest magnitude (of the contributions, or the
#: product of its factors' largest) is at least ``2**-40`` (about ``1e-12``) is
#: summed unscaled, in its dtype, as before: the squares of all its elements
#: within float32's ``2**-23`` of that largest are normal float32 numbers, and it
#: saves converting the sums to float64 (which doubled the cost of the sums of
#: an MLP). Smaller layers, and every layer on other devices (where looking
#: at the value would make the host wait), are summed at a scale.
SMALLEST_UNSCALED = 2.0**-40


def _needed(scale: Tensor) -> Optional[Tensor]:
    """``scale``, or ``None`` on the CPU where it shows a largest magnitude of at
    least :data:`SMALLEST_UNSCALED` (``scale = 2**-e`` with the largest below ``2**e``)."""
    if _device.on_host(scale) and scale.item() * SMALLEST_UNSCALED <= 0.5:
        return None
    return scale


def scaled_factors(*factors: Tensor) -> Tuple[List[Tensor], Optional[Tensor]]:
    """The factors of products (``x_i = sum_l g_il a_il^T``) each at its own
    :func:`power_of_two_scale`, and the product of the scales; unchanged with
    scale ``None`` where their squares cannot underflow (float64, or
    :data:`SMALLEST_UNSCALED`)."""
    if not needs_scale(factors[0].dtype):
        return list(factors), None
    scales = [power_of_two_scale(factor) for factor in factors]
    if _needed(math.prod(scales)) is None:
        return list(factors), None
    return [factor * scale for factor, scale in zip(factors, scales)], math.prod(scales)


def contributions_scale(contributions: Tensor) -> Optional[Tensor]:
    """:func:`power_of_two_scale` of contributions, ``None`` where their squares
    cannot underflow (float64, or :data:`SMALLEST_UNSCALED`)."""
    if not needs_scale(contributions.dtype):
        return None
    return _needed(power_of_two_scale(contributions))


def unscaled_norms(at_scale: Tensor, scale: Optional[Tensor]) -> Tensor:
    """Per-example squared norms formed at ``scale``: ``at_scale / scale**2``, in
    :func:`saved_dtype` whatever the scale (``[N]`` numbers: converting costs
    nothing, and the norms are then the same numbers on every path)."""
    wide = saved_dtype(at_scale.dtype)
    if scale is None:
        return at_scale.to(wide)
    return at_scale.to(wide) / scale.to(wide).square()


def unscaled_sums(sums: Tensor, scale: Optional[Tensor]) -> Tensor:
    """``[T, S, ...]`` formed from contributions times ``scale``: ``[T / scale, S / scale**2, ...]``,
    every row after the first a sum of squares (``A`` of :func:`.conv_math.expanded_sums`)."""
    if scale is None:
        return sums
    wide = saved_dtype(sums.dtype)
    scale = scale.to(wide)  # its square may exceed float32's range
    powers = [scale] + [scale.square()] * (len(sums) - 1)
    inverse = torch.stack(powers).reciprocal_()  # powers of two: exact
    return sums.to(wide) * inverse.reshape(len(sums), *[1] * (sums.dim() - 1))


def squared_norms_of(contributions: Tensor) -> Tensor:
    """``||x_i||^2`` of contributions ``[N, *shape]``, ``[N]``; at a scale for float32
    and narrower, saved in float64."""
    scale = contributions_scale(contributions)
    if scale is None:
        return unscaled_norms(contributions.square().flatten(start_dim=1).sum(1), None)
    squares = (contributions * scale).square_().flatten(start_dim=1).sum(1)
    return unscaled_norms(squares, scale)


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
