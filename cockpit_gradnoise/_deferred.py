"""A step's statistics kept on the device until one transfer to the host.

On a GPU, every ``.item()``, ``float(tensor)`` or ``bool(tensor)`` makes the
host wait for the device. The quantities therefore form their statistics as
0-dim tensors left where the data is, with groups whose presence depends on
the data (:class:`Conditional`), and :func:`resolve` copies all of them to the
host at once, at the end of the step: one transfer per device and quantity
(:func:`transfer`, the only place where the host waits). Python numbers pass
through unchanged, so host paths that already have floats cost nothing here.
"""

from typing import Any, Dict, Iterator, List

import torch
from torch import Tensor


class Conditional:
    """Statistics that exist only when ``count > 0``, which the device knows first.

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
    by_device: Dict[torch.device, List[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    values = [0.0] * len(tensors)
    for indices in by_device.values():
        stacked = torch.stack(
            [tensors[i].detach().reshape(()).to(torch.float64) for i in indices]
        )
        for i, value in zip(indices, stacked.tolist()):
            values[i] = value
    return values


def resolve(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples, :class:`Conditional`) with every tensor a float.

    All tensors are copied by one :func:`transfer`; none when there are none.
    """
    tensors: List[Tensor] = []
    if not _collect(tree, tensors):
        return tree  # Python numbers only (the CPU paths): nothing to rebuild
    return _rebuild(tree, iter(transfer(tensors)))


def _collect(node, out) -> bool:
    """Append the tensors of ``node`` to ``out``; whether it holds a tensor or a Conditional."""
    if isinstance(node, Tensor):
        out.append(node)
        return True
    if isinstance(node, Conditional):
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
    if isinstance(node, Conditional):
        count = _rebuild(node.count, values)
        statistics = _rebuild(node.statistics, values)
        return statistics if count > 0 else {}
    if isinstance(node, dict):
        result = {}
        for key, value in node.items():
            rebuilt = _rebuild(value, values)
            if isinstance(value, Conditional):
                result.update(rebuilt)
            else:
                result[key] = rebuilt
        return result
    if isinstance(node, (list, tuple)):
        return type(node)(_rebuild(value, values) for value in node)
    return node
