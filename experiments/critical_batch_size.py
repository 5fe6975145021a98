"""Does the gradient noise scale predict the critical batch size?

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training" (arXiv:1812.06162): the steps ``S`` and examples ``E = B S`` that
batch size ``B`` needs to reach a fixed loss (learning rate tuned per batch
size) follow ``(S / S_min - 1) (E / E_min - 1) = 1``, that is
``S = S_min + E_min / B``; the critical batch size ``B_crit = E_min / S_min``
is close to the noise scale, which ``B_simple = tr(Sigma) / |G|^2``
approximates. For each task this script trains every batch size of
``--batch-sizes`` with every learning rate of the task's grid until the
validation loss reaches the task's target, fits ``S_min, E_min``, measures
``GradientNoiseScale``'s smoothed ``B_simple`` along one more run, and writes
a figure per task and a markdown page with the numbers to ``--out``.

    python -m experiments.critical_batch_size --out docs/experiments
    python -m experiments.critical_batch_size --quick --out /tmp/cbs

The tasks: the digits CNN of ``experiments.train_digits`` (plain SGD), and a
character-level GPT (``experiments.models.GPT``, Adam) trained on source
files of Python's own standard library. Nothing downloads.
"""

import argparse
import json
import math
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import cockpit_gradnoise as cgn

import backpack
import matplotlib
import matplotlib.ticker
import numpy as np
import scipy
import scipy.optimize
import torch
from cockpit.utils.schedules import linear

# The tasks (experiments/cbs_tasks.py), named here as the scripts and tests use them.
from experiments.cbs_tasks import (  # noqa: F401 (VOCABULARY, encode_text: the tests)
    VOCABULARY,
    Task,
    digits_task,
    encode_text,
    gpt_task,
    stdlib_text,
)

#: Batch sizes of the full run: 8 to 512 in powers of two.
BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512)
#: The factor within which McCandlish et al.'s Figure 4 shows B_simple and
#: B_crit agreeing across their tasks (roughly an order of magnitude).
PAPER_FACTOR = 10.0
PAGE = "critical-batch-size.md"
RESULTS = "critical-batch-size.json"


# ----------------------------------------------------------------------------
# Pure functions: the formulas
# ----------------------------------------------------------------------------


def steps_to_target(steps, losses, target) -> float:
    """First step at which ``losses`` reach ``target``, interpolated between evaluations.

    The loss is evaluated at ``steps`` (increasing); the crossing between two
    evaluations ``(s0, l0)``, ``(s1, l1)`` with ``l0 > target >= l1`` is placed
    on the straight line between them,
    ``s0 + (s1 - s0) (l0 - target) / (l0 - l1)``.

    Returns:
        The step as a float; ``steps[0]`` if the first loss is already at or
        below the target; ``inf`` if the target is never reached.
    """
    steps, losses = np.asarray(steps, dtype=float), np.asarray(losses, dtype=float)
    if steps.shape != losses.shape or steps.ndim != 1:
        raise ValueError(f"steps and losses must be 1-d of one length, got {steps.shape}, "
                         f"{losses.shape}")
    reached = np.flatnonzero(losses <= target)
    if reached.size == 0:
        return math.inf
    i = reached[0]
    if i == 0:
        return float(steps[0])
    s0, s1, l0, l1 = steps[i - 1], steps[i], losses[i - 1], losses[i]
    return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))


def predicted_steps(batch_size, s_min, e_min):
    """Steps the paper's model predicts for batch size ``B``: ``S = S_min + E_min / B``.

    Equivalent to ``(S / S_min - 1)(E / E_min - 1) = 1`` with ``E = B S``
    (McCandlish et al. 2018, eq. 2.11).
    """
    return s_min + e_min / np.asarray(batch_size, dtype=float)


