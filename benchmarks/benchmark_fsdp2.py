"""What exact global-batch statistics cost under FSDP2, beside DDP.

Run with torchrun (gloo on CPUs; one thread per process):

    torchrun --standalone --nproc_per_node 2 benchmarks/benchmark_fsdp2.py

The MLP 784-512-512-10 in float32 at a global batch of ``--batch-size`` (split
evenly over the processes), ``fully_shard`` on every Linear and the root, in
interleaved rounds of:

- a plain FSDP2 step (forward, loss, backward with FSDP2's reduce-scatter);
- an FSDP2 step tracked by a Cockpit holding the four quantities exact under
  FSDP2, every step, and one holding each of them alone;
- the same model under DDP, plain, tracked by the same four quantities, and
  by GradientVarianceQuantiles alone.

Medians over the rounds, on rank 0, and the ratios tracked / plain. Each
process's peak resident memory (``ru_maxrss``) is printed once at the end: it
is a high-water mark of the whole run, not of one kind of step.
"""

import argparse
import copy
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from backpack import extend  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook is firing")
QUANTITIES = ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize")
# Alone, under FSDP2 and DDP: its sums sharded, quantiles by a distributed selection.
VARIANCE = "GradientVarianceQuantiles"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def cockpit_of(model, names):
    params = [p for p in model.parameters() if p.requires_grad]
    return cgn.Cockpit(params, quantities=[getattr(cgn, name)(linear(1)) for name in names])


def step_of(model, cockpit=None):
    loss_fn = extend(nn.CrossEntropyLoss())
    state = {"step": 0}

    def step(x, y):
        model.zero_grad(set_to_none=True)
        outputs = model(x)
        loss = loss_fn(outputs, y)
        if cockpit is None:
            loss.backward()
            return
        info = {"batch_size": len(y), "loss": loss,
                "individual_losses": nn.functional.cross_entropy(outputs, y, reduction="none")}
        with cockpit(state["step"], info=info):
            loss.backward()
        state["step"] += 1

    return step


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    base = cgn.prepare_model(mlp())
    sharded = copy.deepcopy(base)
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    replicated = copy.deepcopy(base)
    ddp = DistributedDataParallel(replicated)
    steps = {
        "fsdp2 plain": step_of(sharded),
        "fsdp2 tracked (4)": step_of(sharded, cockpit_of(sharded, QUANTITIES)),
        **{f"fsdp2 {name}": step_of(sharded, cockpit_of(sharded, [name])) for name in QUANTITIES},
        "ddp plain": step_of(ddp),
        "ddp tracked (4)": step_of(ddp, cockpit_of(replicated, QUANTITIES)),
        f"fsdp2 {VARIANCE}": step_of(sharded, cockpit_of(sharded, [VARIANCE])),
        f"ddp {VARIANCE}": step_of(ddp, cockpit_of(replicated, [VARIANCE])),
    }
    local = args.batch_size // world
    torch.manual_seed(1 + rank)
    x, y = torch.randn(local, 784), torch.randint(0, 10, (local,))
    times = {key: [] for key in steps}
    for _ in range(args.rounds):
        for key, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(values[1:]) for key, values in times.items()}
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        print(f"{world} processes, global batch {args.batch_size}, MLP 784-512-512-10 float32, "
              f"medians of {args.rounds - 1} rounds")
        for key, seconds in medians.items():
            plain = medians["ddp plain" if key.startswith("ddp") else "fsdp2 plain"]
            print(f"{key:28s} {seconds * 1e3:8.1f} ms  {seconds / plain:6.2f}x plain")
        print("peak RSS per process (MiB, whole run):", [round(float(p), 1) for p in peaks])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
