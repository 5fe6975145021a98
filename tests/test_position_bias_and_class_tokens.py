"""Issue 32, class 4 (b, c): relative position bias tables, and CvT's stage class token.

(b) A relative position bias table is indexed in its module's own forward and added to the
attention scores, batch-free, broadcast over batch x windows x heads: timm's Swin
(``WindowAttention.relative_position_bias_table``, on ``[N*W, heads, tokens, tokens]``
windows) and CoAtNet's ``RelPosBias`` (timm's ``maxxvit``). The module around the table whose
input and output lead with the batch is run again on each example alone
(``extensions/fallback/regroup.py``, ``blocks.py``): each example's contribution is the sum
over its own windows (at the first tracked step, this test's; from the next on, timm's Swin
takes the windows' way: ``tests/test_swin_windows_timm.py``). Exact against one backward pass
per example on an un-prepared float64 copy, for GradientVarianceQuantiles, PerExampleGradNorm
and GradientNoiseScale, at batch sizes 2, 3 and the number of windows of the last stage.
Hugging Face's Swin and SwinV2 are in ``tests/test_regroup.py``.

(c) CvT's last stage (``CvtStage``) returns its hidden states, which the classifier does not
use, then its class token: the first output gets no gradient, so the module's hook never
ran (its ``cls_token`` was counted in "layers of class unknown", then left out by name). The
first output's gradient is exactly zero (it reached no loss): the module is computed at the
end of the backward pass with that gradient of zeros and its class token's, and is exact.
"""

import dataclasses
import warnings

import cockpit_gradnoise as cgn

import pytest
import torch

from tests.test_regroup import Pixels, assert_exact_with_structural_zeros, perturbed

# Without the fused qkv's bias: its key third is zero by structure (softmax ignores a shift of
# every score of a query), rounding noise in the reference and in the recomputed rows alike,
# which no comparison of its quantiles can tell apart (not this test's subject).


def timm_swin():
    """32 pixels, patches of 4: 8x8 tokens in 16 windows of 2x2, then 4x4 tokens in 4."""
    import timm

    return perturbed(timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=32,
        window_size=2, embed_dim=8, depths=(1, 1), num_heads=(1, 2), mlp_ratio=1.0, qkv_bias=False))


def coatnet():
    """timm's CoAtNet (``coatnet_nano_rw``'s configuration, shrunk): a conv stage, then a
    transformer stage whose attention adds ``RelPosBias``'s table to its scores."""
    from timm.models import maxxvit

    base = maxxvit.model_cfgs["coatnet_nano_rw"]
    cfg = dataclasses.replace(
        base, embed_dim=(8, 16), depths=(1, 1), block_type=("C", "T"), stem_width=(8, 8),
        transformer_cfg=dataclasses.replace(base.transformer_cfg, dim_head=8, expand_ratio=1.0,
                                            attn_bias=False),
        conv_cfg=dataclasses.replace(base.conv_cfg, expand_ratio=1.0))
    torch.manual_seed(0)
    return perturbed(maxxvit.MaxxVit(cfg, img_size=32, num_classes=3))


def images(examples):
    generator = torch.Generator().manual_seed(examples)
    return (torch.randn(examples, 3, 32, 32, dtype=torch.float64, generator=generator),
            torch.randint(0, 3, (examples,), generator=generator))


# 2, odd, the number of windows of the last stage (4).
@pytest.mark.parametrize("examples", [2, 3, 4])
def test_timm_swin_relative_position_bias_tables_are_exact(examples):
    model = timm_swin()
    assert any(name.endswith("relative_position_bias_table") for name, _ in model.named_parameters())
    assert_exact_with_structural_zeros(model, *images(examples))


@pytest.mark.parametrize("examples", [2, 3])
def test_coatnet_relative_position_bias_tables_are_exact(examples):
    model = coatnet()
    tables = [name for name, module in model.named_modules() if type(module).__name__ == "RelPosBias"]
    assert tables
    assert_exact_with_structural_zeros(model, *images(examples))