def fit_steps_examples(batch_sizes, steps) -> Tuple[float, float]:
    """``S_min, E_min`` of McCandlish et al.'s hyperbola, by least squares in log space.

    Minimizes ``sum_B (log S_B - log(S_min + E_min / B))^2`` over
    ``S_min, E_min >= 0`` (relative errors: steps span orders of magnitude),
    from the weighted linear fit of ``S`` against ``1 / B``. Points with a
    non-finite ``S`` (target not reached) are left out.

    Returns:
        ``(S_min, E_min)``; NaN for both, with a warning, when fewer than two
        points remain. A parameter at its bound 0 is a defined result:
        ``E_min = 0`` (steps do not fall with batch size: ``B_crit = 0``) or
        ``S_min = 0`` (steps fall as ``1 / B`` throughout: ``B_crit`` above
        the measured range); either comes with a warning.
    """
    b, s = np.asarray(batch_sizes, dtype=float), np.asarray(steps, dtype=float)
    keep = np.isfinite(s) & (s > 0)
    b, s = b[keep], s[keep]
    if len(b) < 2:
        warnings.warn(f"fit_steps_examples needs two batch sizes that reached the target, "
                      f"got {len(b)}; S_min and E_min are NaN", stacklevel=2)
        return math.nan, math.nan
    # Linear least squares of S on (1, 1/B) weighted by 1/S: relative errors, as below.
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    start, *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    floor = 1e-3 * np.array([s.min(), (b * s).min()])  # an interior start for the bounds
    start = np.maximum(start, floor)
    def cost(p):
        return float(np.sum((np.log(predicted_steps(b, *p)) - np.log(s)) ** 2))

    interior = scipy.optimize.least_squares(
        lambda p: np.log(predicted_steps(b, *p)) - np.log(s),
        start, bounds=(0.0, np.inf), x_scale=floor * 1e3, xtol=1e-14, ftol=1e-14, gtol=1e-14,
    ).x
    # The optimizer only approaches a bound; the fits on the bounds have closed
    # forms (geometric means), and the best of the three is the answer.
    on_bounds = [(np.exp(np.mean(np.log(s))), 0.0), (0.0, np.exp(np.mean(np.log(b * s))))]
    best = min([tuple(interior)] + on_bounds, key=cost)
    s_min, e_min = (float(v) for v in best)
    if s_min == 0.0 or e_min == 0.0:
        warnings.warn(f"the fit sits at a bound (S_min={s_min:.3g}, E_min={e_min:.3g}): "
                      "the steps do not follow the hyperbola over these batch sizes",
                      stacklevel=2)
    return s_min, e_min


def critical_batch(s_min, e_min) -> float:
    """``B_crit = E_min / S_min``; ``inf`` for ``S_min = 0 < E_min``, NaN if undefined."""
    if not (math.isfinite(s_min) and math.isfinite(e_min)):
        return math.nan
    if s_min <= 0:
        return math.inf if e_min > 0 else math.nan
    return e_min / s_min


def value_at_step(steps, values, step) -> float:
    """The value tracked at the last of ``steps`` at or before ``step`` (NaN if none)."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    before = np.flatnonzero(steps <= step)
    return float(values[before[-1]]) if before.size and math.isfinite(step) else math.nan


def value_range(steps, values, first, last) -> Tuple[float, float]:
    """Smallest and largest of the finite ``values`` tracked at steps in ``[first, last]``."""
    steps, values = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    inside = values[(steps >= first) & (steps <= last) & np.isfinite(values)]
    return (float(inside.min()), float(inside.max())) if inside.size else (math.nan, math.nan)


def agreement_factor(b_crit, b_simple) -> float:
    """How far apart two batch sizes are, as a factor ``>= 1``: ``max(a/b, b/a)``."""
    if not (b_crit > 0 and b_simple > 0) or math.isinf(b_crit) or math.isinf(b_simple):
        return math.nan
    return max(b_crit / b_simple, b_simple / b_crit)


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: its validation curve and when it reached the target."""

    batch_size: int
    lr: float
    eval_steps: List[int] = field(default_factory=list)
    eval_losses: List[float] = field(default_factory=list)
    steps: float = math.inf  # to the target; inf if not reached
    pruned: bool = False  # stopped once it could no longer beat the best run
    diverged: bool = False  # stopped at a validation loss that is not finite
    cockpit: object = None  # the Cockpit, when quantities were tracked
    # The last evaluated step of a pruned run: its loss was above the target there, so its
    # steps to the target are above it (NaN: not recorded).
    stopped_at: float = math.nan

    def outcome(self) -> str:
        """The steps to the target, or why there are none."""
        if math.isfinite(self.steps):
            return f"{self.steps:.1f}"
        return "pruned" if self.pruned else "diverged" if self.diverged else "not reached"


