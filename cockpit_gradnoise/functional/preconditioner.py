"""Diagonal preconditioners of adaptive optimizers, and the noise-scale sums of preconditioned gradients.

The optimizers of ``torch.optim`` that divide the gradient by a running
second moment update it with the step's gradient ``g`` first and then divide:
the update of step ``t`` applies ``P_t = diag(1 / (sqrt(v_t) + eps))`` with
``v_t`` the moment *after* ``g`` was added. The functions below form that
``P_t`` from the state *before* the step and ``g``, with torch's operations in
torch's order (in the state's dtype, as the optimizer does), so that they give
the ``P`` the next ``optimizer.step()`` applies.
"""

import math
from typing import Optional, Tuple, Union

from cockpit_gradnoise import _device
from cockpit_gradnoise.functional.norms import squared_norm

import torch
from torch import Tensor

Number = Union[float, Tensor]


def adam_preconditioner(
    exp_avg_sq: Number, grad: Tensor, *, beta2: float, step: Number, eps: float,
    max_exp_avg_sq: Optional[Number] = None,
) -> Tensor:
    """``P`` of Adam's (and AdamW's) update at step ``t = step + 1``.

    Kingma and Ba 2015; ``torch.optim.Adam``:

    .. math::

        v_t = \\beta_2 v_{t-1} + (1 - \\beta_2) g^2, \\qquad
        \\hat v_t = \\frac{v_t}{1 - \\beta_2^t}, \\qquad
        P = \\frac{1}{\\sqrt{\\hat v_t} + \\epsilon},

    with ``v_t`` replaced by ``max(v_max, v_t)`` under ``amsgrad``.

    Args:
        exp_avg_sq: ``v_{t-1}`` (``state["exp_avg_sq"]``; ``0`` before the first step).
        grad: ``g``, the gradient the step adds (with Adam's ``weight_decay``,
            not decoupled: ``grad + weight_decay * param``).
        beta2: ``beta_2``.
        step: ``t - 1``, the steps taken (``state["step"]``; a tensor under ``capturable``).
        eps: ``epsilon``.
        max_exp_avg_sq: ``state["max_exp_avg_sq"]`` under ``amsgrad``, else ``None``.

    Returns:
        ``P``'s diagonal, shaped as ``grad``.
    """
    second_moment = _moving_average(exp_avg_sq, grad, beta2)
    if max_exp_avg_sq is not None:
        second_moment = torch.maximum(torch.as_tensor(max_exp_avg_sq).to(second_moment), second_moment)
    bias_correction2 = 1 - beta2 ** (step + 1)
    root = bias_correction2.sqrt() if isinstance(bias_correction2, Tensor) else math.sqrt(bias_correction2)
    return second_moment.sqrt_().div_(root).add_(eps).reciprocal_()


def rmsprop_preconditioner(
    square_avg: Number, grad: Tensor, *, alpha: float, eps: float,
    grad_avg: Optional[Number] = None,
) -> Tensor:
    """``P`` of RMSprop's update (Hinton's lecture 6e; ``torch.optim.RMSprop``).

    .. math::

        s_t = \\alpha s_{t-1} + (1 - \\alpha) g^2, \\qquad
        P = \\frac{1}{\\sqrt{s_t - \\bar g_t^2} + \\epsilon},

    where the centered variant subtracts ``bar g_t = alpha bar g_{t-1} + (1 -
    alpha) g`` (the plain one: ``bar g_t = 0``), clamped at 0 against
    rounding. No bias correction; ``eps`` is added to the root.

    Args:
        square_avg: ``s_{t-1}`` (``state["square_avg"]``; ``0`` before the first step).
        grad: ``g`` (with ``weight_decay``: ``grad + weight_decay * param``;
            under ``maximize``, ``-grad``, which the centered mean sees).
        alpha: ``alpha``.
        eps: ``epsilon``.
        grad_avg: ``bar g_{t-1}`` (``state["grad_avg"]``) when ``centered``, else ``None``.
    """
    second_moment = _moving_average(square_avg, grad, alpha)
    if grad_avg is not None:
        mean = torch.lerp(torch.as_tensor(grad_avg).to(grad).expand_as(grad), grad, 1 - alpha)
        second_moment = second_moment.addcmul_(mean, mean, value=-1).clamp_(min=0)
    return second_moment.sqrt_().add_(eps).reciprocal_()


