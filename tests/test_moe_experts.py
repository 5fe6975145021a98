"""Mixture-of-experts experts in ``transformers``' 3-D layout, from the batch's own pass.

``extensions/fallback/experts.py`` computes the experts' (and a Mixtral-style router's)
per-example results from the rows, routing and output gradient of the batch's pass,
where the block was recomputed per example (``blocks.py``). Here the fast way is made
to serve from the first step (``experts.CONFIRM = False``: no comparison with the
recomputation first) and must be exact against one float64 backward pass per example
for Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE (its router's logits in float32) and
GPT-OSS (transposed weights, biases, its clamped gate), at batch sizes 2, odd and the
sequence length, with top-2 routing and with an expert no token reaches; DeepSeek-V3's
(group-limited, bias-corrected top-k routing in float32, a shared expert beside) to
float32's rounding where its router computes in float32; and it must give way to the recomputation, still
exact, where its reimplementation of the experts is not theirs, or where its rows
disagree with the recomputation's on the first step.
"""

import copy

from cockpit_gradnoise.extensions.fallback import experts

import pytest
import torch

from tests.cases import token_losses
from tests.library_models import Logits
from tests.test_moe import (
    SEQUENCE,
    WithAuxiliaryLoss,
    assert_rows_exact,
    causal_lm,
    granite_moe,
    mixtral,
    qwen2_moe,
    qwen3_moe,
    tokens,
    track_one_step,
)
from tests.test_moe_float32_routers import assert_exact_per_example
from tests.test_moe_float32_routers import causal_lm as sweep_causal_lm
from tests.test_silent_inexact import assert_exact


def olmoe():
    return causal_lm("Olmoe", num_experts=4)


def gpt_oss():
    """Transposed 3-D weights with biases, interleaved gate and up, a clamped gate."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=11, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=16, experts_implementation="eager", layer_types=["full_attention"])
    torch.manual_seed(0)
    return transformers.GptOssForCausalLM(config).double().eval()


def many_experts():
    """16 experts, top-2, for 2 examples of 6 tokens: some expert gets no token."""
    return causal_lm("Mixtral", num_local_experts=16)


@pytest.fixture
def fast(monkeypatch):
    """The fast way from the first step; ``fast`` lists the names it gave results, per call."""
    monkeypatch.setattr(experts, "CONFIRM", False)
    served, routed = [], []
    results, factors = experts._results, experts._factors

    def spy_results(*args, **kwargs):
        found = results(*args, **kwargs)
        served.append(sorted(next(iter(found.values()), {})))
        return found

    def spy_factors(module, roles, rows, index, *args):
        routed.append(torch.bincount(index.reshape(-1), minlength=len(module.down_proj)))
        return factors(module, roles, rows, index, *args)

    monkeypatch.setattr(experts, "_results", spy_results)
    monkeypatch.setattr(experts, "_factors", spy_factors)
    return served, routed


MIXTRAL_LIKE = ["experts.down_proj", "experts.gate_up_proj", "gate.weight"]
FAMILIES = {"mixtral": (mixtral, MIXTRAL_LIKE), "qwen2-moe": (qwen2_moe, MIXTRAL_LIKE),
            "qwen3-moe": (qwen3_moe, MIXTRAL_LIKE), "olmoe": (olmoe, MIXTRAL_LIKE),
            "gpt-oss": (gpt_oss, ["experts.down_proj", "experts.down_proj_bias", "experts.gate_up_proj",
                                  "experts.gate_up_proj_bias", "router.bias", "router.weight"]),
            "granite-moe": (granite_moe, ["experts.down_proj", "experts.gate_up_proj", "router.weight"]),
            "16 experts": (many_experts, MIXTRAL_LIKE)}


@pytest.mark.parametrize("family, examples", [
    ("mixtral", 2), ("mixtral", 5), ("mixtral", SEQUENCE), ("qwen2-moe", 5), ("qwen3-moe", 2),
    ("olmoe", 3), ("granite-moe", SEQUENCE), ("gpt-oss", 3), ("16 experts", 2)])
def test_experts_and_router_from_the_batch_pass_are_exact(fast, family, examples):
    make, names = FAMILIES[family]
    inputs, targets = tokens(examples)
    assert_exact(Logits(make()), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    served, routed = fast
    assert served == [names]  # every expert parameter (and the router) the fast way
    if family == "16 experts":
        assert (routed[0][:16] == 0).any()  # an expert no token reached: zero rows


def deepseek_v3():
    """DeepSeek-V3's block: 8 experts in 4 groups, top-2 from the best 2 groups chosen by scores
    plus a random ``e_score_correction_bias``, the weights the unbiased sigmoid scores,
    normalized and scaled, all in float32 (``weight.type(torch.float32)``); a shared expert
    beside (on the block's input, its rows examples: recomputed per example with the block)."""
    model = sweep_causal_lm("deepseek_v3", first_k_dense_replace=0, n_routed_experts=8, num_local_experts=8,
                            n_group=4, topk_group=2, num_hidden_layers=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=generator))
                module.weight.copy_(0.3 * torch.randn(module.weight.shape, generator=generator))
    return model


def test_deepseek_v3_experts_and_float32_router_from_the_batch_pass(fast):
    """Exact to float32's rounding (its router's product is float32's; every other parameter
    to 1e-10: ``assert_exact_per_example``)."""
    inputs, targets = tokens(3)
    model = deepseek_v3()
    assert_exact_per_example(model, inputs, targets)
    served, routed = fast
    assert served and all(names == MIXTRAL_LIKE for names in served)


