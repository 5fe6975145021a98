"""CPU time of issue 32's underflow checks: a tracked step with them against one without.

Every tracked step checks the sums of squares and the per-example squared norms it
saved for ones underflow lost (``functional/underflow.py``: one comparison per element
of each layer's sums, ``[N]`` per norm; ``extensions/_squares.exact_where_lost`` on the
layers whose squares are formed from factors). Not switched off here: the ``[N]``
comparisons inside ``_squares.squared_norms_of`` and ``unscaled_norms``, and the marks
of ``unscaled_sums`` (only where a layer is summed at a scale). This script times, in CPU time of one
thread (``time.process_time``), a plain step and the step with the package's five
quantities (``methods.package_all``) with the checks and without them (the checks
replaced by what they return where nothing underflows), the three in a rotating order
in each round, after ``--warmup`` untimed steps each. Nothing underflows in these
models, so both tracked steps compute the same numbers. Printed per model: the median
CPU time of each, the ratios to the plain step, and the spread of the per-round ratio
of the step with checks over the one without.

Run: ``PYTHONPATH=. python benchmarks/underflow_check_cost.py --models gpt,resnet18 --rounds 15``.
"""

import contextlib
import os
import statistics
import sys
from pathlib import Path

if not __package__:  # as benchmarks/benchmark.py: the repository's `benchmarks`, ahead of Opacus'
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from cockpit_gradnoise import functional  # noqa: E402
from cockpit_gradnoise.extensions import convolution, linear, sums  # noqa: E402
from cockpit_gradnoise.extensions.fallback import reduce  # noqa: E402

from benchmarks.benchmark_cpu_ratio import cpu_seconds, one_thread, plain_and_tracked  # noqa: E402


@contextlib.contextmanager
def without_checks():
    """The checks replaced by what they give where nothing underflows."""
    patched = [
        (functional, "unresolved_sums", lambda *args, **kwargs: None),
        (functional, "unresolved_norms", lambda *args, **kwargs: None),
        (functional, "unresolved_norm_sum", lambda *args, **kwargs: None),
        (linear, "exact_where_lost", lambda compute, kinds, examples, numel, *factors: compute(*factors)),
        (reduce, "exact_where_lost", lambda compute, kinds, examples, numel, *factors: compute(*factors)),
        (convolution, "exact_where_lost", lambda compute, kinds, examples, numel, *factors: compute(*factors)),
        (sums, "_underflowed", lambda *args: False),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def cpu_seconds_of(step, x, y, checks: bool) -> float:
    """:func:`.benchmark_cpu_ratio.cpu_seconds`, with the checks or without them."""
    with contextlib.nullcontext() if checks else without_checks():
        return cpu_seconds(step, x, y)


def measure(name: str, rounds: int, warmup: int):
    """``{"plain", "checks", "none"}`` CPU times of ``rounds`` rotating rounds of model ``name``."""
    plain, tracked, x, y = plain_and_tracked(name)
    runs = {"plain": lambda: cpu_seconds_of(plain, x, y, True),
            "checks": lambda: cpu_seconds_of(tracked, x, y, True),
            "none": lambda: cpu_seconds_of(tracked, x, y, False)}
    for _ in range(warmup):
        for run in runs.values():
            run()
    times = {key: [] for key in runs}
    order = list(runs)
    for k in range(rounds):
        for key in order[k % 3:] + order[: k % 3]:
            times[key].append(runs[key]())
    return times


def main(argv=None):
    args = one_thread(argv, __doc__.splitlines()[0], "gpt,resnet18")
    print("| model | plain ms | all five, checks ms | all five, no checks ms | checks / plain "
          "| no checks / plain | checks / no checks | per-round (min, quartiles, max) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        times = measure(name, args.rounds, args.warmup)
        median = {key: statistics.median(value) for key, value in times.items()}
        ratios = sorted(c / n for c, n in zip(times["checks"], times["none"]))
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"| {name} | {1e3 * median['plain']:.1f} | {1e3 * median['checks']:.1f} "
              f"| {1e3 * median['none']:.1f} | {median['checks'] / median['plain']:.3f} "
              f"| {median['none'] / median['plain']:.3f} | {median['checks'] / median['none']:.3f} "
              f"| {ratios[0]:.3f}, {quartiles[0]:.3f}, {quartiles[1]:.3f}, {quartiles[2]:.3f}, "
              f"{ratios[-1]:.3f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
