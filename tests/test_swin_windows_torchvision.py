"""Issue 32, windowed attention: torchvision's Swin (v1 and v2) and timm's SwinV2 on the batch's own pass.

torchvision's ``ShiftedWindowAttention`` takes and returns ``[N, H, W, C]`` and cuts the windows
itself (``shifted_window_attention``), passing its ``qkv`` and ``proj`` layers' weights to
``F.linear`` without calling them. The survey finds those ``F.linear`` calls on rows that are not
examples and makes the layers members of the attention, its own block
(``extensions/fallback/regroup.py``; also in a stage of one window per example, the class having
cut windows in another); the attention's ``Broadcasts`` mode sees each call
(``extensions/fallback/broadcast.py``), so the layers get their rows from the batch's pass as
called members do, the table (v1) or the position-bias MLP and ``logit_scale`` (v2) as broadcast
tensors, and v2's ``qkv`` bias, a copy with its key third zeroed, as a broadcast operand of
``F.linear`` (``extensions/fallback/windows.py``). Before this, the attention was recomputed per
example at every step (the ``torch.func`` fallback). Exact against the float64 brute force
(GradientVarianceQuantiles, PerExampleGradNorm, GradientNoiseScale) on a grid of 6x6 tokens
padded to 8x8 (4 windows of 4x4) with a plain and a shifted block, at batch sizes 2, 3 and the
number of windows, and a second stage of one window per example; windows in another order fail the
proof and are recomputed, exact.
timm's SwinV2 (``qkv``'s weight through ``F.linear`` with a concatenated bias) takes the same
way: ``tests/test_swin_windows_timm.py``.
"""

import types

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.fallback import windows

import pytest
import torch

from tests.cases import classification_losses, key_third_is_zero
from tests.test_regroup import assert_exact_with_structural_zeros, perturbed
from tests.test_swin_windows import _batch, _warm_up, ways  # noqa: F401 - the fixture

IMAGE, WIDTH, WINDOWS = 24, 8, 4  # patches of 4: 6x6 tokens, padded to 8x8: 4 windows of 4x4


def torchvision_swin(v2=False, depths=(2,)):
    """torchvision's ``SwinTransformer`` (``swin_t``'s class; ``swin_v2_t``'s blocks where ``v2``):
    a stage of a plain and a shifted block (shift 2), width 8, 2 heads, windows of 4x4; with
    ``depths=(2, 1)`` a second stage on 3x3 tokens, padded to one window per example."""
    from torchvision.models import swin_transformer as tv

    blocks = {"block": tv.SwinTransformerBlockV2, "downsample_layer": tv.PatchMergingV2} if v2 else {}
    model = tv.SwinTransformer(patch_size=[4, 4], embed_dim=WIDTH, depths=list(depths), num_heads=[2] * len(depths),
                               window_size=[4, 4], mlp_ratio=1.0, stochastic_depth_prob=0.0, num_classes=3, **blocks)
    assert [block.attn.shift_size for block in model.features[1]] == [[0, 0], [2, 2]]
    return perturbed(model)


