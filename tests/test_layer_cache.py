"""The layer cache serves a result only for the very module and tensors it came from."""

import gc

from cockpit_gradnoise.extensions._layer_cache import LayerCache

import torch
from torch import nn


def test_a_result_is_served_for_its_own_sources_only():
    cache, module, other = LayerCache(), nn.Linear(2, 2), nn.Linear(2, 2)
    inputs, grad_output, result = torch.ones(3, 2), torch.ones(3, 2), torch.arange(3.0)
    cache.put("slot", (module, inputs, grad_output), result, extra=(0, 1))
    assert cache.get("slot", (module, inputs, grad_output), extra=(0, 1)) is result
    assert cache.get("slot", (module, inputs, grad_output), extra=(0, 1)) is result  # kept
    for wrong, extra in [
        ((other, inputs, grad_output), (0, 1)),  # another layer
        ((module, inputs, grad_output.clone()), (0, 1)),  # an equal tensor, not the same
        ((module, inputs), (0, 1)),  # fewer sources
        ((module, inputs, grad_output), None),  # another subsampling
    ]:
        assert cache.get("slot", wrong, extra) is None
    assert cache.get("other slot", (module, inputs, grad_output), (0, 1)) is None


def test_an_in_place_change_makes_the_result_stale():
    cache, module, grad_output = LayerCache(), nn.Linear(2, 2), torch.ones(3, 2)
    cache.put("slot", (module, grad_output), "result")
    grad_output.mul_(2)
    assert cache.get("slot", (module, grad_output)) is None


def test_a_new_tensor_at_a_dead_ones_address_does_not_match():
    cache, module = LayerCache(), nn.Linear(2, 2)
    grad_output = torch.ones(3, 2)
    cache.put("slot", (module, grad_output), "result")
    address = id(grad_output)
    del grad_output
    gc.collect()
    # Allocate until a tensor reuses the address (CPython reuses freed objects; not always among
    # the first hundred when other tests ran before).
    reused = [torch.ones(3, 2) for _ in range(10_000)]
    same_address = [t for t in reused if id(t) == address]
    assert same_address, "no new tensor took the dead one's address: nothing was tested"
    for tensor in same_address:
        assert cache.get("slot", (module, tensor)) is None


def test_take_empties_the_slot_and_put_replaces_its_entry():
    cache, module, grad_output = LayerCache(), nn.Linear(2, 2), torch.ones(3, 2)
    cache.put("slot", (module, grad_output), "first")
    cache.put("slot", (module, grad_output), "second")
    assert cache.take("slot", (module, grad_output)) == "second"
    assert cache.take("slot", (module, grad_output)) is None
    cache.put("slot", (module, grad_output), "third")
    assert cache.take("slot", (nn.Linear(2, 2), grad_output)) is None  # emptied even so
    assert cache.get("slot", (module, grad_output)) is None
