"""Per-element work of the quantities, in nanoseconds per gradient element, one thread.

What a tracked step spends on the numbers after the backward pass: for each
model, one backward pass with the package's extensions leaves the sums
``[T, S]`` on every parameter (:class:`~cockpit_gradnoise.extensions.SumsOfContributions`),
and then each candidate below runs on those same tensors, interleaved in
rounds (candidate A, B, C, A, B, C, ...), one thread
(``torch.set_num_threads(1)``); the table gives the median and the minimum
over the rounds of the process's CPU time (``time.process_time``: on a
shared machine, time spent descheduled is not counted) divided by the
number of gradient elements.

Candidates:

- ``reference``: a minimal pipeline written here, per layer: one sd
  ``sqrt(max(S - T**2 / N, 0) N / (N - 1))``, one SNR ``|T| / sd`` and one
  ``torch.bincount`` of the top 14 bits of the sd (eager torch, whole
  tensors): the floor the quantities' own work is compared with (issue 21's
  target: within 1.5x).
- ``GradientVarianceQuantiles``: the quantity's computation
  (``value_from_sums`` per layer, ``statistics_of_values``: sd with the
  rounding clamp and SNR of all layers into two buffers, exact quantiles and
  means of both, per layer and for the network), and its two halves: the
  elementwise part (``functional.sd_and_signal_to_noise``), and the
  quantiles and means of its results (``functional.sd_statistics_in_place``,
  on a copy of the buffers made in the timed call: the selection reorders
  them).
- ``torch.compile``: the elementwise part as one compiled function (sd with
  the rounding clamp, SNR capped at the limit, the left-out count), inductor
  on the CPU, ``dynamic=True`` so that one compile serves every layer; its
  first call's seconds (the compile) are printed, and whether its sd and SNR
  equal the eager ones bit for bit. The claim weighed (issue 21): only a
  fused compiled kernel would reach 1.5x the reference. ``--no-compile``
  leaves it out.
- ``the bucket selection``: the earlier path of the quantity on the CPU,
  still that of ``functional.sd_statistics_of_layers`` (``gradient_sd``,
  ``signal_to_noise``, bucket counts and gathered candidates sorted).
- ``ParamGradRatio``: the quantity's ``parameter_value`` per layer and its
  statistics (the passes over ``param`` and ``param.grad``).
- Floors, to weigh the targets (issue 21: GradientVarianceQuantiles within
  1.5x of the reference, and on the MLP at most 2.5x a plain step):

  - ``plain step``: forward and backward of the model without extensions,
    per gradient element;
  - ``floor of an exact selection``: less than any exact selection of the
    quantity's statistics can do, one single-rank partition (NumPy's SIMD
    selection, its fastest) of each layer's non-zero sd and SNR values,
    nothing for the network's, and the float64 sums of the means, on copies
    into buffers made beforehand; five levels need more than one rank;
  - ``the sums' two matrix products`` (MLP only): ``T = G^T A`` and
    ``S = (G^2)^T (A^2)`` per weight, of random factors of its shapes, which
    ``SumsOfContributions`` computes for a Linear layer without positions.

  A line per model then adds them up: the elementwise part plus the
  selection floor against the reference, and, on the MLP, a plain step plus
  the products, the elementwise part and the selection floor against a plain
  step (the extensions' and Cockpit's own costs left out).

A second table gives the same figure per layer family (the class of the
layer that holds the parameters: Linear, Conv2d, BatchNorm2d, LayerNorm,
Embedding, ...), issue 21's measure of what each family's rows cost after the
backward pass: the reference and the quantities' work on that family's
layers alone (GradientVarianceQuantiles' and ParamGradRatio's statistics of
each layer, not the network's), interleaved in rounds, each against the
reference on the same elements. Small layers (biases, norms) show their
fixed costs per call there. ``--no-families`` leaves it out.

Run ``python benchmarks/benchmark_per_element.py`` (``--models mlp,resnet18``,
``--rounds``, ``--quick`` for a smoke test). The machine may be shared:
rounds are interleaved so that disturbances hit every candidate alike, and
the median is the figure to read.
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)
from cockpit_gradnoise import functional  # noqa: E402
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions, arena  # noqa: E402
from cockpit_gradnoise.functional.fused import memory_order  # noqa: E402
from cockpit_gradnoise.step import Batch  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402
from backpack import backpack, extend  # noqa: E402

from benchmarks.models import MODELS, model_and_batch  # noqa: E402


def tracked_tensors(model_name, batch_size=None, by_family=False):
    """``(params, n)``: a model's parameters after one backward pass with the sums extension
    (with ``by_family``: ``{family: params}`` for the params, :func:`families`)."""
    spec = MODELS[model_name]
    model, x, y = model_and_batch(spec, batch_size or spec.batch_size, torch.device("cpu"))
    model = cgn.prepare_model(model)
    loss = extend(spec.loss("mean"))(model(x), y)
    with backpack(SumsOfContributions()):
        loss.backward()
    if by_family:
        return families(model), len(x)
    return [p for p in model.parameters() if p.requires_grad], len(x)


def families(model):
    """``{family: trainable params}``, a family being the class of the layer that holds a
    parameter (Linear, Conv2d, LayerNorm, Embedding, ...), in the order first met."""
    found = {}
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if params:
            found.setdefault(type(module).__name__, []).extend(params)
    return found


_BUCKET_SHIFT = 32 - 14
LEVELS = (0.05, 0.25, 0.5, 0.75, 0.95)


def reference(params, n):
    """One sd, one SNR and one bincount of the sd's buckets per layer (the floor)."""
    for param in params:
        total, squares = getattr(param, SUMS_SAVEFIELD)[:2]
        sd = (squares - total * total / n).clamp_(min=0).mul_(n / (n - 1)).sqrt_()
        snr = total.abs() / sd  # noqa: F841 (the work is what is measured)
        torch.bincount((sd.view(torch.int32) >> _BUCKET_SHIFT).reshape(-1), minlength=1 << 14)