def train(task, batch_size, lr, seed, *, max_steps, stop_after=math.inf, quantities=None,
          continue_after_target=1.0) -> Run:
    """Train from the seed's initialization until the validation loss reaches the target.

    Args:
        task: The :class:`Task`.
        batch_size: Examples per step.
        lr: Learning rate.
        seed: Seeds the initialization and the batches: every run of a task
            starts from the same weights.
        max_steps: Give up after this many steps.
        stop_after: Stop (``pruned``) once past this many steps without
            reaching the target: the best run so far took that many.
        quantities: Cockpit quantities to track (the model is then extended
            with BackPACK); the Cockpit that holds their results is
            ``run.cockpit``.
        continue_after_target: With quantities, train on to this many times
            the steps the target took (to see the noise scale beyond it).
    """
    torch.manual_seed(seed)
    model = task.make_model()
    loss_fn, per_example = task.losses()
    run, cockpit = Run(batch_size, lr), None
    if quantities is not None:
        model, loss_fn = cgn.prepare_model(model), backpack.extend(loss_fn)
        cockpit = run.cockpit = cgn.Cockpit(model.parameters(), quantities=quantities)
    opt = task.make_optimizer(model.parameters(), lr)
    generator = torch.Generator().manual_seed(seed)
    every, end = task.eval_every(batch_size), max_steps
    for step in range(max_steps + 1):
        if step % every == 0 or step == end:
            run.eval_steps.append(step)
            run.eval_losses.append(task.validation_loss(model))
            if not math.isfinite(run.eval_losses[-1]):
                run.diverged = True
                break
            if math.isinf(run.steps):
                run.steps = steps_to_target(run.eval_steps, run.eval_losses, task.target)
                if math.isfinite(run.steps):
                    if cockpit is None:
                        break
                    end = min(max_steps, math.ceil(run.steps * continue_after_target))
            if math.isinf(run.steps) and step > stop_after:
                run.pruned, run.stopped_at = True, float(step)
                break
        if step >= end:
            break
        x, y = task.sample(batch_size, generator)
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        if cockpit is None:
            loss.backward()
        else:
            info = {"batch_size": len(x), "individual_losses": per_example(out, y),
                    "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return run


def sweep(task, batch_sizes, seed, log=print, *, first_lr=None,
          on_batch=None) -> Dict[int, List[Run]]:
    """Every learning rate of the task's grid at every batch size; ``{B: runs}``.

    The learning rate that was best at the previous batch size runs first
    (at the first batch size, ``first_lr``, by default the grid's middle one);
    the others stop as soon as they cannot beat the best run of their batch
    size (only the minimum number of steps over the grid is used).
    ``on_batch(B, runs)`` is called after each batch size (to store them).
    """
    runs = {}
    previous = task.learning_rates[len(task.learning_rates) // 2] if first_lr is None else first_lr
    for b in batch_sizes:
        order = sorted(task.learning_rates, key=lambda lr: (abs(math.log(lr / previous)), lr))
        runs[b], best = [], math.inf
        for lr in order:
            start = time.perf_counter()
            run = train(task, b, lr, seed, max_steps=task.max_steps, stop_after=best)
            runs[b].append(run)
            best = min(best, run.steps)
            log(f"  {task.name} B={b} lr={lr:g}: {run.outcome()} "
                f"({time.perf_counter() - start:.1f} s)")
        runs[b].sort(key=lambda r: r.lr)
        best_run = best_of(runs[b])
        if best_run is not None:
            previous = best_run.lr
        if on_batch is not None:
            on_batch(b, runs[b])
    return runs


def best_of(runs) -> Optional[Run]:
    """The run that reached the target in the fewest steps (None if none did)."""
    reached = [r for r in runs if math.isfinite(r.steps)]
    return min(reached, key=lambda r: r.steps) if reached else None


def noise_scale_run(task, lr, seed, max_steps, continue_after_target=2.0):
    """One run at ``task.gns_batch`` with a Cockpit tracking GradientNoiseScale every step.

    Returns:
        The run and ``{statistic: (steps, values)}`` of the network (``"all"``)
        for ``b_simple`` and ``b_simple_smoothed``.
    """
    names = [n for n, _ in task.make_model().named_parameters()]
    quantities = [cgn.GradientNoiseScale(linear(1), param_names=names)]
    run = train(task, task.gns_batch, lr, seed, max_steps=max_steps, quantities=quantities,
                continue_after_target=continue_after_target)
    frame = cgn.to_frame(run.cockpit)
    frame = frame[(frame.quantity == "GradientNoiseScale") & (frame.param == "all")]
    series = {}
    for statistic in ("b_simple", "b_simple_smoothed"):
        rows = frame[frame.statistic == statistic]
        series[statistic] = (rows.step.tolist(), rows.value.tolist())
    return run, series


# ----------------------------------------------------------------------------
# Results, figures, the page
# ----------------------------------------------------------------------------


@dataclass
class Result:
    """What one task measured."""

    task: Task
    runs: Dict[int, List[Run]]
    s_min: float
    e_min: float
    b_crit: float
    gns_run: Optional[Run]
    gns_series: Dict[str, Tuple[list, list]]  # {statistic: (steps, values)}, "all"
    b_simple: float  # smoothed B_simple at the step the GNS run reached the target
    seconds: float

    def best(self):
        """``(batch size, best run)`` for every batch size, the run None if none reached."""
        return [(b, best_of(runs)) for b, runs in self.runs.items()]

    def measured(self):
        """Batch sizes and steps of the batch sizes that reached the target."""
        pairs = [(b, r.steps) for b, r in self.best() if r is not None]
        return np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs], float)

    def series(self, statistic):
        """Steps and values of one tracked statistic of the network."""
        steps, values = self.gns_series[statistic]
        return np.asarray(steps, float), np.asarray(values, float)

    def to_json(self) -> dict:
        """The measured numbers (not the task's code), for :func:`result_from_json`."""
        gns = None if self.gns_run is None else {
            "lr": self.gns_run.lr, "steps": self.gns_run.steps, "series": self.gns_series}
        return {
            "task": self.task.name, "target": self.task.target,
            "runs": {str(b): [run_summary(r) for r in runs] for b, runs in self.runs.items()},
            "s_min": self.s_min, "e_min": self.e_min, "b_crit": self.b_crit,
            "b_simple": self.b_simple, "gns": gns, "seconds": self.seconds,
        }


