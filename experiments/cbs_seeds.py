"""The fixed-batch grid of :mod:`experiments.critical_batch_size` on more training seeds,
and McCandlish et al.'s hyperbola fitted to the seed-averaged grid.

A frontier fitted to one seed's grid is biased low: its ``S_min, E_min`` come
from the fewest steps over noisy single runs, so a run of another seed (even
the fixed batch at ``B_crit`` itself) lands outside it. McCandlish, Kaplan,
Amodei et al. 2018 (arXiv:1812.06162, section 3) fit averaged runs; here, for
every batch size and learning rate, the steps to the target are averaged over
the seeds that ran that batch size, the best learning rate per batch size is
the one with the fewest mean steps, and the hyperbola is fitted to those means.

    python -m experiments.critical_batch_size --tasks gpt --first-seed 1 --seeds 2

runs the grid (the same batch sizes, learning rates and pruning, on the data
split and validation set of ``--seed``, default 0) for training seeds 1 and 2,
and stores it in ``<out>/critical-batch-size-seeds.json`` beside the seed-0
results of ``critical-batch-size.json``, which it does not touch.
"""

import json
import math
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from experiments import critical_batch_size as cbs

SEED_RESULTS = "critical-batch-size-seeds.json"


# ----------------------------------------------------------------------------
# Pure functions: the seed average
# ----------------------------------------------------------------------------


def steps_bounds(runs) -> Dict[float, Tuple[float, bool]]:
    """One seed's runs at one batch size: ``{lr: (steps, exact)}``.

    A run that reached the target gives its steps, exactly. A pruned run
    stopped once past the best run of its batch size without reaching the
    target, so its steps are above that best, and above the step it stopped
    at where that is recorded (``stopped_at``): the larger is a lower bound
    (``exact`` False). A diverged run, or one that did not reach the target
    within the step budget, gives ``inf`` (exact: the grid's budget is the
    same for every seed).
    """
    best = cbs.best_of(runs)
    bounds = {}
    for run in runs:
        if math.isfinite(run.steps):
            bounds[run.lr] = (run.steps, True)
        elif run.pruned and best is not None:
            stopped = run.stopped_at if math.isfinite(run.stopped_at) else 0.0
            bounds[run.lr] = (max(best.steps, stopped), False)
        else:
            bounds[run.lr] = (math.inf, True)
    return bounds


def seed_means(runs_by_seed) -> Tuple[Dict[float, float], Dict[float, bool]]:
    """Per learning rate, the steps averaged over the seeds, and whether that mean is exact
    (else a lower bound: some seed pruned it, see :func:`steps_bounds`; a rate a seed did not
    run counts as ``inf``, not exact)."""
    per_seed = [steps_bounds(runs) for runs in runs_by_seed.values()]
    mean, exact = {}, {}
    for lr in sorted(set().union(*per_seed)):
        values = [seed.get(lr, (math.inf, False)) for seed in per_seed]
        mean[lr] = float(np.mean([v for v, _ in values]))
        exact[lr] = all(e for _, e in values)
    return mean, exact


def undecided(runs_by_seed) -> List[Tuple[int, float]]:
    """``(seed, lr)`` of the pruned runs whose full length could change the seed-averaged best:
    those of every rate whose mean's lower bound is below the best exact mean (all with a
    finite bound when no rate is exact and finite)."""
    mean, exact = seed_means(runs_by_seed)
    best = min([m for lr, m in mean.items() if exact[lr]], default=math.inf)
    rivals = {lr for lr, m in mean.items() if not exact[lr] and m < best}
    return [(seed, run.lr) for seed, runs in runs_by_seed.items() for run in runs
            if run.lr in rivals and run.pruned]


