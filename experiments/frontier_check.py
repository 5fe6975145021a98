"""The sanity check of :mod:`experiments.adaptive_batch`: what a fixed batch at ``B_crit``
should come to on the fitted frontier, and how far the mean of one-seed values is biased.

A run's frontier value ``f(S, E) = (S / S_min - 1)(E / E_min - 1)`` (McCandlish et al. 2018,
arXiv:1812.06162, eq. 2.11) is bilinear in its steps ``S`` and examples ``E``. Over runs of
one arm on different seeds, with ``S_min, E_min`` fixed, the mean value is therefore exactly

    mean_i f(S_i, E_i) = f(mean S, mean E) + cov(S, E) / (S_min E_min)

(``cov`` the population covariance over the runs; the second-order expansion of ``f`` has no
higher terms, so the delta method is exact here). For a fixed batch ``B``, ``E = B S`` and the
second term is ``B var(S) / (S_min E_min)``. The hyperbola is fitted to the seed-averaged
steps, so the *mean run* at ``B_crit`` lies on it (``f = 1``), while the mean of the runs'
own values lies above 1 by the spread term: noisy steps alone lift it. This module computes
both parts for the grid's own runs at the batches around ``B_crit`` and for every arm, and
the ``fixed-avg`` arm's settings: the fixed batch at the seed-averaged grid's ``B_crit``
with that grid's best learning rate.
"""

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from experiments import cbs_seeds
from experiments.adaptive_batch import ARMS, FIXED_AVG, fixed_batch, frontier_value, run_from_json

# ----------------------------------------------------------------------------
# Pure functions: the formulas
# ----------------------------------------------------------------------------


def mean_run_value(steps, examples, s_min, e_min) -> float:
    """``f(mean S, mean E)``: the frontier value of the mean run over seeds."""
    return frontier_value(float(np.mean(steps)), float(np.mean(examples)), s_min, e_min)


def spread_term(steps, examples, s_min, e_min) -> float:
    """``cov(S, E) / (S_min E_min)``, the population covariance over the runs: how far the mean
    of the runs' frontier values lies above the value of their mean run (exactly, ``f`` being
    bilinear); for a fixed batch ``B``, ``B var(S) / (S_min E_min)``."""
    s, e = np.asarray(steps, dtype=float), np.asarray(examples, dtype=float)
    return float(np.mean((s - s.mean()) * (e - e.mean())) / (s_min * e_min))


def check_row(steps, examples, s_min, e_min) -> Dict[str, float]:
    """Over runs that reached the target: ``n``, the mean frontier value and its standard error
    over the runs, the value of the mean run and the spread term (``mean = mean_run + spread``)."""
    values = [frontier_value(s, e, s_min, e_min) for s, e in zip(steps, examples)]
    n = len(values)
    return {"n": n, "mean": float(np.mean(values)),
            "se": float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
            "mean_run": mean_run_value(steps, examples, s_min, e_min),
            "spread": spread_term(steps, examples, s_min, e_min)}


def paired_difference(values, reference) -> Dict[str, float]:
    """``values - reference`` over the seeds both have (``{seed: value}`` each): the mean
    difference and its standard error over those seeds, ``n`` of them. Runs of one seed share
    the initialization and the draws of examples, so the pairs cancel what the seed adds to both."""
    diffs = [values[seed] - reference[seed] for seed in sorted(values) if seed in reference]
    n = len(diffs)
    return {"n": n, "mean": float(np.mean(diffs)) if n else math.nan,
            "se": float(np.std(diffs, ddof=1) / math.sqrt(n)) if n > 1 else math.nan}


def bracketing_batches(batches: Sequence[int], b_crit) -> List[int]:
    """The measured batches next to ``b_crit``: the largest at or below it and the smallest at or
    above it (one batch when ``b_crit`` is measured or outside the range)."""
    below = [b for b in batches if b <= b_crit]
    above = [b for b in batches if b >= b_crit]
    return sorted({*(below[-1:] if below else []), *(above[:1] if above else [])})


def nearest_batch(batches: Sequence[int], batch) -> int:
    """The measured batch nearest ``batch`` in log scale (the smaller on a tie)."""
    return min(batches, key=lambda b: (abs(math.log(b / batch)), b))


def grid_steps(grids, batch, lr) -> List[float]:
    """Steps of every seed's run of ``(batch, lr)`` in ``grids = {seed: {B: [Run]}}`` that ran
    it, where they are exact (a pruned run's bound is left out: not a run's steps)."""
    steps = []
    for grid in grids.values():
        bound = cbs_seeds.steps_bounds(grid.get(batch, [])).get(lr)
        if bound is not None and bound[1] and math.isfinite(bound[0]):
            steps.append(bound[0])
    return steps


def fixed_at_average(baseline) -> Dict[str, object]:
    """The ``fixed-avg`` arm's settings from a (seed-averaged) baseline: ``B_crit`` rounded
    (as the ``fixed`` arm rounds its own) and the grid's best learning rate at the measured
    batch nearest it in log scale (not interpolated: the rates are a factor-2 ladder and the
    best one is a choice among them), with what they rest on."""
    batch = fixed_batch(baseline)  # one rounding for both fixed arms
    nearest = nearest_batch(list(baseline.best_lr), batch)
    return {"batch": batch, "lr": baseline.best_lr[nearest], "lr_of_batch": nearest,
            "b_crit": baseline.b_crit, "s_min": baseline.s_min, "e_min": baseline.e_min,
            "grid_seeds": list(baseline.seeds), "source": baseline.source}


