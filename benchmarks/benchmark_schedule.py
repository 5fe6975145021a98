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
  for what tracking and the schedule add;
- **norms**: tracked as the scheduled copy, without a schedule, at the same
  batches: what the ``"norms"`` preset (``TwoBatchNoiseScale``'s hooks) costs
  by itself;
- with ``--parts``, a copy per quantity of the preset, tracked alone
  (``TwoBatchNoiseScale``, ``ParamGradRatio``, ``UpdateSize``): where the
  preset's time goes.

At each optimizer step the copies take that step on the same micro-batches, in
an order drawn afresh (seeded), so that drifts of the machine hit all alike.
Reported: **whole run / plain**, the scheduled run's total time over the plain
copy's over all measured steps (the figure issue 34 asks to keep within 1.05),
the median over rounds of ten steps of the same ratio (quartiles), the same
for the norms copy (the schedule's own cost is the difference), and the
schedule's batches. Clock: as ``benchmark_untracked`` (CPU time of the process
by default on CPU, meant with ``--threads 1``; on CUDA, synchronized wall
clock). ::

    python -m benchmarks.benchmark_schedule --steps 60 --threads 1
    python -m benchmarks.benchmark_schedule --device cuda --steps 200
"""

import argparse
import copy
import math
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
#: The "norms" preset's quantities, each tracked alone by a copy of its own with --parts.
PARTS = ("TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Copy:
    """One model and its optimizer; ``step(k, K, batches)`` is optimizer step ``k`` of ``K`` micro-batches."""

    def __init__(self, model, kind: str, args):
        self.loss = MODELS["gpt"].loss("none")
        self.tracker = self.schedule = None
        if kind != "plain":  # "scheduled", "norms", or one quantity of the preset (--parts)
            preset = "norms" if kind in ("scheduled", "norms") else [kind]
            model, self.tracker = cgn.track(model, every=1, quantities=preset)
        if kind == "scheduled":
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
    """``{"whole run", "rounds", "quartiles", "norms", "batches", "changes", "plain s"}``."""
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    spec = MODELS["gpt"]
    model, _, _ = model_and_batch(spec, 1, device)
    kinds = ("plain", "scheduled", "norms") + (PARTS if args.parts else ())
    copies = {kind: Copy(copy.deepcopy(model), kind, args) for kind in kinds}
    scheduled = copies["scheduled"]
    order = random.Random(0)
    totals, rounds, batches = dict.fromkeys(kinds, 0.0), {"scheduled": [], "norms": []}, []
    round_totals = dict.fromkeys(kinds, 0.0)
    for k in range(args.warmup + args.steps):
        K = scheduled.schedule.accumulation  # the plain copy follows the schedule's batches
        micro_batches = [(spec.inputs(args.micro_batch, device), spec.targets(args.micro_batch, device))
                         for _ in range(K)]
        shuffled = list(kinds)
        order.shuffle(shuffled)
        times = {kind: copies[kind].timed(k, micro_batches, device, clock) for kind in shuffled}
        if k < args.warmup:
            continue
        batches.append(K * args.micro_batch)
        for kind in kinds:
            totals[kind] += times[kind]
            round_totals[kind] += times[kind]
        if (k - args.warmup) % ROUND == ROUND - 1:
            for kind in rounds:
                rounds[kind].append(round_totals[kind] / round_totals["plain"])
            round_totals = dict.fromkeys(kinds, 0.0)
    ratios = rounds["scheduled"]
    return {
        "whole run": totals["scheduled"] / totals["plain"],
        "rounds": statistics.median(ratios) if ratios else math.nan,
        "quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios or [math.nan]) * 2,
        "norms": totals["norms"] / totals["plain"],
        "parts": {kind: totals[kind] / totals["plain"] for kind in kinds if kind in PARTS},
        "batches": batches,
        "changes": [c["reason"] for c in scheduled.schedule.changes],
        "plain s": totals["plain"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind, default, meaning in (
            ("steps", int, 60, "optimizer steps measured"), ("warmup", int, 3, "steps before, not measured"),
            ("micro-batch", int, 8, "examples per micro-batch"), ("max-batch", int, 128, "the schedule's"),
            ("patience", int, 5, "the schedule's"), ("lr", float, 1e-3, "AdamW's"),
            ("threads", int, 0, "torch threads (0: torch's default)"), ("device", str, "cpu", "")):
        parser.add_argument(f"--{name}", type=kind, default=default, help=meaning)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--parts", action="store_true",
                        help="also a copy per quantity of the preset, tracked alone: what each costs")
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
          f"plain {result['plain s']:.1f} s); norms alone at the same batches / plain: "
          f"{result['norms']:.3f}")
    if result["parts"]:
        print("each alone at the same batches / plain: " + ", ".join(
            f"{kind} {ratio:.3f}" for kind, ratio in result["parts"].items()))
    return result


if __name__ == "__main__":
    main()