def averaged_best(runs_by_seed) -> Optional[Tuple[float, float, int]]:
    """The best learning rate of one batch size on the seed-averaged steps.

    Args:
        runs_by_seed: ``{seed: [Run]}``, the runs of one batch size on every
            seed that ran it.

    Returns:
        ``(lr, mean steps, number of seeds)`` of the learning rate with the
        fewest mean steps among those that reached the target on every seed;
        ``None``, with a warning naming the batch size, when no learning rate
        did, or when a learning rate pruned on some seed could still have a
        smaller mean (its lower bound is below the best mean): the seed-averaged
        best is then not known exactly, and is left out rather than guessed
        (:func:`complete` runs those pruned runs to their end).
    """
    if not runs_by_seed:
        return None
    batch = next(iter(runs_by_seed.values()))[0].batch_size
    mean, exact = seed_means(runs_by_seed)
    complete = [lr for lr in mean if exact[lr] and math.isfinite(mean[lr])]
    if not complete:
        warnings.warn(f"batch {batch}: no learning rate reached the target on all "
                      f"{len(runs_by_seed)} seeds; left out of the seed-averaged fit",
                      stacklevel=2)
        return None
    best = min(complete, key=lambda lr: (mean[lr], lr))
    rivals = sorted({lr for _, lr in undecided(runs_by_seed)})
    if rivals:
        warnings.warn(f"batch {batch}: learning rate(s) {', '.join(f'{lr:g}' for lr in rivals)} "
                      f"pruned on some seed could beat {best:g}'s mean of {mean[best]:.1f} "
                      f"steps; left out of the seed-averaged fit", stacklevel=2)
        return None
    return best, mean[best], len(runs_by_seed)


def averaged_grid(grids) -> Dict[int, Tuple[float, float, int]]:
    """``{B: (lr, mean steps, seeds)}`` over ``grids = {seed: {B: [Run]}}`` (see :func:`averaged_best`).

    Each batch size is averaged over the seeds that ran it; batch sizes whose
    best is not known exactly are left out (with a warning).
    """
    batches = sorted({b for grid in grids.values() for b in grid})
    averaged = {}
    for b in batches:
        best = averaged_best({seed: grid[b] for seed, grid in grids.items() if b in grid})
        if best is not None:
            averaged[b] = best
    return averaged


def averaged_fit(grids) -> Tuple[float, float]:
    """``S_min, E_min`` fitted (:func:`cbs.fit_steps_examples`) to the seed-averaged grid."""
    averaged = averaged_grid(grids)
    return cbs.fit_steps_examples(list(averaged), [steps for _, steps, _ in averaged.values()])


# ----------------------------------------------------------------------------
# Reading and measuring
# ----------------------------------------------------------------------------


def runs_of(stored_runs) -> Dict[int, List[cbs.Run]]:
    """``{B: [Run]}`` from the JSON form ``{"B": [run_summary]}``."""
    return {int(b): [cbs.Run(**r) for r in rs] for b, rs in stored_runs.items()}


def with_completed(runs, completed) -> List[cbs.Run]:
    """``runs`` with each pruned run replaced by the run of its learning rate in ``completed``
    (the last of them: a run stopped with a tighter bound, or run to its end)."""
    full = {run.lr: run for run in completed}
    return [full.get(run.lr, run) if run.pruned else run for run in runs]


def load_grids(folder, task_name) -> Dict[int, Dict[int, List[cbs.Run]]]:
    """``{seed: {B: [Run]}}`` of one task: the page's seed from ``critical-batch-size.json``
    and the others from ``critical-batch-size-seeds.json`` (when it exists), on one data split,
    each pruned run replaced by its full run where :func:`complete` ran it."""
    folder = Path(folder)
    main = json.loads((folder / cbs.RESULTS).read_text())
    result = next(r for r in main["results"] if r["task"] == task_name)
    grids = {main["seed"]: runs_of(result["runs"])}
    path = folder / SEED_RESULTS
    if path.exists():
        seeds = json.loads(path.read_text())
        if seeds["data_seed"] != main["seed"] or seeds["quick"] != main["quick"]:
            raise ValueError(f"{path} is of data seed {seeds['data_seed']} (quick "
                             f"{seeds['quick']}), {cbs.RESULTS} of {main['seed']} "
                             f"({main['quick']}): not one grid")
        for seed, entry in seeds["grids"].get(task_name, {}).items():
            if entry["target"] != result["target"]:
                raise ValueError(f"{path}: seed {seed} of {task_name} is at target "
                                 f"{entry['target']}, not {result['target']}")
            grids[int(seed)] = runs_of(entry["runs"])
        for seed, batches in seeds.get("completed", {}).get(task_name, {}).items():
            for b, runs in runs_of(batches).items():
                grids[int(seed)][b] = with_completed(grids[int(seed)][b], runs)
    return grids


