"""Cost of an untracked step (forward + backward, no backpack context) with the hooks.

Compares, on torchvision's resnet18 (batch 32, 3x32x32, float32, CPU): the
plain model, the package's hooks (``cgn.prepare_model(model)``), and BackPACK's
own hooks on the converted model (``backpack.extend(model, use_converter=True)``;
plain ``backpack.extend`` fails on resnet18's in-place operations). The three
are timed in turn, round after round, and each reported as its minimum and
median over the rounds (the machine may be shared), with the ratios to plain;
also the hooked model inside ``backpack.disable()`` (nothing stored). On a
busy machine the differences drown in the noise, so the time spent inside the
hooks themselves is measured too (their functions wrapped with a timer), per
step and as a fraction of the plain step::

    python benchmarks/benchmark_hooks.py --rounds 30
"""

import argparse
import copy
import statistics
import time

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import hooks

import torch
import torchvision
from backpack import disable, extend
from torch import nn


def step(model, inputs, targets, store=True):
    model.zero_grad(set_to_none=True)
    disable.store_io = store
    try:
        nn.functional.cross_entropy(model(inputs), targets).backward()
    finally:
        disable.store_io = True


class Timed:
    """A function that adds the time spent in it to ``seconds``."""

    def __init__(self, function):
        self.function, self.seconds, self.calls = function, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def time_inside_hooks(plain, inputs, targets, rounds):
    """Seconds per step spent in the forward hooks and the tensor hooks, and their calls."""
    stored, ran = Timed(hooks._store_call), Timed(hooks._run_extensions)
    originals = hooks._store_call, hooks._run_extensions
    hooks._store_call, hooks._run_extensions = stored, ran
    try:
        model = cgn.prepare_model(copy.deepcopy(plain))
        step(model, inputs, targets)
        stored.seconds = ran.seconds = stored.calls = ran.calls = 0
        for _ in range(rounds):
            step(model, inputs, targets)
    finally:
        hooks._store_call, hooks._run_extensions = originals
    # ran's time is inside the backward pass, stored's inside the forward pass: no overlap.
    return (stored.seconds + ran.seconds) / rounds, (stored.calls + ran.calls) // rounds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(num_classes=10)
    hooked = cgn.prepare_model(copy.deepcopy(plain))
    models = {
        "plain": (plain, True),
        "cgn hooks": (hooked, True),
        "cgn hooks, backpack.disable()": (hooked, False),
        "BackPACK converter + extend": (extend(copy.deepcopy(plain), use_converter=True), True),
    }
    inputs, targets = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    times = {name: [] for name in models}
    for model, store in models.values():
        step(model, inputs, targets, store)  # warm-up
    for _ in range(args.rounds):
        for name, (model, store) in models.items():
            start = time.perf_counter()
            step(model, inputs, targets, store)
            times[name].append(time.perf_counter() - start)
    base_min, base_median = min(times["plain"]), statistics.median(times["plain"])
    print(f"resnet18, batch {args.batch}, 3x32x32, float32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    for name, values in times.items():
        low, median = min(values), statistics.median(values)
        print(f"{name:30s} min {1e3 * low:7.1f} ms ({low / base_min:.3f}x)   "
              f"median {1e3 * median:7.1f} ms ({median / base_median:.3f}x)")
    inside, calls = time_inside_hooks(plain, inputs, targets, args.rounds)
    print(f"inside the hooks: {1e3 * inside:.2f} ms per step ({calls} hook calls), "
          f"{inside / base_min:.4f} of the fastest plain step")


if __name__ == "__main__":
    main()
