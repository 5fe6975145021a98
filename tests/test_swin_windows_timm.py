"""Issue 32, windowed attention: timm's Swin on the batch's own pass.

timm's ``SwinTransformerBlock`` runs ``WindowAttention`` on ``[N*W, t, C]`` windows; the
attention holds its relative position table itself (a module with the fallback, its input's
rows not examples), so before this its whole block was recomputed per example, ``norm1``,
``norm2`` and ``mlp`` included. Now the block computes its members alone (the attention, its
``qkv`` and ``proj``, found on the windows' rows by the survey) and they get their rows from
the batch's pass (``extensions/fallback/windows.py``), the table as SwinV2's broadcast bias
(``extensions/fallback/broadcast.py``): added to the scores, or, in timm's fused path, passed
to ``scaled_dot_product_attention`` as its mask (expanded to the rows there too). ``norm1`` and
``mlp`` keep their own rules (their rows are examples). Exact against the float64 brute force,
the fused ``qkv`` bias's key third an exact zero (softmax ignores it), on a grid of 6x6 tokens
padded to 8x8 (4 windows of 4x4) with a plain and a shifted block, at batch sizes 2, 3 and the
number of windows. timm's SwinV2 (``qkv``'s weight read through ``F.linear``, its bias a
concatenation of ``q_bias``, the ``k_bias`` buffer and ``v_bias``) takes the same way: the survey
makes ``qkv`` a member whose call is that ``F.linear``, the bias a broadcast operand of it
(``tests/test_swin_windows_torchvision.py``); recomputed (the attention only, not ``norm1`` or
``mlp``) on the proof's and the comparison's steps.
"""

from cockpit_gradnoise.extensions.fallback import blocks

import pytest

from tests.cases import key_third_is_zero
from tests.test_regroup import assert_exact_with_structural_zeros, perturbed
from tests.test_swin_windows import _batch, _warm_up, ways  # noqa: F401 - the fixture

IMAGE, WIDTH, WINDOWS = 24, 8, 4  # patches of 4: 6x6 tokens, padded to 8x8: 4 windows of 4x4


def timm_swin(name="swin_tiny_patch4_window7_224", fused=False):
    """One stage of a plain and a shifted block (shift 2), ``fused``: timm's fused attention."""
    import timm

    model = timm.create_model(name, pretrained=False, num_classes=3, img_size=IMAGE, window_size=4,
                              embed_dim=WIDTH, depths=(2,), num_heads=(2,), mlp_ratio=1.0)
    for module in model.modules():
        if type(module).__name__ == "WindowAttention" and hasattr(module, "fused_attn"):  # (v1's)
            module.fused_attn = fused
    return perturbed(model)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("examples", [2, 3, WINDOWS])
def test_timm_swin_window_layers_from_the_batch_pass_are_exact(ways, fused, examples):  # noqa: F811
    model = timm_swin(fused=fused)
    assert [block.shift_size for block in model.layers[0].blocks] == [(0, 0), (2, 2)]
    inputs, targets = _batch(examples, image=IMAGE)
    prepared = _warm_up(model, inputs, targets)
    assert ways == {"fast": 2, "recomputed": 4}  # step 1: proof, recomputed; step 2: both, compared
    assert_exact_with_structural_zeros(prepared, inputs, targets,
                                       known_zeros=key_third_is_zero("attn.qkv.bias", WIDTH))
    assert ways == {"fast": 4, "recomputed": 4}  # step 3: both blocks from the batch's pass alone


def test_timm_swinv2_window_layers_from_the_batch_pass_are_exact(ways, monkeypatch):  # noqa: F811
    recomputed, vectorized = set(), blocks.vectorized

    def noted(module, block, grad, params):
        recomputed.update(params)
        return vectorized(module, block, grad, params)

    monkeypatch.setattr(blocks, "vectorized", noted)
    inputs, targets = _batch(3, image=IMAGE)
    prepared = _warm_up(timm_swin("swinv2_tiny_window8_256"), inputs, targets)
    assert ways == {"fast": 2, "recomputed": 4}
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 4, "recomputed": 4}
    assert "attn.qkv.weight" in recomputed and "attn.cpb_mlp.0.weight" in recomputed
    assert not any(name.startswith(("norm", "mlp")) for name in recomputed)
