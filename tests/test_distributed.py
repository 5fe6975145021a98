"""DistributedDataParallel: exact global-batch statistics, identical on every process.

2 and 3 processes (gloo on loopback, started here, a free port, float64) run
the checks in one group per world size, because starting a process costs
seconds: a module fixture runs every job of a group and saves each process's
results, the tests below compare them with one process on the concatenated
batch. A group that hangs is killed after ``JOIN_TIMEOUT`` seconds and fails
its tests; collectives time out after ``GLOO_TIMEOUT``.

Processes start by ``forkserver`` where there is one (else ``spawn``): a
fresh interpreter, spawned once, imports torch, BackPACK, Cockpit and this
module, and forks every process of both groups from that clean,
single-threaded state (nothing of pytest's process is inherited), instead of
each process importing them again (about 10 s each on a busy 2-core machine).

References (one process, in this process):

- GradientVarianceQuantiles, PerExampleGradNorm, GradientNoiseScale: the
  concatenated batch of all processes with the same loss reduction;
- ParamGradRatio, UpdateSize: read ``param.grad``, which DDP averages over
  processes, i.e. the gradient of ``mean_r loss_r`` (``loss_r`` the loss of
  process ``r``'s batch); for a mean loss with equal local batches that is
  the concatenated batch's gradient.
"""

import contextlib
import dataclasses
import datetime
import math
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work
from cockpit_gradnoise import _ranks, cli, distributed

import pandas
import pytest
import torch
import torch.distributed as dist

# Imported here, so that the forkserver, which preloads the test module whose group starts it
# (this one, or one importing it), holds them: spawned processes skip their import (half their CPU).
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.multiprocessing as mp
import torch.nn.functional as F
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn
from torch.multiprocessing.spawn import ProcessException

from tests import test_two_batch
from tests.cases import MODELS, ModelCase, build
from tests.helpers import RTOL

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
JOIN_TIMEOUT = 300  # seconds for a whole group: generous for a loaded 2-core machine
GLOO_TIMEOUT = 60  # seconds for one collective
CASES = {case.name: case for case in MODELS}
PER_EXAMPLE = ("GradientVarianceQuantiles", "PerExampleGradNorm", "GradientNoiseScale")
FROM_GRAD = ("ParamGradRatio", "UpdateSize")
LR = 0.1
LOSS_FAILURE = "the loss failed on purpose on rank 1"


@dataclass(frozen=True)
class Config:
    """A model, a loss reduction and the local batch size of each process."""

    model: str
    reduction: str
    sizes: Tuple[int, ...]

    @property
    def id(self):
        return f"{self.model}-{self.reduction}-{'-'.join(map(str, self.sizes))}"


def configs(sizes):
    return [
        Config(model, reduction, local_sizes)
        for model in ("mlp", "cnn", "layernorm-sequence")
        for reduction in ("mean", "sum")
        for local_sizes in sizes
    ]


# Equal and uneven local batches, each world size with a single-example process.
CONFIGS = {
    2: configs([(4, 4), (1, 6)]),
    3: configs([(3, 3, 3), (5, 1, 2)]),
}
NO_SYNC_SIZES = ((3, 2), (2, 4))  # per micro-batch, per process
MINIBATCHES = 5  # over 2 or 3 processes: unequal shares


# The processes ---------------------------------------------------------------------


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(world, out, target=None):
    """Spawn ``world`` processes running ``target(rank, world, port, out)`` (:func:`worker`,
    or a function of another test module); their results, error and folder."""
    target = worker if target is None else target
    if START_METHOD == "forkserver":  # before the server starts; it then imports once
        mp.get_context("forkserver").set_forkserver_preload([target.__module__])
    context = mp.start_processes(
        target, args=(world, free_port(), str(out)), nprocs=world, join=False,
        start_method=START_METHOD,
    )
    deadline, error = time.monotonic() + JOIN_TIMEOUT, None
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                error = f"the group of {world} processes hung for {JOIN_TIMEOUT} s"
                break
    except ProcessException as exception:  # a process raised: join ended the others
        error = str(exception)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)
               if (out / f"rank{r}.pt").exists()]
    return results, error, out


