"""The loss's reduction: the scale ``c`` with ``loss = c * sum_i loss_i`` (``1/N`` or ``1``)."""

import math
from typing import Optional, Sequence, Tuple

from cockpit_gradnoise import _device

import torch
from torch import Tensor


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
