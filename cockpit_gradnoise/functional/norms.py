"""Norms: squared norms accumulated in float64, their ratios, and per-example norm statistics."""

import math
from typing import Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.logs import schema

import numpy
import torch
from torch import Tensor


def scalar(tensor: Tensor):
    """A one-element tensor as a Python float on the CPU (no wait there); on
    other devices the tensor itself, left there for the step's one transfer
    (:func:`cockpit_gradnoise._device.resolve`)."""
    return tensor.item() if _device.on_host(tensor) else tensor


def norm_ratio(squared_numerator, squared_denominator):
    """``sqrt(a) / sqrt(b)`` (:func:`~cockpit_gradnoise.logs.schema.ratio_or_inf`), floats or tensors."""
    if isinstance(squared_numerator, Tensor):
        return schema.ratio_or_inf(squared_numerator.sqrt(), squared_denominator.sqrt())
    return schema.ratio_or_inf(math.sqrt(squared_numerator), math.sqrt(squared_denominator))


#: The dtypes NumPy takes from torch as they are.
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
#: :func:`squared_norm` of at most this many elements on the CPU is one NumPy dot
#: (8 us against 62 for the torch calls, on a 128-element bias here); below
#: OpenBLAS's threshold for threads in a dot (10,000).
NUMPY_NORM_AT_MOST = 1 << 13