def join_group(rank, world, port):
    """This process's place in the gloo group on loopback: one thread, collectives that time
    out, BackPACK's hook warning off (the workers of this file and of test_fsdp2)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT),
    )


def run_jobs(rank, world, port, out, jobs, mesh_shape=None, mesh_dim_names=None):
    """A worker's body: join the group, run ``jobs`` (``{name: job(mesh)}``; the mesh of
    ``mesh_shape`` and ``mesh_dim_names``, by default 1-D over every process) in order,
    saving this process's results after each, and leave the group."""
    join_group(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape or (world,), mesh_dim_names=mesh_dim_names)
    results = {}
    try:
        for name, job in jobs.items():
            results[name] = job(mesh)
            torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def worker(rank, world, port, out):
    join_group(rank, world, port)
    out = Path(out)
    results = {}
    jobs = [(config.id, lambda config=config: ddp_steps(config)) for config in CONFIGS[world]]
    jobs += [("minibatch", minibatch_functions), ("float32", float32_collectives)]
    if world == 2:
        jobs += [
            ("no_sync", no_sync_steps),
            ("errors", errors_raised_together),
            ("skipped_call", skipped_call),
            ("fsdp", fsdp_message),
            ("train_ddp", lambda: train_ddp_quick(out / "train_ddp")),
            ("two_batch", test_two_batch.two_processes_with_micro_batches),
            ("resume", lambda: resumed_ddp_run(out / "resume")),
        ]
    try:
        for key, job in jobs:
            results[key] = job()
            torch.save(results, out / f"rank{rank}.pt")
        if world == 2:
            loss_fails_on_rank_1()
    finally:
        dist.destroy_process_group()


def local_part(tensor, sizes):
    """This process's rows of a batch laid out process after process."""
    start = sum(sizes[: dist.get_rank()])
    return tensor[start : start + sizes[dist.get_rank()]]


def all_quantities(names, schedule=linear(1)):
    return [
        cgn.GradientVarianceQuantiles(schedule, quantiles=(0.0, 0.25, 0.5, 1.0), param_names=names),
        cgn.PerExampleGradNorm(schedule, quantiles=(0.0, 0.5, 1.0), param_names=names),
        cgn.ParamGradRatio(schedule, param_names=names),
        cgn.UpdateSize(schedule, param_names=names),
        cgn.GradientNoiseScale(schedule, param_names=names),
    ]


def table(cockpit):
    """``{(step, quantity, param, statistic): value}`` of a cockpit."""
    frame = cgn.to_frame(cockpit)
    return dict(zip(zip(frame.step, frame.quantity, frame.param, frame.statistic), frame.value))


@contextlib.contextmanager
def counting_all_reduce(counter):
    """Count the calls of ``torch.distributed.all_reduce`` (DDP's own are in C++)."""
    original = dist.all_reduce

    def counted(*args, **kwargs):
        counter.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original


def info_of(problem, outputs, targets, loss):
    return {
        "batch_size": len(targets),
        "individual_losses": problem.per_example_loss(outputs, targets),
        "loss": loss,
    }


def ddp_steps(config, steps=2):
    """Two tracked DDP steps with every quantity; the all_reduce calls of the first."""
    problem = build(CASES[config.model], sum(config.sizes), config.reduction)
    model = nn.parallel.DistributedDataParallel(problem.model)
    inputs, targets = local_part(problem.inputs, config.sizes), local_part(problem.targets, config.sizes)
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    optimizer = torch.optim.SGD(problem.params, lr=LR)
    calls = []
    for step in range(steps):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = problem.loss_fn(outputs, targets)
        with counting_all_reduce(calls if step == 0 else []):
            with cockpit(step, info=info_of(problem, outputs, targets, loss)):
                loss.backward()
        optimizer.step()
    return {"table": table(cockpit), "all_reduce_calls": len(calls)}


