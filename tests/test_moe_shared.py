"""Shared experts of mixture-of-experts blocks, from one pass of the block on the batch.

``extensions/fallback/shared.py`` gives the ``nn.Linear`` layers beside the routed experts
(Qwen2-MoE's shared expert on the flattened tokens and its sigmoid ``shared_expert_gate``,
DeepSeek-V3's shared experts on the block's ``[N, T, C]`` input) their rows from one pass of
the block on the whole batch, the gradient at each layer's output through the block's output
only. Served from the first step (``experts.CONFIRM = False``), they must be exact against
one float64 backward pass per example, at batch 2, 3 and the sequence length; rows made
wrong must be caught by the first step's comparison with the recomputation.
"""

import traceback

from cockpit_gradnoise.extensions.fallback import experts, shared

import pytest
import torch

from tests.cases import token_losses
from tests.library_models import Logits
from tests.test_moe import SEQUENCE, assert_rows_exact, qwen2_moe, tokens, track_one_step
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


def test_rows_that_disagree_with_the_recomputation_on_the_first_step_are_not_used(monkeypatch):
    """With the comparison on (the default): shared rows made wrong (each example's rows
    taken for the next example's) are caught on the first step, which is the recomputation's,
    exact; the block's fast way is off for good."""
    layer_results = shared.layer_results

    def shifted(rows, deltas, examples, bias, squares):
        per = rows.shape[0] // examples
        return layer_results(rows.roll(per, 0), deltas, examples, bias, squares)

    monkeypatch.setattr(shared, "layer_results", shifted)
    inputs, targets = tokens(3)
    model = Logits(qwen2_moe())
    assert_exact(model, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert model.model.model.layers[0].mlp.__dict__[experts.ATTRIBUTE].verified is False


class WithSharedGateTerm(torch.nn.Module):
    """``logits``, keeping the shared expert gate's output: a term of the loss on it reaches
    ``shared_expert_gate.weight`` other than through the block's output."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.model.model.layers[0].mlp.shared_expert_gate.register_forward_hook(self.keep)

    def keep(self, module, args, output):
        self.gate_output = output

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_a_term_reaching_a_shared_layer_otherwise_leaves_it_out_by_name(served):
    """Its rows through the block's output only do not add up to its gradient: left out with
    a warning naming it, never split per token; the shared expert, which the term does not
    reach, stays exact."""
    inputs, targets = tokens(3)
    model, reference = WithSharedGateTerm(qwen2_moe()), WithSharedGateTerm(qwen2_moe())
    rows, messages = track_one_step(model, inputs, targets, lambda m: 0.1 * m.gate_output.square().sum())
    gate = "model.model.layers.0.mlp.shared_expert_gate.weight"
    assert gate not in rows and gate in messages
    assert_rows_exact(rows, reference, inputs, targets, [
        f"model.model.layers.0.mlp.shared_expert.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")])
    assert served == [QWEN2_SHARED]


def test_the_experts_are_replayed_not_run_again(served, monkeypatch):
    """The pass on the batch gives the experts' output of the batch's pass (their inputs the
    same): the routed experts do not run inside it."""
    import transformers

    experts_class = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts
    calls, forward = [], experts_class.forward

    def counted(self, *args, **kwargs):
        calls.append(any(frame.filename == shared.__file__ for frame in traceback.extract_stack()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(experts_class, "forward", counted)
    inputs, targets = tokens(3)
    rows, messages = track_one_step(Logits(qwen2_moe()), inputs, targets)
    assert messages == "" and served == [QWEN2_SHARED] and calls and not any(calls)


def test_a_shared_layer_feeding_the_experts_gives_way_to_the_recomputation(served, monkeypatch):
    """A block whose routing weights are scaled by its shared gate's output: the experts'
    output is no constant of that layer, so no shared rows from the batch (the block is
    recomputed per example), still exact."""
    import transformers

    def forward(self, hidden_states):
        rows = hidden_states.view(-1, hidden_states.shape[-1])
        gate = torch.sigmoid(self.shared_expert_gate(rows))
        _, weights, index = self.gate(rows)
        out = self.experts(rows, index, weights * gate) + gate * self.shared_expert(rows)
        return out.reshape(hidden_states.shape)

    monkeypatch.setattr(transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, "forward", forward)
    inputs, targets = tokens(3)
    assert_exact(Logits(qwen2_moe()), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert served == [[]]


@pytest.mark.parametrize("squares", [True, False])
def test_a_layers_results_from_its_rows_are_each_examples_own(squares):
    """``layer_results`` against each example's gradient formed alone (float64), with a bias
    (no family above has one) and 3 examples of 4 rows each."""
    generator = torch.Generator().manual_seed(0)
    rows, deltas = torch.randn(12, 5, generator=generator, dtype=torch.float64), torch.randn(
        12, 3, generator=generator, dtype=torch.float64)
    found = shared.layer_results(rows, deltas, 3, bias=True, squares=squares)
    weight = torch.stack([deltas[4 * i : 4 * i + 4].T @ rows[4 * i : 4 * i + 4] for i in range(3)])
    bias = deltas.reshape(3, 4, 3).sum(1)
    for (norms, sums), x in ((found["weight"], weight), (found["bias"], bias)):
        torch.testing.assert_close(norms, x.flatten(1).square().sum(1), rtol=1e-12, atol=0)
        torch.testing.assert_close(sums[0], x.sum(0), rtol=1e-12, atol=1e-14)
        if squares:
            torch.testing.assert_close(sums[1], x.square().sum(0), rtol=1e-12, atol=0)
    assert shared.layer_results(rows[:11], deltas[:11], 3, bias=True, squares=squares) is None
