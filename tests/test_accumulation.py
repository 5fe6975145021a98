"""Gradient accumulation: K micro-batches tracked as one batch of all their examples.

Each optimizer step differentiates ``K`` micro-batches (``K = 2`` and ``3``,
uneven sizes, a micro-batch of one example), each inside the tracker's
``with`` with the same step, ``losses.mean() / K`` or ``losses.sum()``. Every
statistic of the five quantities is compared with float64 references on one
batch of all the step's examples (``cockpit_gradnoise.references``: a loop
over examples): GradientVarianceQuantiles, PerExampleGradNorm and
GradientNoiseScale with the step's examples and reduction; ParamGradRatio
with the gradient of the accumulated loss (what ``param.grad`` holds), and
UpdateSize with the SGD step it takes, on a reference copy of the model.
The same under DistributedDataParallel (2 gloo processes, ``no_sync()`` on
the first ``K - 1`` micro-batches): the global accumulated batch.

The loops of :func:`accumulate` and :func:`ddp_steps` are the recipes of
``docs/accumulation.md`` and of ``docs/training-setups.md`` (the tracker's
``micro_batch=k, micro_batches=K``, and Cockpit's ``info`` keys).
"""

import contextlib
import copy
import dataclasses
import math
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work
from cockpit_gradnoise import references
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.tracking import Tracker

import pytest
import torch
import torch.distributed as dist
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import build, case_named
from tests.helpers import RTOL, assert_statistics_match, sd_rtol
from tests.process_groups import join_group, run_group

LR, STEPS = 0.1, 2
GVQ_LEVELS, NORM_LEVELS = (0.0, 0.25, 0.5, 1.0), (0.0, 0.5, 1.0)
SMOOTHING = 0.9  # GradientNoiseScale's default
ONE_PROCESS = [(3, 4), (2, 1, 4)]  # examples per micro-batch: K = 2 and 3, uneven
# Examples per micro-batch (outer) and process (inner), 2 processes: K = 2 and 3.
TWO_PROCESSES = [((2, 3), (1, 2)), ((1, 2), (3, 1), (2, 2))]
DDP_CASES = [("mlp", reduction, sizes) for reduction in ("mean", "sum") for sizes in TWO_PROCESSES]
DDP_CASES += [("cnn", "mean", TWO_PROCESSES[1])]


def quantities(names):
    schedule = linear(1)
    return [
        cgn.GradientVarianceQuantiles(schedule, quantiles=GVQ_LEVELS, param_names=names),
        cgn.PerExampleGradNorm(schedule, quantiles=NORM_LEVELS, param_names=names),
        cgn.ParamGradRatio(schedule, param_names=names),
        cgn.UpdateSize(schedule, param_names=names),
        cgn.GradientNoiseScale(schedule, param_names=names),
    ]


def stored(tracker):
    """``{(step, quantity): {param: {statistic: value}}}`` of the tracker's quantities, decoded
    (not the optimizer it logs)."""
    frame = tracker.frame()
    frame = frame[frame.quantity != "Optimizer"]
    result = {}
    for step, quantity, param, statistic, value in zip(
        frame.step, frame.quantity, frame.param, frame.statistic, frame.value
    ):
        result.setdefault((step, quantity), {}).setdefault(param, {})[statistic] = value
    return result


def parts_of(problem, step, sizes):
    """The step's examples, part after part (a micro-batch of one process is a part)."""
    per_step = sum(sizes)
    start = step * per_step
    return problem.inputs[start : start + per_step], problem.targets[start : start + per_step]


def accumulated_loss(per_example_loss, outputs, targets, sizes, reduction, count, world=1):
    """The loss whose gradient ``param.grad`` holds after the step.

    ``sizes``: the parts in order, each differentiating its ``losses.mean() / K``
    or ``losses.sum()``; DDP averages the processes' gradients (``/ world``).
    """
    total, start = 0.0, 0
    for size in sizes:
        losses = per_example_loss(outputs[start : start + size], targets[start : start + size])
        start += size
        total = total + (losses.sum() if reduction == "sum" else losses.mean() / count)
    return total / world


