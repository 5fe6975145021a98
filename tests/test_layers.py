"""Layers of real models, against a float64 per-example reference.

The reference: ``torch.func`` (``vmap`` of ``grad`` of one example's loss) on
an un-extended copy of the model as built (before ``prepare_model`` converts
attention). ``nn.Embedding(padding_idx=...)``; ``nn.MultiheadAttention``
converted by ``prepare_model`` and ``track``; subclasses of supported layers:
every one this package claims (``extensions/subclasses.py``) must give exact
rows, every other one none (never its parent's rule on a different
function); the warning that names the layers without rows.
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
    facts,
    fallback,
    subclasses,
)
from cockpit_gradnoise.references import contributions_through_batch

import pytest
import timm
import torch
from backpack import backpack, extend
from torch import nn
from torch.func import functional_call, grad, vmap

from tests.helpers import RTOL
from tests.layer_models import PADDING, Attention, embedding_padding, padded_tokens


class Inherits(nn.Linear):
    """A subclass that changes nothing on the forward path."""

    def extra_repr(self):
        return "inherits " + super().extra_repr()


class Doubles(nn.Linear):
    """A subclass whose forward is another function: the Linear rule would be wrong."""

    def forward(self, x):
        return 2 * super().forward(x)


class InheritsBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass that changes nothing on the forward path."""


def per_example_reference(model, x, y):
    """``{name: [N, *shape]}``: each example's gradient of its own (summed) loss, float64."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def extension_results(model, x, y):
    """Run the three extensions on ``cgn.prepare_model(model)`` with a summed loss."""
    prepared = cgn.prepare_model(model)
    loss = extend(nn.CrossEntropyLoss(reduction="sum"))(prepared(x), y)
    facts.begin()  # what a cockpit call does: the facts of this backward pass alone
    with backpack(PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient()):
        loss.backward()
    return prepared


def assert_close(got, expected):
    """Equal up to rounding: each element a sum of the same terms in another order, so within
    ``RTOL`` of the largest element of ``expected`` (exact zeros stay exact: ``atol`` 0 there)."""
    atol = RTOL * expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=atol)


def assert_rows_exact(prepared, contributions, names):
    """The three extensions' results on ``names`` equal those of ``contributions`` (``[N, *shape]``)."""
    params = dict(prepared.named_parameters())
    for name in names:
        param, x = params[name], contributions[name]
        assert_close(getattr(param, BATCH_L2_SAVEFIELD), x.flatten(1).square().sum(1))
        sums = getattr(param, SUMS_SAVEFIELD)
        assert_close(sums[0], x.sum(0))
        assert_close(sums[1], x.square().sum(0))
        assert_close(getattr(param, LOCAL_GRADIENT_SAVEFIELD), x.sum(0))


def with_rows(prepared):
    return {n for n, p in prepared.named_parameters() if hasattr(p, SUMS_SAVEFIELD)}


def check(make, x, n_classes=3):
    """``(prepared model, names with rows)``, the rows checked against the reference (eval mode)."""
    torch.manual_seed(0)
    model = make().double().eval()
    y = torch.randint(0, n_classes, (len(x),))
    expected = per_example_reference(copy.deepcopy(model), x, y)
    prepared = extension_results(model, x, y)
    names = with_rows(prepared)
    assert_rows_exact(prepared, expected, names)
    return prepared, names


def images(n=3, channels=3, size=8):
    torch.manual_seed(1)
    return torch.randn(n, channels, size, size, dtype=torch.float64)


def test_a_subclass_with_the_parents_forward_gets_its_rule():
    _, names = check(lambda: nn.Sequential(Inherits(4, 5), nn.Tanh(), Inherits(5, 3)),
                     torch.randn(3, 4, dtype=torch.float64))
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_subclass_with_its_own_forward_gets_the_fallback_not_its_parents_rule():
    model = nn.Sequential(Doubles(4, 5), nn.Tanh(), nn.Linear(5, 3))
    # check() compares with the reference: the Linear rule would be off by 2.
    prepared, names = check(lambda: model, torch.randn(3, 4, dtype=torch.float64))
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert isinstance(getattr(prepared[0], fallback.ATTRIBUTE, None), fallback.Fallback)
    owners = facts.recording().owners
    assert [owners[id(p)] for p in prepared.parameters()] == ["Doubles"] * 2 + ["Linear"] * 2


