"""minibatch_gradient_stats and dataset_gradient: brute force, state, bad input,
numerics, memory, and agreement with GradientVarianceQuantiles."""

import copy
import importlib.util
import math
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional, references
from cockpit_gradnoise.logs import schema

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tests.cases import MODELS, ModelCase, Problem, masked_token_losses, run_step
from tests.helpers import RTOL, assert_statistics_match

QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)
cross_entropy = nn.CrossEntropyLoss()


# Tiny models: a second thread only contends on a shared machine (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


def make_batches(case, count, size, seed=0):
    """``count`` float64 batches of ``size`` examples of ``case`` and their targets."""
    torch.manual_seed(seed)
    batches = []
    for _ in range(count):
        inputs = case.inputs(size)
        if inputs.is_floating_point():
            inputs = inputs.double()
        batches.append((inputs, case.targets(size)))
    return batches


def make_model(case, seed=0):
    torch.manual_seed(seed)
    return case.make().double()


def assert_gradients_match(got, expected, rtol=RTOL, network_scale=False):
    """Within ``rtol`` of each parameter's largest gradient element, or of the network's
    (``network_scale``: a parameter whose gradient is zero by structure, BERT's
    ``key.bias``, is rounding noise in both, of no scale of its own)."""
    assert set(got) == set(expected)
    largest = max(grad.abs().max().item() for grad in expected.values())
    for name, grad in expected.items():
        assert got[name].dtype == grad.dtype and got[name].shape == grad.shape, name
        scale = largest if network_scale else grad.abs().max().item()
        torch.testing.assert_close(got[name], grad, rtol=rtol, atol=rtol * scale)


