"""The figures and the page of ``experiments.adaptive_batch``, from its stored numbers."""

import math
import os
from pathlib import Path
from typing import List

import matplotlib
import matplotlib.ticker
import numpy as np

from experiments import critical_batch_size as cbs
from experiments.adaptive_batch import (
    ABLATION,
    ARMS,
    EXAMPLES_CAP,
    GRID,
    MAX_BATCH,
    MEDIAN,
    MICRO_BATCH,
    PER_EXAMPLE,
    RESULTS,
    RULE,
    RULES,
    START_BATCH,
    WARMUP_FRACTIONS,
    baseline_from_json,
    beats_frontier,
    frontier_value,
    lr_cap,
    run_from_json,
    warmup_budget,
)
from experiments.adaptive_batch_reading import VERDICT, WHY
from experiments.pages import seed_ranges

PAGE = "adaptive-batch.md"
#: The table of single runs shows seeds below this (the rest are in the JSON): 124 seeds of
#: four arms made a page of 700 rows.
RUN_ROWS = 12


# ----------------------------------------------------------------------------
# Figures and the page
# ----------------------------------------------------------------------------

COLORS = {"adaptive-norms": "C3", "adaptive-per-example": "C2", "warmup": "C1", "fixed": "C0",
          "fixed-avg": "C9",
          ABLATION: "C4", "adaptive-norms-median": "C5", "adaptive-per-example-median": "C6",
          "adaptive-norms-k0.9": "C7", "adaptive-norms-k1.5": "C8"}
#: The adaptive arms whose changes and verdicts the page lists.
ADAPTIVE_ARMS = [arm for arm in ARMS if arm.startswith("adaptive")]


def plot_frontier(axes, baseline, color, style, label):
    """The grid's points (best learning rate per batch) and its fitted hyperbola."""
    points = np.asarray(baseline.points, dtype=float)
    axes.loglog(points[:, 0] * points[:, 1], points[:, 1], style, color=color, mfc="none",
                label=f"fixed batch, {label} (best lr)")
    for b, s in points:
        axes.annotate(f"{b:.0f}", (b * s, s), textcoords="offset points", xytext=(4, 4),
                      fontsize=7, color=color)
    if math.isfinite(baseline.s_min) and math.isfinite(baseline.e_min) and baseline.e_min > 0:
        grid = np.geomspace(1, 4096, 300)
        steps = cbs.predicted_steps(grid, baseline.s_min, baseline.e_min)
        axes.loglog(grid * steps, steps, "-", color=color, lw=1,
                    label=f"its fit (S/S_min - 1)(E/E_min - 1) = 1, B_crit {baseline.b_crit:.3g}")


