"""The two-batch-size noise scale (McCandlish et al. 2018, appendix A.1), from norms alone.

- Exact: against gradients of each micro-batch and of the weighted whole,
  each from its own ``torch.autograd.grad`` on an un-hooked copy, float64,
  one process and two (gloo on loopback, each process two micro-batches
  under ``no_sync``: run in ``tests/test_distributed.py``'s group of 2).
- Unbiased, and in agreement with the per-example estimate of
  :class:`~cockpit_gradnoise.GradientNoiseScale`: over many batches drawn
  with replacement from a fixed population (so its mean gradient ``G`` and
  covariance trace are known exactly), both estimates' means lie within 4
  standard errors of the truth (a normal tail of 6e-5 per check).
"""

import contextlib
import copy
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import functional
from cockpit_gradnoise.logs import schema

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

RTOL = 1e-11
RANK_SIZES = ((3, 2), (2, 4))  # micro-batch sizes of process 0 and 1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def micro_batches(sizes, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, generator=generator, dtype=torch.float64),
             torch.randint(0, 2, (b,), generator=generator)) for b in sizes]


def squared_norms(grads):
    values = [float(g.double().square().sum()) for g in grads]
    return values + [sum(values)]


def from_the_model_of_the_paper(small, big_squared_norm, big_examples):
    """``(grad_sq, trace_cov)`` solved from McCandlish et al. 2018, appendix A's model
    ``E |G_b|^2 = |G|^2 + tr(Sigma) / b``: for each small batch ``(M_j, b_j)`` the two
    equations at ``b_j`` and ``B`` (the big batch's ``M``), solved as a linear system;
    the mean over small batches (written apart from the package's closed form)."""
    solutions = [torch.linalg.solve(
        torch.tensor([[1.0, 1 / b], [1.0, 1 / big_examples]], dtype=torch.float64),
        torch.tensor([float(m), float(big_squared_norm)], dtype=torch.float64)) for m, b in small]
    grad_sq, trace_cov = torch.stack(solutions).mean(0).tolist()
    return grad_sq, trace_cov


@pytest.mark.parametrize("estimate", [functional.two_batch_noise_scale_estimates, from_the_model_of_the_paper])
def test_the_estimates_equal_hand_computed_values(estimate):
    # |G|^2 = 1, tr(Sigma) = 8 give |G_b|^2 = 1 + 8 / b exactly: 5 at b = 2, 3 at 4, 2 at B = 8.
    assert estimate([(5.0, 2), (3.0, 4)], 2.0, 8) == pytest.approx((1.0, 8.0), rel=1e-14, abs=0)
    # With |G_2|^2 = 6 instead: at b = 2, |G|^2 = (8*2 - 2*6) / (8 - 2) = 2/3 and
    # tr(Sigma) = (6 - 2) / (1/2 - 1/8) = 32/3; at b = 4, 1 and 8 as above; their means 5/6, 28/3.
    grad_sq, trace_cov = estimate([(6.0, 2), (3.0, 4)], 2.0, 8)
    assert grad_sq == pytest.approx(5 / 6, rel=1e-14, abs=0) and trace_cov == pytest.approx(28 / 3, rel=1e-14, abs=0)


def test_the_estimates_are_elementwise_on_tensors():
    grad_sq, trace_cov = functional.two_batch_noise_scale_estimates(
        [(torch.tensor([5.0, 6.0], dtype=torch.float64), 2), (torch.tensor([3.0, 3.0], dtype=torch.float64), 4)],
        torch.tensor([2.0, 2.0], dtype=torch.float64), 8)
    assert grad_sq.tolist() == pytest.approx([1.0, 5 / 6], rel=1e-14, abs=0)
    assert trace_cov.tolist() == pytest.approx([8.0, 28 / 3], rel=1e-14, abs=0)