class Attention(nn.Module):
    """LayerNorm and MultiheadAttention: layers BackPACK (and so Cockpit) cannot run."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.norm = nn.LayerNorm(4)
        self.attention = nn.MultiheadAttention(4, num_heads=2, batch_first=True)
        self.head = nn.Linear(4 * 3, 3)

    def forward(self, x):
        h = self.norm(self.embed(x))
        h, _ = self.attention(h, h, h)
        return self.head(h.flatten(1))


ATTENTION = ModelCase("attention", Attention, lambda n: torch.randn(n, 3, 2))


# Against brute force ------------------------------------------------------------


# Batches of independent examples: not in training mode (BatchNorm's batch statistics; the
# two computations would draw different dropout masks), nor the masked LM's token mean, whose
# examples weigh by their batch's token count (its batches are one draw per size, too).
# Not the cases whose forward pass draws random numbers (stochastic depth): the package
# and the reference would draw different ones for each batch.
INDEPENDENT = [case for case in MODELS
               if not case.examples_interact and not case.random_forward
               and case.losses is not masked_token_losses]


@pytest.mark.parametrize("case", INDEPENDENT + [ATTENTION], ids=lambda case: case.name)
def test_statistics_match_reference(case):
    model, batches = make_model(case), make_batches(case, 5, 7)
    loss_fn, _ = case.losses("mean")
    expected = references.minibatch_gradient_stats(model, batches, loss_fn, quantiles=QUANTILES)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cgn.minibatch_gradient_stats(model, batches, loss_fn, quantiles=QUANTILES)
    assert_statistics_match(got, expected)
    # The frozen layer is not measured; the unused one is left out, with a warning.
    assert ("unused.weight" in str([w.message for w in caught])) == (case.name == "unused-frozen")
    assert not any("frozen" in name for name in got)


# Llama's RMSNorm and T5's LayerNorm compute in float32 inside a float64 model, so batches
# of other sizes round differently in float32: the case matrix checks them at N = 2 and 8
# (tests/cases.py).
FLOAT64_THROUGHOUT = [case for case in INDEPENDENT if case.name not in ("hf-llama", "hf-t5", "hf-t5-train")]


@pytest.mark.parametrize("case", FLOAT64_THROUGHOUT + [ATTENTION], ids=lambda case: case.name)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dataset_gradient_is_the_gradient_of_all_examples_at_once(case, reduction):
    model = make_model(case)
    # An unequal last batch: weighting batches equally would be wrong here.
    batches = make_batches(case, 3, 16) + make_batches(case, 1, 2, seed=1)
    loss_fn, _ = case.losses(reduction)
    expected = references.dataset_gradient(model, batches, loss_fn, reduction=reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused parameter's warning
        got = cgn.dataset_gradient(model, batches, loss_fn, reduction=reduction)
    assert_gradients_match(got, expected, network_scale=case.known_zeros is not None)


def test_float32_model_float64_accumulation():
    """A float32 model: the dataset gradient comes back in float32, accurate to float32."""
    case = MODELS[0]
    model = make_model(case).float()
    batches = [(x.float(), y) for x, y in make_batches(case, 7, 16)]
    got = cgn.dataset_gradient(model, batches, cross_entropy)
    expected = references.dataset_gradient(model.double(), [(x.double(), y) for x, y in batches],
                                           cross_entropy)
    assert {g.dtype for g in got.values()} == {torch.float32}
    assert_gradients_match({n: g.double() for n, g in got.items()}, expected, rtol=1e-5)


def test_return_sd_and_accumulate_dtype():
    case = MODELS[0]
    model, batches = make_model(case).float(), make_batches(case, 4, 5)
    batches = [(x.float(), y) for x, y in batches]
    stats, sds = cgn.minibatch_gradient_stats(
        model, batches, cross_entropy, return_sd=True, accumulate_dtype=torch.float32
    )
    grads = references.batch_gradients(model, batches, cross_entropy)
    assert set(sds) == set(grads) == set(stats) - {cgn.NETWORK}
    for name, sd in sds.items():
        assert sd.dtype == torch.float32 and sd.shape == dict(model.named_parameters())[name].shape
        expected = torch.from_numpy(grads[name].std(0, ddof=1)).view(sd.shape)
        torch.testing.assert_close(sd.double(), expected, rtol=1e-5, atol=1e-7)


# State and bad input ------------------------------------------------------------


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("function", [cgn.minibatch_gradient_stats, cgn.dataset_gradient])
@pytest.mark.parametrize("fail", [False, True], ids=["completes", "raises"])
def test_parameters_grads_and_buffers_are_restored(function, fail):
    torch.manual_seed(0)
    model = WithBatchNorm().double().train()
    params = list(model.parameters())
    params[0].grad = torch.full_like(params[0], 7.0)  # an earlier gradient, kept
    grad_before = params[0].grad
    before = copy.deepcopy(model.state_dict())
    batches = make_batches(MODELS[0], 4, 8)

    def loss_fn(outputs, targets):
        loss_fn.calls += 1
        if fail and loss_fn.calls == 3:
            raise RuntimeError("user error in batch 3")
        return cross_entropy(outputs, targets)

    loss_fn.calls = 0
    if fail:
        with pytest.raises(RuntimeError, match="batch 3"):
            function(model, batches, loss_fn)
    else:
        function(model, batches, loss_fn)
    assert params[0].grad is grad_before and bool((grad_before == 7.0).all())
    assert all(p.grad is None for p in params[1:])
    after = model.state_dict()  # parameters and buffers (BatchNorm running statistics)
    assert all(torch.equal(before[key], after[key]) for key in before)


def one_batch():
    yield make_batches(MODELS[0], 1, 4)[0]


BAD_INPUTS = {
    "no batches": (dict(batches=[]), "no batches"),
    "one batch": (dict(batches=make_batches(MODELS[0], 1, 4)), "at least 2"),
    "one batch from a generator": (dict(batches=one_batch()), "at least 2"),
    "num_batches=1": (dict(num_batches=1), "num_batches >= 2"),
    "loss per example": (dict(loss_fn=nn.CrossEntropyLoss(reduction="none")), r"scalar.*\(4,\)"),
    "not a pair": (dict(batches=[(x,) for x, _ in make_batches(MODELS[0], 2, 4)]), "pair"),
    "detached loss": (dict(loss_fn=lambda out, y: cross_entropy(out.detach(), y)), "depends on no"),
    "bad quantile": (dict(quantiles=(0.5, 2.0)), r"\[0, 1\]"),
}


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error_naming_the_problem(bad):
    changes, message = BAD_INPUTS[bad]
    arguments = dict(
        model=make_model(MODELS[0]), batches=make_batches(MODELS[0], 3, 4), loss_fn=cross_entropy
    )
    arguments.update(changes)
    with pytest.raises(ValueError, match=message):
        cgn.minibatch_gradient_stats(**arguments)


def test_batches_of_different_sizes_warn():
    model = make_model(MODELS[0])
    batches = make_batches(MODELS[0], 3, 8) + make_batches(MODELS[0], 1, 3)
    with pytest.warns(UserWarning, match=r"different sizes \[3, 8\].*drop_last=True"):
        cgn.minibatch_gradient_stats(model, batches, cross_entropy)


def test_progress_bar(capsys):
    model, batches = make_model(MODELS[0]), make_batches(MODELS[0], 3, 4)
    cgn.minibatch_gradient_stats(model, batches, cross_entropy)
    assert capsys.readouterr().err == ""  # off by default
    cgn.minibatch_gradient_stats(model, batches, cross_entropy, progress=True)
    assert "minibatch_gradient_stats" in capsys.readouterr().err
    cgn.dataset_gradient(model, iter(batches), cross_entropy, progress=True, num_batches=2)
    assert "2/2" in capsys.readouterr().err


def test_bad_input_dataset_gradient():
    model, batches = make_model(MODELS[0]), make_batches(MODELS[0], 2, 4)
    with pytest.raises(ValueError, match="no batches"):
        cgn.dataset_gradient(model, [], cross_entropy)
    with pytest.raises(ValueError, match="reduction"):
        cgn.dataset_gradient(model, batches, cross_entropy, reduction="average")
    with pytest.raises(ValueError, match=r"len\(targets\)"):
        cgn.dataset_gradient(model, [(x, None) for x, _ in batches], lambda out, y: out.sum())
    with pytest.raises(ValueError, match="requires_grad"):
        cgn.dataset_gradient(model.requires_grad_(False), batches, cross_entropy)


# Missing and non-finite gradients -----------------------------------------------


class Branches(nn.Module):
    """``sometimes`` is used only by batches whose first input is positive."""

    def __init__(self):
        super().__init__()
        self.always = nn.Linear(6, 3)
        self.sometimes = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)

    def forward(self, x):
        out = self.always(x)
        return out + self.sometimes(x) if x[0, 0] > 0 else out


def test_missing_gradient_counts_as_zero_and_never_used_is_left_out():
    torch.manual_seed(0)
    model = Branches().double()
    batches = make_batches(MODELS[0], 12, 5)
    used = [bool(x[0, 0] > 0) for x, _ in batches]
    assert any(used) and not all(used) and not used[0]  # first appears late, too
    expected = references.minibatch_gradient_stats(
        model, batches, cross_entropy, quantiles=QUANTILES
    )
    with pytest.warns(UserWarning, match=r"never\.weight.*no gradient"):
        got = cgn.minibatch_gradient_stats(model, batches, cross_entropy, quantiles=QUANTILES)
    assert_statistics_match(got, expected)
    assert "sometimes.weight" in got and "never.weight" not in got

    grads = references.batch_gradients(model, batches, cross_entropy)
    sizes = torch.tensor([len(y) for _, y in batches], dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"never\.weight"):
        got = cgn.dataset_gradient(model, batches, cross_entropy)
    for name, rows in grads.items():
        expected = (sizes @ torch.from_numpy(rows) / sizes.sum()).view(got[name].shape)
        torch.testing.assert_close(got[name], expected, rtol=RTOL, atol=1e-15)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 2)
        self.second = nn.Linear(3, 2)

    def forward(self, x):
        return torch.cat([self.first(x[:, :3]), self.second(x[:, 3:])], dim=1)


def test_non_finite_gradient_gives_nan_statistics_and_a_warning():
    """A NaN input of one head in one batch: that head's rows and "all" are NaN."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    batches = [(torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64))
               for _ in range(5)]
    batches[2][0][1, 4] = math.nan
    mse = nn.MSELoss()
    with pytest.warns(UserWarning, match=r"\['second.weight', 'second.bias'\].*NaN"):
        got = cgn.minibatch_gradient_stats(model, batches, mse, quantiles=QUANTILES)
    expected = references.minibatch_gradient_stats(model, batches, mse, quantiles=QUANTILES)
    for name in ("first.weight", "first.bias"):
        assert got[name] == pytest.approx(expected[name], rel=RTOL, abs=0)
    for name in ("second.weight", "second.bias", cgn.NETWORK):
        assert set(got[name]) == set(schema.sd_statistic_names(QUANTILES))
        assert all(math.isnan(value) for value in got[name].values())
    with pytest.warns(UserWarning, match=r"\['second.weight', 'second.bias'\].*NaN"):
        gradient = cgn.dataset_gradient(model, batches, mse)
    assert gradient["first.weight"].isfinite().all() and gradient["second.weight"].isnan().all()