def plot_task(baseline, runs, unit, path, fair=None):
    """Left: steps against examples, the grid(s), the hyperbola(s) and every run; right: batch
    over examples. ``fair``: the seed-averaged grid's baseline, drawn beside seed 0's."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    plot_frontier(left, baseline, "0.6", "o", "seed 0's grid")
    if fair is not None:
        plot_frontier(left, fair, "k", "s", "seed-averaged grid")
    for arm in ARMS:
        mine = [r for r in runs if r.arm == arm]
        done = [r for r in mine if math.isfinite(r.steps)]
        if mine:
            left.plot([r.examples for r in done], [r.steps for r in done], "x" if arm.startswith("fixed")
                      else "o", color=COLORS[arm],
                      label=f"{arm} ({len(done)} of {len(mine)} reached)")
    for axis in (left.xaxis, left.yaxis):
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel(f"examples to loss {baseline.target:g} ({unit})")
    left.set_ylabel("steps to it")
    left.set_title(f"{baseline.task}: runs against the fixed-batch frontier", fontsize=10)
    left.legend(fontsize=7)
    for run in runs:
        if not run.batches:
            continue
        right.step(np.cumsum(run.batches), run.batches, where="pre", color=COLORS[run.arm],
                   alpha=1.0 if run.seed == min(r.seed for r in runs) else 0.35, lw=1,
                   label=run.arm if run.seed == min(r.seed for r in runs) else None)
    if math.isfinite(baseline.b_crit):
        right.axhline(baseline.b_crit, color="0.4", ls=":", lw=1,
                      label=f"B_crit (fit) {baseline.b_crit:.3g}")
    right.set_yscale("log", base=2)
    right.set_xscale("log")
    right.set_xlabel(f"examples seen after the step ({unit})")
    right.set_ylabel("batch of the step")
    right.set_title("batch over training (first seed solid)", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _n(value, digits=3):
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def summary(runs, baseline):
    """Per arm: runs, reached, mean S, mean E, mean/min/max frontier value, beats count."""
    rows = {}
    for arm in ARMS:
        mine = [r for r in runs if r.arm == arm]
        if not mine:
            continue
        done = [r for r in mine if math.isfinite(r.steps)]
        values = [r.frontier(baseline.s_min, baseline.e_min) for r in done]
        rows[arm] = {
            "runs": len(mine), "reached": len(done),
            "steps": float(np.mean([r.steps for r in done])) if done else math.inf,
            "examples": float(np.mean([r.examples for r in done])) if done else math.inf,
            "value": float(np.mean(values)) if done else math.nan,
            "low": min(values, default=math.nan), "high": max(values, default=math.nan),
            # The standard error of the mean over seeds: how far "below 1" is resolved.
            "se": float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1
            else math.nan,
            "beats": sum(beats_frontier(r.steps, r.examples, baseline.s_min, baseline.e_min)
                         for r in done)}
    return rows


def verdicts(rows, task, runs=(), against_warmup=True) -> List[str]:
    """Plain sentences on the issue's two targets, from the mean over seeds, and seed by seed
    against the warmup run of the same seed (same initialization and draws of examples);
    ``against_warmup=False``: the frontier's target alone (it does not depend on the grid)."""
    lines = []
    warmups = {r.seed: r for r in runs if r.arm == "warmup" and math.isfinite(r.steps)}
    warm = rows.get("warmup")
    for arm in ADAPTIVE_ARMS:
        row = rows.get(arm)
        if row is None:
            continue
        if row["reached"] < row["runs"]:
            lines.append(f"- {task}, {arm}: {row['runs'] - row['reached']} of {row['runs']} "
                         f"runs did not reach the target.")
        if not row["reached"]:
            continue
        below = row["value"] < 1
        lines.append(f"- {task}, {arm}: mean frontier value {_n(row['value'])} "
                     f"({'below' if below else 'not below'} 1); {row['beats']} of "
                     f"{row['reached']} runs below the fitted hyperbola.")
        if against_warmup and warm is not None and warm["reached"]:
            fewer = row["steps"] <= warm["steps"]
            cheaper = row["examples"] <= warm["examples"]
            word = "meets" if fewer and cheaper else "misses"
            lines.append(f"- {task}, {arm} against the warmup: {row['steps']:.1f} steps and "
                         f"{row['examples']:,.0f} examples against {warm['steps']:.1f} and "
                         f"{warm['examples']:,.0f} (means): {word} the target of at most the "
                         f"warmup's steps at no more of its examples.")
        pairs = [(r, warmups[r.seed]) for r in runs
                 if r.arm == arm and r.seed in warmups and math.isfinite(r.steps)]
        if pairs:
            steps, examples = ([getattr(r, key) <= getattr(w, key) for r, w in pairs]
                               for key in ("steps", "examples"))
            lines.append(f"- {task}, {arm} against the warmup seed by seed: at most its steps in "
                         f"{sum(steps)} of {len(pairs)}, at most its examples in {sum(examples)}, "
                         f"both in {sum(map(all, zip(steps, examples)))}.")
    return lines


