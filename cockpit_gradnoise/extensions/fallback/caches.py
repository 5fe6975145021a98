"""A key/value cache of ``transformers`` a module's call filled from empty: left out of its recomputation.

Hugging Face's causal LMs create a ``DynamicCache`` in every forward pass where
``config.use_cache`` is true (the default), in training mode too, and hand it to each
attention module, whose forward appends its keys and values (``cache.update(k, v,
layer_idx)``) and attends over what ``update`` returns. The fallback's recomputation of
such a module per example (GraniteMoE-SWA's attention, for its ``sinks``) would find
the batch's keys already there. Where the layers this call updated held nothing before it
(a cache created by this forward pass), ``update`` returned exactly the keys and values
the call gave it (``torch.cat`` of nothing and them; a sliding-window layer returns
the full states too), so the recomputation with no cache (``None``, which these modules
read as "attend over this call's keys") computes the same function: exact. Only the
dynamic layers of ``transformers`` (:data:`DYNAMIC_LAYERS`) and its linear-attention layers of
Mamba-style mixers (:data:`LINEAR_LAYERS`, their convolution and recurrent states) are taken, given to a module of
``transformers`` (whose convention ``None`` is: :func:`reads_none_as_no_cache`); any other
cache stays, and the module is refused with the reason (:func:`.running.cache_updated`).
"""

from typing import Dict, FrozenSet, List, Sequence

#: The cache layers whose ``update`` on an empty layer returns the given states as they are.
DYNAMIC_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer"})

#: The cache layers of a Mamba-style mixer (convolution and recurrent states): on an empty
#: layer (no previous state) its ``update_conv_state`` returns the given states padded on the
#: left with zeros, as a causal convolution without a cache pads them, and the mixer runs its
#: prefill from zero states, as it does without a cache (GraniteMoeHybrid's Mamba layers).
LINEAR_LAYERS = frozenset({"LinearAttentionLayer"})


def _filled(layer) -> int:
    """How much ``layer`` holds: its sequence length (a dynamic layer), or the positions and
    states it was given (a linear-attention layer); 0: empty."""
    if type(layer).__name__ in LINEAR_LAYERS:
        return int(layer.cumulative_length_linear) + sum(map(bool, layer.has_previous_state.values()))
    return layer.get_seq_length()


def is_cache(value) -> bool:
    """Whether ``value`` is a ``transformers`` key/value cache (a ``Cache``)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(value).__mro__)


def reads_none_as_no_cache(module) -> bool:
    """Whether ``module`` is a class of ``transformers``, whose attention modules read a
    cache of ``None`` as none (``if cache is not None: k, v = cache.update(...)``); a module
    of another library may read ``None`` otherwise, so its cache is kept (and refused)."""
    return type(module).__module__.startswith("transformers.")


def lengths(leaves: Sequence) -> Dict[int, List[int]]:
    """``{leaf index: [what each layer holds]}`` of the caches among ``leaves`` whose layers
    are all dynamic or linear-attention ones (:data:`DYNAMIC_LAYERS`, :data:`LINEAR_LAYERS`)."""
    found = {}
    for k, leaf in enumerate(leaves):
        layers = getattr(leaf, "layers", None) if is_cache(leaf) else None
        if isinstance(layers, list) and all(type(layer).__name__ in DYNAMIC_LAYERS | LINEAR_LAYERS
                                            for layer in layers):
            found[k] = [_filled(layer) for layer in layers]
    return found


def filled_from_empty(leaves: Sequence, before: Dict[int, List[int]]) -> FrozenSet[int]:
    """The indices of the caches among ``leaves`` that the call updated, each of whose
    updated layers was empty before it (``before``: :func:`lengths` then)."""
    after = lengths(leaves)
    fresh = set()
    for k, was in before.items():
        now = after.get(k)
        if now is None or len(now) < len(was):
            continue
        changed = [j for j, length in enumerate(now) if j >= len(was) or length != was[j]]
        if changed and all(j >= len(was) or was[j] == 0 for j in changed):
            fresh.add(k)
    return frozenset(fresh)
