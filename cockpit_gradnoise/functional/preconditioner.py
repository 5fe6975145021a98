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
from typing import Iterable, Optional, Tuple, Union

from cockpit_gradnoise import _device
from cockpit_gradnoise.functional.layout import dimension_order
from cockpit_gradnoise.functional.norms import squared_norm

import numpy
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
    preconditioner: Union[None, Tensor, Iterable[Tensor]], sum_of_squares: Tensor, sum_of_gradients: Tensor,
    n: int, *, defer: bool = False,
) -> Tuple[float, float]:
    """``S_P = mean_i ||P g_i||^2`` and ``M_P = ||P mean_i g_i||^2`` from per-element sums.

    With ``Q_j = sum_i g_ij^2`` and ``T_j = sum_i g_ij`` over the ``N``
    examples and a diagonal ``P = diag(p)``:

    .. math::

        S_P = \\frac{1}{N} \\sum_j p_j^2 Q_j, \\qquad
        M_P = \\frac{1}{N^2} \\sum_j (p_j T_j)^2,

    the ``S`` and ``M`` of :func:`noise_scale_estimates` for the
    preconditioned gradients ``P g_i``. In float64, piece by piece, in two
    buffers of a piece (never a float64 copy of the whole parameter, no
    tensor of its size made): per piece, the rows ``T_j^2`` and ``Q_j`` times
    ``p_j^2`` in one matrix-vector product (``torch.mv``), summed in float64.

    **Rounding.** ``p`` is float32 (the optimizer's) or float64. For float32
    (and narrower) ``T`` and ``p``, ``p_j^2`` and ``T_j^2`` are exact in float64
    (48 bits of 53) and never underflow there (``|T_j| >= 2**-149`` or 0), so
    each term ``p_j^2 T_j^2`` is rounded once, as ``(p_j T_j)^2`` of the exact
    ``p_j T_j`` would be: the same number. For float64 ``T``, ``T_j^2`` may be
    subnormal (``|T_j| < 2**-511``), off by at most ``2**-1075`` absolutely; an
    element whose sums are resolved has ``Q_j >= 4 N`` tiny
    (:func:`~cockpit_gradnoise.functional.unresolved_sums`, checked before) and
    ``p_j^2 Q_j`` is in ``S_P``, so that error is below ``2**-1075 / (4 N
    2**-1022) < 2**-55`` of the element's share of ``N S_P``: under float64's own rounding.

    Args:
        preconditioner: ``p``, shaped as the sums, or its consecutive pieces over
            the flattened elements, each of :func:`piece_size` elements but the last (e.g.
            :meth:`~cockpit_gradnoise.quantities.preconditioners.OptimizerPreconditioner.pieces`,
            which forms each piece while the last is summed); ``None`` for ``P = I``.
        sum_of_squares: ``Q``.
        sum_of_gradients: ``T``.
        n: ``N``.
        defer: On other devices than the CPU, 0-dim float64 tensors left there.

    Returns:
        ``(S_P, M_P)``.
    """
    if preconditioner is None:
        squares, gradients = sum_of_squares.reshape(-1), sum_of_gradients.reshape(-1)
        result = (_device.float64_total(squares) / n, squared_norm(gradients, defer=True) / n**2)
    else:
        if isinstance(preconditioner, Tensor):
            preconditioner = preconditioner.reshape(-1).split(piece_size(sum_of_squares, sum_of_gradients))
        totals = _weighted_sums(preconditioner, sum_of_squares, sum_of_gradients)  # [M, S] unscaled
        if _device.on_host(totals):  # one read of both
            weighted_gradients, weighted_squares = totals.tolist()
            return weighted_squares / n, weighted_gradients / n**2
        result = (totals[1] / n, totals[0] / n**2)
    if defer and not _device.on_host(sum_of_squares):
        return result
    return tuple(float(value) for value in result)


def piece_size(*sums: Tensor) -> int:
    """Elements per piece of :func:`preconditioned_noise_sums` of per-element sums ``sums``.

    :data:`.._device.CHUNK` on the CPU (a piece's float64 buffers within the
    cache), :data:`.._device.DEVICE_CHUNK` elsewhere (few launches); where a sum
    is not contiguous (a convolution's weight sums are laid out channels last),
    a whole number of its rows (elements of one index of the first dimension, at
    least one row): :func:`preconditioned_noise_sums` reads the sums in their
    memory order, and puts each piece of ``p`` in that order as it converts it.
    """
    size = _device.CHUNK if _device.on_host(sums[0]) else _device.DEVICE_CHUNK
    for tensor in sums:
        if not tensor.is_contiguous() and tensor.dim() > 0:
            row = max(tensor[0].numel(), 1)
            size = max(row, size - size % row)
    return size


