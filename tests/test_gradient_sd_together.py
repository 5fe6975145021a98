"""GradientVarianceQuantiles' sd and SNR of a step's parameters formed together.

On other devices than the CPU (``values_of_many``, issue 32): a few launches for a group of
parameters (``functional.gradient_sd_of_many``), where one parameter at a time took about
fifty each. The same elementwise operations on the same numbers, each parameter at its own
power-of-two scale: within the rounding two evaluations of them may differ by (a fused
multiply-add in one kernel and not in another), derived below, of each parameter's own
:func:`~cockpit_gradnoise.functional.gradient_sd`; and within the rounding bound of a
float64 brute force.
"""

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, functional
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD
from cockpit_gradnoise.functional.underflow import lost_to_underflow, underflow_floor
from cockpit_gradnoise.quantities import gradient_variance
from cockpit_gradnoise.step import Batch

import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, ModelCase, build, run_step
from tests.test_values_of_many import launches_of

N = 5


def _sums(generator, scales, dtype=torch.float64, examples=N):
    """Per tensor ``(S, T, R, x)``: float64 per-example contributions ``x`` of a few shapes at
    ``scales`` (far apart: each tensor its own power-of-two scale), some elements with identical
    examples (sd 0), one tensor all 0 (a dead layer); ``S``, ``T`` summed in float64 and kept in
    ``dtype``, ``R`` as an expansion's magnitudes would be (``>= S``)."""
    found = []
    for k, (shape, scale) in enumerate(zip([(4, 3), (7,), (2, 3, 2), (1,), (5,)], scales)):
        x = torch.randn(examples, *shape, generator=generator, dtype=torch.float64) * scale
        x.reshape(examples, -1)[:, 0] = x.reshape(examples, -1)[0, 0]  # examples agree there
        if x[0].numel() >= 7:  # nearly agree: centred sums of 1e-8 to 1e-3 of S, about the thresholds
            spread = torch.tensor([1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 1e-2], dtype=torch.float64)
            flat = x.reshape(examples, -1)
            flat[:, 1:7] = flat[0, 1:7] * (1 + spread * torch.randn(examples, 6, generator=generator,
                                                                     dtype=torch.float64))
        if k == 4:
            x.zero_()
        found.append((x.square().sum(0).to(dtype), x.sum(0), x.square().sum(0).mul(13).to(dtype), x))
    return found