@pytest.mark.parametrize("model_type, router", [
    ("minimax_m2", "gate.weight"),  # a second input, the block's e_score_correction_bias
    ("afmoe", "router.gate.weight"),  # the weight a child's (an nn.Linear inside the router)
    ("ernie4_5_moe", "gate.weight")])  # a frozen parameter beside (its routing statistics)
def test_routers_with_more_inputs_or_parameters_from_the_batch_pass(fast, model_type, router):
    """Routers in float32 (the sweep's tiny configurations), to float32's rounding."""
    inputs, targets = tokens(3)
    model = sweep_causal_lm(model_type)
    assert_exact_per_example(model, inputs, targets)
    served, _ = fast
    assert served and all(names[:2] == ["experts.down_proj", "experts.gate_up_proj"] and router in names
                          for names in served)


def test_jamba_experts_and_router_from_the_batch_pass_are_exact(fast):
    """Jamba's (the sweep's tiny configuration: Mamba and attention layers, one block of
    experts), per-example norms of its experts and router to 1e-10. (Not the whole model
    through ``assert_exact``: its Mamba ``A_log`` differs from the float64 reference at
    float32's rounding, in the noise scale's cancelling ``grad_sq`` at batch 2.)"""
    inputs, targets = tokens(2)
    model = sweep_causal_lm("jamba")
    reference = copy.deepcopy(model)
    rows, messages = track_one_step(model, inputs, targets)
    assert messages == ""
    names = [name for name, p in model.named_parameters() if ".experts." in name or name.endswith("router.weight")]
    assert len(names) == 3
    assert_rows_exact(rows, reference, inputs, targets, names)
    assert fast[0] == [["experts.down_proj", "experts.gate_up_proj", "router.weight"]]


def test_norms_alone_by_gram_matrices_are_exact(fast):
    """PerExampleGradNorm alone asks for no sums of squares: the norms by Gram matrices."""
    inputs, targets = tokens(5)
    model = mixtral()
    reference = Logits(mixtral())
    rows, messages = track_one_step(Logits(model), inputs, targets)
    assert messages == ""
    assert_rows_exact(rows, reference, inputs, targets, [
        f"model.model.layers.0.mlp.{name}" for name in MIXTRAL_LIKE])
    assert fast[0] == [MIXTRAL_LIKE]


def test_the_router_reached_by_the_auxiliary_loss_is_still_left_out(fast):
    """The router's rows through the experts only: the load-balancing loss's term is not in
    them, so they do not add up to its gradient, and it is left out by name as before."""
    inputs, targets = tokens(5)
    model = WithAuxiliaryLoss(mixtral(output_router_logits=True))
    reference = WithAuxiliaryLoss(mixtral(output_router_logits=True))
    rows, messages = track_one_step(model, inputs, targets, lambda m: 0.1 * m.aux_loss)
    router = "model.model.layers.0.mlp.gate.weight"
    assert router not in rows and router in messages and "auxiliary" in messages
    experts_names = [f"model.model.layers.0.mlp.experts.{name}" for name in ("gate_up_proj", "down_proj")]
    assert_rows_exact(rows, reference, inputs, targets, experts_names)
    assert fast[0] == [MIXTRAL_LIKE]


def test_experts_computing_otherwise_are_recomputed_per_example(fast, monkeypatch):
    """A gate the reimplementation applies that the module's forward does not (a future
    ``transformers``, another activation): outputs differ, the block is recomputed per
    example for good, still exact."""
    import transformers

    def other_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.tanh(gate) * up

    monkeypatch.setattr(transformers.models.mixtral.modeling_mixtral.MixtralExperts, "_apply_gate", other_gate)
    inputs, targets = tokens(3)
    model = Logits(mixtral())
    assert_exact(model, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert fast[0] == [[]]
    block = model.model.model.layers[0].mlp
    assert block.__dict__[experts.ATTRIBUTE].verified is False


def test_rows_that_disagree_with_the_recomputation_on_the_first_step_are_not_used(monkeypatch):
    """With the comparison on (the default): fast rows made wrong (each example's tokens taken
    for the next example's) are caught on the first step; that step and the next are the
    recomputation's, exact."""
    segments = experts._segments

    def shifted(tokens, positions):
        reached, counts, segment = segments(tokens, positions)
        return (reached + 1) % 3, counts, segment

    monkeypatch.setattr(experts, "_segments", shifted)
    inputs, targets = tokens(3)
    model = Logits(mixtral())
    assert_exact(model, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE, steps_before=0)
    block = model.model.model.layers[0].mlp
    assert block.__dict__[experts.ATTRIBUTE].verified is False


def test_the_first_step_confirms_the_fast_way_and_the_next_uses_it():
    inputs, targets = tokens(3)
    model = Logits(mixtral())
    reference = Logits(mixtral())
    names = [f"model.model.layers.0.mlp.{name}" for name in MIXTRAL_LIKE]
    for step in range(2):
        rows, messages = track_one_step(model, inputs, targets)
        assert messages == ""
        assert_rows_exact(rows, reference, inputs, targets, names)
        model.zero_grad()
    assert model.model.model.layers[0].mlp.__dict__[experts.ATTRIBUTE].verified is True
