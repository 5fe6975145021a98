"""float32 contributions of ``1e-22``: squares would underflow (below ``1e-38``).

A network whose last layer (weights and targets) is scaled by ``2**-36``
computes, in float32, exactly ``2**-72`` times the contributions of the
unscaled network upstream of it (a power of two changes no rounding), about
``1e-22`` here; their squares, ``1e-44``, are lost in float32. The package
forms them at a power-of-two scale and keeps the sums in float64, so every
statistic of the scaled network is exactly the unscaled network's times its
power of two (sd and norms), or equal (SNR), and matches the float64
reference as closely. Before: sd, norms and SNR of every upstream layer came out 0 or absent.
"""

import copy
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, references
from cockpit_gradnoise.extensions import _squares, sums
from cockpit_gradnoise.functional import underflow

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.helpers import rows
from tests.layer_models import Gate
from tests.models import NanoLayerNorm

N = 8
SHIFT = 36  # the last layer and the targets times 2**-36: contributions times 2**-72


class Sequence(nn.Module):
    """Conv2d, GroupNorm, a Linear along the 16 positions, then a plain Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.step = nn.Linear(4, 5)
        self.head = nn.Linear(80, 3)

    def forward(self, x):
        steps = torch.tanh(self.norm(self.conv(x))).flatten(2).transpose(1, 2)  # [N, 16, 4]
        return self.head(torch.tanh(self.step(steps)).flatten(1))


class Tokens(nn.Module):
    """Embedding, LayerNorm, then a Linear head."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(12, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(20, 3)

    def forward(self, tokens):
        return self.head(self.norm(self.embedding(tokens)).flatten(1))


class Positions(nn.Module):
    """Token embedding plus ``wpe(torch.arange(T))`` (without the batch dimension),
    nanoGPT's LayerNorm, a gate, then a Linear head."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(12, 4), nn.Embedding(5, 4)
        self.norm, self.gate = NanoLayerNorm(4, bias=True), Gate(4)
        self.head = nn.Linear(20, 3)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        return self.head(self.gate(torch.tanh(self.norm(x))).flatten(1))


CASES = {
    "sequence": (Sequence, lambda g: torch.randn(N, 3, 6, 6, generator=g)),
    "tokens": (Tokens, lambda g: torch.randint(0, 12, (N, 5), generator=g)),
    # The fallback (closed form and vmap) and a table applied without the batch.
    "positions": (Positions, lambda g: torch.randint(0, 12, (N, 5), generator=g)),
}
QUANTITIES = ("GradientVarianceQuantiles", "PerExampleGradNorm")


def problem(name, shift):
    """The case's float32 model, inputs and targets, the head and targets times ``2**-shift``."""
    make, inputs = CASES[name]
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make()
    x = inputs(generator)
    targets = torch.randn(N, 3, generator=generator)
    with torch.no_grad():
        model.head.weight.mul_(2.0**-shift)
        model.head.bias.mul_(2.0**-shift)
    return model, x, targets * 2.0**-shift


def tracked(model, inputs, targets):
    model = cgn.prepare_model(copy.deepcopy(model))
    loss_fn = extend(nn.MSELoss())
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), quantiles=(0.1, 0.5, 0.9), param_names=model),
        cgn.PerExampleGradNorm(linear(1), quantiles=(0.1, 0.5, 0.9), param_names=model),
    ]
    cockpit = cgn.Cockpit(list(model.parameters()), quantities=quantities)
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    individual = ((outputs - targets) ** 2).mean(1)
    with cockpit(0, info={"loss": loss, "individual_losses": individual, "batch_size": N}):
        loss.backward()
    return {quantity: rows(cockpit, quantity) for quantity in QUANTITIES}


EPS32 = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_contributions_give_the_unscaled_statistics_times_their_power_of_two(name):
    scaled = tracked(*problem(name, SHIFT))
    plain = tracked(*problem(name, 0))
    checked = 0
    for quantity in QUANTITIES:
        for param, statistics in plain[quantity].items():
            assert set(scaled[quantity][param]) == set(statistics), (quantity, param)
            if param == cgn.NETWORK:
                continue  # the head's elements scale by another power than the rest
            shift = SHIFT if param.startswith("head.") else 2 * SHIFT
            for statistic, value in statistics.items():
                factor = 1.0 if statistic.startswith("snr_") else 2.0 ** -shift
                assert value != 0 or statistic.startswith("snr_"), (quantity, param, statistic)
                # Exactly: a power of two changes no rounding, nothing underflows
                # (the sd of both from float32 sums, at a scale or not).
                assert scaled[quantity][param][statistic] == value * factor, (
                    quantity, param, statistic
                )
                checked += 1
    assert checked > 40


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_contributions_match_the_float64_reference(name):
    """As the unscaled float32 network does: the same relative errors, which are
    float32's rounding of the contributions (here below ``1e-4``)."""
    model, inputs, targets = problem(name, SHIFT)
    got = tracked(model, inputs, targets)
    double = copy.deepcopy(model).double()
    x = inputs.double() if inputs.is_floating_point() else inputs

    def per_example_loss(outputs, y):
        return ((outputs - y) ** 2).mean(1)

    expected = {
        "GradientVarianceQuantiles": references.gradient_variance_quantiles(
            double, per_example_loss, x, targets.double(), reduction="mean",
            quantiles=(0.1, 0.5, 0.9), dtype=torch.float32,
        ),
        "PerExampleGradNorm": references.per_example_grad_norm(
            double, per_example_loss, x, targets.double(), quantiles=(0.1, 0.5, 0.9)
        ),
    }
    for quantity in QUANTITIES:
        for param, statistics in expected[quantity].items():
            for statistic, value in statistics.items():
                value_got = got[quantity][param][statistic]
                assert value != 0 and value_got == pytest.approx(value, rel=1e-4), (
                    quantity, param, statistic, value_got, value
                )


