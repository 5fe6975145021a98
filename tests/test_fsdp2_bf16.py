"""FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: the bfloat16 pass's own statistics.

2 and 3 processes (gloo on loopback, ``init_device_mesh("cpu", (W,))``, one launch per
world size for every job: ``process_groups.run_group``), test_fsdp2's model in float32
(a layer of width 7: uneven shards; a frozen and an unused layer), sharded with a policy
that casts the parameters to bfloat16 and reduces FSDP2's gradient in float32 (or in
bfloat16). Jobs: ``mean`` (``cgn.track`` after ``fully_shard`` on every Linear and the
root, the five quantities of the default preset), ``sum`` (a Cockpit over the sharded
parameters, the root only, ``reshard_after_forward=False``), ``reduce_bf16``
(``reduce_dtype=torch.bfloat16``), ``adam`` (PreconditionedNoiseScale with Adam),
``accumulation`` (two micro-batches per step, ``reshard_after_forward=False``),
``norms`` / ``norms_reduce_bf16`` (``cgn.track(quantities="norms")``) and ``float16`` (a
float16 policy, refused); unequal local batches (``1/N_r`` not a power of two), two steps.

What "exact" means here (docs/training-setups.md, "autocast, and bfloat16 or float16
models", and docs/distributed.md, "FSDP2 with a MixedPrecisionPolicy"): each statistic of
the per-example gradients that *this* sharded bfloat16 computation gives, each process
rounding after its own loss scale (``1/N_r`` for a mean loss). The reference is built on
each process, in the worker, to reproduce that process's rounding: an un-extended copy of
the model holding FSDP2's unsharded parameters (the float32 parameters gathered and cast
to bfloat16, as FSDP2 casts each shard before its all-gather), run on the process's batch
(cast to bfloat16, as FSDP2 casts the root's inputs), each example's loss backpropagated
alone with the process's scale (``losses[i] / N_r``, ``losses[i]`` for a sum; divided by
``K`` for ``K`` micro-batches), widened to float64. The test checks that this copy computes
what the FSDP2 process computed: every Linear's input and output gradient equal bit for
bit, and each example's output gradient row in its own backward pass equal bit for bit
to its row in the batch's. The global statistics of those per-example gradients are
formed in float64 and compared within the bound derived from bfloat16's unit roundoff
``u = 2**-8`` (tests/test_mixed_precision.py's ``delta_i``, per element, carried through
each formula by the triangle inequality; written where it is checked); and, tighter,
against the copy's bfloat16 factors multiplied out in float64, within float32's rounding
alone (``u = 0``), which the float32 model's per-example gradients are far outside.
ParamGradRatio and UpdateSize read FSDP2's float32 gradient and parameters, not
per-example gradients: equal, with the DDP tests' tolerance, to one process holding
FSDP2's gathered gradient and parameters; and FSDP2's gradient is the mean over processes
of their bfloat16 gradients, within the reduction's rounding in ``reduce_dtype``.
TwoBatchNoiseScale is a float64 function of the gradients the pass computed (each
process's bfloat16 gradient, FSDP2's reduced one): equal to it to float64 rounding.
"""

import math
import warnings

import cockpit_gradnoise as cgn  # first: makes `import cockpit` work
from cockpit_gradnoise import functional
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities.gradient_noise_scale import DEFAULT_SMOOTHING

import pytest
import torch

from tests import test_two_batch
from tests.fsdp2_bf16_jobs import ADAM, JOBS, MICRO_BATCHES, NORMS_JOBS, QUANTILES, SIZES, STEPS, from_grad, worker
from tests.helpers import gamma
from tests.process_groups import agreed_table, assert_identical, assert_tables_match, results_of, run_once_per_world
from tests.test_fsdp2 import Net, table, trainable

U = 2.0**-8  # bfloat16's unit roundoff


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_bf16_", worker)


# The bounds --------------------------------------------------------------------------


