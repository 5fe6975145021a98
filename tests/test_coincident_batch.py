"""Layers on rows that are not examples, whose row count equals the batch size by coincidence.

The architecture sweep found switch_transformers' experts (native ``nn.Linear``s on the
tokens routed to them) silently wrong where an expert saw as many tokens as the batch has
examples: its rows were taken for examples. They are now left out with the other experts:
the model run on one example more (.fallback.regroup) shows that no expert's rows are
examples, and the model (the one module around them that takes and returns the batch first)
is run again on each example alone, which this model's routing, fixed to the batch's first
rows, cannot: refused by name, never counted.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.facts import batch_by_coincidence

import pytest
import torch
from torch import nn

from tests.helpers import rows


def test_only_layers_of_a_kind_with_other_row_counts_are_coincident():
    leading = {"experts.expert_0.wo.weight": 7, "experts.expert_1.wo.weight": 4,
               "experts.expert_12.wo.weight": 4, "head.weight": 4, "wpe.weight": 6,
               "h.0.attn.weight": 4, "h.1.attn.weight": 4}
    assert batch_by_coincidence(leading, 4) == {"experts.expert_1.wo.weight", "experts.expert_12.wo.weight"}
    assert batch_by_coincidence({"h.0.attn.weight": 4, "h.1.attn.weight": 4}, 4) == set()
    assert batch_by_coincidence({"wpe.weight": 6, "h.0.attn.weight": 4}, 4) == set()


class Experts(nn.Module):
    """Tokens flattened to ``[B*T, C]``, the first ``B`` routed to expert 0, the rest to
    expert 1 (a fixed routing, so that expert 0 sees exactly as many rows as examples)."""

    def __init__(self, batch, width=5):
        super().__init__()
        self.batch = batch
        self.embedding = nn.Linear(3, width)
        self.experts = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):  # x: [B, T, 3]
        hidden = torch.tanh(self.embedding(x))
        tokens = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros_like(tokens)
        out = out.index_add(0, torch.arange(self.batch), self.experts[0](tokens[: self.batch]))
        rest = torch.arange(self.batch, tokens.shape[0])
        out = out.index_add(0, rest, self.experts[1](tokens[self.batch:]))
        return self.head(out.reshape(hidden.shape).mean(1))


@pytest.mark.parametrize("batch", [3, 4])
def test_an_expert_that_sees_as_many_rows_as_examples_is_left_out_not_counted(batch):
    torch.manual_seed(0)
    model, tracker = cgn.track(Experts(batch).double(), every=1, quantities=["PerExampleGradNorm"])
    x, y = torch.randn(batch, 3, 3, dtype=torch.float64), torch.randint(0, 2, (batch,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with pytest.warns(UserWarning, match=r"\['experts.0.bias', 'experts.0.weight', 'experts.1.bias', "
                      r"'experts.1.weight'\].*its block \(Experts\).*one example alone"):
        with tracker(0, losses) as loss:
            loss.backward()
    got = set(rows(tracker.cockpit, "PerExampleGradNorm"))
    assert not got & {"experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias"}
    assert {"embedding.weight", "head.weight"} <= got


def test_the_checker_says_why_and_reports_no_wrong_rows():
    torch.manual_seed(0)
    batch = 4
    table = cgn.check_model(Experts(batch), torch.randn(batch, 3, 3), torch.randint(0, 2, (batch,)),
                            nn.CrossEntropyLoss(), verbose=False)
    notes = dict(zip(table.param, table.note))
    assert all("one example alone" in notes[f"experts.{k}.weight"] for k in (0, 1))
    assert (table.max_rel_error[table.rows] < 1e-10).all()