def float32_collectives():
    """All-reduce calls of one tracked step of a float32 model (GradientNoiseScale's scalar
    sums are float64)."""
    sizes = (3,) * dist.get_world_size()
    problem = build(CASES["cnn"], sum(sizes), "mean", dtype=torch.float32)
    model = nn.parallel.DistributedDataParallel(problem.model)
    inputs, targets = local_part(problem.inputs, sizes), local_part(problem.targets, sizes)
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    outputs = model(inputs)
    loss = problem.loss_fn(outputs, targets)
    calls = []
    with counting_all_reduce(calls), cockpit(0, info=info_of(problem, outputs, targets, loss)):
        loss.backward()
    return len(calls)


def no_sync_steps():
    """Two micro-batches per optimizer step, the first inside no_sync(), each tracked."""
    problem = build(CASES["mlp"], sum(map(sum, NO_SYNC_SIZES)), "mean")
    model = nn.parallel.DistributedDataParallel(problem.model)
    names = problem.names
    quantities = all_quantities(names)[:2] + [
        cgn.ParamGradRatio(lambda step: step == 1, param_names=names),  # where DDP synchronizes
        cgn.GradientNoiseScale(linear(1), param_names=names),
    ]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    start = 0
    for step, sizes in enumerate(NO_SYNC_SIZES):
        batch = slice(start, start + sum(sizes))
        start += sum(sizes)
        inputs = local_part(problem.inputs[batch], sizes)
        targets = local_part(problem.targets[batch], sizes)
        with model.no_sync() if step == 0 else contextlib.nullcontext():
            outputs = model(inputs)
            loss = problem.loss_fn(outputs, targets)
            with cockpit(step, info=info_of(problem, outputs, targets, loss)):
                loss.backward()
    return {"table": table(cockpit), "grads": [p.grad.clone() for p in problem.params]}


def minibatch_functions():
    """minibatch_gradient_stats and dataset_gradient of a DDP model, same batches everywhere."""
    case = CASES["cnn"]
    model = nn.parallel.DistributedDataParallel(make_model(case))
    batches = make_batches(case, MINIBATCHES, 4)
    stats, sds = cgn.minibatch_gradient_stats(model, batches, nn.CrossEntropyLoss(), return_sd=True)
    gradient = cgn.dataset_gradient(model, batches, nn.CrossEntropyLoss())
    return {"stats": stats, "sds": sds, "gradient": gradient}


def make_model(case):
    torch.manual_seed(0)
    return case.make().double()


def make_batches(case, count, size):
    torch.manual_seed(1)
    return [(case.inputs(size).double(), torch.randint(0, 3, (size,))) for _ in range(count)]


def errors_raised_together():
    """Messages of errors that concern one process only, as each process raised them."""
    messages = {}
    problem = build(CASES["mlp"], 8, "mean")
    model = nn.parallel.DistributedDataParallel(problem.model)
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    inputs, targets = local_part(problem.inputs, (4, 4)), local_part(problem.targets, (4, 4))
    for name, step in (("mixed_reductions", 0), ("one_process_fails", 1)):
        problem.model.zero_grad()
        outputs = model(inputs)
        loss = problem.loss_fn(outputs, targets)
        info = info_of(problem, outputs, targets, loss)
        if dist.get_rank() == 1 and name == "mixed_reductions":
            info["loss"] = info["individual_losses"].sum()
        if dist.get_rank() == 1 and name == "one_process_fails":
            del info["individual_losses"]
        try:
            with cockpit(step, info=info):
                loss.backward()
            messages[name] = None
        except Exception as error:  # recorded: the test checks the messages
            messages[name] = f"{type(error).__name__}: {error}"
    messages["partly_used"] = partly_used_parameter_message()
    return messages


def skipped_call():
    """Rank 1 skips the tracked call of step 2 (DDP pairs its step 3 with rank 0's step 2).

    Returns each process's error (None if none) and the steps its cockpit recorded.
    """
    problem = build(CASES["mlp"], 8, "mean")
    model = nn.parallel.DistributedDataParallel(problem.model)
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    inputs, targets = local_part(problem.inputs, (4, 4)), local_part(problem.targets, (4, 4))
    error = None
    for step in (0, 1, 2) if dist.get_rank() == 0 else (0, 1, 3):
        problem.model.zero_grad()
        outputs = model(inputs)
        loss = problem.loss_fn(outputs, targets)
        try:
            with cockpit(step, info=info_of(problem, outputs, targets, loss)):
                loss.backward()
        except RuntimeError as exception:  # recorded: the test checks the messages
            error = str(exception)
            break
    return {"error": error, "steps": sorted(cockpit.get_output())}


