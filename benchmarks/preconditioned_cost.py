"""Issue 34's first speed target in CPU time of one thread (``--preconditioned-cost``).

What ``PreconditionedNoiseScale`` adds to a ``GradientNoiseScale`` step (the
target: at most 5%), alone beside it and beside ``GradientVarianceQuantiles``
too (whose per-element sums it reads: computed once when both are tracked).
"""

import random
import statistics
import sys

import torch

from benchmarks.harness import times_in_shuffled_rounds
from benchmarks.methods import METHODS, plain_step
from benchmarks.models import MODELS, model_and_batch

#: Issue 34: the preconditioned noise scale adds at most 5% to a GradientNoiseScale step.
PRECONDITIONED_TARGET = 0.05
#: (label, the step without PreconditionedNoiseScale, the same step with it), every
#: quantity tracked at every step with an Adam whose state is that of a later step.
PAIRS = (
    ("GradientNoiseScale", "GradientNoiseScale (Adam)",
     "GradientNoiseScale+PreconditionedNoiseScale (Adam)"),
    ("GradientVarianceQuantiles + GradientNoiseScale", "GradientVarianceQuantiles+GradientNoiseScale (Adam)",
     "GradientVarianceQuantiles+GradientNoiseScale+PreconditionedNoiseScale (Adam)"),
)


def preconditioned_cost_rows(args):
    """Per model and pair: CPU time of one thread, interleaved rounds in a shuffled order.

    Every step (a plain step and both sides of each pair) runs once per round,
    in an order drawn afresh each round (seeded), timed by
    ``time.process_time``. The added cost of a pair is ``with / without - 1``:
    of the steps' fastest rounds (on a shared machine noise only adds time),
    and its median and quartiles over rounds (each round's two times).
    """
    device = torch.device("cpu")
    order = random.Random(0)
    rows = []
    for model_name in args.models:
        spec = MODELS[model_name]
        model, x, y = model_and_batch(spec, args.batch_size or spec.batch_size, device)
        steps = {"plain": plain_step(model, spec.loss)}
        for _, without, with_ in PAIRS:
            steps[without], steps[with_] = METHODS[without](model, spec.loss), METHODS[with_](model, spec.loss)
        for step in steps.values():
            for _ in range(args.warmup):
                step(x, y)
        print(f"{model_name}: PreconditionedNoiseScale's cost, {len(steps)} steps, {args.rounds} rounds",
              file=sys.stderr)
        times = times_in_shuffled_rounds(steps, x, y, args.rounds, order)
        best = {name: min(t) for name, t in times.items()}
        for label, without, with_ in PAIRS:
            per_round = [b / a - 1 for a, b in zip(times[without], times[with_])]
            quartiles = statistics.quantiles(per_round, n=4)
            rows.append({
                "model": model_name, "beside": label, "plain_ms": 1e3 * best["plain"],
                "without_ratio": best[without] / best["plain"], "with_ratio": best[with_] / best["plain"],
                "cost": best[with_] / best[without] - 1, "cost_median": quartiles[1],
                "cost_quartiles": (quartiles[0], quartiles[2]),
            })
    return rows


def preconditioned_cost_markdown(rows):
    """``preconditioned_cost_rows``' results as the README shows them."""
    lines = [
        "| model (plain step, ms) | PreconditionedNoiseScale beside | without / plain | with / plain "
        "| added: fastest rounds | median (quartiles) over rounds | target +5% |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        verdict = "met" if row["cost"] <= PRECONDITIONED_TARGET else "missed"
        low, high = row["cost_quartiles"]
        lines.append(
            f"| {row['model']} ({row['plain_ms']:.0f}) | {row['beside']} | {row['without_ratio']:.2f} | "
            f"{row['with_ratio']:.2f} | **{100 * row['cost']:+.1f}%** | {100 * row['cost_median']:+.1f}% "
            f"({100 * low:+.1f}% to {100 * high:+.1f}%) | {verdict} |"
        )
    return "\n".join(lines)
