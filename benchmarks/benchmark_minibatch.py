"""Per-batch cost of minibatch_gradient_stats and dataset_gradient against a plain step.

Both functions run their own loop over batches, so they are timed per batch
from inside it: the batches come from an iterator that notes the time
whenever the next batch is asked for, and the time between two requests is
one batch's forward, backward and accumulation (the final statistics, done
once per call, are not in it). A plain training loop (``zero_grad``,
forward, ``backward``) over the same batches is timed the same way,
interleaved with each function in every round; the table gives medians over
all batches of all rounds and their ratio. Peak extra memory is that of one
call over 2 batches, measured as ``benchmarks/benchmark.py`` measures a step.
Models, batch size, threads and allocator are those of ``benchmark.py``.

Options are ``benchmark.py``'s (``--models``, ``--batch-size``, ``--rounds``,
``--threads``, ``--device``, ``--quick``) plus ``--batches`` (per call, 8)::

    python benchmarks/benchmark_minibatch.py --rounds 15
"""

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

import cockpit_gradnoise as cgn  # noqa: E402

import torch  # noqa: E402

from benchmarks import benchmark  # noqa: E402
from benchmarks.harness import allocator, peak_extra_bytes, synchronize  # noqa: E402
from benchmarks.methods import plain_step  # noqa: E402
from benchmarks.models import MODELS, model_and_batch  # noqa: E402
from benchmarks.readme_tables import markdown  # noqa: E402

FUNCTIONS = {
    "minibatch_gradient_stats, per batch": cgn.minibatch_gradient_stats,
    "minibatch_gradient_stats float32 accumulators, per batch": functools.partial(
        cgn.minibatch_gradient_stats, accumulate_dtype=torch.float32
    ),
    "dataset_gradient, per batch": cgn.dataset_gradient,
}


def batch_times(loop, x, y, count, device):
    """Seconds ``loop(batches)`` spends on each of ``count`` batches ``(x, y)``."""
    stamps = []

    def batches():
        for _ in range(count):
            synchronize(device)
            stamps.append(time.perf_counter())
            yield x, y
        synchronize(device)
        stamps.append(time.perf_counter())

    loop(batches())
    return [later - earlier for earlier, later in zip(stamps, stamps[1:])]


def benchmark_model(model_name, args, device):
    """Rows of the table for one model: the plain step, then each function."""
    spec = MODELS[model_name]
    model, x, y = model_and_batch(spec, args.batch_size or spec.batch_size, device)
    plain = plain_step(model, spec.loss)

    def plain_loop(batches):
        for inputs, targets in batches:
            plain(inputs, targets)

    loops = {
        name: functools.partial(function, model, loss_fn=spec.loss("mean"))
        for name, function in FUNCTIONS.items()
    }
    for loop in [plain_loop, *loops.values()]:  # warm-up
        batch_times(loop, x, y, 2, device)
    plain_times, times = [], {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, loop in loops.items():
            plain_times += batch_times(plain_loop, x, y, args.batches, device)
            times[name] += batch_times(loop, x, y, args.batches, device)
    plain_median = statistics.median(plain_times)
    peak_extra_bytes(plain, x, y, device)  # the first call also loads the profiler
    plain_memory = peak_extra_bytes(plain, x, y, device)
    rows = [row(model_name, "plain step", plain_median, 1.0, plain_memory, 1.0)]
    for name, loop in loops.items():

        def call(inputs, targets, loop=loop):
            loop([(inputs, targets)] * 2)

        call.model = model
        memory = peak_extra_bytes(call, x, y, device)
        median = statistics.median(times[name])
        rows.append(
            row(model_name, name, median, median / plain_median, memory, memory / plain_memory)
        )
    return rows


def row(model, method, median, ratio, memory, memory_ratio):
    return {
        "model": model,
        "method": method,
        "median_ms": 1e3 * median,
        "ratio": ratio,
        "peak_extra_mib": memory / 2**20,
        "memory_ratio": memory_ratio,
        "note": None,
    }


def parse_args(argv):
    """``benchmark.py``'s options (``--methods``, ``--warmup`` and ``--json`` are
    ignored) plus ``--batches``, the number of batches per call."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--batches", type=int, default=8)
    own, rest = parser.parse_known_args(argv)
    args = benchmark.parse_args(rest)
    args.batches = 2 if args.quick else own.batches
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"batch size {args.batch_size or 'per model'}, {args.rounds} rounds of "
          f"{args.batches} batches")
    print(f"memory allocator: {allocator()}")
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    table = []
    for model_name in args.models:
        table += benchmark_model(model_name, args, device)
    print(markdown(table))
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
    return table


if __name__ == "__main__":
    main()