def global_examples(results, step, source="autograd", unit=U):
    """Per parameter: the global batch's per-example gradients ``g_i`` (units of example
    ``i``'s own loss) from ``source`` (:func:`tests.fsdp2_bf16_jobs.low_precision_reference`) and the bound
    ``d_i = ||delta_i||`` on ``||g_i^package - g_i||`` (:func:`element_bounds`)."""
    return {name: (g, d.flatten(1).norm(dim=1)) for name, (g, d) in element_bounds(results, step, source, unit).items()}


def element_bounds(results, step, source="autograd", unit=U):
    """Per parameter: ``g_ij`` of the global batch (units of example ``i``'s own loss) and the
    bound ``delta_ij`` on ``|g_ij^package - g_ij|``.

    tests/test_mixed_precision.py's ``delta_i``, per element (each element of a Linear's
    contribution is ``L = 1`` product of its factors, exact in float32):
    ``u (1 + u) |x_ij| + (gamma_1(u) + 2 gamma_K(2**-24)) A_ij`` with ``A_ij`` the product's
    magnitude, in the units of the process's loss, divided by its scale ``c_r`` (``1/N_r`` or
    1) as the package divides (in float64, or float32 for the sums: in the gamma counts of
    the tests). Against the factors multiplied out in float64 (``"products"``) only
    float32's sums round: ``unit = 0``.
    """
    out = {}
    for name in results[0]["steps"][step]["parts"][0][source]:
        g, d = [], []
        for part in (part for result in results for part in result["steps"][step]["parts"]):
            x, scale, magnitude = part[source][name], part["scale"], part["elements"][name]
            delta = unit * (1 + unit) * x.abs() + (gamma(1, unit) + 2 * gamma(part["terms"][name])) * magnitude
            g.append(x / scale)
            d.append(delta / scale)
        out[name] = (torch.cat(g), torch.cat(d))
    return out


def norm_bounds(g, d):
    """``|n_i - ||g_i|||`` per example: ``d_i + gamma_{P+2} (||g_i|| + d_i)`` (the squared norm's
    float32 sum of ``P`` terms, the division by ``c_r**2``, the square root)."""
    norms = g.flatten(1).norm(dim=1)
    return norms, d + gamma(g[0].numel() + 2) * (norms + d)


def sum_bound(g, d, world):
    """``||T - T_ref||`` of ``T = sum_i g_i``: ``sum_i d_i + gamma_{N+W} sum_i (||g_i|| + d_i)``
    (each process's float32 sum of its ``N_r`` contributions, the division by ``c_r``, the
    float32 all-reduce over ``W`` processes: at most ``N + W`` roundings deep)."""
    norms = g.flatten(1).norm(dim=1)
    return d.sum() + gamma(len(g) + world) * (norms + d).sum()


def sd_bound(g, d, world):
    """``||sd - sd_ref||_2`` over a layer's elements, in units of ``g`` (tests/test_mixed_precision.py's
    ``sd_bound``): the centring is a projection, so ``sqrt(N/(N-1)) ||dG||_F`` for the
    contributions, plus ``sqrt(N/(N-1) sum_j b_j)`` for forming ``S - T^2/N`` from float32 sums
    ``N + W`` roundings deep (:func:`~cockpit_gradnoise.functional.variance_rounding_bound`,
    which also bounds what the package sets to 0)."""
    n = len(g)
    norms = g.flatten(1).norm(dim=1)
    squares = ((norms + d) ** 2).sum().reshape(1)
    rounding = functional.variance_rounding_bound(squares, n + world, dtype=torch.float32).sum()
    return (n / (n - 1)) ** 0.5 * (d.square().sum().sqrt() + rounding.sqrt())


def ratio_bound(a, ea, b, eb):
    """``|a'/b' - a/b|`` for ``|a' - a| <= ea``, ``|b' - b| <= eb < |b|``; ``inf`` otherwise."""
    if abs(b) <= eb:
        return math.inf
    return (ea * abs(b) + eb * abs(a)) / (abs(b) * (abs(b) - eb))


def q_name(level):
    return schema.norm_statistic_names((level,))[0]


def quantile(values, level):
    return torch.quantile(values, level).item()


