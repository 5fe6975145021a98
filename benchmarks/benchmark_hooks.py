"""Cost of an untracked step (forward + backward, no backpack context) with the hooks.

Compares, on torchvision's resnet18 (batch 32, 3x32x32, float32, CPU): the
plain model, the package's hooks (``cgn.prepare_model(model)``), and BackPACK's
own hooks on the converted model (``backpack.extend(model, use_converter=True)``;
plain ``backpack.extend`` fails on resnet18's in-place operations). The three
are timed in turn, round after round, and each reported as its minimum and
median over the rounds (the machine may be shared), with the ratios to plain::

    python benchmarks/benchmark_hooks.py --rounds 30
"""

import argparse
import copy
import statistics
import time

import cockpit_gradnoise as cgn

import torch
import torchvision
from backpack import extend
from torch import nn


def step(model, inputs, targets):
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(inputs), targets).backward()


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
    models = {
        "plain": plain,
        "cgn hooks": cgn.prepare_model(copy.deepcopy(plain)),
        "BackPACK converter + extend": extend(copy.deepcopy(plain), use_converter=True),
    }
    inputs, targets = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    times = {name: [] for name in models}
    for name, model in models.items():
        step(model, inputs, targets)  # warm-up
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            step(model, inputs, targets)
            times[name].append(time.perf_counter() - start)
    base_min, base_median = min(times["plain"]), statistics.median(times["plain"])
    print(f"resnet18, batch {args.batch}, 3x32x32, float32, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    for name, values in times.items():
        low, median = min(values), statistics.median(values)
        print(f"{name:30s} min {1e3 * low:7.1f} ms ({low / base_min:.3f}x)   "
              f"median {1e3 * median:7.1f} ms ({median / base_median:.3f}x)")


if __name__ == "__main__":
    main()