def adagrad_preconditioner(state_sum: Number, grad: Tensor, *, eps: float) -> Tensor:
    """``P`` of Adagrad's update (Duchi et al. 2011; ``torch.optim.Adagrad``):
    ``P = 1 / (sqrt(sum_{k<=t} g_k^2) + eps)``.

    Args:
        state_sum: ``sum_{k<t} g_k^2`` plus ``initial_accumulator_value`` (``state["sum"]``).
        grad: ``g`` (with ``weight_decay``: ``grad + weight_decay * param``).
        eps: ``epsilon``.
    """
    return (grad * grad).add_(state_sum).sqrt_().add_(eps).reciprocal_()


def _moving_average(previous: Number, grad: Tensor, weight: float) -> Tensor:
    """``weight * previous + (1 - weight) * grad**2``, in torch's order (``mul_``, ``addcmul_``)."""
    if isinstance(previous, Tensor):
        return previous.mul(weight).addcmul_(grad, grad, value=1 - weight)
    return torch.mul(grad, grad).mul_(1 - weight).add_(previous * weight)  # no state yet


def preconditioned_noise_sums(
    preconditioner: Optional[Tensor], sum_of_squares: Tensor, sum_of_gradients: Tensor, n: int,
    *, defer: bool = False,
) -> Tuple[float, float]:
    """``S_P = mean_i ||P g_i||^2`` and ``M_P = ||P mean_i g_i||^2`` from per-element sums.

    With ``Q_j = sum_i g_ij^2`` and ``T_j = sum_i g_ij`` over the ``N``
    examples and a diagonal ``P = diag(p)``:

    .. math::

        S_P = \\frac{1}{N} \\sum_j p_j^2 Q_j, \\qquad
        M_P = \\frac{1}{N^2} \\sum_j (p_j T_j)^2,

    the ``S`` and ``M`` of :func:`noise_scale_estimates` for the
    preconditioned gradients ``P g_i``. In float64, piece by piece, in two
    buffers of a piece each (never a float64 copy of the whole parameter,
    no tensor of its size made): the products of float32 numbers are exact
    there, and ``p T`` is formed before it is squared, so nothing underflows
    where ``p`` is large.

    Args:
        preconditioner: ``p``, shaped as the sums; ``None`` for ``P = I``.
        sum_of_squares: ``Q``.
        sum_of_gradients: ``T``.
        n: ``N``.
        defer: On other devices than the CPU, 0-dim float64 tensors left there.

    Returns:
        ``(S_P, M_P)``.
    """
    squares, gradients = sum_of_squares.reshape(-1), sum_of_gradients.reshape(-1)
    if preconditioner is None:
        result = (_device.float64_total(squares) / n, squared_norm(gradients, defer=True) / n**2)
    else:
        result = tuple(total / scale for total, scale in zip(
            _weighted_sums(preconditioner.reshape(-1), squares, gradients), (n, n**2)))
    if defer and not _device.on_host(squares):
        return result
    return tuple(float(value) for value in result)


def _weighted_sums(weights: Tensor, squares: Tensor, gradients: Tensor) -> Tuple[Tensor, Tensor]:
    """``(sum_j w_j^2 Q_j, sum_j (w_j T_j)^2)`` of 1d tensors in float64: 0-dim tensors."""
    if weights.numel() == 0:
        return (weights.new_zeros((), dtype=torch.float64),) * 2
    size = _device.CHUNK if _device.on_host(weights) else _device.DEVICE_CHUNK
    shape = (min(size, weights.numel()),)
    weight_piece = torch.empty(shape, dtype=torch.float64, device=weights.device)
    gradient_piece = torch.empty(shape, dtype=torch.float64, device=weights.device)
    weighted_squares, weighted_gradients = [], []
    for start in range(0, weights.numel(), size):
        piece = slice(start, start + size)
        weight = weight_piece[: min(size, weights.numel() - start)].copy_(weights[piece])
        gradient = gradient_piece[: weight.numel()].copy_(gradients[piece]).mul_(weight)
        weighted_gradients.append(torch.dot(gradient, gradient))
        weighted_squares.append(torch.dot(weight.square_(), squares[piece].double()))
    if len(weighted_squares) == 1:
        return weighted_squares[0], weighted_gradients[0]
    return torch.stack(weighted_squares).sum(), torch.stack(weighted_gradients).sum()
