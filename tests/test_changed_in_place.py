"""A layer's output changed in place by the module that called it.

ConvBERT's ``SeparableConv1D`` adds its ``bias`` to its pointwise convolution's output
with ``x += self.bias``; timm's ``NaFlexEmbeds`` adds its position table to its
projection's output with ``add_``, then concatenates its register token. Both were left
out: the torch.func fallback replays the module with its children's recorded outputs,
and a recorded output changed in place is not what the child returned ("a child's output
that was changed in place is needed"); the projection (``nn.Linear`` on ``[N, P, C]``,
whose output is a view of its matrix product) lost its hook to the in-place change
("no rule for Linear"). Now a row-wise child (``replay.ROW_WISE``) is run again on the
example, and a Linear's output gradient is taken at its matrix product
(``hooks._linear_base``). Exact against one backward pass per example on an
un-prepared float64 copy, for GradientVarianceQuantiles, PerExampleGradNorm and
GradientNoiseScale, at batch sizes 2, odd and the number of tokens, with no warning.
"""

import pytest
import torch
from torch import nn

from tests.models import LogitsOf
from tests.test_regroup import assert_exact_with_structural_zeros, perturbed


class ProjectThenShift(nn.Module):
    """``proj(x).add_(table)``: the Linear's output (a view, for a 3-d input) changed in place."""

    def __init__(self, width=4, tokens=3):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.table = nn.Parameter(torch.randn(tokens, width))

    def forward(self, x):
        x = self.proj(x)
        x.add_(self.table)
        return torch.tanh(x).flatten(1)


def shifted():
    return perturbed(nn.Sequential(ProjectThenShift(), nn.Linear(12, 3)))


def convbert():
    from transformers import ConvBertConfig, ConvBertForSequenceClassification

    config = ConvBertConfig(vocab_size=11, hidden_size=8, embedding_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=8, head_ratio=2, conv_kernel_size=3,
                            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    return LogitsOf(perturbed(ConvBertForSequenceClassification(config)))


def naflexvit():
    """32 pixels, patches of 16: 4 tokens and a register token; a position table of their
    grid (timm's default, 16x16, is interpolated in float32: exact to float32 only). No
    bias on the fused qkv: its key third is zero by structure, rounding noise in the
    reference and in the rows alike, which no comparison of quantiles tells apart."""
    import timm

    return perturbed(timm.create_model("naflexvit_base_patch16_gap", pretrained=False, num_classes=3,
                                       img_size=32, embed_dim=8, depth=1, num_heads=1, mlp_ratio=1.0,
                                       pos_embed_grid_size=(2, 2), qkv_bias=False))


@pytest.mark.parametrize("examples", [2, 3])
def test_a_linear_output_changed_in_place_keeps_its_rows(examples):
    generator = torch.Generator().manual_seed(examples)
    inputs = torch.randn(examples, 3, 4, dtype=torch.float64, generator=generator)
    assert_exact_with_structural_zeros(shifted(), inputs, torch.randint(0, 3, (examples,), generator=generator))


# 2, odd, the sequence length (5).
@pytest.mark.parametrize("examples", [2, 3, 5])
def test_convbert_separable_convolution_bias_is_exact(examples):
    model = convbert()
    assert any(name.endswith("key_conv_attn_layer.bias") for name, _ in model.named_parameters())
    generator = torch.Generator().manual_seed(examples)
    inputs = torch.randint(1, 11, (examples, 5), generator=generator)
    assert_exact_with_structural_zeros(model, inputs, torch.randint(0, 3, (examples,), generator=generator))


# 2, odd, the number of patches (4).
@pytest.mark.parametrize("examples", [2, 3, 4])
def test_naflexvit_patch_embedding_is_exact(examples):
    model = naflexvit()
    assert {"embeds.proj.weight", "embeds.reg_token", "embeds.pos_embed"} <= dict(model.named_parameters()).keys()
    generator = torch.Generator().manual_seed(examples)
    inputs = torch.randn(examples, 3, 32, 32, dtype=torch.float64, generator=generator)
    assert_exact_with_structural_zeros(model, inputs, torch.randint(0, 3, (examples,), generator=generator))
