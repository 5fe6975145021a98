"""The expanded square of a convolution's sums: its rounding bound holds, and it decides.

Where a convolution (or a Linear on a sequence: a 1x1 convolution,
``cockpit_gradnoise.extensions.linear``) has few output positions the extensions sum ``S`` over
products of positions and save ``[T, S, R]``, ``R = w(L) A`` with ``A`` the
absolute terms (:mod:`cockpit_gradnoise.extensions.conv_math`); the sd's
rounding bound adds ``N eps R``
(:func:`~cockpit_gradnoise.functional.expansion_rounding_bound`). Checked
here in float32, on the layers alone against float64 per-example gradients of
the same factors (autograd, one example at a time), and through Cockpit:

- random examples: the centred sum is within the bound of the exact one,
  and no element is clamped (real variance is far above the bound);
- identical examples: sd exactly 0 with the bound, not without it;
- micro-batches and the loss scaler carry ``R`` as they carry ``S``.
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise import amp, functional
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, conv_math, cost_model, linear

import pytest
import torch
from cockpit.utils.schedules import linear as linear_schedule
from torch import nn

from tests.cases import run_step
from tests.test_accumulation import (
    test_micro_batches_give_the_statistics_of_one_batch_of_all_their_examples as accumulated,
)
from tests.test_rounding import MODELS as ROUNDING_MODELS
from tests.test_rounding import ConvThenSequenceLinear, problem

EPS32 = torch.finfo(torch.float32).eps

# (name, layer, example shape): 4, 4 and 3 positions (a transposed convolution's are its input's).
LAYERS = [
    ("conv2d-2x2", lambda: nn.Conv2d(3, 16, 3, stride=2, padding=1), (3, 4, 4)),
    ("convtranspose2d-groups", lambda: nn.ConvTranspose2d(
        4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (4, 2, 2)),
    ("conv1d-circular", lambda: nn.Conv1d(4, 8, 3, padding=1, padding_mode="circular"), (4, 3)),
    # 2x2 and 3 positions, as ConvNeXt's stage-3 pointwise layers see at 32x32.
    ("linear-2x2", lambda: nn.Linear(12, 16), (2, 2, 12)),
    ("linear-3-positions", lambda: nn.Linear(10, 8), (3, 10)),
]


def factors(make, shape, n, seed, identical=False, cancelling=False):
    """``(layer, inputs, output gradient)`` in float32, standard normal; ``cancelling``:
    output gradients spanning six decades, so that the terms of a contribution cancel."""
    generator = torch.Generator().manual_seed(seed)
    torch.default_generator.manual_seed(seed)
    layer = make()
    inputs = torch.randn(1 if identical else n, *shape, generator=generator)
    with torch.no_grad():
        out = layer(inputs)
    grad = torch.randn(out.shape, generator=generator)
    if cancelling:
        grad = grad * 10.0 ** torch.randint(-3, 4, out.shape, generator=generator)
    if identical:
        inputs, grad = inputs.expand(n, *shape), grad.expand(n, *grad.shape[1:])
    return layer, inputs, grad


def expanded_sums(layer, inputs, grad, monkeypatch):
    """The extension's ``[T, S, R]`` of the weight, the expansion forced."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")
    if isinstance(layer, nn.Linear):
        sums = linear.linear_expanded_sums(inputs, grad)
    else:
        sums = conv_math.weight_sums(layer, inputs, grad)
    assert len(sums) == 3
    return sums


def exact_centred_sum(layer, inputs, grad):
    """``sum_i (x_i - mean)**2`` in float64 from each example's weight gradient by autograd."""
    wide = copy.deepcopy(layer).double()
    rows = []
    for x, g in zip(inputs.double(), grad.double()):
        (row,) = torch.autograd.grad((wide(x[None]) * g[None]).sum(), wide.weight)
        rows.append(row)
    x = torch.stack(rows)
    return (x - x.mean(0)).square().sum(0)


