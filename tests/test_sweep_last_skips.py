"""The sweep's last skips, built (experiments/sweep_models.py) and checked exactly.

Reformer in training mode without randomness (its reversible layers' backward pass asserts
training mode); a Gemma 4 assistant with a tiny target model's hidden states and keys and
values, as transformers' generation passes them.
"""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch

from experiments import architecture_sweep, sweep_models


def _build(name):
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sweep_models.build("transformers", name)


def _checked(case):
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)


def test_reformer_is_checked_in_training_mode_without_randomness(one_thread):
    case = _build("reformer")
    assert case.model.training and "training mode" in case.detail
    with torch.no_grad():
        torch.manual_seed(1)
        first = case.model(*case.inputs)
        torch.manual_seed(2)
        assert torch.equal(first, case.model(*case.inputs))  # no dropout, fixed hash seed
    frame = _checked(case)
    record = architecture_sweep.classify(frame, set())
    # every row compared: its layers' gradients come from a backward inside a Function
    assert record["status"] == "exact" and record["coverage"] == 1.0 and not record["unverified"], record
    assert frame.param.str.contains("encoder.layers.1.attention").any()


def test_a_gemma4_assistant_drafts_from_a_tiny_targets_keys_and_values(one_thread):
    case = _build("gemma4_assistant")
    embeds, *keys_values = case.inputs
    assert embeds.shape[:2] == (sweep_models.BATCH, sweep_models.LENGTH) and len(keys_values) == 4
    assert all(t.shape[0] == sweep_models.BATCH for t in keys_values)
    frame = _checked(case)
    float32 = architecture_sweep.float32_parameters(
        case.model, frame, architecture_sweep.computed_in_float32(case))
    record = architecture_sweep.classify(frame, float32)
    assert record["status"] == "exact to float32" and record["coverage"] == 1.0, record
    assert record["parameters"] > 10 and not record["unverified"]


def test_the_behaviour_pass_compares_reformer_in_the_mode_it_is_built_in(one_thread):
    """In evaluation mode its tracked step would raise (the backward asserts training mode)."""
    from experiments import sweep_behaviour

    behaviour = sweep_behaviour.behaviour_one(_build("reformer"))
    assert behaviour["verdict"] == "kept", behaviour
    assert behaviour["eval"]["inside"]["identical"] and not behaviour["train"]["random"]
