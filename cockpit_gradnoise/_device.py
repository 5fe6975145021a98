"""Where a tensor lives decides its path; a step's statistics reach the host in one transfer.

The CPU paths use NumPy and go through large tensors in pieces; other
devices (GPUs) use torch on whole tensors and keep every result there.
:func:`on_host` tells the two apart, and it is the one place that does: the
tests set ``cockpit_gradnoise._device.on_host`` to ``lambda tensor: False``
(``monkeypatch.setattr``) to run the paths of other devices on CPU tensors.

On a GPU, every ``.item()``, ``float(tensor)`` or ``bool(tensor)`` makes the
host wait for the device. The quantities therefore form their statistics as
0-dim tensors left where the data is, with groups whose presence depends on
the data (:class:`PresentIfPositive`), and :func:`resolve` copies all of them
to the host at once, at the end of the step: one transfer per device and
quantity (:func:`transfer`, the only place where the host waits). Python
numbers pass through unchanged, so host paths that already have floats cost
nothing here.
"""

from typing import Any, Dict, Iterator, List, Tuple

import numpy
import torch
from torch import Tensor

#: Elements per piece in passes over all elements on the CPU: a piece's
#: temporaries stay small (fresh tensors the size of a layer cost more in page
#: faults than in work, and count in the quantities' peak memory), and large
#: enough that the calls' own overhead is small (2**15 was 40% slower on the
#: benchmark MLP; 2**17 to 2**22 within the noise; 2**20 added 4 MiB to the
#: MLP's peak).
CHUNK = 1 << 17

#: Elements per piece where other devices convert to float64
#: (:func:`float64_pieces`): 128 MiB of float64 at most, in few launches.
DEVICE_CHUNK = 1 << 24


def on_host(tensor: Tensor) -> bool:
    """Whether ``tensor`` takes the CPU paths (NumPy, pieces); other devices use torch.

    The one switch between the two: tests replace it to run the paths of other
    devices on CPU tensors. ``Tensor.is_cpu`` (``device.type == "cpu"``, without building
    a ``torch.device``: 0.08 us against 0.45 here, asked a few thousand times a step).
    """
    return tensor.is_cpu


def pieces(flat: Tensor) -> Tuple[Tensor, ...]:
    """A 1d tensor in pieces of :data:`CHUNK` elements on CPU; whole on other devices.

    On a GPU, pieces would only add launches.
    """
    return flat.split(CHUNK) if on_host(flat) and flat.numel() > CHUNK else (flat,)