def reference_steps(problem, reduction, parts, count, world=1, steps=STEPS):
    """``{(step, quantity): rows}`` by float64 references, and GradientVarianceQuantiles' bounds.

    On a copy of ``problem.model`` (untrained), trained by SGD with the accumulated
    loss's gradient. ``parts``: example counts of the parts of a step, in the
    order of its examples.
    """
    model = copy.deepcopy(problem.model)
    expected, averages, bounds = {}, {}, {}
    for step in range(steps):
        inputs, targets = parts_of(problem, step, parts)
        grads = references.per_example_gradients(model, problem.per_example_loss, inputs, targets)
        n = len(inputs)
        expected[step, "GradientVarianceQuantiles"] = references.gradient_variance_quantiles(
            model, None, inputs, targets, reduction=reduction, quantiles=GVQ_LEVELS,
            gradients=grads)
        # Rounding: the sums over examples, added in another order.
        bounds[step] = {name: sd_rtol(grads, n, name) for name in expected[step, "GradientVarianceQuantiles"]}
        expected[step, "PerExampleGradNorm"] = references.per_example_grad_norm(
            model, None, inputs, targets, quantiles=NORM_LEVELS, gradients=grads)
        noise = references.gradient_noise_scale(model, None, inputs, targets, gradients=grads)
        for name, row in noise.items():
            row[schema.BATCH_SIZE] = float(n)
            row[schema.B_SIMPLE_SMOOTHED] = smoothed(averages, name, row)
        expected[step, "GradientNoiseScale"] = noise

        def loss_fn(outputs, targets):
            return accumulated_loss(problem.per_example_loss, outputs, targets, parts, reduction,
                                    count, world)

        expected[step, "ParamGradRatio"] = references.param_grad_ratio(model, loss_fn, inputs, targets)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        before = {name: p.detach().clone() for name, p in named}
        gradient = torch.autograd.grad(loss_fn(model(inputs), targets), [p for _, p in named])
        with torch.no_grad():
            for (_, p), g in zip(named, gradient):
                p.sub_(LR * g)
        if step < steps - 1:  # stored under step at step + 1
            expected[step, "UpdateSize"] = references.update_size(
                before, {n: p.detach() for n, p in named})
    return expected, bounds


def smoothed(averages, name, row):
    """``b_simple_smoothed``: the ratio of the moving averages of trace_cov and grad_sq."""
    old = averages.get(name)
    new = (row["trace_cov"], row["grad_sq"])
    averages[name] = new if old is None else tuple(
        SMOOTHING * a + (1 - SMOOTHING) * b for a, b in zip(old, new))
    trace_cov, grad_sq = averages[name]
    return trace_cov / grad_sq if grad_sq > 0 else math.inf


def assert_steps_match(got, problem, reduction, parts, count, world=1):
    """Every statistic of every step as :func:`reference_steps` gives it.

    To ``RTOL``, GradientVarianceQuantiles to its rounding bound (``sd_rtol``).
    """
    expected, bounds = reference_steps(problem, reduction, parts, count, world)
    assert set(got) == set(expected)
    for (step, quantity), rows in expected.items():
        tolerance = None
        if quantity == "GradientVarianceQuantiles":
            def tolerance(name, statistic, bounds=bounds[step]):
                return bounds[name]
        assert_statistics_match(got[step, quantity], rows, RTOL, tolerance)


# One process ------------------------------------------------------------------------------


def accumulate(problem, tracker, reduction, sizes, api="tracker", steps=STEPS):
    """``steps`` SGD steps of ``len(sizes)`` micro-batches, each tracked."""
    opt = torch.optim.SGD(problem.params, lr=LR)
    count = len(sizes)
    for step in range(steps):
        opt.zero_grad()
        inputs, targets = parts_of(problem, step, sizes)
        start = 0
        for k, size in enumerate(sizes):
            x, y = inputs[start : start + size], targets[start : start + size]
            start += size
            losses = problem.per_example_loss(problem.model(x), y)
            if api == "tracker":
                with tracker(step, losses, optimizer=opt, reduction=reduction, micro_batch=k,
                             micro_batches=count) as loss:
                    loss.backward()
                continue
            # The explicit API: Cockpit's info.
            loss = losses.sum() if reduction == "sum" else losses.mean() / count
            info = {"individual_losses": losses, "loss": loss, "optimizer": opt,
                    "micro_batch": k, "micro_batches": count}
            with tracker.cockpit(step, info=info):
                loss.backward()
        opt.step()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("sizes", ONE_PROCESS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("model, api", [("mlp", "tracker"), ("cnn", "tracker"), ("mlp", "info")])
def test_micro_batches_give_the_statistics_of_one_batch_of_all_their_examples(
        model, api, sizes, reduction):
    problem = build(case_named(model), STEPS * sum(sizes), reduction)
    initial = dataclasses.replace(problem, model=copy.deepcopy(problem.model))
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem.names)),
                      problem.names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one warning
        warnings.filterwarnings("ignore", message="Full backward hook")
        accumulate(problem, tracker, reduction, sizes, api)
    assert_steps_match(stored(tracker), initial, reduction, sizes, len(sizes))


