"""The rounding bound of the gradient's standard deviation, on long inner sums.

Each example's contribution ``x_ij`` to a convolution's or a sequence
Linear's gradient is itself a sum over ``L`` output positions or steps. Two
identical examples can then come out with a centred sum of squares of pure
rounding noise above the bound that counts only the sums over examples
(``3N + 4`` eps S): an sd of ~3e-11 instead of 0 and an SNR of ~3e7 (seen
in float64, Conv1d then a Linear along the sequence, batch 7, mean loss).
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional, references

import pytest
import torch
from backpack import backpack
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions import BatchGrad
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import ModelCase, build, run_step

DTYPES = [torch.float32, torch.float64]
BATCHES = [(7, "mean"), (33, "sum")]


def sequential_sums(terms, n):
    """``S`` and ``T`` of ``n`` identical examples whose contributions are sums of ``terms``.

    ``terms`` is ``[L, M]``: ``L`` terms for each of ``M`` elements. Each
    contribution is summed over ``l`` first (as a per-example computation
    does), ``T`` over the examples first and then over ``l`` (another order,
    as autograd may take): the two round differently.
    """
    contribution = torch.zeros_like(terms[0])
    for term in terms:
        contribution = contribution + term
    sum_of_squares, total = torch.zeros_like(contribution), torch.zeros_like(contribution)
    for _ in range(n):
        sum_of_squares = sum_of_squares + contribution * contribution
    for term in terms:
        over_examples = torch.zeros_like(term)
        for _ in range(n):
            over_examples = over_examples + term
        total = total + over_examples
    return sum_of_squares, total


def equal_terms(length, dtype, seed):
    """``[length, 2000]``: per element one value spanning 7 decades, repeated.

    Repeated additions of one value round the same way each time, so the
    rounding of a long sum grows like its length (the worst case).
    """
    generator = torch.Generator().manual_seed(seed)
    value = torch.randn(2000, generator=generator, dtype=torch.float64).exp()
    value = value * 10.0 ** torch.randint(-3, 4, (2000,), generator=generator)
    return value.to(dtype).expand(length, 2000)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, length", [(7, 256), (33, 1024)])
def test_bound_with_inner_terms_zeroes_rounding_of_long_sums(n, length, dtype):
    sum_of_squares, total = sequential_sums(equal_terms(length, dtype, n), n)
    without = functional.gradient_sd(sum_of_squares, total, n)
    assert (without > 0).any(), "the case must show rounding above the bound without L"
    sd = functional.gradient_sd(sum_of_squares, total, n, inner_terms=length)
    assert torch.equal(sd, torch.zeros_like(sd))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, length", [(7, 256), (33, 1024)])
def test_bound_with_inner_terms_keeps_spread_well_above_rounding(n, length, dtype):
    """Examples that differ by a relative spread ``r`` with ``r**2`` 100 times
    the bound's ``(3N + 4L) eps``: the centred sum is then within 1/100 of
    exact, so sd within about 1/200 (``rtol=1e-2``), and never 0."""
    eps = torch.finfo(dtype).eps
    spread = 10 * ((3 * n + 4 * length) * eps) ** 0.5
    generator = torch.Generator().manual_seed(0)
    scales = 1 + spread * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    terms = equal_terms(length, torch.float64, n)
    # Each example's contribution summed sequentially in dtype; S and T over examples.
    contributions = torch.stack(
        [sequential_sums((terms * scale).to(dtype), 1)[1] for scale in scales]
    )
    sum_of_squares = contributions.pow(2).sum(0)
    total = contributions.sum(0)
    sd = functional.gradient_sd(sum_of_squares, total, n, inner_terms=length)
    exact = contributions.double().std(0) * n**0.5  # sd of the sum over examples
    assert (sd > 0).all()
    torch.testing.assert_close(sd.double(), exact, rtol=1e-2, atol=0)


# Models whose contributions sum over many positions ---------------------------------


class ConvThenSequenceLinear(nn.Module):
    """Conv1d, then one Linear applied at every step of the sequence it outputs."""

    def __init__(self, length):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.step = nn.Linear(3, 4)
        self.out = nn.Linear(4 * (length - 2), 3)

    def forward(self, x):
        steps = self.conv(x).transpose(1, 2)  # [N, length - 2, 3]
        return self.out(torch.tanh(self.step(steps)).flatten(1))


def conv2d_many_positions():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 16 * 16, 3)
    )


def conv2d_few_positions():
    """2x2 output positions: the cost model would expand the square for ``S``
    alone (``cost_model.formation_is_cheaper``), whose terms cancel here."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(256, 3)
    )