def absolute_terms(layer, inputs, grad):
    """``A = sum_i (sum_l |b_il| |a_il|^T)**2`` in float64: ``sum_l |b_il| |a_il|^T`` is the
    weight gradient of the layer applied to ``|input_i|`` with output gradient
    ``|grad_i|`` (its patches, padded in any mode, are the input's made absolute)."""
    wide = copy.deepcopy(layer).double()
    total = torch.zeros_like(wide.weight)
    for x, g in zip(inputs.double(), grad.double()):
        (alpha,) = torch.autograd.grad((wide(x.abs()[None]) * g.abs()[None]).sum(), wide.weight)
        total += alpha.square()
    return total


def bound(sums, n):
    """The sd's rounding bound of ``[T, S, R]``: ``(3N + 4) eps S + N eps R``, float64."""
    relative = functional.variance_rounding_bound(sums[1].double(), n, dtype=torch.float32)
    return relative + functional.expansion_rounding_bound(sums[2].double(), n, torch.float32)


def sd_of(sums, n, with_bound=True):
    """:func:`~cockpit_gradnoise.functional.gradient_sd` as GradientVarianceQuantiles computes it."""
    total, squares, magnitudes = sums
    extra = functional.expansion_rounding_bound(magnitudes, n, torch.float32) if with_bound else None
    return functional.gradient_sd(squares.clone(), total.float(), n, dtype=torch.float32,
                                  extra_rounding=extra)


@pytest.mark.parametrize("n", [2, 7, 64])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_random_examples_are_within_the_bound_and_kept(name, make, shape, n, monkeypatch):
    """Within the bound also where the terms cancel; nothing clamped where they do not.
    (Where they cancel by more than about ``1 / (N w(L) eps)``, ``1e4`` here,
    the expansion cannot resolve an element's variance, and sets it to 0.)"""
    for seed in range(2):
        layer, inputs, grad = factors(make, shape, n, seed, cancelling=True)
        sums = expanded_sums(layer, inputs, grad, monkeypatch)
        exact, allowed = exact_centred_sum(layer, inputs, grad), bound(sums, n)
        centred = sums[1].double() - sums[0].double().square() / n
        assert ((centred - exact).abs() <= allowed).all(), (seed, (centred - exact).abs().max())
        layer, inputs, grad = factors(make, shape, n, seed)
        sums = expanded_sums(layer, inputs, grad, monkeypatch)
        exact, allowed = exact_centred_sum(layer, inputs, grad), bound(sums, n)
        sd = sd_of(sums, n)
        # Only what rounding cannot resolve is set to 0: a computed centred sum within
        # the bound of 0 and of the exact one.
        assert (exact[sd == 0] <= 2 * allowed[sd == 0]).all()
        if n > 2:
            # Real variance: none of it taken for rounding noise (0 where padding alone is
            # read). Two examples can agree to 1e-5 by chance: there the sd is 0 only
            # where x_1 - x_2 is within the bound (above); from 7 examples on the
            # smallest centred sum is 968 times the bound (seeds 0 and 1).
            assert torch.equal(sd > 0, exact > 0)
        # The sd's own roundings (scale, product, square root): a few eps of sd**2.
        from_sd = sd.double().square() * (n - 1) / n
        assert ((from_sd - exact).abs() <= allowed + 8 * EPS32 * exact).all()


@pytest.mark.parametrize("n", [2, 7, 64])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_the_magnitudes_are_w_of_L_times_the_absolute_terms(name, make, shape, n, monkeypatch):
    """``R = w(L) A`` to float32's rounding of a sum of ``M = N L(L+1)/2`` positive terms,
    each three rounded products: ``(M + 2) u`` relative, one more for ``w(L)``, and
    ``eps = 2u`` for the second-order terms."""
    layer, inputs, grad = factors(make, shape, n, 0, cancelling=True)
    sums = expanded_sums(layer, inputs, grad, monkeypatch)
    if isinstance(layer, nn.Linear):
        positions = grad[0, ..., 0].numel()
    else:
        positions = (inputs if isinstance(layer, conv_math.TRANSPOSED) else grad)[0, 0].numel()
    weight = conv_math.expansion_rounding_terms(positions)
    exact = weight * absolute_terms(layer, inputs, grad)
    terms = n * positions * (positions + 1) // 2 + 3
    assert ((sums[2].double() - exact).abs() <= terms * EPS32 * exact).all()