# ----------------------------------------------------------------------------
# The page's lines
# ----------------------------------------------------------------------------


def _n(value, digits=3):
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def fixed_avg_bullet(settings) -> List[str]:
    """The page's bullet on the ``fixed-avg`` arm (empty when it did not run)."""
    if not settings:
        return []
    seeds = settings["grid_seeds"]
    return [f"- {FIXED_AVG} (the sanity check on the grid the arms are judged against): batch "
            f"{settings['batch']}, the seed-averaged grid's B_crit {_n(settings['b_crit'])} "
            f"rounded (S_min {_n(settings['s_min'], 4)}, E_min {_n(settings['e_min'], 4)}, "
            + (f"grid seeds {', '.join(map(str, seeds))}" if seeds else "one seed's grid: "
               "--quick") + " when it ran), learning rate "
            f"{settings['lr']:g}, that grid's best at its measured batch nearest it in log scale "
            f"({settings['lr_of_batch']}; taken, not interpolated: the rates are a factor-2 "
            "ladder); no tuning run."]


def check_table(fair, grids, runs) -> List[str]:
    """The sanity check analysed against the seed-averaged frontier ``fair``: the grid's own
    runs at the batches around ``B_crit`` (each seed's run at the averaged best rate) and every
    arm, each as mean value = value of the mean run + spread term."""
    if fair is None or grids is None:
        return []
    s_min, e_min = fair.s_min, fair.e_min
    batches = sorted(fair.best_lr)
    near = nearest_batch(batches, fair.b_crit)
    rows = []
    for b in bracketing_batches(batches, fair.b_crit):
        steps = grid_steps(grids, b, fair.best_lr[b])
        if steps:
            label = f"grid, batch {b}, lr {fair.best_lr[b]:g}" + (
                " (nearest B_crit)" if b == near else "")
            rows.append((label, check_row(steps, [b * s for s in steps], s_min, e_min)))
    def by_seed(arm):
        return {r.seed: frontier_value(r.steps, r.examples, s_min, e_min) for r in runs
                if r.arm == arm and math.isfinite(r.steps)}

    reference = by_seed(FIXED_AVG)
    for arm in ARMS:
        done = [r for r in runs if r.arm == arm and math.isfinite(r.steps)]
        if done:
            row = check_row([r.steps for r in done], [r.examples for r in done], s_min, e_min)
            row["paired"] = None if arm == FIXED_AVG else paired_difference(by_seed(arm),
                                                                             reference)
            rows.append((arm, row))
    return [
        "", f"The sanity check analysed, against the seed-averaged frontier (B_crit "
        f"{_n(fair.b_crit)}). A run's value f = (S/S_min - 1)(E/E_min - 1) is bilinear in its "
        "steps and examples, so over seeds the mean value is exactly the value of the mean run "
        "plus the spread term cov(S, E) / (S_min E_min) (for a fixed batch B: B var(S) / "
        "(S_min E_min)). The fit is to the mean runs: a fixed batch whose mean run lies on the "
        "hyperbola has mean value 1 plus its spread term, not 1. The grid's rows are its own "
        "runs, one per seed, at the seed-averaged best learning rate of that batch: what a "
        "fixed batch there comes to on this frontier. The last column: the arm's value minus "
        f"{FIXED_AVG}'s on the same seeds (mean ± s.e. over the pairs; seeds compared): below "
        "0 beats the fixed batch at this frontier's own B_crit.", "",
        "| runs | seeds reached | mean value ± s.e. | value of the mean run | spread term | "
        f"minus {FIXED_AVG}, same seeds |",
        "|---|---|---|---|---|---|",
        *(f"| {label} | {row['n']} | {_n(row['mean'])} ± {_n(row['se'], 2)} | "
          f"{_n(row['mean_run'])} | {_n(row['spread'], 2)} | "
          + ("–" if label.startswith("grid") else _paired(row["paired"]))
          + " |" for label, row in rows), ""]


def _paired(paired) -> str:
    if paired is None:
        return "the reference"
    if paired["n"] < 2:
        return "–"
    return f"{paired['mean']:+.3g} ± {_n(paired['se'], 2)} ({paired['n']})"


def task_lines(entry, fair, grids) -> List[str]:
    """The lines :mod:`experiments.adaptive_batch_page` adds to a task's section: the
    ``fixed-avg`` bullet and the sanity check's table (``fair``, ``grids``: the seed-averaged
    baseline and the grids it averages, None without them)."""
    return [*fixed_avg_bullet(entry.get(FIXED_AVG)),
            *check_table(fair, grids, [run_from_json(r) for r in entry["runs"]])]


def grids_of(grid_path, task) -> Optional[Dict[int, dict]]:
    """The grids of ``task`` over its seeds beside ``grid_path`` (None with one seed)."""
    grids = cbs_seeds.load_grids(Path(grid_path).parent, task.name)
    return grids if len(grids) > 1 else None