def fair_lines(task, baseline, fair, runs) -> List[str]:
    """The seed-averaged frontier of one task, and each arm's mean value against it."""
    if fair is None:
        return []
    rows = summary(runs, fair)
    said = "; ".join(f"{arm} {_n(row['value'])} ± {_n(row['se'], 2)}"
                     for arm, row in rows.items() if row["reached"])
    fixed = rows.get("fixed")
    check = "" if fixed is None or not fixed["reached"] else (
        f" The sanity check: the fixed batch ({fixed['runs']} seeds) comes to "
        f"{_n(fixed['value'])} ± {_n(fixed['se'], 2)} against it "
        f"({_n(summary(runs, baseline)['fixed']['value'])} against seed 0's; its batch and "
        f"rate are seed 0's grid's).")
    at_average = rows.get("fixed-avg")
    if at_average is not None and at_average["reached"]:
        check += (f" At this grid's own B_crit and best rate (fixed-avg, {at_average['runs']} "
                  f"seeds): {_n(at_average['value'])} ± {_n(at_average['se'], 2)}.")
    # The arms on the seeds the grid ran too (the same initializations and draws) and on the
    # others: how much of an arm's value is its seeds'.
    split = []
    for words, mine in (("the grid's own seeds", [r for r in runs if r.seed in fair.seeds]),
                        ("the other seeds", [r for r in runs if r.seed not in fair.seeds])):
        part = summary(mine, fair)
        if part:
            split.append(f"On {words} ({seed_ranges({r.seed for r in mine})}): "
                         + "; ".join(f"{arm} {_n(row['value'])} ± {_n(row['se'], 2)}"
                                     for arm, row in part.items() if row["reached"]))
    # The fit's own residual, in the same unit: the averaged grid's points against it.
    points = ", ".join(f"{b:.0f}: {_n(frontier_value(s, b * s, fair.s_min, fair.e_min))}"
                       for b, s in fair.points)
    return [
        f"- Seed-averaged baseline (the fair one): the same grid on the training seeds "
        f"{seed_ranges(fair.seeds)}; for each batch and learning rate the steps "
        f"to the target averaged over the seeds, the best learning rate per batch on the "
        f"means, the hyperbola fitted to them (McCandlish et al. 2018 fit averaged runs): "
        f"S_min = {_n(fair.s_min, 4)}, E_min = {_n(fair.e_min, 4)} {task.unit}, B_crit = "
        f"{_n(fair.b_crit)} (seed 0 alone: {_n(baseline.s_min, 4)}, {_n(baseline.e_min, 4)}, "
        f"{_n(baseline.b_crit)}). A minimum over one seed's noisy runs lies below the typical "
        f"run, so seed 0's frontier puts runs of other seeds outside it, the fixed batch at "
        f"its own B_crit too; the averaged one is fitted to what a run typically takes. "
        f"The averaged grid's own points against it (batch: value): {points}; near the knee "
        f"a few percent more steps than the fit moves the value by several times as much. "
        f"Mean frontier value against it (± its standard error over the seeds): {said}.{check}"
        + "".join(f" {part}." for part in split if len(split) > 1),
    ]


