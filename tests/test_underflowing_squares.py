"""Issue 32: no silent wrong number from squares that underflow.

Where every square of an element's contributions underflows (float32 contributions
below about ``1e-19``, or ``2**-63`` below their layer's largest on the scaled path;
float64 ones below about ``1.5e-154``), ``S_j = sum_i x_ij**2`` came out 0 or
subnormal, and GradientVarianceQuantiles reported ``sd_j = 0`` and the SNR cap
("examples agree to rounding") where the exact SNR is of order 1; an example's
squared norm came out 0 although its gradient is not. Now float32 layers get the
exact numbers (their squares formed again in float64 where the check finds one
lost, :func:`._squares.exact_where_lost`), and float64 ones, where no wider dtype
holds those squares, are left out by name with a warning
(:mod:`.functional.underflow`).

The cases: a unit that is on only where a sigmoid saturates (``sigma'(z) <= e^-s``,
:class:`tests.test_saturated_units.SaturatedUnit`), on the native rules (``[N, T, 1]``)
and on the block path (rows ``[N*T, 1]``), and at the scale of a head ``2**-50``
smaller (its layers then take the scaled path); and examples whose inputs are
``1e-25`` (float32) or ``1e-170`` (float64) times the others', so that their squared
norms underflow while the other examples keep every element's sums normal.
"""

import copy
import math
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, references
from cockpit_gradnoise.extensions import _squares

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.helpers import rows
from tests.test_saturated_units import TOKENS, SaturatedUnit, saturating_inputs

QUANTITIES = ("GradientVarianceQuantiles", "PerExampleGradNorm", "GradientNoiseScale")
LEVELS = (0.0, 0.5, 1.0)


def saturated(dtype, saturating, flatten, head_scale=1.0):
    """:class:`SaturatedUnit` in ``dtype`` with ``fc``'s unit 0 at ``z <= -saturating``."""
    torch.manual_seed(0)
    model = SaturatedUnit(flatten).to(dtype)
    with torch.no_grad():
        model.fc.weight[0, 0] = saturating
        model.head.weight.mul_(head_scale)
    return model


class ExampleScaled(nn.Module):
    """``head(tanh(fc(x)))``: ``fc`` a ``Linear`` on ``[N, in]`` (``"products"``) or on
    sequences ``[N, T, in]`` (``"sequences"``), or a ``Conv2d`` on ``[N, in, 5, 5]``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.fc = nn.Conv2d(3, 2, 3) if kind == "convolutions" else nn.Linear(3, 4)
        self.head = nn.Linear(18 if kind == "convolutions" else 4, 3)

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        y = self.head(y.flatten(1) if self.kind == "convolutions" else y)
        return y.mean(1) if self.kind == "sequences" else y


SHAPES = {"products": (4, 3), "sequences": (4, 5, 3), "convolutions": (4, 3, 5, 5)}


def example_scaled(dtype, tiny, kind):
    """The model and inputs whose examples 1 and 3 are ``tiny`` times the others'."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    shape = SHAPES[kind]
    scales = torch.tensor([1.0, tiny, 1.0, tiny], dtype=torch.float64).reshape(4, *[1] * (len(shape) - 1))
    inputs = (torch.randn(shape, generator=generator, dtype=torch.float64) * scales).to(dtype)
    return ExampleScaled(kind).to(dtype), inputs, torch.randint(0, 3, (4,), generator=generator)


def tracked(model, inputs, targets):
    """``({quantity: rows}, [warning texts])`` of one tracked step of every quantity."""
    model = cgn.prepare_model(copy.deepcopy(model))
    loss_fn, per_example = extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")
    names = [name for name, _ in model.named_parameters()]
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), quantiles=LEVELS, param_names=names),
        cgn.PerExampleGradNorm(linear(1), quantiles=LEVELS, param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names),
    ]
    cockpit = cgn.Cockpit(list(model.parameters()), quantities=quantities)
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"loss": loss, "individual_losses": per_example(outputs, targets),
                              "batch_size": len(inputs)}):
            loss.backward()
    return {q: rows(cockpit, q) for q in QUANTITIES}, [str(w.message) for w in caught]


def expected(model, inputs, targets, dtype, left_out):
    """The per-example references of the three quantities, without ``left_out``
    (``{quantity: names}``) in their ``"all"``: the gradients of a loop over the examples
    in the model's dtype (float32 rounds them as the model does), the statistics of them in
    float64."""
    double, x = copy.deepcopy(model), inputs
    per_example = nn.CrossEntropyLoss(reduction="none")
    grads = {name: g.double() for name, g in
             references.per_example_gradients(double, per_example, x, targets).items()}
    result = {}
    for quantity, reference in [
        ("GradientVarianceQuantiles", lambda g: references.gradient_variance_quantiles(
            double, per_example, x, targets, reduction="mean", quantiles=LEVELS, gradients=g, dtype=dtype)),
        ("PerExampleGradNorm", lambda g: references.per_example_grad_norm(
            double, per_example, x, targets, quantiles=LEVELS, gradients=g)),
        ("GradientNoiseScale", lambda g: references.gradient_noise_scale(
            double, per_example, x, targets, gradients=g)),
    ]:
        kept = {name: g for name, g in grads.items() if name not in left_out.get(quantity, ())}
        result[quantity] = reference(kept)
    return result, {name: g / len(inputs) for name, g in grads.items()}  # x_i = g_i / N


