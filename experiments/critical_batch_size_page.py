"""The figures and the page of :mod:`experiments.critical_batch_size`, from its results.

Split from the measurement so that each file stays readable; this module
imports the measurement's results, never the other way round (its command
line imports this module inside ``main``).
"""

import json
import math
from pathlib import Path
from typing import List

import matplotlib
import matplotlib.ticker
import numpy as np

from experiments.cbs_seeds import SEED_RESULTS, seeds_section
from experiments.critical_batch_size import (
    PAGE,
    PAPER_FACTOR,
    RESULTS,
    agreement_factor,
    best_of,
    predicted_steps,
    value_range,
)


def plot_task(result, path):
    """Steps against examples with the fitted hyperbola, and B_simple over training."""
    import matplotlib.pyplot as plt

    task = result.task
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90)
    b, s = result.measured()
    left.loglog(b * s, s, "o", color="C0", label="measured (best learning rate)")
    for bi, si in zip(b, s):
        left.annotate(f"{bi:.0f}", (bi * si, si), textcoords="offset points", xytext=(4, 4),
                      fontsize=8)
    if math.isfinite(result.s_min) and math.isfinite(result.e_min):
        # From well below to well above the measured batches and B_crit: the whole knee.
        knee = [result.b_crit] if 0 < result.b_crit < math.inf else []
        grid = np.geomspace(min([b.min()] + knee) / 4, max([b.max()] + knee) * 4, 200)
        fitted = predicted_steps(grid, result.s_min, result.e_min)
        left.loglog(grid * fitted, fitted, "-", color="C1",
                    label=f"fit: S_min={result.s_min:.3g}, E_min={result.e_min:.3g}")
        left.axhline(result.s_min, color="0.6", ls=":", lw=1)
        left.axvline(result.e_min, color="0.6", ls=":", lw=1)
        if 0 < result.b_crit < math.inf:
            left.plot(2 * result.e_min, 2 * result.s_min, "s", color="C3",
                      label=f"B_crit = {result.b_crit:.3g}")
        if result.b_simple > 0 and math.isfinite(result.b_simple):
            s_pred = predicted_steps(result.b_simple, result.s_min, result.e_min)
            left.plot(result.b_simple * s_pred, s_pred, "D", color="C2",
                      label=f"B = B_simple = {result.b_simple:.3g}")
    for axis in (left.xaxis, left.yaxis):  # decade labels only: the minor ones collide
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel(f"examples to reach loss {task.target:g} ({task.unit})")
    left.set_ylabel("steps to reach it")
    left.set_title(f"{task.name}: (S/S_min - 1)(E/E_min - 1) = 1", fontsize=10)
    left.legend(fontsize=7)

    if result.gns_series is not None:
        steps, raw = result.series("b_simple")
        finite = np.isfinite(raw) & (raw > 0)
        right.semilogy(steps[finite], raw[finite], ".", color="C0", alpha=0.2, ms=3,
                       label="B_simple of each batch")
        steps, smoothed = result.series("b_simple_smoothed")
        finite = np.isfinite(smoothed) & (smoothed > 0)
        right.semilogy(steps[finite], smoothed[finite], "-", color="C0",
                       label="B_simple smoothed")
        right.axvline(result.gns_run.steps, color="0.4", ls="--", lw=1,
                      label=f"loss {task.target:g} reached")
        right.axhline(task.gns_batch, color="C1", ls=":", lw=1,
                      label=f"batch size {task.gns_batch}")
    if 0 < result.b_crit < math.inf:
        right.axhline(result.b_crit, color="C3", lw=1.5, label=f"B_crit (fit) {result.b_crit:.3g}")
        right.axhspan(result.b_crit / PAPER_FACTOR, result.b_crit * PAPER_FACTOR, color="C3",
                      alpha=0.07, label=f"B_crit x/÷ {PAPER_FACTOR:g}")
    right.set_xlabel(f"step (batch {task.gns_batch})")
    right.set_ylabel(f"noise scale ({task.unit.split(' ')[0]})")
    right.set_title("GradientNoiseScale over training", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verdict(result) -> str:
    """One plain sentence: do B_simple and B_crit agree within the paper's factor?"""
    factor = agreement_factor(result.b_crit, result.b_simple)
    if math.isnan(factor):
        return (f"B_crit ({result.b_crit:.3g}) and B_simple ({result.b_simple:.3g}) cannot be "
                f"compared here: one of them is not a finite positive number.")
    if factor <= PAPER_FACTOR:
        return (f"**They agree within the paper's factor:** B_simple = {result.b_simple:.3g} "
                f"and B_crit = {result.b_crit:.3g} are a factor {factor:.2g} apart "
                f"(at most {PAPER_FACTOR:g}).")
    return (f"**They do not agree within the paper's factor:** B_simple = "
            f"{result.b_simple:.3g} and B_crit = {result.b_crit:.3g} are a factor "
            f"{factor:.2g} apart (more than {PAPER_FACTOR:g}).")


def _number(value, digits=3):
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def task_section(result, figure) -> List[str]:
    """The page's section of one task."""
    task = result.task
    lrs = ", ".join(f"{lr:g}" for lr in task.learning_rates)
    lines = [
        f"## {task.title}", "",
        f"- Model and optimizer: {task.description}.",
        f"- Data: {task.data_note}.",
        f"- Target: validation loss {task.target:g}; learning rates {lrs}; at most "
        f"{task.max_steps:,} steps; validation loss every max(1, {task.eval_examples} // B) "
        f"steps, the crossing interpolated linearly between evaluations.",
        "",
        "| batch B | best lr | steps S | examples E = B S | steps per learning rate |",
        "|---|---|---|---|---|",
    ]
    for b, runs in result.runs.items():
        best = best_of(runs)
        per_lr = ", ".join(f"{r.lr:g}: {r.outcome()}" for r in runs)
        if best is None:
            lines.append(f"| {b} | – | not reached | – | {per_lr} |")
            continue
        edge = " (grid edge)" if best.lr in (min(task.learning_rates),
                                             max(task.learning_rates)) else ""
        lines.append(f"| {b} | {best.lr:g}{edge} | {best.steps:.1f} | {b * best.steps:,.0f} "
                     f"| {per_lr} |")
    b, s = result.measured()
    residual = (np.log(s) - np.log(predicted_steps(b, result.s_min, result.e_min))
                if len(b) >= 2 else np.array([math.nan]))
    rms = float(np.sqrt(np.mean(residual ** 2)))
    lines += [
        "",
        f"Fit (least squares of log S against log(S_min + E_min / B), {len(b)} batch sizes): "
        f"S_min = {_number(result.s_min, 4)} steps, E_min = {_number(result.e_min, 4)} "
        f"{task.unit}, **B_crit = E_min / S_min = {_number(result.b_crit)}**; root-mean-square "
        f"residual {_number(rms, 2)} in log S (a factor {_number(math.exp(rms), 3)}).",
        "",
    ]
    if result.gns_run is not None:
        low, high = value_range(*result.series("b_simple_smoothed"),
                                0.75 * result.gns_run.steps, 1.25 * result.gns_run.steps)
        lines += [
            f"Noise scale: the run at batch {task.gns_batch} with its best learning rate "
            f"({result.gns_run.lr:g}) again, a Cockpit tracking `GradientNoiseScale` "
            f"(smoothing 0.9) every step; it reached the target at step "
            f"{result.gns_run.steps:.1f}, where the smoothed **B_simple = "
            f"{_number(result.b_simple)}** {task.unit} (the network's, `\"all\"`). Over the "
            f"steps within 25% of that one it ranges from {_number(low)} to {_number(high)}: "
            f"how much the comparison hinges on where the value is read.",
            "",
        ]
    lines += [verdict(result), "", f"![{task.name}: steps against examples, and B_simple]"
              f"({figure})", ""]
    return lines


def more_seeds(results, out) -> List[str]:
    """The section on the grid over more training seeds, where ``out`` holds them."""
    sections = [line for r in results for line in seeds_section(out, r.task)]
    if not sections:
        return []
    stored = json.loads((Path(out) / SEED_RESULTS).read_text())
    return [
        "## The grid on more seeds", "",
        "One seed's grid is noisy: its fitted S_min and E_min rest on the fewest steps over "
        "single runs, and a run of another seed lands outside its hyperbola (the fixed batch "
        "at its B_crit averages well above the frontier value 1 in "
        "[adaptive-batch](adaptive-batch.md)). McCandlish et al. 2018 fit runs averaged over "
        "seeds; so does the seed-averaged fit here, which "
        "[adaptive-batch](adaptive-batch.md) uses as its fair frontier. The sections above "
        "are seed 0's.", "",
        *sections,
        f"Measured by (stored in `{SEED_RESULTS}`; `critical_batch_size --seeds` runs only "
        "the grid, with no noise-scale run):", "",
        "```bash", *stored["commands"], "```", "",
    ]


def write_page(results, out, run_info) -> Path:
    """The markdown summary, with the numbers of ``results``; returns its path.

    ``run_info``: the run's ``command``, ``seed``, ``seconds`` and ``versions``
    (and ``"replotted with"``: the commit that redrew them).
    """
    replotted = ""
    if "replotted with" in run_info:
        replotted = (f" The figures and this page were last redrawn with `--replot` at "
                     f"commit {run_info['replotted with']}.")
    lines = [
        "# Does the gradient noise scale predict the critical batch size?", "",
        "<!-- Generated by experiments/critical_batch_size.py; do not edit by hand. -->", "",
        "McCandlish, Kaplan, Amodei et al. 2018, \"An Empirical Model of Large-Batch "
        "Training\" (arXiv:1812.06162), model the steps $S$ and examples $E = BS$ that "
        "batch size $B$ needs to reach a given loss, with the learning rate tuned for each "
        "batch size, as", "",
        "$$", r"\left(\frac{S}{S_{\min}} - 1\right)\left(\frac{E}{E_{\min}} - 1\right) = 1,"
        r"\qquad B_{\text{crit}} = \frac{E_{\min}}{S_{\min}},", "$$", "",
        "and find the critical batch size close to the noise scale, which "
        "[GradientNoiseScale](../gradient-noise-scale.md)'s $B_{\\text{simple}}$ estimates. "
        "Their Figure 4 compares the two on tasks whose critical batch sizes span six "
        "orders of magnitude: the points scatter about equality by up to about an order of "
        "magnitude (OpenAI's blog post on the paper, \"How AI training scales\": the noise "
        "scale explains R² = 80% of the variation of the critical batch size). The check "
        f"here is therefore agreement within a factor {PAPER_FACTOR:g}; the factor itself "
        "is in the table. This page "
        "tests it on two small tasks that train on a CPU.", "",
        "| task | target loss | B_crit (fit) | B_simple at the target | factor apart | "
        f"within {PAPER_FACTOR:g}? |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        factor = agreement_factor(r.b_crit, r.b_simple)
        within = "–" if math.isnan(factor) else ("yes" if factor <= PAPER_FACTOR else "no")
        lines.append(f"| {r.task.name} | {r.task.target:g} | {_number(r.b_crit)} | "
                     f"{_number(r.b_simple)} | {_number(factor, 2)} | {within} |")
    lines.append("")
    for r in results:
        lines += task_section(r, f"critical-batch-size-{r.task.name}.png")
    lines += more_seeds(results, out)
    lines += [
        "## How it is measured", "",
        "- Every run of a task starts from the same initialization (the seed) and draws "
        "its batches from a generator with the same seed. The learning rate is constant.",
        "- Steps to the target: the first crossing of the validation loss, interpolated "
        "between evaluations. At each batch size the learning rate that was best at the "
        "previous one runs first; a run stops (\"pruned\") once it is past the best "
        "run's steps without reaching the target, since only the minimum over the grid "
        "counts. A best learning rate at an edge of the grid is marked: there the "
        "minimum may lie outside it, and the steps are an upper bound.",
        "- The fit: $S = S_{\\min} + E_{\\min}/B$ is the hyperbola with $E = BS$; its "
        "parameters minimize the squared differences of $\\log S$ (relative errors; the "
        "steps span orders of magnitude) under $S_{\\min}, E_{\\min} \\ge 0$. On the "
        "figures' left, the square is the hyperbola's knee $(2E_{\\min}, 2S_{\\min})$, "
        "where $B = B_{\\text{crit}}$; the diamond is the point where $B = B_{\\text{simple}}$.",
        "- $B_{\\text{simple}}$ is measured the way the paper compares it: at the point "
        "of training where the target loss is reached, from the ratio of separately "
        "smoothed estimates of $\\operatorname{tr}(\\Sigma)$ and $|G|^2$, all parameters "
        "together. It ignores curvature ($B_{\\text{noise}}$ weights the covariance by the "
        "Hessian), and under Adam the relevant noise scale is the preconditioned one: "
        "the paper's caveats, which apply here too.",
        "- The digits training set has 1,500 images: at large batches a run sees it "
        "many times over, unlike the paper's large data sets.",
        "",
        "## Reproduce", "",
        "```bash", run_info["command"], "```", "",
        f"Seed {run_info['seed']}; total wall time {run_info['seconds']:.0f} s on one CPU "
        "thread (`torch.set_num_threads(1)`), on a machine shared with other jobs. The "
        f"measured numbers are also in `{RESULTS}`; `--replot` redraws the figures and "
        "rewrites this page from them without training." + replotted, "",
        "| package | version |", "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in run_info["versions"].items()]
    lines.append("")
    path = Path(out) / PAGE
    path.write_text("\n".join(lines))
    return path
