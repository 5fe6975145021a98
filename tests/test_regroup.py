"""Issue 32, class 1 beyond mixture-of-experts: layers with a rule on rows that are not examples.

OPT's decoder layer flattens its tokens (``[N*T, C]``) before ``fc1``, ``fc2`` and
``final_layer_norm``; Swin's window attention runs on ``[N*W, tokens, C]`` windows (and
SwinV2's position-bias MLP on a table without the batch); DBRX's router on flattened
tokens; MobileBERT's head multiplies by its ``decoder``'s weight without calling it. Those
layers were left out (``applied without the batch dimension``), or silently inexact where a
size matched the batch. The model run on one example more (``extensions/fallback/regroup.py``)
finds them, and the smallest module around each that takes and returns the batch first is
run again on each example alone (``extensions/fallback/blocks.py``): exact against one
backward pass per example through a float64 forward pass of the batch, for
GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale, at batch sizes 2, odd,
the sequence length and the number of windows, with no warning.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.library_models import Logits
from tests.test_silent_inexact import assert_exact
from tests.test_tied import assert_left_out_by_name, assert_matches_references

SEQUENCE, VOCAB = 6, 11
# A reference contribution below this share of the network's largest is rounding noise of a
# gradient zero by structure (an attention key's bias: softmax ignores a shift of every score),
# about 1e-17 of it in float64: the package's rows are exact zeros there (the rules' and the
# blocks' structural zeros). 500 eps64: a real gradient that small would fail, not pass.
STRUCTURAL_ZERO = 1e-13


def assert_exact_with_structural_zeros(model, inputs, targets, losses=None, inner_terms=1, left_out=None,
                                       match=None, known_zeros=None):
    """:func:`tests.test_silent_inexact.assert_exact` (no warning allowed), the references'
    structural zeros exact zeros (a parameter's, and those ``known_zeros(grads)`` sets: a fused
    ``qkv`` bias's key third); or, with ``left_out``, that parameter left out by name with a
    warning matching ``match`` and every other one exact."""
    loss_fn, per_example_loss = losses or classification_losses("mean")
    contributions = check.reference_contributions(copy.deepcopy(model), (inputs,), targets, loss_fn)
    scale = max(float(x.abs().max()) for x in contributions.values() if x.numel())
    grads = {name: (x if float(x.abs().max()) > STRUCTURAL_ZERO * scale else torch.zeros_like(x)) * len(inputs)
             for name, x in contributions.items() if x.numel() and name != left_out}
    if known_zeros is not None:
        known_zeros(grads)
    problem = Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs, targets, "mean")
    if left_out is not None:
        quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
        assert_left_out_by_name(problem, quantity, left_out, match)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if left_out is None else "ignore", UserWarning)
        assert_matches_references(problem, inner_terms, grads=grads)


def tokens(examples, length=SEQUENCE, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, examples, length), generator=generator)


def perturbed(model):
    """``model`` in float64, evaluation mode, away from its initialization's zeros."""
    torch.manual_seed(0)
    model = model.double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=VOCAB, hidden_size=8, ffn_dim=12, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=8,
                       dropout=0.0, attention_dropout=0.0)
    return Logits(perturbed(OPTForCausalLM(config)))


def dbrx():
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(  # attn_config's rope_theta and clip_qkv: transformers needs them
        d_model=8, n_heads=2, n_layers=1, vocab_size=VOCAB, max_seq_len=16,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"hidden_size": 8, "ffn_hidden_size": 12, "moe_num_experts": 4, "moe_top_k": 2},
        experts_implementation="eager")
    return Logits(perturbed(DbrxForCausalLM(config)))


@pytest.mark.parametrize("examples", [2, 5, SEQUENCE])
def test_opt_layers_on_flattened_tokens_are_exact(examples):
    inputs, targets = tokens(examples)
    assert_exact_with_structural_zeros(opt(), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)


def test_opt_at_one_token_is_exact():
    """``N*T`` is ``N``: the rows are examples, and each is exact (in the checker's table: at one
    token the attention's query and key weights are zero by structure too, whose rows the
    quantities' comparison cannot tell from the reference's rounding noise)."""
    inputs, targets = tokens(3, length=1)
    frame = cgn.check_model(opt(), inputs, targets, token_losses("mean")[0], verbose=False)
    assert frame.rows.all()
    scale = frame.reference_scale.max()
    errors = frame.max_rel_error * frame.reference_scale / scale  # against the network's scale
    assert (errors < 1e-13).all(), frame[errors >= 1e-13]