# Numerics -----------------------------------------------------------------------


def near_equal_float32(count, size, spread, seed=0):
    """``count`` float32 vectors ``c (1 + spread z)``, ``c`` in [1, 2): a few ulps apart."""
    generator = torch.Generator().manual_seed(seed)
    center = 1 + torch.rand(size, generator=generator, dtype=torch.float64)
    noise = torch.randn(count, size, generator=generator, dtype=torch.float64)
    return (center * (1 + spread * noise)).float()


def two_pass_sd(samples):
    x = samples.double()
    return ((x - x.mean(0)).square().sum(0) / (len(x) - 1)).sqrt()


def relative_error(got, expected):
    return ((got - expected).abs() / expected).max().item()


def test_welford_is_accurate_where_the_naive_formula_fails():
    """10,000 near-equal float32 gradients (relative spread 1e-6, about 8 ulps).

    The two-pass float64 result is checked against exact rational arithmetic
    (``statistics.stdev``) on a few elements. Welford in float64 must be within
    1e-6 of it; the naive ``(sum x^2 - (sum x)^2 / n) / (n - 1)``, even summed
    in float64, and Welford in float32 (``accumulate_dtype=torch.float32``) must
    miss by more, or this case would not tell them apart.
    """
    samples = near_equal_float32(10_000, 32, spread=1e-6)
    expected = two_pass_sd(samples)
    for column in range(3):
        exact = statistics.stdev(samples[:, column].double().tolist())
        assert expected[column].item() == pytest.approx(exact, rel=1e-12)

    def welford(dtype):
        mean, m2, delta = (torch.zeros(32, dtype=dtype) for _ in range(3))
        for count, sample in enumerate(samples, start=1):
            functional.welford_update_(mean, m2, sample, count, delta)
        return functional.welford_sd(m2, len(samples)).double()

    total, total_of_squares = (torch.zeros(32, dtype=torch.float64) for _ in range(2))
    for sample in samples.double():
        total += sample
        total_of_squares += sample.square()
    n = len(samples)
    naive = ((total_of_squares - total.square() / n) / (n - 1)).clamp(min=0).sqrt()

    assert relative_error(welford(torch.float64), expected) <= 1e-6
    assert relative_error(naive, expected) > 1e-6
    assert relative_error(welford(torch.float32), expected) > 1e-6


