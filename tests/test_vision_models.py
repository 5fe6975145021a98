"""torchvision and timm models, unmodified, through ``prepare_model``: no converter,
the same outputs and gradients as the original in both modes, exact rows."""

import copy
import functools
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import PerExampleSquaredNorms
from cockpit_gradnoise.extensions.savefields import SUMS_SAVEFIELD

import pytest
import torch
from torch import nn

from tests.test_hooks import RTOL, row_errors, tracked_backward

N, CLASSES = 2, 3


def torchvision_model(name):
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=CLASSES)


def timm_model(name, **kwargs):
    import timm

    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


#: Dropout and drop-path on wherever the model has them, so training mode draws.
MODELS = {
    "torchvision mobilenet_v3_small": lambda: torchvision_model("mobilenet_v3_small"),
    "torchvision efficientnet_b0": lambda: torchvision_model("efficientnet_b0"),
    "torchvision convnext_tiny": lambda: torchvision_model("convnext_tiny"),
    "torchvision resnet18": lambda: torchvision_model("resnet18"),
    "timm efficientnet_b0": lambda: timm_model("efficientnet_b0", drop_rate=0.5, drop_path_rate=0.2),
    "timm regnetx_002": lambda: timm_model("regnetx_002", drop_rate=0.5),
}


@functools.lru_cache(maxsize=None)
def original(name, dtype=torch.float64):
    torch.manual_seed(0)
    return MODELS[name]().to(dtype)


def batch(seed=1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(N, 3, 32, 32, dtype=dtype, generator=generator)
    return inputs, torch.randint(0, CLASSES, (N,), generator=generator)


def outputs_and_gradients(model, inputs, targets, tracked):
    """The outputs and every parameter's gradient, with a fixed random state."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    if tracked:
        out = []
        tracked_backward(model, inputs, targets, forward=lambda m, x: out.append(m(x)) or out[0],
                         extensions=(PerExampleSquaredNorms(),))
        out = out[0]
    else:
        out = model(inputs)
        nn.functional.cross_entropy(out, targets, reduction="sum").backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", MODELS)
def test_the_prepared_model_computes_what_the_original_computes(name):
    """Same random state, same dropout masks, same numbers, in training and in
    eval mode: nothing is rewritten. The prepared model runs tracked backward
    passes (the hooks at work). float32: float64 depthwise convolutions are
    slow on CPUs, and both sides run the same kernels on the same numbers."""
    model = copy.deepcopy(original(name, torch.float32))
    prepared = cgn.prepare_model(copy.deepcopy(model))
    assert type(prepared) is type(model)
    inputs, targets = batch(dtype=torch.float32)
    for training in (True, False):
        model.train(training), prepared.train(training)
        assert all(m.training == training for m in prepared.modules())
        expected_out, expected_grads = outputs_and_gradients(model, inputs, targets, tracked=False)
        got_out, got_grads = outputs_and_gradients(prepared, inputs, targets, tracked=True)
        # Not bit-identity: a bound far below what a change of dropout or mode makes.
        torch.testing.assert_close(got_out, expected_out, rtol=1e-6, atol=0)
        assert set(got_grads) == set(expected_grads)
        for param_name, expected in expected_grads.items():
            torch.testing.assert_close(got_grads[param_name], expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("name", ["torchvision resnet18", "torchvision mobilenet_v3_small"])
def test_every_parameter_gets_exact_rows_in_eval_mode(name):
    model = copy.deepcopy(original(name)).eval()
    prepared = cgn.prepare_model(copy.deepcopy(model))
    inputs, targets = batch()
    tracked_backward(prepared, inputs, targets)
    names = [n for n, _ in model.named_parameters()]
    assert all(hasattr(p, SUMS_SAVEFIELD) for p in prepared.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gradients = references.per_example_gradients(
            model, lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
            inputs, targets,
        )
    errors = row_errors(prepared, gradients, names)
    assert max(errors.values()) < RTOL, sorted(errors.items(), key=lambda item: -item[1])[:3]


def test_the_converter_is_refused_where_it_would_freeze_the_training_flag():
    """timm's classifier head calls F.dropout(..., training=self.training)."""
    model = timm_model("resnet18", drop_rate=0.5)
    with pytest.raises(RuntimeError, match="freeze this model's training mode"):
        cgn.prepare_model(model, use_converter=True)
    assert model.training  # its flags are restored after the check


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(3 * 4 * 4, CLASSES)

    def forward(self, x):
        out = self.relu(self.conv(x))
        out += x
        return self.head(self.drop(out).flatten(1))


def test_the_converter_keeps_dropout_modules_following_train_and_eval():
    torch.manual_seed(0)
    model = Block().double()
    converted = cgn.prepare_model(copy.deepcopy(model), use_converter=True)
    assert isinstance(converted, torch.fx.GraphModule)
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in model.named_parameters()]
    inputs = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    for training in (True, False, True):
        model.train(training), converted.train(training)
        torch.manual_seed(3)
        expected = model(inputs)
        torch.manual_seed(3)
        torch.testing.assert_close(converted(inputs), expected, rtol=1e-12, atol=0)