def check(got, expected, bound, key):
    assert abs(got - expected) <= bound, (key, got, expected, bound)


# Tests ---------------------------------------------------------------------------------


MATRIX = [(world, job) for world in (2, 3) for job in JOBS]
SGD_MATRIX = [(world, job) for world, job in MATRIX if JOBS[job][4] == "SGD"]


@pytest.mark.parametrize("world,job", MATRIX)
def test_the_reference_computes_what_each_process_computed(groups, world, job):
    """The copy's factors are FSDP2's bit for bit, and one example's backward pass gives its
    rows of the batch's (other rows 0): the reference is the same computation."""
    for result in results_of(groups, world, job):
        for step in result["steps"]:
            assert all(part["factors_agree"] and part["rows_agree"] for part in step["parts"])


@pytest.mark.parametrize("world,job", SGD_MATRIX)
def test_per_example_quantities_within_the_bfloat16_bound(groups, world, job):
    """PerExampleGradNorm, GradientNoiseScale and GradientVarianceQuantiles, every statistic
    and the network's rows, against the float64 statistics of the bfloat16 pass's own
    per-example gradients (by autograd), within bounds derived from ``u`` (each below)."""
    results = results_of(groups, world, job)
    assert_identical([result["table"] for result in results])
    checked = check_per_example(results, world, job, "autograd", U)
    # b_simple and the SNR where their bounds are finite: most rows here.
    assert checked["b_simple"] >= STEPS * 4 and checked["snr"] >= STEPS * 2, checked


@pytest.mark.parametrize("world,job", SGD_MATRIX)
def test_per_example_quantities_within_float32_rounding_of_the_bfloat16_factors(groups, world, job):
    """Tighter: against each process's bfloat16 factors (a Linear's input and output
    gradient, FSDP2's bit for bit) multiplied out in float64, only float32's sums round
    (``u = 0`` in the bounds): no sum of the package is formed in bfloat16."""
    check_per_example(results_of(groups, world, job), world, job, "products", 0.0)


@pytest.mark.parametrize("world", [2, 3])
def test_the_float32_models_statistics_are_outside_that_bound(groups, world):
    """The tighter test can fail: the per-example gradients of the float32 model (FSDP2
    without the policy, on the same parameters and batches) are not within float32
    rounding of what the bfloat16 pass reports."""
    with pytest.raises(AssertionError):
        check_per_example(results_of(groups, world, "mean"), world, "mean", "float32", 0.0)


