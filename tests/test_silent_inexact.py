"""Issue 32, class 3: numbers that were wrong with no warning, against float64 per-example loops.

Real library classes from tiny random configs (nothing downloaded), float64, at the
batch sizes where the old path went wrong:

- a tied weight whose embedding class overrides ``forward`` (Gemma's scaled word
  embedding shares its weight with the head): the cross terms of its two uses were
  formed at the scaled output, off by the scale;
- a batch-free input whose leading size equals the batch size (Funnel's ``cls_mask``
  at batch 4): the torch.func fallback took it for per-example input;
- an eval-mode cache of a tensor computed from a parameter (timm's LeViT
  ``attention_bias_cache``): the recomputation read the cache, rows of zeros;
- a second backward pass without ``zero_grad``: GradientNoiseScale mixed
  ``param.grad`` (both batches) with this batch's per-example sums;
- a NumPy integer step, and the explicit API under autocast on a model extended by
  ``backpack.extend`` alone.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check, references
from cockpit_gradnoise.extensions import (
    SUMS_SAVEFIELD,
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
    fallback,
)

import pytest
import torch
from backpack import backpack, extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, classification_losses, token_losses
from tests.library_models import Logits
from tests.models import LogitsOf
from tests.test_tied import assert_matches_references


def extensions():
    return PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient()


def assert_exact(model, inputs, targets, losses=None, inner_terms=1, steps_before=0):
    """GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale of the prepared
    ``model`` (mean reduction) against ``g_i`` from one backward pass per example through
    one float64 forward pass of the batch on an un-prepared copy
    (``check.reference_contributions``): models that compute parts in float32 (Gemma's
    RMSNorm) round the same there; no warning (no refusal) allowed. ``steps_before``: plain
    steps of the prepared model first (forward and backward, no quantity)."""
    loss_fn, per_example_loss = losses or classification_losses("mean")
    contributions = check.reference_contributions(
        copy.deepcopy(model), (inputs,), targets, loss_fn)
    grads = {name: x * len(inputs) for name, x in contributions.items()}  # x_i = g_i / N
    problem = Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs,
                      targets, "mean")
    for _ in range(steps_before):
        problem.loss_fn(problem.model(inputs), targets).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert_matches_references(problem, inner_terms, grads=grads)


# 1. A tied weight whose embedding overrides forward ---------------------------------------


def gemma(config, family):
    """A tiny ``<family>ForCausalLM`` with its head tied to the scaled word embedding.

    The RMSNorm weights are frozen: Gemma's RMSNorm computes in float32 whatever the
    model's dtype (``x.float()``), so no float64 reference is exact to 1e-10 there.
    """
    import transformers

    config = getattr(transformers, config)(
        vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=16,
        tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).double().eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        param.requires_grad_("norm" not in name)
    return Logits(model)


@pytest.mark.parametrize("config, family", [
    ("GemmaConfig", "Gemma"), ("Gemma2Config", "Gemma2"), ("Gemma3TextConfig", "Gemma3")])
def test_a_tied_scaled_word_embedding_is_exact(config, family):
    torch.manual_seed(1)
    inputs, targets = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    assert_exact(gemma(config, family), inputs, targets, token_losses("mean"), inner_terms=2 * 5)


# 3. A cache of a tensor computed from a parameter --------------------------------------------


def randomized(model):
    """``model`` in float64, evaluation mode, every parameter drawn (timm initializes the
    attention biases and the last BatchNorm weight of each branch to zero)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return model.double().eval()


def levit():
    from timm.models.levit import Levit

    model = randomized(Levit(img_size=32, num_classes=3, embed_dim=(16,), key_dim=4, depth=(1,),
                             num_heads=(2,)))
    # Its blocks' BatchNorm1d run on the tokens flattened to [B*N, C] (issue 32's class 1).
    for name, param in model.named_parameters():
        param.requires_grad_(not (name.startswith("stages") and ".bn." in name))
    return model


def efficientformer():
    from timm.models.efficientformer import EfficientFormer

    # Its attention is built for 7 x 7 positions: the last stage of a 224 x 224 image.
    model = randomized(EfficientFormer(depths=(1, 1, 1, 1), embed_dims=(4, 4, 4, 8), num_vit=1,
                                       num_classes=3, mlp_ratios=2, img_size=224))
    # The key part of the fused qkv bias has a gradient of exactly zero, computed as
    # rounding noise, whose sd no reference matches (structural zeros, issue 19).
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith("qkv.bias"))
    return model