@pytest.mark.parametrize("largest", [0.0, 1e-45, 1e-22, 0.75, 3.0, 1e30, math.inf, math.nan])
def test_power_of_two_scale_brings_the_largest_into_half_to_one(largest, monkeypatch):
    values = torch.tensor([largest, -largest / 3, 0.0])
    for on_host in (True, False):  # the device's path, on CPU tensors
        monkeypatch.setattr(_device, "on_host", lambda tensor, on_host=on_host: on_host)
        scale = _squares.power_of_two_scale(values).item()
        assert math.frexp(scale)[0] == 0.5  # a power of two
        if largest == 0 or not math.isfinite(largest):
            assert scale == 1.0
        elif largest > 1e-37:
            assert 0.5 <= largest * scale < 1, (largest, scale, on_host)
        else:  # kept a normal float32: 2**125 at most
            assert scale == 2.0**125


@pytest.mark.parametrize("case", ["negative", "float64 rounds up", "nan", "inf", "empty", "all empty"])
def test_power_of_two_scale_of_several_tensors_on_the_device_path(case, monkeypatch):
    """Several tensors of several dtypes: the device's path (one stack and one amax of
    the extremes) gives ``2**-e`` of the largest magnitude rounded to float32, 1 when
    any tensor holds NaN or inf (the host's path reads the extremes as Python floats:
    the same but where float32 rounding reaches the next power of two)."""
    tensors = {
        "negative": [torch.tensor([-3.0, 0.5]), torch.tensor([1e-30], dtype=torch.float64)],
        # float64 just below 2**10 rounds to 2**10 in float32, whichever path rounds it
        "float64 rounds up": [torch.tensor([2.0**10 - 2.0**-40], dtype=torch.float64),
                              torch.tensor([-7.0], dtype=torch.float16)],
        "nan": [torch.tensor([1.0]), torch.tensor([math.nan, 2.0], dtype=torch.bfloat16)],
        "inf": [torch.tensor([-math.inf], dtype=torch.float64), torch.tensor([1e-20])],
        "empty": [torch.zeros(0), torch.tensor([-1e-40, 5e-41])],
        "all empty": [torch.zeros(0), torch.zeros(0, dtype=torch.float64)],
    }[case]
    magnitudes = [abs(float(x)) for t in tensors for x in t.float().flatten()]
    largest = math.nan if any(map(math.isnan, magnitudes)) else max(magnitudes, default=0.0)
    exponent = min(max(math.frexp(largest)[1], -125), 127) if math.isfinite(largest) else 0
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    assert _squares.power_of_two_scale(*tensors).item() == 2.0**-exponent, case


def test_sums_are_float64_only_where_squares_could_underflow_on_the_cpu(monkeypatch):
    contributions = torch.randn(8, 5)
    assert _squares.contributions_scale(contributions) is None
    assert sums.sums_of(contributions).dtype == torch.float32
    tiny = contributions * 2.0**-80
    got = sums.sums_of(tiny)
    assert got.dtype == torch.float64
    assert_within_rounding(got, tiny)
    assert (tiny.square() == 0).all(), "the case must underflow without the scale"
    # Elsewhere (GPU) the value is not read: always at a scale.
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    got = sums.sums_of(contributions)
    assert got.dtype == torch.float64
    assert_within_rounding(got, contributions)


def assert_within_rounding(got, contributions):
    """``[T, S]`` as float32 sums of ``N = 8`` terms round: within ``N eps sum_i |terms|``."""
    x = contributions.double()
    bound = len(x) * EPS32
    assert ((got[0] - x.sum(0)).abs() <= bound * x.abs().sum(0)).all()
    assert ((got[1] - x.square().sum(0)).abs() <= bound * x.square().sum(0)).all()