def _squared_norm_by_pieces(flat: Tensor) -> Tensor:
    """``sum_j flat_j**2`` of a 1-d tensor as a 0-dim float64 tensor on its device: dot
    products of float64 copies of its pieces (:func:`~cockpit_gradnoise._device.float64_pieces`:
    never all of it in float64 at once), added."""
    parts = [torch.dot(piece, piece) for piece in _device.float64_pieces(flat)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _squared_norms_foreach(tensors: Sequence[Tensor], device) -> Tensor:
    """``||t||^2`` of each of ``tensors`` as one float64 vector on ``device``: their norms
    by one ``torch._foreach_norm`` in float64 (fused on a GPU; on the CPU it converts each
    tensor to float64 in turn), squared: two roundings more than a sum of squares."""
    norms = torch._foreach_norm(list(tensors), dtype=torch.float64)
    return torch.stack([norm.to(device) for norm in norms]).square_()


def squared_norm(tensor: Tensor, *, defer: bool = False) -> float:
    """``sum_j tensor_j**2``, accumulated in float64, as a Python float.

    Dot products of float64 copies of pieces of the tensor
    (:func:`~cockpit_gradnoise._device.float64_pieces`: never all of it in
    float64 at once). Squares of float32 and narrower values are exact in
    float64, so only the sum rounds: the result is off by at most
    ``n 2**-53`` relative for ``n`` elements (``(n + 1) 2**-53`` for float64
    input), whatever order the CPU's kernels add in (Higham 2002, ch. 4):
    ``1.1e-10`` for a million elements. A float32 dot product's error depends
    on the CPU's kernel (``1e-6`` to ``1e-5`` relative on a million elements).

    With ``defer``, on other devices than the CPU: a 0-dim float64 tensor
    left on the device (the same number).
    """
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= NUMPY_NORM_AT_MOST and _device.on_host(flat) and flat.dtype in _NUMPY_FLOATS:
        # One NumPy float64 dot: a few torch calls cost more than the work on a
        # small tensor (a bias, a norm's weight).
        values = flat.numpy().astype(numpy.float64)
        return float(numpy.dot(values, values))
    result = _squared_norm_by_pieces(flat)
    if defer and not _device.on_host(flat):
        return result
    return result.item()


def norm_tensor(tensor: Tensor) -> Tensor:
    """``sqrt(sum_j tensor_j**2)`` accumulated in float64: a 0-dim float64 tensor on the
    tensor's device (no wait for the host), what a gradient hook keeps.

    One ``vector_norm`` in float64 for a tensor of at most
    :data:`~cockpit_gradnoise._device.CHUNK` elements on the CPU and for any tensor on
    other devices. A larger CPU tensor goes by dot products of float64 pieces
    (:func:`~cockpit_gradnoise._device.float64_pieces`): on the CPU ``vector_norm(dtype=
    torch.float64)`` first copies the whole tensor to float64 (50M elements: 288 ms and
    383 MB more at the peak, against 39 ms and 5.75 MB by pieces). Its square is within
    :func:`squared_norms`' bound: ``n 2**-53`` relative for ``n`` elements, and two
    roundings more (the square root and the square).
    """
    flat = tensor.detach().reshape(-1)
    if _device.on_host(flat) and flat.numel() > _device.CHUNK:
        return _squared_norm_by_pieces(flat).sqrt()
    return torch.linalg.vector_norm(flat, dtype=torch.float64)


def squared_norm_tensors(tensors: Sequence[Tensor]) -> Tensor:
    """The squares of :func:`norm_tensor` of ``tensors`` (at least one): a float64 vector on
    the first's device.

    The tensors of at most :data:`~cockpit_gradnoise._device.CHUNK` elements (every tensor
    on other devices than the CPU) in one ``torch._foreach_norm`` (fused on a GPU), the
    larger CPU ones by pieces.
    """
    device = tensors[0].device
    large = [_device.on_host(t) and t.numel() > _device.CHUNK for t in tensors]
    if not any(large):  # all in one call, in their order
        return _squared_norms_foreach([t.detach() for t in tensors], device)
    squares = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    rest = [i for i, is_large in enumerate(large) if not is_large]
    if rest:
        found = _squared_norms_foreach([tensors[i].detach() for i in rest], device)
        squares.index_copy_(0, torch.tensor(rest, device=device), found)
    for i in (i for i, is_large in enumerate(large) if is_large):
        squares[i] = norm_tensor(tensors[i]).to(device).square()
    return squares


def divided_squared_norms(tensors: Sequence[Tensor], divisor: float) -> Tensor:
    """``||t / divisor||^2`` of each of ``tensors`` (at least one, on one device, none on the
    CPU's paths) as a float64 vector there, for other devices than the CPU: in groups of at most
    :data:`~cockpit_gradnoise._device.DEVICE_CHUNK` elements (a larger tensor alone), one
    ``torch._foreach_div`` (no quotients where ``divisor`` is 1) and one ``torch._foreach_norm``
    each (fused on a GPU), never every quotient at once; a tensor narrower than float32 is
    converted to float32 with its group (exact).

    Each quotient is rounded in its tensor's dtype (float32 for a narrower one), as ``t / divisor``
    rounds it; its squares are
    exact in float64, and only their sum rounds: with the norm's square root and square, within
    ``(n + 2) 2**-53`` relative of the exact squared norm of the quotients for ``n`` elements
    (:func:`squared_norm`'s ``n 2**-53``, two roundings more).
    """
    norms: List[Tensor] = []
    group: List[Tensor] = []
    size = 0
    for tensor in [t.detach() for t in tensors] + [None]:
        if group and (tensor is None or size + tensor.numel() > _device.DEVICE_CHUNK):
            group = [t.to(torch.promote_types(t.dtype, torch.float32)) for t in group]
            quotients = torch._foreach_div(group, divisor) if divisor != 1.0 else group
            norms += torch._foreach_norm(quotients, dtype=torch.float64)
            group, size = [], 0
        if tensor is not None:
            group.append(tensor)
            size += tensor.numel()
    return torch.stack(norms).square_()


def squared_norms(tensors: Sequence[Tensor], *, defer: bool = False) -> List:
    """:func:`squared_norm` of each of ``tensors``, the small ones on the CPU in one call.

    The CPU tensors of at most :data:`~cockpit_gradnoise._device.CHUNK` elements go
    through one ``torch._foreach_norm`` in float64 (no Python per tensor; it converts
    each tensor to float64 in turn, at most 1 MiB), whose norms are squared: two more
    roundings than :func:`squared_norm`'s sum (``2**-52`` relative), and the same
    bound ``n 2**-53`` otherwise. A network's layers, biases and norms' weights took
    half the time of :func:`squared_norm` per tensor (49 tensors of the benchmark GPT,
    825k elements: 1.3 ms for both the weights and the gradients, against 2.7). With
    ``defer``, the plain tensors of other devices likewise, one call per device (fused: no
    float64 copies, a launch or so for all, where a copy and a ``dot`` each took two). The
    others (larger CPU tensors, subclasses such as DTensor) are :func:`squared_norm`'s.

    Returns:
        One Python float per tensor (with ``defer``, on other devices: a 0-dim float64
        tensor left there).
    """
    flats = [tensor.detach().reshape(-1) for tensor in tensors]
    # Plain tensors only: a DTensor (tensor parallelism, FSDP2) is normed by its own rules.
    small = [i for i, flat in enumerate(flats) if type(flat) is Tensor and _device.on_host(flat)
             and flat.numel() <= _device.CHUNK and flat.dtype in _NUMPY_FLOATS]
    results: List = [None] * len(flats)
    if small:
        found = _squared_norms_foreach([flats[i] for i in small], flats[small[0]].device)
        for i, squared in zip(small, found.tolist()):
            results[i] = squared
    if defer:  # other devices: every plain tensor of a device in one _foreach_norm, left there
        by_device: Dict[torch.device, List[int]] = {}
        for i, flat in enumerate(flats):
            if results[i] is None and type(flat) is Tensor and not _device.on_host(flat) \
                    and flat.dtype.is_floating_point:
                by_device.setdefault(flat.device, []).append(i)
        for device, indices in by_device.items():
            for i, squared in zip(indices, _squared_norms_foreach([flats[i] for i in indices], device).unbind()):
                results[i] = squared
    for i, flat in enumerate(flats):
        if results[i] is None:
            results[i] = squared_norm(flat, defer=defer)
    return results


def per_example_norm_statistics(
    squared_norms: Tensor, levels: Sequence[float], *, defer: bool = False
) -> Dict[str, float]:
    """Statistics over a batch of per-example gradient norms.

    Args:
        squared_norms: ``||g_i||^2`` for each example, shape ``[N]``.
        levels: Quantile levels.
        defer: Leave the results on the device as 0-dim tensors (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).

    Returns:
        ``q<level>``, ``mean`` and ``max`` of ``||g_i||``.
    """
    norms = squared_norms.detach().clamp(min=0).sqrt_()
    values = order_statistics.quantile_summary(norms, levels, defer=True) + [scalar(norms.max())]
    result = dict(zip(schema.norm_statistic_names(levels), values))
    return result if defer else _device.resolve(result)


def per_example_norm_statistics_of_rows(squared_norms: Tensor, levels: Sequence[float]) -> List[Tensor]:
    """:func:`per_example_norm_statistics` of each row of ``squared_norms`` at once.

    The per-example squared norms of many parameters (or micro-batches) that share
    one batch, stacked ``[R, N]`` (``N >= 1``): one sort of the table and vector ops
    over its rows, a constant number of ops whatever ``R``
    (:mod:`~cockpit_gradnoise.order_statistics.rows`). Per row the same numbers: the
    quantiles of ``||g_i||`` as ``numpy.quantile`` (bit for bit), the mean summed
    in float64 (to rounding: another order of addition) and the max (NaN where a
    row holds NaN, as ``Tensor.max``).

    Returns:
        One float64 column ``[R]`` per name of
        :func:`~cockpit_gradnoise.logs.schema.norm_statistic_names` (quantiles in
        level order, ``mean``, ``max``), left on the table's device.
    """
    norms = squared_norms.detach().clamp(min=0).sqrt_()
    quantiles = order_statistics.quantiles_of_sorted_rows(order_statistics.sorted_rows(norms), levels)
    mean = norms.sum(dim=1, dtype=torch.float64) / norms.shape[1]
    return quantiles + [mean, norms.amax(dim=1).double()]


def stacked_by_dtype(tensors: Sequence) -> Optional[List[Tuple[List[int], Tensor]]]:
    """``[(indices, torch.stack(those tensors))]``, one group per dtype in order of first
    appearance, where ``tensors`` are plain tensors of one shape and device (a batch's
    per-example norms of each parameter, each parameter's 0-dim sums); ``None``
    otherwise (none, a number, a DTensor), for the caller's path of one tensor at a
    time. Stacking copies: the values are exact, each in its own dtype."""
    if not tensors or any(type(t) is not Tensor for t in tensors):
        return None
    first = tensors[0]
    if any(t.shape != first.shape or t.device != first.device for t in tensors):
        return None
    groups: Dict[torch.dtype, List[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(i)
    return [(indices, torch.stack([tensors[i].detach() for i in indices])) for indices in groups.values()]


def rows_of_columns(names: Sequence[str], columns: Sequence[Tensor]) -> List[Dict[str, float]]:
    """``[{name: column[r]} for each row r]`` of columns of equal length ``R``.

    On the CPU floats (one stack and one ``tolist``); on other devices 0-dim tensors
    left there (views, no kernel), for the step's one transfer
    (:func:`~cockpit_gradnoise._device.resolve`).
    """
    if _device.on_host(columns[0]):
        table = torch.stack([column.double() for column in columns], dim=1).tolist()
        return [dict(zip(names, row)) for row in table]
    return [dict(zip(names, row)) for row in zip(*(column.unbind() for column in columns))]