@pytest.mark.parametrize("n", [2, 7, 64])
@pytest.mark.parametrize("name, make, shape", LAYERS, ids=[layer[0] for layer in LAYERS])
def test_identical_examples_give_sd_exactly_zero(name, make, shape, n, monkeypatch):
    """With the bound every element is 0; without it, formation's bound alone
    (relative to ``S``), rounding noise of the expansion passes (shown on some seed)."""
    noisy = 0
    for seed in range(4):
        layer, inputs, grad = factors(make, shape, n, seed, identical=True, cancelling=True)
        sums = expanded_sums(layer, inputs, grad, monkeypatch)
        assert torch.equal(sd_of(sums, n), torch.zeros_like(sums[0], dtype=torch.float32))
        noisy += int(sd_of(sums, n, with_bound=False).count_nonzero())
    assert noisy > 0, "formation's bound alone must let the expansion's noise through"


def _spy_on_expansion(monkeypatch):
    """Counts the calls of the convolutions' and the Linear layers' expansion, forced."""
    calls = []
    for module, name in [(conv_math, "expanded_sums"), (linear, "linear_expanded_sums")]:
        monkeypatch.setattr(module, name, _counting(getattr(module, name), calls, name))
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")
    return calls


def _counting(function, calls, name):
    def spy(*args):
        calls.append(name)
        return function(*args)

    return spy


# The 2x2 convolution whose terms cancel, and a Linear over 4 positions of a Conv1d's output.
THROUGH_COCKPIT = [(next(m[1:] for m in ROUNDING_MODELS if m[0] == "conv2d-few-positions"), "0.weight"),
                   ((lambda: ConvThenSequenceLinear(6), (2, 6)), "step.weight")]


@pytest.mark.parametrize("model, weight", THROUGH_COCKPIT, ids=["conv2d", "sequence-linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identical_examples_through_cockpit_give_sd_zero_and_the_largest_snr(
        model, weight, dtype, monkeypatch):
    """test_rounding's cancelling 2x2 convolution, and a Linear over 4 positions, their
    sums expanded: sd 0 and the SNR at
    :func:`~cockpit_gradnoise.functional.resolvable_snr`, as with formation."""
    calls = _spy_on_expansion(monkeypatch)
    make, shape = model
    for n, reduction in [(7, "mean"), (33, "sum")]:
        for seed in range(2):
            case = problem(make, shape, n, reduction, dtype, seed)
            quantity = cgn.GradientVarianceQuantiles(linear_schedule(1), param_names=case.names)
            output = run_step(case, [quantity]).get_output()[0]["GradientVarianceQuantiles"]
            limit = torch.tensor(functional.resolvable_snr(n, dtype), dtype=dtype).item()
            statistics = output[weight]
            assert all(v == 0 for s, v in statistics.items() if not s.startswith("snr_"))
            assert statistics["snr_q0.5"] == limit
    assert calls


@pytest.mark.parametrize("model, expanded", [("cnn", "expanded_sums"), ("gpt", "linear_expanded_sums")])
def test_micro_batches_add_the_magnitudes_as_they_add_the_sums(model, expanded, monkeypatch):
    """The accumulation test's CNN (3x3 positions) and the case matrix's GPT (Linear
    layers over 4 positions) with their sums expanded: the statistics of the
    micro-batches are those of one batch of all their examples."""
    calls = _spy_on_expansion(monkeypatch)
    accumulated(model, "tracker", (2, 3), "mean")
    assert expanded in calls


def test_the_loss_scaler_divides_the_magnitudes_as_sums_of_squares():
    value = torch.tensor([[2.0], [8.0], [16.0]])
    unscaled = amp.unscaled_savefield(SUMS_SAVEFIELD, value, 2.0)
    assert unscaled.flatten().tolist() == [1.0, 2.0, 4.0]


def test_a_backward_pass_with_create_graph_gets_the_expanded_sums(monkeypatch):
    """Under ``create_graph`` (Cockpit's second-order quantities) the output gradients
    require grad; the expansion writes its products in place, outside autograd."""
    _spy_on_expansion(monkeypatch)
    layer, inputs, grad = factors(*LAYERS[0][1:], 5, 0)
    reference = conv_math.weight_sums(layer, inputs, grad)
    sums = conv_math.weight_sums(layer, inputs, grad.requires_grad_())
    assert torch.equal(sums, reference) and not sums.requires_grad
