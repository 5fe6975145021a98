"""How far one optimizer step moves each layer: a two-step quantity.

Stored under Cockpit's key ``"UpdateSize"``, so Cockpit's own Distance panel
reads it. That panel turns a value into a number with
``_root_sum_of_squares(x) if type(x) == list else x``: a float, or a plain
``list`` whose items it squares and sums; anything else (a dict, a list
subclass, an object) breaks it or is plotted as categories. The stored value is
therefore a plain list with one :class:`LayerUpdate` per parameter, as
Cockpit's own ``UpdateSize`` stores one norm per parameter: an item squares
to its norm squared, and also keeps the parameter's name and ``||theta(s)||``.
:func:`~cockpit_gradnoise.to_frame` reads the list through
:meth:`LayerUpdate.statistics_of_list`, and json_tricks (``Cockpit.write``)
round-trips the items through ``__json_encode__``/``__json_decode__``.
"""

import math
from typing import Dict, List, Sequence

from cockpit_gradnoise import _device, distributed, functional
from cockpit_gradnoise.extensions import sharded
from cockpit_gradnoise.logs.schema import decode_float, encode_float, update_statistics
from cockpit_gradnoise.quantities._two_step import TwoStepParameterQuantity

import torch


class LayerUpdate:
    """One parameter's update in one optimizer step.

    Behaves as the number ``norm`` where Cockpit expects one (``float()``,
    ``** 2``).

    Attributes:
        name: The parameter's name.
        norm: ``||theta(s+1) - theta(s)||``.
        start_norm: ``||theta(s)||``.
    """

    def __init__(self, name: str, norm: float, start_norm: float):
        self.name = str(name)
        self.norm = float(norm)
        self.start_norm = float(start_norm)

    def __float__(self) -> float:
        return self.norm

    def __pow__(self, exponent):
        # Cockpit's Distance panel squares the items of the stored list.
        return self.norm**exponent

    @staticmethod
    def statistics_of_list(updates: Sequence["LayerUpdate"]) -> Dict[str, Dict[str, float]]:
        """``{name: {"norm": ..., "relative": ...}}`` plus ``"all"`` for the network.

        :func:`cockpit_gradnoise.logs.schema.update_statistics`, the one formula that
        live items and logged ones (read without torch) share.
        """
        return update_statistics(updates)

    def __json_encode__(self):
        return {
            "name": self.name,
            "norm": encode_float(self.norm),
            "start_norm": encode_float(self.start_norm),
        }

    def __json_decode__(self, name, norm, start_norm, **unused):
        self.__init__(name, decode_float(norm), decode_float(start_norm))

    def __repr__(self):
        return f"LayerUpdate({self.name!r}, norm={self.norm!r}, start_norm={self.start_norm!r})"