def gvq_values(quantity, params, n):
    batch = Batch(n, 1.0)
    return [quantity.value_from_sums(quantity.parameter_sums(p, batch), batch) for p in params]


def gvq_all(quantity, params, n, network=True):
    """The quantity's statistics of the savefields' sums, formed into new buffers each call:
    over a union (one layer's own sums tile their storage) sd and SNR would overwrite the
    sums the next round reads."""
    with mock.patch.object(arena, "union_of", lambda layers: None):
        return quantity.statistics_of_values(gvq_values(quantity, params, n), network)


def pgr_all(quantity, params, n, network=True):
    values = [quantity.parameter_value(p, None) for p in params]
    return quantity.statistics_of_values(values, network)


def layer_sums(params):
    """Per layer ``(S, T)``, views of the sums savefield, and ``R`` where it has one
    (sums expanded over positions: resnet18's layer3 convolutions)."""
    return [(sums[1], sums[0], *sums[2:]) for sums in (getattr(p, SUMS_SAVEFIELD) for p in params)]


def gvq_elementwise(params, n):
    sums = layer_sums(params)
    return functional.sd_and_signal_to_noise(sums, n, functional.resolvable_snr(n, torch.float32))


def layer_views(buffer, sds):
    """``buffer`` (a tensor or array of all layers' elements) cut into the layers of ``sds``."""
    offsets = [0]
    for view in sds:
        offsets.append(offsets[-1] + view.numel())
    return [buffer[start:end] for start, end in zip(offsets, offsets[1:])]


def gvq_statistics(formed, levels=LEVELS):
    """Quantiles and means of formed sd and SNR, on copies (the selection reorders them)."""
    sd, snr, sds, snrs, left_out = formed
    sd, snr = sd.clone(), snr.clone()
    views = [layer_views(b, sds) for b in (sd, snr)]
    return functional.sd_statistics_in_place(*views, left_out, levels, True, (sd, snr))


