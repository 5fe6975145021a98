"""Exact quantiles of many float32 values: selection against sorting, side by side.

Each candidate finds the values at the 10 ranks that quantiles 0.05, 0.25,
0.5, 0.75 and 0.95 need (numpy.quantile's linear method), of values shaped
like a layer's gradient standard deviations (|normal| x lognormal, 10% exact
zeros), for 670k elements (the benchmark MLP) and 11M (resnet18). Every
candidate is checked against ``numpy.sort`` before it is timed. Rounds are
interleaved; the table gives the minimum and the median over rounds (the
minimum is the least disturbed by other processes). Each candidate starts
from the values as the quantity has them and may not reorder them, so a
sort or partition includes its copy.

NumPy's sort and partition use SIMD (AVX512 or AVX2) where the CPU has it.
NumPy 2.4 groups the features (``X86_V4`` is AVX512 SKX, ``X86_V3`` AVX2), so
``NPY_DISABLE_CPU_FEATURES="AVX512_SKX AVX512_ICL"`` turns off ICL only; the
header line says which are on. To see sorting with AVX2 only and with no
SIMD at all::

    python benchmarks/benchmark_order_statistics.py
    NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" python benchmarks/...
    NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR" python benchmarks/...

A second table (CPU) times the quantiles of three layers and of the network
(their union), as :class:`~cockpit_gradnoise.GradientVarianceQuantiles`
needs them: per layer and then the union again, against
``order_statistics.select_each_and_union``, whose network's counts are the
sum of the layers' and whose one gathering pass serves both.

Options: ``--sizes 670000,11000000``, ``--rounds 7``, ``--threads 1``,
``--device cuda`` (torch candidates only, synchronized), ``--quick`` (smoke
test: small sizes, 2 rounds).
"""

import argparse
import os
import statistics
import sys
import time

from cockpit_gradnoise import order_statistics

import numpy
import torch

LEVELS = (0.05, 0.25, 0.5, 0.75, 0.95)


def numpy_sort(values, ranks):
    array = values.numpy().copy()
    array.sort()
    return array[ranks].tolist()


def numpy_partition(values, ranks):
    return numpy.partition(values.numpy(), ranks)[ranks].tolist()


def torch_sort(values, ranks):
    return torch.sort(values).values[ranks].tolist()


def torch_kthvalue(values, ranks):
    found = {r: torch.kthvalue(values, r + 1).values for r in sorted(set(ranks))}
    return [found[r].item() for r in ranks]


def bucket_select(values, ranks):
    return order_statistics.select(values, ranks)


def bucket_select_union_of_8(values, ranks):
    """The same values as the union of 8 tensors (a network's layers), not joined."""
    return order_statistics.select(list(values.chunk(8)), ranks)


CPU_ONLY = {"numpy.sort (copy, in place)", "numpy.partition"}
CANDIDATES = {
    "numpy.sort (copy, in place)": numpy_sort,
    "numpy.partition": numpy_partition,
    "torch.sort": torch_sort,
    "torch.kthvalue per rank": torch_kthvalue,
    "order_statistics.select": bucket_select,
    "order_statistics.select, union of 8": bucket_select_union_of_8,
}


def layers_separately(parts, ranks, union_ranks):
    """Each layer's ranks, then the network's from a second pass over all elements."""
    return [order_statistics.select(p, r) for p, r in zip(parts, ranks)], order_statistics.select(
        parts, union_ranks
    )


def layers_shared(parts, ranks, union_ranks):
    """Both from one counting and one gathering pass (what the quantities do)."""
    return order_statistics.select_each_and_union(parts, ranks, union_ranks)


def layers_numpy_sort(parts, ranks, union_ranks):
    """numpy.sort of each layer and of the joined network."""
    each = [numpy_sort(p, r) for p, r in zip(parts, ranks)]
    return each, numpy_sort(torch.cat(parts), union_ranks)


