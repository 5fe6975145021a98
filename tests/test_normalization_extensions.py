"""BackPACK's first-order extensions on normalization layers against a per-example loop.

Every savefield of ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and
``Variance``, for every parameter of models with ``LayerNorm``, ``GroupNorm``
and ``RMSNorm`` (the normalization layer's and its neighbours'), equals the
slow obvious reference in float64: one autograd backward pass per example on an
un-extended copy of the model. Also: how rows are registered, that importing
the module leaves BackPACK as it is, and what this means for Cockpit.
"""

import copy
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Tuple

from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions
from cockpit_gradnoise.extensions import normalization as norms

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad, BatchL2Grad, DiagGGNExact, SumGradSquared, Variance
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from torch import nn


@pytest.fixture(autouse=True)
def backpack_without_the_global_rows():
    """BackPACK's own extensions as shipped: ``cgn.track`` with a Cockpit quantity (an
    earlier test) registers the normalization rows globally, as documented."""
    norms.unregister_normalization_extensions_globally()
    yield
    norms.unregister_normalization_extensions_globally()

RTOL = 1e-10
HAS_RMS_NORM = hasattr(nn, "RMSNorm")
needs_rms_norm = pytest.mark.skipif(not HAS_RMS_NORM, reason="nn.RMSNorm needs torch >= 2.4")


def sequence_model(norm: nn.Module) -> nn.Module:
    """Linear -> norm -> Linear on ``(N, T=3, 4)``: the norm sees ``(N, 3, 5)``."""
    return nn.Sequential(nn.Linear(4, 5), norm, nn.Tanh(), nn.Flatten(), nn.Linear(15, 3))


def flat_model(norm: nn.Module) -> nn.Module:
    """An MLP on ``(N, 4)``: the norm sees ``(N, 6)``."""
    return nn.Sequential(nn.Linear(4, 6), norm, nn.Tanh(), nn.Linear(6, 3))


def image_model(norm: nn.Module) -> nn.Module:
    """A CNN on ``(N, 2, 4, 4)``: the norm sees ``(N, 4, 4, 4)``.

    The convolution has no bias: norms over one channel's positions (LayerNorm
    over W or (H, W), GroupNorm with one channel per group) remove it, so its
    gradient would be zero and compare nothing.
    """
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), norm, nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)
    )


def signal_model(norm: nn.Module) -> nn.Module:
    """A 1d CNN on ``(N, 2, 5)``: the norm sees ``(N, 4, 5)``."""
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1), norm, nn.Tanh(), nn.Flatten(), nn.Linear(20, 3)
    )


INPUT_SHAPES = {
    sequence_model: (3, 4),
    flat_model: (4,),
    image_model: (2, 4, 4),
    signal_model: (2, 5),
}


@dataclass(frozen=True)
class NormCase:
    """A model with one normalization layer, and the shape of one example."""

    name: str
    make_norm: Callable[[], nn.Module]
    make_model: Callable[[nn.Module], nn.Module]
    training: bool = True

    def build(self) -> nn.Module:
        model = self.make_model(self.make_norm()).double()
        # Affine parameters start at 1 and 0; random ones make the case general.
        with torch.no_grad():
            for param in model.parameters():
                param.normal_()
        return model.train(self.training)

    @property
    def example_shape(self) -> Tuple[int, ...]:
        return INPUT_SHAPES[self.make_model]


def rms_norm(*args, **kwargs):
    return nn.RMSNorm(*args, **kwargs)


