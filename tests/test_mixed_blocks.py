"""Issue 32: layers whose rows mix the examples, inside a module whose rows do not, run in it on each example.

timm's ``csatv2`` attends over the *batch* behind a ``LayerNorm(1)`` (its ``SpatialTransformerBlock``):
every example's ``q``, ``k``, ``v`` are equal, so each example's forward output is its own and so is
its gradient, but the gradient of one example's loss reaches the other examples' rows of ``norm1``,
``pos_embed.proj`` and ``qkv``, which the layers' rules would give to those examples.
``extensions/fallback/mixing.py``'s check found them and left them out by name. The same check now
also looks at the modules around them: the smallest batch-first one whose own rows are not mixed
(the ``SpatialTransformerBlock``) becomes their block (``regroup._block_mixed``), run again on each
example alone with every block's checks (its output alone equals its row of the batch's; the
contributions add up to the gradient). Exact against a float64 per-example loop; a module whose
examples really interact, forward or backward only, is still refused by name.
"""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions.fallback import mixing
from cockpit_gradnoise.logs import schema

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn
from torch.nn import functional as F

from tests.cases import Problem, classification_losses
from tests.helpers import RTOL
from tests.test_mixed_examples import BackwardMixing, ForwardMixing, batch, contributions, csatv2, flagged, images
from tests.test_tied import assert_left_out_by_name

ATTENTION = "stages.0.0.attn.attn"


def problem_of(model, inputs, targets):
    loss_fn, per_example_loss = classification_losses("mean")
    return Problem(cgn.prepare_model(model), extend(loss_fn), per_example_loss, inputs, targets, "mean")


def frozen_structural_zeros(model):
    """``norm1.weight`` frozen, as ``norm2.weight`` is: ``LayerNorm(1)`` normalizes its input to 0, so
    its weight's gradient is zero by structure, and rounding noise in the reference."""
    model.get_submodule(ATTENTION).norm1.weight.requires_grad_(False)
    return model


def test_csatv2_attention_over_the_batch_exact_in_its_block(examples=4):
    """Through ``cgn.track``: no warning, the layers that mix are the block's, and every
    parameter's per-example norms and the network's noise-scale sums exact (``norm1.bias``,
    ``pos_embed.proj`` and ``qkv`` too)."""
    model = frozen_structural_zeros(csatv2())
    inputs, targets = images(examples)
    grads = contributions(model, inputs, targets)
    model, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm", "GradientNoiseScale"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = F.cross_entropy(model(inputs), targets, reduction="none")
        with tracker(0, losses) as loss:
            loss.backward()
    assert not flagged(model)
    block = model.get_submodule(ATTENTION).__dict__[mixing.BLOCK_ATTRIBUTE]
    assert {type(m).__name__ for m in block.members} == {"Conv2d", "LayerNorm", "Linear"}
    output = tracker.get_output()[0]
    norms = output["PerExampleGradNorm"]
    assert set(norms) == set(grads) | {schema.NETWORK}
    for name, stats in references.per_example_grad_norm(None, None, inputs, None, gradients=grads).items():
        assert norms[name]["max"] == pytest.approx(stats["max"], rel=RTOL), name
        assert norms[name]["mean"] == pytest.approx(stats["mean"], rel=RTOL), name
    expected = references.gradient_noise_scale(None, None, inputs, None, gradients=grads)[schema.NETWORK]
    for statistic in ("grad_sq", "trace_cov"):
        assert output["GradientNoiseScale"][schema.NETWORK][statistic] == pytest.approx(
            expected[statistic], rel=RTOL)


def test_csatv2_check_model_names_the_block():
    model = frozen_structural_zeros(csatv2())
    inputs, targets = images(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(model, inputs, targets, nn.CrossEntropyLoss(), verbose=False)
    assert frame.attrs["coverage"] == 1.0
    mixed = frame[frame.param.str.startswith(f"{ATTENTION}.") & ~frame.param.str.contains("mlp|norm2")]
    assert len(mixed) == 4 and mixed.how.str.contains("SpatialTransformerBlock").all(), mixed.to_string()
    assert (frame.max_rel_error <= 1e-10).all(), frame.to_string()


class Wrapped(nn.Module):
    """A toy that mixes its examples, inside a module around it whose rows are examples: the
    head after it is per example, so the rows of ``inner``'s output are not found mixed."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


@pytest.mark.parametrize("make, why", [
    (BackwardMixing, r"part of its gradient did not come through its block's output"),
    (ForwardMixing, r"its output for one example alone differs from its output in the batch")])
def test_examples_that_interact_inside_the_block_are_refused_by_name(make, why):
    """Backward only (``h - h.detach()``: each output alone is its row, its gradient is not):
    the contributions do not add up to the gradient; forward: the output alone differs."""
    torch.manual_seed(0)
    model = Wrapped(make()).double()
    inputs, targets = batch(4)
    problem = problem_of(model, inputs, targets)
    assert_left_out_by_name(problem, cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
                            ("inner.first.weight", "inner.first.bias"), why)
    assert not flagged(problem.model)


def test_without_a_module_around_the_layers_they_are_left_out_as_mixed():
    """The model itself is no block: its toys' mixed layers left out by the check, as before."""
    torch.manual_seed(0)
    model = cgn.prepare_model(BackwardMixing().double())
    model(batch()[0])
    assert flagged(model) == {"first"}
