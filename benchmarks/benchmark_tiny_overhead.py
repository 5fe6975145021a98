"""The per-tracked-module overhead at the tiny size, and the Python calls per parameter (issue 32).

``benchmark_realistic``'s tiny configuration alone (GPT-2 and the Llama at 2 layers, width
32, vocabulary 128, sequence 16, batch 2), where compute is negligible and a tracked
step's extra time is the package's host work: ``(tracked - plain) / tracked modules`` in
microseconds of CPU time (one thread, methods interleaved in shuffled rounds, medians),
without the realistic size's half-minute steps. ``--profile`` adds a cProfile of one
tracked step of each method after a warm-up step: Python function calls per trainable
parameter per step (deterministic: no timing), and the functions with the most calls.
Run the package under test and a copy of another commit one after the other to compare
(``PYTHONPATH=/tmp/base:.`` for the copy). ::

    python -m benchmarks.benchmark_tiny_overhead --rounds 30 --profile
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.benchmark_realistic import METHODS, MODELS, SIZES, measure  # noqa: E402
from benchmarks.models import token_loss  # noqa: E402


def calls_per_parameter(name, top=8):
    """``{method: calls per trainable parameter}`` of one tracked step at the tiny size."""
    options, sequence, batch = SIZES["tiny"]
    options = {k: v for k, v in options.items() if not (name == "gpt2" and k == "mlp")}
    torch.manual_seed(0)
    model = MODELS[name](**options)
    vocabulary = model.model.config.vocab_size
    x, y = (torch.randint(0, vocabulary, (batch, sequence)) for _ in range(2))
    parameters = sum(1 for p in model.parameters() if p.requires_grad)
    found = {}
    for method, build in METHODS.items():
        step = build(model, token_loss)
        step(x, y)  # first-call work (plans, checks) is not per step
        profile = cProfile.Profile()
        profile.runcall(step, x, y)
        stats = pstats.Stats(profile)
        found[method] = stats.total_calls / parameters
        print(f"  {name} {method}: {stats.total_calls} calls, {found[method]:.0f} per parameter "
              f"({parameters} parameters); most called:")
        ranked = sorted(stats.stats.items(), key=lambda item: -item[1][1])[:top]
        for (path, line, function), (_, calls, *_) in ranked:
            print(f"      {calls:6d}  {Path(path).name}:{line}:{function}")
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also count calls per parameter")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    print(f"cockpit_gradnoise from {Path(cgn.__file__).parent}, torch {torch.__version__}, 1 thread, "
          f"CPU time, {args.rounds} rounds; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    results = {}
    for name in args.models.split(","):
        tiny, modules, _ = measure(name, "tiny", args.rounds)
        plain = statistics.median(tiny["plain"])
        results[name] = {"plain ms": plain * 1e3, "tracked modules": modules}
        for method in METHODS:
            per_module = (statistics.median(tiny[method]) - plain) / modules * 1e6
            spread = statistics.quantiles([t * 1e3 for t in tiny[method]], n=4)
            print(f"{name} {method}: {per_module:.0f} us per tracked module ({modules} modules; plain "
                  f"{plain * 1e3:.2f} ms; tracked quartiles {spread[0]:.2f} / {spread[2]:.2f} ms)", flush=True)
            results[name][method] = per_module
        if args.profile:
            results[name]["calls per parameter"] = calls_per_parameter(name)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return results


if __name__ == "__main__":
    main()