def reference(model, batches, weights):
    """``{name: (grad_sq, trace_cov)}`` from each batch's own gradient, by autograd on a copy."""
    plain = copy.deepcopy(model)
    params = list(plain.parameters())
    sums = [torch.autograd.grad(F.cross_entropy(plain(x), y, reduction="sum"), params)
            for x, y in batches]
    total = sum(w * len(y) for w, (_, y) in zip(weights, batches))
    effective = total**2 / sum(w * w * len(y) for w, (_, y) in zip(weights, batches))
    big = [sum(w * s[i] for w, s in zip(weights, sums)) / total for i in range(len(params))]
    small = [squared_norms([g / len(y) for g in s]) for s, (_, y) in zip(sums, batches)]
    names = [n for n, _ in plain.named_parameters()] + [schema.NETWORK]
    return {name: from_the_model_of_the_paper(
        [(m[i], len(y)) for m, (_, y) in zip(small, batches)], squared_norms(big)[i], effective)
        for i, name in enumerate(names)}


def assert_matches(record, expected, examples):
    assert set(record) == set(expected)
    for name, (grad_sq, trace_cov) in expected.items():
        got = record[name]
        assert got[schema.GRAD_SQ] == pytest.approx(grad_sq, rel=RTOL)
        assert got[schema.TRACE_COV] == pytest.approx(trace_cov, rel=RTOL)
        assert got[schema.B_SIMPLE] == pytest.approx(schema.ratio_or_inf(trace_cov, grad_sq), rel=RTOL)
        assert got[schema.BATCH_SIZE] == examples


@pytest.mark.parametrize("sizes, reduction", [((2, 3, 4), "mean"), ((5, 2), "sum"), ((3, 3), "mean")])
def test_every_statistic_equals_the_formula_on_each_batchs_own_gradient(sizes, reduction):
    model = mlp()
    noise = cgn.TwoBatchNoiseScale(model)
    batches = micro_batches(sizes)
    weights = [1 / (len(sizes) * b) if reduction == "mean" else 1.0 for b in sizes]
    for (x, y), weight in zip(batches, weights):
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        (loss / len(sizes) if reduction == "mean" else loss).backward()
        noise.micro_batch(len(y), None if reduction == "mean" else 1.0)
    record = noise.step(7)
    assert_matches(record, reference(model, batches, weights), sum(sizes))
    assert noise.output == {7: record}
    frame = noise.frame()
    assert set(frame["quantity"]) == {"TwoBatchNoiseScale"}
    assert len(frame) == len(record) * 5


def population(size=50, seed=3):
    """A fixed linear least-squares problem: per-example gradients in closed form."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.8 * torch.randn(
        size, generator=generator, dtype=torch.float64)
    return x, y


def per_example_gradients(model, x, y):
    """``[N, 4]``: each example's gradient of ``(w.x + b - y)^2 / 2``, weight then bias."""
    residual = (model(x).squeeze(1) - y).detach()
    return torch.cat([residual[:, None] * x, residual[:, None]], dim=1)


def test_both_estimates_are_unbiased_over_batches_drawn_from_a_known_population():
    x, y = population()
    model = nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.7, -1.5, 0.2]]))
        model.bias.fill_(0.3)
    g = per_example_gradients(model, x, y)
    true_grad_sq = float(g.mean(0).square().sum())
    true_trace = float((g - g.mean(0)).square().sum(1).mean())  # drawn with replacement
    noise = cgn.TwoBatchNoiseScale(model)
    generator = torch.Generator().manual_seed(4)
    rounds, parts, b = 400, 4, 4
    two_batch, per_example = [], []
    for step in range(rounds):
        index = torch.randint(0, len(y), (parts * b,), generator=generator)
        for part in index.view(parts, b):
            (F.mse_loss(model(x[part]).squeeze(1), y[part]) / 2 / parts).backward()
            noise.micro_batch(b)
        record = noise.step(step)[schema.NETWORK]
        model.zero_grad()
        two_batch.append((record[schema.GRAD_SQ], record[schema.TRACE_COV]))
        drawn = g[index]
        per_example.append(functional.noise_scale_estimates(
            float(drawn.square().sum(1).mean()), float(drawn.mean(0).square().sum()), len(index)))
    for estimates in (two_batch, per_example):
        for column, truth in zip(zip(*estimates), (true_grad_sq, true_trace)):
            values = torch.tensor(column)
            standard_error = float(values.std()) / math.sqrt(rounds)
            assert abs(float(values.mean()) - truth) <= 4 * standard_error
    # Same batches: the paired difference of the two estimates has mean 0.
    for a, c in zip(zip(*two_batch), zip(*per_example)):
        difference = torch.tensor(a) - torch.tensor(c)
        assert abs(float(difference.mean())) <= 4 * float(difference.std()) / math.sqrt(rounds)


