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
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import scipy.stats

from experiments import cbs_seeds
from experiments import critical_batch_size as cbs
from experiments.adaptive_batch import ARMS, FIXED_AVG, fixed_batch, frontier_value, run_from_json
from experiments.pages import seed_ranges

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
    diffs = paired_values(values, reference)
    n = len(diffs)
    return {"n": n, "mean": float(np.mean(diffs)) if n else math.nan,
            "se": float(np.std(diffs, ddof=1) / math.sqrt(n)) if n > 1 else math.nan}


def one_sided_t(values, null=0.0) -> Dict[str, float]:
    """Student's t test of ``mean <= null`` against ``mean < null`` over independent seeds.

    ``t = (mean - null) / (sd / sqrt(n))`` (``sd`` with ``ddof=1``), ``p`` its lower tail under
    Student's t with ``n - 1`` degrees of freedom: the chance of a mean this far below
    ``null`` if the true mean were ``null``. It assumes the values independent (one run per
    seed) and their mean normal (exact for normal values, by the central limit theorem
    otherwise); ``S_min, E_min`` are taken as known, so the frontier's own error is not in it.
    """
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n < 2:
        return {"n": n, "t": math.nan, "p": math.nan}
    below, sd = x.mean() - null, x.std(ddof=1)
    # Values without spread: the mean is certainly off the null (t infinite), or on it.
    t = below / (sd / math.sqrt(n)) if sd > 0 else (math.copysign(math.inf, below) if below
                                                     else math.nan)
    return {"n": n, "t": float(t), "p": float(scipy.stats.t.cdf(t, n - 1))}


def sign_test(values, null=0.0) -> Dict[str, float]:
    """How many values lie below ``null``, and the one-sided sign test's ``p``: the chance of at
    least that many of ``n`` below if each were below or above with probability 1/2 (the
    median at ``null``), ``P(Binomial(n, 1/2) >= below)``; values equal to ``null`` left out.
    It assumes only independent seeds, not normal values."""
    x = np.asarray(values, dtype=float)
    x = x[x != null]
    n, below = len(x), int(np.sum(x < null))
    return {"n": n, "below": below,
            "p": float(scipy.stats.binom.sf(below - 1, n, 0.5)) if n else math.nan}


def bootstrap_mean(values, null=0.0, resamples=10_000, level=0.95, seed=0) -> Dict[str, float]:
    """The bootstrap over seeds of the values' mean (Efron 1979): ``resamples`` means of ``n``
    values drawn with replacement; the percentile interval at ``level`` and the share of the
    resampled means at or above ``null`` (a one-sided bootstrap ``p`` of ``mean < null``).
    It assumes independent seeds and that the seeds at hand stand for their distribution; with
    few seeds the interval is too narrow (the resampled spread is the plug-in one, ``(n-1)/n``
    of the sample variance)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return {"low": math.nan, "high": math.nan, "share_at_or_above": math.nan}
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return {"low": float(low), "high": float(high),
            "share_at_or_above": float(np.mean(means >= null))}


def below_tests(values, null) -> Dict[str, object]:
    """Every test of "the mean lies below ``null``" on one set of values (one per seed):
    mean and standard error, :func:`one_sided_t`, :func:`sign_test`, :func:`bootstrap_mean`."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    return {"n": n, "mean": float(x.mean()) if n else math.nan,
            "se": float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
            "t": one_sided_t(x, null), "sign": sign_test(x, null),
            "bootstrap": bootstrap_mean(x, null)}


def paired_values(values, reference) -> List[float]:
    """``values[seed] - reference[seed]`` over the seeds both have, in seed order."""
    return [values[seed] - reference[seed] for seed in sorted(values) if seed in reference]


def seeds_needed(sd, distance, standard_errors=2.0) -> int:
    """Seeds for a mean ``distance`` from the null to lie ``standard_errors`` standard errors
    from it: ``n >= (standard_errors * sd / distance)^2``, rounded up (the power calculation;
    ``standard_errors = 1.96 + 0.84`` gives 80% power of a one-sided test at 2.5%)."""
    return math.ceil((standard_errors * sd / distance) ** 2)


