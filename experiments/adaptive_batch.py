"""Does the adaptive batch schedule beat every fixed batch size?

McCandlish, Kaplan, Amodei et al. 2018 (arXiv:1812.06162): a fixed batch
``B`` reaches a given loss in ``S`` steps and ``E = B S`` examples on the
hyperbola ``(S / S_min - 1)(E / E_min - 1) = 1``; a schedule that grows the
batch as the noise scale grows can land inside it (the paper's section 2.3,
"adaptive batch size training"). For the two tasks of
``experiments.critical_batch_size`` (the digits CNN with SGD, the
character-level GPT with Adam) this script runs, for each seed:

- ``adaptive-norms``, ``adaptive-per-example``: ``cgn.BatchSchedule`` from
  batch 8, through gradient accumulation, with the noise scale of the
  ``"norms"`` preset (micro-batch norms) or of the per-example gradients;
- ``warmup``: a hand-set batch-size warmup (doubling at fixed fractions of
  an example budget), each batch with the grid's best learning rate;
- ``fixed``: the fixed batch at the fitted ``B_crit`` with its best learning rate;
- ``fixed-avg``: the fixed batch at the seed-averaged grid's ``B_crit`` with that grid's
  best learning rate (the sanity check on the frontier the arms are judged against,
  ``experiments.frontier_check``);

each until the validation loss reaches the task's target (the grid's
evaluation). The baseline frontier is the grid stored in
``docs/experiments/critical-batch-size.json`` (not rerun). It writes a figure
per task, a JSON of the numbers and a markdown page to ``--out``.

    python -m experiments.adaptive_batch --out docs/experiments
    python -m experiments.adaptive_batch --quick --out /tmp/adaptive
"""

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import cockpit_gradnoise as cgn

import matplotlib
import matplotlib.ticker
import numpy as np
import torch

from experiments import cbs_seeds
from experiments import critical_batch_size as cbs

RESULTS = "adaptive-batch-{task}.json"
#: The grid this experiment compares against (``experiments.critical_batch_size``).
GRID = Path("docs") / "experiments" / cbs.RESULTS
#: Every schedule starts here: the grid's smallest batch, whose best learning rate is tuned.
START_BATCH = 8
#: The warmup doubles the batch when the examples seen pass these fractions of its budget.
WARMUP_FRACTIONS = (1 / 8, 1 / 4, 1 / 2)
#: Arms in the order of the page; "adaptive-*" use ``cgn.BatchSchedule``.
ARMS = ("adaptive-norms", "adaptive-per-example", "warmup", "fixed", "fixed-avg",
        "adaptive-lr-kept", "adaptive-norms-median", "adaptive-per-example-median",
        "adaptive-norms-k0.9", "adaptive-norms-k1.5")
#: The fixed batch at the seed-averaged grid's B_crit with its best learning rate (both
#: stored under this key of the task's results when it first runs: the grid may grow later).
FIXED_AVG = "fixed-avg"
#: Where ``--rerun`` of ``fixed-avg`` keeps the settings the replaced runs ran with.
REPLACED_SETTINGS = "replaced fixed-avg settings"
#: The ablation ``adaptive-lr-kept``: the per-example schedule with ``rule=None`` (the learning
#: rate stays the grid's best at the start), to tell the batch rule from the learning-rate rule.
ABLATION = "adaptive-lr-kept"
#: The per-example arm's noise scale: the preconditioned one under Adam (what the schedule
#: reads for an adaptive optimizer), the plain one under SGD.
PER_EXAMPLE = {"adam": "PreconditionedNoiseScale", "sgd": "GradientNoiseScale"}
#: Micro-batch of each adaptive arm: the norms estimate needs two micro-batches a step.
MICRO_BATCH = {"adaptive-norms": START_BATCH // 2, "adaptive-per-example": START_BATCH,
               ABLATION: START_BATCH}
