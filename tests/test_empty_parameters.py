"""A trainable parameter with no elements (a size 0 in a configuration: MobileBERT's tiny
head, ``[0, 99]``) is left out of every quantity by name, never a crash of the step: its
statistics would be reductions over nothing (``amax`` raised, ``zeros / numel`` divided by 0)."""

import warnings

import cockpit_gradnoise as cgn

import pytest
import torch
from torch import nn


class HeadWithEmptyWeight(nn.Module):
    """A layer and a parameter of shape (0, 3) that takes part in the forward pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        out = self.lin(x)
        return out + torch.cat([self.empty, out[:1] * 0], 0).sum(0)


@pytest.mark.parametrize("quantities", ["all", "norms"])
def test_a_parameter_without_elements_is_left_out_by_name_and_the_step_is_kept(quantities):
    torch.manual_seed(0)
    model, tracker = cgn.track(HeadWithEmptyWeight(), every=1, quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=opt) as loss:
                loss.backward()
            opt.step()
    told = [str(w.message) for w in caught if "no elements" in str(w.message)]
    assert told and "'empty'" in told[0]
    frame = tracker.frame()
    assert set(frame["step"]) == {0, 1}
    # UpdateSize reads only param: its documented values (no move, relative inf as for an
    # all-zero parameter); every quantity of per-element or per-example statistics leaves it out.
    empty = frame[frame["param"] == "empty"]
    assert set(empty["quantity"]) <= {"UpdateSize"}
    assert (empty[empty["statistic"] == "norm"]["value"] == 0).all()
    assert {"lin.weight", "lin.bias"} <= set(frame["param"])
    assert frame["value"].notna().any()