def test_end_to_end_near_equal_gradients_float32_model():
    """A float32 model, 2,000 batches whose gradients differ by about 1e-5 relative.

    The gradients the function consumed are recorded by tensor hooks and their
    standard deviation taken two-pass in float64.
    """
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    recorded = {name: [] for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: recorded[name].append(grad.clone()))
    base = torch.randn(8, 4)
    targets = torch.randn(8, 2)
    batches = [(base * (1 + 1e-5 * torch.randn(8, 4)), targets) for _ in range(2000)]
    _, sds = cgn.minibatch_gradient_stats(model, batches, nn.MSELoss(), return_sd=True)
    for name, sd in sds.items():
        grads = torch.stack(recorded[name])
        assert len(grads) == 2000
        assert (two_pass_sd(grads) / grads.double().mean(0).abs()).max() < 1e-4  # near-equal
        assert relative_error(sd, two_pass_sd(grads)) <= 1e-6


# Memory -------------------------------------------------------------------------


def peak_allocated_bytes(function):
    """Peak of the bytes torch's CPU allocator holds while ``function`` runs, above the start.

    The profiler records every allocation and free through torch's allocator
    with its size; their running sum in time order is the memory in use above
    the start. Unlike the process's resident memory, this does not depend on
    whether glibc returns freed memory to the system.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    in_use = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        in_use += event.nbytes()
        peak = max(peak, in_use)
    return peak


def test_peak_memory_does_not_grow_with_the_number_of_batches():
    """The peak after 48 batches equals the peak after 4, and is O(parameters).

    Anything kept per batch (a gradient, the outputs and with them the graph)
    would raise the peak of the longer run. A loss function that keeps each
    batch's 640-byte output shows the measurement sees such growth: its peak
    rises by 44 outputs.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))
    parameter_bytes = 8 * sum(p.numel() for p in model.parameters())  # float64 copy

    def batches(count):
        generator = torch.Generator().manual_seed(1)
        for _ in range(count):
            inputs = torch.randn(16, 64, generator=generator)
            yield inputs, torch.randint(0, 10, (16,), generator=generator)

    def peak(count, loss_fn=cross_entropy):
        return peak_allocated_bytes(
            lambda: cgn.minibatch_gradient_stats(model, batches(count), loss_fn)
        )

    def forward_backward():
        for inputs, targets in batches(4):
            cross_entropy(model(inputs), targets).backward()
        model.zero_grad(set_to_none=True)

    peak_4, peak_48 = peak(4), peak(48)
    assert peak_48 == peak_4
    # Accumulators, gathered gradient and the statistics' sort: a few copies.
    assert peak_4 <= 6 * parameter_bytes + peak_allocated_bytes(forward_backward)

    kept = []

    def keeping_loss(outputs, targets):
        kept.append(outputs)
        return cross_entropy(outputs, targets)

    leak_4 = peak(4, keeping_loss)
    kept.clear()
    assert peak(48, keeping_loss) - leak_4 >= 44 * 16 * 10 * 4