class Branch(nn.Module):
    """A linear layer, plus a second one where ``use_extra`` is set."""

    def __init__(self):
        super().__init__()
        self.body, self.extra = nn.Linear(6, 3), nn.Linear(6, 3)
        self.use_extra = False

    def forward(self, x):
        return self.body(x) + self.extra(x) if self.use_extra else self.body(x)


def partly_used_parameter_message():
    """The error when a parameter is used on rank 1 only (find_unused_parameters=True)."""
    torch.manual_seed(0)
    model = extend(Branch().double())
    model.use_extra = dist.get_rank() == 1
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    names = [n for n, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(list(model.parameters()), quantities=all_quantities(names))
    inputs, targets = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    outputs = ddp(inputs)
    loss_fn = extend(nn.CrossEntropyLoss())
    loss = loss_fn(outputs, targets)
    info = {"batch_size": 4, "loss": loss,
            "individual_losses": nn.functional.cross_entropy(outputs, targets, reduction="none")}
    try:
        with cockpit(0, info=info):
            loss.backward()
    except ValueError as error:
        return str(error)
    return None


def fsdp_message():
    """The error at a tracked step of an FSDP-wrapped model (None if none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    problem = build(CASES["mlp"], 4, "mean")
    model = FullyShardedDataParallel(problem.model, device_id=torch.device("cpu"))
    params = list(model.parameters())
    cockpit = cgn.Cockpit(params, quantities=[cgn.ParamGradRatio(linear(1))])
    loss = problem.loss_fn(model(problem.inputs), problem.targets)
    try:
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    except TypeError as error:
        return str(error)
    return None


def train_ddp_quick(out):
    """What ``experiments/train_ddp.py --quick`` returned (the log path on rank 0 only)."""
    from experiments import train_ddp

    return train_ddp.main(["--quick", "--out", str(out)])


def resumed_ddp_run(out):
    """tests/resume_training.py's run under DDP (each process half of each batch), streamed:
    once whole, and once checkpointed after step 2 (rank 0's state, saved and loaded by every
    process), stopped after step 4 without closing (as if killed), restarted from the
    checkpoint (docs/training-setups.md, "Resuming a run"). Returns the files under ``out``
    this process opened while restarting."""
    from tests.resume_training import batch, network

    out.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(log, steps, state=None, stop=None):
        model, tracker = cgn.track(network(), every=1, log=log)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            tracker.load_state_dict(state["tracker"])
        for step in steps:
            x, y = (part.chunk(world)[rank] for part in batch(step))
            opt.zero_grad()
            with tracker(step, F.cross_entropy(ddp(x), y, reduction="none"), optimizer=opt) as loss:
                loss.backward()
            opt.step()
            if step == stop:
                saved = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "tracker": tracker.state_dict()}
                if rank == 0:
                    torch.save(saved, out / "ckpt.pt")
                dist.barrier()
        return tracker

    run(out / "whole", range(6)).close()
    run(out / "run", range(5), stop=2)  # not closed: no summary line, as a killed run's log
    opened, builtin_open = [], open

    def recording_open(file, *args, **kwargs):
        if str(out) in str(file):
            opened.append(str(file))
        return builtin_open(file, *args, **kwargs)

    import builtins

    builtins.open = recording_open
    try:
        state = torch.load(out / "ckpt.pt", weights_only=True)
        tracker = run(out / "run", range(3, 6), state=state)
        tracker.close()
    finally:
        builtins.open = builtin_open
    return {"opened": opened, "writer": tracker.stream.writer}


def loss_fails_on_rank_1():
    """The last job: rank 1's loss raises inside the cockpit; the group must end, not hang."""
    problem = build(CASES["mlp"], 8, "mean")
    model = nn.parallel.DistributedDataParallel(problem.model)
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    inputs, targets = local_part(problem.inputs, (4, 4)), local_part(problem.targets, (4, 4))
    outputs = model(inputs)
    info = info_of(problem, outputs, targets, problem.loss_fn(outputs, targets))

    def loss_fn(outputs, targets):
        if dist.get_rank() == 1:
            raise RuntimeError(LOSS_FAILURE)
        return problem.loss_fn(outputs, targets)

    with cockpit(0, info=info):
        loss_fn(outputs, targets).backward()


# The groups ----------------------------------------------------------------------


def run_once_per_world(tmp_path_factory, prefix, target=None):
    """``world -> (per-process results, error, folder)``: ``run_group(world, ..., target)`` run
    once per world size, when first needed (a module fixture's, in a folder ``prefix<world>``)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_group(world, tmp_path_factory.mktemp(f"{prefix}{world}"), target)
        return cache[world]

    return get


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "world")


def results_of(groups, world, key):
    results, error, _ = groups(world)
    missing = [r for r in range(world) if r >= len(results) or key not in results[r]]
    assert not missing, f"processes {missing} have no results for {key!r}: {error}"
    return [result[key] for result in results]


# References: one process ----------------------------------------------------------


def reference_steps(config, steps=2):
    """Tables of the per-example quantities on the concatenated batch and of ParamGradRatio and
    UpdateSize with DDP's gradient, over the same two optimizer steps."""
    problem = build(CASES[config.model], sum(config.sizes), config.reduction)
    names, params = problem.names, problem.params
    per_example = cgn.Cockpit(params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in PER_EXAMPLE
    ])
    from_grad = cgn.Cockpit(params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in FROM_GRAD
    ])
    optimizer = torch.optim.SGD(params, lr=LR)
    for step in range(steps):
        problem.model.zero_grad()
        outputs = problem.model(problem.inputs)
        loss = problem.loss_fn(outputs, problem.targets)
        with per_example(step, info=info_of(problem, outputs, problem.targets, loss)):
            loss.backward()
        problem.model.zero_grad()
        ddp_loss = ddp_mean_loss(problem, config.sizes)
        with from_grad(step, info={"loss": ddp_loss}):
            ddp_loss.backward()
        optimizer.step()
    return {**table(per_example), **table(from_grad)}