@pytest.mark.parametrize("examples", [3, SEQUENCE])
def test_dbrx_router_on_flattened_tokens_and_experts_are_exact(examples):
    inputs, targets = tokens(examples)
    assert_exact(dbrx(), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)


class Pixels(nn.Module):
    """``model(pixel_values).logits`` of a Hugging Face image classifier."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


def swin(family):
    """16 pixels, patches of 2: 8x8 tokens, then 4x4, in windows of 2x2 (16, then 4 windows)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
        window_size=2, mlp_ratio=1.0, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
    return Pixels(perturbed(getattr(transformers, f"{family}ForImageClassification")(config)))


# 2, odd, the number of windows of the last stage (4).
@pytest.mark.parametrize("family, examples", [("Swin", 2), ("Swin", 4), ("Swinv2", 3), ("Swinv2", 4)])
def test_window_attention_is_exact(family, examples):
    torch.manual_seed(examples)
    inputs = torch.randn(examples, 3, 16, 16, dtype=torch.float64)
    assert_exact_with_structural_zeros(swin(family), inputs, torch.randint(0, 3, (examples,)))


class SequenceFirst(nn.Module):
    """A block that runs its layer on ``[T, N, C]``: where ``T`` equals ``N`` the layer's
    output leads with the batch size, and its rows are not examples."""

    def __init__(self, width=4):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):  # [N, T, C]
        return torch.tanh(self.inner(x.transpose(0, 1).cumsum(0)).transpose(0, 1))


class WithSequenceFirst(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.embed, self.block, self.head = nn.Linear(3, width), SequenceFirst(width), nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(1))


@pytest.mark.parametrize("examples", [2, 5])  # 5: the sequence length
def test_a_layer_whose_rows_number_the_batch_by_coincidence_is_exact_through_its_block(examples):
    torch.manual_seed(0)
    inputs, targets = torch.randn(examples, 5, 3, dtype=torch.float64), torch.randint(0, 3, (examples,))
    assert_exact(WithSequenceFirst().double(), inputs, targets)


class SequenceFirstOutput(nn.Module):
    """The model's own output is ``[T, N, 3]``: no module around the layer takes and returns
    the batch first, and at ``T = N`` its rows lead with the batch size."""

    def __init__(self, width=4):
        super().__init__()
        self.embed, self.head = nn.Linear(3, width), nn.Linear(width, 3)

    def forward(self, x):  # [N, T, 3]
        return self.head(torch.tanh(self.embed(x)).transpose(0, 1).cumsum(0))


class SequenceFirstLoss(nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.reduction = reduction

    def forward(self, output, targets):  # output [T, N, 3], targets [N]
        losses = nn.functional.cross_entropy(output[-1], targets, reduction="none")
        return losses.mean() if self.reduction == "mean" else losses


@pytest.mark.parametrize("examples", [2, 5])
def test_a_layer_on_rows_that_are_not_examples_without_a_block_is_refused_by_name(examples):
    torch.manual_seed(0)
    inputs, targets = torch.randn(examples, 5, 3, dtype=torch.float64), torch.randint(0, 3, (examples,))
    model = cgn.prepare_model(SequenceFirstOutput().double())
    problem = Problem(model, SequenceFirstLoss("mean"), SequenceFirstLoss("none"), inputs, targets, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, ("head.weight", "head.bias"),
                            r"\['head.bias', 'head.weight'\].*runs on rows that are not examples.*no module "
                            r"around it")


def mobilebert():
    from transformers import MobileBertConfig, MobileBertForMaskedLM

    config = MobileBertConfig(
        vocab_size=VOCAB, hidden_size=8, embedding_size=4, num_hidden_layers=1, num_attention_heads=2,
        intra_bottleneck_size=8, intermediate_size=8, num_feedforward_networks=1,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(perturbed(MobileBertForMaskedLM(config)))


@pytest.mark.parametrize("examples", [2, 3])
def test_a_weight_its_parent_reads_without_calling_its_layer_is_exact(examples):
    """MobileBERT's head multiplies by ``decoder.weight`` (tied to the word embeddings) and
    ``dense.weight`` without calling them (the embeddings' rows missed the head's use: silently
    inexact, off by 1.0): the smallest module around the head that takes and returns the batch
    first and holds the word embeddings too (the whole model) is run on each example alone,
    and every parameter is exact, the tied weight with both uses (it was left out while the
    block held the head only; the word embedding's ``padding_idx`` is kept under ``vmap`` by
    :func:`cockpit_gradnoise.extensions.fallback.padding.padding_kept`)."""
    inputs, targets = tokens(examples)
    assert_exact_with_structural_zeros(mobilebert(), inputs, targets, token_losses("mean"), SEQUENCE)
