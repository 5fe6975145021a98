"""The two ``torch.func`` formulations of the fallback's per-example gradients, side by side.

Per module (``benchmark_fallback``'s: nanoGPT's LayerNorm, a layer scale, HF
``Conv1D``; batch 32, 64 positions, width 128), in one process, in CPU time of
one thread, the fastest of ``--repeats`` interleaved rounds, each the
per-example gradients of the module's parameters for the whole batch (no
reductions):

- ``plain``: the module's forward and backward (input and parameter gradients);
- ``forward + autograd``: the module's forward under ``vmap`` with an expanded
  copy of each parameter per example, then one ``torch.autograd.grad`` to
  the copies (what :func:`cockpit_gradnoise.extensions.fallback.replay.per_example_gradients`
  does, there with the parameters swapped in place rather than by
  ``functional_call``);
- ``vmap of vjp``: ``vmap`` over the examples of ``torch.func.vjp`` of the
  module's forward with its parameters as the primal (Opacus' form).

Run: ``PYTHONPATH=. python -m benchmarks.fallback_vmap_methods [--repeats 15]``.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call, vjp, vmap

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.benchmark_fallback import WIDTH, LayerScale, N, NanoLayerNorm, T  # noqa: E402


def forward_and_autograd(module, params, x, grad):
    copies = {name: p.expand(len(x), *p.shape).requires_grad_() for name, p in params.items()}
    outputs = vmap(lambda own, example: functional_call(module, own, (example.unsqueeze(0),)))(copies, x)
    return torch.autograd.grad(outputs, list(copies.values()), grad.unsqueeze(1))


def vmap_of_vjp(module, params, x, grad):
    def one(example, g):
        _, pullback = vjp(lambda own: functional_call(module, own, (example.unsqueeze(0),)), params)
        return pullback(g.unsqueeze(0))[0]

    return vmap(one)(x, grad)


def modules():
    from transformers.pytorch_utils import Conv1D

    return {"nanoGPT LayerNorm": NanoLayerNorm(WIDTH), "layer-scale gamma": LayerScale(WIDTH),
            "HF Conv1D(384, 128)": Conv1D(3 * WIDTH, WIDTH)}


def measure(module, repeats):
    x = torch.randn(N, T, WIDTH)
    grad = torch.randn_like(module(x))
    params = {name: p.detach() for name, p in module.named_parameters()}
    leaf = x.clone().requires_grad_()

    def plain():
        module.zero_grad(set_to_none=True)
        leaf.grad = None
        module(leaf).backward(grad)

    methods = {"plain": plain,
               "forward + autograd": lambda: forward_and_autograd(module, params, x, grad),
               "vmap of vjp": lambda: vmap_of_vjp(module, params, x, grad)}
    expected = forward_and_autograd(module, params, x, grad)
    for got, want in zip(vmap_of_vjp(module, params, x, grad).values(), expected):
        torch.testing.assert_close(got, want)  # the same numbers
    times = {name: [] for name in methods}
    for _ in range(repeats + 1):  # the first round warms up
        for name, method in methods.items():
            start = time.process_time()
            method()
            times[name].append(time.process_time() - start)
    return {name: min(values[1:]) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, one thread, CPU clock, fastest of {args.repeats} rounds, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"| module (batch {N}) | plain ms | forward + autograd ms | vmap of vjp ms |")
    print("|---|---|---|---|")
    for label, module in modules().items():
        found = measure(module, args.repeats)
        print(f"| {label} | {1e3 * found['plain']:.2f} | {1e3 * found['forward + autograd']:.2f} "
              f"| {1e3 * found['vmap of vjp']:.2f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