def test_a_parametrized_layer_gets_no_rule():
    layer = torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 3))
    rules = SumsOfContributions()._rules
    assert subclasses.rule_for(type(layer), rules, None) is None
    assert subclasses.rule_for(Doubles, rules, None) is None
    assert subclasses.rule_for(Inherits, rules, None) is rules[nn.Linear]


def test_timm_layer_norm_on_sequences():
    from timm.layers import LayerNorm

    _, names = check(lambda: nn.Sequential(nn.Linear(4, 6), LayerNorm(6), nn.GELU(), nn.Flatten(),
                                           nn.Linear(18, 3)),
                     torch.randn(3, 3, 4, dtype=torch.float64))
    assert {"1.weight", "1.bias"} <= names


@pytest.mark.parametrize("norm", ["timm", "torchvision"])
def test_channels_first_layer_norms(norm):
    if norm == "timm":
        from timm.layers import LayerNorm2d
    else:
        from torchvision.models.convnext import LayerNorm2d

    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), LayerNorm2d(4), nn.Tanh(),
                             nn.Flatten(), nn.Linear(4 * 8 * 8, 3))

    _, names = check(make, images())
    assert names == {"0.weight", "1.weight", "1.bias", "4.weight", "4.bias"}


def batchnorm_model(norm):
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm, nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 3))


def test_a_batchnorm_subclass_in_eval_mode_is_exact():
    def make():
        model = batchnorm_model(InheritsBatchNorm(4))
        model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.5, 2)
        return model

    _, names = check(make, images())
    assert {"1.weight", "1.bias"} <= names
    assert not facts.recording().examples_interact


def test_a_batchnorm_subclass_in_training_mode_gives_contributions_and_says_examples_interact():
    torch.manual_seed(0)
    model = batchnorm_model(InheritsBatchNorm(4)).double()
    x, y = images(), torch.randint(0, 3, (3,))
    expected = contributions_through_batch(
        copy.deepcopy(model), nn.CrossEntropyLoss(reduction="sum"), x, y
    )
    prepared = extension_results(model, x, y)
    assert with_rows(prepared) == set(expected)
    assert_rows_exact(prepared, expected, expected)
    assert facts.recording().examples_interact


def batchnorm_act(drop=False):
    from timm.layers import BatchNormAct2d

    drop_layer = (lambda: nn.Dropout(0.5)) if drop else None
    return BatchNormAct2d(4, act_layer=nn.SiLU, inplace=False, drop_layer=drop_layer)


def test_timm_batchnorm_act_in_eval_mode_is_exact():
    """Its forward applies an activation after the normalization: the rule carries the
    gradient back through it (the BatchNorm rule would read it as the one at the normalization)."""

    def make():
        model = batchnorm_model(batchnorm_act(drop=True))
        model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.5, 2)
        model[1].weight.data.uniform_(0.5, 2), model[1].bias.data.uniform_(-1, 1)
        return model

    prepared, names = check(make, images())
    assert {"1.weight", "1.bias"} <= names
    assert not facts.recording().examples_interact


def test_timm_batchnorm_act_in_training_mode_gives_contributions():
    torch.manual_seed(0)
    model = batchnorm_model(batchnorm_act()).double()
    x, y = images(), torch.randint(0, 3, (3,))
    original = copy.deepcopy(model)
    prepared = extension_results(model, x, y)
    assert facts.recording().examples_interact
    # The contributions through the batch, formed per example from the batch's backward
    # pass: the gradient at the normalization's output times x_hat, summed over positions.
    norm = original[1]
    inputs = {}
    norm.register_forward_hook(lambda m, args, out: inputs.update(x=args[0]))
    normalized = {}

    def at_normalization(module, args, out):
        normalized["y"] = out
        out.retain_grad()

    handle = norm.drop.register_forward_hook(lambda m, args, out: at_normalization(m, args, args[0]))
    nn.functional.cross_entropy(original(x), y, reduction="sum").backward()
    handle.remove()
    x_in, grad = inputs["x"].detach(), normalized["y"].grad
    mean, var = x_in.mean((0, 2, 3), keepdim=True), x_in.var((0, 2, 3), unbiased=False, keepdim=True)
    x_hat = (x_in - mean) / (var + norm.eps).sqrt()
    expected = {"1.weight": (grad * x_hat).sum((2, 3)), "1.bias": grad.sum((2, 3))}
    torch.testing.assert_close(expected["1.weight"].sum(0), norm.weight.grad, rtol=RTOL, atol=0)
    assert_rows_exact(prepared, expected, expected)


