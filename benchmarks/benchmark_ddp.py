"""What exact global-batch statistics cost under DistributedDataParallel.

Run with torchrun (gloo on CPUs; one thread per process):

    torchrun --standalone --nproc_per_node 2 benchmarks/benchmark_ddp.py

For the models of ``benchmark.py`` (MLP 784-512-512-10, CNN) at a global batch
of ``--batch-size`` (split evenly over the processes), interleaved rounds of:

- a plain DDP step (forward, loss, backward with DDP's gradient all-reduce);
- a DDP step tracked by a Cockpit holding all five quantities, every step;

and, inside the tracked step, the time spent in
``cockpit_gradnoise.distributed.reduce_step`` (packing the sums, the header
and payload all-reduces, unpacking; timed after a barrier, so without waiting
for a slower process) and the bytes it all-reduces. Separately,
on each process's local batch without DDP, the marginal cost of the
``LocalGradient`` extension that distributed training adds (a backward with
the other quantities' extensions, with and without it). Medians over the
rounds, on rank 0; every process does the same work.
"""

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

# This repository's package and benchmarks, also when run as a script by torchrun.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)
from cockpit_gradnoise import distributed  # noqa: E402
from cockpit_gradnoise.extensions import (  # noqa: E402
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
)
from cockpit_gradnoise.logs.schema import QUANTITIES  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from backpack import backpack, extend  # noqa: E402
from backpack.core.derivatives.convnd import weight_jac_t_save_memory  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.models import MODELS  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook is firing")


class ReductionTimer:
    """Wraps ``distributed.reduce_step``: seconds and payload bytes of each call."""

    def __init__(self):
        self.seconds, self.bytes = [], []
        self.original = distributed.reduce_step

    def __call__(self, contribution, *args, **kwargs):
        # Timed from when every process is there: waiting for a slower process's
        # local computation is not the reduction's cost.
        dist.barrier()
        start = time.perf_counter()
        result = self.original(contribution, *args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.bytes.append(sum(v.numel() * v.element_size() for v, _ in contribution.sums))
        return result


def plain_ddp_step(model):
    ddp = DistributedDataParallel(copy.deepcopy(model))

    def step(x, y):
        ddp.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()

    return step


def tracked_ddp_step(model):
    inner = extend(copy.deepcopy(model))
    ddp = DistributedDataParallel(inner)
    loss_fn = extend(nn.CrossEntropyLoss())
    names = [n for n, _ in inner.named_parameters()]
    quantities = [getattr(cgn, name)(linear(1), param_names=names) for name in QUANTITIES]
    cockpit = cgn.Cockpit(inner.parameters(), quantities=quantities)
    counter = iter(range(10**9))

    def step(x, y):
        global_step = next(counter)
        ddp.zero_grad(set_to_none=True)
        out = ddp(x)
        loss = loss_fn(out, y)
        info = {
            "batch_size": len(x),
            "individual_losses": nn.functional.cross_entropy(out.detach(), y, reduction="none"),
            "loss": loss,
        }
        with cockpit(global_step, info=info):
            loss.backward()

    return step


def local_backward(model, extensions):
    """A backward on this process's batch alone (no DDP) with BackPACK ``extensions``."""
    model = extend(copy.deepcopy(model))
    loss_fn = extend(nn.CrossEntropyLoss())
    params = list(model.parameters())

    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        with backpack(*[ext() for ext in extensions]), weight_jac_t_save_memory(True):
            loss.backward()
        for param in params:
            for ext in extensions:
                delattr(param, ext().savefield)

    return step


def timed(step, x, y):
    dist.barrier()  # start together: the step's all-reduce would wait for the slower one
    start = time.perf_counter()
    step(x, y)
    return time.perf_counter() - start


def benchmark_model(name, args):
    torch.manual_seed(0)
    model = MODELS[name].make()
    local = args.batch_size // dist.get_world_size()
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(local, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (local,), generator=generator)
    steps = {
        "plain": plain_ddp_step(model),
        "tracked": tracked_ddp_step(model),
        "extensions": local_backward(model, [PerExampleSquaredNorms, SumsOfContributions]),
        "with local gradient": local_backward(
            model, [PerExampleSquaredNorms, SumsOfContributions, LocalGradient]
        ),
    }
    timer = ReductionTimer()
    distributed.reduce_step = timer
    times = {key: [] for key in steps}
    try:
        for round_ in range(args.warmup + args.rounds):
            for key, step in steps.items():
                seconds = timed(step, x, y)
                if round_ >= args.warmup:
                    times[key].append(seconds)
    finally:
        distributed.reduce_step = timer.original
    median = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    reduction = statistics.median(timer.seconds[args.warmup:]) * 1e3
    return {
        "model": name,
        "plain": median["plain"],
        "tracked": median["tracked"],
        "reduction": reduction,
        "local gradient": median["with local gradient"] - median["extensions"],
        "payload MiB": timer.bytes[-1] / 2**20,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn", help="comma separated (default: mlp,cnn)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (default: 128)")
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (default: 21)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default: 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rows = [benchmark_model(name, args) for name in args.models.split(",")]
        rank, world = dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    print(f"global batch {args.batch_size} over {world} processes, gloo, 1 thread each, "
          f"torch {torch.__version__}, medians of {args.rounds} rounds (ms)\n")
    print("| model | plain DDP step | tracked DDP step | reduce_step | its share of the "
          "tracked step | LocalGradient extension | all-reduced sums |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['plain']:.2f} | {r['tracked']:.2f} | {r['reduction']:.2f} "
              f"| {r['reduction'] / r['tracked']:.0%} | {r['local gradient']:.2f} "
              f"| {r['payload MiB']:.2f} MiB |")


if __name__ == "__main__":
    main()
