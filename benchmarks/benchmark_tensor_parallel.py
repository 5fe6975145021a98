"""What exact statistics cost under tensor parallelism, beside DDP.

Run with torchrun (gloo on CPUs; one thread per process):

    torchrun --standalone --nproc_per_node 2 benchmarks/benchmark_tensor_parallel.py

benchmark_fsdp2's MLP 784-512-512-10 in float32, prepared, then split by
``parallelize_module`` on a 1-D ``tp`` mesh of every process: the first
Linear by ``ColwiseParallel``, the second by ``RowwiseParallel``, the last
plain. Every process runs the whole batch of ``--batch-size`` examples (tensor
parallelism splits the layers, not the batch); under DDP the same model runs
the same batch split evenly over the processes. Interleaved rounds of:

- a plain step (forward, loss, backward) under tensor parallelism and under DDP;
- the same step tracked every step by a Cockpit holding the five quantities
  exact under both (GradientNoiseScale, PerExampleGradNorm, ParamGradRatio,
  UpdateSize, GradientVarianceQuantiles), and one holding each alone.

Medians over the rounds, on rank 0, and the medians of each round's ratio
tracked / plain of the same parallelism.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.benchmark_fsdp2 import QUANTITIES, VARIANCE, cockpit_of, mlp, step_of  # noqa: E402

FIVE = (*QUANTITIES, VARIANCE)


def split(model, mesh):
    """``ColwiseParallel`` on the first Linear, ``RowwiseParallel`` on the second (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(1)  # the same batch on every process (tensor parallelism)
    x, y = torch.randn(args.batch_size, 784), torch.randint(0, 10, (args.batch_size,))
    share = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    base = cgn.prepare_model(mlp(args.width))
    tp = split(copy.deepcopy(base), mesh)
    replicated = copy.deepcopy(base)
    ddp = DistributedDataParallel(replicated)
    steps = {
        "tp plain": (step_of(tp), slice(None)),
        "tp tracked (5)": (step_of(tp, cockpit_of(tp, FIVE)), slice(None)),
        **{f"tp {name}": (step_of(tp, cockpit_of(tp, [name])), slice(None)) for name in FIVE},
        "ddp plain": (step_of(ddp), share),
        "ddp tracked (5)": (step_of(ddp, cockpit_of(replicated, FIVE)), share),
    }
    times = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, (step, part) in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step(x[part], y[part])
            times[key].append(time.perf_counter() - start)
    if rank == 0:
        print(f"{world} processes, batch {args.batch_size} (tp: on every process; ddp: split), "
              f"MLP 784-{args.width}-{args.width}-10 float32, medians of {args.rounds - 1} rounds")
        for key, values in times.items():
            plain = times["ddp plain" if key.startswith("ddp") else "tp plain"]
            # Paired: each round's ratio to its own plain step (drifts of a shared machine cancel).
            ratio = statistics.median(t / p for t, p in zip(values[1:], plain[1:]))
            print(f"{key:36s} {statistics.median(values[1:]) * 1e3:8.1f} ms  {ratio:6.3f}x plain")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
