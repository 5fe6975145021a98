"""Issue 32, class 1: mixture-of-experts blocks whose routers compute in float32.

The newer ``transformers`` blocks (AFMoE, MiniMax-M2, Llama 4, HY-V3, EXAONE-MoE,
Kolibri, ERNIE-4.5-MoE, GLM-4-MoE-Lite; Solar Open, whose router is GLM-4-MoE-Lite's,
in the sweep) route in float32 whatever the model's dtype (``router_logits.float()``,
``self.weight.type(torch.float32)``), with shared experts beside the routed ones.
Their blocks are recomputed one example at a time (``extensions/fallback/blocks.py``),
but in a float64 model one example alone may round its float32 routing otherwise than
the batch (a float32 product of 7 rows against one of 28: about 1e-8 of the output), so the block's checks at float64's
``sqrt(eps)`` refused every parameter inside it as "examples interact", or the router
as "reached another way". The checks now use the narrowest dtype the block computes in
(:func:`cockpit_gradnoise.extensions.fallback.blocks.rounding`).

Reference: one backward pass per example through one float64 forward pass of the batch
on an un-prepared copy (``check.reference_contributions``), as ``check_model`` and the
sweep compare. Every parameter outside the blocks is exact to 1e-10 (its rule reads the
batch's backward pass). The block's parameters are each example's own gradient through
the block run alone, whose float32 routing rounds otherwise than the batch's: they agree
to float32's rounding, the sweep's "exact to float32" (``FLOAT32_TOLERANCE``, 1e-4:
float32 sums of at most a few hundred terms), with the statistics' tolerances derived
from it below; the network's ("all") holds them too. (A per-example loop of each example
alone through the whole model is no 1e-10 reference either: the other layers' gradients
pass through the batch's float32 routing.)
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check, references
from cockpit_gradnoise.extensions import facts
from cockpit_gradnoise.extensions.fallback.capture import BLOCK_ATTRIBUTE

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear

from experiments.architecture_sweep import FLOAT32_TOLERANCE
from tests.cases import Problem, run_step, token_losses
from tests.helpers import EPS64, RTOL, assert_statistics_match, rounding_bounds, rows, sd_rtol
from tests.library_models import Logits
from tests.test_moe import WithAuxiliaryLoss, track_one_step
from tests.test_tied import QUANTILES

SEQUENCE, EXPERTS, VOCAB = 6, 4, 11


def causal_lm(model_type, **extra):
    """A tiny float64 causal LM of ``model_type`` (the sweep's tiny configuration: width 32,
    one layer of each kind, 4 experts, top-2, the experts run by the eager loop), evaluation
    mode, as ``Logits``."""
    import transformers

    from experiments.sweep_models import tiny_config

    config = tiny_config(model_type)
    for key, value in {"vocab_size": VOCAB, **extra}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():  # transformers leaves some expert tensors empty
        for name, param in model.named_parameters():
            if ".experts." in name and param.dim() == 3:
                param.normal_(0.0, 0.3)
    return Logits(model)


def tokens(examples, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, examples, SEQUENCE), generator=generator)


def assert_exact_per_example(model, inputs, targets):
    """GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale of every
    trainable parameter, and of the network, against the reference (module docstring): the
    block's parameters (every expert's among them) to float32's rounding, every other to
    1e-10; no warning."""
    loss_fn, per_example_loss = token_losses("mean")
    n = len(inputs)
    contributions = check.reference_contributions(copy.deepcopy(model), (inputs,), targets, loss_fn)
    grads = {name: x * n for name, x in contributions.items()}  # x_i = g_i / N
    problem = Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs,
                      targets, "mean")
    named = dict(problem.model.named_parameters())
    names = [name for name in problem.names if name in grads]
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names),
        cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names),
    ]
    cockpit = cgn.Cockpit([named[name] for name in names], quantities=quantities)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run_step(problem, quantities, cockpit=cockpit)
    recomputed = {name for name in names if id(named[name]) in facts.recording().block_rows}
    assert set(experts_of(model)) <= recomputed
    chosen = {name: grads[name] for name in names}
    rounded = recomputed | {cgn.NETWORK}
    args = (problem.model, per_example_loss, inputs, targets)
    got = cockpit.get_output()[0]

    expected = references.per_example_grad_norm(*args, quantiles=QUANTILES, gradients=chosen)
    assert_statistics_match(got["PerExampleGradNorm"], expected, rtol_of=lambda name, _: (
        FLOAT32_TOLERANCE if name in rounded else RTOL))

    expected = references.gradient_variance_quantiles(
        *args, reduction="mean", quantiles=QUANTILES, gradients=chosen)
    # Every statistic outside the blocks, as tests/test_moe.py; the block's sd statistics
    # (an SNR of an element whose sd is float32 rounding noise has no bound).
    exact = {name: stats for name, stats in expected.items() if name not in rounded}
    tolerance = {name: sd_rtol(chosen, n, name, SEQUENCE) for name in exact}
    assert_statistics_match({name: got["GradientVarianceQuantiles"][name] for name in exact}, exact,
                            rtol_of=lambda name, _: tolerance[name])
    atol = {name: _sd_atol(chosen, n, name) for name in rounded}
    assert_statistics_match(
        without_snr({name: got["GradientVarianceQuantiles"][name] for name in rounded}),
        without_snr({name: expected[name] for name in rounded}), atol_of=lambda name, _: atol[name])

    expected = references.gradient_noise_scale(*args, gradients=chosen)
    noise = rows(cockpit, "GradientNoiseScale")
    assert set(noise) == set(expected)
    for name, stats in expected.items():
        numel = sum(g[0].numel() for key, g in chosen.items() if name in (key, cgn.NETWORK))
        bounds = rounding_bounds(n, numel, stats["grad_sq"], stats["trace_cov"])
        if name in rounded:  # 2 delta relative in each squared norm and product, as the rounding
            bounds = [bound / ((n + numel) * EPS64) * 2 * FLOAT32_TOLERANCE for bound in bounds]
        for key, bound in zip(("grad_sq", "trace_cov"), bounds):
            assert noise[name][key] == pytest.approx(stats[key], rel=RTOL, abs=bound), (name, key)


def without_snr(table):
    """The sd statistics of GradientVarianceQuantiles' ``{param: {statistic: value}}``."""
    return {name: {k: v for k, v in stats.items() if not k.startswith("snr")}
            for name, stats in table.items()}