def cvt():
    """(Stage ``s`` reads its ``depth[s]``-th drop-path rate: ``depth[s] > s``.)"""
    from transformers import CvtConfig, CvtForImageClassification

    config = CvtConfig(
        num_channels=3, patch_sizes=[7, 3, 3], patch_stride=[4, 2, 2], patch_padding=[2, 1, 1],
        embed_dim=[8, 8, 8], num_heads=[1, 1, 2], depth=[1, 2, 3], mlp_ratio=[1.0, 1.0, 1.0],
        drop_rate=[0.0, 0.0, 0.0], attention_drop_rate=[0.0, 0.0, 0.0], drop_path_rate=[0.0, 0.0, 0.0],
        cls_token=[False, False, True], num_labels=3)
    model = perturbed(CvtForImageClassification(config))
    # The key projection's BatchNorm bias shifts every key of a channel alike, which softmax
    # ignores: a gradient zero by structure, rounding noise in the reference and in the
    # BatchNorm rule's rows alike (not this test's subject).
    for name, param in model.named_parameters():
        if "convolution_projection_key" in name and name.endswith("normalization.bias"):
            param.requires_grad_(False)
    return Pixels(model)


@pytest.mark.parametrize("examples", [3])
def test_cvt_stage_class_token_is_exact_though_only_a_later_output_reaches_the_loss(examples):
    model = cvt()
    assert any(name.endswith("stages.2.cls_token") for name, _ in model.named_parameters())
    assert_exact_with_structural_zeros(model, *images(examples))


def test_a_drop_path_run_again_inside_a_module_is_given_the_batch_draws():
    """timm's BEiT in training mode, float32: its ``cls_token`` is used in ``Beit``'s own forward,
    whose recomputation per example runs the blocks' drop path again; each example is given its
    part of the batch's draws (``extensions/fallback/draws.py``, exact in float64 in
    ``tests/test_random_draws.py``): no warning, every parameter has rows."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("beit_base_patch16_224", pretrained=False, num_classes=3, img_size=32,
                              patch_size=8, embed_dim=16, depth=2, num_heads=2, drop_path_rate=0.2,
                              init_values=0.1).train()
    inputs, targets = images(3)
    tracked, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
    losses = torch.nn.functional.cross_entropy(tracked(inputs.float()), targets, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with tracker(0, losses) as loss:
            loss.backward()
    rows = tracker.get_output()[0]["PerExampleGradNorm"]
    assert {"cls_token", "blocks.1.gamma_1", "head.weight"} <= set(rows)


# (d) A parameter expanded over the batch by its module's own forward ------------------------


def test_perceivers_latents_and_position_table_expanded_over_the_batch_are_exact():
    """Perceiver's ``PerceiverEmbeddings`` returns ``self.latents.expand(batch_size, -1, -1)``
    and its trainable position encoding its table expanded the same way: no input leads with
    the batch, and the fallback refused both. Example ``i``'s contribution is its row of the
    output's gradient (``extensions/fallback/running.py``, ``expanded_parameter``), where the
    survey saw the rows follow the batch. Against check_model's per-example float64 loop."""
    from experiments import sweep_models

    case = sweep_models.build("transformers", "perceiver")
    frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)
    table = frame.set_index("param")
    for name in ("model.perceiver.embeddings.latents",
                 "model.perceiver.decoder.output_position_encodings.position_embeddings"):
        assert table.rows[name] and table.max_rel_error[name] < 1e-10, table.loc[name]
    # every row exact; a gradient zero by structure (a key's bias) against the network's scale
    errors = table.max_rel_error * table.reference_scale / table.reference_scale.max()
    relative = table.max_rel_error.where(table.reference_scale > 1e-8 * table.reference_scale.max(), errors)
    assert (relative[table.rows] < 1e-10).all(), relative[table.rows].sort_values().tail()


class ExpandedTo(torch.nn.Module):
    """A table ``[1, C]`` expanded to the sequence length, not the batch: ``[T, C]``."""

    def __init__(self, width):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(1, width))

    def forward(self, length: int):
        return self.table.expand(length, -1)


class AddsExpanded(torch.nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.embed, self.expanded, self.head = (torch.nn.Linear(3, width), ExpandedTo(width),
                                                torch.nn.Linear(width, 3))

    def forward(self, x):  # [N, T, 3]
        hidden = torch.tanh(self.embed(x) * self.expanded(x.shape[1]))
        return self.head(hidden.mean(1))


@pytest.mark.parametrize("examples", [2, 5])  # 5: the length, the expanded rows' number
def test_a_parameter_expanded_to_a_size_equal_to_the_batch_by_chance_is_not_read_per_example(examples):
    """Its rows are positions, whatever their number: exact through its block, never the
    positions' gradients taken for examples'."""
    torch.manual_seed(0)
    x, y = torch.randn(examples, 5, 3, dtype=torch.float64), torch.randint(0, 3, (examples,))
    frame = cgn.check_model(AddsExpanded().double(), x, y, torch.nn.CrossEntropyLoss(), verbose=False)
    table = frame.set_index("param")
    assert (table.max_rel_error[table.rows] < 1e-10).all(), table