def test_each_micro_batch_gradient_is_kept_for_estimators_across_batch_sizes():
    sizes = (2, 1, 4)
    problem = build(case_named("mlp"), STEPS * sum(sizes), "mean")
    quantity = cgn.GradientNoiseScale(linear(1), param_names=problem.names)
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=[quantity]), problem.names)
    model = copy.deepcopy(problem.model)
    accumulate(problem, tracker, "mean", sizes, steps=1)
    (step, kept), = quantity.micro_batch_gradients.items()
    assert step == 0 and [m.examples for m in kept] == list(sizes)
    inputs, targets, start = problem.inputs, problem.targets, 0
    for size, micro in zip(sizes, kept):
        part = slice(start, start + size)
        start += size
        grads = references.per_example_gradients(model, problem.per_example_loss, inputs[part],
                                                 targets[part])
        assert micro.loss_scale == 1 / (len(sizes) * size)
        for name, g in grads.items():  # ||sum_i g_i||^2
            assert micro.squared_norms[name] == pytest.approx(
                g.sum(0).pow(2).sum().item(), rel=RTOL, abs=0), name


# What is refused or warned about ------------------------------------------------------------


def micro_batch_call(problem, tracker, step, k, count, part, **kwargs):
    x, y = problem.inputs[part], problem.targets[part]
    losses = problem.per_example_loss(problem.model(x), y)
    with tracker(step, losses, micro_batch=k, micro_batches=count, **kwargs) as loss:
        loss.backward()


def fresh(n=8):
    problem = build(case_named("mlp"), n, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem.names))
    return problem, Tracker(cockpit, problem.names)


def test_a_micro_batch_loss_not_divided_by_k_is_refused_naming_the_fix():
    problem, tracker = fresh()
    losses = problem.per_example_loss(problem.model(problem.inputs), problem.targets)
    with pytest.raises(ValueError, match=r"losses.mean\(\) / micro_batches"):
        tracker(0, losses, loss=losses.mean(), micro_batch=0, micro_batches=2)
    tracker(0, losses, loss=losses.mean() / 2, micro_batch=0, micro_batches=2)  # accepted
    tracker(0, losses, loss=losses.sum(), micro_batch=0, micro_batches=2)
    with pytest.raises(ValueError, match="micro_batch= and micro_batches= together"):
        tracker(0, losses, micro_batch=0)
    with pytest.raises(ValueError, match="from 0 to micro_batches - 1"):
        tracker(0, losses, micro_batch=2, micro_batches=2)


def test_micro_batches_out_of_order_or_missing_record_nothing_with_a_warning():
    problem, tracker = fresh()
    with pytest.warns(UserWarning, match="micro-batch 1 of 2 at step 0 does not follow"):
        micro_batch_call(problem, tracker, 0, 1, 2, slice(0, 4))  # micro-batch 0 never came
    problem.model.zero_grad()
    micro_batch_call(problem, tracker, 1, 0, 3, slice(0, 4))
    with pytest.warns(UserWarning, match="step 1 ended after 1 of its 3 micro-batches"):
        problem.model.zero_grad()
        micro_batch_call(problem, tracker, 2, 0, 2, slice(0, 4))
        micro_batch_call(problem, tracker, 2, 1, 2, slice(4, 8))
    # Only step 2 is complete; UpdateSize needs step 3.
    assert set(tracker.get_output()) == {2}
    assert "UpdateSize" not in tracker.get_output()[2]


def test_a_step_accumulated_again_after_it_was_recorded_overwrites_nothing():
    problem, tracker = fresh()
    for k in range(2):
        micro_batch_call(problem, tracker, 0, k, 2, slice(4 * k, 4 * k + 4))
    first = copy.deepcopy(stored(tracker))
    with pytest.warns(UserWarning, match="step 0 comes after step 0 was recorded"):
        for k in range(2):
            micro_batch_call(problem, tracker, 0, k, 2, slice(4 * k, 4 * k + 4))
    assert stored(tracker) == first


def test_the_cockpit_around_the_last_micro_batch_only_warns_and_describes_that_backward_pass():
    """The issue's case: param.grad holds the earlier micro-batches. GradientNoiseScale
    reads that backward pass's own gradient (the last micro-batch's), never param.grad."""
    problem, tracker = fresh()
    model = copy.deepcopy(problem.model)
    first, last = slice(0, 4), slice(4, 8)
    problem.per_example_loss(problem.model(problem.inputs[first]), problem.targets[first]).mean().backward()
    losses = problem.per_example_loss(problem.model(problem.inputs[last]), problem.targets[last])
    with pytest.warns(UserWarning, match=r"already holds gradients .* micro_batch=k, micro_batches=K"):
        with tracker(0, losses) as loss:
            loss.backward()
    expected = references.gradient_noise_scale(model, problem.per_example_loss,
                                               problem.inputs[last], problem.targets[last])
    got = stored(tracker)[0, "GradientNoiseScale"]
    for name, row in expected.items():
        for statistic, value in row.items():
            assert got[name][statistic] == pytest.approx(value, rel=RTOL, abs=0), (name, statistic)


