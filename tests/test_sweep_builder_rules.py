"""The sweep builder's general rules (experiments/sweep_models.py), on plain configuration dicts."""

import torch
from torch import nn

from experiments import architecture_sweep, sweep_models


def test_routing_fits_the_tiny_experts_and_leaves_a_fitting_default_alone():
    # DeepSeek-V2: top-k left to the checkpoint
    assert sweep_models._routing({"num_experts_per_tok": None}, 4, {}) == {"num_experts_per_tok": 2}
    # Kimi: top-8 of 4, serialized as num_experts_per_token; one group fits
    kimi = {"num_experts_per_token": 8, "num_expert_group": 1}
    aliases = {"num_experts_per_tok": "num_experts_per_token", "n_group": "num_expert_group"}
    assert sweep_models._routing(kimi, 4, aliases) == {"num_experts_per_token": 2}
    # Beam: 8 groups of 4 experts hold none; groups are scored by their best 2
    assert sweep_models._routing({"num_experts_per_tok": 2, "n_group": 8, "topk_group": 4}, 4, {}) == {
        "n_group": 2, "topk_group": 1}
    # 8 groups of 256 experts and top-6 of 64: what the default says
    assert sweep_models._routing({"num_experts_per_tok": 6, "n_group": 8}, 256, {}) == {}


def test_per_layer_lists_follow_the_layers_kept_and_layer_indices_are_renumbered():
    values = {"num_hidden_layers": 6, "swiglu_limits": [0] * 6, "moe_layers": list(range(6)),
              "no_rope_layers": [1, 0, 0, 1, 1, 0]}
    assert sweep_models._one_layer_per_kind(values) == {
        "num_hidden_layers": 2, "swiglu_limits": [0, 0], "moe_layers": [0, 1], "no_rope_layers": [1, 0]}
    # indices of some layers only (interleaved experts): those kept, renumbered
    interleaved = {"num_hidden_layers": 6, "limits": [3] * 6, "moe_layers": [1, 3, 5]}
    assert sweep_models._one_layer_per_kind(interleaved) == {
        "num_hidden_layers": 2, "limits": [3, 3], "moe_layers": [1]}
    # a hybrid stack: the first layer of each kind, every list cut alike
    hybrid = {"num_hidden_layers": 4, "layer_types": ["linear", "linear", "full", "linear"],
              "limits": [7] * 4}
    assert sweep_models._one_layer_per_kind(hybrid) == {
        "num_hidden_layers": 2, "layer_types": ["linear", "full"], "limits": [7, 7]}
    assert sweep_models._one_layer_per_kind({"num_hidden_layers": 1, "limits": [3]}) == {}


def test_a_latent_head_dim_that_is_the_whole_query_head_stays_so():
    mistral4 = {"head_dim": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "kv_lora_rank": 256}
    deepseek = {"head_dim": 64, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "kv_lora_rank": 512}
    got, kept = sweep_models._latent_attention(mistral4), sweep_models._latent_attention(deepseek)
    assert got["head_dim"] == got["qk_rope_head_dim"] + got["qk_nope_head_dim"]
    assert kept["head_dim"] == kept["qk_rope_head_dim"]


class _Output(dict):
    """A model output with ``logits`` or without, indexable as transformers' ``ModelOutput``."""

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error


class _Head(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.linear, self.name = nn.Linear(3, 2), name

    def forward(self, input_ids):
        scores = self.linear(input_ids) + torch.zeros(())  # a tensor of the default dtype
        return _Output({self.name: scores, "dtype": torch.zeros(()).dtype})


def test_logits_reads_a_head_without_logits_and_restores_the_default_dtype():
    x = torch.randn(4, 3, dtype=torch.float64)
    named = sweep_models.Logits(_Head("last_hidden_state").double(), ["input_ids"])
    assert torch.equal(named(x), named.model.linear(x))
    float64 = sweep_models.Logits(_Head("logits").double(), ["input_ids"], torch.float64)
    seen = []
    float64.model.register_forward_hook(lambda module, args, out: seen.append(out["dtype"]))
    assert float64(x).dtype == torch.float64 and seen == [torch.float64]
    assert torch.get_default_dtype() == torch.float32


def test_every_parameter_of_a_float32_model_gets_the_float32_tolerance_and_none_of_a_float64_one():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert architecture_sweep.float32_model(model) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert architecture_sweep.float32_model(model.double()) == set()
