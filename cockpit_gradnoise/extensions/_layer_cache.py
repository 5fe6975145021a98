"""One layer's work shared between the extensions that run on it in one hook.

BackPACK runs every active extension on a layer, one after the other, before
it goes on to the next layer; several of them may need the same intermediate
result (a sequence Linear's formed contributions, a normalization layer's
per-example contributions). The backward pass's :class:`LayerCache`
(``facts.recording().layer_cache``, :mod:`.facts`) keeps the result
computed for the first, for the others.

A stale result cannot be served: an entry is keyed on the layer and the
tensors it was computed from (``module.input0``, the output gradient), held
by weak reference and compared by identity (``is``, not ``id``, which a new
tensor may reuse) and by version (an in-place change bumps it), plus any
further hashable key (BackPACK's subsampling). A tensor that is gone, or
replaced, or modified, no longer matches. Each slot holds one entry, so at
most one layer's result per slot is kept alive.
"""

import weakref
from typing import Any, Dict, Hashable, Optional, Sequence

from torch import Tensor


def _versions(sources: Sequence[Any]) -> tuple:
    # Tensor._version counts in-place changes (autograd's own staleness check); modules
    # have none (asked directly: getattr on a module raises inside nn.Module.__getattr__).
    return tuple([source._version if isinstance(source, Tensor) else None for source in sources])


class _Key:
    """Weak references to the sources of a result, their versions and an extra key."""

    __slots__ = ("_refs", "_versions", "_extra")

    def __init__(self, sources: Sequence[Any], extra: Hashable):
        self._refs = tuple(map(weakref.ref, sources))
        self._versions = _versions(sources)
        self._extra = extra

    def matches(self, sources: Sequence[Any], extra: Hashable) -> bool:
        if len(sources) != len(self._refs):
            return False
        for ref, source in zip(self._refs, sources):
            if ref() is not source:
                return False
        return self._versions == _versions(sources) and self._extra == extra


class LayerCache:
    """Results computed from a layer's tensors, one entry per slot.

    ``sources``: the module and the tensors the result was computed from, in a
    fixed order; ``extra``: anything else it depends on.
    """

    def __init__(self):
        self._slots: Dict[Hashable, tuple] = {}

    def get(self, slot: Hashable, sources: Sequence[Any], extra: Hashable = None) -> Optional[Any]:
        """The result put in ``slot`` from these very ``sources`` and ``extra``, or ``None``."""
        entry = self._slots.get(slot)
        if entry is None or not entry[0].matches(sources, extra):
            return None
        return entry[1]

    def take(self, slot: Hashable, sources: Sequence[Any], extra: Hashable = None) -> Optional[Any]:
        """As :meth:`get`, and empty ``slot`` (for a result only one more reader needs)."""
        result = self.get(slot, sources, extra)
        self._slots.pop(slot, None)
        return result

    def put(self, slot: Hashable, sources: Sequence[Any], result: Any, extra: Hashable = None) -> None:
        """Keep ``result`` in ``slot``, replacing what it held."""
        self._slots[slot] = (_Key(sources, extra), result)
