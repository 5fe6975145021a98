"""Which sums of squares underflow lost: the check that keeps them from reporting a wrong number.

A square below the smallest normal number of its dtype (``tiny``: ``1.2e-38`` in
float32, ``2.2e-308`` in float64) keeps fewer digits, and one below half the
smallest subnormal is 0. Where every square of an element's contributions is
that small, ``S_j = sum_i x_ij**2`` is 0 or subnormal although the
contributions are real, and the one-pass formula would report ``sd_j = 0`` and
the SNR cap ("the examples agree to rounding") where the exact SNR is of
order 1; a per-example squared norm would be 0 for an example whose gradient
is not.

The bound. With gradual underflow (IEEE 754, torch's default: subnormals are
not flushed) each square, and each addition, that lands below ``tiny`` is off
by at most half the smallest subnormal, ``tiny * eps / 2``; so ``k`` terms'
sum is off by at most ``k tiny eps`` from underflow. That is at most ``eps / 4``
of the sum wherever the sum is at least :func:`underflow_floor`, ``4 k tiny``:
within the rounding the formulas already allow. A sum below it that is not an
exact 0 of exact zeros cannot be told from what underflow left of it:
*unresolved*. The extensions that form squares at a power-of-two scale also
write :data:`UNRESOLVED` (a positive number below every floor) where the
scaled sums are unresolved, so that the unscaled sums show it
(``extensions/_squares.py``); the quantities leave a parameter with an
unresolved element out, naming it (:func:`unresolved_sums`,
:func:`unresolved_norms`).
"""

from typing import List, Optional, Sequence, Union

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.functional.layout import memory_order

import numpy
import torch
from torch import Tensor

#: What an extension writes in place of a sum of squares that underflow left
#: unresolved: the smallest positive float64 (and, converted, float32) number,
#: below every :func:`underflow_floor`, so the quantities' checks find it.
UNRESOLVED = 5e-324


def underflow_floor(terms: int, dtype: torch.dtype) -> float:
    """``4 k tiny``: the smallest sum of ``k = terms`` squares formed in ``dtype``
    that underflow cannot have moved by more than ``eps / 4`` of itself."""
    return 4.0 * max(terms, 1) * torch.finfo(dtype).tiny


def unresolved_sums(squares: Tensor, total: Tensor, n: int, loss_scale: float = 1.0) -> Optional[Union[int, Tensor]]:
    """How many elements have ``S_j = sum_i x_ij**2`` that underflow may have lost: on
    the CPU an int, ``None`` for none; elsewhere a 0-dim tensor (the host does not wait).

    ``S_j`` below the floor while ``S_j != 0`` or ``T_j = sum_i x_ij != 0``
    (an exact 0 of exact zeros, ``S_j = T_j = 0``, is a dead unit and resolved).

    Args:
        squares: ``S``, in the dtype its squares were formed in, or wider
            (float64 sums of float32 squares formed at a power-of-two scale,
            where the extension wrote :data:`UNRESOLVED` for squares that
            underflowed at that scale: float64 holds every other).
        total: ``T``, shaped like ``squares``.
        n: ``N``, the terms of each ``S_j``.
        loss_scale: ``c`` where the sums are in units of ``g_i`` (``S / c**2``).

    From wider sums, :func:`~cockpit_gradnoise.functional.gradient_sd` forms sd
    without underflow (in the wide dtype where the narrow one would lose an element).
    """
    floor = underflow_floor(n, squares.dtype) / loss_scale**2
    if not _device.on_host(squares):  # a 0-dim tensor: the host does not wait for it here
        return lost_to_underflow(squares, floor, squares, total).sum()
    # In NumPy: several times faster than torch's comparisons here (a layer of 2.4M
    # elements, most of them dead units: 1.2 ms against 6 ms, 32 ms by a boolean mask).
    # In memory order (a view): a convolution's permuted sums are read in order, not by strides.
    squares = memory_order(squares.detach())
    s = (squares.numpy() if squares.dtype in _PLAIN else squares.double().numpy()).reshape(-1)
    # Counted in pieces: no mask of the layer's size (VGG-11's classifier weight: 103M
    # elements, half of them dead units, three masks of 0.1 GB of fresh pages each).
    below = order_statistics.count_where(s, numpy.less, floor)
    if not below:  # one comparison per element: all a layer without dead units costs
        return None
    # Where a layer has dead units (S = T = 0, all below): the others below are unresolved.
    total = memory_order(total.detach())
    t = (total.numpy() if total.dtype in _PLAIN else total.double().numpy()).reshape(-1)
    return below - _dead_count(s, t) or None