def check_per_example(results, world, job, source, unit):
    """Every statistic of the three per-example quantities at every step within its bound
    (:func:`global_examples` ``(source, unit)``); how many b_simple and SNR rows were checked."""
    got = results[0]["table"]
    reduction = JOBS[job][2]
    n = sum(SIZES[world]) * MICRO_BATCHES.get(job, 1)  # every micro-batch of every process
    scale = 1.0 / n if reduction == "mean" else 1.0  # x_i = c g_i of the global loss
    checked, averages = {"b_simple": 0, "snr": 0}, {}
    for step in range(STEPS):
        all_norms, all_norm_bounds = 0.0, 0.0
        gns_all = [0.0, 0.0, 0.0, 0.0]  # S, M and their bounds
        sds, sd_bounds, snrs = [], [], []
        for name, (g, d) in global_examples(results, step, source, unit).items():
            row = lambda quantity, statistic: got[(step, quantity, name, statistic)]  # noqa: E731
            # PerExampleGradNorm: quantiles, mean and max of ||g_i||, each 1-Lipschitz in the
            # largest |n_i - ||g_i|||.
            norms, b = norm_bounds(g, d)
            for level in QUANTILES:
                check(row("PerExampleGradNorm", q_name(level)), quantile(norms, level), b.max().item(), name)
            check(row("PerExampleGradNorm", "mean"), norms.mean().item(), b.mean().item(), name)
            check(row("PerExampleGradNorm", "max"), norms.max().item(), b.max().item(), name)
            all_norms = all_norms + norms.square()
            all_norm_bounds = all_norm_bounds + b.square()
            # GradientNoiseScale: S = mean_i ||g_i||^2 (off by mean_i b_i (2 ||g_i|| + b_i)),
            # M = ||T / N||^2 (off by e (2 ||T|| + e) / N^2, e the bound on ||T - T_ref||).
            total = g.sum(0)
            e = sum_bound(g, d, world)
            s_ref, s_err = norms.square().mean(), (b * (2 * norms + b)).mean()
            m_ref, m_err = total.norm().square() / n**2, e * (2 * total.norm() + e) / n**2
            gns = [s_ref.item(), m_ref.item(), s_err.item(), m_err.item()]
            gns_all = [a + v for a, v in zip(gns_all, gns)]
            checked["b_simple"] += check_noise_scale(got, step, name, gns, n, averages=averages)
            # GradientVarianceQuantiles: sd in units of param.grad (c g); quantiles 1-Lipschitz
            # in max_j |sd_j - sd_ref,j| <= ||sd - sd_ref||_2, the mean in ||.||_2 / sqrt(P).
            sd_g, bound_g = g.std(0, unbiased=True).flatten() * n**0.5, sd_bound(g, d, world).item()
            sd, bound = sd_g * scale, bound_g * scale
            for level in QUANTILES:
                check(row("GradientVarianceQuantiles", q_name(level)), quantile(sd, level), bound, name)
            check(row("GradientVarianceQuantiles", "mean"), sd.mean().item(), bound / sd.numel() ** 0.5, name)
            sds.append(sd)
            sd_bounds.append(bound)
            snrs.append(snr_bounds(total, e.item(), sd_g, bound_g, n))
            checked["snr"] += check_snr(got, step, name, snrs[-1])
        # The network: ||g_i|| over all parameters is off by sqrt(sum_l b_il^2) (the triangle
        # inequality on the vector of layer norms); S and M add over layers, their bounds too;
        # sd and SNR are the layers' elements together.
        norms, b = all_norms.sqrt(), all_norm_bounds.sqrt()
        row = lambda quantity, statistic: got[(step, quantity, "all", statistic)]  # noqa: E731
        for level in QUANTILES:
            check(row("PerExampleGradNorm", q_name(level)), quantile(norms, level), b.max().item(), "all")
        check(row("PerExampleGradNorm", "mean"), norms.mean().item(), b.mean().item(), "all")
        check(row("PerExampleGradNorm", "max"), norms.max().item(), b.max().item(), "all")
        checked["b_simple"] += check_noise_scale(got, step, "all", gns_all, n, averages=averages)
        sd = torch.cat(sds)
        for level in QUANTILES:
            check(row("GradientVarianceQuantiles", q_name(level)), quantile(sd, level), max(sd_bounds), "all")
        check(row("GradientVarianceQuantiles", "mean"), sd.mean().item(),
              math.sqrt(sum(x * x for x in sd_bounds)) / sd.numel() ** 0.5, "all")
        if all(snr is not None for snr in snrs):
            checked["snr"] += check_snr(got, step, "all", tuple(torch.cat(parts) for parts in zip(*snrs)))
    return checked


def check_noise_scale(got, step, name, gns, n, quantity="GradientNoiseScale", averages=None):
    """grad_sq = (N M - S)/(N-1), trace_cov = N (S - M)/(N-1), b_simple their ratio (+inf where
    grad_sq is negative); 1 if b_simple was checked (its bound finite, or both signs negative).

    With ``averages`` (GradientNoiseScale's ``b_simple_smoothed``: ``EMA(trace_cov) /
    EMA(grad_sq)``, both averaged with the same weights, which are positive): the averages of
    the reference values and of their bounds (:func:`~cockpit_gradnoise.functional.exponential_moving_average`
    is linear), their ratio as b_simple's.
    """
    s_ref, m_ref, s_err, m_err = gns
    grad_sq, trace_cov = functional.noise_scale_estimates(s_ref, m_ref, n)
    e_grad, e_trace = (n * m_err + s_err) / (n - 1), n * (s_err + m_err) / (n - 1)
    row = lambda statistic: got[(step, quantity, name, statistic)]  # noqa: E731
    check(row("grad_sq"), grad_sq, e_grad, name)
    check(row("trace_cov"), trace_cov, e_trace, name)
    assert row("batch_size") == n
    checked = check_ratio(row("b_simple"), trace_cov, e_trace, grad_sq, e_grad, name)
    if averages is not None:
        previous = averages.get(name, (None,) * 4)
        averages[name] = tuple(functional.exponential_moving_average(old, new, DEFAULT_SMOOTHING)
                               for old, new in zip(previous, (trace_cov, e_trace, grad_sq, e_grad)))
        check_ratio(row("b_simple_smoothed"), *averages[name], name)
    return checked