def task_section(task, baseline, fixed, runs, figure, fair=None, extra=(), up=".") -> List[str]:
    """The page's section of one task; ``fair``: the seed-averaged grid's baseline; ``extra``:
    lines after the arms' bullets (experiments.frontier_check.task_lines); ``up``: the
    folder of the grid's page, relative to this page's."""
    budget = warmup_budget(baseline)
    batches = [START_BATCH * 2 ** i for i in range(len(WARMUP_FRACTIONS) + 1)]
    stages = ", ".join(f"{b} (lr {baseline.lr_at(b):g})" for b in batches)
    thresholds = ", ".join(f"{f * budget:,.0f}" for f in WARMUP_FRACTIONS)
    rule = "the SGD rule `eps_opt(B) = eps_max / (1 + B_noise / B)`" + (
        "" if task.optimizer == "sgd" else " on its preconditioned step (the rule `adam-lr`; "
        "under `target` and before, the square-root rule `lr ~ sqrt(B)` of Malladi et al. 2022)")
    lines = [
        f"## {task.title}", "",
        f"- Baseline: the grid of [critical-batch-size]({Path(up, 'critical-batch-size.md').as_posix()}) "
        f"({baseline.source}):"
        f" S_min = {_n(baseline.s_min, 4)}, E_min = {_n(baseline.e_min, 4)} {task.unit}, "
        f"B_crit = {_n(baseline.b_crit)}; target validation loss {task.target:g}; at most "
        f"{task.max_steps:,} steps, or {EXAMPLES_CAP} E_min examples (then \"not reached\").",
        *fair_lines(task, baseline, fair, runs),
        f"- adaptive: `cgn.BatchSchedule(micro_batch=m, min_batch={START_BATCH}, "
        f"max_batch={MAX_BATCH}, max_accumulation={MAX_BATCH}/m, rule=\"auto\", "
        f"max_lr_factor={lr_cap(baseline):g})`, which for "
        f"{task.optimizer.upper() if task.optimizer == 'sgd' else 'Adam'} rescales the learning "
        f"rate by {rule}; starting learning rate {baseline.lr_at(START_BATCH):g}, the grid's "
        f"best at batch {START_BATCH}"
        + (" (the smallest of the grid's rates: the best may lie below it)"
           if baseline.lr_at(START_BATCH) == min(task.learning_rates) else "")
        + f". The learning rate at batch B is {baseline.lr_at(START_BATCH):g} times the rule's "
        f"factor from batch {START_BATCH} to B at the current estimate, never above "
        f"max_lr_factor = {lr_cap(baseline):g}: the grid's best learning rate at its largest batch "
        f"({baseline.best_lr[max(baseline.best_lr)]:g} at {max(baseline.best_lr)}) over its best at "
        f"{START_BATCH}, the grid knowledge the warmup arm uses too"
        + ", and no scaling without a finite B_noise"
        + f". The schedule's defaults otherwise (patience: 10 new estimates between changes; "
        f"at most x2 per change; each change to the near end of the target band, twice the "
        f"estimate's range, never past it, so that a rising estimate is followed at B_noise "
        f"(multiple=1), and no growth where the range has no upper end: the rule `{RULE}`, "
        f"docs/advice.md \"Why the band is twice the range\", \"Why the near end\" and \"Why "
        f"not grow on an unresolved estimate\"; the runs' rules: \"What ran\" above); "
        f"every step tracked. `adaptive-norms`: m = {MICRO_BATCH['adaptive-norms']}, "
        f"quantities=\"norms\" (TwoBatchNoiseScale from micro-batch norms, which needs two "
        f"micro-batches a step); `adaptive-per-example`: m = "
        f"{MICRO_BATCH['adaptive-per-example']}, quantities=[\"{PER_EXAMPLE[task.optimizer]}\"] "
        f"(from every example's gradient"
        + (", preconditioned by Adam's own state: the noise Adam sees" if task.optimizer == "adam"
           else "") + ").",
        f"- {ABLATION} (an ablation, where it ran): `adaptive-per-example` with `rule=None`: "
        f"the learning rate stays {baseline.lr_at(START_BATCH):g} whatever the batch, which "
        f"tells the batch rule's effect from the learning-rate rule's.",
        f"- `adaptive-norms{MEDIAN}`, `adaptive-per-example{MEDIAN}` (the one change tried after "
        f"the first rerun): the same with `estimate=\"median\"`: B_noise is the median of the "
        f"last 10 per-step b_simple, not b_simple_smoothed (see \"What the adaptive runs did\").",
        "- `adaptive-norms-k0.9`, `adaptive-norms-k1.5` (an ablation of `multiple`, where they ran): "
        "`adaptive-norms` with `multiple=0.9` and `1.5`, a rising estimate followed at k B_noise: "
        "on McCandlish et al.'s model (1 + 1/k)/2 times the steps and (1 + k)/2 times the examples "
        "of k = 1, a move along the frontier, not below it; chosen from the k = 1 runs as the "
        "multiples at which the warmup's steps and examples are both undercut on one task each "
        "(GPT 0.9, digits 1.5), to test that prediction.",
        f"- warmup: batches {stages}, doubling when the examples seen pass {thresholds} "
        f"(fractions {', '.join(f'{f:g}' for f in WARMUP_FRACTIONS)} of the budget 2 E_min = "
        f"{budget:,.0f}); each batch with the grid's best learning rate for it.",
        *([] if fixed is None else [  # None: the fixed arm did not run here
            f"- fixed: batch {fixed['batch']} (B_crit rounded), learning rate {fixed['lr']:g}, the "
            f"best of the grid's learning rates at that batch with seed 0 (steps per lr: "
            + ", ".join(f"{k}: {v}" for k, v in fixed["steps per lr"].items()) + ")."]),
        *extra,
        "",
        "| arm | seeds run | reached | mean steps S | mean examples E | frontier value: mean "
        "(min-max) | below the hyperbola |" + (" seed-averaged frontier: value, mean (min-max) "
                                               "| below its hyperbola |" if fair else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if fair else ""),
    ]
    rows = summary(runs, baseline)
    fair_rows = summary(runs, fair) if fair else {}
    for arm, row in rows.items():
        other = fair_rows.get(arm)
        lines.append(f"| {arm} | {row['runs']} | {row['reached']} | {row['steps']:.1f} | "
                     f"{row['examples']:,.0f} | {_n(row['value'])} ({_n(row['low'])} to "
                     f"{_n(row['high'])}) | {row['beats']} of {row['reached']} |" + (
                         "" if other is None else
                         f" {_n(other['value'])} ({_n(other['low'])} to {_n(other['high'])}) | "
                         f"{other['beats']} of {other['reached']} |"))
    lines += ["", *verdicts(rows, task.name, runs),
              *(verdicts(fair_rows, f"{task.name} (seed-averaged frontier)",
                         against_warmup=False) if fair else []), "",
              "| arm | seed | batch: first, largest, last | lr: first, largest, last | batch "
              "changes | steps S | examples E | (S/S_min-1)(E/E_min-1) | seconds |"
              + (" value, seed-averaged frontier |" if fair else ""),
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if fair else "")]
    for r in (r for r in runs if r.seed < RUN_ROWS):
        b = f"{r.batches[0]}, {max(r.batches)}, {r.batches[-1]}" if r.batches else "-"
        lr = f"{r.lrs[0]:.3g}, {max(r.lrs):.3g}, {r.lrs[-1]:.3g}" if r.lrs else "-"
        steps, examples = f"{r.steps:.1f}", f"{r.examples:,.0f}"
        if not math.isfinite(r.steps):
            steps = (f"{'diverged' if r.diverged else 'not reached'}: stopped at step "
                     f"{len(r.batches)}, validation loss {r.eval_losses[-1]:.3g}")
            examples = f"(stopped at {sum(r.batches):,})"
        lines.append(f"| {r.arm} | {r.seed} | {b} | {lr} | {len(r.changes)} | {steps} | "
                     f"{examples} | {_n(r.frontier(baseline.s_min, baseline.e_min))} | "
                     f"{r.seconds:.0f} |"
                     + (f" {_n(r.frontier(fair.s_min, fair.e_min))} |" if fair else ""))
    if any(r.seed >= RUN_ROWS for r in runs):
        lines += ["", f"Runs of seeds {RUN_ROWS} and later: in `"
                  f"{RESULTS.format(task=task.name)}` (the tables above count them)."]
    lines += ["", "The adaptive runs' changes (first seed): step, batch, the noise scale "
              "B_noise it rested on (`inf`: no signal resolved yet, the estimate of |G|^2 at "
              "or below 0), the learning-rate factor:", ""]
    for r in runs:
        if r.arm in ADAPTIVE_ARMS and r.seed == min(x.seed for x in runs):
            moves = "; ".join(f"{c['step']}: {c['batch']}->{c['new_batch']} (B_noise "
                              f"{_n(c['noise_scale'])}, lr x{c['lr_factor']:.3g})"
                              for c in r.changes)
            lines.append(f"- {r.arm}: {moves or 'none'}.")
    lines += ["", f"![{task.name}: runs against the frontier, and their batch]({figure})", ""]
    return lines


