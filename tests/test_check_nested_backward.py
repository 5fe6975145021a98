"""check_model's reference where a custom ``autograd.Function`` runs a backward pass of its own.

Reformer's reversible layers run their forward without a graph and, in their backward,
recompute it and call ``.backward()``: the layers' gradients reach ``param.grad`` but not
``torch.autograd.grad``, the reference's first way. The reference then reads them from
``param.grad``, one example at a time; compared here with a loop over single examples.
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check

import torch
from torch import nn


class Recomputed(torch.autograd.Function):
    """``layer(x)`` without a graph; its backward recomputes it and calls ``.backward()``."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            ctx.layer(x).backward(grad)
        return x.grad, None


class Reversible(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x):
        return Recomputed.apply(x, self.inner)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), Reversible(6), nn.Tanh(), nn.Linear(6, 3)).double()


def test_the_reference_reads_a_gradient_accumulated_by_a_backward_inside_a_function():
    model, loss_fn = _model(), nn.CrossEntropyLoss()
    inputs, targets = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 2, 1, 2])
    found = check.reference_contributions(copy.deepcopy(model), (inputs,), targets, loss_fn)
    assert set(found) == {name for name, _ in model.named_parameters()}
    for i in range(len(inputs)):  # example i's own loss, as a share of the batch's mean
        model.zero_grad(set_to_none=True)
        (loss_fn(model(inputs[i:i + 1]), targets[i:i + 1]) / len(inputs)).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(found[name][i], param.grad, rtol=1e-12, atol=1e-15)


def test_check_model_compares_the_rows_of_a_layer_run_inside_such_a_function():
    frame = cgn.check_model(_model(), torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 2, 1, 2]),
                            nn.CrossEntropyLoss(), verbose=False)
    assert frame.rows.all() and frame.max_rel_error.notna().all(), frame
    assert (frame.max_rel_error < 1e-12).all(), frame