def check_ratio(got, a, ea, b, eb, name):
    """``a / b`` within :func:`ratio_bound` (+inf where ``b`` is negative for certain); 1 if checked."""
    if b < -eb:  # +inf on both (schema.ratio_or_inf)
        assert got == math.inf, name
        return 1
    bound = ratio_bound(a, ea, b, eb)
    if math.isinf(bound):
        return 0
    check(got, a / b, bound, name)
    return 1


def snr_bounds(total, e, sd, bound, n):
    """``(snr_ref, bound)`` per element, or ``None`` where some ``sd_ref,j`` is within its bound.

    ``snr_j = min(|T_j| / sd_j, R)`` (free of units; ``R``
    :func:`~cockpit_gradnoise.functional.resolvable_snr`, the cap 1-Lipschitz): ``|T_j|`` is
    off by at most ``e`` (:func:`sum_bound`) and ``sd_j`` by the layer's ``||sd - sd_ref||_2``,
    so the ratio by :func:`ratio_bound`'s ``(e sd_j + |T_j| bound) / (sd_j (sd_j - bound))``.
    """
    if not bool((sd > bound).all()):
        return None
    t = total.flatten().abs()
    limit = functional.resolvable_snr(n, torch.float32)
    return (t / sd).clamp(max=limit), (e * sd + t * bound) / (sd * (sd - bound))


def check_snr(got, step, name, snr):
    """The median and the mean of the SNR within the largest and the mean of the elements'
    bounds; 1 if checked."""
    if snr is None:
        return 0
    snr, element = snr
    check(got[(step, "GradientVarianceQuantiles", name, "snr_q0.5")], quantile(snr, 0.5), element.max().item(), name)
    check(got[(step, "GradientVarianceQuantiles", name, "snr_mean")], snr.mean().item(), element.mean().item(), name)
    return 1


@pytest.mark.parametrize("world,job", MATRIX)
def test_fsdp2_gradient_is_the_mean_of_the_processes_bfloat16_gradients(groups, world, job):
    """What ParamGradRatio reads: FSDP2's float32 gradient is the mean over processes of their
    bfloat16 batch gradients (the copy's, by autograd), per element within the reduction's
    rounding in ``reduce_dtype``: ``gamma_{W+2+K}(unit) sum_k mean_r |G_rk|`` (``W - 1``
    additions, a division before and after, in float32 or bfloat16, and ``K`` micro-batches
    accumulated in float32)."""
    results = results_of(groups, world, job)
    unit = torch.finfo(JOBS[job][3]).eps / 2
    within_float32 = []
    count = MICRO_BATCHES.get(job, 1)
    for step in range(STEPS):
        for name, grad in results[0]["steps"][step]["grads"].items():
            # [micro-batch, process]: added over micro-batches, the mean over processes.
            local = torch.stack([torch.stack([part["local_grad"][name].double()
                                              for part in result["steps"][step]["parts"]])
                                 for result in results], dim=1)
            error = (grad.double() - local.mean(1).sum(0)).abs()
            magnitude = local.abs().mean(1).sum(0)
            assert (error <= gamma(world + 2 + count, unit) * magnitude).all(), (step, name)
            within_float32.append(bool((error <= gamma(world + 2 + count) * magnitude).all()))
    # The bound can fail: reduced in bfloat16, FSDP2's gradient is not the float32 mean.
    assert all(within_float32) == (JOBS[job][3] == torch.float32)