#: The one change tried after the first rerun: ``estimate="median"`` (the median of the last
#: per-step ``b_simple``, not ``b_simple_smoothed``), otherwise the arm without the suffix.
MEDIAN = "-median"
MICRO_BATCH.update({arm + MEDIAN: MICRO_BATCH[arm] for arm in ("adaptive-norms", "adaptive-per-example")})
#: The ablation of ``multiple`` (k, the batch a rising estimate is followed at, k B_noise):
#: ``adaptive-norms`` with k other than 1. On McCandlish et al.'s model a run at k B_noise
#: takes (1 + 1/k) / 2 times the steps and (1 + k) / 2 times the examples of one at k = 1:
#: from the k = 1 runs, the warmup's steps and examples are both undercut at k near 0.9 on
#: the GPT (fewer examples, more steps) and near 1.5 on the digits (the other way), no one k on
#: both; these arms test that prediction.
MULTIPLES = {"adaptive-norms-k0.9": 0.9, "adaptive-norms-k1.5": 1.5}
MICRO_BATCH.update({arm: MICRO_BATCH["adaptive-norms"] for arm in MULTIPLES})
MAX_BATCH = 512
#: A run stops ("not reached") past this many times E_min examples: beyond it the frontier
#: value is below 1 only within 1 / (CAP - 1) of S_min steps, which no run comes near.
EXAMPLES_CAP = 20
#: The schedule's rules the adaptive runs ran under, oldest first (stored with each run; runs
#: stored without one ran under the first): ``"centre"``, each change toward round(B_noise);
#: ``"near-end"``, to the near end of the estimate's range; ``"resolved"``, the near end and no
#: growth on an estimate whose range has no upper end (cgn.schedule.rule); ``"target"``, that
#: rule on the band scaled so that a rising estimate is followed at B_noise (``multiple=1``),
#: not at the range's near end B_noise / 2; ``"adam-lr"``, that rule with McCandlish et al.'s
#: learning-rate rule for Adam too, on its preconditioned step, not the square-root rule
#: (cgn.schedule.rule.in_run_rule; the digits CNN's SGD runs are the same as under ``target``).
#: RULE: the newest.
RULES = ("centre", "near-end", "resolved", "target", "adam-lr")
RULE = RULES[-1]


# ----------------------------------------------------------------------------
# Pure functions: the formulas
# ----------------------------------------------------------------------------


def frontier_value(steps, examples, s_min, e_min) -> float:
    """``(S / S_min - 1)(E / E_min - 1)``: 1 on McCandlish et al.'s fitted hyperbola.

    A fixed batch ``B`` on the fitted frontier gives exactly 1 (eq. 2.11,
    ``S = S_min + E_min / B``); a run at ``S > S_min`` and ``E > E_min`` that
    gives less than 1 lies inside the hyperbola, fewer steps than any fixed
    batch at its number of examples. Values below 0 (``S < S_min`` or
    ``E < E_min``, one of them) also beat every fixed batch; see
    :func:`beats_frontier` for the test that holds everywhere.
    """
    return (steps / s_min - 1.0) * (examples / e_min - 1.0)


def beats_frontier(steps, examples, s_min, e_min) -> bool:
    """Whether ``(E, S)`` lies below the hyperbola: fewer steps than any fixed batch with ``E``.

    On the hyperbola ``S_h(E) = S_min E / (E - E_min)`` for ``E > E_min``; no
    fixed batch reaches the loss with ``E <= E_min`` examples or ``S <= S_min``
    steps, so such a run beats them all.
    """
    if examples <= e_min or steps <= s_min:
        return True
    return steps < s_min * examples / (examples - e_min)


def examples_at(step, batches) -> float:
    """Examples seen after fractional step ``step`` when step ``i`` used ``batches[i]`` examples.

    The cumulative count is linear within a step (a crossing interpolated to
    step 12.5 has seen half of step 12's batch); ``inf`` for ``step = inf``.
    """
    if not math.isfinite(step):
        return math.inf
    cumulative = np.concatenate([[0.0], np.cumsum(np.asarray(batches, dtype=float))])
    if step > len(batches):
        raise ValueError(f"step {step} is past the {len(batches)} steps trained")
    return float(np.interp(step, np.arange(len(cumulative)), cumulative))


def warmup_batch(examples_seen, start, budget, fractions=WARMUP_FRACTIONS) -> int:
    """The warmup's batch: ``start`` doubled once for every fraction of ``budget`` already seen."""
    return start * 2 ** sum(examples_seen >= f * budget for f in fractions)


# ----------------------------------------------------------------------------
# Hand-set schedules, with BatchSchedule's interface
# ----------------------------------------------------------------------------


