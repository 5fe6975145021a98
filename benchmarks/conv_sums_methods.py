"""Convolutions' ``[sum_i x_i, sum_i x_i**2]``: formation against expansion, per layer (issue 21).

On torchvision's resnet18 (float32, 3x32x32, batch 64, eval mode, random
weights), each convolution's input and output gradient are captured from one
real backward pass; then, per layer:

- **time**: :func:`cockpit_gradnoise.extensions.conv_math.weight_sums` with
  each method forced (``cost_model.FORCE_METHOD``), CPU time of one thread
  (``time.process_time``), the minimum of ``--repeats`` interleaved
  repetitions, and the method the cost model chooses;
- **margins** (layers with ``L > 1``): the expansion's ``[T, S, R]`` in
  float32 against formation in float64 from the same (widened) factors.
  ``error / bound``: the largest ``|C_32 - C_64|`` over the bound
  ``(3N + 4) eps S + N eps R`` (at most 1 if the bound holds); ``clamped``:
  the fraction of elements whose exact centred sum ``C_64`` is at or below
  the bound, among those where it is positive (real variance the bound
  would set to 0), beside the same for formation's bound ``(3N + 4) eps S``;
  ``C / bound``: quantiles of the margin over those elements;
  ``identical``: the largest ``C_32 / bound`` when every example is
  example 0 (rounding noise only: at most 1, then sd is 0).

::

    python -m benchmarks.conv_sums_methods --repeats 5
"""

import argparse
import sys
import time
from pathlib import Path

from cockpit_gradnoise import functional
from cockpit_gradnoise.extensions import conv_math, cost_model

import numpy
import torch
from torch import nn

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.models import MODELS, model_and_batch  # noqa: E402

EPS32 = torch.finfo(torch.float32).eps


def captured_layers(model, inputs, targets, loss_fn):
    """``[(name, conv, input, output gradient)]`` from one backward pass."""
    seen = {}

    def forward_hook(module, args, output):
        name = names[module]
        seen[name] = [module, args[0].detach(), None]
        output.register_hook(lambda grad: seen[name].__setitem__(2, grad.detach()))

    names = {m: n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    handles = [m.register_forward_hook(forward_hook) for m in names]
    loss_fn(model(inputs), targets).backward()
    for handle in handles:
        handle.remove()
    return [(name, *seen[name]) for name in names.values()]


def timed(method, conv, inputs, grad_output):
    cost_model.FORCE_METHOD = method
    try:
        start = time.process_time()
        conv_math.weight_sums(conv, inputs, grad_output)
        return time.process_time() - start
    finally:
        cost_model.FORCE_METHOD = None


def bounds(sums, n):
    """``(expansion's bound, formation's bound)`` in float64 from ``[T, S, R]``."""
    relative = functional.variance_rounding_bound(sums[1].double(), n, dtype=torch.float32)
    extra = functional.expansion_rounding_bound(sums[2].double(), n, torch.float32)
    return relative + extra, relative


def centred(sums, n):
    total, squares = sums[0].double(), sums[1].double()
    return squares - total.square() / n


def margins(conv, inputs, grad_output):
    """The margin figures of one layer (module docstring)."""
    n = len(inputs)
    cost_model.FORCE_METHOD = "expansion"
    try:
        got = conv_math.weight_sums(conv, inputs, grad_output)
        same = conv_math.weight_sums(
            conv, inputs[:1].expand_as(inputs), grad_output[:1].expand_as(grad_output)
        )
        cost_model.FORCE_METHOD = "formation"
        exact = conv_math.weight_sums(conv.double(), inputs.double(), grad_output.double())
    finally:
        cost_model.FORCE_METHOD = None
        conv.float()
    bound, relative = bounds(got, n)
    exact_centred = centred(exact, n)
    error = (centred(got, n) - exact_centred).abs()
    # Where every term is 0 (dead units, zero padding) the bound is 0, and so must the error be.
    assert (error[bound == 0] == 0).all()
    real = exact_centred > 0  # elements with real variance
    ratio = (exact_centred[real] / bound[real]).numpy()
    noise = centred(same, n) / bounds(same, n)[0]
    return {
        "error / bound": (error[bound > 0] / bound[bound > 0]).max().item(),
        "clamped": (ratio <= 1).mean(),
        "clamped, formation's bound": (exact_centred[real] <= relative[real]).double().mean().item(),
        "C / bound": numpy.quantile(ratio, [0.0, 1e-3, 1e-2, 0.5]),
        "identical": noise[noise.isfinite()].max().item(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--times-only", action="store_true", help="no margins (faster)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = MODELS["resnet18"]
    model, inputs, targets = model_and_batch(spec, args.batch_size, "cpu")
    layers = captured_layers(model, inputs, targets, spec.loss("mean"))
    print(f"resnet18 3x32x32, batch {args.batch_size}, float32, one thread; ms: min of "
          f"{args.repeats} interleaved repetitions")
    print("| layer | C_b x C_a | L | formation ms | expansion ms | chosen | error / bound "
          "| clamped (formation's bound) | C / bound: min, q0.001, q0.01, median | identical |")
    print("|---|---|---:|---:|---:|---|---:|---:|---|---:|")
    for name, conv, x, g in layers:
        _, c_b, c_a, positions = conv_math.layer_shape(conv, x, g)
        times = {"formation": [], "expansion": []}
        for _ in range(args.repeats):
            for method in times:
                times[method].append(timed(method, conv, x, g))
        formation, expansion = (1e3 * min(times[m]) for m in times)
        chosen = "formation" if cost_model.use_formation(cost_model.expansion_cost, c_b, c_a, positions) \
            else "expansion"
        row = f"| {name} | {c_b} x {c_a} | {positions} | {formation:.1f} | {expansion:.1f} | {chosen} |"
        if positions > 1 and not args.times_only:
            m = margins(conv, x, g)
            quantiles = ", ".join(f"{q:.3g}" for q in m["C / bound"])
            by_formation = m["clamped, formation's bound"]
            clamped = f"{m['clamped']:.2%} ({by_formation:.2%})"
            row += (f" {m['error / bound']:.2g} | {clamped} | {quantiles} | {m['identical']:.2g} |")
        else:
            row += " - | - | - | - |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
