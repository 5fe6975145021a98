"""Issue 32: a tied parameter whose layer is called several times, or is not a Linear or an Embedding.

A tied parameter's per-example contribution is the sum over its uses,
``x_i = sum_u x_i^(u)`` (``extensions/tied.py``). Each *call* of a layer that holds it
is a use of its own (LED's shared embedding, called by its encoder and its decoder and
tied to the head: tests/test_embedding_subclasses.py), and a use by a layer of any class
called with one tensor is recomputed per example (``tied.RecomputedUse``: Zamba's RMSNorm
weights shared by its two hybrid layers, I-BERT's ``QuantEmbedding`` tied to its head).
Before, these were left out by name ("calls of a tied layer are not summed yet", "tied
parameters are combined over the weights of layers that compute a Linear's or an
Embedding's function only"). Here every parameter is exact against one backward pass per
example through a float64 forward pass of the batch on an un-prepared copy, with no
warning, for GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale; the real
``transformers`` classes from tiny configurations; and what stays refused. Also two
silently wrong numbers met on the way (an embedding's padding row under ``vmap``, NaN
output gradients at padding positions) and a Mamba mixer given its model's fresh cache.
"""

import cockpit_gradnoise as cgn

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.test_repeated_layers import MaskedLM, TiedAndCalledTwice, tokens, without_key_biases
from tests.test_silent_inexact import assert_exact
from tests.test_tied import TiedToANorm, assert_left_out_by_name

SEQUENCE = 5  # (tests.test_repeated_layers.tokens: 5 positions, 11 tokens)


@pytest.mark.parametrize("examples", [3, SEQUENCE])
def test_an_embedding_called_twice_and_tied_to_the_head_is_exact(examples):
    torch.manual_seed(0)
    (inputs, _), targets = tokens(examples), torch.randint(0, 3, (examples,))
    assert_exact(TiedAndCalledTwice().double(), inputs, targets, inner_terms=2 * SEQUENCE)


@pytest.mark.parametrize("examples", [3, SEQUENCE])
def test_a_layer_norm_weight_tied_to_a_linear_bias_is_exact(examples):
    """Both uses recomputed per example (neither is a Linear's or an Embedding's weight)."""
    torch.manual_seed(0)
    (inputs, _), targets = tokens(examples), torch.randint(0, 3, (examples,))
    model = Classify(TiedToANorm()).double()
    assert_exact(model, inputs, targets, inner_terms=SEQUENCE)


