"""Issue 32, speed of windowed attention: Swin's window layers from the batch's own pass.

``transformers``' ``SwinLayer`` runs its attention on windows, ``[N*W, t, C]``. Its
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and relative position bias table get each
example's contributions from the batch's backward pass, summed over the rows of the
example's windows, once the rows' map to the examples is proven by NaN-poisoned passes
(``extensions/fallback/windows.py``); the block is no longer run again per example. Exact
against the float64 brute force (one backward pass per example through the batch's forward
pass) for GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale, with the key
bias's structural zeros, on shifted windows of a grid padded to a multiple of the window, at
batch sizes 2, 3 and the number of windows (4), and at one window per example. A model whose windows are
ordered otherwise (each window one row later in the batch: still independent examples, but
row ``r`` is no longer example ``r // W``'s) fails the proof and is recomputed per example,
exact; taking the map for granted there would be silently wrong (asserted too).
SwinV2 (its attention's ``logit_scale`` and position-bias MLP, broadcast over the rows) takes
the same way, also where its attention is the block itself (one window per example). timm's Swin
(the table a parameter of the attention module itself) takes it too: ``tests/test_swin_windows_timm.py``.
"""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.fallback import blocks, windows

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear

from tests.cases import Problem, classification_losses, run_step, token_losses
from tests.test_regroup import SEQUENCE, Pixels, assert_exact_with_structural_zeros, opt, perturbed, tokens

IMAGE = 12  # patches of 2: 6x6 tokens, padded to 8x8: 4 windows of 4x4
WINDOWS = 4


def swin(image=IMAGE, depths=(2,), family="Swin"):
    """Stages of ``depths`` blocks, every second one shifted; float64, evaluation mode."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        image_size=image, patch_size=2, num_channels=3, embed_dim=8, depths=list(depths),
        num_heads=[2] * len(depths), window_size=4, mlp_ratio=1.0, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return Pixels(perturbed(getattr(transformers, f"{family}ForImageClassification")(config)))


@pytest.fixture
def ways(monkeypatch):
    """``{"fast": blocks from the batch's pass, "recomputed": blocks run again per example}``, per step."""
    found = {"fast": 0, "recomputed": 0}
    fast, recomputed = windows._results, blocks.vectorized

    def counted_fast(*args):
        result = fast(*args)
        found["fast"] += bool(result)
        return result

    def counted_recomputed(*args):
        found["recomputed"] += 1
        return recomputed(*args)

    monkeypatch.setattr(windows, "_results", counted_fast)
    monkeypatch.setattr(blocks, "vectorized", counted_recomputed)
    return found


def _warm_up(model, inputs, targets, steps=2, losses=None):
    """Two tracked steps: the first proves the map, the second confirms the fast way against the
    recomputation. Returns the prepared model."""
    prepared = cgn.prepare_model(model)
    loss_fn, per_example_loss = losses or classification_losses("mean")
    problem = Problem(prepared, extend(loss_fn), per_example_loss, inputs, targets, "mean")
    for step in range(steps):
        quantities = [cgn.PerExampleGradNorm(linear(1), param_names=problem.names)]
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            run_step(problem, quantities, step=step)
    return prepared


def _batch(examples, image=IMAGE):
    generator = torch.Generator().manual_seed(examples)
    inputs = torch.randn(examples, 3, image, image, dtype=torch.float64, generator=generator)
    return inputs, torch.randint(0, 3, (examples,), generator=generator)


@pytest.mark.parametrize("family", ["Swin", "Swinv2"])
def test_window_layers_from_the_batch_pass_are_exact(ways, family):
    """Swin; and SwinV2, whose attention reads its ``logit_scale`` in its own forward and adds a
    bias its MLP computes from a table without the batch: both broadcast over the windows' rows,
    expanded there, each example's share from its rows' gradient
    (``extensions/fallback/broadcast.py``). Shifted windows of a padded grid."""
    inputs, targets = _batch(3)
    prepared = _warm_up(swin(family=family), inputs, targets)
    assert ways == {"fast": 2, "recomputed": 4}  # step 1: proof, recomputed; step 2: both, compared
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 4, "recomputed": 4}  # step 3: the two blocks from the batch's pass alone


@pytest.mark.parametrize("family", ["Swin", "Swinv2"])
@pytest.mark.parametrize("examples", [2, WINDOWS])
def test_window_layers_unconfirmed_are_exact(ways, monkeypatch, examples, family):
    """Without the comparison step (one warm-up step: the proof), the fast way alone is exact."""
    monkeypatch.setattr(windows, "CONFIRM", False)
    inputs, targets = _batch(examples)
    prepared = _warm_up(swin(family=family), inputs, targets, steps=1)
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 2, "recomputed": 2}