@pytest.mark.parametrize("make, size", [(levit, 32), (efficientformer, 224)])
@pytest.mark.parametrize("steps_before", [0, 1])
def test_an_eval_mode_attention_bias_cache_gives_exact_rows(make, size, steps_before):
    """Read from ``attention_bias_cache`` in evaluation mode, the biases' rows were zeros;
    after a first step the cache holds that step's graph, which a second backward pass of
    the plain model cannot go through (the tracked model computes it again, as in training)."""
    model = make()
    attention = next(m for m in model.modules() if hasattr(m, "attention_bias_cache"))
    torch.manual_seed(1)
    inputs, targets = torch.randn(3, 3, size, size, dtype=torch.float64), torch.randint(0, 3, (3,))
    assert_exact(model, inputs, targets, inner_terms=16, steps_before=steps_before)
    assert attention.attention_bias_cache  # the model still caches


# 2. A batch-free input whose leading size equals the batch size ------------------------------


def funnel():
    """``FunnelForSequenceClassification``: two blocks, the second on 8 / 2 = 4 positions,
    whose attention gets ``cls_mask`` (``[4, 8]``, batch-free) beside the attention mask
    (``[B, 8]``, built from the batch's shape)."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    config = FunnelConfig(
        vocab_size=11, block_sizes=[1, 1], num_decoder_layers=1, d_model=8, n_head=2, d_head=4,
        d_inner=16, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=16, num_labels=3)
    torch.manual_seed(0)
    model = FunnelForSequenceClassification(config).double().eval()
    for name, param in model.named_parameters():  # the keys' bias: structural zeros (issue 19)
        param.requires_grad_(not name.endswith("k_head.bias"))
    return LogitsOf(model)  # [N, 3] here


@pytest.mark.parametrize("batch", [4, 3])
def test_funnel_is_exact_where_its_pooled_length_equals_the_batch_size(batch):
    torch.manual_seed(1)
    inputs, targets = torch.randint(0, 11, (batch, 8)), torch.randint(0, 3, (batch,))
    assert_exact(funnel(), inputs, targets, inner_terms=8)


class FixedBatch(nn.Module):
    """A layer scale the fallback computes, in a model that takes batches of 4 only."""

    def __init__(self):
        super().__init__()
        self.gamma, self.head = nn.Parameter(torch.randn(4, 5)), nn.Linear(5, 3)

    def forward(self, x):
        return self.head((x.view(4, 2, 5) * self.gamma[:, None]).sum(1))


def test_a_module_whose_inputs_cannot_be_told_apart_is_refused_naming_why():
    """The layout is learned from a pass one example larger; a model that cannot run it
    leaves the module without rows, with a warning (not the old guess by sizes)."""
    torch.manual_seed(0)
    model = cgn.prepare_model(FixedBatch().double())
    x, y = torch.randn(4, 2, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match=r"FixedBatch \(gamma\).*could not be learned.*"
                                          r"one example more failed \(RuntimeError"):
        with backpack(*extensions()):
            nn.functional.cross_entropy(model(x), y).backward()
    assert not hasattr(model.gamma, SUMS_SAVEFIELD) and hasattr(model.head.weight, SUMS_SAVEFIELD)


# 5. Autocast on a model extended by backpack.extend alone ------------------------------------


def test_autocast_on_a_model_extended_by_backpack_alone_names_the_fix_after_the_backward_pass():
    """It crashed inside ``loss.backward()`` (``expected m1 and m2 to have the same dtype``):
    BackPACK keeps the float32 input of a layer whose output gradient is bfloat16. Now the
    backward pass completes (``param.grad`` is there) and the quantities raise, naming the
    layer's parameters and ``cgn.prepare_model``."""
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    names = [name for name, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(model.parameters(), quantities=[
        cgn.GradientVarianceQuantiles(linear(1), param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names)])
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(x)
        loss = extend(nn.CrossEntropyLoss())(outputs, y)
        losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    info = {"batch_size": 8, "individual_losses": losses, "loss": loss}
    with pytest.raises(ValueError, match=r"\['0.bias', '0.weight'\]: '0.weight': its layer "
                                         r"\(Linear\) ran under torch.autocast .*"
                                         r"cgn.prepare_model\(model\)"):
        with cockpit(0, info=info):
            loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# 4. A second backward pass without zero_grad -------------------------------------------------


def test_gradient_noise_scale_of_a_second_backward_pass_without_zero_grad_is_this_batchs():
    """The cockpit around the second of two backward passes, no micro-batch keys, at its
    first call (Cockpit gives the quantities its parameters only after the backward pass):
    ``grad_sq`` mixed ``param.grad`` (both batches) with this batch's per-example norms.
    Now it is this batch's, from this backward pass's own gradient (BackPACK's), with a
    warning that names ``zero_grad`` and the accumulation keys."""
    torch.manual_seed(0)
    model = cgn.prepare_model(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double())
    loss_fn, per_example_loss = classification_losses("mean")
    names = [name for name, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(model.parameters(),
                          quantities=[cgn.GradientNoiseScale(linear(1), param_names=names)])
    (x1, x2), (y1, y2) = torch.randn(2, 8, 4, dtype=torch.float64), torch.randint(0, 3, (2, 8))
    loss_fn(model(x1), y1).backward()
    outputs = model(x2)
    loss = extend(loss_fn)(outputs, y2)
    info = {"batch_size": 8, "individual_losses": per_example_loss(outputs, y2), "loss": loss}
    with pytest.warns(UserWarning, match=r"already holds gradients before the tracked backward "
                                         r"pass of step 0.*micro_batch.*zero_grad\(\)"):
        with cockpit(0, info=info):
            loss.backward()
    got = cockpit.get_output()[0]["GradientNoiseScale"]
    expected = references.gradient_noise_scale(model, per_example_loss, x2, y2)
    for name in [*names, "all"]:
        for statistic in ("grad_sq", "trace_cov"):
            assert got[name][statistic] == pytest.approx(expected[name][statistic], rel=1e-10)


class NormedEmbedding(nn.Embedding):
    """Not a lookup times a constant: each row is normalized."""

    def forward(self, index):
        return nn.functional.normalize(super().forward(index), dim=-1)


class TiedNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.head = NormedEmbedding(11, 8), nn.Linear(8, 11, bias=False)
        self.head.weight = self.embedding.weight
        self.mix = nn.Linear(8, 8)

    def forward(self, index):
        return self.head(torch.tanh(self.mix(self.embedding(index))))


def test_a_tied_embedding_whose_forward_is_no_lookup_is_exact():
    """The torch.func fallback computes its own rows; its use cannot be combined with the
    head's as an Embedding's (its output gradient is not the lookup's), so it is recomputed
    per example (extensions/tied.py, RecomputedUse; left out by name before)."""
    torch.manual_seed(0)
    inputs, targets = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    assert_exact(TiedNormed().double(), inputs, targets, token_losses("mean"), inner_terms=5)


class Shift(nn.Module):
    """Parameters used in its own forward: the fallback (and so the layout's pass) covers it."""

    def __init__(self, width):
        super().__init__()
        self.shift, self.gain = nn.Parameter(torch.randn(width)), nn.Parameter(torch.randn(()))

    def forward(self, x):
        return torch.tanh(x * self.gain + self.shift)


def test_the_layout_pass_leaves_training_as_it_was():
    """The pass one example larger (``fallback/layout.py``) restores the random state and
    the buffers: a BatchNorm's running statistics, the next dropout mask and the outputs
    are those of the plain model."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), Shift(6),
                          nn.Linear(6, 3)).double().train()
    prepared = cgn.prepare_model(copy.deepcopy(plain))
    x = torch.randn(5, 4, dtype=torch.float64)
    outputs = []
    for model in (plain, prepared):
        torch.manual_seed(1)
        outputs.append([model(x), model(x)])  # the second draws after the first's pass
    state = next(iter(prepared[3].__dict__[fallback.ATTRIBUTE].layouts.values()))
    assert state.refusal is None and state.leaves == {0}  # the pass ran, x is per example
    for got, expected in zip(outputs[1], outputs[0]):
        assert torch.equal(got, expected)
    for name, buffer in plain.named_buffers():
        assert torch.equal(dict(prepared.named_buffers())[name], buffer), name


class CachedTable(nn.Module):
    """Adds a table; in evaluation mode through a tensor computed from it once and kept in a
    plain attribute (no dict cache the fallback would empty)."""

    def __init__(self):
        super().__init__()
        self.table, self.kept = nn.Parameter(torch.randn(1, 4)), None

    def forward(self, x):
        if self.training:
            return x + self.table
        if self.kept is None:
            self.kept = self.table * 2.0
        return x + self.kept


def test_a_parameter_used_through_a_kept_tensor_is_refused_not_zero():
    """Kept by an earlier call (with its graph): the tracked call read it, its recomputation
    cannot see the table behind it."""
    torch.manual_seed(0)
    model = cgn.prepare_model(nn.Sequential(nn.Linear(3, 4), CachedTable(), nn.Tanh(),
                                            nn.Linear(4, 2)).double().eval())
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    model(x)  # an earlier forward pass (no backward) keeps the table's tensor
    with pytest.warns(UserWarning, match=r"CachedTable \(table\).*the forward pass used "
                                         r"\['table'\] but its recomputation"):
        with backpack(*extensions()):
            nn.functional.cross_entropy(model(x), y).backward()
    assert model[1].table.grad is not None and not hasattr(model[1].table, SUMS_SAVEFIELD)
    assert hasattr(model[0].weight, SUMS_SAVEFIELD)


def test_a_tensor_kept_by_the_call_itself_is_recomputed_exact():
    """Computed from the table by the call itself (``None`` before it): the recomputation runs
    with the attributes the call set as it found them, so it computes it again from the
    table's copies (``parameters.attributes_as_called``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), CachedTable(), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(model, (x,), y, nn.CrossEntropyLoss(), verbose=False)
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()