def ddp_mean_loss(problem, sizes):
    """``mean_r loss_r``: the loss whose gradient DDP leaves in ``param.grad``."""
    losses, start = [], 0
    for size in sizes:
        part = slice(start, start + size)
        start += size
        losses.append(problem.loss_fn(problem.model(problem.inputs[part]), problem.targets[part]))
    return torch.stack(losses).mean()


def assert_tables_match(got, expected, rtol=RTOL):
    """Same keys (coverage statistics aside), values equal to ``rtol`` (``inf == inf``)."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rtol, abs=0), key


def agreed_table(results) -> dict:
    """Rank 0's ``"table"`` of ``results`` (one per process), checked equal on every process."""
    tables = [result["table"] for result in results]
    assert_identical(tables)
    return tables[0]


def assert_identical(tables):
    """Every process's table equal to rank 0's, bit for bit (NaN equal to NaN)."""
    for rank, other in enumerate(tables[1:], start=1):
        assert other.keys() == tables[0].keys(), rank
        different = [
            key for key, value in tables[0].items()
            if not (other[key] == value or math.isnan(value) and math.isnan(other[key]))
        ]
        assert not different, (rank, different[:5])


# Tests ------------------------------------------------------------------------------

MATRIX = [(world, config) for world, configs_ in CONFIGS.items() for config in configs_]


