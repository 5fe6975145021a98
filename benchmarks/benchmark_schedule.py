"""What the adaptive batch schedule with the ``"norms"`` preset costs over a whole run (issue 34).

Two copies of the benchmark's GPT (``experiments.models.GPT``, 4 blocks of width
128, sequence 64, per-token loss; ``benchmarks.models.MODELS["gpt"]``) with the
same weights train side by side in one process, each with its own AdamW:

- **scheduled**: ``cgn.track(model, every=1, quantities="norms")`` and a
  :class:`cgn.BatchSchedule` (``micro_batch`` examples per micro-batch, from
  two micro-batches, ``schedule.update`` after each ``optimizer.step()``): the
  loop of ``docs/advice.md``, "An adaptive batch schedule";
- **plain**: the model as written, no tracker, stepping with the **same number
  of micro-batches** as the scheduled run at each step (its ``losses.mean() / K``
  differentiated, as the tracker's), so the two do the same arithmetic but
  for what tracking and the schedule add.

At each optimizer step both take that step on the same micro-batches, in an
order drawn afresh (seeded), so that drifts of the machine hit both alike.
Reported: **whole run / plain**, the scheduled run's total time over the plain
copy's over all measured steps (the figure issue 34 asks to keep within 1.05),
the median over rounds of ten steps of the same ratio (quartiles), and the
schedule's batches. Clock: as ``benchmark_untracked`` (CPU time of the process
by default on CPU, meant with ``--threads 1``; on CUDA, synchronized wall
clock). ::

    python -m benchmarks.benchmark_schedule --steps 60 --threads 1
    python -m benchmarks.benchmark_schedule --device cuda --steps 200
"""

import argparse
import copy
import os
import random
import statistics
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.models import MODELS, model_and_batch  # noqa: E402

ROUND = 10  # steps per round of the median


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Copy:
    """One model and its optimizer; ``step(k, K, batches)`` is optimizer step ``k`` of ``K`` micro-batches."""

    def __init__(self, model, scheduled: bool, args):
        self.loss = MODELS["gpt"].loss("none")
        self.tracker = self.schedule = None
        if scheduled:
            model, self.tracker = cgn.track(model, every=1, quantities="norms")
            self.schedule = cgn.BatchSchedule(args.micro_batch, 2 * args.micro_batch, args.max_batch,
                                              patience=args.patience)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step(self, k, micro_batches):
        self.optimizer.zero_grad(set_to_none=True)
        K = len(micro_batches)
        for index, (x, y) in enumerate(micro_batches):
            losses = self.loss(self.model(x), y)
            if self.tracker is None:
                (losses.mean() / K).backward()
            else:
                with self.tracker(k, losses, optimizer=self.optimizer, micro_batch=index,
                                  micro_batches=K) as loss:
                    loss.backward()
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.update(k, self.tracker, self.optimizer)

    def timed(self, k, micro_batches, device, clock) -> float:
        _sync(device)
        start = clock()
        self.step(k, micro_batches)
        _sync(device)
        return clock() - start


def measure(args, device):
    """``{"whole run", "rounds", "quartiles", "batches", "changes", "plain s"}``."""
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    spec = MODELS["gpt"]
    model, _, _ = model_and_batch(spec, 1, device)
    plain, scheduled = Copy(copy.deepcopy(model), False, args), Copy(model, True, args)
    order = random.Random(0)
    totals, rounds, batches = [0.0, 0.0], [], []
    round_totals = [0.0, 0.0]
    for k in range(args.warmup + args.steps):
        K = scheduled.schedule.accumulation  # the plain copy follows the schedule's batches
        micro_batches = [(spec.inputs(args.micro_batch, device), spec.targets(args.micro_batch, device))
                         for _ in range(K)]
        pair = [plain, scheduled]
        order.shuffle(pair)
        times = {id(c): c.timed(k, micro_batches, device, clock) for c in pair}
        if k < args.warmup:
            continue
        batches.append(K * args.micro_batch)
        for i, c in enumerate((plain, scheduled)):
            totals[i] += times[id(c)]
            round_totals[i] += times[id(c)]
        if (k - args.warmup) % ROUND == ROUND - 1:
            rounds.append(round_totals[1] / round_totals[0])
            round_totals = [0.0, 0.0]
    return {
        "whole run": totals[1] / totals[0],
        "rounds": statistics.median(rounds),
        "quartiles": statistics.quantiles(rounds, n=4)[::2] if len(rounds) > 1 else rounds * 2,
        "batches": batches,
        "changes": [c["reason"] for c in scheduled.schedule.changes],
        "plain s": totals[0],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps measured")
    parser.add_argument("--warmup", type=int, default=3, help="steps before (not measured)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} "
          f"clock, {args.steps} steps after {args.warmup}, micro-batch {args.micro_batch}, load "
          f"average {os.getloadavg()[0]:.2f} at the start", flush=True)
    result = measure(args, device)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for line in result.pop("changes"):
        print(line)
    batches = result.pop("batches")
    print(f"batches: {batches[0]} to {batches[-1]}, {sum(batches)} examples in {len(batches)} steps")
    q = result["quartiles"]
    print(f"whole run, norms + schedule / plain at the same batches: **{result['whole run']:.3f}** "
          f"(rounds of {ROUND}: median {result['rounds']:.3f}, quartiles {q[0]:.3f}-{q[1]:.3f}; "
          f"plain {result['plain s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