def test_one_micro_batch_on_one_process_records_nothing_with_a_warning():
    model = mlp()
    noise = cgn.TwoBatchNoiseScale(model)
    (x, y), = micro_batches([4])
    F.cross_entropy(model(x), y).backward()
    noise.micro_batch(4)
    with pytest.warns(UserWarning, match="one micro-batch on one process"):
        assert noise.step(0) is None
    assert noise.output == {}


def test_calls_out_of_order_and_bad_arguments_name_the_fix():
    model = mlp()
    noise = cgn.TwoBatchNoiseScale(model)
    with pytest.raises(RuntimeError, match=r"call micro_batch\(\) once after each"):
        noise.micro_batch(3)
    (x, y), = micro_batches([3])
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="was not closed"):
        noise.step(0)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="examples must be a positive int"):
            noise.micro_batch(bad)
    with pytest.raises(ValueError, match="weight must be a positive"):
        noise.micro_batch(3, weight=-1.0)
    noise.micro_batch(3)
    noise.remove()
    F.cross_entropy(model(x), y).backward()  # no hook left: nothing recorded
    assert noise._pending is None


def two_processes_with_micro_batches():
    """One step of this process under DDP (2 processes), run by ``tests/test_distributed.py``."""
    model = nn.parallel.DistributedDataParallel(mlp())
    noise = cgn.TwoBatchNoiseScale(model)
    sizes = RANK_SIZES[dist.get_rank()]
    for k, (x, y) in enumerate(micro_batches(sizes, seed=10 + dist.get_rank())):
        with model.no_sync() if k < len(sizes) - 1 else contextlib.nullcontext():
            (F.cross_entropy(model(x), y) / len(sizes)).backward()
        noise.micro_batch(len(y))
    return noise.step(3)


def check_two_processes(records):
    """The two processes' records against the formula on all four micro-batches."""
    assert records[0] == records[1]
    batches = [batch for rank in range(2) for batch in micro_batches(RANK_SIZES[rank], seed=10 + rank)]
    weights = [1 / (len(sizes) * b) for sizes in RANK_SIZES for b in sizes]
    # Names as in the unwrapped model (no "module."), like every quantity's.
    assert_matches(records[0], reference(mlp(), batches, weights), sum(map(sum, RANK_SIZES)))


def test_the_norms_preset_records_each_tracked_accumulated_step_and_its_log(tmp_path):
    """The front door's cheap preset: the tracker around every micro-batch."""
    model, tracker = cgn.track(mlp(), every=2, quantities="norms", log=tmp_path / "run")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes, expected = (2, 3, 4), {}
    for step in range(3):
        batches = micro_batches(sizes, seed=20 + step)
        if step % 2 == 0:
            expected[step] = reference(model, batches, [1 / (len(sizes) * b) for b in sizes])
        for k, (x, y) in enumerate(batches):
            losses = F.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=optimizer, micro_batch=k,
                         micro_batches=len(sizes)) as loss:
                loss.backward()  # losses.mean() / K
        optimizer.step()
        optimizer.zero_grad()
    quantity = next(q for q in tracker.cockpit.quantities if isinstance(q, cgn.TwoBatchNoiseScale))
    assert quantity._pending is None  # the untracked step's backward passes left nothing
    tracker.close()
    frame = cgn.to_frame(cgn.read_log(tmp_path / "run.jsonl"))  # the stream keeps no step in memory
    assert set(frame["quantity"]) == {"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize",
                                      "Optimizer"}  # the tracker logs its optimizer too
    rows = frame[frame.quantity == "TwoBatchNoiseScale"]
    assert sorted(set(rows["step"])) == [0, 2]
    for step, values in expected.items():
        at = rows[rows.step == step]
        record = {name: dict(zip(group.statistic.astype(str), group.value))
                  for name, group in at.groupby(at.param.astype(str), sort=False)}
        assert_matches(record, values, sum(sizes))