def assert_exact_or_left_out(model, inputs, targets, left_out, inner_terms=1):
    """Every parameter of every quantity within its rounding of the per-example reference
    (``"all"`` without those left out), and those of ``left_out`` (``{quantity: names}``) left
    out, each named in a warning that says why; no other warning of underflow."""
    dtype = next(model.parameters()).dtype
    got, told = tracked(model, inputs, targets)
    want, grads = expected(model, inputs, targets, dtype, left_out)
    for quantity in QUANTITIES:
        gone = left_out.get(quantity, ())
        assert set(got[quantity]) == set(want[quantity]) - set(gone), quantity
        for name in gone:
            assert any(quantity in text and repr(name) in text and "underflow" in text for text in told), (
                quantity, name, told)
        kept = {key: g for key, g in grads.items() if key not in gone}
        for name, statistics in want[quantity].items():
            if name in gone:
                continue
            for statistic, value in statistics.items():
                if quantity == "GradientNoiseScale" and statistic not in ("grad_sq", "trace_cov"):
                    continue
                rel = tolerance(quantity, kept, len(inputs), name, inner_terms, dtype)
                assert got[quantity][name][statistic] == pytest.approx(value, rel=rel, abs=0.0), (
                    quantity, name, statistic)
    unexpected = [text for text in told if "underflow" in text and not any(
        q in text for q in left_out)]
    assert not unexpected, unexpected


def tolerance(quantity, grads, n, name, inner_terms, dtype):
    """Relative rounding of ``name``'s statistics in ``dtype``: for sd and SNR
    :func:`tests.helpers.sd_rtol`'s ``2 (N + L) eps (1 + SNR_max**2 / (N - 1))`` (the
    one-pass formula's cancellation), for norms and the noise scale's sums ``(N + P) eps``
    over the cancellation of ``tr(Sigma)`` and ``|G|^2`` (:func:`tests.helpers.rounding_bounds`)."""
    eps = torch.finfo(dtype).eps
    x = torch.cat([g.reshape(n, -1) for key, g in grads.items() if name in (key, cgn.NETWORK)], 1)
    if quantity == "GradientVarianceQuantiles":
        sd = (n / (n - 1) * (x - x.mean(0)).pow(2).sum(0)).sqrt()
        snr = x.sum(0).abs()[sd > 0] / sd[sd > 0]
        return max(1e-12, 2 * (n + inner_terms) * eps * (1 + float(snr.max()) ** 2 / (n - 1)))
    bound = 4 * (n + x.shape[1] + inner_terms) * eps
    if quantity == "PerExampleGradNorm":
        return bound
    squares, mean = x.square().sum() / n, x.mean(0).square().sum()
    centred = min(float(squares - mean), float(n * mean - squares / n))
    return bound * max(1.0, float(squares) / max(abs(centred), 1e-300))


@pytest.mark.parametrize("flatten", [False, True], ids=["native", "block"])
def test_float32_saturated_unit_is_exact(flatten):
    """Before: ``snr_q0.5`` of ``fc.bias`` 569 (the cap) instead of 1.86, sd 0."""
    inputs, targets = saturating_inputs(3)
    model = saturated(torch.float32, 50.0, flatten)
    assert_exact_or_left_out(model, inputs.float(), targets, {}, TOKENS)


def test_float32_saturated_unit_on_the_scaled_path_is_exact():
    """The head ``2**-50`` smaller: ``fc`` and ``out`` are summed at a scale (their largest
    contribution is below ``2**-40``), where the unit's (``2**-66`` below it) squares underflow."""
    inputs, targets = saturating_inputs(3)
    model = saturated(torch.float32, 45.0, flatten=False, head_scale=2.0**-50)
    assert_exact_or_left_out(model, inputs.float(), targets, {}, TOKENS)


@pytest.mark.parametrize("flatten", [False, True], ids=["native", "block"])
def test_float64_saturated_unit_is_left_out_by_name(flatten):
    """float64 contributions ~1e-161: no wider dtype holds their squares, so ``fc``'s
    parameters and ``out.weight`` (the unit's weight there) are left out of
    GradientVarianceQuantiles, named (before: sd 0, SNR the cap,
    no warning); the other quantities and parameters stay exact."""
    inputs, targets = saturating_inputs(3)
    gone = {"GradientVarianceQuantiles": ("fc.weight", "fc.bias", "out.weight")}
    assert_exact_or_left_out(saturated(torch.float64, 370.0, flatten), inputs, targets, gone, TOKENS)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_float32_tiny_examples_keep_their_norms(kind):
    """Examples with inputs ``1e-25`` times the others': ``fc.weight``'s squared norms of them,
    ~1e-50, were 0 in float32 (before: the norms' ``q0`` 0)."""
    model, inputs, targets = example_scaled(torch.float32, 1e-25, kind)
    assert_exact_or_left_out(model, inputs, targets, {}, 9 if kind == "convolutions" else 5)