@pytest.mark.parametrize("family", ["Swin", "Swinv2"])
def test_one_window_per_example_is_exact(ways, family):
    """16 pixels: 8x8 tokens (4 windows), then 4x4, one window: there the rows of the attention's
    layers are examples (their own rules) and only its position bias table is a member, its
    block the attention itself, the table expanded to the rows of the attention's input
    (SwinV2: the attention, direct, is the block, its members the position-bias MLP's layers)."""
    inputs, targets = _batch(3, image=16)
    prepared = _warm_up(swin(image=16, depths=(2, 1), family=family), inputs, targets)
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 6, "recomputed": 6}


def _windows_one_row_later(monkeypatch):
    """Every window one row later in the batch (the last first), and back: the model computes
    the same, but row ``r`` of the attention is example ``(r - 1) // W``'s."""
    from transformers.models.swin import modeling_swin

    partition, reverse = modeling_swin.window_partition, modeling_swin.window_reverse
    monkeypatch.setattr(modeling_swin, "window_partition", lambda x, size: partition(x, size).roll(1, 0))
    monkeypatch.setattr(modeling_swin, "window_reverse", lambda w, *args: reverse(w.roll(-1, 0), *args))


def test_windows_that_are_not_in_example_order_are_recomputed(ways, monkeypatch):
    _windows_one_row_later(monkeypatch)
    inputs, targets = _batch(3)
    prepared = _warm_up(swin(), inputs, targets)
    assert_exact_with_structural_zeros(prepared, inputs, targets)
    assert ways == {"fast": 0, "recomputed": 6}


def test_the_map_taken_for_granted_would_be_silently_wrong(monkeypatch):
    """What the proof prevents: the same model with the map assumed, unconfirmed, is inexact."""
    _windows_one_row_later(monkeypatch)
    monkeypatch.setattr(windows, "proven", lambda *args: True)
    monkeypatch.setattr(windows, "CONFIRM", False)
    inputs, targets = _batch(3)
    prepared = _warm_up(swin(), inputs, targets)
    with pytest.raises(AssertionError):
        assert_exact_with_structural_zeros(prepared, inputs, targets)



def test_opt_flattened_tokens_from_the_batch_pass_are_exact(ways):
    """OPT's decoder layer: ``final_layer_norm``, ``fc1`` and ``fc2`` on the flattened tokens
    ``[N*T, C]`` (row ``r`` example ``r // T``'s), the LayerNorm's rows ``G_r * x_hat_r`` and
    ``G_r``, from the batch's pass; its integer ``position_ids`` per example kept as they are in
    the NaN passes (their values part of the proof)."""
    inputs, targets = tokens(3)
    prepared = _warm_up(opt(), inputs, targets, losses=token_losses("mean"))
    assert ways == {"fast": 1, "recomputed": 2}  # step 1: proof, recomputed; step 2: both, compared
    assert_exact_with_structural_zeros(prepared, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert ways == {"fast": 2, "recomputed": 2}  # step 3: from the batch's pass alone


@pytest.mark.parametrize("examples", [2, SEQUENCE])
def test_opt_unconfirmed_is_exact(ways, monkeypatch, examples):
    """The fast way alone (no comparison step), at 2 and at the batch size equal to the length."""
    monkeypatch.setattr(windows, "CONFIRM", False)
    inputs, targets = tokens(examples)
    prepared = _warm_up(opt(), inputs, targets, steps=1, losses=token_losses("mean"))
    assert_exact_with_structural_zeros(prepared, inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)
    assert ways == {"fast": 1, "recomputed": 1}


class _Scaled(torch.nn.Module):
    """Rows ``[R, 2, 3]`` scaled by a tensor of its parameter alone, then (``matmul``) multiplied
    by another one: the first a broadcast the windows' way expands, the second a use it does not know."""

    def __init__(self, matmul=False):
        super().__init__()
        self.scale, self.mixer = torch.nn.Parameter(torch.ones(2, 1)), torch.nn.Parameter(torch.eye(3))
        self.matmul = matmul

    def forward(self, rows):
        scaled = rows * self.scale.exp()
        return scaled @ (2 * self.mixer) if self.matmul else scaled


@pytest.mark.parametrize("matmul", [False, True])
def test_broadcasts_expand_a_batch_free_tensor_and_refuse_other_uses(matmul):
    from cockpit_gradnoise.extensions.fallback.broadcast import Broadcasts, example_shares, summed_per_example

    module, rows = _Scaled(matmul), torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    module.double()
    kept = {}

    def expand(k, expanded):
        expanded.register_hook(lambda grad: kept.update({k: summed_per_example(grad, 3)}))
        return expanded

    with Broadcasts(module, 6, expand) as mode:
        out = module(rows)
    assert mode.broken == matmul and len(mode.operands) == 1 and mode.operands[0][1] == (1, 2, 1)
    out.pow(2).sum().backward()
    shares = example_shares(mode, kept, [module.scale])[0]  # rows 2i, 2i+1: example i's
    expected = torch.stack([torch.autograd.grad(module(rows[2 * i : 2 * i + 2].detach()).pow(2).sum(),
                                                module.scale)[0] for i in range(3)])
    if not matmul:
        torch.testing.assert_close(shares, expected, rtol=1e-12, atol=0)