@pytest.mark.parametrize("world,job", SGD_MATRIX)
def test_param_grad_ratio_and_update_size_are_those_of_fsdp2s_gradient_and_parameters(groups, world, job):
    """One process holding FSDP2's gathered float32 parameters and gradient at each step:
    the same rows, with the DDP tests' tolerance."""
    results = results_of(groups, world, job)
    torch.manual_seed(0)
    model = Net()
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=from_grad(dict(named)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer's
        for step, recorded in enumerate(results[0]["steps"]):
            with torch.no_grad():
                for name, param in named:
                    param.copy_(recorded["params"][name])
                    param.grad = recorded["grads"].get(name)
            with cockpit(step, info={"loss": torch.tensor(0.0)}):
                pass
    expected = table(cockpit)
    got = {key: value for key, value in results[0]["table"].items() if key[1] in ("ParamGradRatio", "UpdateSize")}
    assert_tables_match(got, expected)
    assert {key[2] for key in expected} >= {"fc1.weight", "fc2.bias", "all"}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", list(NORMS_JOBS))
def test_the_norms_preset_is_the_two_batch_estimator_of_the_bfloat16_gradients(groups, world, job):
    """``cgn.track(quantities="norms")``: TwoBatchNoiseScale in float64 of the gradients the
    pass computed, each process's bfloat16 gradient (FSDP2's unsharded one, equal bit for bit
    to the copy's) as a small batch and FSDP2's float32 gradient as the big one (the mean of
    the processes' means: weights ``1 / (W N_r)``, as tests/test_fsdp2_track.py's reference),
    reduced in float32 or in bfloat16."""
    results = results_of(groups, world, job)
    got = agreed_table(results)
    sizes = SIZES[world]
    total = sum(1 / world for _ in sizes)  # sum_r w_r N_r
    effective = total**2 / sum(n / (world * n) ** 2 for n in sizes)
    for step in range(STEPS):
        parts = [result["steps"][step] for result in results]
        names = list(parts[0]["grads"])
        for part in parts:
            assert all(torch.equal(part["unsharded"][name], part["local_grad"][name]) for name in names)
        small = [test_two_batch.squared_norms([part["local_grad"][name] for name in names]) for part in parts]
        big = test_two_batch.squared_norms([parts[0]["grads"][name] / total for name in names])
        for i, name in enumerate(names + ["all"]):
            grad_sq, trace_cov = test_two_batch.from_the_model_of_the_paper(
                [(m[i], n) for m, n in zip(small, sizes)], big[i], effective)
            assert got[(step, "TwoBatchNoiseScale", name, "grad_sq")] == pytest.approx(grad_sq, rel=1e-11)
            assert got[(step, "TwoBatchNoiseScale", name, "trace_cov")] == pytest.approx(trace_cov, rel=1e-11)
            assert got[(step, "TwoBatchNoiseScale", name, "batch_size")] == sum(sizes)
    assert {"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"} <= {key[1] for key in got}


def adam_weights(grad, moment, steps):
    """``p_j^2`` of the update after ``steps`` steps, in float64 (the class's docstring):
    ``v_t = beta2 v + (1 - beta2) G^2``, ``v_hat = v_t / (1 - beta2^t)``, ``p = 1 / (sqrt(v_hat) + eps)``."""
    beta2, eps = ADAM["betas"][1], ADAM["eps"]
    grad = grad.double()
    moment = torch.zeros_like(grad) if moment is None else moment.double()
    v = beta2 * moment + (1 - beta2) * grad.square()
    return (1 / ((v / (1 - beta2 ** (steps + 1))).sqrt() + eps)).square()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("source,unit", [("autograd", U), ("products", 0.0)])
def test_preconditioned_noise_scale_within_the_bfloat16_bound(groups, world, source, unit):
    """PreconditionedNoiseScale with Adam (``P`` from its float32 state and FSDP2's float32
    gradient): ``S_P = sum_j p_j^2 Q_j / N`` and ``M_P = sum_j p_j^2 T_j^2 / N^2`` of the
    bfloat16 pass's per-example gradients, per element within

    - ``|dQ_j| <= sum_i delta_ij (2 |g_ij| + delta_ij) + gamma_{N+W+1} sum_i (|g_ij| + delta_ij)^2``,
    - ``|dT_j| <= sum_i delta_ij + gamma_{N+W} sum_i (|g_ij| + delta_ij)``,
    - ``p_j^2`` formed in float32 (eight roundings: ``gamma_17`` on its square) and the
      weighted sums over ``P`` elements added in float32 across ``W`` processes
      (``gamma_{P+W+1}``),

    so ``|dS_P| <= sum_j p_j^2 (|dQ_j| + (gamma_17 + gamma_{P+W+1}) (Q_j + |dQ_j|)) / N`` and
    ``|dM_P| <= sum_j p_j^2 (|dT_j| (2 |T_j| + |dT_j|) + (gamma_17 + gamma_{P+W+1}) (|T_j| + |dT_j|)^2) / N^2``;
    grad_sq, trace_cov and b_simple follow as for GradientNoiseScale, and
    b_simple_smoothed, ``EMA(trace_cov / S_P) / EMA(grad_sq / S_P)`` (averages from 0, the
    same positive weights for both:
    :func:`~cockpit_gradnoise.functional.scale_free_smoothed_noise_scale`), from each step's
    two ratios within :func:`ratio_bound`. Against the products of the factors (``u = 0``) too."""
    results = results_of(groups, world, "adam")
    got = agreed_table(results)
    n = sum(SIZES[world])
    averages = {}  # name: EMAs of trace_cov / S_P, grad_sq / S_P and their bounds
    for step in range(STEPS):
        recorded = results[0]["steps"][step]
        network = [0.0, 0.0, 0.0, 0.0]
        values = {}
        for name, (g, d) in element_bounds(results, step, source, unit).items():
            weights = adam_weights(recorded["grads"][name], recorded["moments"].get(name), step)
            rounding = gamma(17) + gamma(weights.numel() + world + 1)
            q, t = g.square().sum(0), g.sum(0)
            dq = (d * (2 * g.abs() + d)).sum(0) + gamma(n + world + 1) * (g.abs() + d).square().sum(0)
            dt = d.sum(0) + gamma(n + world) * (g.abs() + d).sum(0)
            s_p, m_p = (weights * q).sum() / n, (weights * t.square()).sum() / n**2
            s_err = (weights * (dq + rounding * (q + dq))).sum() / n
            m_err = (weights * (dt * (2 * t.abs() + dt) + rounding * (t.abs() + dt).square())).sum() / n**2
            values[name] = [s_p.item(), m_p.item(), s_err.item(), m_err.item()]
            network = [a + v for a, v in zip(network, values[name])]
        values["all"] = network
        for name, gns in values.items():
            check_noise_scale(got, step, name, gns, n, "PreconditionedNoiseScale")
            s_p, _, s_err, _ = gns
            grad_sq, trace_cov = functional.noise_scale_estimates(gns[0], gns[1], n)
            e_grad, e_trace = (n * gns[3] + s_err) / (n - 1), n * (s_err + gns[3]) / (n - 1)
            scaled = (trace_cov / s_p, ratio_bound(trace_cov, e_trace, s_p, s_err),
                      grad_sq / s_p, ratio_bound(grad_sq, e_grad, s_p, s_err))
            previous = averages.get(name, (0.0,) * 4)
            averages[name] = tuple(DEFAULT_SMOOTHING * old + (1 - DEFAULT_SMOOTHING) * new
                                   for old, new in zip(previous, scaled))
            check_ratio(got[(step, "PreconditionedNoiseScale", name, "b_simple_smoothed")], *averages[name], name)


@pytest.mark.parametrize("world", [2, 3])
def test_a_float16_policy_is_refused_by_name(groups, world):
    for message in results_of(groups, world, "float16"):
        assert message is not None and "MixedPrecisionPolicy" in message and "torch.float16" in message
        assert "param_dtype=torch.bfloat16" in message  # what is supported
