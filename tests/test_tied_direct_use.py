"""A tied weight that a forward pass also takes directly, outside the layers that hold it.

NeoMME's masked-LM head (``transformers``) computes ``hidden @ unembedding_projection.weight``
without calling that layer; its weight is tied to the embedding's ``embedding_projection``,
which does run. The rules combine the uses of the layers that ran, so the rows missed the
head's use: off by about 0.7 relative, silently (the sweep's ``inexact`` row). The parameter
is now left out by name, at the tracked step, and the rest stays exact.
"""

import cockpit_gradnoise as cgn

import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from experiments import architecture_sweep, sweep_models
from tests.cases import Problem, token_losses
from tests.test_tied import assert_left_out_by_name


class Factorized(nn.Module):
    """ALBERT-style factorized embedding whose projection is tied to a head layer's weight,
    which the head multiplies by itself (NeoMME)."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 3)
        self.projection = nn.Linear(3, 6, bias=False)
        self.unprojection = nn.Linear(3, 6, bias=False)
        self.unprojection.weight = self.projection.weight
        self.mixer = nn.Linear(6, 6)
        self.head = nn.Linear(3, 11)

    def forward(self, idx):
        hidden = torch.tanh(self.mixer(self.projection(self.embedding(idx))))
        return self.head(hidden @ self.unprojection.weight)


def test_a_tied_weight_taken_directly_outside_its_layers_is_left_out_by_name():
    torch.manual_seed(0)
    model = cgn.prepare_model(Factorized().double())
    loss_fn, per_example_loss = token_losses("mean")
    inputs, targets = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    problem = Problem(model, extend(loss_fn), per_example_loss, inputs, targets, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.model)
    assert_left_out_by_name(problem, quantity, "projection.weight",
                            r"'projection.weight': it is tied, and 1 operation\(s\) of the forward "
                            r"pass took it directly \(\w+, as hidden @ Linear.weight\)")


def test_neomme_masked_lm_leaves_its_tied_projection_out_and_the_rest_exact():
    """The real class at the sweep's tiny configuration, through ``check_model``'s float64
    per-example loop: the tied projection has no rows, with the reason; every other row is
    exact (the sweep's own classification, float32 norms inside the float64 model counted)."""
    case = sweep_models.build("transformers", "neomme")
    float32 = architecture_sweep.computed_in_float32(case)
    frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)
    projection = frame[frame.param.str.endswith("embed_tokens.embedding_projection.weight")].iloc[0]
    assert not projection.rows and "took it directly" in projection.note
    record = architecture_sweep.classify(
        frame, architecture_sweep.float32_parameters(case.model, frame, float32))
    assert record["status"] == "exact, left out"  # the tied word embedding and head: exact
    assert [item["param"] for item in record["left_out"]] == [
        "model.embed_tokens.embedding_projection.weight"]
