"""Issue 32, class 1: mixture-of-experts blocks, whose layers run on tokens, not examples.

Mixtral's and Qwen2-MoE's blocks take ``[N, T, C]`` and flatten it to ``[N*T, C]``
tokens; the router and the experts (3-D parameters, gathered by ``torch.where`` and
added back with ``index_add_``; Qwen2-MoE's shared expert, ``nn.Linear`` layers)
see rows that are tokens. They used to get no rows (the fallback's ``vmap`` cannot
run ``nonzero``; the router's output leads with ``N*T``). The block is now
recomputed one example at a time (``extensions/fallback/blocks.py``): every
parameter inside it is exact against one backward pass per example through a
float64 forward pass of the batch on an un-prepared copy, at batch sizes 2, odd, the
number of experts and the sequence length, for GradientVarianceQuantiles,
PerExampleGradNorm and GradientNoiseScale, with no warning.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check

import pytest
import torch

from tests.cases import token_losses
from tests.library_models import Logits
from tests.test_silent_inexact import assert_exact

SEQUENCE, EXPERTS, VOCAB = 6, 4, 11


def causal_lm(family, **config):
    """A tiny float64 ``<family>ForCausalLM`` in evaluation mode, one layer of 4 experts, top-2,
    its experts run by ``transformers``' eager loop (its grouped products take no float64)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
        max_position_embeddings=16, experts_implementation="eager", **config)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).double().eval()


def mixtral(**extra):
    return causal_lm("Mixtral", num_local_experts=EXPERTS, **extra)


def qwen2_moe(**extra):
    return causal_lm("Qwen2Moe", num_experts=EXPERTS, moe_intermediate_size=6,
                     shared_expert_intermediate_size=10, **extra)


def qwen3_moe(**extra):
    return causal_lm("Qwen3Moe", num_experts=EXPERTS, moe_intermediate_size=6, head_dim=4, **extra)


def granite_moe(**extra):
    return causal_lm("GraniteMoe", num_local_experts=EXPERTS, **extra)


MODELS = {"mixtral": mixtral, "qwen2-moe": qwen2_moe, "qwen3-moe": qwen3_moe, "granite-moe": granite_moe}


def tokens(examples, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, examples, SEQUENCE), generator=generator)


# 2, odd, the number of experts, the sequence length; Qwen3-MoE and GraniteMoE, alike
# (router and 3-D experts only), at one.
@pytest.mark.parametrize("family, examples", [
    *((family, examples) for family in ("mixtral", "qwen2-moe") for examples in (2, 5, EXPERTS, SEQUENCE)),
    ("qwen3-moe", 5), ("granite-moe", 3)])
def test_every_parameter_of_a_mixture_of_experts_block_is_exact(family, examples):
    inputs, targets = tokens(examples)
    model = Logits(MODELS[family]())
    assert any(".experts." in name for name, _ in model.named_parameters())
    assert_exact(model, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)


def track_one_step(model, inputs, targets, extra_loss=None):
    """One tracked float64 step of ``model`` (``extra_loss(model)`` added to the loss); the
    rows of PerExampleGradNorm and the package's warnings."""
    _, per_example_loss = token_losses("mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracked, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
        losses = per_example_loss(tracked(inputs), targets)
        with tracker(0, losses) as loss:
            (loss if extra_loss is None else loss + extra_loss(model)).backward()
    messages = " ".join(str(w.message) for w in caught if "cockpit-gradnoise" in str(w.message))
    return tracker.get_output()[0]["PerExampleGradNorm"], messages


def assert_rows_exact(rows, model, inputs, targets, names):
    """``names``' per-example norms (max, mean) equal the float64 per-example references."""
    loss_fn, _ = token_losses("mean")
    contributions = check.reference_contributions(model, (inputs,), targets, loss_fn)
    for name in names:
        norms = (contributions[name] * len(inputs)).flatten(1).norm(dim=1)
        assert rows[name]["max"] == pytest.approx(float(norms.max()), rel=1e-10, abs=0), name
        assert rows[name]["mean"] == pytest.approx(float(norms.mean()), rel=1e-10, abs=0), name


class WithAuxiliaryLoss(torch.nn.Module):
    """``logits``, keeping the router's auxiliary load-balancing loss of the pass."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False)
        self.aux_loss = out.aux_loss
        return out.logits


# The load-balancing loss is a product of two means over every token of the batch: a
# term of the batch, not a sum of the examples' own. The router it reaches is left out
# by name; the experts, which it does not reach, stay exact.
def test_the_router_reached_by_the_auxiliary_loss_is_left_out_by_name_and_the_experts_are_exact():
    inputs, targets = tokens(5)
    model = WithAuxiliaryLoss(mixtral(output_router_logits=True))
    reference = copy.deepcopy(model)
    rows, messages = track_one_step(model, inputs, targets, lambda m: 0.1 * m.aux_loss)
    router = "model.model.layers.0.mlp.gate.weight"
    assert router not in rows and router in messages and "auxiliary" in messages
    experts = [f"model.model.layers.0.mlp.experts.{name}" for name in ("gate_up_proj", "down_proj")]
    assert_rows_exact(rows, reference, inputs, targets, experts)


class CappedExperts(torch.nn.Module):
    """Experts ``[E, C, C]`` on tokens ``[M, C]``, each taking the first ``capacity`` tokens
    the router sends it (the others pass unchanged): which tokens an expert drops depends
    on the other examples of the batch."""

    def __init__(self, width, experts, capacity):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, width, width) / width**0.5)
        self.capacity = capacity

    def forward(self, tokens, expert):
        out = tokens.clone()
        for e in range(len(self.weight)):
            taken = torch.where(expert == e)[0][: self.capacity]
            out = out.index_add(0, taken, tokens[taken] @ self.weight[e])
        return out


class CappedBlock(torch.nn.Module):
    def __init__(self, width, experts, capacity):
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.experts = CappedExperts(width, experts, capacity)

    def forward(self, x):
        tokens = x.flatten(0, 1)
        return self.experts(tokens, self.router(tokens).argmax(-1)).view_as(x)


class Capped(torch.nn.Module):
    def __init__(self, width=4, experts=2, capacity=3):
        super().__init__()
        self.block = CappedBlock(width, experts, capacity)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.block(x)).mean(1)


def test_a_block_whose_examples_interact_through_a_capacity_limit_is_left_out_by_name():
    torch.manual_seed(0)
    with torch.random.fork_rng():
        torch.set_default_dtype(torch.float64)
        try:
            model = Capped()
            inputs, targets = torch.randn(5, 4, 4), torch.randint(0, 3, (5,))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tracked, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
                losses = torch.nn.functional.cross_entropy(tracked(inputs), targets, reduction="none")
                with tracker(0, losses) as loss:
                    loss.backward()
        finally:
            torch.set_default_dtype(torch.float32)
    rows = tracker.get_output()[0]["PerExampleGradNorm"]
    messages = " ".join(str(w.message) for w in caught)
    assert "block.experts.weight" not in rows and "block.experts.weight" in messages
    assert "interact" in messages
    assert "head.weight" in rows  # the step is kept


def test_a_random_block_forward_is_left_out_by_name():
    """Mixtral's router jitter in training mode: a forward pass run again draws other noise."""
    inputs, targets = tokens(3)
    model = Logits(mixtral(router_jitter_noise=0.1, attention_dropout=0.0)).train()
    rows, messages = track_one_step(model, inputs, targets)
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        assert f"model.model.layers.0.mlp.{name}" not in rows
        assert f"model.model.layers.0.mlp.{name}" in messages
    assert "random" in messages and "model.lm_head.weight" in rows