class UpdateSize(TwoStepParameterQuantity):
    """How far does each step move each layer, absolutely and relative to its size?

    Under step ``s`` it stores the update of one optimizer step,
    ``theta(s+1) - theta(s)``, where ``theta(k)`` is the parameters' state when
    the cockpit is called at step ``k``. Per parameter and for ``"all"``:
    ``norm = ||theta(s+1) - theta(s)||`` and ``relative = norm / ||theta(s)||``
    (``inf`` when ``theta(s)`` is all zero, never NaN).

    A value is stored for ``s`` only if the schedule selects ``s`` and the
    cockpit is called at both ``s`` and ``s + 1``; otherwise nothing is stored
    for ``s`` and the cached parameters are dropped at the next call. So a
    start without an end, an end without a tracked start, a schedule that
    skips steps and a loop that calls the cockpit every other step store
    nothing wrong and keep nothing behind.

    Memory: one copy of the parameters, taken without autograd history on the
    parameters' device (or on the CPU with ``cache_on_cpu=True``), and
    reused from step to step (no new allocation when tracking every step).
    No BackPACK extension, no ``info``.

    The stored value is a list of :class:`LayerUpdate` under Cockpit's key
    ``"UpdateSize"``: Cockpit's Distance panel shows its network norm, and
    :func:`~cockpit_gradnoise.to_frame` gives the named rows. It replaces
    Cockpit's own ``UpdateSize`` (same key): use one of the two.

    Args:
        track_schedule: Function from step to bool: the start steps ``s``.
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
        cache_on_cpu: Keep the copy of the parameters in CPU memory (for
            models whose second copy does not fit on the accelerator); each
            layer is then moved to the CPU in turn to measure the update.
    """

    #: Under FSDP2 the copy is sharded like the parameters, and each process's sums of
    #: squares over its shards are added across processes (one all_reduce).
    supports_fsdp2 = True
    supports_hsdp = True
    #: Under tensor parallelism the same: a split parameter's shards add, a replicated one
    #: (and a plain tensor) is counted once.
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True

    def __init__(self, track_schedule, *, param_names=None, verbose=False, cache_on_cpu=False):
        super().__init__(track_schedule, param_names=param_names, verbose=verbose)
        self.cache_on_cpu = bool(cache_on_cpu)

    def start(self, params, reuse) -> List[torch.Tensor]:
        """A copy of ``params``, in ``reuse``'s tensors where they fit."""
        reuse = reuse or []
        return [
            self._copy_into(reuse[i] if i < len(reuse) else None, param)
            for i, param in enumerate(params)
        ]

    def end(self, cache, params, names) -> List[LayerUpdate]:
        """One :class:`LayerUpdate` per parameter; overwrites ``cache`` with the update."""
        squares = _squares_together(cache, params)
        if squares is None:
            squares = []
            for buffer, param in zip(cache, params):
                # FSDP2: this process's shard of each (the sums of squares add across processes).
                buffer, param = sharded.local_tensor(buffer), sharded.local_tensor(param.detach())
                start = functional.squared_norm(buffer, defer=True)
                # The cache is overwritten next or dropped: reuse it for the difference.
                difference = buffer.sub_(param.to(buffer.device))
                squares.append((functional.squared_norm(difference, defer=True), start))
        # On a GPU: the step's one transfer, for every layer at once.
        squares = _device.resolve(squares)
        if any(type(p).__name__ == "DTensor" for p in params):
            # A shard's copies (HSDP's replicate dimension, a replicated or plain tensor
            # under tensor parallelism) counted once.
            squares = [pair if sharded.counted_here(p) else (0.0, 0.0) for pair, p in zip(squares, params)]
            squares = _summed_over_processes(squares)
        return [
            LayerUpdate(name, math.sqrt(norm_sq), math.sqrt(start_sq))
            for name, (norm_sq, start_sq) in zip(names, squares)
        ]

    def cache_matches(self, cache, params) -> bool:
        """Whether the cache holds one tensor per parameter, shaped alike."""
        if len(cache) == len(params) and all(b.shape == p.shape for b, p in zip(cache, params)):
            return True
        self.warn_once(
            "changed-parameters",
            "the parameters changed shape or number between two steps; no update "
            "size is stored for that step",
        )
        return False

    def cache_state(self, cache) -> List[torch.Tensor]:
        """A copy of the cached parameters (the cache is overwritten at the next step)."""
        return [tensor.detach().clone() for tensor in cache]

    def cache_from_state(self, state) -> List[torch.Tensor]:
        """The saved parameters, on the parameters' device (the CPU with ``cache_on_cpu``)."""
        params = self.known_params or []
        return [tensor.to(torch.device("cpu") if self.cache_on_cpu or i >= len(params)
                          else params[i].device, copy=True)
                for i, tensor in enumerate(state)]

    def cached_tensors(self) -> List[torch.Tensor]:
        """The cached copy of the parameters (empty when none)."""
        return list(self._cache or [])

    def cached_bytes(self) -> int:
        """Bytes held by the cached copy of the parameters (0 when none)."""
        return sum(t.numel() * t.element_size() for t in self.cached_tensors())

    def _copy_into(self, buffer, param):
        """``param``'s values in ``buffer`` if it fits, else in a new tensor."""
        source = param.detach()
        device = torch.device("cpu") if self.cache_on_cpu else source.device
        if (
            buffer is None
            or buffer.shape != source.shape
            or buffer.dtype != source.dtype
            or buffer.device != device
        ):
            return source.to(device=device, copy=True)
        return buffer.copy_(source)


def _squares_together(cache, params):
    """``[(||theta(s+1) - theta(s)||^2, ||theta(s)||^2)]``, ``cache`` overwritten by the updates,
    where every buffer and parameter is a plain tensor on one device other than the CPU: both
    norms of all parameters by one float64 ``_foreach_norm`` each and the updates by one
    ``_foreach_sub_`` (a few launches for all, not five a parameter; the norms within
    :func:`~cockpit_gradnoise.functional.squared_norms`' bound); else ``None``."""
    tensors = list(cache) + [param.detach() for param in params]
    if not cache or len(cache) != len(params) or any(type(t) is not torch.Tensor for t in tensors) \
            or _device.on_host(tensors[0]) or len({t.device for t in tensors}) != 1:
        return None
    starts = functional.squared_norm_tensors(cache)
    torch._foreach_sub_(list(cache), tensors[len(cache):])
    return list(zip(functional.squared_norm_tensors(cache).unbind(), starts.unbind()))


def _summed_over_processes(squares):
    """``[(norm_sq, start_sq)]`` of the processes' shards, added (one all_reduce, float64)."""
    total = torch.tensor(squares, dtype=torch.float64).reshape(-1, 2)
    distributed.all_reduce_([total])
    return [tuple(row) for row in total.tolist()]
