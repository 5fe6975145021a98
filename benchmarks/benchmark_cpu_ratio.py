"""CPU time of a tracked step against a plain step, side by side in one process.

For each model of ``benchmarks/models.py`` named, a plain step and a step with the
package's five quantities (``methods.package_all``) are timed alternately in CPU time of
one thread (``time.process_time``: on a shared machine, waiting for a core adds no time),
after ``--warmup`` untimed steps each (a Swin block proves its windows' map on its first
tracked step and compares both ways on the second: ``extensions/fallback/windows.py``).
Printed per model: the median CPU time of each, their ratio, and the spread of the ratios
of the rounds (each tracked step over the plain step of its round).

Run: ``PYTHONPATH=. python benchmarks/benchmark_cpu_ratio.py --models gpt,swin --rounds 15``
(``--batch-size 8``: another batch than the models' own, e.g. ``vgg11``'s 2).
With ``--phases``, also where the tracked step's time goes: its forward pass, backward pass
(the rules and blocks) and the quantities after it (``methods._phases``), each the median
over the rounds as a fraction of the plain step's median.
"""

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # as benchmarks/benchmark.py: the repository's `benchmarks`, ahead of Opacus'
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

import torch  # noqa: E402

from benchmarks.methods import package_all, plain_step  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402


def cpu_seconds(step, x, y) -> float:
    start = time.process_time()
    step(x, y)
    return time.process_time() - start


def plain_and_tracked(name: str, batch_size: int = 0):
    """``(plain step, step with the five quantities, inputs, targets)`` of model ``name`` on the CPU,
    at ``batch_size`` (0: the model's default)."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.make()
    device = torch.device("cpu")
    batch_size = batch_size or spec.batch_size
    x, y = spec.inputs(batch_size, device), spec.targets(batch_size, device)
    return plain_step(model, spec.loss), package_all(model, spec.loss), x, y


def measure(name: str, rounds: int, warmup: int, batch_size: int = 0):
    """``(plain times, tracked times, phases)`` of ``rounds`` alternating steps of model ``name``
    (``phases``: ``{"plain": ..., "tracked": ...}``, each step's ``methods._phases``)."""
    plain, tracked, x, y = plain_and_tracked(name, batch_size)
    for _ in range(warmup):
        plain(x, y)
        tracked(x, y)
    times = {"plain": [], "tracked": []}
    for phases in (plain.phases, tracked.phases):
        for kept in phases.values():
            kept.clear()
    for _ in range(rounds):
        times["plain"].append(cpu_seconds(plain, x, y))
        times["tracked"].append(cpu_seconds(tracked, x, y))
    return times["plain"], times["tracked"], {"plain": plain.phases, "tracked": tracked.phases}


def phases_row(name: str, plain, phases) -> str:
    """A row of ``--phases``'s table: each phase's median over the rounds / the plain step's."""
    unit = statistics.median(plain)
    cells = [statistics.median(phases[way][phase]) / unit
             for way, names in (("plain", ("forward", "backward")), ("tracked", ("forward", "backward", "quantities")))
             for phase in names]
    return f"| {name} | " + " | ".join(f"{cell:.2f}" for cell in cells) + " |"


def one_thread(argv, description: str, models: str):
    """The arguments ``--models`` (default ``models``), ``--rounds``, ``--warmup``; torch on
    one thread, and a first line that says so, with the machine's load."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", default=models)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--phases", action="store_true", help="also each phase's share (module docstring)")
    parser.add_argument("--batch-size", type=int, default=0, help="0: each model's default")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, CPU time, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    return args


def main(argv=None):
    args = one_thread(argv, __doc__.splitlines()[0], "gpt,swin")
    print("| model | plain ms | all five ms | all five / plain | per-round ratios (min, quartiles, max) |")
    print("|---|---:|---:|---:|---|")
    rows = []
    for name in args.models.split(","):
        plain, tracked, phases = measure(name, args.rounds, args.warmup, args.batch_size)
        rows.append(phases_row(name, plain, phases))
        ratios = sorted(t / p for p, t in zip(plain, tracked))
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3  # one round: itself
        print(f"| {name} | {1e3 * statistics.median(plain):.1f} | {1e3 * statistics.median(tracked):.1f} "
              f"| {statistics.median(tracked) / statistics.median(plain):.2f} | {ratios[0]:.2f}, "
              f"{quartiles[0]:.2f}, {quartiles[1]:.2f}, {quartiles[2]:.2f}, {ratios[-1]:.2f} |")
    if args.phases:
        print("\nPhases, medians as fractions of the plain step's median:\n")
        print("| model | plain forward | plain backward | tracked forward | tracked backward | quantities |")
        print("|---|---:|---:|---:|---:|---:|")
        print("\n".join(rows))
    print(f"load average {os.getloadavg()[0]:.2f} at the end; peak resident memory of the process "
          f"(both models, all steps) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