def _known_zeros(v2):
    """v1: softmax ignores each ``qkv.bias``'s key third (an exact zero); v2 zeroes it in its forward pass."""
    def zero(grads):
        for name, g in grads.items():
            if name.endswith("attn.qkv.bias"):
                key_third_is_zero("attn.qkv.bias", g.shape[1] // 3)({name: g})
    return None if v2 else zero


def test_attention_from_the_batch_pass_is_exact(ways):  # noqa: F811
    """Step 1 proves the map (recomputed), step 2 also recomputes and compares, step 3 is the batch's pass alone."""
    inputs, targets = _batch(3, image=IMAGE)
    prepared = _warm_up(torchvision_swin(), inputs, targets)
    assert ways == {"fast": 2, "recomputed": 4}
    assert_exact_with_structural_zeros(prepared, inputs, targets, known_zeros=_known_zeros(False))
    assert ways == {"fast": 4, "recomputed": 4}


@pytest.mark.parametrize("v2, examples, depths", [(False, 2, (2,)), (False, WINDOWS, (2, 1)), (True, 3, (2,)),
                                                   (True, WINDOWS, (2, 1))])
def test_attention_unconfirmed_is_exact(ways, monkeypatch, v2, examples, depths):  # noqa: F811
    """Without the comparison step (one warm-up step: the proof), the batch's pass alone is exact; with a
    second stage of one window per example, its attention too (its class cuts windows in the first stage:
    ``regroup._hook_one_window``), as a block of one window per example."""
    monkeypatch.setattr(windows, "CONFIRM", False)
    inputs, targets = _batch(examples, image=IMAGE)
    prepared = _warm_up(torchvision_swin(v2, depths), inputs, targets, steps=1)
    assert_exact_with_structural_zeros(prepared, inputs, targets, known_zeros=_known_zeros(v2))
    assert ways == {"fast": sum(depths), "recomputed": sum(depths)}


def test_check_model_gives_every_parameter_exact_rows():
    """``cgn.check_model`` (one tracked step on a fresh copy: the proof's step, recomputed per example)."""
    inputs, targets = _batch(2, image=IMAGE)
    loss_fn, _ = classification_losses("mean")
    frame = cgn.check_model(torchvision_swin(v2=True), inputs, targets, loss_fn, verbose=False)
    assert frame.attrs["coverage"] == 1.0
    assert float(frame["max_rel_error"].max()) < 1e-10, frame


def _windows_one_row_later(monkeypatch):
    """``F.linear`` on the windows each one row later (the last first), and back: the model computes
    the same, but row ``r`` of the layers' calls is example ``(r - 1) // W``'s."""
    from torchvision.models import swin_transformer as tv

    def linear(x, weight, bias=None):
        return torch.nn.functional.linear(x.roll(1, 0), weight, bias).roll(-1, 0)

    monkeypatch.setattr(tv, "F", types.SimpleNamespace(**{**vars(torch.nn.functional), "linear": linear}))


def test_windows_out_of_example_order_are_recomputed(ways, monkeypatch):  # noqa: F811
    """The proof fails: the block is recomputed per example, exact."""
    _windows_one_row_later(monkeypatch)
    inputs, targets = _batch(3, image=IMAGE)
    prepared = _warm_up(torchvision_swin(), inputs, targets)
    assert_exact_with_structural_zeros(prepared, inputs, targets, known_zeros=_known_zeros(False))
    assert ways == {"fast": 0, "recomputed": 6}


def test_the_map_taken_for_granted_would_be_silently_wrong(monkeypatch):
    """What the proof prevents: the same model with the map assumed, unconfirmed, is inexact."""
    _windows_one_row_later(monkeypatch)
    monkeypatch.setattr(windows, "proven", lambda *args: True)
    monkeypatch.setattr(windows, "CONFIRM", False)
    inputs, targets = _batch(3, image=IMAGE)
    prepared = _warm_up(torchvision_swin(), inputs, targets, steps=1)
    with pytest.raises(AssertionError):
        assert_exact_with_structural_zeros(prepared, inputs, targets, known_zeros=_known_zeros(False))


def test_timm_swinv2_stage_of_one_window_per_example_is_exact(ways):  # noqa: F811
    """timm's SwinV2 with a second stage on 3x3 tokens (one window per example, its ``proj`` called on
    rows that are examples): that stage's attention is its own block, ``qkv`` through ``F.linear`` and
    ``proj`` its members, from the batch's pass too."""
    import timm

    model = perturbed(timm.create_model("swinv2_tiny_window8_256", pretrained=False, num_classes=3, img_size=IMAGE,
                                        window_size=4, embed_dim=WIDTH, depths=(2, 1), num_heads=(2, 2), mlp_ratio=1.0))
    inputs, targets = _batch(3, image=IMAGE)
    prepared = _warm_up(model, inputs, targets)
    assert ways == {"fast": 3, "recomputed": 6}
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 6, "recomputed": 6}