class Classify(nn.Module):
    """A token model's logits averaged over the positions (3 classes)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx).mean(1)[:, :3]


def zamba():
    """A tiny float64 Zamba: its shared transformer block runs in its two hybrid layers, whose
    RMSNorm weights are tied (two ZambaRMSNorm objects holding one tensor)."""
    import transformers

    config = transformers.ZambaConfig(
        vocab_size=11, hidden_size=8, attention_hidden_size=16, intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=2, attention_head_dim=8, num_key_value_heads=2,
        n_mamba_heads=2, mamba_d_state=4, mamba_dt_rank=2, max_position_embeddings=16,
        layers_block_type=["mamba", "hybrid", "hybrid"], use_mamba_kernels=False,
        use_cache=False, tie_word_embeddings=True, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.ZambaForCausalLM(config).double().eval()
    first, second = model.model.layers[1].shared_transf, model.model.layers[2].shared_transf
    assert first.input_layernorm is not second.input_layernorm
    assert first.input_layernorm.weight is second.input_layernorm.weight
    for name, param in model.named_parameters():
        # (the Mamba mixers' dt bias gets gradients near 1e-33, whose relative error is
        # rounding of a cancelling sum; the mixers are checked by the sweep's row)
        param.requires_grad_(".mamba." not in name)
    return MaskedLM(model)


def ibert(tied=True):
    """A tiny float64 I-BERT: its word embedding, a QuantEmbedding, is tied to its head; the
    token 1 is its padding (``tests.test_repeated_layers.tokens`` draws it)."""
    import transformers

    config = transformers.IBertConfig(pad_token_id=1,
        vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=16, quant_mode=False,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.IBertForMaskedLM(config).double().eval()
    assert (model.lm_head.decoder.weight is model.ibert.embeddings.word_embeddings.weight) == tied
    assert type(model.ibert.embeddings.word_embeddings).__name__ == "QuantEmbedding"
    return without_key_biases(MaskedLM(model))


@pytest.mark.parametrize("make, examples", [(zamba, 3), (ibert, 3), (ibert, SEQUENCE)])
def test_transformers_tied_uses_are_exact(make, examples):
    """(LED, its shared embedding called twice by its encoder, for its tokens and its padding,
    once by its decoder, and tied to the head: tests/test_embedding_subclasses.py.)"""
    inputs, targets = tokens(examples)
    assert (inputs[1:] == 1).any()  # the padding token after the first example
    assert_exact(make(), inputs, targets, token_losses("mean"), inner_terms=2 * SEQUENCE)


# The padding row under vmap (extensions/fallback/padding.py) -------------------------------


def test_an_untied_quant_embedding_with_padding_tokens_is_exact():
    """The fallback's recomputation of I-BERT's QuantEmbedding (``F.embedding`` with its
    ``padding_idx``): vmap gave the padding row the padding positions' gradients for every
    example but the first (silently off by 7-60% per example before)."""
    inputs, targets = tokens(3)
    assert (inputs[1:] == 1).any()
    assert_exact(ibert(tied=False), inputs, targets, token_losses("mean"), inner_terms=SEQUENCE)


class PaddedTwice(nn.Module):
    """An embedding with a padding index called twice (its calls recomputed per example)."""

    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 6, padding_idx=1), nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.embedding(idx) + self.embedding(idx.flip(1))).mean(1))


def test_an_embedding_with_padding_called_twice_is_exact():
    torch.manual_seed(0)
    (inputs, _), targets = tokens(3), torch.randint(0, 3, (3,))
    assert (inputs[1:] == 1).any()
    assert_exact(PaddedTwice().double(), inputs, targets, inner_terms=2 * SEQUENCE)


class TwoInputs(nn.Module):
    """A layer that takes two tensors, ``x * weight + y``: its use is not recomputed."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x, y):
        return x * self.weight + y


class TiedToATwoInputLayer(nn.Module):
    """A LayerNorm's weight also the weight of a layer called with two tensors."""

    def __init__(self):
        super().__init__()
        self.embedding, self.norm, self.head = nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 3)
        self.mix = TwoInputs(self.norm.weight)

    def forward(self, idx):
        h = self.embedding(idx)
        return self.head(torch.tanh(self.mix(self.norm(h), h)).mean(1))


def test_a_tied_use_that_cannot_be_recomputed_is_left_out_by_name():
    torch.manual_seed(0)
    loss_fn, per_example_loss = classification_losses("mean")
    (inputs, _), targets = tokens(3), torch.randint(0, 3, (3,))
    problem = Problem(cgn.prepare_model(TiedToATwoInputLayer().double()), extend(loss_fn),
                      per_example_loss, inputs, targets, "mean")
    quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, "norm.weight",
                            r"\['norm.weight'\].*tied and used as the weight of a TwoInputs")


class NaNAtPadding(torch.autograd.Function):
    """The identity, whose backward pass gives NaN at the padding positions (LED's encoder
    gives its padding tokens' lookups NaN output gradients): torch's embedding backward
    ignores those positions, and so must the rule."""

    @staticmethod
    def forward(y, padding):
        return y.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.padding = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return torch.where(ctx.padding.unsqueeze(-1), torch.nan, grad), None


