"""Where an adaptive arm's steps go against the warmup's: the stored runs split by loss phase.

The issue's target asks the adaptive schedule for at most the warmup's steps at
no more of its examples. On the digits CNN ``adaptive-norms`` misses it on steps
(``docs/experiments/adaptive-batch.md``). This script splits each pair of
stored runs of one seed at the steps where the validation loss first reaches a
ladder of levels (``critical_batch_size.steps_to_target``, interpolated between
evaluations) and compares, phase by phase, the steps, the mean batch and the
mean learning rate of the two arms, with McCandlish et al. 2018's prediction of
the ratio of their steps at the measured noise scale: a batch ``B`` takes
``S = S_min (1 + B_noise / B)`` steps for the progress of ``S_min`` noiseless
ones (eq. 2.11), so two batches ``B_a``, ``B_w`` over the same progress take
steps in the ratio ``(1 + B_noise / B_a) / (1 + B_noise / B_w)``.

With ``--rerun`` it also re-runs the adaptive arm of the stored seeds recording
each decision of the schedule's rule (the batch, the estimate it read, why it
kept or changed the batch: the stored runs keep the changes only), and replays
each stored adaptive run's batch trace twice with a one-micro-batch table:
with its own learning rates (the control: it must give the stored steps again,
up to the order of float sums) and with the grid's best rate at each batch (the
rates the warmup uses): whether the schedule's learning rate is what costs steps.

    python -m experiments.adaptive_batch_phases --task digits --rerun
"""

import argparse
import json
import math
import warnings
from pathlib import Path
from typing import Dict, List, Sequence
from unittest import mock

import numpy as np

from experiments import adaptive_batch as ab
from experiments import critical_batch_size as cbs

#: The loss levels the runs are split at: digits from about 2.3 at step 0 to its target 0.15,
#: set before the split was looked at (halving steps of the loss, the first past its plateau).
LEVELS = {"digits": (1.0, 0.6, 0.3, 0.15)}


# ----------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------


def phase_bounds(eval_steps, eval_losses, levels: Sequence[float]) -> List[float]:
    """``[0, s_1, ..., s_n]``: the (interpolated) step at which the loss first reaches each level."""
    return [0.0] + [cbs.steps_to_target(eval_steps, eval_losses, level) for level in levels]


def phase_means(values: Sequence[float], start: float, end: float) -> float:
    """The mean of the per-step ``values`` of the steps ``floor(start)`` to ``ceil(end) - 1``
    (the steps taken within the phase, the one it starts and ends in included)."""
    return float(np.mean(values[int(start):int(math.ceil(end))]))


def predicted_ratio(noise_scale, batch_a, batch_w) -> float:
    """McCandlish et al. 2018, eq. 2.11: steps at batch ``batch_a`` over steps at ``batch_w`` for
    the same progress at noise scale ``noise_scale``, ``(1 + B_noise/B_a) / (1 + B_noise/B_w)``."""
    return (1.0 + noise_scale / batch_a) / (1.0 + noise_scale / batch_w)