class _ToFloat32(nn.Module):
    def forward(self, x):
        return x.float()


def test_bfloat16_and_float32_gradients_are_normed_exactly_in_float64():
    """Mixed dtypes (a bfloat16 layer, then float32 ones): each micro-batch's own gradient
    (autograd on a copy, in the model's dtypes) and ``param.grad`` as accumulated, squared and
    summed in float64 (exact squares; a bfloat16 or float32 sum would be off by 1e-3 or 1e-7)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 64).to(torch.bfloat16), _ToFloat32(), nn.Tanh(), nn.Linear(64, 2))
    plain = copy.deepcopy(model)
    noise = cgn.TwoBatchNoiseScale(model)
    sizes = (3, 5)
    own = []
    for x, y in micro_batches(sizes, seed=4):
        x = x.to(torch.bfloat16)
        own.append(torch.autograd.grad(F.cross_entropy(plain(x), y) / len(sizes), list(plain.parameters())))
        (F.cross_entropy(model(x), y) / len(sizes)).backward()
        noise.micro_batch(len(y))
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    record = noise.step(0)
    # Weights 1 / (b K): a micro-batch's mean gradient is K g_k; the big batch's is param.grad.
    small = [[m * len(sizes) ** 2 for m in squared_norms(grads)] for grads in own]
    big = squared_norms([p.grad for p in model.parameters()])
    effective = len(sizes) ** 2 / sum(1 / b for b in sizes)  # (sum w b)^2 / sum w^2 b: 7.5
    names = [n for n, _ in model.named_parameters()] + [schema.NETWORK]
    expected = {name: from_the_model_of_the_paper([(m[i], b) for m, b in zip(small, sizes)], big[i], effective)
                for i, name in enumerate(names)}
    assert_matches(record, expected, sum(sizes))


def test_two_backward_passes_in_one_micro_batch_are_refused_not_added_as_squares():
    """|g1|^2 + |g2|^2 is not the micro-batch's |g1 + g2|^2: refused, naming the fix; alone
    and through the tracker (a warning, nothing recorded at that step, the next step recorded)."""
    model = mlp()
    noise = cgn.TwoBatchNoiseScale(model)
    (x, y), = micro_batches([3])
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"two backward passes reached \['0.bias', '0.weight'"):
        noise.micro_batch(3)
    assert noise._pending is None and noise._micro_batches == []
    for k in (1, 2):  # the step's other micro-batches: param.grad holds the dropped one's gradient
        (x, y), = micro_batches([2], seed=k)
        F.cross_entropy(model(x), y).backward()
        noise.micro_batch(2)
    with pytest.warns(UserWarning, match="a micro-batch of this step was dropped"):
        assert noise.step(0) is None
    model, tracker = cgn.track(mlp(), every=1, quantities=["TwoBatchNoiseScale"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning) as caught:
        for step in range(2):
            for k, (x, y) in enumerate(micro_batches((2, 3, 4), seed=30 + step)):
                losses = F.cross_entropy(model(x), y, reduction="none")
                with tracker(step, losses, optimizer=optimizer, micro_batch=k, micro_batches=3) as loss:
                    loss.backward(retain_graph=step == 0)
                    if step == 0 and k == 0:
                        loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    told = " ".join(str(warning.message) for warning in caught)
    assert "two backward passes reached ['0.bias'" in told and "micro-batch of this step was dropped" in told
    frame = cgn.to_frame(tracker.cockpit)
    assert sorted(set(frame[frame.quantity == "TwoBatchNoiseScale"].step)) == [1]


def test_untracked_steps_run_without_its_hooks_and_cockpits_context_and_tracked_ones_stay_exact():
    """Untracked steps of the norms preset cost nothing of it: the tracker skips Cockpit's
    context (IdleStep) and no hook is on the parameters (taken off after the last tracked
    step before an untracked one, put back at the next tracked step's call), and each
    tracked step after a gap is exact."""
    from cockpit_gradnoise.tracked_step import IdleStep

    model, tracker = cgn.track(mlp(), every=3, quantities="norms")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    quantity = next(q for q in tracker.cockpit.quantities if isinstance(q, cgn.TwoBatchNoiseScale))
    params = list(model.parameters())
    sizes, expected = (2, 3), {}
    for step in range(7):
        batches = micro_batches(sizes, seed=40 + step)
        tracked = step % 3 == 0
        if tracked:
            expected[step] = reference(model, batches, [1 / (len(sizes) * b) for b in sizes])
        for k, (x, y) in enumerate(batches):
            losses = F.cross_entropy(model(x), y, reduction="none")
            context = tracker(step, losses, optimizer=optimizer, micro_batch=k, micro_batches=len(sizes))
            # Steps 1 and 4 end UpdateSize's two-step measurement: Cockpit's context, no hooks.
            assert isinstance(context, IdleStep) == (step in (2, 5)), step
            with context as loss:
                # hooks on the parameters at tracked steps only (Cockpit's, then none)
                assert all(bool(p._backward_hooks) == tracked for p in params), step
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert sorted(quantity.output) == [0, 3, 6]
    for step, values in expected.items():
        assert_matches(quantity.output[step], values, sum(sizes))


class Branched(nn.Module):
    """Its second layer takes part only where ``deep``: a micro-batch that leaves it out gives
    its parameters no gradient, so their hooks do not run in that backward pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 2).double(), nn.Linear(2, 2).double()

    def forward(self, x, deep):
        out = self.first(x)
        return self.second(out) if deep else out