CASES = [
    NormCase("layer-norm-flat", lambda: nn.LayerNorm(6), flat_model),
    NormCase("layer-norm-seq", lambda: nn.LayerNorm(5), sequence_model),
    NormCase("layer-norm-seq-eval", lambda: nn.LayerNorm(5), sequence_model, training=False),
    NormCase("layer-norm-seq-nobias", lambda: nn.LayerNorm(5, bias=False), sequence_model),
    NormCase(
        "layer-norm-seq-noaffine",
        lambda: nn.LayerNorm(5, elementwise_affine=False),
        sequence_model,
    ),
    NormCase("layer-norm-seq-last2", lambda: nn.LayerNorm((3, 5), eps=1e-3), sequence_model),
    NormCase("layer-norm-image-last1", lambda: nn.LayerNorm(4), image_model),
    NormCase("layer-norm-image-last2", lambda: nn.LayerNorm((4, 4), bias=False), image_model),
    NormCase("layer-norm-image-last3", lambda: nn.LayerNorm((4, 4, 4)), image_model),
    NormCase("group-norm-image", lambda: nn.GroupNorm(2, 4), image_model),
    NormCase("group-norm-image-eval", lambda: nn.GroupNorm(2, 4), image_model, training=False),
    NormCase("group-norm-image-noaffine", lambda: nn.GroupNorm(2, 4, affine=False), image_model),
    NormCase("group-norm-image-instance", lambda: nn.GroupNorm(4, 4, eps=1e-2), image_model),
    NormCase("group-norm-signal", lambda: nn.GroupNorm(2, 4), signal_model),
    NormCase("group-norm-flat", lambda: nn.GroupNorm(3, 6), flat_model),
]
RMS_CASES = [
    NormCase("rms-norm-flat", lambda: rms_norm(6), flat_model),
    NormCase("rms-norm-seq-eval", lambda: rms_norm(5), sequence_model, training=False),
    NormCase(
        "rms-norm-seq-noaffine", lambda: rms_norm(5, elementwise_affine=False), sequence_model
    ),
    NormCase("rms-norm-seq-last2", lambda: rms_norm((3, 5), eps=1e-3), sequence_model),
    NormCase("rms-norm-image-last2", lambda: rms_norm((4, 4)), image_model),
]
ALL_CASES = [pytest.param(case, id=case.name) for case in CASES] + [
    pytest.param(case, id=case.name, marks=needs_rms_norm) for case in RMS_CASES
]
REDUCTIONS = ["mean", "sum"]
BATCH_SIZES = [2, 7]


# Tiny models: a second thread only contends on a shared machine (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


def registered(*extensions):
    return [norms.register_normalization_extensions(ext) for ext in extensions]


def make_problem(case: NormCase, n: int, seed: int = 0):
    """Seeded extended model, an un-extended copy of it, inputs and targets."""
    torch.manual_seed(seed)
    model = case.build()
    reference_model = copy.deepcopy(model)
    inputs = torch.randn(n, *case.example_shape, dtype=torch.float64)
    targets = torch.randint(0, 3, (n,))
    return extend(model), reference_model, inputs, targets


def backward_with(model, inputs, targets, reduction, extensions):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(inputs), targets, reduction=reduction)
    with backpack(*extensions):
        loss.backward()


def contributions_reference(reference_model, inputs, targets, reduction):
    """``{name: x_i [N, *param.shape]}``: ``g_i / N`` for a mean, ``g_i`` for a sum."""
    per_example_loss = nn.CrossEntropyLoss(reduction="none")
    grads = references.per_example_gradients(reference_model, per_example_loss, inputs, targets)
    scale = 1.0 / len(inputs) if reduction == "mean" else 1.0
    return {name: scale * g for name, g in grads.items()}


def expected_savefields(x: torch.Tensor) -> dict:
    """Each extension's result from contributions ``x``, as BackPACK defines it."""
    n = x.shape[0]
    return {
        "grad_batch": x,
        "batch_l2": x.pow(2).flatten(start_dim=1).sum(1),
        "sum_grad_squared": x.pow(2).sum(0),
        "variance": x.pow(2).sum(0) / n - (x.sum(0) / n) ** 2,
    }


def assert_close_relative(got: torch.Tensor, expected: torch.Tensor, what: str):
    """``||got - expected|| <= RTOL ||expected||``, with a nonzero ``expected``."""
    assert got.shape == expected.shape, what
    scale = expected.norm().item()
    assert scale > 0, f"{what}: the reference is zero, the comparison would prove nothing"
    error = (got - expected).norm().item()
    assert error <= RTOL * scale, f"{what}: relative error {error / scale:.2e}"