def phase_rows(runs_a: Dict[int, dict], runs_w: Dict[int, dict], levels: Sequence[float],
               noise_scales=None) -> List[Dict[str, float]]:
    """Per phase, over the seeds both arms ran: each arm's mean steps, batch and learning rate,
    and the paired difference of steps (mean and standard error).

    Args:
        runs_a: ``{seed: stored run}`` of the adaptive arm (``eval_steps``,
            ``eval_losses``, ``batches``, ``lrs``).
        runs_w: The same of the reference arm (the warmup).
        levels: The loss levels, falling; the last the target.
        noise_scales: Optional ``{seed: per-step B_noise}`` of arm ``a``: adds its
            median over the phase and the median over seeds of :func:`predicted_ratio`.
    """
    seeds = sorted(set(runs_a) & set(runs_w))
    bounds = {(arm, s): phase_bounds(runs[s]["eval_steps"], runs[s]["eval_losses"], levels)
              for arm, runs in (("a", runs_a), ("w", runs_w)) for s in seeds}
    rows = []
    for i, level in enumerate(levels):
        row = {"level": level}
        for arm, runs in (("a", runs_a), ("w", runs_w)):
            spans = [bounds[arm, s][i:i + 2] for s in seeds]
            row[f"{arm}_steps"] = float(np.mean([end - start for start, end in spans]))
            for key in ("batches", "lrs"):
                row[f"{arm}_{key}"] = float(np.mean([phase_means(runs[s][key], *span)
                                                     for s, span in zip(seeds, spans)]))
        diff = [np.diff(bounds["a", s][i:i + 2])[0] - np.diff(bounds["w", s][i:i + 2])[0]
                for s in seeds]
        row["diff"] = float(np.mean(diff))
        row["diff_se"] = float(np.std(diff, ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else math.nan
        if noise_scales is not None:
            medians, ratios = [], []
            for s in seeds:
                start, end = bounds["a", s][i:i + 2]
                values = [v for v in noise_scales[s][int(start):int(math.ceil(end))]
                          if math.isfinite(v) and v > 0]
                if not values:
                    continue
                medians.append(float(np.median(values)))
                ratios.append(predicted_ratio(
                    medians[-1], phase_means(runs_a[s]["batches"], start, end),
                    phase_means(runs_w[s]["batches"], *bounds["w", s][i:i + 2])))
            row["noise_scale"] = float(np.median(medians)) if medians else math.nan
            row["predicted_ratio"] = float(np.median(ratios)) if ratios else math.nan
        rows.append(row)
    return rows


def decision_shares(decisions: Dict[int, List[dict]], bounds: Dict[int, Sequence[float]],
                    phase: int) -> Dict[str, float]:
    """Over the seeds, of the rule's decisions within phase ``phase`` (the steps between
    ``bounds[seed][phase]`` and ``bounds[seed][phase + 1]``): the share of each ``why``, and
    the median of ``batch / B_noise`` over those with a finite positive estimate
    (``"batch_over_noise"``)."""
    whys, ratios = {}, []
    for seed, found in decisions.items():
        start, end = bounds[seed][phase:phase + 2]
        for d in found[int(start):int(math.ceil(end))]:
            whys[d["why"]] = whys.get(d["why"], 0) + 1
            if math.isfinite(d["noise_scale"]) and d["noise_scale"] > 0:
                ratios.append(d["batch"] / d["noise_scale"])
    total = sum(whys.values())
    shares = {why: count / total for why, count in sorted(whys.items())}
    shares["batch_over_noise"] = float(np.median(ratios)) if ratios else math.nan
    return shares


# ----------------------------------------------------------------------------
# Re-running: the rule's decisions, and the replays
# ----------------------------------------------------------------------------


class Replay:
    """A schedule that replays a batch and learning-rate trace, one micro-batch a step
    (:class:`experiments.adaptive_batch.TableSchedule`'s interface)."""

    def __init__(self, batches: Sequence[int], lrs: Sequence[float]):
        self.batches, self.lrs = list(batches), list(lrs)
        self.micro_batch, self.accumulation, self.changes = self.batches[0], 1, []

    @property
    def batch(self):
        return self.micro_batch

    def update(self, step, tracker, optimizer):
        i = min(step + 1, len(self.batches) - 1)
        self.micro_batch = self.batches[i]
        for group in optimizer.param_groups:
            group["lr"] = self.lrs[i]


def recorded_run(task, arm, baseline, seed):
    """``(run, decisions)``: the arm re-run, with each decision of the rule (batch, estimate,
    why), recorded by wrapping ``cockpit_gradnoise.schedule.batch_schedule.decide``."""
    from cockpit_gradnoise.schedule import batch_schedule

    decisions, decide = [], batch_schedule.decide

    def recording(accumulation, bounds, noise_scale, recent=(), **kwargs):
        found = decide(accumulation, bounds, noise_scale, recent, **kwargs)
        decisions.append({"batch": bounds.micro_batch * accumulation,
                          "noise_scale": float(noise_scale), "why": found.why})
        return found

    with mock.patch.object(batch_schedule, "decide", recording):
        run = ab.run_arm(task, arm, baseline, seed, None)
    return run, decisions


def replays(task, baseline, stored_run, extra=400) -> Dict[str, List[float]]:
    """``{"own": [steps, examples], "grid": [...]}``: the stored run's batch trace (its last
    batch kept ``extra`` steps more) replayed with its own rates and with the grid's best."""
    batches = stored_run["batches"] + [stored_run["batches"][-1]] * extra
    found = {}
    for name, lrs in (("own", stored_run["lrs"] + [stored_run["lrs"][-1]] * extra),
                      ("grid", [baseline.lr_at(b) for b in batches])):
        run = ab.train_scheduled(task, Replay(batches, lrs), lrs[0], stored_run["seed"],
                                 arm=name, max_steps=task.max_steps)
        found[name] = [run.steps, run.examples]
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits")
    parser.add_argument("--arm", default="adaptive-norms")
    parser.add_argument("--out", default="docs/experiments")
    parser.add_argument("--rerun", action="store_true",
                        help="re-run the arm recording the rule's decisions, and the replays")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    stored = json.loads((Path(args.out) / ab.RESULTS.format(task=args.task)).read_text())
    runs = {arm: {r["seed"]: r for r in stored["runs"] if r["arm"] == arm}
            for arm in (args.arm, "warmup")}
    noise_scales = None
    if args.rerun:
        task = cbs.make_tasks(False, 0)[args.task]
        baseline = ab.baseline_from_json(stored["baseline"])
        noise_scales, recorded, replayed = {}, {}, {}
        for seed, old in sorted(runs[args.arm].items()):
            run, recorded[seed] = recorded_run(task, args.arm, baseline, seed)
            noise_scales[seed] = [d["noise_scale"] for d in recorded[seed]]
            replayed[seed] = replays(task, baseline, old)
            print(f"seed {seed}: stored {old['steps']:.1f} steps; re-run {run.steps:.1f}; "
                  f"replayed {replayed[seed]}", flush=True)
        for name in ("own", "grid"):
            steps = np.array([replayed[s][name][0] for s in replayed])
            print(f"replay with {name} rates: {steps.mean():.1f} steps")
        levels = LEVELS[args.task]
        bounds = {s: phase_bounds(runs[args.arm][s]["eval_steps"],
                                  runs[args.arm][s]["eval_losses"], levels) for s in recorded}
        for i, level in enumerate(levels):
            shares = decision_shares(recorded, bounds, i)
            print(f"decisions to loss {level}: " + json.dumps({k: round(v, 3) for k, v in shares.items()}))
    for row in phase_rows(runs[args.arm], runs["warmup"], LEVELS[args.task], noise_scales):
        print(json.dumps({k: round(v, 3) for k, v in row.items()}))


if __name__ == "__main__":
    main()
