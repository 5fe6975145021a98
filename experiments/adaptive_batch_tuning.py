"""Tuning runs of the adaptive batch experiment: arms on seeds the page does not report.

A change of the schedule's rule is decided here, on seeds apart from those the page
reports (``experiments.adaptive_batch``'s 0..N-1), then the page's runs are redone. Each
run is ``experiments.adaptive_batch.run_arm`` with ``cgn.BatchSchedule``'s ``rule=`` set to
``--rule``; one line per run (steps, examples, frontier value, the batch changes):

    python -m experiments.adaptive_batch_tuning --rule sqrt --seeds 100-105
    python -m experiments.adaptive_batch_tuning --rule auto --seeds 100-105

(``auto`` under Adam: McCandlish et al.'s rule on the preconditioned step since the rule
``adam-lr``; ``sqrt``: the square-root rule, what ``auto`` was before.)
"""

import argparse
import json
import warnings
from pathlib import Path
from unittest import mock

import cockpit_gradnoise as cgn

import torch

from experiments import adaptive_batch as ab
from experiments import critical_batch_size as cbs


def seeds_of(text):
    """``"100-105"`` -> 100..105; ``"3,7"`` -> 3, 7."""
    if "-" in text:
        first, last = map(int, text.split("-"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def main(argv=None):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gpt")
    parser.add_argument("--arms", default="adaptive-norms,adaptive-per-example,warmup,fixed")
    parser.add_argument("--seeds", default="100-105", help="e.g. 100-105 or 100,103")
    parser.add_argument("--rule", default="auto", choices=["auto", "sgd", "sqrt"],
                        help="the adaptive arms' BatchSchedule(rule=...)")
    parser.add_argument("--results", default="docs/experiments",
                        help="the folder of adaptive-batch-<task>.json (the fixed arm's lr)")
    args = parser.parse_args(argv)
    task = cbs.make_tasks(False, 0)[args.task]
    baseline = ab.baseline_of(task, ab.GRID, False, print)
    fixed_lr = json.loads((Path(args.results) / ab.RESULTS.format(task=task.name)).read_text())[
        "fixed"]["lr"]
    schedule = cgn.BatchSchedule

    def with_rule(*given, **options):
        if options.get("rule") == "auto":  # the ablation's rule=None stays
            options["rule"] = args.rule
        return schedule(*given, **options)

    with mock.patch.object(cgn, "BatchSchedule", with_rule):
        for seed in seeds_of(args.seeds):
            for arm in args.arms.split(","):
                run = ab.run_arm(task, arm, baseline, seed, fixed_lr)
                changes = [(c["step"], c["new_batch"], round(c["lr_factor"], 2))
                           for c in run.changes]
                print(f"{args.rule} {arm} {seed}: S {run.steps:.1f} E {run.examples:.0f} "
                      f"value {run.frontier(baseline.s_min, baseline.e_min):.3f} "
                      f"({run.seconds:.0f} s) {changes}", flush=True)


if __name__ == "__main__":
    main()
