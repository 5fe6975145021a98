"""Issue 9's support cost on the GPT in CPU time of one thread (``--support-cost``).

What the rows of LayerNorm, embeddings and attention add to all five
quantities, against a control family (the blocks' MLP ``nn.Linear`` layers).
"""

import statistics
import sys
import time

import torch

from benchmarks.methods import FROZEN_LABELS, MLP_FROZEN, package_all, plain_step, with_frozen
from benchmarks.models import MODELS, model_and_batch
from benchmarks.readme_tables import SUPPORT_COST_TARGET

SUPPORT_LABELS = [*FROZEN_LABELS, MLP_FROZEN]


def support_cost_rows(args):
    """Issue 9's support cost on the GPT: CPU time of one thread, min over interleaved rounds.

    The main table's support cost is a ratio of two ratios of medians of wall
    time on two threads, and moved by up to 10 points from run to run on a
    shared machine. Here every step of a round (the plain step, all five, and
    per family its frozen plain step and all five on the frozen copy) is timed
    by ``time.process_time`` on one thread, interleaved, and each step's
    fastest round is taken: on a shared machine the noise only ever adds time.

    Per family, the rows' cost ``ratio(all five) / ratio(all five, frozen) - 1``,
    its spread (quartiles over rounds of the same formula on that round's
    four times), the family's own weight-gradient time ``w`` (plain step minus
    frozen plain step) and its rows' time ``r`` (what all five add over the
    frozen copy's all five, minus ``w``); both are differences of two minima,
    so a few ms of noise.
    """
    spec = MODELS["gpt"]
    device = torch.device("cpu")
    model, x, y = model_and_batch(spec, args.batch_size or spec.batch_size, device)
    steps = {"plain": plain_step(model, spec.loss), "all": package_all(model, spec.loss)}
    for label in SUPPORT_LABELS:
        frozen = with_frozen(package_all, label)(model, spec.loss)
        steps[f"plain {label}"], steps[f"all {label}"] = frozen.plain, frozen
    for step in steps.values():
        for _ in range(args.warmup):
            step(x, y)
    times = {name: [] for name in steps}
    print(f"gpt: support cost, {len(steps)} steps, {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.process_time()
            step(x, y)
            times[name].append(time.process_time() - start)
    best = {name: 1e3 * min(t) for name, t in times.items()}
    rows = []
    for label in SUPPORT_LABELS:
        per_round = [
            (a / p) / (b / q) - 1
            for a, p, b, q in zip(times["all"], times["plain"], times[f"all {label}"],
                                  times[f"plain {label}"])
        ]
        quartiles = statistics.quantiles(per_round, n=4)
        w = best["plain"] - best[f"plain {label}"]
        all_ratio = best["all"] / best["plain"]
        frozen_ratio = best[f"all {label}"] / best[f"plain {label}"]
        rows.append({
            "family": label,
            "all_ratio": all_ratio,
            "frozen_ratio": frozen_ratio,
            "cost": all_ratio / frozen_ratio - 1,
            "cost_quartiles": (quartiles[0], quartiles[2]),
            "weight_gradient_ms": w,
            "rows_ms": best["all"] - best[f"all {label}"] - w,
        })
    return rows, best


def support_cost_markdown_cpu(rows, best):
    """``support_cost_rows``' results as the README shows them."""
    lines = [
        f"Plain step {best['plain']:.1f} ms, all five {best['all']:.1f} ms (CPU time, one thread).",
        "",
        "| family | all five / plain | frozen: all five / plain | rows cost (quartiles over rounds) "
        "| target | weight gradient w, ms | rows r, ms |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for row in rows:
        control = row["family"] == MLP_FROZEN
        verdict = "control" if control else (
            "met" if row["cost"] <= SUPPORT_COST_TARGET else "missed")
        low, high = row["cost_quartiles"]
        lines.append(
            f"| {row['family'][1:-1]} | {row['all_ratio']:.2f} | {row['frozen_ratio']:.2f} | "
            f"**{100 * row['cost']:+.1f}%** ({100 * low:+.0f}% to {100 * high:+.0f}%) | {verdict} | "
            f"{row['weight_gradient_ms']:.1f} | {row['rows_ms']:.1f} |"
        )
    return "\n".join(lines)