def _difference_bound(squares: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """The most two evaluations of :func:`gradient_sd` on the same ``S`` (``squares``) and ``T``
    may differ in ``sd**2``, per element, where their operations round differently (one kernel
    fusing ``S - T**2 / N`` into one rounding, another not): the centred sums differ by at most
    ``4 eps (S + T**2 / N) <= 8 eps S`` (Cauchy-Schwarz); kept by both, ``sd**2 = C N / (N - 1)``
    and the root add ``4 eps sd**2 <= 4 eps S N / (N - 1)``; where one is at its rounding bound
    ``(3N + 4) eps S`` and set to 0, the other's ``C`` is at most that plus ``8 eps S``. Together
    below ``(3N + 16) eps S N / (N - 1)``."""
    return (3 * n + 16) * eps * squares.double() * n / (n - 1)


@pytest.mark.parametrize("sums_dtype, dtype", [(torch.float64, torch.float32), (torch.float64, torch.float64),
                                               (torch.float32, torch.float32)])
@pytest.mark.parametrize("expanded", [False, True])
def test_sd_of_many_is_each_tensors_own(sums_dtype, dtype, expanded):
    """Joined, each tensor's sd within the rounding two evaluations may differ by of its own
    :func:`gradient_sd`, at scales from 1 to 1e-30 (float64 sums of float32 contributions:
    each at its own power-of-two scale; one scale for all would overflow float32 or underflow)."""
    pairs = _sums(torch.Generator().manual_seed(0), [1.0, 1e-12, 1e-30, 3e3, 1.0], sums_dtype)
    totals = [t.to(dtype) for _, t, _, _ in pairs]
    own = [functional.gradient_sd(s, t, N, dtype=dtype, extra_rounding=functional.expansion_rounding_bound(
        r, N, dtype) if expanded else None) for (s, _, r, _), t in zip(pairs, totals)]
    lengths = torch.tensor([t.numel() for t in totals])
    squares = torch.cat([s.reshape(-1) for s, _, _, _ in pairs])
    magnitudes = torch.cat([r.reshape(-1) for _, _, r, _ in pairs]) if expanded else None
    joined = functional.gradient_sd_of_many(squares.clone(), torch.cat([t.reshape(-1) for t in totals]), lengths,
                                            N, dtype=dtype, magnitudes=magnitudes)
    assert joined.dtype == own[0].dtype and joined.shape == (int(lengths.sum()),)
    own = torch.cat([sd.reshape(-1) for sd in own]).double()
    extra = 0 if not expanded else N * torch.finfo(dtype).eps * magnitudes.double() * N / (N - 1)
    bound = _difference_bound(squares, N, torch.finfo(dtype).eps) + extra
    assert ((joined.double().square() - own.square()).abs() <= bound).all()
    assert (own > 0).sum() > 5  # (not all set to 0)
    # Set to 0 by one and not the other only where the centred sum is within the two
    # evaluations' rounding (and the inputs', 4 eps S) of the threshold, (3N + 4) eps S + N eps R.
    flips = (own == 0) != (joined == 0)
    total = torch.cat([t.reshape(-1) for t in totals]).double()
    centred = squares.double() - total.square() / N
    threshold = (3 * N + 4) * torch.finfo(dtype).eps * squares.double() + (
        N * torch.finfo(dtype).eps * magnitudes.double() if expanded else 0)
    assert ((centred - threshold).abs()[flips] <= 12 * torch.finfo(dtype).eps * squares.double()[flips]).all()
    assert (own == 0).sum() > len(pairs)  # (some set to 0 beside the identical examples' and the dead tensor's)


@pytest.mark.parametrize("tensors", [1, 2])
def test_a_part_of_one_tensor_is_its_own(tensors):
    """A part of one tensor (a large parameter alone) takes its own scale, not expanded: within
    the rounding of :func:`gradient_sd` itself, as a part of two."""
    pairs = _sums(torch.Generator().manual_seed(4), [1e-25, 1.0])[:tensors]
    numels = [s.numel() for s, _, _, _ in pairs]
    squares = torch.cat([s.reshape(-1) for s, _, _, _ in pairs])
    total = torch.cat([t.reshape(-1) for _, t, _, _ in pairs]).to(torch.float32)
    joined = functional.gradient_sd_of_many(squares.clone(), total, torch.tensor(numels), N, dtype=torch.float32)
    own = torch.cat([functional.gradient_sd(s, t.to(torch.float32), N, dtype=torch.float32).reshape(-1)
                     for s, t, _, _ in pairs])
    bound = _difference_bound(squares, N, torch.finfo(torch.float32).eps)
    assert ((joined.double().square() - own.double().square()).abs() <= bound).all() and (own > 0).any()


def test_sd_of_many_within_the_bound_of_brute_force():
    """Joined, each element's sd within the rounding bound of float64's brute force from the
    same contributions, ``N / (N - 1) sum_i (x_i - mean)**2``: ``|sd**2 - exact| <= (3N + 4) eps S
    N / (N - 1)`` and a square root's rounding (float64 sums of float32 contributions, sd in float32)."""
    pairs = _sums(torch.Generator().manual_seed(1), [1.0, 1e-20, 1e-33, 1e4, 1.0])
    squares = torch.cat([s.reshape(-1) for s, _, _, _ in pairs])
    total = torch.cat([t.reshape(-1) for _, t, _, _ in pairs]).to(torch.float32)
    numels = [t.numel() for _, t, _, _ in pairs]
    sd = functional.gradient_sd_of_many(squares.clone(), total, torch.tensor(numels), N, dtype=torch.float32)
    exact = torch.cat([N * x.var(0, unbiased=True).reshape(-1) for _, _, _, x in pairs])  # N/(N-1) sum (x - mean)**2
    eps = torch.finfo(torch.float32).eps
    bound = (3 * N + 4) * eps * squares * N / (N - 1) + 4 * eps * exact
    assert ((sd.double().square() - exact).abs() <= bound).all()


def test_unresolved_counts_of_segments_are_each_tensors_own():
    """The underflow counts of joined sums, each tensor's as :func:`unresolved_sums` gives it."""
    pairs = _sums(torch.Generator().manual_seed(3), [1.0, 1e-160, 1e-155, 1e-170, 1.0])
    totals = [t.to(torch.float32) for _, t, _, _ in pairs]
    squares = torch.cat([s.reshape(-1) for s, _, _, _ in pairs])
    counts = functional.unresolved_sums_of_segments(
        squares, torch.cat([t.reshape(-1) for t in totals]), torch.tensor([t.numel() for t in totals]), N)
    own = []
    for (s, _, _, _), t in zip(pairs, totals):
        lost = lost_to_underflow(s, underflow_floor(N, s.dtype), s, t)
        own.append(int(lost.sum()))
    assert counts.dtype == torch.int64 and counts.tolist() == own and sum(own) > 0 and own[0] == own[-1] == 0


def _values(case: ModelCase, dtype, together: bool, monkeypatch, inputs_scale=1.0):
    """``({name: (sd, SNR)}, {name: S}, output)`` of one GradientVarianceQuantiles step of
    ``case`` at batch ``N`` on the paths of other devices, formed together or one at a time."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    if not together:
        monkeypatch.setattr(cgn.GradientVarianceQuantiles, "values_of_many", lambda self, *args: None)
    problem = build(case, N, "mean", dtype=dtype)
    if problem.inputs.is_floating_point():
        problem.inputs = problem.inputs * inputs_scale
    quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names)
    seen, sums = {}, {}
    local_values = quantity._local_values

    def kept(step, params):
        found = local_values(step, params)
        by_name = dict(zip(problem.names, problem.params))
        for name, (sd, snr, _) in found[1]:
            seen[name] = (sd.detach().clone(), snr.detach().clone())
            sums[name] = getattr(by_name[name], SUMS_SAVEFIELD)[1].detach().clone()
        return found

    quantity._local_values = kept
    run_step(problem, [quantity])
    monkeypatch.undo()
    return seen, sums, quantity.output[0]


_CASES = [case for case in MODELS if case.name in ("mlp", "cnn", "layernorm-sequence", "embedding", "groupnorm-cnn",
                                                    "unused-frozen")]


@pytest.mark.parametrize("case", _CASES, ids=lambda case: case.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inputs_scale", [1.0, 1e-20, 1e-160])
def test_values_together_are_each_parameters_own(case, dtype, inputs_scale, monkeypatch):
    """On real backward passes (convolutions' expanded sums, normalizations, embeddings, frozen
    and unused parameters; inputs at ``1e-20``, where float32 squares underflow): the same
    parameters, each sd within the rounding two evaluations may differ by, each SNR the same
    ratio where both sd are (a division, correctly rounded), and the same statistics where
    every sd is the same number; parameters whose squares underflow left out alike."""
    together, sums, output = _values(case, dtype, True, monkeypatch, inputs_scale)
    alone, _, output_alone = _values(case, dtype, False, monkeypatch, inputs_scale)
    assert together.keys() == alone.keys() and output.keys() == output_alone.keys() and together
    if inputs_scale == 1e-160 and dtype == torch.float64 and case.name in ("mlp", "cnn"):
        # (the first layer's weight: squares of 1e-160 contributions underflow float64; on other
        # devices its row is NaN, known after the step's transfer)
        assert {str(v) for v in output["0.weight"].values()} == {"nan"} != {str(v) for v in output["0.bias"].values()}
    eps = torch.finfo(dtype).eps
    all_same = True
    for name, (sd, snr) in together.items():
        sd_alone, snr_alone = alone[name]
        assert sd.shape == sd_alone.shape and sd.dtype == sd_alone.dtype and snr.shape == snr_alone.shape
        bound = _difference_bound(sums[name].reshape(sd.shape), N, eps)
        assert ((sd.double().square() - sd_alone.double().square()).abs() <= bound).all(), name
        same = sd.reshape(-1) == sd_alone.reshape(-1)
        assert torch.equal(snr[same].isnan(), snr_alone[same].isnan())
        assert torch.equal(snr[same].nan_to_num(), snr_alone[same].nan_to_num())
        all_same = all_same and bool(same.all())
    if all_same:
        for row, row_alone in zip(output.values(), output_alone.values()):
            assert {k: v for k, v in row.items() if v == v} == {k: v for k, v in row_alone.items() if v == v}


def test_values_are_formed_one_at_a_time_on_the_cpu(monkeypatch):
    """On the CPU (NumPy's fused formation over the network's buffer) and for FSDP2's shards,
    nothing is formed together."""
    quantity = cgn.GradientVarianceQuantiles(linear(1))
    quantity._cuts, quantity._own_sums, quantity._checks = None, False, None
    param = nn.Parameter(torch.ones(3))
    setattr(param, SUMS_SAVEFIELD, torch.ones(2, 3, dtype=torch.float64))
    assert quantity.values_of_many([("p", param)], Batch(4, 1.0), []) is None
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    quantity._cuts = {}
    assert quantity.values_of_many([("p", param)], Batch(4, 1.0), []) is None


def test_parts_are_bounded():
    """Runs of at most ``_PART_ELEMENTS`` elements, in order; a larger parameter alone."""
    limit = gradient_variance._PART_ELEMENTS
    assert gradient_variance._parts([0, 1, 2, 3, 4], [limit // 2, limit // 2, 1, limit + 1, 3]) == [
        [0, 1], [2], [3], [4]]


def test_launches_of_the_values_do_not_grow_fifty_a_parameter(monkeypatch):
    """Issue 32: one at a time, the values took about fifty launches a parameter (on a GPU each
    10-40 us); together a few a group. What still grows with the parameters is the statistics'
    (their quantiles by segments, a few launches a parameter)."""
    quantity = cgn.GradientVarianceQuantiles
    grown = launches_of(quantity, 12, monkeypatch) - launches_of(quantity, 2, monkeypatch)
    monkeypatch.setattr(quantity, "values_of_many", lambda self, *args: None)
    grown_alone = launches_of(quantity, 12, monkeypatch) - launches_of(quantity, 2, monkeypatch)
    assert grown < grown_alone / 3, (grown, grown_alone)