def decisive_steps(runs_by_seed, seed, lr) -> float:
    """Past how many steps seed ``seed``'s run of ``lr`` cannot make ``lr`` the best: the
    steps at which its rate's mean, with the other seeds' bounds, reaches the best exact mean
    (``inf`` without one). A run stopped there leaves a bound that settles it."""
    mean, exact = seed_means(runs_by_seed)
    best = min([m for r, m in mean.items() if exact[r]], default=math.inf)
    others = sum(steps_bounds(runs).get(lr, (math.inf, False))[0]
                 for s, runs in runs_by_seed.items() if s != seed)
    return len(runs_by_seed) * best - others


def complete(task, grids, log=print, on_run=None) -> None:
    """Run on, past its pruning, each pruned run that could change the seed-averaged best
    (:func:`undecided`), until none is left: each to the target, or until it passes
    :func:`decisive_steps` (then its bound settles it). ``grids`` is updated in place and
    ``on_run(seed, run)`` called after each run (to store it).

    The runs of the rate pruned on the fewest seeds go first: that rate is the soonest exact,
    and its exact mean bounds the others' runs (they stop at :func:`decisive_steps`, or are
    settled without a run), where in seed order every run of every rate may run to its end."""
    for b in sorted({b for grid in grids.values() for b in grid}):
        runs_by_seed = {seed: grid[b] for seed, grid in grids.items() if b in grid}
        while todo := undecided(runs_by_seed):  # each round leaves fewer undecided runs
            pruned_seeds = Counter(lr for _, lr in todo)
            for seed, lr in sorted(todo, key=lambda run: pruned_seeds[run[1]]):  # stable
                if (seed, lr) not in undecided(runs_by_seed):  # settled by an earlier run
                    continue
                start = time.perf_counter()
                run = cbs.train(task, b, lr, seed, max_steps=task.max_steps,
                                stop_after=decisive_steps(runs_by_seed, seed, lr))
                grids[seed][b] = runs_by_seed[seed] = with_completed(runs_by_seed[seed], [run])
                log(f"  {task.name} B={b} lr={lr:g} seed {seed}, run on: {run.outcome()}"
                    + (f" at step {run.stopped_at:g}" if run.pruned else "")
                    + f" ({time.perf_counter() - start:.1f} s)")
                if on_run is not None:
                    on_run(seed, run)


def measure_seeds(tasks, names, seeds, batch_sizes, out, command, run_info, log=print) -> dict:
    """The grid of every task of ``names`` for every training seed of ``seeds``.

    Stored in ``<out>/critical-batch-size-seeds.json`` after every batch size;
    a seed stored incomplete resumes at its first missing batch size (its
    first learning rate the best of the last one stored, as the sweep would).
    Then, over every seed stored for the task (the results' own seed in
    ``<out>/critical-batch-size.json`` too), the pruned runs that could change
    the seed-averaged best run in full (:func:`complete`), stored under
    ``"completed"``; the results' file is not touched.
    """
    path = Path(out) / SEED_RESULTS
    stored = json.loads(path.read_text()) if path.exists() else {
        "data_seed": run_info["seed"], "quick": run_info["quick"], "commands": [], "grids": {}}
    if (stored["data_seed"], stored["quick"]) != (run_info["seed"], run_info["quick"]):
        raise ValueError(f"{path} holds data seed {stored['data_seed']} (quick "
                         f"{stored['quick']}); this run is of {run_info['seed']} "
                         f"({run_info['quick']})")
    stored["commands"].append(command)
    stored["versions"] = run_info["versions"]
    for name in names:
        task = tasks[name]
        for seed in seeds:
            entry = stored["grids"].setdefault(name, {}).setdefault(
                str(seed), {"target": task.target, "runs": {}, "seconds": 0.0,
                            "complete": False})
            done = runs_of(entry["runs"])
            todo = [b for b in batch_sizes if b not in done]
            if not todo:
                continue
            last = cbs.best_of(done[max(done)]) if done else None
            clock = {"since": time.perf_counter()}

            def store(b, runs, entry=entry, clock=clock):
                entry["runs"][str(b)] = [cbs.run_summary(r) for r in runs]
                now = time.perf_counter()
                entry["seconds"] += now - clock["since"]
                clock["since"] = now
                path.write_text(json.dumps(stored, indent=1))

            log(f"{name} seed {seed}:")
            cbs.sweep(task, todo, seed, log, first_lr=None if last is None else last.lr,
                      on_batch=store)
            entry["complete"] = all(str(b) in entry["runs"] for b in batch_sizes)
            path.write_text(json.dumps(stored, indent=1))
        completed = stored.setdefault("completed", {}).setdefault(name, {})

        def store_full(seed, run, completed=completed):
            done = completed.setdefault(str(seed), {}).setdefault(str(run.batch_size), [])
            done.append({**cbs.run_summary(run), "stopped_at": run.stopped_at})
            path.write_text(json.dumps(stored, indent=1))

        log(f"{name}: the pruned runs that could change the seed-averaged best, in full:")
        complete(task, load_grids(out, name), log, store_full)
    return stored


