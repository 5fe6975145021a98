"""What each process of ``tests/test_distributed.py``'s DDP groups runs: the jobs, and the
configurations the tests compare them over.

:func:`worker` runs every job of a group of 2 or 3 processes in one launch
(:func:`tests.process_groups.run_group`), saving each process's results after each job.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

# The forkserver preloads the worker's module (this one): what the jobs would import lazily
# (the log's frame, the report, the collectives) is imported here once, as the test module's
# own imports did when the worker lived there, so spawned processes skip it.
from cockpit_gradnoise import cli, distributed  # noqa: F401

import pandas  # noqa: F401
import torch
import torch.distributed as dist
import torch.nn.functional as F
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests import test_two_batch
from tests.cases import MODELS, build
from tests.process_groups import join_group

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


def worker(rank, world, port, out):
    """Every job of a group of ``world`` processes in order, saving this process's results
    after each; with 2 processes, last, a loss that fails on rank 1 (the group must end)."""
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
            try:
                loss_fails_on_rank_1()
            except Exception as error:  # written before the group closes (run_group reads it):
                # the other process, cut off, may exit first and be the one torch reports
                (out / f"rank{rank}.error").write_text(f"{type(error).__name__}: {error}")
                raise
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