def selection_floor(formed):
    """Less than an exact selection of five levels, per layer and of the network, can do:
    one single-rank partition (the median) of each layer's non-zero sd and SNR values, and
    the float64 sums of both. The zeros are taken out beforehand, untimed (a partition slows
    down tenfold on a value repeated that often), and each layer's values are copied into a
    buffer made beforehand (the partition reorders them), so no time goes to fresh memory."""
    sd, snr, sds, _, _ = formed
    buffers = [buffer.numpy() for buffer in (sd, snr)]
    layers = [values[values != 0] for buffer in buffers for values in layer_views(buffer, sds)]
    work = [numpy.empty_like(values) for values in layers]

    def floor():
        for buffer in buffers:
            buffer.sum(dtype=numpy.float64)
        for values, scratch in zip(layers, work):
            if values.size:
                numpy.copyto(scratch, values)
                scratch.partition(values.size // 2)

    return floor


def plain_step(model_name, batch_size=None):
    """A training step's forward and backward of the model without extensions."""
    spec = MODELS[model_name]
    model, x, y = model_and_batch(spec, batch_size or spec.batch_size, torch.device("cpu"))
    loss = spec.loss("mean")

    def step():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    return step


def sums_products(params, n):
    """``T = G^T A`` and ``S = (G^2)^T (A^2)`` per 2-D weight, of random factors of its shapes."""
    factors = [(torch.randn(n, p.shape[0]), torch.randn(n, p.shape[1])) for p in params if p.dim() == 2]

    def products():
        for g, a in factors:
            torch.mm(g.T, a)
            torch.mm(g.square().T, a.square())

    return products


def floors(model_name, times):
    """The per-model line adding up the floors (module docstring), from median times."""
    median = {name: statistics.median(ns) for name, ns in times.items()}
    reference = median["reference: one sd, one SNR, one bincount"]
    per_element = median[ELEMENTWISE] + median[SELECTION_FLOOR]
    line = (f"{model_name}: elementwise part + selection floor = {per_element:.2f} ns/element, "
            f"{per_element / reference:.2f} x the reference (target 1.5)")
    if PRODUCTS in median:
        step = median[PLAIN] + median[PRODUCTS] + per_element
        line += (f"; plain step + sums' products + that = {step:.2f} ns/element, "
                 f"{step / median[PLAIN]:.2f} x the plain step's {median[PLAIN]:.2f} "
                 "(GradientVarianceQuantiles' target on the MLP: 2.5)")
    return line


def gvq_bucket_selection(params, n, levels=LEVELS):
    """The earlier path: gradient_sd, signal_to_noise, bucket selection of the quantiles."""
    sds, snrs = [], []
    for param in params:
        total, squares = getattr(param, SUMS_SAVEFIELD)[:2]
        sd = functional.gradient_sd(squares, total, n, dtype=total.dtype)
        snrs.append(functional.signal_to_noise(total, sd, functional.resolvable_snr(n, total.dtype)))
        sds.append(sd)
    return functional.sd_statistics_of_layers(sds, snrs, levels, True)


def compiled_elementwise():
    """sd with the rounding clamp, capped SNR and the left-out count of one layer, compiled."""

    def elementwise(squares, total, n: int, rounding: float, limit: float):
        centred = torch.addcmul(squares, total, total, value=-1.0 / n)
        kept = centred > squares * rounding
        sd = torch.where(kept, centred.clamp(min=0.0) * (n / (n - 1)), 0.0).sqrt()
        snr = (total.abs() / sd).clamp(max=limit)
        left_out = snr.isnan()
        return sd, snr.nan_to_num(nan=0.0, posinf=math.inf), left_out.sum()

    return torch.compile(elementwise, dynamic=True)


def compiled_run(function, params, n):
    rounding = (3 * n + 4) * torch.finfo(torch.float32).eps
    limit = functional.resolvable_snr(n, torch.float32)
    return [
        # In the order of memory, as the eager function takes them.
        function(memory_order(s), memory_order(t), n, rounding, limit)
        for s, t, *_ in layer_sums(params)
    ]


def compile_check(function, params, n):
    """Seconds of the first call (the compile), and whether sd and SNR equal the eager ones."""
    start = time.perf_counter()
    compiled = compiled_run(function, params, n)
    seconds = time.perf_counter() - start
    _, _, sds, snrs, _ = gvq_elementwise(params, n)
    same = all(
        torch.equal(c_sd, sd) and torch.equal(c_snr, snr)
        for (c_sd, c_snr, _), sd, snr in zip(compiled, sds, snrs)
    )
    return seconds, same


ELEMENTWISE = "  sd with rounding clamp, SNR (sd_and_signal_to_noise)"
PLAIN = "plain step (forward, backward; no extensions)"
SELECTION_FLOOR = "  floor of an exact selection: one partition per layer's sd and SNR, means"
PRODUCTS = "  the sums' two matrix products (T = G^T A, S = (G^2)^T A^2)"


def candidates(params, n, compiled=None, model_name=None, batch_size=None):
    """Name -> function of no arguments (each returns what it computed)."""
    gvq = cgn.GradientVarianceQuantiles(lambda step: True)
    pgr = cgn.ParamGradRatio(lambda step: True)
    formed = gvq_elementwise(params, n)
    functions = {
        "reference: one sd, one SNR, one bincount": lambda: reference(params, n),
        "GradientVarianceQuantiles: all": lambda: gvq_all(gvq, params, n),
        ELEMENTWISE: lambda: gvq_elementwise(params, n),
        "  quantiles and means (sd_statistics_in_place, with a copy)": lambda: gvq_statistics(formed),
        "  the bucket selection (gradient_sd, signal_to_noise, sd_statistics_of_layers)": (
            lambda: gvq_bucket_selection(params, n)
        ),
        "ParamGradRatio: all": lambda: pgr_all(pgr, params, n),
        SELECTION_FLOOR: selection_floor(formed),
    }
    if model_name is not None:
        functions[PLAIN] = plain_step(model_name, batch_size)
    if model_name == "mlp":
        functions[PRODUCTS] = sums_products(params, n)
    if compiled is not None:
        functions["torch.compile: sd with rounding clamp, SNR, left-out count"] = (
            lambda: compiled_run(compiled, params, n)
        )
    return functions


FAMILY_CANDIDATES = ("reference: one sd, one SNR, one bincount",
                     "GradientVarianceQuantiles: its layers' statistics", "ParamGradRatio: its layers'")


def family_candidates(params, n):
    """Per family: the reference, and the quantities' work on the family's layers alone
    (no network statistics: those are of all families together)."""
    gvq = cgn.GradientVarianceQuantiles(lambda step: True)
    pgr = cgn.ParamGradRatio(lambda step: True)
    functions = (
        lambda: reference(params, n),
        lambda: gvq_all(gvq, params, n, network=False),
        lambda: pgr_all(pgr, params, n, network=False),
    )
    return dict(zip(FAMILY_CANDIDATES, functions))


def measure_families(model_name, rounds, batch_size=None):
    """``{family: (layers, elements, {candidate: ns per element of each round})}``: the
    candidates of every family, interleaved in rounds as :func:`measure`'s."""
    by_family, n = tracked_tensors(model_name, batch_size, by_family=True)
    functions = {(family, name): function for family, params in by_family.items()
                 for name, function in family_candidates(params, n).items()}
    times = interleaved(functions, rounds)
    result = {}
    for family, params in by_family.items():
        elements = sum(p.numel() for p in params)
        result[family] = (len(params), elements, {
            name: [1e9 * t / elements for t in times[(family, name)]] for name in FAMILY_CANDIDATES})
    return result


def interleaved(functions, rounds):
    """``{name: [CPU seconds of each round]}`` of functions run in turn, after one warm-up call."""
    for function in functions.values():
        function()
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():
            start = time.process_time()
            function()
            times[name].append(time.process_time() - start)
    return times


def measure(model_name, rounds, batch_size=None, compiled=None):
    params, n = tracked_tensors(model_name, batch_size)
    elements = sum(p.numel() for p in params)
    note = None
    if compiled is not None:
        seconds, same = compile_check(compiled, params, n)
        note = (f"{model_name}: torch.compile's first call {seconds:.1f} s; its sd and SNR equal "
                f"the eager ones bit for bit: {same}")
    times = interleaved(candidates(params, n, compiled, model_name, batch_size), rounds)
    return elements, {name: [1e9 * t / elements for t in ts] for name, ts in times.items()}, note


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,resnet18,gpt")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke test: MLP, batch 8, 3 rounds")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    parser.add_argument("--no-families", action="store_true", help="leave out the table per family")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.quick:
        models, args.rounds, args.batch_size, args.no_compile = ["mlp"], 3, 8, True
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    compiled, notes, lines = None if args.no_compile else compiled_elementwise(), [], []
    print("\n| model | elements | candidate | ns/element, median | min | ratio to reference |")
    print("|---|---:|---|---:|---:|---:|")
    for model_name in models:
        print(f"measuring {model_name}", file=sys.stderr)
        elements, times, note = measure(model_name, args.rounds, args.batch_size, compiled)
        notes.append(note)
        lines.append(floors(model_name, times))
        floor = statistics.median(next(iter(times.values())))
        for name, ns in times.items():
            median = statistics.median(ns)
            print(
                f"| {model_name} | {elements:,} | {name} | {median:.2f} | {min(ns):.2f} "
                f"| {median / floor:.2f} |"
            )
    print("", *lines, *(note for note in notes if note), sep="\n")
    if not args.no_families:
        print_families(models, args.rounds, args.batch_size)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


def print_families(models, rounds, batch_size):
    """The table per layer family (:func:`measure_families`), each family's ratios to its
    own reference."""
    print("\nPer layer family (the class of the layer holding the parameters):\n")
    print("| model | family | layers | elements | candidate | ns/element, median | min "
          "| ratio to the family's reference |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for model_name in models:
        print(f"measuring {model_name} per family", file=sys.stderr)
        for family, (layers, elements, times) in measure_families(model_name, rounds, batch_size).items():
            floor = statistics.median(times[FAMILY_CANDIDATES[0]])
            for name, ns in times.items():
                median = statistics.median(ns)
                print(f"| {model_name} | {family} | {layers} | {elements:,} | {name} | {median:.2f} "
                      f"| {min(ns):.2f} | {median / floor:.2f} |")


if __name__ == "__main__":
    main()