def experts_of(model):
    """The routed and shared experts' parameters, by name."""
    return [name for name, p in model.named_parameters() if "expert" in name and p.requires_grad]


def _sd_atol(grads, n, name):
    """Absolute tolerance of the sd statistics of ``name`` where each contribution ``x_ij``
    is off by at most ``delta = FLOAT32_TOLERANCE`` of the parameter's largest ``|x_ij|``,
    ``X`` (the sweep's measure): ``sd_j = sqrt(n / (n - 1)) ||x_.j - mean||`` moves by at
    most ``sqrt(n / (n - 1)) sqrt(n) delta X``, and every quantile and mean of ``sd`` with it."""
    x = torch.cat([g.reshape(n, -1) for key, g in grads.items() if name in (key, cgn.NETWORK)], 1)
    return FLOAT32_TOLERANCE * float(x.abs().max()) * n / (n - 1) ** 0.5


# 2, odd, the number of experts, the sequence length for two; one batch size for the others.
@pytest.mark.parametrize("model_type, examples", [
    *(("afmoe", n) for n in (2, 5, EXPERTS, SEQUENCE)),
    ("llama4_text", 5), ("llama4_text", SEQUENCE),
    ("minimax_m2", 3), ("hy_v3", 5), ("exaone_moe", 3), ("kolibri1", 2),
    ("ernie4_5_moe", 5), ("glm4_moe_lite", 3)])
def test_every_parameter_of_a_block_routing_in_float32_is_exact(model_type, examples):
    inputs, targets = tokens(examples)
    model = causal_lm(model_type)
    assert experts_of(model)
    assert_exact_per_example(model, inputs, targets)


def test_a_random_block_routing_in_float32_is_still_left_out_by_name():
    """MiniMax-M2's router jitter in training mode changes the output by far more than
    float32's rounding: the wider tolerance does not let it through."""
    inputs, targets = tokens(3)
    model = causal_lm("minimax_m2", router_jitter_noise=0.1, attention_dropout=0.0).train()
    rows, messages = track_one_step(model, inputs, targets)
    block = next(name.rsplit(".experts.", 1)[0] for name in experts_of(model))
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
        assert f"{block}.{name}" not in rows and f"{block}.{name}" in messages
    assert "random" in messages and "model.lm_head.weight" in rows


def test_the_auxiliary_loss_at_its_default_coefficient_still_leaves_a_float32_router_out():
    """The sum check at float32's ``sqrt(eps)`` still sees the load-balancing loss (a term of
    the batch) at MiniMax-M2's ``router_aux_loss_coef`` (1e-3): the routers are left out by
    name, the experts stay."""
    inputs, targets = tokens(5)
    model = WithAuxiliaryLoss(causal_lm("minimax_m2", output_router_logits=True).model)
    coefficient = model.model.config.router_aux_loss_coef
    assert coefficient == pytest.approx(1e-3)
    rows, messages = track_one_step(model, inputs, targets, lambda m: coefficient * m.aux_loss)
    routers = [name for name in rows if name.endswith("mlp.gate.weight")]
    assert not routers and "auxiliary" in messages and "model.model.layers.1.mlp.gate.weight" in messages
    assert set(experts_of(model)) <= set(rows)


def test_a_block_computing_in_float32_under_vmap_is_exact():
    """OLMo-Hybrid's gated delta rule computes in float32 inside the float64 model
    (``.to(torch.float32)``, ``A_log.float()``), on rows that are not examples: its block
    runs per example under ``vmap`` (``block_vmap``), which now notes the narrowest dtype as
    the loop does, so ``A_log``'s sum check is at float32's rounding (it was refused as
    "reached another way", 2e-8 against float64's 1.5e-8)."""
    inputs, targets = tokens(3)
    model = causal_lm("olmo_hybrid", linear_num_key_heads=2, linear_num_value_heads=2,
                      linear_key_head_dim=8, linear_value_head_dim=8)
    block = next(m for m in model.modules() if type(m).__name__ == "OlmoHybridGatedDeltaNet")
    assert_exact_per_example(model, inputs, targets)
    assert block.__dict__[BLOCK_ATTRIBUTE].vectorized is True  # the vmap path, not the loop
