"""A key/value cache of ``transformers`` that a module's call filled from empty is left out of
the fallback's recomputation (``extensions/fallback/caches.py``): exact, against float64
per-example references; a cache that held keys before the call is still refused."""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.fallback import caches

import pytest
import torch


def test_granitemoe_swas_sinks_with_the_cache_its_model_creates_are_exact():
    """The real class: GraniteMoE-SWA's causal LM creates a ``DynamicCache`` in every forward
    pass (``config.use_cache`` is true, in training mode too) and its attention, whose
    ``sinks`` the fallback computes, appends its keys to it. Exact to 1e-10 in float64."""
    pytest.importorskip("transformers.models.granitemoe_swa")
    from experiments import sweep_models

    case = sweep_models.build("transformers", "granitemoe_swa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)
    sinks = frame[frame.param.str.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and sinks.rows.all(), sinks.note.tolist()
    assert (sinks.max_rel_error < 1e-10).all(), sinks.max_rel_error.tolist()


def test_only_caches_whose_updated_layers_were_empty_count_as_filled_by_the_call():
    from transformers import DynamicCache

    def update(cache, layer):
        cache.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), layer)

    cache = DynamicCache()
    update(cache, 0)  # an earlier layer of the same pass: not read by the call
    before = caches.lengths([cache])
    update(cache, 1)
    assert caches.filled_from_empty([cache], before) == {0}
    before = caches.lengths([cache])
    update(cache, 1)  # the layer held keys before the call (generation): kept, refused
    assert caches.filled_from_empty([cache], before) == frozenset()
    before = caches.lengths([cache])
    assert caches.filled_from_empty([cache], before) == frozenset()  # not updated by the call