def _dead_count(s: numpy.ndarray, t: numpy.ndarray) -> int:
    """The number of ``j`` with ``s_j = t_j = 0``, of 1d arrays of one size, in pieces."""
    piece = order_statistics.COUNT_PIECE
    return sum(int(numpy.count_nonzero((s[k : k + piece] == 0) & (t[k : k + piece] == 0)))
               for k in range(0, s.size, piece))


_PLAIN = (torch.float32, torch.float64)


def unresolved_norms(squared_norms: Tensor, numel: int, loss_scale: float = 1.0) -> Optional[Union[int, Tensor]]:
    """How many examples have a squared norm ``||x_i||^2`` that underflow may have lost
    (as :func:`unresolved_sums` counts).

    Non-zero and below the floor of ``numel`` terms in the norms' dtype. A norm
    of exactly 0 is an example without a gradient there (a token routed
    elsewhere); where an extension formed squares in float32 (at a scale or
    not) and saw them underflow, or a norm of 0 beside nonzero contributions,
    it wrote :data:`UNRESOLVED` (the norms of float32 parameters are saved in
    float64, where no square of a float32 contribution underflows).

    Args:
        squared_norms: ``[N]``.
        numel: The parameter's elements (terms of each norm).
        loss_scale: ``c`` where the norms are in units of ``g_i``.
    """
    floor = underflow_floor(numel, squared_norms.dtype) / loss_scale**2
    count = ((squared_norms != 0) & (squared_norms < floor)).sum()
    return (int(count) or None) if _device.on_host(squared_norms) else count


def unresolved_norm_sum(squared_norms: Tensor, numel: int) -> Optional[Union[int, Tensor]]:
    """Whether ``sum_i ||x_i||^2`` may be off by more than ``eps / 4`` of itself for
    underflow (1; where not, ``None`` on the CPU and 0 elsewhere): some norm is
    unresolved (:func:`unresolved_norms`) and the sum is below ``N`` floors (each
    unresolved norm is off by less than one floor)."""
    floor = underflow_floor(numel, squared_norms.dtype)
    lost = (squared_norms != 0) & (squared_norms < floor)
    small = squared_norms.sum(dtype=torch.float64) < len(squared_norms) * floor
    found = lost.any() & small
    return (int(found) or None) if _device.on_host(squared_norms) else found.to(torch.int64)


def lost_to_underflow(at_scale: Tensor, floor, squares: Tensor, total: Tensor) -> Tensor:
    """Where a sum of squares ``S_j`` may have lost squares to underflow.

    Elementwise,

    .. math::

        a_j < \\text{floor} \\ \\text{and} \\ (S_j \\ne 0 \\ \\text{or} \\ T_j \\ne 0),

    ``a`` the sums as formed (at a scale, or ``S`` itself), ``T_j = sum_i x_ij``: an exact 0 of
    exact zeros (``S_j = T_j = 0``) is a dead unit, resolved. ``floor``: a number, or a tensor
    broadcast against ``at_scale``. Four launches."""
    return (at_scale < floor) & ((squares != 0) | (total != 0))


def unresolved_sums_of_segments(squares: Tensor, total: Tensor, lengths: Tensor, n: int) -> Tensor:
    """:func:`unresolved_sums` (``loss_scale`` 1) of several tensors' sums joined, on other devices
    than the CPU: ``[P]`` int64 counts, each run of ``lengths[k]`` consecutive elements one
    tensor's (``lengths`` as :func:`~cockpit_gradnoise.functional.gradient_sd_of_many` takes
    them); the same counts, from float64 sums of the marks (exact), in a few launches for all."""
    lost = lost_to_underflow(squares, underflow_floor(n, squares.dtype), squares, total)
    return torch.segment_reduce(lost.to(torch.float64), "sum", lengths=lengths, unsafe=True).to(torch.int64)