def seed_steps(grids, best_lr) -> Dict[int, List[float]]:
    """``{B: steps of each seed}`` at each batch's seed-averaged best rate ``best_lr[B]``, for
    the batches every seed of ``grids`` ran to the target there (seeds in sorted order)."""
    seeds = sorted(grids)
    steps = {b: [cbs_seeds.steps_bounds(grids[s].get(b, [])).get(lr) for s in seeds]
             for b, lr in sorted(best_lr.items())}
    return {b: [bound[0] for bound in bounds] for b, bounds in steps.items()
            if all(bound is not None and bound[1] and math.isfinite(bound[0])
                   for bound in bounds)}


def resampled_frontiers(steps_by_batch, resamples=400, seed=0) -> np.ndarray:
    """``[resamples, 2]``: ``S_min, E_min`` refitted (:func:`cbs.fit_steps_examples`) to the
    grid's mean steps over grid seeds drawn with replacement, one seed's runs at every batch
    together (they share its initialization); ``steps_by_batch`` from :func:`seed_steps`.

    Each batch keeps the learning rate the whole grid chose for it: the resamples carry the
    steps' seed noise, not the choice of the best rate among noisy means (which, redone per
    resample, would favour a lucky rate and lower the frontier further)."""
    batches = list(steps_by_batch)
    if len(batches) < 2:  # no hyperbola to refit
        return np.empty((0, 2))
    steps = np.asarray([steps_by_batch[b] for b in batches], dtype=float).T  # [seed, batch]
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(steps), size=(resamples, len(steps)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a resample at a bound is a resample
        return np.asarray([cbs.fit_steps_examples(batches, steps[rows].mean(axis=0))
                           for rows in drawn])


def two_level_bootstrap(steps, examples, frontiers, null=1.0, reference=None, level=0.95,
                        seed=0) -> Dict[str, float]:
    """The mean frontier value with the frontier's own error: for each resampled frontier
    ``(S_min, E_min)`` (:func:`resampled_frontiers`), the arm's seeds drawn with replacement.

    With ``reference = (steps, examples)`` of another arm on the same seeds (in the same
    order), the mean of the paired differences instead. Returns the percentile interval at
    ``level``, the share of resampled means at or above ``null``, and ``frontier_sd``: the
    standard deviation over the frontiers of the mean over all the arm's seeds (the
    frontier's part alone). It draws the arm's seeds independently of the grid's, although the
    seeds both ran share an initialization; a seed that is hard for the grid is hard for the
    arm too, so the independent draws widen the interval (conservative)."""
    def values(s, e, fronts):
        return (s / fronts[:, :1] - 1.0) * (e / fronts[:, 1:] - 1.0)

    s, e = np.asarray(steps, dtype=float), np.asarray(examples, dtype=float)
    fronts = np.asarray(frontiers, dtype=float)
    fronts = fronts[np.all(np.isfinite(fronts) & (fronts > 0), axis=1)]
    if len(s) < 2 or not len(fronts):
        return {"low": math.nan, "high": math.nan, "share_at_or_above": math.nan,
                "frontier_sd": math.nan}
    per_seed = values(s[None, :], e[None, :], fronts)  # [frontier, seed]
    if reference is not None:
        rs, re = (np.asarray(x, dtype=float) for x in reference)
        per_seed = per_seed - values(rs[None, :], re[None, :], fronts)
    # A stream apart from resampled_frontiers' (the same seed would draw the arm's seeds as
    # the grid's, matched: a joint resample of the seeds both ran, not the independent one).
    rng = np.random.default_rng([seed, 1])
    drawn = rng.integers(0, len(s), size=per_seed.shape)
    means = np.take_along_axis(per_seed, drawn, axis=1).mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return {"low": float(low), "high": float(high),
            "share_at_or_above": float(np.mean(means >= null)),
            "frontier_sd": float(np.std(per_seed.mean(axis=1), ddof=1))}


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
            + (f"grid seeds {seed_ranges(seeds)}" if seeds else "one seed's grid: "
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
        return values_by_seed(runs, arm, s_min, e_min)

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


def values_by_seed(runs, arm, s_min, e_min, of="value") -> Dict[int, float]:
    """``{seed: x}`` of ``arm``'s runs that reached the target: ``x`` its frontier value
    (``of="value"``), its ``"steps"`` or its ``"examples"``."""
    def pick(run):
        if of == "value":
            return frontier_value(run.steps, run.examples, s_min, e_min)
        return getattr(run, of)

    return {r.seed: pick(r) for r in runs if r.arm == arm and math.isfinite(r.steps)}


def _p(value) -> str:
    return f"{value:.2g}" if math.isfinite(value) else "–"


def _tested(label, tests) -> str:
    boot, sign = tests["bootstrap"], tests["sign"]
    return (f"| {label} | {tests['n']} | {_n(tests['mean'])} ± {_n(tests['se'], 2)} | "
            f"{_p(tests['t']['p'])} | {_n(boot['low'])} to {_n(boot['high'])} | "
            f"{_p(boot['share_at_or_above'])} | {sign['below']} of {sign['n']} "
            f"({_p(sign['p'])}) |")


def tests_table(fair, runs, frontiers=None) -> List[str]:
    """Whether each arm's mean value lies below 1 and each adaptive arm's below the fixed
    batch at ``B_crit`` and the warmup on the same seeds, against the seed-averaged frontier
    ``fair``: :func:`below_tests` on the values, and on the paired differences; with
    ``frontiers`` (:func:`resampled_frontiers`), the same with the frontier's own error
    (:func:`two_level_bootstrap`); then the warmup target seed by seed."""
    if fair is None:
        return []
    s_min, e_min = fair.s_min, fair.e_min
    arms = [arm for arm in ARMS if values_by_seed(runs, arm, s_min, e_min)]
    references = [arm for arm in (FIXED_AVG, "warmup") if arm in arms]
    adaptive = [arm for arm in arms if arm.startswith("adaptive")]
    head = ("| seeds | mean ± s.e. | t test: p | bootstrap 95% interval of the mean | "
            "bootstrap: share of means ≥ {null} | seeds below {null} (sign test: p) |")
    lines = [
        "", "Tested over seeds, against the seed-averaged frontier. Each p is one-sided, of one "
        "comparison (none corrected for the several in these tables). The t test assumes "
        "independent seeds and a normal mean; the sign test only independent seeds; the "
        "bootstrap (10,000 resamples of the seeds, percentile interval) that the seeds at hand "
        "stand for their distribution. All three take S_min and E_min as known: the "
        "frontier's own error, shared by every arm, is in none of them (it cancels in the "
        "paired differences only in so far as it shifts both arms alike; the third table "
        "adds it, where the grid's seeds are at hand).", "",
        "| arm " + head.format(null=1), "|---|---|---|---|---|---|---|",
        *(_tested(arm, below_tests(list(values_by_seed(runs, arm, s_min, e_min).values()),
                                   1.0)) for arm in arms), "",
        "The adaptive arms' values minus the references' on the same seeds (below 0: the arm "
        "lies further inside the frontier):", "",
        "| arm minus reference " + head.format(null=0), "|---|---|---|---|---|---|---|",
        *(_tested(f"{arm} − {ref}", below_tests(paired_values(
            values_by_seed(runs, arm, s_min, e_min), values_by_seed(runs, ref, s_min, e_min)),
            0.0)) for arm in adaptive for ref in references), ""]
    if frontiers is not None and len(frontiers):
        lines += frontier_error_rows(runs, arms, adaptive, references, frontiers)
    if "warmup" in arms:
        lines += warmup_target_rows(runs, adaptive, s_min, e_min)
    return lines


def frontier_error_rows(runs, arms, adaptive, references, frontiers) -> List[str]:
    """The tests table's rows with the frontier's own error: :func:`two_level_bootstrap` of
    each arm's mean value and of each adaptive arm's paired difference."""
    def steps_examples(arm, seeds=None):
        done = {r.seed: r for r in runs if r.arm == arm and math.isfinite(r.steps)}
        chosen = sorted(done) if seeds is None else seeds
        return [done[k].steps for k in chosen], [done[k].examples for k in chosen]

    def row(label, boot, n):
        return (f"| {label} | {n} | {_n(boot['low'])} to {_n(boot['high'])} | "
                f"{_p(boot['share_at_or_above'])} | {_n(boot['frontier_sd'], 2)} |")

    rows = []
    for arm in arms:
        steps, examples = steps_examples(arm)
        rows.append(row(arm, two_level_bootstrap(steps, examples, frontiers), len(steps)))
    for arm in adaptive:
        for ref in references:
            common = sorted({r.seed for r in runs if r.arm == arm and math.isfinite(r.steps)}
                            & {r.seed for r in runs if r.arm == ref and math.isfinite(r.steps)})
            boot = two_level_bootstrap(*steps_examples(arm, common), frontiers, null=0.0,
                                       reference=steps_examples(ref, common))
            rows.append(row(f"{arm} − {ref}", boot, len(common)))
    return [f"With the frontier's own error too: the grid's seeds drawn with replacement and "
            f"the hyperbola refitted to their mean steps ({len(frontiers)} refits, each batch at "
            "the learning rate the whole grid chose for it), and for each refit the arm's seeds "
            "drawn with replacement, independently (the seeds both ran share an "
            "initialization, so this overstates the spread). Last column: the standard "
            "deviation over the refits of the mean over all the arm's seeds, the frontier's "
            "part alone. The null is 1 for an arm, 0 for a difference.", "",
            "| arm, or arm minus reference | seeds | 95% interval of the mean | share of "
            "means ≥ the null | the frontier's part (sd) |", "|---|---|---|---|---|",
            *rows, ""]


def warmup_target_rows(runs, arms, s_min, e_min) -> List[str]:
    """The warmup target (at most the warmup's steps at no more of its examples) seed by seed:
    each arm's steps and examples minus the warmup's of the same seed."""
    rows = []
    warm = {of: values_by_seed(runs, "warmup", s_min, e_min, of) for of in ("steps", "examples")}
    for arm in arms:
        diffs = {of: paired_values(values_by_seed(runs, arm, s_min, e_min, of), warm[of])
                 for of in warm}
        steps, examples = np.asarray(diffs["steps"]), np.asarray(diffs["examples"])
        if len(steps) < 2:
            continue
        se = {of: float(np.std(d, ddof=1) / math.sqrt(len(d))) for of, d in diffs.items()}
        rows.append(f"| {arm} | {len(steps)} | {steps.mean():+.3g} ± {_n(se['steps'], 2)} "
                    f"({_p(one_sided_t(steps)['p'])}) | {examples.mean():+,.0f} ± "
                    f"{se['examples']:,.0f} ({_p(one_sided_t(examples)['p'])}) | "
                    f"{int(np.sum(steps <= 0))} | {int(np.sum(examples <= 0))} | "
                    f"{int(np.sum((steps <= 0) & (examples <= 0)))} |")
    if not rows:
        return []
    return ["The warmup target seed by seed: each arm's steps and examples minus the warmup's "
            "on the same seed (mean ± s.e., in brackets the t test's one-sided p of a mean "
            "below 0), and how many seeds meet each part and both.", "",
            "| arm | seeds | steps minus the warmup's (p) | examples minus the warmup's (p) | "
            "seeds at most its steps | seeds at most its examples | seeds meeting both |",
            "|---|---|---|---|---|---|---|", *rows, ""]


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
    runs = [run_from_json(r) for r in entry["runs"]]
    frontiers = (None if fair is None or grids is None
                 else resampled_frontiers(seed_steps(grids, fair.best_lr)))
    return [*fixed_avg_bullet(entry.get(FIXED_AVG)), *check_table(fair, grids, runs),
            *tests_table(fair, runs, frontiers)]


def grids_of(grid_path, task) -> Optional[Dict[int, dict]]:
    """The grids of ``task`` over its seeds beside ``grid_path`` (None with one seed)."""
    grids = cbs_seeds.load_grids(Path(grid_path).parent, task.name)
    return grids if len(grids) > 1 else None