class NaNPadded(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.head = nn.Embedding(11, 6, padding_idx=1), nn.Linear(6, 3)

    def forward(self, idx):
        h = NaNAtPadding.apply(self.embedding(idx), idx == 1)
        return self.head(torch.tanh(h).mean(1))


def test_nan_output_gradients_at_padding_positions_reach_no_row():
    torch.manual_seed(0)
    (inputs, _), targets = tokens(3), torch.randint(0, 3, (3,))
    assert (inputs == 1).any()
    assert_exact(NaNPadded().double(), inputs, targets, inner_terms=SEQUENCE)


def test_calls_of_a_tied_layer_in_two_forward_passes_are_not_combined():
    """Two forward passes, one backward pass of both losses: the calls of different forward
    passes are different examples, never combined per row; the tied weight is left out by
    name (as every layer called in both: tests/test_repeated_layers.py)."""
    torch.manual_seed(0)
    loss_fn, per_example_loss = classification_losses("mean")
    (inputs, _), targets = tokens(3), torch.randint(0, 3, (3,))
    model = cgn.prepare_model(TiedAndCalledTwice().double())
    names = [name for name, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(list(model.parameters()), quantities=[cgn.PerExampleGradNorm(linear(1), param_names=names)])
    losses = per_example_loss(model(inputs), targets) + per_example_loss(model(inputs.flip(0)), targets)
    with pytest.warns(UserWarning, match=r"'embedding.weight': its layers' calls belong to several forward"):
        with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    assert "embedding.weight" not in cockpit.get_output()[0]["PerExampleGradNorm"]


# A Mamba mixer given the cache its model creates (extensions/fallback/caches.py) ---------------


def test_granite_hybrid_mamba_mixer_with_its_models_fresh_cache_gets_rows():
    """``GraniteMoeHybridForCausalLM`` creates a cache in every forward pass (``use_cache``)
    and its Mamba mixer writes its convolution and recurrent states there; the mixer's
    recomputation per example found the batch's states (``torch.cat`` of 4 and 1 rows) and
    ``dt_bias``, ``A_log``, ``D`` and ``conv1d`` were left out. A linear-attention layer the
    call filled from empty is now left out of the recomputation, as a dynamic layer is: every
    parameter has rows, the mixer's to float32's rounding (its scan computes in float32:
    ``dt.float()``), every other to 1e-10."""
    import transformers

    config = transformers.GraniteMoeHybridConfig(
        vocab_size=11, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=8,
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=2, mamba_n_groups=1,
        mamba_d_state=4, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        use_cache=True, experts_implementation="eager", attn_implementation="eager")
    torch.manual_seed(0)
    model = MaskedLM(transformers.GraniteMoeHybridForCausalLM(config).double().eval())
    inputs, targets = tokens(3)
    frame = cgn.check_model(model, (inputs,), targets, token_losses("mean")[0], verbose=False)
    mixer = frame.param.str.contains(r"\.mamba\.(?:dt_bias|A_log|D|conv1d\.)")
    assert mixer.sum() == 5 and frame.rows.all(), frame.param[~frame.rows].tolist()
    assert (frame.max_rel_error[mixer] < 1e-5).all()
    assert (frame.max_rel_error[~mixer] < 1e-10).all()


def test_a_recomputed_use_that_raises_is_left_out_by_name_and_the_step_kept(monkeypatch):
    """A use's recomputation that fails in the backward pass (a forward ``vmap`` cannot run)
    refuses the tied parameter, naming why; the backward pass and the step go on."""
    from cockpit_gradnoise.extensions import tied

    def fails(self, start, stop):
        raise RuntimeError("vmap: data-dependent control flow")

    monkeypatch.setattr(tied.RecomputedUse, "formed", fails)
    torch.manual_seed(0)
    loss_fn, per_example_loss = classification_losses("mean")
    (inputs, _), targets = tokens(3), torch.randint(0, 3, (3,))
    problem = Problem(cgn.prepare_model(Classify(TiedToANorm()).double()), extend(loss_fn),
                      per_example_loss, inputs, targets, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, "model.norm.weight",
                            r"\['model.norm.weight'\].*cannot be recomputed per example \(RuntimeError")
