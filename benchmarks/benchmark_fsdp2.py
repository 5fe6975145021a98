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
  by GradientVarianceQuantiles alone;
- the front door on the model as users write it (built, ``fully_shard``, then
  ``cgn.track``): a bare FSDP2 step of a model never prepared, the same
  model's tracker attached but the step not tracked (step 0 tracked once
  before the rounds, then ``every`` far away),
  and the ``"norms"`` preset tracked every step.

Medians over the rounds, on rank 0, and the medians of each round's ratio
tracked / plain (the front door's rows / the bare step of the same round).

Memory (``--memory MODE``, one kind of step per process group, so that the
high-water mark is of that kind alone)::

    for mode in bare untracked four norms ddp_four variance variance_at_end ddp_variance \
            gns gns_at_end ddp_gns; do
        torchrun --standalone --nproc_per_node 2 benchmarks/benchmark_fsdp2.py --memory $mode --width 2048
    done

(``--depth D``: ``D`` hidden ``width x width`` layers instead of one; ``--replicas R``, also
for the timed rounds: HSDP, ``fully_shard`` on an ``R x (processes / R)`` replicate x shard
mesh; ``--tp T``, with ``--memory``: the
hidden layers split in pairs by ``ColwiseParallel`` and ``RowwiseParallel`` over ``T``
processes, then ``fully_shard`` on ``dp`` of a ``(processes / T) x T`` ``("dp", "tp")`` mesh,
or not sharded where ``T`` is every process; each ``dp`` group the same examples) prints, per
process, bytes in use by malloc (glibc's ``mallinfo2``, where
torch's CPU tensors live; memory freed but cached by malloc is not in it):
kept after 2 warm-up steps above what was in use before the first (the
gradients, the tracker's state, and the runtime's one-time allocations, the
same in every mode), the peak above that during 3 more steps (sampled by a
thread whenever the step releases the GIL, as every op does), and the bytes
of the parameters and gradients it holds (its shards under FSDP2, the full
tensors under DDP).
"""

import argparse
import contextlib
import copy
import ctypes
import resource
import statistics
import sys
import threading
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
# Alone, under FSDP2 and DDP: its local gradient reduce-scattered in the backward pass.
NOISE_SCALE = "GradientNoiseScale"
#: The front door's rows: the bare step first (their baseline).
FRONT_DOOR = ("fsdp2 bare (front door loop)", "fsdp2 tracker attached, untracked",
              "fsdp2 norms preset (cgn.track)", "fsdp2 TwoBatchNoiseScale alone")


def mlp(width=512, depth=1):
    """784-width-...-width-10: ``depth`` hidden layers of ``width x width``."""
    torch.manual_seed(0)
    hidden = [module for _ in range(depth) for module in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), *hidden, nn.Linear(width, 10))


def fully_sharded(model, mesh):
    """``fully_shard`` on every Linear and the root (in place)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def split_and_sharded(model, mesh):
    """The hidden ``width x width`` layers of :func:`mlp` split in pairs over ``mesh["tp"]``
    (``ColwiseParallel``, then ``RowwiseParallel``: Megatron's MLP), then ``fully_shard`` on
    every Linear and the root over ``mesh["dp"]`` where it has more than one process."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    hidden = [str(k) for k, layer in enumerate(model) if isinstance(layer, nn.Linear)][1:-1]
    parallelize_module(model, mesh["tp"], {name: ColwiseParallel() if j % 2 == 0 else RowwiseParallel()
                                           for j, name in enumerate(hidden)})
    return fully_sharded(model, mesh["dp"]) if mesh["dp"].size() > 1 else model


def front_step(model, tracker=None, first=1):
    """A step of the front door's loop: per-example losses, their mean, ``tracker``'s block
    around the backward pass (from step ``first``); with no tracker a bare step."""
    state = {"step": first}

    def step(x, y):
        model.zero_grad(set_to_none=True)
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with tracker(state["step"], losses) if tracker else contextlib.nullcontext(losses.mean()) as loss:
            loss.backward()
        state["step"] += 1

    return step


def cockpit_of(model, names):
    params = [p for p in model.parameters() if p.requires_grad]
    return cgn.Cockpit(params, quantities=[getattr(cgn, name)(linear(1)) for name in names])


def reduced_at_end_cockpit(model, name=VARIANCE):
    """A Cockpit of ``name`` whose sums are reduced whole after the backward pass."""
    cockpit = cockpit_of(model, [name])
    reduced_at_end(cockpit.quantities)
    return cockpit


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
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=1, help="hidden width x width layers (--memory)")
    parser.add_argument("--memory", choices=sorted(MEMORY_MODES))
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP on a replicas x (processes / replicas) mesh")
    parser.add_argument("--tp", type=int, default=1,
                        help="with --memory: the hidden layers split over tp processes (pairs Colwise, Rowwise)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if args.tp > 1 and not args.memory:
        parser.error("--tp goes with --memory")
    if args.tp > 1 and (args.replicas > 1 or args.depth % 2):
        parser.error("--tp needs an even --depth (pairs of split layers) and no --replicas")
    mesh = init_device_mesh("cpu", (world,)) if args.replicas == 1 else init_device_mesh(
        "cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    if args.tp > 1:
        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    local = args.batch_size // (world // args.tp)
    torch.manual_seed(1 + rank // args.tp)  # the processes of a tp group: the same examples
    x, y = torch.randn(local, 784), torch.randint(0, 10, (local,))
    if args.memory:
        return memory(args, mesh, x, y)
    base = cgn.prepare_model(mlp(args.width))
    sharded = fully_sharded(copy.deepcopy(base), mesh)
    replicated = copy.deepcopy(base)
    ddp = DistributedDataParallel(replicated)
    bare = fully_sharded(mlp(args.width), mesh)
    attached, idle = cgn.track(fully_sharded(mlp(args.width), mesh), every=10**9, quantities="norms")
    front_step(attached, idle, first=0)(x, y)  # step 0 tracked: its hooks made, then steps 1, 2, ... not
    norms, norms_tracker = cgn.track(fully_sharded(mlp(args.width), mesh), every=1, quantities="norms")
    two_batch, two_batch_tracker = cgn.track(fully_sharded(mlp(args.width), mesh), every=1,
                                             quantities=["TwoBatchNoiseScale"])
    steps = {
        **dict(zip(FRONT_DOOR, [front_step(bare), front_step(attached, idle), front_step(norms, norms_tracker),
                                front_step(two_batch, two_batch_tracker)])),
        "fsdp2 plain": step_of(sharded),
        "fsdp2 tracked (4)": step_of(sharded, cockpit_of(sharded, QUANTITIES)),
        **{f"fsdp2 {name}": step_of(sharded, cockpit_of(sharded, [name])) for name in QUANTITIES},
        "ddp plain": step_of(ddp),
        "ddp tracked (4)": step_of(ddp, cockpit_of(replicated, QUANTITIES)),
        f"fsdp2 {VARIANCE}": step_of(sharded, cockpit_of(sharded, [VARIANCE])),
        f"fsdp2 {VARIANCE}, sums at the end": step_of(sharded, reduced_at_end_cockpit(sharded)),
        f"ddp {VARIANCE}": step_of(ddp, cockpit_of(replicated, [VARIANCE])),
        f"fsdp2 {NOISE_SCALE}, gradient at the end": step_of(sharded, reduced_at_end_cockpit(sharded, NOISE_SCALE)),
    }
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
        layout = "" if args.replicas == 1 else f" (HSDP: {args.replicas} x {world // args.replicas})"
        print(f"{world} processes{layout}, global batch {args.batch_size}, MLP 784-{args.width}-{args.width}-10 "
              f"float32, medians of {args.rounds - 1} rounds")
        for key, seconds in medians.items():
            plain = times["ddp plain" if key.startswith("ddp") else FRONT_DOOR[0] if key in FRONT_DOOR
                          else "fsdp2 plain"]
            # Paired: each round's ratio to its own plain step (drifts of a shared machine cancel).
            ratio = statistics.median(t / p for t, p in zip(times[key][1:], plain[1:]))
            print(f"{key:36s} {seconds * 1e3:8.1f} ms  {ratio:6.3f}x plain")
        print("peak RSS per process (MiB, whole run):", [round(float(p), 1) for p in peaks])
    dist.destroy_process_group()


MEMORY_MODES = {
    "bare": "FSDP2, not prepared, not tracked",
    "untracked": "FSDP2, cgn.track after fully_shard, steps not tracked",
    "four": "FSDP2, cgn.track after fully_shard, the four exact quantities every step",
    "norms": "FSDP2, cgn.track after fully_shard, the norms preset every step",
    "ddp_four": "DDP (the unsharded model), cgn.track, the four quantities every step",
    "variance": "FSDP2, cgn.track after fully_shard, GradientVarianceQuantiles every step",
    "variance_at_end": "the same, its sums reduced whole after the backward pass",
    "ddp_variance": "DDP (the unsharded model), cgn.track, GradientVarianceQuantiles every step",
    "gns": "FSDP2, cgn.track after fully_shard, GradientNoiseScale every step",
    "gns_at_end": "the same, its local gradient reduced whole after the backward pass",
    "ddp_gns": "DDP (the unsharded model), cgn.track, GradientNoiseScale every step",
}


def reduced_at_end(quantities):
    """``quantities`` with their per-element sums (GradientNoiseScale: its local gradient)
    reduced whole after the backward pass, as before they were reduce-scattered inside it (an
    instance attribute: this cockpit's)."""
    for quantity in quantities:
        if getattr(quantity, "sums_sharded_in_backward", None):
            quantity.sums_sharded_in_backward = None
    return quantities


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def malloc_in_use() -> int:
    """Bytes malloc has handed out and not got back (glibc's ``mallinfo2``: heap chunks in use
    and mmapped blocks), where torch's CPU tensors live; freed memory kept by malloc is not in it."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakSampler(threading.Thread):
    """The highest :func:`malloc_in_use` seen while it runs (sampled whenever the step
    releases the GIL: every op does; a tensor held for less than one op can be missed)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = malloc_in_use(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, malloc_in_use())
            time.sleep(0)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, malloc_in_use())


def memory(args, mesh, x, y):
    """One kind of step, 3 times: the growth of this process's peak resident memory."""
    mode, model = args.memory, mlp(args.width, args.depth)
    if mode.startswith("ddp_"):
        alone = {"ddp_variance": [VARIANCE], "ddp_gns": [NOISE_SCALE]}
        model, tracker = cgn.track(model, every=1, quantities=alone.get(mode, list(QUANTITIES)))
        model = DistributedDataParallel(model)
    else:
        model = fully_sharded(model, mesh) if args.tp == 1 else split_and_sharded(model, mesh)
        tracker = None
        if mode != "bare":
            quantities = {"untracked": "norms", "four": list(QUANTITIES), "norms": "norms",
                          "variance": [VARIANCE], "variance_at_end": [VARIANCE],
                          "gns": [NOISE_SCALE], "gns_at_end": [NOISE_SCALE]}[mode]
            model, tracker = cgn.track(model, every=10**9 if mode == "untracked" else 1,
                                       quantities=quantities)
            if mode.endswith("_at_end"):
                reduced_at_end(tracker.cockpit.quantities)
    step = front_step(model, tracker)
    before = malloc_in_use()
    for _ in range(2):  # warm-up: the runtime's one-time allocations, the kept state
        step(x, y)
    steady = malloc_in_use()
    sampler = PeakSampler()
    sampler.start()
    for _ in range(3):
        step(x, y)
    peak = sampler.stop()
    held = sum(sharded_bytes(p) + (0 if p.grad is None else sharded_bytes(p.grad)) for p in model.parameters())
    row = torch.tensor([steady - before, peak - steady, held], dtype=torch.float64) / 2**20
    rows = [torch.zeros(3, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        print(f"{mode:9s} ({MEMORY_MODES[mode]}), MiB per process: kept after 2 steps "
              f"{[round(float(r[0]), 1) for r in rows]}, peak above that over 3 more "
              f"{[round(float(r[1]), 1) for r in rows]}, parameters and gradients held "
              f"{[round(float(r[2]), 1) for r in rows]}")
    dist.destroy_process_group()


def sharded_bytes(tensor) -> int:
    """Bytes of this process's part of ``tensor`` (its shard for a DTensor)."""
    local = tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor
    return local.numel() * local.element_size()


if __name__ == "__main__":
    main()