def test_timm_batchnorm_act_with_random_dropout_in_training_gets_no_rows():
    torch.manual_seed(0)
    model = batchnorm_model(batchnorm_act(drop=True)).double()
    prepared = extension_results(model, images(), torch.randint(0, 3, (3,)))
    assert with_rows(prepared) == {"0.weight", "0.bias", "4.weight", "4.bias"}
    assert facts.recording().examples_interact
    assert facts.recording().owners[id(prepared[1].weight)] == "BatchNormAct2d"


def test_timm_convnext_and_vit():
    """Every parameter has exact rows: the subclass layers by their parents' rules, what is used
    directly in a forward (layer scale, class token, position table) by the fallback."""
    convnext = lambda: timm.create_model("convnext_atto", pretrained=False, num_classes=3,  # noqa: E731
                                          depths=(1, 1, 1, 1), dims=(4, 8, 8, 8))
    prepared, names = check(convnext, images(size=32))
    assert names == {n for n, _ in prepared.named_parameters()}

    vit = lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,  # noqa: E731
                                     num_classes=3, depth=1, embed_dim=8, num_heads=2)
    prepared, names = check(vit, images(size=32))
    assert names == {n for n, _ in prepared.named_parameters()}


def test_the_padding_row_is_exactly_zero_and_the_others_exact():
    prepared, names = check(embedding_padding, padded_tokens(6))
    assert names == {"0.weight", "3.weight", "3.bias"}
    weight = prepared.get_parameter("0.weight")
    assert torch.all(getattr(weight, SUMS_SAVEFIELD)[:, PADDING] == 0)
    assert torch.all(getattr(weight, LOCAL_GRADIENT_SAVEFIELD)[PADDING] == 0)


@pytest.mark.parametrize("bias", [False, True])
def test_prepare_model_converts_attention_keeping_names_and_every_parameter_is_exact(bias):
    torch.manual_seed(0)
    original = Attention(bias=bias)
    names_before = [n for n, _ in original.named_parameters()]
    prepared, names = check(lambda: original, torch.randint(0, 11, (5, 4)))
    assert not any(isinstance(m, nn.MultiheadAttention) for m in prepared.modules())
    assert [n for n, _ in prepared.named_parameters()] == names_before
    assert names == set(names_before)


def test_track_converts_attention_and_its_optimizer_keeps_the_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                          nn.Flatten(), nn.Linear(4 * 8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before track
    x, y = torch.randn(5, 4, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    expected = per_example_reference(copy.deepcopy(model), x, y)
    model, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
    assert {id(p) for p in model.parameters()} == {id(p) for g in optimizer.param_groups
                                                   for p in g["params"]}
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with tracker(0, losses, reduction="sum") as loss:
        loss.backward()
    got = tracker.frame().query("statistic == 'max'").set_index("param").value
    assert set(got.index) == {*expected, cgn.NETWORK}
    for name, g in expected.items():
        assert got[name] == pytest.approx(g.flatten(1).norm(dim=1).max().item(), rel=RTOL)


class Scale(nn.Module):
    """Uses its parameter directly, with a random draw that the fallback's ``vmap`` refuses."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        # No layer-scale look-alike; a draw of one row more than the batch: none of its own to replay.
        return (x * self.scale).sin() + 0 * torch.rand(len(x) + 1, dtype=x.dtype).sum()


class RandomDoubles(Doubles):
    """Doubles with a random draw: neither the Linear rule nor the fallback."""

    def forward(self, x):
        return super().forward(x) + 0 * torch.rand(len(x) + 1, dtype=x.dtype).sum()  # as Scale draws


def test_the_unsupported_warning_is_short_and_names_the_classes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), *(Scale(8) for _ in range(200)), RandomDoubles(8, 3))
    model, tracker = cgn.track(model.double(), every=1)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.warns(UserWarning) as caught:
        with tracker(0, nn.functional.cross_entropy(model(x), y, reduction="none")) as loss:
            loss.backward()
    # The fallback refused every module here (vmap cannot draw random numbers per example):
    # its reason replaces "no per-example rule", grouped by reason, one warning for the step.
    assert not [w for w in caught if "no per-example rule" in str(w.message)]
    messages = [str(w.message) for w in caught if "no exact per-example results" in str(w.message)]
    assert len(messages) == 1, messages  # one for the step, for all quantities
    message = messages[0]
    assert len(message) < 600, message  # a few hundred characters per distinct reason, not per parameter
    assert "202 parameters" in message and "(in RandomDoubles, Scale)" in message
    assert "no dimension of the examples" in message and "200 more" in message
    assert "docs/architectures.md" in message