def conv2d_one_position():
    """One output position: each contribution is one product, the sums two matrix products."""
    return nn.Sequential(nn.Conv2d(3, 64, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))


# (name, model, input shape): 64 steps, 256, 4 and 1 output positions.
MODELS = [
    ("conv1d-sequence-linear", lambda: ConvThenSequenceLinear(66), (2, 66)),
    ("conv2d-many-positions", conv2d_many_positions, (2, 16, 16)),
    ("conv2d-few-positions", conv2d_few_positions, (3, 4, 4)),
    ("conv2d-one-position", conv2d_one_position, (3, 3, 3)),
]


def problem(make, shape, n, reduction, dtype, seed, spread=0.0):
    """``n`` copies of one example (plus ``spread`` times noise in the inputs)."""
    model_case = ModelCase("rounding", make, lambda n: torch.zeros(n, *shape))
    case = build(model_case, n, reduction, dtype, seed)
    inputs = torch.randn(1, *shape, dtype=dtype).repeat(n, *[1] * len(shape))
    case.inputs = inputs + spread * torch.randn_like(inputs)
    case.targets = case.targets[:1].repeat(n)
    return case


def per_example_sums(case):
    """``{name: (sum_i x_i**2, sum_i x_i, param.grad)}``, the sums from BackPACK's
    per-example contributions, in a backward pass set up as Cockpit sets it up."""
    loss = case.loss_fn(case.model(case.inputs), case.targets)
    with backpack(BatchGrad()), weight_jac_t_save_memory(save_memory=True):
        loss.backward()
    return {
        name: (p.grad_batch.pow(2).sum(0), p.grad_batch.sum(0), p.grad)
        for name, p in case.model.named_parameters()
    }


# Where the contributions are sums over several positions (param.grad rounds otherwise).
SEVERAL_POSITIONS = MODELS[:3]


@pytest.mark.parametrize(
    "name, make, shape", SEVERAL_POSITIONS, ids=[m[0] for m in SEVERAL_POSITIONS]
)
def test_identical_examples_give_sd_exactly_zero_from_one_computation(name, make, shape):
    """Summing ``T`` from the same per-example values as ``S`` leaves only the
    sums over examples to round: sd exactly 0, in every case, with ``L = 1``.
    With ``T`` from ``param.grad`` (another reduction) and ``L = 1``, rounding
    noise passes the bound: the case shows what it guards against."""
    noisy = []
    for dtype in DTYPES:
        for n, reduction in BATCHES:
            for seed in range(3):
                case = problem(make, shape, n, reduction, dtype, seed)
                for param, (squares, total, grad) in per_example_sums(case).items():
                    sd = functional.gradient_sd(squares, total, n)
                    assert torch.equal(sd, torch.zeros_like(sd)), (param, dtype, n, seed)
                    if functional.gradient_sd(squares, grad, n).any():
                        noisy.append((param, dtype, n, seed))
    assert noisy, "param.grad as the total must show rounding noise in some case"


