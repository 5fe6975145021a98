"""The fallback's ``vmap`` route checked to add up (``extensions/fallback/sum_check.py``): its cost.

At the first tracked step of each module on the route, the module runs once more on the whole
batch and its gradient is compared with the sum of its examples' contributions; later steps
skip it. Measured on models of the architecture sweep (``experiments/sweep_models.py``, their
tiny configurations, as the sweep builds them) whose modules without a rule take the route:
the first and the second tracked training step (``cgn.track(model, every=1)``, all five
quantities, training mode), with the check and without it (every module's check marked done
before the first step: the code path before the check), and a plain step of the same model,
interleaved in one process, CPU time (``time.process_time``), one thread, medians over the
rounds; and the CPU time spent inside the check itself (the batch's run and the comparison),
which the noise of a whole first step (its survey passes, one-time work) hides. Each round
tracks a fresh copy of the model (the first step is the one measured).

    PYTHONPATH=. python -m benchmarks.benchmark_sum_check [--models funnel gemma3n_text] [--rounds 5]
"""

import argparse
import copy
import gc
import statistics
import time
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.fallback import sum_check
from cockpit_gradnoise.extensions.fallback.capture import ATTRIBUTE, Fallback

import torch

from experiments import sweep_behaviour, sweep_models


class _Timed:
    """The CPU seconds spent in the check itself (:func:`.sum_check.not_summing_under_vmap`)."""

    def __init__(self):
        self.seconds, self.original = 0.0, sum_check.not_summing_under_vmap
        sum_check.not_summing_under_vmap = self

    def __call__(self, *args):
        start = time.process_time()
        try:
            return self.original(*args)
        finally:
            self.seconds += time.process_time() - start


def _states(model: torch.nn.Module):
    return [s for s in (getattr(m, ATTRIBUTE, None) for m in model.modules()) if isinstance(s, Fallback)]


def _tracked_steps(case, checked: bool):
    """CPU seconds of the first two tracked steps of a fresh copy; the modules checked."""
    model, tracker = cgn.track(copy.deepcopy(case.model).train(), every=1)
    if not checked:  # the route as it was: no module's sum checked
        for state in _states(model):
            state.sums_checked = True
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for step in (0, 1):
        gc.collect()
        start = time.process_time()
        sweep_behaviour._tracked_step(case, model, optimizer, step, tracker)
        times.append(time.process_time() - start)
    modules = sum(1 for s in _states(model) if s.sums_checked) if checked else 0
    return times, modules


def _plain_step(case, plain, optimizer) -> float:
    gc.collect()
    start = time.process_time()
    sweep_behaviour._plain_step(case, plain, optimizer, 0)
    return time.process_time() - start


def measure(name: str, rounds: int) -> dict:
    case = sweep_models.build("transformers", name)
    plain = copy.deepcopy(case.model).train()
    optimizer = torch.optim.SGD(plain.parameters(), lr=1e-3)
    _plain_step(case, plain, optimizer)  # warm-up
    found = {"plain": [], "first off": [], "first on": [], "second off": [], "second on": []}
    modules, timed = 0, _Timed()
    for _ in range(rounds):
        for checked in (False, True):
            before = timed.seconds
            (first, second), count = _tracked_steps(case, checked)
            if checked:
                found.setdefault("check itself", []).append(timed.seconds - before)
            kind = "on" if checked else "off"
            found[f"first {kind}"].append(first)
            found[f"second {kind}"].append(second)
            modules = max(modules, count)
        found["plain"].append(_plain_step(case, plain, optimizer))
    return {"model": name, "modules checked": modules,
            **{kind: 1e3 * statistics.median(values) for kind, values in found.items()},
            "first on - off (each round)": [round(1e3 * (b - a), 1)
                                            for a, b in zip(found["first off"], found["first on"])]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["funnel", "gemma3n_text"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print("| model | modules checked | plain ms | first step, no check ms | first step, checked ms "
          "| added ms | the check itself ms | second step, no check ms | second step, checked ms "
          "| added per round ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        r = measure(name, args.rounds)
        print(f"| {name} | {r['modules checked']} | {r['plain']:.1f} | {r['first off']:.1f} | "
              f"{r['first on']:.1f} | {r['first on'] - r['first off']:.1f} | {r['check itself']:.1f} | "
              f"{r['second off']:.1f} | "
              f"{r['second on']:.1f} | {r['first on - off (each round)']} |", flush=True)


if __name__ == "__main__":
    main()
