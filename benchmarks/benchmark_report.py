"""The report and the dashboard on a large synthetic frame: time and peak memory.

The frame is built directly in the format of :func:`cockpit_gradnoise.to_frame`
(columns ``step, quantity, param, statistic, value``, one row per number, the
statistics of the five quantities as they store them), so this measures what
runs on the frame, not reading the log (``benchmarks/benchmark_log.py`` does
that). The default shape is the issue's: 200 parameter tensors and the
network, 340 tracked steps, about 1.64 M rows. ``--steps 10000 --layers 6``
gives as many rows over 10,000 tracked steps: the dashboard's lines then
hold 10,000 points each before decimation.

    python benchmarks/benchmark_report.py
    python benchmarks/benchmark_report.py --steps 10000 --layers 6
    python benchmarks/benchmark_report.py --diverge-at 0.5   # NaN from halfway

Each of ``build_report`` + ``format_report`` and ``plot`` (saving a PNG) is
timed ``--rounds`` times on the same frame; the minimum and the median wall
time are printed, the minimum CPU time of the process (steadier on a shared
machine), and the peak of Python allocations (tracemalloc) in a first
untimed round.
"""

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from cockpit_gradnoise.logs.schema import (
    GRADIENT_VARIANCE,
    NETWORK,
    NOISE_SCALE,
    PARAM_GRAD_RATIO,
    PER_EXAMPLE_NORM,
    UPDATE_SIZE,
)

import numpy
import pandas

#: The statistics each quantity stores per parameter (the network's, where they differ).
STATISTICS = {
    GRADIENT_VARIANCE: ["q0.1", "q0.5", "q0.9", "mean", "snr_q0.5", "snr_mean"],
    PER_EXAMPLE_NORM: ["q0.05", "q0.5", "q0.95", "mean", "max"],
    PARAM_GRAD_RATIO: ["mean", "median", "min", "max", "zero_grad_fraction", "norm_ratio"],
    UPDATE_SIZE: ["norm", "relative"],
    NOISE_SCALE: ["grad_sq", "trace_cov", "b_simple", "batch_size", "b_simple_smoothed"],
}
NETWORK_STATISTICS = {PARAM_GRAD_RATIO: ["zero_grad_fraction", "norm_ratio"]}


def synthetic_frame(steps=340, layers=200, every=1, diverge_at=None, seed=0, batch_size=32):
    """A frame as :func:`~cockpit_gradnoise.to_frame` gives it, of made-up positive numbers.

    Args:
        steps: Number of tracked steps.
        layers: Number of parameter tensors (the network ``"all"`` comes on top).
        every: Steps between tracked steps.
        diverge_at: Fraction of the run from which every value is NaN (one
            value of each row group inf), ``None`` for a healthy run.
        seed: Seed of the values.
        batch_size: The ``batch_size`` statistic of the noise scale.

    Returns:
        The frame, sorted by step and quantity, parameters in model order.
    """
    rng = numpy.random.default_rng(seed)
    names = [f"layer{i}.weight" for i in range(layers)] + [NETWORK]
    block = [  # one step's (quantity, param, statistic), in the stored order
        (quantity, name, statistic)
        for quantity in sorted(STATISTICS)
        for name in names
        for statistic in (NETWORK_STATISTICS.get(quantity, STATISTICS[quantity])
                          if name == NETWORK else STATISTICS[quantity])
    ]
    tracked = numpy.arange(steps, dtype="int64") * every
    quantity, param, statistic = (numpy.array(column, dtype=object) for column in zip(*block))
    n = len(block)
    values = rng.lognormal(-3.0, 1.0, size=(steps, n))
    values[:, statistic == "batch_size"] = batch_size
    values[:, statistic == "zero_grad_fraction"] = 0.0
    values[:, statistic == "relative"] *= 1e-2
    if diverge_at is not None:
        first = int(diverge_at * steps)
        values[first:] = numpy.nan
        values[first, ::7] = numpy.inf
    frame = pandas.DataFrame({
        "step": numpy.repeat(tracked, n),
        "quantity": numpy.tile(quantity, steps),
        "param": numpy.tile(param, steps),
        "statistic": numpy.tile(statistic, steps),
        "value": values.ravel(),
    })
    return frame.astype({"quantity": str, "param": str, "statistic": str})


def _timed(function, rounds):
    tracemalloc.start()
    function()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    times, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        function()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(times), statistics.median(times), min(cpu), peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=340)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--diverge-at", type=float)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["report", "plot"], help="time one of the two")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    from cockpit_gradnoise.views import dashboard
    from cockpit_gradnoise.views.report import build_report, format_report

    start = time.perf_counter()
    frame = synthetic_frame(args.steps, args.layers, args.every, args.diverge_at)
    print(f"frame: {len(frame):,} rows, {args.steps} tracked steps, {args.layers} layers "
          f"(built in {time.perf_counter() - start:.2f} s)")
    image = Path(tempfile.mkdtemp(prefix="cgn-bench-report-")) / "dashboard.png"

    def report():
        return format_report(build_report(frame, source="synthetic"))

    def plot():
        import matplotlib.pyplot as plt

        plt.close(dashboard.figure(frame, savefig=image))

    for name, function in (("report", report), ("plot", plot)):
        if args.only in (None, name):
            best, median, cpu, peak = _timed(function, args.rounds)
            print(f"{name:>6}: min {best:.3f} s, median {median:.3f} s over {args.rounds} "
                  f"rounds (CPU min {cpu:.3f} s); peak Python allocations "
                  f"{peak / 2**20:.0f} MB")
    if args.diverge_at is not None:
        print(report().split("\n\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
