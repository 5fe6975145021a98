"""A tied weight that a forward pass also takes directly, outside the layers that hold it.

NeoMME's masked-LM head (``transformers``) computes ``hidden @ unembedding_projection.weight``
without calling that layer; its weight is tied to the embedding's ``embedding_projection``,
which does run. The rules combine the uses of the layers that ran, so the rows missed the
head's use: off by about 0.7 relative, silently (the sweep's ``inexact`` row). The layer not
called is found by the run one example larger (``extensions/fallback/regroup.py``), and the
smallest module around it that takes and returns the batch first and holds every layer of
the tied weight is run again on each example alone, its parameters replaced in every layer
that holds them (``parameters.own_parameters``): the tied weight is exact with both uses
(it was left out by name while ``vmap`` replaced it in one layer only).
"""

import cockpit_gradnoise as cgn

import torch
from torch import nn

from experiments import architecture_sweep, sweep_models
from tests.cases import token_losses
from tests.test_silent_inexact import assert_exact


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


def test_a_tied_weight_taken_directly_outside_its_layers_is_exact():
    torch.manual_seed(0)
    inputs, targets = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    assert_exact(Factorized().double(), inputs, targets, token_losses("mean"), inner_terms=5)


def test_neomme_masked_lm_is_exact_with_its_tied_projection():
    """The real class at the sweep's tiny configuration, through ``check_model``'s float64
    per-example loop: the tied projection has rows from its block, and every row is exact
    (the sweep's own classification, float32 norms inside the float64 model counted)."""
    case = sweep_models.build("transformers", "neomme")
    float32 = architecture_sweep.computed_in_float32(case)
    frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)
    projection = frame[frame.param.str.endswith("embed_tokens.embedding_projection.weight")].iloc[0]
    assert projection.rows and "its block" in projection.how
    record = architecture_sweep.classify(
        frame, architecture_sweep.float32_parameters(case.model, frame, float32))
    assert record["status"] == "exact" and record["left_out"] == []
