"""Issue 32: parameters of a forward pass that draws random numbers in training mode get exact rows.

Where the torch.func fallback (or a block) runs a module again per example and its forward
draws random numbers (dropout, drop path), an example alone draws other masks than in the
batch; those parameters were left out by name (timm's BEiT and EVA-02: ``cls_token``,
``pos_embed``; XLNet's block: every parameter). Now the batch's draws are replayed
(``extensions/fallback/draws.py``): each example alone is given its part of them. Exact
against ``cgn.check_model``, whose float64 reference runs one backward pass per example
through one forward pass of the batch (the batch's draws), at batch 2, 3 and 5. A random
tensor drawn once for every example is handed whole to each, one flattened example-major
(``[N * T, C]``: OPT) gives each example its block of rows; one with no such map, or whose
rows are not the examples (the output check), is still refused by name.
The model's randomness is the same as without the package: same draws, same loss, same
random state afterwards.
"""

import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import check

import pytest
import torch
from torch import nn

from tests.helpers import rows

BATCHES = (2, 3, 5)


def _timm(name, **extra):
    import timm

    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, img_size=16, patch_size=8, depth=2, embed_dim=16,
                             num_heads=2, num_classes=3, drop_path_rate=0.3, drop_rate=0.2,
                             **extra).double().train()


def beit():
    return _timm("beit_base_patch16_224", init_values=0.1)


def eva02():
    return _timm("eva02_tiny_patch14_224")


def _images(examples):
    generator = torch.Generator().manual_seed(examples)
    images = torch.randn(examples, 3, 16, 16, generator=generator, dtype=torch.float64)
    return images, torch.arange(examples) % 3


def _checked(model, inputs, targets, loss=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cgn.check_model(model, inputs, targets, loss or nn.CrossEntropyLoss(), verbose=False)


@pytest.mark.parametrize("make", [beit, eva02])
@pytest.mark.parametrize("examples", BATCHES)
def test_timm_class_token_and_position_table_in_training_mode_are_exact(make, examples):
    """The model itself holds ``cls_token`` (and EVA-02 ``pos_embed``) and runs its blocks,
    whose drop path draws per example: every element gets rows, exact to 1e-10."""
    images, labels = _images(examples)
    frame = _checked(make(), (images,), labels)
    assert frame.attrs["coverage"] == 1.0, frame[~frame.rows][["param", "note"]].to_string()
    assert frame.max_rel_error.max() < 1e-10
    own = frame.set_index("param").loc[["cls_token"]]
    assert (own.how.str.startswith("fallback")).all() and (own.reference_scale > 0).all()


def test_tracking_keeps_the_batch_draws_and_the_random_state():
    """A tracked step in training mode draws what the step draws without the package (same
    loss, same gradient), leaves the random state where it leaves it, and gives the class
    token its rows without a warning; at the next step, where ``vmap`` is no longer tried
    (it met the draws), its largest per-example norm is the reference's."""
    images, labels = _images(3)
    plain = beit()
    model, tracker = cgn.track(beit(), every=1, quantities=["PerExampleGradNorm"])
    for step, seed in enumerate((7, 8)):
        plain.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = nn.functional.cross_entropy(plain(images), labels)
        loss.backward()
        after = torch.rand(4)
        torch.manual_seed(seed)
        logits = model(images)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracker(step, nn.functional.cross_entropy(logits, labels, reduction="none")) as tracked:
                tracked.backward()
        assert torch.equal(torch.rand(4), after)
        torch.testing.assert_close(tracked, loss, rtol=0, atol=0)
        grads = dict(plain.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-12, atol=1e-15)
        assert not [str(w.message) for w in caught if "cockpit-gradnoise" in str(w.message)]
    torch.manual_seed(8)
    reference = check.reference_contributions(plain, (images,), labels, nn.CrossEntropyLoss())["cls_token"]
    got = rows(tracker.cockpit, "PerExampleGradNorm", step=1)["cls_token"]["max"]
    assert got == pytest.approx(3 * float(reference.flatten(1).norm(dim=1).max()), rel=1e-10)


class Toy(nn.Module):
    """A module with its own parameter whose forward draws random numbers: per example
    (``rand_like``; ``native_dropout``, the kernel of dropout on a GPU), once for every example,
    flattened with the features, or per example but handed to other examples (``flip``)."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
        self.head = nn.Linear(4, 3).double()

    def forward(self, x):
        hidden = x * self.scale
        keep = {
            "per example": lambda: torch.rand_like(hidden) < 0.6,
            # (the kernel dropout runs on a GPU, here on the CPU: its output replayed from its mask)
            "native dropout": lambda: torch.native_dropout(hidden, 0.4, True)[0] * 0.6 / hidden,
            "shared": lambda: torch.rand(hidden.shape[1:], dtype=hidden.dtype) < 0.6,
            "flattened": lambda: (torch.rand(hidden.numel(), dtype=hidden.dtype) < 0.6).view_as(hidden),
            # (flattened features first: example i's features are not rows 4i..4i+3)
            "flattened token-major": lambda: (torch.rand(hidden.numel(), dtype=hidden.dtype) < 0.6)
            .view(hidden.shape[1], -1).t(),
            "unmapped": lambda: (torch.rand(len(hidden) + 1, 4, dtype=hidden.dtype) < 0.6)[1:],
            "flipped": lambda: (torch.rand_like(hidden) < 0.6).flip(0),
        }[self.draw]()
        return self.head(torch.tanh(hidden * keep / 0.6 + self.scale))


@pytest.mark.parametrize("draw", ["per example", "native dropout", "shared", "flattened",
                                  "flattened token-major", "unmapped", "flipped"])
def test_a_random_tensor_that_is_not_per_example_is_refused_by_name(draw):
    """Replayed where the random tensor has one dimension of the examples (sliced, or flattened
    example-major), or none that depends on the batch (drawn once, handed whole to each example),
    and each example's output alone matches its row of the batch's; else ``scale`` is left out,
    naming why."""
    torch.manual_seed(0)
    model = Toy(draw).train()
    inputs = torch.randn(5, 4, dtype=torch.float64)
    frame = _checked(model, (inputs,), torch.arange(5) % 3).set_index("param")
    assert frame.loc["head.weight", "rows"] and frame.loc["head.weight", "max_rel_error"] < 1e-10
    if draw in ("per example", "native dropout", "shared", "flattened"):
        assert frame.loc["scale", "rows"] and frame.loc["scale", "max_rel_error"] < 1e-10
    else:
        assert not frame.loc["scale", "rows"]
        # (unmapped: example 0's first 2 of the N + 1 rows give it its own output; example 1's
        # next 2 do not, and the rows would run out at example 3)
        why = "differs from its output in the batch"
        assert "random" in frame.loc["scale", "note"] and why in frame.loc["scale", "note"]