def copied_without_waiting(tensor: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor copied to ``device``: on CUDA from pinned memory, without the host
    waiting (a copy from pageable memory synchronises the stream)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def float64_pieces(flat: Tensor) -> Iterator[Tensor]:
    """A 1d tensor as float64 copies of its pieces, on its device, each valid until the next.

    Never the whole tensor in float64 at once (8 bytes per element): pieces of
    :data:`CHUNK` elements on CPU, :data:`DEVICE_CHUNK` elsewhere, copied into
    one buffer (a fresh tensor per piece took 4x as long on CPU, in page
    faults). Converting to float64 is exact for every floating dtype up to
    float64.
    """
    size = CHUNK if on_host(flat) else DEVICE_CHUNK
    if flat.numel() <= size or flat.dtype == torch.float64:
        yield from (piece.double() for piece in flat.split(size))
        return
    buffer = torch.empty(size, dtype=torch.float64, device=flat.device)
    for piece in flat.split(size):
        yield buffer[: piece.numel()].copy_(piece)


def float64_total(flat: Tensor, *, skip_nan: bool = False) -> Tensor:
    """Sum of a 1d tensor's elements accumulated in float64: a 0-dim tensor on its device.

    By :func:`float64_pieces`; ``skip_nan`` leaves NaN out (``nansum``).
    """
    parts = [piece.nansum() if skip_nan else piece.sum() for piece in float64_pieces(flat)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def masked(flat: Tensor, mask: Tensor) -> Tensor:
    """``flat[mask]`` for 1d tensors; on CPU through NumPy, several times faster.

    Also leaner: ``torch.masked_select`` on CPU needs several times the
    input's memory for a moment.
    """
    if on_host(flat):
        # compress: ~3x faster than boolean indexing when many are kept.
        return torch.from_numpy(numpy.compress(mask.numpy(), flat.numpy()))
    return flat[mask]


class PresentIfPositive:
    """Statistics present only if ``count > 0``, which the device knows first.

    :func:`resolve` merges ``statistics`` into the dict that holds this object
    (whatever its key there) when the transferred ``count`` is positive, and
    leaves them out otherwise: e.g. the SNR of a layer whose every ``sd_j`` is
    0, or ratio statistics when every gradient element is 0.
    """

    def __init__(self, count, statistics: Dict[str, Any]):
        self.count = count
        self.statistics = statistics


def transfer(tensors: List[Tensor]) -> List[float]:
    """The values of 0-dim (or one-element) tensors as Python floats, in order.

    One copy per device holding any of them (CPU tensors cost no wait): the
    step's only host-device synchronisation.
    """
    # Grouped by device and dtype: one stack and one conversion per group (exact:
    # float64 holds every value of a narrower dtype), not one conversion per tensor,
    # which on a GPU is a kernel launch each.
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault((tensor.device, tensor.dtype), []).append(i)
    by_device: Dict[torch.device, Tuple[List[int], List[Tensor]]] = {}
    for (device, _), indices in groups.items():
        order, parts = by_device.setdefault(device, ([], []))
        order += indices
        parts.append(torch.stack([_scalar(tensors[i]) for i in indices]).to(torch.float64))
    values = [0.0] * len(tensors)
    for order, parts in by_device.values():
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)
        for i, value in zip(order, stacked.tolist()):
            values[i] = value
    return values


def _scalar(tensor: Tensor) -> Tensor:
    """``tensor`` as a 0-dim tensor without autograd history; itself where it is one
    already (most are: two dispatched ops less each, host time on every device)."""
    if tensor.dim() == 0 and not tensor.requires_grad:
        return tensor
    return tensor.detach().reshape(())


def resolve(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples, :class:`PresentIfPositive`) with every tensor a float.

    All tensors are copied by one :func:`transfer`; none when there are none.
    """
    tensors: List[Tensor] = []
    if not _collect(tree, tensors):
        return tree  # Python numbers only (the CPU paths): nothing to rebuild
    return _rebuild(tree, iter(transfer(tensors)))


#: Leaves that hold no tensor: most of a step's rows on the CPU, where every value is a float.
_NUMBERS = frozenset((float, int, bool, str, type(None)))


def _collect(node, out) -> bool:
    """Append the tensors of ``node`` to ``out``; whether it holds a tensor or a PresentIfPositive."""
    if type(node) in _NUMBERS:  # exact types: a fast path for the common leaves
        return False
    if type(node) is dict and all(map(_NUMBERS.__contains__, map(type, node.values()))):
        return False  # a row of plain numbers (tested in C: a few thousand values a step)
    if isinstance(node, Tensor):
        out.append(node)
        return True
    if isinstance(node, PresentIfPositive):
        _collect(node.count, out)
        _collect(node.statistics, out)
        return True
    found = False
    if isinstance(node, dict):
        for value in node.values():
            found = _collect(value, out) or found
    elif isinstance(node, (list, tuple)):
        for value in node:
            found = _collect(value, out) or found
    return found


def _rebuild(node, values: Iterator[float]):
    if isinstance(node, Tensor):
        return next(values)
    if isinstance(node, PresentIfPositive):
        count = _rebuild(node.count, values)
        statistics = _rebuild(node.statistics, values)
        return statistics if count > 0 else {}
    if isinstance(node, dict):
        result = {}
        for key, value in node.items():
            rebuilt = _rebuild(value, values)
            if isinstance(value, PresentIfPositive):
                result.update(rebuilt)
            else:
                result[key] = rebuilt
        return result
    if isinstance(node, (list, tuple)):
        return type(node)(_rebuild(value, values) for value in node)
    return node