def write_page(stored, tasks, out, fair=None, extra=None, readings=True) -> Path:
    """The markdown page from the stored numbers; returns its path. ``fair``: ``{task:
    Baseline or None}``, the seed-averaged grids (a second row of values against them);
    ``extra``: ``{task: lines}`` added to its section (see :func:`task_section`);
    ``readings``: with the hand-written readings (:mod:`.adaptive_batch_reading`), which are
    of the runs stored in ``docs/experiments`` only."""
    fair, extra = fair or {}, extra or {}
    up = os.path.relpath(GRID.parent.resolve(), Path(out).resolve())  # the grid page's folder
    lines = [
        "# Does the adaptive batch schedule beat every fixed batch?"
        + ("" if readings else f" ({Path(out).name})"), "",
        "<!-- Generated by experiments/adaptive_batch.py; do not edit by hand. -->", "",
        "A fixed batch reaches the target loss on the hyperbola "
        "$(S/S_{\\min} - 1)(E/E_{\\min} - 1) = 1$ of McCandlish et al. 2018 (measured and "
        f"fitted in [critical-batch-size]({Path(up, 'critical-batch-size.md').as_posix()})); "
        "the fixed batch at "
        "$B_{\\text{crit}}$ sits at its knee, with value 1. A run whose batch grows during "
        "training can land inside it (value below 1): fewer steps than any fixed batch that "
        f"uses as many examples. Here [`cgn.BatchSchedule`]({Path(up, '../advice.md').as_posix()}) "
        "grows the batch from "
        f"{START_BATCH} through gradient accumulation, from the measured noise scale, against "
        "a hand-set batch-size warmup (Merrill et al. 2025, \"Critical Batch Size Revisited\", "
        "arXiv:2505.23971: start small, double as the critical batch grows) and the fixed "
        "batch at the fitted $B_{\\text{crit}}$. The issue's targets: the adaptive run below "
        "1 on both tasks, and at most the warmup's steps at no more of its examples.", "",
        f"What ran: {what_ran(stored)}.", "",
        "Mean frontier value $(S/S_{\\min} - 1)(E/E_{\\min} - 1)$ over the runs that reached "
        "the target (reached of run); below 1 beats the fixed batches:", "",
        "| task | " + " | ".join(ARMS) + " |", "|---|" + "---|" * len(ARMS),
    ]
    frontiers = [(entry, baseline_from_json(entry["baseline"]), "seed 0's frontier")
                 for entry in stored]
    frontiers += [(entry, fair[entry["task"]], "seed-averaged frontier") for entry in stored
                  if fair.get(entry["task"]) is not None]
    for entry, baseline, which in frontiers:
        rows = summary([run_from_json(r) for r in entry["runs"]], baseline)
        lines.append(f"| {entry['task']}, {which} | " + " | ".join(
            f"{_n(rows[a]['value']) if rows[a]['reached'] else 'none reached'} "
            f"({rows[a]['reached']} of {rows[a]['runs']})" if a in rows
            else "not run" for a in ARMS) + " |")
    lines.append("")
    for entry in stored:
        task = tasks[entry["task"]]
        baseline = baseline_from_json(entry["baseline"])
        runs = [run_from_json(r) for r in entry["runs"]]
        lines += task_section(task, baseline, entry["fixed"], runs,
                              f"adaptive-batch-{task.name}.png", fair.get(task.name),
                              extra.get(task.name, ()), up)
    lines += why_section(stored, readings)
    lines += [
        "## How it is measured", "",
        "- Every run of a seed starts from the same initialization and draws its examples "
        "from a generator with that seed; the data split and validation set are the grid's "
        "(seed 0). Two frontiers: seed 0's grid alone (what the arms' batches and learning "
        "rates were set from: B_crit, the warmup's budget, the grid's best rates), and, where "
        "the grid ran on more training seeds (`critical_batch_size --seeds`, on the same data "
        "split and validation set), the seed-averaged one: per batch and learning rate the "
        "steps averaged over the seeds, the best rate per batch on the means (a batch where a "
        "rate pruned on some seed could still have the smaller mean is left out, not "
        "guessed), the hyperbola fitted to those means. The arms' seeds 0 to 2 (or more) are "
        "also grid seeds; the others are not. The fixed arm's seed-0 run is "
        "the best of the learning rates tried, as in the grid; its other seeds use that rate.",
        "- Steps S: optimizer steps to the first crossing of the target, interpolated between "
        "evaluations as in the grid (validation loss at step 0 and whenever the examples since "
        "the last evaluation reach max(1, N // B) B, B the batch of the last step and N "
        "the grid's examples between evaluations: for a fixed batch every max(1, N // B) "
        "steps, as the grid). Examples "
        "E: the sum of the batches of those steps, the fractional last step in proportion.",
        "- The warmup's fractions were set before any run and not tuned: geometric, because "
        "the critical batch rises fastest early in training and then plateaus (Merrill et "
        "al. 2025), with the budget the fixed batch at B_crit needs; its final batch is "
        f"{START_BATCH * 2 ** len(WARMUP_FRACTIONS)} (B_crit: " + ", ".join(
            f"{e['task']} {_n(e['baseline']['b_crit'])}" for e in stored) + "). Its "
        "learning rates are the grid's best per batch: the hand tuning a user with the grid "
        "would do, more than the adaptive arms get (their one tuned rate at the start, "
        "rescaled by the rule, and the bound `max_lr_factor` from the grid's best rates).",
        "- Frontier value below 0 means fewer steps than S_min or fewer examples than E_min; "
        "\"below the hyperbola\" counts runs with fewer steps than any fixed batch would need "
        "with their number of examples.", "",
        "## Reproduce", "",
        "Each task's runs are stored in `" + RESULTS.format(task="<task>") + "`; `--replot` "
        "redraws the figures and this page from them, `--resume` adds only the runs missing "
        "from them. One CPU thread each (`torch.set_num_threads(1)`), on a machine shared "
        "with other jobs. Commands with `--out` elsewhere ran in parallel into a copy whose "
        "new runs were then added to the stored file (a run is one seed of one arm, the "
        "same whichever folder holds it); `--out docs/experiments` gives the same runs.", "",
    ]
    for entry in stored:
        lines += [f"{entry['task']}: seeds {seed_ranges(entry['seeds'])}, wall time "
                  f"{entry['seconds']:.0f} s, by", "", "```bash", *entry["commands"], "```", ""]
    lines += ["| package | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in stored[-1]["versions"].items()] + [""]
    path = Path(out) / PAGE
    path.write_text("\n".join(lines))
    return path


def behaviour(runs, baseline) -> dict:
    """Per adaptive arm, over its seeds: changes, of them on an infinite B_noise and shrinks,
    the mean largest and last batch, and the share of examples seen at batches above 2 B_crit."""
    rows = {}
    for arm in ADAPTIVE_ARMS:
        mine = [r for r in runs if r.arm == arm and r.batches]
        if not mine:
            continue
        changes = [c for r in mine for c in r.changes]
        above = sum(b for r in mine for b in r.batches if b > 2 * baseline.b_crit)
        decided = [r.decisions for r in mine if r.decisions]  # stored since the rule "resolved"
        rows[arm] = {"changes": len(changes),
                     "blind": sum(math.isinf(c["noise_scale"]) for c in changes),
                     "shrinks": sum(c["new_batch"] < c["batch"] for c in changes),
                     "largest": float(np.mean([max(r.batches) for r in mine])),
                     "last": float(np.mean([r.batches[-1] for r in mine])),
                     "above": above / sum(sum(r.batches) for r in mine),
                     "unresolved": (sum(d.get("unresolved", 0) for d in decided)
                                    / sum(sum(d.values()) for d in decided)) if decided else None}
    return rows


def why_section(stored, readings=True) -> List[str]:
    """What the adaptive runs did, from the stored runs, and (``readings``) what was found
    about them."""
    lines = ["## What the adaptive runs did", "",
             "Per adaptive arm, over its seeds: the batch changes, how many rested on an "
             "infinite B_noise (no signal resolved: the rules before `resolved` doubled the "
             "batch blind there) and how many shrank the batch, the mean largest and last batch (the warmup ends at "
             f"{START_BATCH * 2 ** len(WARMUP_FRACTIONS)}), the share of all examples "
             "seen at batches above 2 B_crit, and the share of the estimates on which the "
             "schedule kept the batch as unresolved (the rule `resolved`: its range had no "
             "upper end; `-`: runs under an earlier rule, which did not count them):", "",
             "| task | arm | changes | on infinite B_noise | shrinks | largest batch | "
             "last batch | examples above 2 B_crit | estimates unresolved |",
             "|---|---|---|---|---|---|---|---|---|"]
    for entry in stored:
        rows = behaviour([run_from_json(r) for r in entry["runs"]],
                         baseline_from_json(entry["baseline"]))
        lines += [f"| {entry['task']} | {arm} | {row['changes']} | {row['blind']} | "
                  f"{row['shrinks']} | {row['largest']:.0f} | {row['last']:.0f} | "
                  f"{row['above']:.0%} | "
                  + ("-" if row["unresolved"] is None else f"{row['unresolved']:.0%}") + " |"
                  for arm, row in rows.items()]
    elsewhere = ["- The hand-written readings are of the runs stored in docs/experiments, on "
                 "docs/experiments/adaptive-batch.md; this page has the generated parts only."]
    return lines + ["", *(WHY if readings else elsewhere), *outcome(stored), *rule_change(stored),
                    *(VERDICT if readings else ()), ""]


#: Each rule of ``RULES`` in words (the page's comparison of consecutive rules).
RULE_WORDS = {"centre": "each change toward round(B_noise)",
              "near-end": "each change to the near end of the estimate's range, never past it",
              "resolved": "the near end, and no growth where the estimate's range has no upper "
                          "end: an infinite B_noise, or a quarter of the recent steps unresolved",
              "target": "the rule `resolved` on the estimate's range scaled by 2: a rising "
                        "estimate is followed at B_noise, the critical batch, not at B_noise / 2",
              "adam-lr": "the rule `target` with McCandlish et al.'s learning-rate rule under "
                         "Adam too (on its preconditioned step), not the square-root rule"}


def rule_change(stored) -> List[str]:
    """Each rule change of ``RULES`` on the same arms and seeds, per task: a table of the
    last stored run of each arm and seed under the rule before against the one after."""
    sections = []
    for i, before_rule in enumerate(RULES):
        for after_rule in RULES[i + 1:]:
            sections += rule_table(stored, before_rule, after_rule, RULES[i + 1:RULES.index(after_rule)])
    return sections


def rule_table(stored, before_rule, after_rule, between) -> List[str]:
    """:func:`rule_change`'s table of the arms and seeds run under ``before_rule`` and then
    ``after_rule``, and under none of the rules ``between`` them."""
    lines = []
    for entry in stored:
        baseline = baseline_from_json(entry["baseline"])
        last = {}  # the last stored run of each arm, seed and rule (replaced first)
        for r in map(run_from_json, entry.get("replaced", []) + entry["runs"]):
            if r.arm in ADAPTIVE_ARMS:
                last[(r.arm, r.seed, r.rule)] = r
        pairs = [(last[(arm, seed, before_rule)], r) for (arm, seed, rule), r in last.items()
                 if rule == after_rule and (arm, seed, before_rule) in last
                 and not any((arm, seed, other) in last for other in between)]
        pairs.sort(key=lambda pair: (ARMS.index(pair[1].arm), pair[1].seed))
        lines += [rule_row(entry["task"], arm, pairs, baseline)
                  for arm in dict.fromkeys(r.arm for _, r in pairs)]
    if not lines:
        return []
    return ["", f"The rule change `{before_rule}` ({RULE_WORDS[before_rule]}) -> "
            f"`{after_rule}` ({RULE_WORDS[after_rule]}), on the same arms and seeds (means "
            "over the seeds that reached the target; changes and shrinks summed over the "
            "seeds, largest batch their mean):", "",
            "| task | arm | seeds | frontier value | steps S | examples E | changes | "
            "shrinks | largest batch | below the hyperbola | frontier value per seed |",
            "|---|---|---|---|---|---|---|---|---|---|---|", *lines, ""]


def rule_row(task, arm, pairs, baseline) -> str:
    """One arm's row of :func:`rule_change`: the runs before and after, over its seeds."""
    old = [a for a, b in pairs if b.arm == arm]
    new = [b for a, b in pairs if b.arm == arm]
    rows = [summary(runs, baseline)[arm] for runs in (old, new)]
    how = [behaviour(runs, baseline)[arm] for runs in (old, new)]
    return (f"| {task} | {arm} | {len(new)} | {_n(rows[0]['value'])} -> "
            f"{_n(rows[1]['value'])} | {rows[0]['steps']:.1f} -> {rows[1]['steps']:.1f} | "
            f"{rows[0]['examples']:,.0f} -> {rows[1]['examples']:,.0f} | {how[0]['changes']} "
            f"-> {how[1]['changes']} | {how[0]['shrinks']} -> {how[1]['shrinks']} | "
            f"{how[0]['largest']:.0f} -> {how[1]['largest']:.0f} | "
            f"{rows[0]['beats']} -> {rows[1]['beats']} | " + ", ".join(
                f"{_n(a.frontier(baseline.s_min, baseline.e_min))} -> "
                f"{_n(b.frontier(baseline.s_min, baseline.e_min))}"
                for a, b in zip(old, new)) + " |")


def outcome(stored) -> List[str]:
    """The median change against the smoothed estimate, on the seeds both ran under one rule,
    and the seeds' own spread, per task."""
    lines = []
    for entry in stored:
        runs = [run_from_json(r) for r in entry["runs"]]
        rows = summary(runs, baseline_from_json(entry["baseline"]))
        pairs = [(arm, arm + MEDIAN) for arm in ("adaptive-norms", "adaptive-per-example")
                 if arm in rows and arm + MEDIAN in rows]
        both = {(r.seed, r.rule) for r in runs if r.arm.endswith(MEDIAN)} & {
            (r.seed, r.rule) for r in runs if r.arm in ("adaptive-norms", "adaptive-per-example")}
        rows.update(summary([r for r in runs if (r.seed, r.rule) in both and r.arm in sum(
            pairs, ())], baseline_from_json(entry["baseline"])))
        if not pairs or not both:
            continue
        said = "; ".join(
            f"{a}: {_n(rows[a]['value'])} -> {_n(rows[m]['value'])}, steps "
            f"{rows[a]['steps']:.1f} -> {rows[m]['steps']:.1f}, examples "
            f"{rows[a]['examples']:,.0f} -> {rows[m]['examples']:,.0f}" for a, m in pairs)
        spread = ""
        if "fixed" in rows and rows["fixed"]["reached"]:
            spread = (f"; for scale, the fixed batch's own seeds span {_n(rows['fixed']['low'])} "
                      f"to {_n(rows['fixed']['high'])}")
        lines.append(f"- {entry['task']}, the median change (mean frontier value, smoothed -> "
                     f"median, on the runs of both with the same seed and rule: "
                     + ", ".join(f"seed {seed} `{rule}`" for seed, rule in sorted(both))
                     + f"): {said}{spread}.")
    return lines


def what_ran(stored) -> str:
    """One sentence: the runs of each task and arm in the stored results."""
    parts = []
    for entry in stored:
        counts = {arm: sum(r["arm"] == arm for r in entry["runs"]) for arm in ARMS}
        rules = {arm: {run_from_json(r).rule for r in entry["runs"] if r["arm"] == arm}
                 for arm in ADAPTIVE_ARMS}
        parts.append(f"{entry['task']}: " + ", ".join(
            f"{arm} {n} seed{'s' if n != 1 else ''}"
            + (f" (rule {'/'.join(sorted(rules[arm]))})" if rules.get(arm) else "")
            for arm, n in counts.items()))
    return "; ".join(parts)