def float64_tolerance(make, shape, n, reduction, spread, length):
    """``{param: rel}`` for the float64 sd's quantiles (``"all"`` too), derived.

    ``sd_j**2`` is formed from ``C_j = S_j - T_j**2 / N``, within ``(3N + 4L) eps S_j``
    of exact (:func:`~cockpit_gradnoise.functional.variance_rounding_bound`, pinned in
    ``test_rounding_bounds.py``; ``eps = 2 u = 2**-52``, ``L`` positions per contribution),
    so ``sd_j`` within half of ``(3N + 4L) eps S_j / C_j`` relative; the other half
    covers the reference's own rounding (its per-example gradients, centred before
    squaring: about ``L eps sqrt(S_j / C_j)``) and that of ``S_j / C_j``, measured here
    from BackPACK's per-example gradients. Every element within ``rel`` at the layer's
    worst ``S_j / C_j``: so is every quantile of them."""
    case = problem(make, shape, n, reduction, torch.float64, 0, spread)
    ratios = {}
    for name, (squares, total, _) in per_example_sums(case).items():
        centred = squares - total**2 / n
        assert (centred > 0).all(), name
        ratios[name] = float((squares / centred).max())
    ratios["all"] = max(ratios.values())
    eps = torch.finfo(torch.float64).eps
    return {name: (3 * n + 4 * length) * eps * ratio for name, ratio in ratios.items()}


def test_small_real_spread_is_kept_through_cockpit():
    """Examples that differ a little: the smallest sd are ~1e-5 (float64) and
    ~1e-2 (float32) of the contributions, their squares far above the bound.
    Every quantile of sd is positive and matches the per-example loop: in
    float64 within :func:`float64_tolerance` (at the layers' worst elements the
    centred sum of such a spread cancels all but 4e-13 to 7e-11 of the sum of
    squares: 1e-3 to 0.2; measured 6e-4 at worst), in float32 within 1e-2
    (measured to 3e-3 at worst: the centred sum cancels all but ~1e-4)."""
    for dtype, spread in [(torch.float64, 1e-5), (torch.float32, 1e-1)]:
        for n, reduction in BATCHES:
            case = problem(MODELS[0][1], MODELS[0][2], n, reduction, dtype, 0, spread)
            if dtype == torch.float64:  # 64 steps of the sequence Linear, 64 positions of the Conv1d
                tolerance = float64_tolerance(MODELS[0][1], MODELS[0][2], n, reduction, spread, 64)
            quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=case.names)
            got = run_step(case, [quantity]).get_output()[0]["GradientVarianceQuantiles"]
            reference = references.gradient_variance_quantiles(
                case.model.double(), case.per_example_loss, case.inputs.double(),
                case.targets, reduction=reduction,
            )
            for param, statistics in reference.items():
                for statistic in ("q0.05", "q0.5", "q0.95"):
                    assert got[param][statistic] > 0, (param, statistic, dtype)
                    rel = tolerance[param] if dtype == torch.float64 else 1e-2
                    assert got[param][statistic] == pytest.approx(
                        statistics[statistic], rel=rel, abs=0
                    ), (param, statistic, dtype, n)


@pytest.mark.parametrize("name, make, shape", MODELS, ids=[m[0] for m in MODELS])
def test_identical_examples_give_sd_exactly_zero_through_cockpit(name, make, shape):
    """The defect as users saw it: nonzero sd, SNR ~3e7, for identical examples
    (``T`` from ``param.grad``; and, with few positions, ``S`` by expansion).
    Now sd is 0 and the SNR the largest the formula resolves
    (:func:`~cockpit_gradnoise.functional.resolvable_snr`)."""
    failures = []
    for dtype in DTYPES:
        for n, reduction in BATCHES:
            for seed in range(3):
                case = problem(make, shape, n, reduction, dtype, seed)
                quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=case.names)
                output = run_step(case, [quantity]).get_output()[0]
                # Examples that agree count at the largest resolvable SNR (not 3e7).
                limit = torch.tensor(functional.resolvable_snr(n, dtype), dtype=dtype).item()
                for param, statistics in output["GradientVarianceQuantiles"].items():
                    sds = [v for s, v in statistics.items() if not s.startswith("snr_")]
                    snrs = [v for s, v in statistics.items() if s.startswith("snr_")]
                    # The mean adds the copies of the limit in float64: 1e-10 relative.
                    at_limit = [v == pytest.approx(limit, rel=1e-10, abs=0) for v in snrs]
                    if any(v != 0 for v in sds) or not all(at_limit):
                        failures.append((param, dtype, n, seed, statistics.get("snr_mean")))
    assert not failures, failures
