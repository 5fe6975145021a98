"""check_model's ``dtype``: a model whose own code cannot run in float64 is checked in float32."""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch

from experiments import architecture_sweep, sweep_models


def _canine():
    """transformers' Canine (tiny, random weights): its attention mask is
    ``(1 - mask.float()) * finfo(dtype).min``, -inf in float32 for float64's least value."""
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sweep_models.build("transformers", "canine")


def test_a_model_that_fails_in_float64_is_checked_exactly_in_float32():
    canine = _canine()
    assert {p.dtype for p in canine.model.parameters()} == {torch.float32}
    torch.manual_seed(1)
    frame = cgn.check_model(canine.model, canine.inputs, canine.targets, canine.loss_fn, verbose=False,
                            dtype=torch.float32)
    # the sweep's classes: a key bias, zero by structure, against the network's scale
    record = architecture_sweep.classify(frame, set(frame.param))
    assert record["status"] == "exact to float32" and record["coverage"] == 1.0, record
    assert record["parameters"] > len(frame) / 2  # Canine's unused hash buckets aside
    assert record["worst_rel_error"] > 1e-12  # float32 rounding, not float64's: it ran in float32
    assert {p.dtype for p in canine.model.parameters()} == {torch.float32}  # the model is not changed

