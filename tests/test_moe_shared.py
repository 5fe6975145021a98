"""Shared experts of mixture-of-experts blocks, from one pass of the block on the batch.

``extensions/fallback/shared.py`` gives the ``nn.Linear`` layers beside the routed experts
(Qwen2-MoE's shared expert on the flattened tokens and its sigmoid ``shared_expert_gate``,
DeepSeek-V3's shared experts on the block's ``[N, T, C]`` input) their rows from one pass of
the block on the whole batch, the gradient at each layer's output through the block's output
only. Served from the first step (``experts.CONFIRM = False``), they must be exact against
one float64 backward pass per example, at batch 2, 3 and the sequence length; rows made
wrong must be caught by the first step's comparison with the recomputation.
"""

from cockpit_gradnoise.extensions.fallback import experts, shared

import pytest

from tests.cases import token_losses
from tests.library_models import Logits
from tests.test_moe import SEQUENCE, qwen2_moe, tokens
from tests.test_moe_experts import deepseek_v3
from tests.test_moe_float32_routers import assert_exact_per_example
from tests.test_silent_inexact import assert_exact

QWEN2_SHARED = ["shared_expert.down_proj.weight", "shared_expert.gate_proj.weight",
                "shared_expert.up_proj.weight", "shared_expert_gate.weight"]
DEEPSEEK_SHARED = ["shared_experts.down_proj.weight", "shared_experts.gate_proj.weight",
                   "shared_experts.up_proj.weight"]


@pytest.fixture
def served(monkeypatch):
    """The fast way from the first step; the names the shared layers' rows served, per call."""
    monkeypatch.setattr(experts, "CONFIRM", False)
    names, results = [], shared.results

    def spy(*args, **kwargs):
        found = results(*args, **kwargs)
        names.append(sorted(name.rsplit(".mlp.", 1)[-1] for name in next(iter(found[0].values()), {})))
        return found

    monkeypatch.setattr(shared, "results", spy)
    return names


@pytest.mark.parametrize("examples", [2, 3, SEQUENCE])
def test_qwen2_moe_shared_expert_and_its_gate_are_exact(served, examples):
    inputs, targets = tokens(examples)
    assert_exact(Logits(qwen2_moe()), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert served == [QWEN2_SHARED]


def test_deepseek_v3_shared_experts_are_exact(served):
    inputs, targets = tokens(3)
    assert_exact_per_example(deepseek_v3(), inputs, targets)
    assert served and all(names == DEEPSEEK_SHARED for names in served)