def _rows_order(tensor: Tensor) -> Optional[Tuple[int, ...]]:
    """The order of dimensions in which ``tensor`` is contiguous
    (:func:`~cockpit_gradnoise.functional.layout.dimension_order`) where the first comes
    first, so that a block of its rows is a block of memory; ``None`` where there is none."""
    if tensor.is_contiguous():
        return tuple(range(tensor.dim()))
    order = dimension_order(tensor)
    return order if order[0] == 0 and tensor.permute(order).is_contiguous() else None


def _copy_permuted(target: Tensor, source: Tensor) -> None:
    """``target.copy_(source)`` of a permuted ``source`` (a piece of ``p`` put in the sums'
    memory order). On the CPU, for float32 and float64, by NumPy's ``copyto``: the same
    numbers (a conversion to float64 is exact), in about half the time of torch's strided
    copy (a 3x3 convolution's piece read at a stride of 9 elements; ``benchmarks/README.md``)."""
    if _device.on_host(target) and source.dtype in _NUMPY_COPIED and not source.requires_grad:
        numpy.copyto(target.numpy(), source.numpy())
    else:
        target.copy_(source)


_NUMPY_COPIED = (torch.float32, torch.float64)


def _weighted_sums(weight_pieces: Iterable[Tensor], squares: Tensor, gradients: Tensor) -> Tensor:
    """``[sum_j (w_j T_j)^2, sum_j w_j^2 Q_j]`` in float64 (one tensor of two), with ``w`` in
    consecutive pieces of :func:`piece_size` elements over the flattened ``Q`` and ``T``.

    A sum over the elements, so taken in the memory order of ``Q`` and ``T``
    (:func:`_rows_order`; a convolution's channels last): their pieces are views, and
    each piece of ``w``, whole rows in the order of the elements, is put in that order by
    the copy that converts it to float64 (no copy of ``Q`` or ``T``).
    """
    order = _rows_order(squares)
    if order is None or _rows_order(gradients) != order:  # laid out otherwise: copied
        squares, gradients, order = squares.contiguous(), gradients.contiguous(), tuple(range(squares.dim()))
    shape, size = squares.shape, min(piece_size(squares, gradients), squares.numel())
    squares, gradients = squares.permute(order).reshape(-1), gradients.permute(order).reshape(-1)  # views
    weight_buffer = torch.empty((size,), dtype=torch.float64, device=squares.device)
    # Rows T^2 and Q of a piece: both sums in one product with w^2.
    sums_buffer = torch.empty((2, size), dtype=torch.float64, device=squares.device)
    # The views of a whole piece made once (every piece is whole but perhaps the last): on
    # the CPU each view is a torch call, several per piece of 2**17 elements otherwise.
    whole = (weight_buffer, sums_buffer, *sums_buffer.unbind())
    rows_shape = None if order == tuple(range(len(order))) else tuple(shape[d] for d in order[1:])
    totals, start = [], 0
    for piece in weight_pieces:
        count = piece.numel()
        stop = start + count
        if count == size:
            weight, sums, gradient_row, square_row = whole
        else:
            weight, sums = weight_buffer[:count], sums_buffer[:, :count]
            gradient_row, square_row = sums.unbind()
        if rows_shape is None:
            weight.copy_(piece.reshape(-1))
        else:  # whole rows (piece_size): the piece's elements put in the sums' memory order
            rows = piece.reshape(-1, *shape[1:])
            _copy_permuted(weight.view(len(rows), *rows_shape), rows.permute(order))
        gradient_row.copy_(gradients[start:stop]).square_()
        square_row.copy_(squares[start:stop])
        totals.append(torch.mv(sums, weight.square_()))
        start = stop
    if start != squares.numel():
        raise ValueError(f"the preconditioner's pieces cover {start} elements of {squares.numel()}")
    if not totals:
        return squares.new_zeros((2,), dtype=torch.float64)
    return totals[0] if len(totals) == 1 else torch.stack(totals).sum(0)
