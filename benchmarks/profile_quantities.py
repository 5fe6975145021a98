"""Each quantity's share of the quantities' phase, and its Python calls per trainable tensor (issue 32).

The models of ``benchmark_cpu_ratio.py`` (``benchmarks/models.py``) with the package's five
quantities, one thread: after ``--warmup`` tracked steps, ``--steps`` steps with a timer around each
quantity's ``track`` (CPU time, ``time.process_time``; the median step as a fraction of the plain
step's median, timed alternately), then as many steps under cProfile around each ``track``: its
Python function calls per step and per trainable tensor (deterministic: no timing). Run the
package under test and a ``git archive`` copy of another commit one after the other to compare. ::

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/profile_quantities.py --models swin,gpt
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # as benchmarks/benchmark.py: the repository's `benchmarks`, ahead of Opacus'
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

import torch  # noqa: E402

from benchmarks.benchmark_cpu_ratio import plain_and_tracked  # noqa: E402


def wrapped_tracks(quantities, enter, leave):
    """Each quantity's ``track`` wrapped: ``enter(name)`` before it, ``leave(name)`` after it."""
    for quantity in quantities:
        original, name = quantity.track, type(quantity).__name__

        def track(*args, _original=original, _name=name, **kwargs):
            enter(_name)
            try:
                return _original(*args, **kwargs)
            finally:
                leave(_name)

        quantity.track = track


def measure(name: str, steps: int, warmup: int):
    """``(plain step's median, {quantity: [CPU seconds per step]}, {quantity: calls per step},
    trainable tensors)`` of model ``name``."""
    plain, tracked, x, y = plain_and_tracked(name)
    cockpit = tracked.cockpit
    for _ in range(warmup):
        plain(x, y)
        tracked(x, y)
    times, started = {}, {}
    wrapped_tracks(cockpit.quantities, lambda q: started.__setitem__(q, time.process_time()),
                   lambda q: times.setdefault(q, []).append(time.process_time() - started[q]))
    plain_times = []
    for _ in range(steps):
        start = time.process_time()
        plain(x, y)
        plain_times.append(time.process_time() - start)
        tracked(x, y)
    profiles = {}
    wrapped_tracks(cockpit.quantities, lambda q: profiles.setdefault(q, cProfile.Profile()).enable(),
                   lambda q: profiles[q].disable())
    for _ in range(steps):
        tracked(x, y)
    calls = {q: pstats.Stats(profile).total_calls / steps for q, profile in profiles.items()}
    tensors = sum(1 for p in tracked.model.parameters() if p.requires_grad)
    return statistics.median(plain_times), times, calls, tensors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="swin,gpt")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, CPU time, {args.steps} steps, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print("| model | quantity | ms a step | of the plain step | calls a step | calls per tensor |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.models.split(","):
        plain, times, calls, tensors = measure(name, args.steps, args.warmup)
        for quantity, spent in times.items():
            seconds = statistics.median(spent)
            print(f"| {name} ({tensors} tensors, plain {1e3 * plain:.1f} ms) | {quantity} | {1e3 * seconds:.2f} "
                  f"| {seconds / plain:.3f} | {calls[quantity]:.0f} | {calls[quantity] / tensors:.1f} |")
        total = sum(statistics.median(spent) for spent in times.values())
        print(f"| {name} | all | {1e3 * total:.2f} | {total / plain:.3f} | {sum(calls.values()):.0f} "
              f"| {sum(calls.values()) / tensors:.1f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