def run_summary(run) -> dict:
    """A run without its validation curve and Cockpit."""
    return {"batch_size": run.batch_size, "lr": run.lr, "steps": run.steps,
            "pruned": run.pruned, "diverged": run.diverged}


def result_from_json(task, data) -> Result:
    """The :class:`Result` that :meth:`Result.to_json` stored, with its task."""
    if data["task"] != task.name or data["target"] != task.target:
        raise ValueError(f"the stored results are of {data['task']} at target "
                         f"{data['target']}, not {task.name} at {task.target}: rerun "
                         f"without --replot")
    runs = {int(b): [Run(**r) for r in rs] for b, rs in data["runs"].items()}
    gns = data["gns"]
    gns_run = None if gns is None else Run(task.gns_batch, gns["lr"], steps=gns["steps"])
    return Result(task, runs, data["s_min"], data["e_min"], data["b_crit"], gns_run,
                  None if gns is None else gns["series"], data["b_simple"], data["seconds"])


def run_task(task, batch_sizes, seed, log=print) -> Result:
    """The sweep, the fit and the noise-scale run of one task."""
    start = time.perf_counter()
    runs = sweep(task, batch_sizes, seed, log)
    result = Result(task, runs, math.nan, math.nan, math.nan, None, None, math.nan, 0.0)
    result.s_min, result.e_min = fit_steps_examples(*result.measured())
    result.b_crit = critical_batch(result.s_min, result.e_min)
    best = dict(result.best()).get(task.gns_batch)
    if best is None:
        warnings.warn(f"{task.name}: batch {task.gns_batch} never reached the target; "
                      f"no noise-scale run", stacklevel=2)
    else:
        result.gns_run, result.gns_series = noise_scale_run(task, best.lr, seed, task.max_steps)
        steps, values = result.series("b_simple_smoothed")
        result.b_simple = value_at_step(steps, values, result.gns_run.steps)
        log(f"  {task.name}: B_simple {result.b_simple:.3g} at step "
            f"{result.gns_run.steps:.0f} (batch {task.gns_batch}, lr {best.lr:g})")
    result.seconds = time.perf_counter() - start
    log(f"  {task.name}: S_min {result.s_min:.4g}, E_min {result.e_min:.4g}, "
        f"B_crit {result.b_crit:.3g} ({result.seconds:.0f} s)")
    return result


def versions() -> Dict[str, str]:
    """Versions of Python and the libraries the numbers came from."""
    import subprocess
    from importlib import metadata

    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(git + ["status", "--porcelain", "experiments", "cockpit_gradnoise"],
                           capture_output=True, text=True).stdout.strip()
    return {
        "this repository (commit)": commit + (" with uncommitted changes" if dirty else ""),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backpack-for-pytorch": metadata.version("backpack-for-pytorch"),
        "cockpit-for-pytorch": metadata.version("cockpit-for-pytorch"),
        "cockpit-gradnoise": metadata.version("cockpit-gradnoise"),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "matplotlib": matplotlib.__version__,
    }


