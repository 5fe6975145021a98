"""The hooks' work per tracked module in the backward pass (issue 32), in CPU time.

On a GPU a tracked step is launch- and host-bound: what counts is the ops and the
Python each tracked module costs, not their arithmetic. The package does that
work in two places: in the backward pass, where each layer's hook runs the rules
(``extensions/``: scales, squares, reductions, the records of the pass), and after
it, where the quantities reduce what the rules left. This script separates the
two on the tiny models of ``benchmark_op_count`` (``benchmark_realistic``'s tiny
GPT-2, 16 tracked modules, and resnet18 at 32x32, batch 4, 41), for
PerExampleGradNorm + GradientNoiseScale and all five: in one process, one thread,
each step's CPU time (``time.process_time``) and that of its ``loss.backward()``
(``Tensor.backward`` wrapped with a timer), the plain step and the tracked steps
interleaved in a shuffled order each round. Reported, per tracked module, the
median over the rounds of ``(tracked - plain)``: of the whole step and of the
backward pass alone, in microseconds, with the quartiles of the backward's share
(the machine's noise) and its difference of the fastest rounds (noise only adds time).

By default the paths of other devices run (``_device.on_host`` patched as in
``benchmark_op_count``): the Python a GPU's host runs; ``--host-paths`` times the
CPU's own paths. ::

    python -m benchmarks.benchmark_hook_work --rounds 40
    python -m benchmarks.benchmark_hook_work --models gpt2-tiny --methods "all five" --host-paths
"""

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.benchmark_op_count import MODELS, add_path_options, take_paths  # noqa: E402
from benchmarks.benchmark_realistic import METHODS, tracked_modules  # noqa: E402
from benchmarks.methods import plain_step  # noqa: E402


class BackwardTimer:
    """``Tensor.backward`` timed while inside: ``seconds``, the CPU time of the last call."""

    def __init__(self):
        self.seconds, self._original = 0.0, None

    def __enter__(self):
        self._original = original = torch.Tensor.backward

        def backward(tensor, *args, **kwargs):
            start = time.process_time()
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self.seconds = time.process_time() - start

        torch.Tensor.backward = backward
        return self

    def __exit__(self, *exc):
        torch.Tensor.backward = self._original


def quartiles(values):
    low, middle, high = statistics.quantiles(values, n=4)
    return low, middle, high


def measure(name, rounds, methods, seed=0):
    """``{method: {"step": [us per module], "backward": [us per module]}}`` of model ``name``."""
    model, x, y, loss = MODELS[name]()
    modules = tracked_modules(model)
    steps = {"plain": plain_step(model, loss)}
    steps.update({method: METHODS[method](model, loss) for method in methods})
    times = {method: {"step": [], "backward": []} for method in steps}
    order = random.Random(seed)
    with BackwardTimer() as timer:
        for step in steps.values():  # warm-up: first-call work (plans, checks) is not per step
            step(x, y)
        for _ in range(rounds):
            names = list(steps)
            order.shuffle(names)
            for method in names:
                start = time.process_time()
                steps[method](x, y)
                times[method]["step"].append(time.process_time() - start)
                times[method]["backward"].append(timer.seconds)
    plain = {part: statistics.median(seconds) for part, seconds in times["plain"].items()}
    print(f"\n{name}: {modules} tracked modules; plain step {plain['step'] * 1e3:.2f} ms, "
          f"its backward {plain['backward'] * 1e3:.2f} ms (medians of {rounds} rounds)")
    result = {"tracked modules": modules, "plain ms": plain["step"] * 1e3,
              "plain backward ms": plain["backward"] * 1e3}
    for method in methods:
        per_module = {part: [(s - plain[part]) / modules * 1e6 for s in seconds]
                      for part, seconds in times[method].items()}
        step, backward = (statistics.median(per_module[part]) for part in ("step", "backward"))
        low, _, high = quartiles(per_module["backward"])
        # Fastest rounds (noise only adds time): (fastest tracked - fastest plain) / modules.
        fastest = (min(times[method]["backward"]) - min(times["plain"]["backward"])) / modules * 1e6
        print(f"  {method}: {step:.0f} us per tracked module, of which the backward pass {backward:.0f} us "
              f"(quartiles over rounds {low:.0f} to {high:.0f}; fastest rounds {fastest:.0f} us), "
              f"after it {step - backward:.0f} us")
        result[method] = {"step us per module": step, "backward us per module": backward,
                          "backward quartiles": (low, high), "backward fastest us per module": fastest}
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_path_options(parser)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--methods", default="PerExampleGradNorm+GradientNoiseScale",
                        help=f"comma-separated, of {', '.join(METHODS)} (all five on resnet18 takes ~3 s a step)")
    args = parser.parse_args(argv)
    take_paths(args)
    print(f"torch {torch.__version__}, cockpit_gradnoise {Path(cgn.__file__).parent}, "
          f"{'CPU' if args.host_paths else 'device'} paths, one thread, CPU time; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    methods = args.methods.split(",")
    results = {name: measure(name, args.rounds, methods) for name in args.models.split(",")}
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return results


if __name__ == "__main__":
    main()