@pytest.mark.parametrize("n", BATCH_SIZES, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_savefields_match_per_example_loop(case, reduction, n):
    model, reference_model, inputs, targets = make_problem(case, n)
    extensions = registered(BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance())
    backward_with(model, inputs, targets, reduction, extensions)

    expected = contributions_reference(reference_model, inputs, targets, reduction)
    params = dict(model.named_parameters())
    assert set(expected) == set(params)
    for name, x in expected.items():
        for savefield, value in expected_savefields(x).items():
            assert_close_relative(getattr(params[name], savefield), value, f"{name}.{savefield}")


@pytest.mark.parametrize("n", BATCH_SIZES, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_package_sums_match_per_example_loop(case, reduction, n):
    """The package's ``SumsOfContributions`` (its own rows, no registration):
    ``[sum_i x_i, sum_i x_i**2]`` of every parameter."""
    model, reference_model, inputs, targets = make_problem(case, n)
    backward_with(model, inputs, targets, reduction, [SumsOfContributions()])
    params = dict(model.named_parameters())
    for name, x in contributions_reference(reference_model, inputs, targets, reduction).items():
        total, squares = getattr(params[name], SUMS_SAVEFIELD)
        assert_close_relative(total, x.sum(0), f"{name} sum")
        assert_close_relative(squares, x.pow(2).sum(0), f"{name} sum of squares")


class OwnBatchL2(BatchL2Grad):
    """A subclass with its own savefield, as the package's quantities use."""

    def __init__(self):
        super().__init__()
        self.savefield = "own_batch_l2"


class OwnSumGradSquared(SumGradSquared):
    def __init__(self):
        super().__init__()
        self.savefield = "own_sum_grad_squared"


SUBCLASS_CASE = CASES[1]  # layer-norm-seq


def check_subclass_savefields(model, reference_model, inputs, targets):
    expected = contributions_reference(reference_model, inputs, targets, "mean")
    for name, param in model.named_parameters():
        fields = expected_savefields(expected[name])
        assert_close_relative(param.own_batch_l2, fields["batch_l2"], name)
        assert_close_relative(param.own_sum_grad_squared, fields["sum_grad_squared"], name)


def test_subclasses_with_own_savefields_get_the_rows():
    model, reference_model, inputs, targets = make_problem(SUBCLASS_CASE, 7)
    backward_with(model, inputs, targets, "mean", registered(OwnBatchL2(), OwnSumGradSquared()))
    check_subclass_savefields(model, reference_model, inputs, targets)


def test_batch_grad_subsampling():
    model, reference_model, inputs, targets = make_problem(CASES[9], 7)  # group-norm-image
    active = [0, 3, 6]
    backward_with(model, inputs, targets, "sum", registered(BatchGrad(subsampling=active)))
    expected = contributions_reference(reference_model, inputs, targets, "sum")
    for name, param in model.named_parameters():
        assert_close_relative(param.grad_batch, expected[name][active], name)


def test_extensions_with_different_subsampling_in_one_pass():
    # The contributions are computed once per layer for all extensions of a
    # backward pass: one subsampling must never be served another's examples.
    class OtherBatchGrad(BatchGrad):
        def __init__(self, subsampling=None):
            super().__init__(subsampling=subsampling)
            self.savefield = "other_grad_batch"

    model, reference_model, inputs, targets = make_problem(CASES[1], 7)  # layer-norm-seq
    first, second = [0, 3, 6], [1, 2]
    extensions = registered(BatchGrad(subsampling=first), OtherBatchGrad(subsampling=second),
                            SumGradSquared())
    backward_with(model, inputs, targets, "sum", extensions)
    expected = contributions_reference(reference_model, inputs, targets, "sum")
    for name, param in model.named_parameters():
        x = expected[name]
        assert_close_relative(param.grad_batch, x[first], name)
        assert_close_relative(param.other_grad_batch, x[second], name)
        assert_close_relative(param.sum_grad_squared, expected_savefields(x)["sum_grad_squared"], name)


def test_register_rejects_what_it_cannot_extend():
    with pytest.raises(TypeError, match=r"BatchGrad\(\)"):
        norms.register_normalization_extensions(BatchGrad)
    with pytest.raises(TypeError, match="DiagGGNExact is not an instance"):
        norms.register_normalization_extensions(DiagGGNExact())


class ConstantWeight(FirstOrderModuleExtension):
    """A row that saves a marker, to see which row BackPACK used."""

    def __init__(self):
        super().__init__(params=["weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        return "own row"


def test_existing_rows_are_kept_unless_overwrite():
    model, _, inputs, targets = make_problem(SUBCLASS_CASE, 2)
    layer_norm = model[1]

    extension = BatchGrad()
    extension.set_module_extension(nn.LayerNorm, ConstantWeight())
    norms.register_normalization_extensions(extension)
    norms.register_normalization_extensions(extension)  # twice: harmless
    backward_with(model, inputs, targets, "mean", [extension])
    assert layer_norm.weight.grad_batch == "own row"

    norms.register_normalization_extensions(extension, overwrite=True)
    backward_with(model, inputs, targets, "mean", [extension])
    assert layer_norm.weight.grad_batch.shape == (2, 5)


class LayerNormOfEmbedding(nn.Module):
    """Normalizes a learned vector that has no batch dimension."""

    def __init__(self, elementwise_affine=True):
        super().__init__()
        self.position = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.norm = nn.LayerNorm(5, elementwise_affine=elementwise_affine).double()

    def forward(self, x):
        return x + self.norm(self.position)


def test_input_without_batch_dimension_is_a_clear_error():
    model = extend(LayerNormOfEmbedding())
    loss = model(torch.randn(3, 5, dtype=torch.float64)).sum()
    with pytest.raises(ValueError, match="add a batch dimension"):
        # BackPACK also warns that it has no row for the outer module's parameter.
        with pytest.warns(UserWarning, match="LayerNormOfEmbedding"):
            with backpack(*registered(BatchGrad())):
                loss.backward()


def test_input_without_batch_dimension_passes_a_norm_without_parameters():
    model = extend(LayerNormOfEmbedding(elementwise_affine=False))
    loss = model(torch.randn(3, 5, dtype=torch.float64)).sum()
    with pytest.warns(UserWarning, match="LayerNormOfEmbedding"):
        with backpack(*registered(BatchGrad())):
            loss.backward()
    assert model.position.grad is not None


def test_layers_around_an_unregistered_norm_keep_backpack_results():
    """First-order extensions need no derivatives to pass a LayerNorm: without
    rows only its own parameters lack results (and BackPACK warns)."""
    model, reference_model, inputs, targets = make_problem(SUBCLASS_CASE, 7)
    with pytest.warns(UserWarning, match="does not have an extension for Module"):
        backward_with(model, inputs, targets, "mean", [BatchGrad()])
    expected = contributions_reference(reference_model, inputs, targets, "mean")
    for name, param in model.named_parameters():
        if name.startswith("1."):
            assert not hasattr(param, "grad_batch")
        else:
            assert_close_relative(param.grad_batch, expected[name], name)


@pytest.fixture
def global_registration():
    """Stock BackPACK before and after the test, whatever it does."""
    norms.unregister_normalization_extensions_globally()
    yield
    norms.unregister_normalization_extensions_globally()


def layer_norm_weight_after_stock_batch_grad():
    """BackPACK's ``BatchGrad()`` on a LayerNorm model: (warned?, has grad_batch?)."""
    model, _, inputs, targets = make_problem(SUBCLASS_CASE, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward_with(model, inputs, targets, "mean", [BatchGrad()])
    warned = any("does not have an extension" in str(w.message) for w in caught)
    return warned, hasattr(model[1].weight, "grad_batch")


def test_global_registration_applies_to_later_instances(global_registration):
    assert layer_norm_weight_after_stock_batch_grad() == (True, False)

    norms.register_normalization_extensions_globally()
    norms.register_normalization_extensions_globally()  # twice: wraps once
    model, reference_model, inputs, targets = make_problem(SUBCLASS_CASE, 7)
    stock = [BatchGrad(), BatchL2Grad(), SumGradSquared(), Variance()]
    backward_with(model, inputs, targets, "mean", stock + [OwnBatchL2(), OwnSumGradSquared()])
    expected = contributions_reference(reference_model, inputs, targets, "mean")
    for name, param in model.named_parameters():
        for savefield, value in expected_savefields(expected[name]).items():
            assert_close_relative(getattr(param, savefield), value, f"{name}.{savefield}")
    check_subclass_savefields(model, reference_model, inputs, targets)

    norms.unregister_normalization_extensions_globally()
    assert layer_norm_weight_after_stock_batch_grad() == (True, False)


STOCK_CHECK = """
import warnings, torch
from torch import nn
from backpack import backpack, extend
from backpack.extensions import BatchGrad
import cockpit_gradnoise.extensions.normalization

model = extend(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5)))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with backpack(BatchGrad()):
        model(torch.randn(2, 4)).sum().backward()
warned = any("does not have an extension" in str(w.message) for w in caught)
print(warned, hasattr(model[1].weight, "grad_batch"), hasattr(model[0].weight, "grad_batch"))
"""


def test_import_alone_keeps_stock_backpack():
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", STOCK_CHECK], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False", "True"]


def run_cockpit_full_first_order(model, inputs, targets, steps=2):
    """Steps of Cockpit's "full" configuration less its second-order quantities."""
    from cockpit import Cockpit, quantities
    from cockpit.utils.configuration import configuration

    second_order = (quantities.HessMaxEV, quantities.HessTrace, quantities.TICDiag)
    tracked = [q for q in configuration("full") if not isinstance(q, second_order)]
    cockpit = Cockpit(model.parameters(), quantities=tracked)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = nn.functional.cross_entropy(outputs, targets)
        info = {
            "batch_size": len(inputs),
            "individual_losses": nn.functional.cross_entropy(outputs, targets, reduction="none"),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit.get_output()


def norm_test_reference(contributions: dict) -> float:
    """Cockpit's NormTest: ``sqrt(N^2 sum_i ||x_i||^2 - N ||g||^2) / (N-1) / N / ||g||^2)``."""
    x = torch.cat([c.flatten(start_dim=1) for c in contributions.values()], dim=1)
    n = x.shape[0]
    grad_l2 = x.sum(0).pow(2).sum()
    variance_l1 = (n**2 * x.pow(2).sum() - n * grad_l2) / (n - 1)
    return (variance_l1 / n / grad_l2).sqrt().item()


def test_cockpit_runs_on_layer_norm_once_rows_are_registered_globally(global_registration):
    """Cockpit's quantities construct plain ``BatchGrad()``; its transforms hook
    then reads ``grad_batch`` of every parameter, which stock BackPACK leaves
    out for LayerNorm."""
    model, reference_model, inputs, targets = make_problem(SUBCLASS_CASE, 7)
    with pytest.warns(UserWarning, match="does not have an extension"):
        with pytest.raises(AttributeError, match="grad_batch_transforms"):
            run_cockpit_full_first_order(copy.deepcopy(model), inputs, targets, steps=1)

    norms.register_normalization_extensions_globally()
    output = run_cockpit_full_first_order(model, inputs, targets)
    expected = contributions_reference(reference_model, inputs, targets, "mean")
    assert output[0]["NormTest"] == pytest.approx(norm_test_reference(expected), rel=RTOL)
    tracked = {"Alpha", "GradHist1d", "GradHist2d", "InnerTest", "OrthoTest", "UpdateSize"}
    assert tracked <= set(output[0])