#: Three layers (60%, 39% and 1% of the elements, at different scales) and
#: their union: a network's quantiles beside its layers'.
LAYER_CANDIDATES = {
    "numpy.sort per layer and of the joined network": layers_numpy_sort,
    "order_statistics.select per layer, then of the union": layers_separately,
    "order_statistics.select_each_and_union (shared passes)": layers_shared,
}


def layer_like(n, device):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(n, generator=generator).abs() * torch.randn(n, generator=generator).exp()
    values[: n // 10] = 0.0
    return values[torch.randperm(n, generator=generator)].to(device)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(n, names, rounds, device):
    values = layer_like(n, device)
    lower, upper, _ = order_statistics.quantile_ranks(LEVELS, n)
    ranks = lower + upper
    expected = numpy.sort(values.cpu().numpy())[ranks].tolist()
    times = {name: [] for name in names}
    for name in names:
        if CANDIDATES[name](values, ranks) != expected:
            raise AssertionError(f"{name} is not exact for n={n}")
    for _ in range(rounds):
        for name in names:
            synchronize(device)
            start = time.perf_counter()
            CANDIDATES[name](values, ranks)
            synchronize(device)
            times[name].append(1e3 * (time.perf_counter() - start))
    return times


def measure_layers(n, rounds):
    """Time :data:`LAYER_CANDIDATES` on CPU (each checked against numpy.sort first)."""
    values = layer_like(n, torch.device("cpu"))
    cuts = [0, int(0.6 * n), int(0.99 * n), n]
    parts = [values[a:b] * scale for a, b, scale in zip(cuts, cuts[1:], (1.0, 10.0, 0.1))]
    ranks = [sum(order_statistics.quantile_ranks(LEVELS, p.numel())[:2], []) for p in parts]
    union_ranks = sum(order_statistics.quantile_ranks(LEVELS, n)[:2], [])
    expected = layers_numpy_sort(parts, ranks, union_ranks)
    times = {name: [] for name in LAYER_CANDIDATES}
    for name, candidate in LAYER_CANDIDATES.items():
        if tuple(candidate(parts, ranks, union_ranks)) != tuple(expected):
            raise AssertionError(f"{name} is not exact for n={n}")
    for _ in range(rounds):
        for name, candidate in LAYER_CANDIDATES.items():
            start = time.perf_counter()
            candidate(parts, ranks, union_ranks)
            times[name].append(1e3 * (time.perf_counter() - start))
    return times


def simd():
    """NumPy's SIMD extensions in use (what its sort can use)."""
    from numpy._core._multiarray_umath import __cpu_features__ as features

    found = [f for f in ("X86_V3", "X86_V4", "AVX512_ICL", "AVX512_SPR") if features.get(f)]
    return ", ".join(found) or "none of X86_V3 (AVX2), X86_V4 (AVX512)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="670000,11000000")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = args.rounds
    if args.quick:
        sizes, rounds = [1000, 100_000], 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [n for n in CANDIDATES if device.type == "cpu" or n not in CPU_ONLY]
    print(
        f"torch {torch.__version__}, numpy {numpy.__version__} (SIMD: {simd()}; "
        f"NPY_DISABLE_CPU_FEATURES={os.environ.get('NPY_DISABLE_CPU_FEATURES', '')!r}), "
        f"{args.threads} thread(s), device {device}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, {rounds} rounds"
    )
    print("| elements | candidate | min ms | median ms |")
    print("|---:|---|---:|---:|")
    for n in sizes:
        print(f"measuring {n} elements", file=sys.stderr)
        for name, times in measure(n, names, rounds, device).items():
            print(f"| {n} | {name} | {min(times):.2f} | {statistics.median(times):.2f} |")
    if device.type != "cpu":
        return
    print("\nQuantiles of three layers and of the network (their union), CPU:\n")
    print("| elements | candidate | min ms | median ms |")
    print("|---:|---|---:|---:|")
    for n in sizes:
        for name, times in measure_layers(n, rounds).items():
            print(f"| {n} | {name} | {min(times):.2f} | {statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