class TableSchedule:
    """A batch chosen by ``batch_of(examples seen)``, each with its learning rate from ``lrs``.

    The same interface as ``cgn.BatchSchedule`` (``micro_batch``,
    ``accumulation``, ``batch``, ``update``, ``changes``), with one micro-batch
    of the whole batch a step (no accumulation: the same gradient, faster).
    """

    def __init__(self, batch_of, lrs: Dict[int, float]):
        self.batch_of, self.lrs = batch_of, lrs
        self.seen = 0
        self.micro_batch = batch_of(0)
        self.accumulation = 1
        self.changes: List[dict] = []

    @property
    def batch(self):
        return self.micro_batch * self.accumulation

    def update(self, step, tracker, optimizer):
        self.seen += self.batch
        new = self.batch_of(self.seen)
        if new != self.batch:
            lr = self.lrs[new]
            factor = lr / optimizer.param_groups[0]["lr"]
            for group in optimizer.param_groups:
                group["lr"] = lr
            self.changes.append({"step": step, "batch": self.batch, "new_batch": new,
                                 "lr_factor": factor, "noise_scale": math.nan,
                                 "why": f"{self.seen} examples seen"})
            self.micro_batch = new


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


@dataclass
class ScheduledRun:
    """One run under a batch schedule: its curve and where it reached the target."""

    arm: str
    seed: int
    lr: float  # at the first step
    batches: List[int] = field(default_factory=list)  # per step
    lrs: List[float] = field(default_factory=list)  # per step
    eval_steps: List[int] = field(default_factory=list)
    eval_losses: List[float] = field(default_factory=list)
    steps: float = math.inf
    examples: float = math.inf
    diverged: bool = False
    changes: List[dict] = field(default_factory=list)
    seconds: float = 0.0
    rule: str = ""  # the schedule's rule of an adaptive run (RULE); "" for the others
    decisions: Dict[str, int] = field(default_factory=dict)  # BatchSchedule.decisions

    def frontier(self, s_min, e_min):
        return frontier_value(self.steps, self.examples, s_min, e_min)


def train_scheduled(task, schedule, lr, seed, *, arm, quantities=None, max_steps,
                    max_examples=math.inf) -> ScheduledRun:
    """Train from the seed's initialization under ``schedule`` until the target is reached.

    Each step draws ``schedule.accumulation`` micro-batches of
    ``schedule.micro_batch`` examples (with the tracker around each backward
    pass when ``quantities`` is given), steps the optimizer, then calls
    ``schedule.update``. The validation loss is evaluated at step 0 and
    whenever the examples since the last evaluation reach ``max(1,
    task.eval_examples // B) B``, ``B`` the batch of the last step: for a
    fixed batch, every ``max(1, task.eval_examples // B)`` steps, as in the grid.
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = task.make_model()
    _, per_example = task.losses()
    tracker = None
    if quantities is not None:
        model, tracker = cgn.track(model, every=1, quantities=quantities)
    opt = task.make_optimizer(model.parameters(), lr)
    generator = torch.Generator().manual_seed(seed)
    run = ScheduledRun(arm, seed, lr)
    since_eval = 0
    for step in range(max_steps + 1):
        batch = run.batches[-1] if run.batches else 1
        if step == 0 or since_eval >= task.eval_every(batch) * batch or step == max_steps:
            since_eval = 0
            run.eval_steps.append(step)
            run.eval_losses.append(task.validation_loss(model))
            if not math.isfinite(run.eval_losses[-1]):
                run.diverged = True
                break
            run.steps = cbs.steps_to_target(run.eval_steps, run.eval_losses, task.target)
            if math.isfinite(run.steps) or step == max_steps or sum(run.batches) > max_examples:
                break
        micro, count = schedule.micro_batch, schedule.accumulation
        run.batches.append(micro * count)
        run.lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        for k in range(count):
            x, y = task.sample(micro, generator)
            losses = per_example(model(x), y)
            if tracker is None:
                (losses.mean() / count).backward()
                continue
            with tracker(step, losses, optimizer=opt, micro_batch=k, micro_batches=count) as loss:
                loss.backward()
        opt.step()
        schedule.update(step, tracker, opt)
        since_eval += run.batches[-1]
    run.examples = examples_at(run.steps, run.batches)
    # A change after step s applies from step s + 1: one after the last step never did.
    run.changes = [{k: (float(v) if isinstance(v, float) else v) for k, v in c.items()}
                   for c in schedule.changes if c["step"] + 1 < len(run.batches)]
    run.decisions = dict(getattr(schedule, "decisions", {}))
    run.seconds = time.perf_counter() - start
    return run


# ----------------------------------------------------------------------------
# The baseline grid and the arms
# ----------------------------------------------------------------------------


@dataclass
class Baseline:
    """The fixed-batch grid of one task: its points, fit and best learning rates."""

    task: str
    target: float
    s_min: float
    e_min: float
    b_crit: float
    points: List[List[float]]  # [batch, steps] of the batch sizes that reached the target
    best_lr: Dict[int, float]
    source: str
    seeds: List[int] = field(default_factory=list)  # the grid's training seeds (averaged)

    def lr_at(self, batch):
        """The grid's best learning rate at ``batch``, or at the nearest batch measured."""
        nearest = min(self.best_lr, key=lambda b: (abs(math.log(b / batch)), b))
        return self.best_lr[nearest]