@pytest.mark.parametrize("world, config", MATRIX, ids=[f"W{w}-{c.id}" for w, c in MATRIX])
def test_every_statistic_equals_one_process_on_the_concatenated_batch(groups, world, config):
    got = agreed_table(results_of(groups, world, config.id))
    expected = reference_steps(config)
    assert {key[1] for key in expected} == set(PER_EXAMPLE + FROM_GRAD)
    assert_tables_match(got, expected)


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_one_header_and_one_all_reduce_per_dtype_per_tracked_step(groups, world):
    """Three reducing quantities over every parameter: a header and one call for float64
    sums; a float32 model adds one for its float32 sums."""
    for config in CONFIGS[world]:
        for result in results_of(groups, world, config.id):
            assert result["all_reduce_calls"] == 2, config.id
    assert results_of(groups, world, "float32") == [3] * world


def test_micro_batches_under_no_sync_are_each_the_global_micro_batch(groups):
    """Per-example quantities: each tracked micro-batch, all processes' examples of it.
    ParamGradRatio, tracked at the synchronizing micro-batch: the accumulated DDP gradient."""
    results = results_of(groups, 2, "no_sync")
    assert_identical([result["table"] for result in results])
    for grad_0, grad_1 in zip(*(result["grads"] for result in results)):
        assert torch.equal(grad_0, grad_1)
    problem = build(CASES["mlp"], sum(map(sum, NO_SYNC_SIZES)), "mean")
    names = problem.names
    per_example = cgn.Cockpit(problem.params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in PER_EXAMPLE
    ])
    inputs, targets, start = problem.inputs, problem.targets, 0
    accumulated = []
    for step, sizes in enumerate(NO_SYNC_SIZES):
        batch = slice(start, start + sum(sizes))
        start += sum(sizes)
        problem.model.zero_grad()
        outputs = problem.model(inputs[batch])
        loss = problem.loss_fn(outputs, targets[batch])
        with per_example(step, info=info_of(problem, outputs, targets[batch], loss)):
            loss.backward()
        micro = dataclasses.replace(problem, inputs=inputs[batch], targets=targets[batch])
        accumulated.append(ddp_mean_loss(micro, sizes))
    problem.model.zero_grad()
    ratio = cgn.Cockpit(problem.params, quantities=[cgn.ParamGradRatio(linear(1), param_names=names)])
    total = torch.stack(accumulated).sum()
    with ratio(1, info={"loss": total}):
        total.backward()
    assert_tables_match(results[0]["table"], {**table(per_example), **table(ratio)})


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_minibatch_functions_take_shares_and_equal_one_process(groups, world):
    results = results_of(groups, world, "minibatch")
    case = CASES["cnn"]
    batches = make_batches(case, MINIBATCHES, 4)
    stats, sds = cgn.minibatch_gradient_stats(
        make_model(case), batches, nn.CrossEntropyLoss(), return_sd=True
    )
    gradient = cgn.dataset_gradient(make_model(case), batches, nn.CrossEntropyLoss())
    for result in results:
        for name, row in stats.items():
            assert result["stats"][name] == pytest.approx(row, rel=RTOL), name
        for name in sds:
            torch.testing.assert_close(result["sds"][name], sds[name], rtol=RTOL, atol=0)
            torch.testing.assert_close(result["gradient"][name], gradient[name], rtol=RTOL, atol=0)


def test_a_mixed_loss_reduction_or_one_failing_process_raises_on_every_process(groups):
    messages = results_of(groups, 2, "errors")
    for rank in (0, 1):
        assert "a mean on some processes and a sum on others" in messages[rank]["mixed_reductions"]
    assert messages[1]["one_process_fails"].startswith("KeyError: \"GradientVarianceQuantiles needs")
    assert messages[0]["one_process_fails"].startswith(
        "RuntimeError: cockpit_gradnoise: process(es) [1] failed"
    )
    for rank in (0, 1):
        assert "extra.weight" in messages[rank]["partly_used"], messages[rank]["partly_used"]
        assert "on some processes only" in messages[rank]["partly_used"]


def test_a_process_that_skipped_a_tracked_call_makes_every_process_raise_naming_both_steps(groups):
    results = results_of(groups, 2, "skipped_call")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"process {rank} paired steps 2 and 3 without an error"
        assert "process 0 at step 2, process 1 at step 3" in result["error"]
        assert "skip a tracked call" in result["error"]
        assert result["steps"] == [0, 1]  # nothing recorded from mixed steps