def test_gradients_held_before_the_first_micro_batch_are_warned_about():
    problem, tracker = fresh()
    problem.per_example_loss(problem.model(problem.inputs), problem.targets).mean().backward()
    with pytest.warns(UserWarning, match="before the first micro-batch of step 0: .*zero_grad"):
        micro_batch_call(problem, tracker, 0, 0, 2, slice(0, 4))


# Two processes (DDP) --------------------------------------------------------------------------


def ddp_worker(rank, world, port, out):
    join_group(rank, world, port)
    results = {}
    try:
        for key in DDP_CASES:
            results[key] = ddp_steps(*key)
            torch.save(results, Path(out) / f"rank{rank}.pt")
        results["deferred"] = deferred_error()
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def ddp_steps(model, reduction, sizes):
    """``STEPS`` steps of ``len(sizes)`` micro-batches, ``no_sync()`` but for the last."""
    rank, count = dist.get_rank(), len(sizes)
    problem = build(case_named(model), STEPS * sum(map(sum, sizes)), reduction)
    ddp = nn.parallel.DistributedDataParallel(problem.model)
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=quantities(problem.names)),
                      problem.names)
    opt = torch.optim.SGD(problem.params, lr=LR)
    parts = [size for micro in sizes for size in micro]
    for step in range(STEPS):
        opt.zero_grad()
        inputs, targets = parts_of(problem, step, parts)
        start = 0
        for k, micro in enumerate(sizes):
            begin = start + sum(micro[:rank])
            x, y = inputs[begin : begin + micro[rank]], targets[begin : begin + micro[rank]]
            start += sum(micro)
            with ddp.no_sync() if k < count - 1 else contextlib.nullcontext():
                losses = problem.per_example_loss(ddp(x), y)
                with tracker(step, losses, optimizer=opt, reduction=reduction, micro_batch=k,
                             micro_batches=count) as loss:
                    loss.backward()
        opt.step()
    return stored(tracker)


def deferred_error():
    """Rank 1's first micro-batch lacks info['individual_losses']: the error of each process,
    as ``"<micro-batch>: <type>: <message>"`` (``None`` if none)."""
    rank = dist.get_rank()
    problem = build(case_named("mlp"), 8, "mean")
    ddp = nn.parallel.DistributedDataParallel(problem.model)
    cockpit = cgn.Cockpit(problem.params, quantities=quantities(problem.names))
    for k in range(2):
        part = slice(4 * k + 2 * rank, 4 * k + 2 * rank + 2)
        with ddp.no_sync() if k == 0 else contextlib.nullcontext():
            losses = problem.per_example_loss(ddp(problem.inputs[part]), problem.targets[part])
            loss = losses.mean() / 2
            info = {"individual_losses": losses, "loss": loss, "micro_batch": k, "micro_batches": 2}
            if rank == 1 and k == 0:
                del info["individual_losses"]
            try:
                with cockpit(0, info=info):
                    loss.backward()
            except Exception as error:  # recorded: the test checks the messages
                return f"{k}: {type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Each process's ``{(model, reduction, sizes): stored}``, and the group's error."""
    results, error, _ = run_group(2, tmp_path_factory.mktemp("accumulation_ddp"), ddp_worker)
    return results, error


@pytest.mark.parametrize("key", DDP_CASES, ids=lambda key: f"{key[0]}-{key[1]}-K{len(key[2])}")
def test_ddp_with_accumulation_gives_the_global_accumulated_batch(two_processes, key):
    results, error = two_processes
    model, reduction, sizes = key
    assert len(results) == 2 and all(key in r for r in results), error
    assert results[0][key] == results[1][key]  # identical on every process
    parts = [size for micro in sizes for size in micro]
    problem = build(case_named(model), STEPS * sum(parts), reduction)
    assert_steps_match(results[0][key], problem, reduction, parts, len(sizes), world=2)


def test_an_error_in_an_earlier_micro_batch_is_raised_at_the_last_on_every_process(two_processes):
    results, error = two_processes
    assert len(results) == 2 and all("deferred" in r for r in results), error
    assert results[1]["deferred"].startswith("1: KeyError: \"GradientVarianceQuantiles needs")
    assert results[0]["deferred"].startswith("1: RuntimeError: cockpit_gradnoise: process(es) [1]")