def grid_baseline(stored, task, source) -> Baseline:
    """The :class:`Baseline` of ``task`` from critical_batch_size's stored JSON result."""
    if stored["task"] != task.name or stored["target"] != task.target:
        raise ValueError(f"the grid is of {stored['task']} at target {stored['target']}, not "
                         f"{task.name} at {task.target}: rerun experiments.critical_batch_size")
    best = {int(b): cbs.best_of([cbs.Run(**r) for r in runs])
            for b, runs in stored["runs"].items()}
    best = {b: r for b, r in best.items() if r is not None}
    return Baseline(task.name, task.target, stored["s_min"], stored["e_min"], stored["b_crit"],
                    [[b, r.steps] for b, r in best.items()], {b: r.lr for b, r in best.items()},
                    source)


def measured_baseline(task, batch_sizes, seed, log) -> Baseline:
    """A small grid measured now (``--quick``): critical_batch_size's sweep and fit."""
    runs = cbs.sweep(task, batch_sizes, seed, log)
    best = {b: cbs.best_of(rs) for b, rs in runs.items()}
    best = {b: r for b, r in best.items() if r is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 2-point fit at a bound is fine for plumbing
        s_min, e_min = cbs.fit_steps_examples(list(best), [r.steps for r in best.values()])
    return Baseline(task.name, task.target, s_min, e_min, cbs.critical_batch(s_min, e_min),
                    [[b, r.steps] for b, r in best.items()], {b: r.lr for b, r in best.items()},
                    f"measured now, batch sizes {', '.join(map(str, batch_sizes))}")


def fixed_batch(baseline) -> int:
    """The fixed arm's batch: ``B_crit`` rounded, at least 1."""
    return max(1, round(baseline.b_crit)) if math.isfinite(baseline.b_crit) else START_BATCH


def warmup_budget(baseline) -> float:
    """The warmup's example budget: ``2 E_min``, what a fixed ``B_crit`` needs on the frontier."""
    return 2.0 * baseline.e_min


def lr_cap(baseline) -> float:
    """The adaptive arms' ``max_lr_factor``: the grid's best learning rate at its largest
    batch over its best at ``START_BATCH`` (at least 1): the grid knowledge the warmup arm
    uses, given to the schedule as its bound."""
    return max(1.0, baseline.best_lr[max(baseline.best_lr)] / baseline.lr_at(START_BATCH))


def run_arm(task, arm, baseline, seed, fixed_lr, fixed_avg=None) -> ScheduledRun:
    """One run of ``arm`` on ``task`` with ``seed``; ``fixed_avg``: the ``fixed-avg`` arm's
    settings (``experiments.frontier_check.fixed_at_average``)."""
    base_lr = baseline.lr_at(START_BATCH)
    limits = {"max_steps": task.max_steps, "max_examples": EXAMPLES_CAP * baseline.e_min}
    if arm in ("fixed", FIXED_AVG):
        batch, lr = ((fixed_batch(baseline), fixed_lr) if arm == "fixed"
                     else (fixed_avg["batch"], fixed_avg["lr"]))
        schedule = TableSchedule(lambda seen: batch, {batch: lr})
        return train_scheduled(task, schedule, lr, seed, arm=arm, **limits)
    if arm == "warmup":
        budget = warmup_budget(baseline)
        batches = [START_BATCH * 2 ** i for i in range(len(WARMUP_FRACTIONS) + 1)]
        schedule = TableSchedule(lambda seen: warmup_batch(seen, START_BATCH, budget),
                                 {b: baseline.lr_at(b) for b in batches})
        return train_scheduled(task, schedule, base_lr, seed, arm=arm, **limits)
    micro = MICRO_BATCH[arm]
    schedule = cgn.BatchSchedule(micro_batch=micro, min_batch=START_BATCH, max_batch=MAX_BATCH,
                                 max_accumulation=MAX_BATCH // micro,
                                 rule=None if arm == ABLATION else "auto",
                                 max_lr_factor=lr_cap(baseline),
                                 estimate="median" if arm.endswith(MEDIAN) else "smoothed",
                                 **({"multiple": MULTIPLES[arm]} if arm in MULTIPLES else {}))
    run = train_scheduled(task, schedule, base_lr, seed, arm=arm,
                          quantities=quantities_of(arm, task), **limits)
    run.rule = RULE
    return run


def quantities_of(arm, task):
    """The tracker's quantities of an adaptive arm: the ``"norms"`` preset, or one per-example one."""
    return "norms" if arm.startswith("adaptive-norms") else [PER_EXAMPLE[task.optimizer]]


def tune_fixed(task, baseline, log) -> Dict[str, object]:
    """The fixed arm's learning rate: critical_batch_size's sweep at ``B_crit``, seed 0."""
    batch = fixed_batch(baseline)
    runs = cbs.sweep(task, [batch], 0, log)[batch]
    best = cbs.best_of(runs)
    lr = best.lr if best is not None else baseline.lr_at(batch)
    return {"batch": batch, "lr": lr, "steps per lr": {str(r.lr): r.outcome() for r in runs}}


def averaged_baseline(grid_path, task) -> Optional[Baseline]:
    """The :class:`Baseline` of the seed-averaged grid (``experiments.cbs_seeds``) beside
    ``grid_path``: steps averaged over seeds per batch and learning rate, the best learning
    rate per batch on the means, the hyperbola fitted to them; None when only one seed ran."""
    grids = cbs_seeds.load_grids(Path(grid_path).parent, task.name)
    if len(grids) < 2:
        return None
    averaged = cbs_seeds.averaged_grid(grids)
    s_min, e_min = cbs.fit_steps_examples(list(averaged), [s for _, s, _ in averaged.values()])
    seeds = ", ".join(map(str, sorted(grids)))
    return Baseline(task.name, task.target, s_min, e_min, cbs.critical_batch(s_min, e_min),
                    [[b, s] for b, (_, s, _) in averaged.items()],
                    {b: lr for b, (lr, _, _) in averaged.items()},
                    f"{grid_path} and {cbs_seeds.SEED_RESULTS} beside it, seeds {seeds} averaged",
                    sorted(grids))


def baseline_from_json(data) -> Baseline:
    data = dict(data)
    data["best_lr"] = {int(b): lr for b, lr in data["best_lr"].items()}
    return Baseline(**data)


def run_from_json(data) -> ScheduledRun:
    if "rule" not in data and data["arm"].startswith("adaptive"):  # stored before RULE
        data = {**data, "rule": RULES[0]}
    return ScheduledRun(**data)


# ----------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/experiments", help="folder for the outputs")
    parser.add_argument("--quick", action="store_true",
                        help="tiny: a 2-batch grid measured now, few steps")
    parser.add_argument("--seeds", type=int, default=3,
                        help="how many seeds: first-seed..first-seed+N-1 (default: 3)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0; others: seeds no earlier run was read on)")
    parser.add_argument("--tasks", default="digits,gpt", help="comma-separated tasks")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
    parser.add_argument("--grid", default=str(GRID), help="critical_batch_size's JSON")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs stored in <out> and run only the missing ones")
    parser.add_argument("--rerun", action="store_true",
                        help="with --resume: drop the stored runs of --arms and run them again "
                             "(fixed-avg: at the grid's B_crit now)")
    parser.add_argument("--replot", action="store_true",
                        help="no training: redraw and rewrite the page from the stored runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    matplotlib.use("Agg")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.tasks.split(",")
    tasks = cbs.make_tasks(args.quick, 0)  # the grid's data split and validation set
    for name in names:
        if name not in tasks:
            parser.error(f"unknown task {name!r}; choose from {', '.join(tasks)}")
    for arm in args.arms.split(","):
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    if not args.replot:
        command = "python -m experiments.adaptive_batch " + " ".join(
            sys.argv[1:] if argv is None else argv)
        for name in names:
            measure(tasks[name], args, command.strip(), out)
    from experiments import adaptive_batch_page, frontier_check  # they import this module

    # Every task stored in ``out``, also those another process measured.
    stored = [json.loads(path.read_text()) for path in
              (out / RESULTS.format(task=n) for n in tasks) if path.exists()]
    if not stored:
        parser.error(f"no results in {out}: run without --replot first")
    tasks = cbs.make_tasks(stored[0]["quick"], 0)
    # The fair frontier: the grid averaged over its seeds (--quick measures one seed's grid).
    fair = {} if stored[0]["quick"] else {
        e["task"]: averaged_baseline(args.grid, tasks[e["task"]]) for e in stored}
    for entry in stored:
        adaptive_batch_page.plot_task(
            baseline_from_json(entry["baseline"]), [run_from_json(r) for r in entry["runs"]],
            tasks[entry["task"]].unit, out / f"adaptive-batch-{entry['task']}.png",
            fair=fair.get(entry["task"]))
    # The fixed-avg arm and the sanity check analysed (experiments.frontier_check).
    checks = {e["task"]: frontier_check.task_lines(
        e, fair.get(e["task"]), None if stored[0]["quick"] else
        frontier_check.grids_of(args.grid, tasks[e["task"]])) for e in stored}
    # The hand-written readings are of the runs in docs/experiments, not of another folder's.
    readings = out.resolve() == GRID.parent.resolve()
    page = adaptive_batch_page.write_page(stored, tasks, out, fair, checks, readings)
    print(f"page: {page}")
    return stored, page


def baseline_of(task, grid_path, quick, log) -> Baseline:
    """The stored grid's baseline of ``task``, or (``--quick``) one measured now."""
    if quick:
        return measured_baseline(task, (8, 32), 0, log)
    grid = json.loads(Path(grid_path).read_text())
    stored_task = next(r for r in grid["results"] if r["task"] == task.name)
    return grid_baseline(stored_task, task, f"{grid_path}, seed {grid['seed']}")


def measure(task, args, command, out) -> dict:
    """Every run of ``task`` that ``args`` asks for and ``out`` lacks; stored after each run."""
    path = out / RESULTS.format(task=task.name)
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.resume and path.exists():
        stored = json.loads(path.read_text())
    else:
        stored = {"task": task.name, "quick": args.quick, "commands": [], "seeds": [],
                  "seconds": 0.0, "fixed": None, "runs": [],
                  "baseline": asdict(baseline_of(task, args.grid, args.quick, log))}
    stored["versions"] = cbs.versions()  # the code of the newest runs
    if args.rerun:  # the replaced runs are kept, for the page's comparison
        rerun = [r for r in stored["runs"] if r["arm"] in args.arms.split(",")]
        stored.setdefault("replaced", []).extend(rerun)
        stored["runs"] = [r for r in stored["runs"] if r not in rerun]
    stored["commands"].append(command)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    stored["seeds"] = sorted(set(stored["seeds"]) | set(seeds))
    baseline, arms = baseline_from_json(stored["baseline"]), args.arms.split(",")
    start = time.perf_counter()
    if "fixed" in arms and stored["fixed"] is None:
        stored["fixed"] = tune_fixed(task, baseline, log)
    if args.rerun and FIXED_AVG in arms and stored.get(FIXED_AVG) is not None:
        # The grid may have grown since: the arm is set again from it, the old settings kept.
        stored.setdefault(REPLACED_SETTINGS, []).append(stored.pop(FIXED_AVG))
    if FIXED_AVG in arms and stored.get(FIXED_AVG) is None:
        from experiments.frontier_check import fixed_at_average  # it imports this module

        # --quick has one seed's grid, measured now: the plumbing, on it.
        averaged = None if args.quick else averaged_baseline(args.grid, task)
        stored[FIXED_AVG] = fixed_at_average(averaged or baseline)
    for seed in seeds:
        for arm in arms:
            if any(r["arm"] == arm and r["seed"] == seed for r in stored["runs"]):
                continue
            run = run_arm(task, arm, baseline, seed, (stored["fixed"] or {}).get("lr"),
                          stored.get(FIXED_AVG))
            stored["runs"].append(asdict(run))
            stored["runs"].sort(key=lambda r: (ARMS.index(r["arm"]), r["seed"]))
            log(f"  {task.name} {arm} seed {seed}: S {run.steps:.1f}, E {run.examples:,.0f}, "
                f"value {run.frontier(baseline.s_min, baseline.e_min):.3g}, "
                f"{len(run.changes)} changes ({run.seconds:.0f} s)")
            stored["seconds"] += time.perf_counter() - start
            start = time.perf_counter()
            path.write_text(json.dumps(stored, indent=1))
    stored["seconds"] += time.perf_counter() - start
    path.write_text(json.dumps(stored, indent=1))
    return stored


if __name__ == "__main__":
    main()