def test_two_batch_noise_scale_under_no_sync_equals_the_formula_on_all_micro_batches(groups):
    test_two_batch.check_two_processes(results_of(groups, 2, "two_batch"))


def test_fsdp_fails_clearly(groups):
    messages = results_of(groups, 2, "fsdp")
    for message in messages:
        assert message is not None and "FullyShardedDataParallel" in message
        assert "Supported: one process, or torch.nn.parallel.DistributedDataParallel" in message


def test_train_ddp_quick_writes_log_dashboard_and_report_on_rank_0_only(groups):
    logs = results_of(groups, 2, "train_ddp")
    _, _, folder = groups(2)
    out = folder / "train_ddp"
    assert logs == [out / "digits_ddp.json", None]
    assert sorted(p.name for p in out.iterdir()) == [
        "digits_ddp.json", "digits_ddp.png", "digits_ddp_report.txt"
    ]
    frame = cgn.to_frame(logs[0])
    assert set(frame.quantity) == set(PER_EXAMPLE + FROM_GRAD)
    assert set(frame[frame.quantity == "GradientNoiseScale"].query("statistic == 'batch_size'").value) == {32.0}
    assert cli.main(["report", str(logs[0])]) == 0


def test_only_the_writer_rank_writes_logs_and_figures(tmp_path, monkeypatch):
    """On another rank write_log and plot write nothing (unless told every rank writes)."""
    problem = build(CASES["mlp"], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    with cockpit(0, info=info_of(problem, outputs, problem.targets, loss)):
        loss.backward()
    monkeypatch.setattr(_ranks, "rank", lambda: 1)  # is_writer asks _ranks.rank
    assert cgn.write_log(cockpit, tmp_path / "log") is None
    cgn.plot(cockpit, savefig=tmp_path / "dash.png")
    assert list(tmp_path.iterdir()) == []
    assert cgn.write_log(cockpit, tmp_path / "log", writer_rank=1) == tmp_path / "log.json"
    cgn.plot(cockpit, savefig=tmp_path / "dash.png", writer_rank=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dash.png", "log.json"]


def test_a_ddp_run_restarted_from_its_checkpoint_logs_what_a_run_never_stopped_logs(groups):
    """Only rank 0 touches the log; the restarted run's log equals the whole run's exactly."""
    ranks = results_of(groups, 2, "resume")
    out = groups(2)[2] / "resume"
    assert [r["writer"] for r in ranks] == [True, False]
    assert not [path for path in ranks[1]["opened"] if "run.jsonl" in path]
    assert any(path.endswith("run.jsonl") for path in ranks[0]["opened"])
    expected = cgn.to_frame(out / "whole.jsonl")
    assert sorted(set(expected.step)) == list(range(6))
    pandas.testing.assert_frame_equal(cgn.to_frame(out / "run.jsonl"), expected, check_exact=True)
    superseded = cgn.read_log(out / "run.jsonl").superseded_records()
    assert {(step, q) for step, q, _ in superseded if q == "UpdateSize"} == {(2, "UpdateSize"),
                                                                           (3, "UpdateSize")}


def test_an_exception_in_one_process_ends_the_group_with_its_error(groups):
    _, error, _ = groups(2)
    assert error is not None and LOSS_FAILURE in error, error
    assert "hung" not in error


# Without a process group (in this process) -------------------------------------------


def pretend_two_processes(monkeypatch):
    """A world size of 2 without any process group: any collective would raise."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)


def test_param_grad_ratio_and_update_size_do_not_communicate(monkeypatch):
    """They read parameters and param.grad, the same on every process under DDP."""
    problem = build(CASES["mlp"], 4, "mean")
    names = problem.names
    quantities = [cgn.ParamGradRatio(linear(1), param_names=names),
                  cgn.UpdateSize(linear(1), param_names=names)]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    pretend_two_processes(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning about rank-local statistics
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for step in range(2):
            outputs = problem.model(problem.inputs)
            loss = problem.loss_fn(outputs, problem.targets)
            with cockpit(step, info={"loss": loss}):
                loss.backward()
    assert set(cgn.to_frame(cockpit).quantity) == set(FROM_GRAD)


class SignAgreement(cgn.ParameterQuantity):
    """Reads BackPACK's per-example gradients without declaring sums: rank-local under DDP."""

    from backpack.extensions import BatchGrad

    extension_classes = (BatchGrad,)

    def parameter_value(self, param, context):
        return (param.grad_batch * param.grad > 0).double().mean().item()

    def network_value(self, values):
        return sum(values) / len(values)

    def statistics(self, value):
        return {"agreement": value}

    def statistic_names(self):
        return ["agreement"]


def test_a_quantity_without_declared_sums_warns_that_it_is_rank_local(monkeypatch):
    problem = build(CASES["mlp"], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=[SignAgreement(linear(1))])
    pretend_two_processes(monkeypatch)
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    with pytest.warns(UserWarning, match="statistics are those of the local batch"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_sharded_parameters_and_models_are_refused_by_class_name():
    class FlatParameter(nn.Parameter):
        pass

    class FullyShardedDataParallel(nn.Module):
        pass

    with pytest.raises(TypeError, match="the class FlatParameter, from FSDP"):
        distributed.check_not_sharded([FlatParameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="the class FullyShardedDataParallel, from FSDP"):
        distributed.check_not_sharded([], FullyShardedDataParallel())
    flattened = nn.Parameter(torch.zeros(2))
    flattened._fsdp_flattened = True
    with pytest.raises(TypeError, match="flattened by FSDP"):
        distributed.check_not_sharded([flattened])
    distributed.check_not_sharded(nn.Linear(2, 2).parameters(), nn.Linear(2, 2))


def test_importing_the_package_loads_no_more_of_torch_distributed_than_torch():
    code = (
        "import sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "import cockpit_gradnoise as cgn\n"
        "cgn.GradientVarianceQuantiles, cgn.write_log, cgn.minibatch_gradient_stats\n"
        "from cockpit_gradnoise import distributed\n"
        "after = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "print(sorted(after - before))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.stdout.strip() == "[]"


def test_outside_distributed_training_every_helper_is_a_no_op():
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.is_writer() and distributed.is_writer(None)
    assert list(distributed.share(range(3))) == [0, 1, 2]
    assert distributed.gather_objects("x") == ["x"]
    tensor = torch.ones(2)
    distributed.all_reduce_([tensor])
    assert torch.equal(tensor, torch.ones(2))


def padded_cnn(padding, padding_mode):
    return nn.Sequential(
        nn.Conv2d(2, 3, (4, 3), padding=padding, padding_mode=padding_mode, dilation=(1, 2)),
        nn.Flatten(),
        nn.LazyLinear(3),
    )


PADDED = [
    ModelCase(f"conv-{padding}-{mode}", lambda p=padding, m=mode: padded_cnn(p, m),
              lambda n: torch.randn(n, 2, 6, 7))
    for padding, mode in (("same", "zeros"), ("valid", "zeros"), (2, "reflect"), ("same", "circular"))
]


@pytest.mark.parametrize("case", MODELS + PADDED, ids=lambda case: case.name)
def test_local_gradient_extension_is_the_gradient_of_the_backward_pass(case):
    """What distributed training reads instead of param.grad (which DDP averages)."""
    from cockpit_gradnoise.extensions import LOCAL_GRADIENT_SAVEFIELD, LocalGradient

    from backpack import backpack

    problem = build(case, 5, "mean")
    problem.model(problem.inputs)  # materialize lazy layers
    loss = problem.loss_fn(problem.model(problem.inputs), problem.targets)
    with backpack(LocalGradient()):
        loss.backward()
    compared = []
    for name, param in zip(problem.names, problem.params):
        if param.grad is not None and name != "unused.weight":
            local = getattr(param, LOCAL_GRADIENT_SAVEFIELD)
            torch.testing.assert_close(local, param.grad, rtol=1e-12, atol=1e-14)
            compared.append(name)
    assert compared, "no parameter had a gradient to compare"
