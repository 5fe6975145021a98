"""A mixture-of-experts step tracked against its plain step, in CPU time of one thread.

The benchmark's Mixtral-style model (``--model moe``, the default: 2 layers of width 128, 8
experts of 256, top-2, sequence 64, batch 32), or Qwen2-MoE's of those sizes with a shared
expert of 256 and its gate (``--model qwen2-moe``). Each round runs the plain step, then each tracked
method, interleaved, each timed by ``time.process_time`` on one thread (the machine is
shared: CPU time is what the step itself spends, and interleaving lets drifts hit every
step alike). Prints, per method, the median ratio to the plain step of the same round and
its quartiles over rounds, and the median milliseconds.

``--profile`` instead prints where one tracked step (all five) spends its time (cProfile,
after the warm-up; the first tracked step of each block also confirms the fast way by
recomputing the block per example, so it is not what later steps cost).

``--before`` adds each method with the shared experts' rows from the per-example
recomputation (``shared.FROM_THE_BATCH = False``), the way before ``shared.py``, interleaved.

Run: ``PYTHONPATH=. python benchmarks/benchmark_moe.py [--model qwen2-moe] [--before] [--rounds 10] [--profile]``.
"""

import argparse
import cProfile
import pstats
import statistics
import time

from cockpit_gradnoise.extensions.fallback import shared

import torch

from benchmarks.methods import package_all, package_quantity, plain_step
from benchmarks.models import MODELS, model_and_batch

METHODS = {"all five": package_all, "PerExampleGradNorm": package_quantity("PerExampleGradNorm")}


def shared_per_example(build):
    """``build``'s step with the shared experts' rows from the per-example recomputation
    (``shared.FROM_THE_BATCH = False``): the way before them, side by side in one process."""
    def built(model, loss):
        step = build(model, loss)

        def run(x, y):
            shared.FROM_THE_BATCH = False
            try:
                return step(x, y)
            finally:
                shared.FROM_THE_BATCH = True

        return run

    return built


def measure(rounds: int, warmup: int, batch_size: int, model_name: str = "moe", before: bool = False):
    """``{method: [tracked / plain of each round]}`` and ``{step: [seconds of each round]}``;
    ``before``: each method also with the shared experts recomputed per example."""
    spec = MODELS[model_name]
    model, x, y = model_and_batch(spec, batch_size, torch.device("cpu"))
    methods = dict(METHODS)
    if before:
        methods.update({f"{name}, shared per example": shared_per_example(build) for name, build in METHODS.items()})
    steps = {"plain": plain_step(model, spec.loss)}
    steps.update({name: build(model, spec.loss) for name, build in methods.items()})
    for step in steps.values():
        for _ in range(warmup):
            step(x, y)
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.process_time()
            step(x, y)
            times[name].append(time.process_time() - start)
    ratios = {name: [t / p for t, p in zip(times[name], times["plain"])] for name in methods}
    return ratios, times


def profile(warmup: int, batch_size: int, model_name: str = "moe", lines: int = 30) -> None:
    spec = MODELS[model_name]
    model, x, y = model_and_batch(spec, batch_size, torch.device("cpu"))
    step = package_all(model, spec.loss)
    for _ in range(warmup):
        step(x, y)
    profiler = cProfile.Profile()
    profiler.runcall(step, x, y)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each method first")
    parser.add_argument("--batch-size", type=int, default=MODELS["moe"].batch_size)
    parser.add_argument("--model", default="moe", choices=["moe", "qwen2-moe"])
    parser.add_argument("--before", action="store_true",
                        help="each method also with the shared experts recomputed per example, interleaved")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.profile:
        profile(args.warmup, args.batch_size, args.model)
        return
    ratios, times = measure(args.rounds, args.warmup, args.batch_size, args.model, args.before)
    print(f"{args.model}, batch {args.batch_size}, {args.rounds} rounds, one thread, CPU time; "
          f"plain step median {1e3 * statistics.median(times['plain']):.0f} ms")
    for name, values in ratios.items():
        q1, median, q3 = statistics.quantiles(values, n=4)
        print(f"{name}: {statistics.median(values):.2f}x plain (quartiles {q1:.2f}-{q3:.2f}), "
              f"{1e3 * statistics.median(times[name]):.0f} ms")


if __name__ == "__main__":
    main()