def test_micro_batches_that_reach_some_parameters_and_not_others_are_exact():
    # The hooks' order differs between micro-batches (all four parameters, then two), and the
    # first order comes back: each micro-batch's squared norms are kept per parameter, in place.
    model, depths, sizes = Branched(), (True, False, True), (2, 3, 4)
    noise = cgn.TwoBatchNoiseScale(model)
    batches = micro_batches(sizes, seed=5)
    for (x, y), deep in zip(batches, depths):
        (F.cross_entropy(model(x, deep), y) / len(sizes)).backward()
        noise.micro_batch(len(y))
    record = noise.step(3)
    plain, weights = copy.deepcopy(model), [1 / (len(sizes) * b) for b in sizes]
    params = list(plain.parameters())
    sums = [[torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(
        F.cross_entropy(plain(x, deep), y, reduction="sum"), params, allow_unused=True))]
        for (x, y), deep in zip(batches, depths)]
    total = sum(w * b for w, b in zip(weights, sizes))
    effective = total**2 / sum(w * w * b for w, b in zip(weights, sizes))
    big = squared_norms([sum(w * s[i] for w, s in zip(weights, sums)) / total for i in range(len(params))])
    small = [squared_norms([g / b for g in s]) for s, b in zip(sums, sizes)]
    assert small[1][2] == small[1][3] == 0.0  # the second layer, left out of the middle micro-batch
    names = [n for n, _ in plain.named_parameters()] + [schema.NETWORK]
    expected = {name: from_the_model_of_the_paper([(m[i], b) for m, b in zip(small, sizes)], big[i], effective)
                for i, name in enumerate(names)}
    assert_matches(record, expected, sum(sizes))