# Agreement with GradientVarianceQuantiles ---------------------------------------


def test_agrees_with_gradient_variance_quantiles():
    """Across 400 batches of size 32 vs one batch at a time, averaged over the same batches.

    Both estimate the standard deviation sigma_j of the mini-batch gradient
    element j. The across-batch estimate s_j from N = 400 batches has a
    relative standard error of about 1/sqrt(2 (N - 1)) = 3.5% (near-normal
    batch gradients); the mean or median over a layer's elements of s_j has at
    most that relative standard error, whatever the correlation between
    elements. The single-batch side is an average over the N batches; its
    standard error is estimated from the N values. A single-batch sd of a
    normal variable is biased low by the factor c4(B); it is divided out. The
    test allows 3 standard errors of each side. Mixing up the standard deviation
    of a mini-batch gradient with that of a per-example gradient (a factor
    sqrt(B) = 5.7) or the variance with the standard deviation would fail it.
    """
    n_batches, size = 400, 32
    torch.manual_seed(0)
    data = torch.randn(2048, 6, dtype=torch.float64)
    labels = (data[:, :3].sum(1) > 0).long() + (data[:, 3] > 1).long()
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    generator = torch.Generator().manual_seed(1)
    # Examples drawn with replacement: batches are independent, as both estimates assume.
    indices = torch.randint(0, len(data), (n_batches, size), generator=generator)
    batches = [(data[i], labels[i]) for i in indices]

    levels = (0.5,)
    across = cgn.minibatch_gradient_stats(model, batches, cross_entropy, quantiles=levels)

    extended = extend(copy.deepcopy(model))
    names = [name for name, _ in extended.named_parameters()]
    quantity = cgn.GradientVarianceQuantiles(linear(1), quantiles=levels, param_names=names)
    cockpit = cgn.Cockpit(list(extended.parameters()), quantities=[quantity])
    loss_fn = extend(nn.CrossEntropyLoss())
    per_example = nn.CrossEntropyLoss(reduction="none")
    for step, (inputs, targets) in enumerate(batches):
        problem = Problem(extended, loss_fn, per_example, inputs, targets, "mean")
        run_step(problem, None, step=step, cockpit=cockpit)
    output = cockpit.get_output()
    single = [output[step]["GradientVarianceQuantiles"] for step in range(n_batches)]

    c4 = math.sqrt(2 / (size - 1)) * math.exp(math.lgamma(size / 2) - math.lgamma((size - 1) / 2))
    across_error = 1 / math.sqrt(2 * (n_batches - 1))
    for name in names + [cgn.NETWORK]:
        for statistic in ("mean", "q0.5"):
            values = [step[name][statistic] for step in single]
            average = statistics.fmean(values)
            single_error = statistics.stdev(values) / average / math.sqrt(n_batches)
            single_mean = average / c4
            ratio = across[name][statistic] / single_mean
            tolerance = 3 * math.hypot(across_error, single_error)
            assert abs(ratio - 1) <= tolerance, (name, statistic, ratio, tolerance)


def test_benchmark_script_runs(capsys):
    """Smoke test of benchmarks/benchmark_minibatch.py (never a timed assertion)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_minibatch.py"
    spec = importlib.util.spec_from_file_location("benchmark_minibatch", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.main(["--quick", "--models", "mlp", "--threads", "1"])
    assert [row["method"] for row in table] == ["plain step", *module.FUNCTIONS]
    assert all(row["ratio"] > 0 and row["peak_extra_mib"] > 0 for row in table)
    assert "QUICK MODE" in capsys.readouterr().out


def test_minibatch_and_references_import_neither_cockpit_nor_backpack():
    """They use plain autograd; the names they share with the quantities come from schema."""
    code = (
        "import sys, cockpit_gradnoise.minibatch, cockpit_gradnoise.references;"
        "print(sorted(m for m in ('cockpit', 'backpack', 'pandas') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