# ----------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------


def make_tasks(quick, seed) -> Dict[str, Task]:
    """The two tasks: tuned grids and targets, or the tiny ``--quick`` versions."""
    if quick:
        return {
            "digits": digits_task((0.2,), target=2.25, max_steps=80, gns_batch=32, seed=seed),
            "gpt": gpt_task((1e-2,), target=3.6, max_steps=60, gns_batch=32, seed=seed),
        }
    return {
        "digits": digits_task((0.1, 0.2, 0.4, 0.8), target=0.15, max_steps=2000,
                              gns_batch=64, seed=seed),
        "gpt": gpt_task((4e-3, 8e-3, 1.6e-2, 3.2e-2), target=2.3, max_steps=1500,
                        gns_batch=64, seed=seed),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/experiments",
                        help="folder for the page and figures (default: docs/experiments)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny: batch sizes 8 and 32, one learning rate, few steps")
    parser.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    parser.add_argument("--tasks", default="digits,gpt",
                        help="comma-separated tasks (default: digits,gpt)")
    parser.add_argument("--replot", action="store_true",
                        help=f"no training: redraw and rewrite the page from <out>/{RESULTS}")
    parser.add_argument("--seeds", type=int, default=0,
                        help="only the grid, for this many more training seeds (from "
                             "--first-seed), on --seed's data; stored beside the results "
                             "(experiments.cbs_seeds), no page")
    parser.add_argument("--first-seed", type=int, default=1,
                        help="with --seeds: the first training seed (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models; and the machine is shared
    matplotlib.use("Agg")
    # torch warns on every step that BackPACK's hooks see no input gradient at the
    # first layer; that is expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.seeds:
        return measure_more_seeds(args, parser, argv, out)
    if args.replot:
        stored = json.loads((out / RESULTS).read_text())
        tasks = make_tasks(stored["quick"], stored["seed"])
        results = [result_from_json(tasks[r["task"]], r) for r in stored["results"]]
        run_info = stored
        # The numbers are the stored run's; say which code drew them.
        run_info["replotted with"] = versions()["this repository (commit)"]
    else:
        results, run_info = measure(args, parser, argv)
        run_info["results"] = [r.to_json() for r in results]
        (out / RESULTS).write_text(json.dumps(run_info, indent=1))
    # Here, not at the top: the page's module imports this one's results.
    from experiments.critical_batch_size_page import plot_task, write_page

    for result in results:
        plot_task(result, out / f"critical-batch-size-{result.task.name}.png")
    page = write_page(results, out, run_info)
    print(f"page: {page}")
    return results, page


def measure(args, parser, argv):
    """Every task of ``args``: the results and what the page records about the run."""
    command = "python -m experiments.critical_batch_size " + " ".join(
        sys.argv[1:] if argv is None else argv)
    run_info = {"command": command.strip(), "seed": args.seed, "quick": args.quick,
                "versions": versions()}  # before training: the code that trains
    tasks = make_tasks(args.quick, args.seed)
    batch_sizes = (8, 32) if args.quick else BATCH_SIZES
    start = time.perf_counter()
    results = []
    for name in args.tasks.split(","):
        if name not in tasks:
            parser.error(f"unknown task {name!r}; choose from {', '.join(tasks)}")
        print(f"{name}:", flush=True)
        results.append(run_task(tasks[name], batch_sizes, args.seed,
                                log=lambda m: print(m, flush=True)))
    run_info["seconds"] = time.perf_counter() - start
    return results, run_info


def measure_more_seeds(args, parser, argv, out):
    """``--seeds``: the grid of more training seeds (experiments.cbs_seeds), no page."""
    from experiments import cbs_seeds  # it imports this module

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.seed in seeds:
        parser.error(f"training seed {args.seed} is the results' own ({RESULTS}); "
                     f"choose --first-seed past it")
    tasks, names = make_tasks(args.quick, args.seed), args.tasks.split(",")
    for name in names:
        if name not in tasks:
            parser.error(f"unknown task {name!r}; choose from {', '.join(tasks)}")
    command = "python -m experiments.critical_batch_size " + " ".join(
        sys.argv[1:] if argv is None else argv)
    run_info = {"seed": args.seed, "quick": args.quick, "versions": versions()}
    return cbs_seeds.measure_seeds(tasks, names, seeds, (8, 32) if args.quick else BATCH_SIZES,
                                   out, command.strip(), run_info,
                                   log=lambda m: print(m, flush=True))


if __name__ == "__main__":
    main()