@pytest.mark.parametrize("kind", list(SHAPES))
def test_float64_tiny_examples_are_left_out_of_the_norms_by_name(kind):
    """Inputs ``1e-170`` times the others': ``fc.weight``'s squared norms of those examples
    underflow in float64 (before: 0, no warning). Its sums of squares over the batch, and so
    GradientVarianceQuantiles and GradientNoiseScale, are held by the other examples."""
    model, inputs, targets = example_scaled(torch.float64, 1e-170, kind)
    gone = {"PerExampleGradNorm": ("fc.weight",)}
    assert_exact_or_left_out(model, inputs, targets, gone, 9 if kind == "convolutions" else 5)


@pytest.mark.parametrize("case", ["saturated", "tiny examples"])
def test_on_other_devices_float32_is_nan_by_name(case, monkeypatch):
    """Where the host would wait to know (a GPU: the device's path, here on CPU tensors), the
    float32 sums are not formed again, and what the checks find is known only with the
    step's one transfer: those parameters' rows, and the network's, are NaN, named in a
    warning that says why; every other parameter's rows exact."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    if case == "saturated":
        inputs, targets = saturating_inputs(3)
        model, inputs, quantity = saturated(torch.float32, 50.0, False), inputs.float(), "GradientVarianceQuantiles"
        gone, inner_terms = ("fc.weight", "fc.bias", "out.weight"), TOKENS
    else:
        model, inputs, targets = example_scaled(torch.float32, 1e-25, "products")
        quantity, gone, inner_terms = "PerExampleGradNorm", ("fc.weight",), 5
    got, told = tracked(model, inputs, targets)
    want, grads = expected(model, inputs, targets, torch.float32, {})
    for name, statistics in got[quantity].items():
        for statistic, value in statistics.items():
            if name in gone or name == cgn.NETWORK:
                assert math.isnan(value), (name, statistic)
            else:
                rel = tolerance(quantity, grads, len(inputs), name, inner_terms, torch.float32)
                assert value == pytest.approx(want[quantity][name][statistic], rel=rel, abs=0.0)
    named = [text for text in told if "underflow" in text]
    assert len(named) == 1 and quantity in named[0] and all(repr(n) in named[0] for n in gone), told
    assert not [text for text in told if "NaN or Inf" in text], told


def test_preconditioned_noise_scale_leaves_out_the_saturated_unit_by_name():
    """PreconditionedNoiseScale reads GradientVarianceQuantiles' per-element sums: the
    float64 unit whose squares underflow (as above) is left out of it by name, checked
    on its own sums (before, it read GradientNoiseScale's per-example norms, which it
    does not have alone: an AttributeError); the others keep rows."""
    got, told, names = tracked_with_optimizer(("PreconditionedNoiseScale",))
    told = [text for text in told if "underflow" in text]
    assert len(told) == 1 and all(name in told[0] for name in ("fc.weight", "fc.bias", "out.weight"))
    kept = got["PreconditionedNoiseScale"]
    assert {"fc.weight", "fc.bias", "out.weight"}.isdisjoint(kept)
    assert set(names) - {"fc.weight", "fc.bias", "out.weight"} <= set(kept)


def tracked_with_optimizer(quantities, optimizer=torch.optim.SGD, dtype=torch.float64):
    """``({quantity: rows}, [warning texts], parameter names)`` of one step of ``quantities``
    (class names) on the model whose unit saturates (``fc``'s squares underflow: in float64,
    or float32 at ``z = -50``), with ``optimizer`` in ``info``."""
    inputs, targets = saturating_inputs(3)
    model = cgn.prepare_model(saturated(dtype, 370.0 if dtype == torch.float64 else 50.0, False))
    inputs = inputs.to(dtype)
    names = [name for name, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(list(model.parameters()),
                          quantities=[getattr(cgn, q)(linear(1), param_names=names) for q in quantities])
    loss_fn, per_example = extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"loss": loss, "individual_losses": per_example(outputs, targets),
                              "batch_size": len(inputs), "optimizer": optimizer(model.parameters(), lr=0.1)}):
            loss.backward()
    return {q: rows(cockpit, q) for q in quantities}, [str(w.message) for w in caught], names


def test_contributions_norms_of_tiny_float32_examples_are_summed_again_in_float64():
    """``_squares.squared_norms_of`` (biases, norms, the rows of blocks): examples 1e-30 and
    1e-44 times the largest underflow at the float32 scale of the largest (0 there); their
    norms are summed again from float64 squares, so each is within float32's rounding of
    its ``numel`` float32 squares (the others) or float64's (those)."""
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[1] *= 1e-30
    x[2] *= 1e-44
    contributions = x.float()
    got = _squares.squared_norms_of(contributions)
    expected = contributions.double().square().flatten(1).sum(1)
    assert got.dtype == torch.float64 and bool((expected > 0).all())
    assert ((got - expected).abs() / expected).max().item() <= (20 + 1) * 2.0**-24