def test_the_scales_table_gives_frexp_s_scale_of_every_float32_magnitude():
    """:func:`_squares.scales_of_largest` (a binary search in a table, the device's path)
    against ``math.frexp``: every power of two float32 holds, its neighbours, seeded random
    magnitudes over the whole range, 0, NaN and infinity, in one vector."""
    powers = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float32)
    zero, inf = torch.tensor(0.0), torch.tensor(math.inf)
    generator = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.rand(2000, generator=generator, dtype=torch.float64) * 277 - 149).float()
    values = torch.cat([powers, torch.nextafter(powers, zero), torch.nextafter(powers, inf), spread,
                        torch.tensor([0.0, math.inf, math.nan, torch.finfo(torch.float32).max])])

    def expected(value):
        exponent = min(max(math.frexp(value)[1], -125), 127) if math.isfinite(value) else 0
        return 2.0**-exponent

    got = _squares.scales_of_largest(values)
    assert got.dtype == torch.float32
    assert got.tolist() == [expected(value) for value in values.tolist()]
    assert _squares.scales_of_largest(torch.tensor(3.0)).shape == ()  # a 0-dim largest stays 0-dim


def test_on_other_devices_a_zero_norm_is_marked_only_beside_nonzero_rows_of_every_factor(monkeypatch):
    """``exact_where_lost`` on other devices' paths: a squared norm of 0 whose example has a
    nonzero row in every factor (x_i = sum_l g_il a_il^T is not 0: underflow lost it) is
    marked UNRESOLVED; one whose example has a zero row in some factor (x_i = 0 exactly) is
    kept, as is a norm that is not 0."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    g = torch.tensor([[[1.0, 2.0]], [[0.0, 0.0]], [[1e-30, 0.0]], [[3.0, 0.0]]])
    a = torch.tensor([[[1.0, 1.0]], [[4.0, 0.0]], [[0.0, 1e-30]], [[0.0, 0.0]]])
    norms = torch.tensor([5.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    got = _squares.exact_where_lost(lambda *factors: norms.clone(), "n", 4, 4, g, a)
    assert got.tolist() == [5.0, 0.0, underflow.UNRESOLVED, 0.0]


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("loss_scale", [1.0, 0.25])
def test_norms_checked_together_find_what_each_parameter_s_check_finds(loss_scale, on_host, monkeypatch):
    """PerExampleGradNorm's and GradientNoiseScale's underflow checks of all parameters at
    once (one table per dtype, on the CPU and on other devices) give each parameter's own
    check's count (on the CPU an int, None for none, as each parameter's): rows with
    unresolved norms, with zeros, with a sum above and below N floors, float32 and float64
    norms, sizes whose floors differ."""
    from cockpit_gradnoise.step import Batch

    monkeypatch.setattr(_device, "on_host", lambda tensor: on_host)
    tiny32, tiny64 = torch.finfo(torch.float32).tiny, torch.finfo(torch.float64).tiny
    rows = [([1.0, 2.0, 3.0], torch.float64, 5), ([0.0, 1e-310, 0.0], torch.float64, 5),
            ([1e-310, 1e-300, 0.0], torch.float64, 7), ([0.0, 0.0, 0.0], torch.float64, 3),
            ([tiny32, 0.0, 2.0], torch.float32, 2), ([tiny32 * 3, tiny32, 0.0], torch.float32, 1),
            ([tiny64 * 8, tiny64, 0.0], torch.float64, 1)]
    items = []
    for k, (norms, dtype, numel) in enumerate(rows):
        param = torch.zeros(numel, dtype=dtype)
        param.cgn_batch_l2 = torch.tensor(norms, dtype=dtype)
        items.append((f"p{k}", param, {"squared_norms": param.cgn_batch_l2 / loss_scale**2}))
    batch = Batch(3, loss_scale)
    for quantity in (cgn.PerExampleGradNorm(linear(1)), cgn.GradientNoiseScale(linear(1))):
        together = quantity.unresolved_of_many(items, batch)
        alone = {name: quantity.unresolved(param, sums, batch) for name, param, sums in items}
        if on_host:  # the same answers, None included
            assert [None if together[name] is None else together[name][0] for name, _, _ in items] == [
                None if alone[name] is None else alone[name][0] for name, _, _ in items]
            assert all(type(together[name][0]) is int for name, _, _ in items if together[name] is not None)
        counts = [0 if alone[name] is None else int(alone[name][0]) for name, _, _ in items]
        assert [0 if together[name] is None else int(together[name][0]) for name, _, _ in items] == counts
        assert any(counts)  # the rows hold findings
        assert not all(counts)


def test_unscaled_norms_mark_exactly_the_nonzero_norms_below_the_floor():
    """Float32 squared norms formed at a scale, widened: 0 stays 0, NaN and inf stay, a norm
    at or above the floor of its terms is divided by the scale's square (exactly), and a
    nonzero one below it (underflow may have lost it) becomes UNRESOLVED."""
    terms = 6
    floor = underflow.underflow_floor(terms, torch.float32)
    at_scale = torch.tensor([0.0, floor / 2, 1.4e-45, floor, 3.0, math.nan, math.inf])
    scale = torch.tensor(2.0**-10)
    got = _squares.unscaled_norms(at_scale, scale, terms)
    assert got.dtype == torch.float64
    expected = [0.0, underflow.UNRESOLVED, underflow.UNRESOLVED, float(torch.tensor(floor)) * 2.0**20,
                3.0 * 2.0**20, math.nan, math.inf]
    assert [(a == b) or (math.isnan(a) and math.isnan(b)) for a, b in zip(got.tolist(), expected)] == [True] * 7