def marked_lost(unscaled: Tensor, at_scale: Tensor, floor, rows: Optional[Tensor] = None) -> Tensor:
    """Squared norms marked :data:`UNRESOLVED` where they may have lost squares to underflow.

    ``unscaled``: float64 norms from ``at_scale``, formed in a narrower dtype;

    .. math::

        r_i = \\min(r_i + m_i, \\text{UNRESOLVED}) \\text{ where } a_i < \\text{floor}, \\quad r_i \\text{ elsewhere},

    ``a`` the norms at their scale, ``m`` their examples' row magnitudes (``0`` without
    ``rows``). A sum of squares is ``>= 0``, so below the floor ``r`` is 0 or at least the
    smallest positive float64, which is UNRESOLVED: the cap marks exactly the nonzero ones and
    leaves a 0 a 0. With ``rows`` (``>= 0``, float32: a positive one is above UNRESOLVED), a 0
    beside nonzero rows is marked too. A NaN (in a norm or a row) is not below the floor, or
    stays NaN: kept. ``floor``: a number, or a tensor broadcast against ``at_scale``
    (one floor per row). Three launches, four with ``rows``."""
    capped = unscaled if rows is None else unscaled + rows
    return torch.where(at_scale < floor, capped.clamp(max=UNRESOLVED), unscaled)


def floors_of(numels: Sequence[int], dtype: torch.dtype, device: torch.device,
              loss_scale: float = 1.0, times: int = 1, compared_in: Optional[torch.dtype] = None) -> Tensor:
    """``[P]``: ``times * underflow_floor(numel, dtype) / loss_scale**2`` of each ``numel`` (a
    Python float, as the checks of one tensor form it), rounded to ``compared_in`` (``dtype``
    by default) as a Python number is where a tensor of that dtype is compared with it; on
    ``device``, the host not waiting."""
    floors = [times * underflow_floor(n, dtype) / loss_scale**2 for n in numels]
    return _device.copied_without_waiting(torch.tensor(floors, dtype=compared_in or dtype), device)


def unresolved_norms_of_rows(table: Tensor, floors: Tensor) -> Tensor:
    """:func:`unresolved_norms` of each row of a ``[P, N]`` table of squared norms (each
    parameter's batch), with each row's floor (``floors`` ``[P]``, in the table's dtype, as
    a Python floor is compared in it): ``[P]`` int64 counts, a few launches for all rows."""
    return ((table != 0) & (table < floors[:, None])).sum(1)


def counts_of_rows(counts: Tensor) -> List[Optional[Union[int, Tensor]]]:
    """Each row's count of :func:`unresolved_norms_of_rows` or :func:`unresolved_norm_sums_of_rows`
    as one parameter's check gives it: on the CPU an int, ``None`` for none (one ``tolist``
    for all rows); elsewhere a 0-dim tensor, the host not waiting."""
    if _device.on_host(counts):
        return [count or None for count in counts.tolist()]
    return list(counts.unbind())


def unresolved_norm_sums_of_rows(table: Tensor, floors: Tensor, sum_floors: Tensor) -> Tensor:
    """:func:`unresolved_norm_sum` of each row of a ``[P, N]`` table: ``[P]`` int64, 1 where
    some norm of the row is below its floor (``floors``, in the table's dtype) and not 0,
    and the row's float64 sum below ``sum_floors`` (``N`` floors, float64). The sums are
    the rows' float64 sums in another order than one row's: they may differ by rounding,
    far inside the bound's slack (each unresolved norm is off by under one floor)."""
    lost = ((table != 0) & (table < floors[:, None])).any(1)
    small = table.sum(1, dtype=torch.float64) < sum_floors
    return (lost & small).to(torch.int64)