# ----------------------------------------------------------------------------
# The page's section
# ----------------------------------------------------------------------------


def _n(value, digits=3):
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def seeds_section(folder, task) -> List[str]:
    """The critical-batch-size page's section on the grid over seeds (empty with one seed)."""
    grids = load_grids(folder, task.name)
    if len(grids) < 2:
        return []
    seeds = sorted(grids)
    stored = json.loads((Path(folder) / SEED_RESULTS).read_text())
    completed = sum(len(runs) for batches in stored.get("completed", {}).get(task.name, {})
                    .values() for runs in batches.values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        averaged = averaged_grid(grids)
        fits = {seed: cbs.fit_steps_examples(*zip(*[(b, r.steps) for b, r in (
            (b, cbs.best_of(runs)) for b, runs in grids[seed].items()) if r is not None]))
            for seed in seeds}
        s_min, e_min = cbs.fit_steps_examples(list(averaged),
                                              [s for _, s, _ in averaged.values()])
    lines = [
        f"### {task.name}: the grid on training seeds {', '.join(map(str, seeds))}", "",
        "The same batch sizes, learning rates and pruning, on the same data split and "
        "validation set; only the initialization and the draws of batches change with the "
        "seed. Best learning rate and steps per seed, and the seed-averaged grid: for each "
        "learning rate the steps averaged over the seeds, the best learning rate on those "
        "means. A run pruned on some seed whose full length could change that best was run "
        "on past its pruning (the runs of the rate pruned on the fewest seeds first), to the "
        "target or until its steps were enough to rule it out "
        f"({completed} such runs here); the other pruned runs are bounded below by their "
        "seed's best, and cannot change it.", "",
        "| batch B | " + " | ".join(f"seed {s}" for s in seeds) + " | averaged: best lr | "
        "mean steps S | mean examples E |",
        "|---|" + "---|" * len(seeds) + "---|---|---|",
    ]
    for b in sorted({b for grid in grids.values() for b in grid}):
        cells = []
        for seed in seeds:
            best = cbs.best_of(grids[seed].get(b, []))
            cells.append("not run" if b not in grids[seed] else "not reached" if best is None
                         else f"{best.lr:g}: {best.steps:.1f}")
        lr, steps, count = averaged.get(b, (math.nan, math.nan, 0))
        tail = (f"{lr:g} | {steps:.1f} | {b * steps:,.0f}" if b in averaged
                else "left out (see below) | – | –")
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {tail} |")
    lines += [
        "",
        "| fit | S_min | E_min | B_crit |", "|---|---|---|---|",
        f"| seed-averaged grid | {_n(s_min, 4)} | {_n(e_min, 4)} | "
        f"**{_n(cbs.critical_batch(s_min, e_min))}** |",
        *(f"| seed {seed} alone | {_n(f[0], 4)} | {_n(f[1], 4)} | "
          f"{_n(cbs.critical_batch(*f))} |" for seed, f in fits.items()),
        "",
    ]
    notes = sorted({str(w.message) for w in caught})
    if notes:
        lines += ["Warnings of the fits and the average:", "", *(f"- {m}" for m in notes), ""]
    return lines
