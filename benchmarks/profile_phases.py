"""Where the time of a tracked step goes, phase by phase, in CPU time of one thread (issue 34).

cProfile inflates Python calls several times over (a tracker's per-call checks
came out ten times their cost under it), so this wraps a few functions of the
package in timers (``time.process_time`` around each call, the wrappers' own
cost about a microsecond a call) and reports each one's total per step:

- ``--preconditioned`` (default): GradientNoiseScale alone and with
  PreconditionedNoiseScale (or the steps ``--methods`` names), with the Adam of
  ``methods.adam_with_state``,
  on ``--model`` (``gpt`` or ``resnet18``): the layer rules of the backward pass
  (the sequence Linear's weights, the convolutions') and the quantity's work
  after it (``P`` and the two weighted sums, the underflow check);
- ``--floor``: the benchmark GPT's sequence Linear weights alone (:func:`floor`): the plain weight
  gradients' products, the Gram matrices of GradientNoiseScale alone, the formation of ``x_i`` that
  PreconditionedNoiseScale's per-element sums need, and the sums and norms from it;
- ``--schedule``: the benchmark GPT with ``cgn.track(..., quantities="norms")``
  and a :class:`cgn.BatchSchedule`, 4 micro-batches of 8 per step: the hooks'
  float64 norms, the tracker's call, Cockpit's context around each micro-batch,
  each quantity of the preset, the schedule.

Nested phases are indented under the phase that contains them. With ``--ab``,
each of this branch's changes to the step is timed against the step without
it, in one process (``--rounds`` rounds, each side once per round in a
shuffled order; the fastest and the median round): ``chunks``, the sequence
Linear's formation in chunks of ``HOST_FORMATION_BYTES`` against the whole
batch at once (``CHUNK_BYTES``); ``aminmax``, the largest magnitudes of the
factors by ``aminmax`` against torch's CPU inf-norm; ``pieces``, ``P`` formed piece by piece
with PreconditionedNoiseScale's weighted sums, read in the sums' memory order, against the whole
``P`` first and the sums flattened (:func:`_whole_weighted_sums`, the code before); ``shared-conv``, a
convolution's weight sums and norms from one formation (``convolution.shares_formation``) against each
computed apart; ``zero-columns``, a convolution's sums over the kernel elements that read something besides
padding, at one position and in the expansion's products row by row (``conv_math.nonzero_columns``,
``nonzero_columns_of_rows``), against all of them. ::

    python -m benchmarks.profile_phases --model gpt --steps 6
    python -m benchmarks.profile_phases --schedule --steps 18
    python -m benchmarks.profile_phases --floor --rounds 10
    python -m benchmarks.profile_phases --floor --model swin --rounds 10
    python -m benchmarks.profile_phases --model resnet18 --steps 3 --by-layer
    python -m benchmarks.profile_phases --model resnet18 --steps 6 --methods \\
        "GradientVarianceQuantiles+GradientNoiseScale (Adam),\\
GradientVarianceQuantiles+GradientNoiseScale+PreconditionedNoiseScale (Adam)"
    python -m benchmarks.profile_phases --ab chunks,aminmax --model gpt --rounds 12
    python -m benchmarks.profile_phases --ab pieces --model resnet18 --rounds 10 \\
        --methods "GradientNoiseScale+PreconditionedNoiseScale (Adam)"
    python -m benchmarks.profile_phases --ab shared-conv --model resnet18 --rounds 10 \\
        --methods "GradientNoiseScale+PreconditionedNoiseScale (Adam)"
"""

import argparse
import copy
import math
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

from benchmarks.harness import cpu_timed  # noqa: E402
from benchmarks.methods import METHODS  # noqa: E402
from benchmarks.models import MODELS, model_and_batch  # noqa: E402


class Phases:
    """Totals of CPU time per label, of the functions :meth:`wrap` replaced."""

    def __init__(self):
        self.totals, self.order = {}, []  # the labels in the order they were wrapped: nested below

    def timed(self, function, label):
        self.order.append(label)
        return cpu_timed(function, self.totals, label)

    def wrap(self, owner, name, label):
        setattr(owner, name, self.timed(getattr(owner, name), label))

    def lines(self, steps):
        return [f"  {label}: {1e3 * self.totals[label] / steps:.2f} ms" for label in self.order
                if label in self.totals]


def preconditioned(args, phases):
    from cockpit_gradnoise.extensions import convolution, hooks, linear
    from cockpit_gradnoise.quantities import _base, preconditioners
    from cockpit_gradnoise.quantities.gradient_variance import GradientVarianceQuantiles
    from cockpit_gradnoise.quantities.preconditioned_noise_scale import PreconditionedNoiseScale

    phases.wrap(hooks, "_dispatch", "the layer rules of the backward pass (all)")
    for rule in (linear.SumsLinear, linear.SquaredNormsLinear, convolution.SumsConv, convolution.SquaredNormsConv):
        phases.wrap(rule, "weight", f"  {rule.__name__}.weight")
    if args.by_layer:
        _time_convolutions_by_shape(phases)
    phases.wrap(_base.ParameterQuantity, "_compute", "the quantities after the backward pass")
    phases.wrap(PreconditionedNoiseScale, "unresolved", "  PreconditionedNoiseScale: underflow check")
    phases.wrap(GradientVarianceQuantiles, "unresolved", "  GradientVarianceQuantiles: underflow check")
    phases.wrap(PreconditionedNoiseScale, "named_value_from_sums",
                "  PreconditionedNoiseScale: P and the weighted sums")
    phases.wrap(preconditioners.OptimizerPreconditioner, "preconditioner", "    P (whole, off the CPU or sharded)")
    spec = MODELS[args.model]
    model, x, y = model_and_batch(spec, spec.batch_size, torch.device("cpu"))
    lines = []
    for method in args.methods.split(","):
        step = METHODS[method](model, spec.loss)
        for _ in range(args.warmup):
            step(x, y)
        phases.totals.clear()  # in place: the timers hold this dict
        total = 0.0
        for _ in range(args.steps):
            start = time.process_time()
            step(x, y)
            total += time.process_time() - start
        lines += [f"{args.model}, {method}: {1e3 * total / args.steps:.1f} ms per step"] + phases.lines(args.steps)
    return lines


def _time_convolutions_by_shape(phases):
    """``--by-layer``: the convolutions' weight functions timed per result and layer shape
    ``(C_b, C_a, L)``, summed over the layers of one shape (the rules look them up in ``conv_math``
    at each call: the sums' and norms' rules through their class attributes, set here anew)."""
    from cockpit_gradnoise.extensions import conv_math, convolution

    wrapped = {}  # label -> the timed function, made once (Phases lists each label once)
    for name in ("weight_sums", "weight_squared_norms", "weight_sums_and_squared_norms"):
        function = getattr(conv_math, name, None)  # the last one since pns15 (the code before has none)
        if function is None:
            continue

        def timed(module, inputs, grad_output, function=function, name=name):
            _, c_b, c_a, positions = conv_math.layer_shape(module, inputs, grad_output)
            label = f"    conv_math.{name}, (C_b, C_a, L) = {(c_b, c_a, positions)}"
            if label not in wrapped:
                wrapped[label] = phases.timed(function, label)
            return wrapped[label](module, inputs, grad_output)

        setattr(conv_math, name, timed)
    convolution.SumsConv.weight_result = staticmethod(conv_math.weight_sums)
    convolution.SquaredNormsConv.weight_result = staticmethod(conv_math.weight_squared_norms)


def schedule(args, phases):
    from cockpit_gradnoise import arming, tracked_step, tracking
    from cockpit_gradnoise.quantities import param_grad_ratio, two_batch, update_size
    from cockpit_gradnoise.schedule import batch_schedule

    phases.wrap(tracking.Tracker, "__call__", "tracker(step, losses, ...)")
    phases.wrap(tracking.fsdp2, "replaced_after_tracking", "  the parameters' check")
    phases.wrap(tracking, "declared_batch", "  the declared batch")
    phases.wrap(arming.Arming, "at_call", "  arming")
    phases.wrap(tracked_step.TrackedStep, "__enter__", "entering the block (Cockpit's context)")
    phases.wrap(tracked_step.TrackedStep, "__exit__", "leaving the block (Cockpit's context, the quantities)")
    phases.wrap(two_batch.TwoBatchNoiseScale, "track", "  TwoBatchNoiseScale")
    phases.wrap(two_batch.TwoBatchNoiseScale, "micro_batch", "    its micro-batch closed")
    phases.wrap(two_batch.TwoBatchNoiseScale, "step", "    its estimate (last micro-batch)")
    phases.wrap(param_grad_ratio.ParamGradRatio, "track", "  ParamGradRatio (every 10th step)")
    phases.wrap(update_size.UpdateSize, "track", "  UpdateSize")
    phases.wrap(batch_schedule.BatchSchedule, "update", "schedule.update")
    spec, device, micro_batches = MODELS["gpt"], torch.device("cpu"), 4
    model, _, _ = model_and_batch(spec, 1, device)
    model, tracker = cgn.track(copy.deepcopy(model), every=1, quantities="norms")
    norms = next(q for q in tracker.cockpit.quantities if isinstance(q, two_batch.TwoBatchNoiseScale))
    norms._record_whole = phases.timed(norms._record_whole, "the hooks' float64 norms (in the backward pass)")
    norms._park()  # the hooks again, with the timed function
    norms._hook()
    rule = cgn.BatchSchedule(8, 16, 128, patience=5)
    optimizer, loss_fn = torch.optim.AdamW(model.parameters(), lr=1e-3), spec.loss("none")
    total = 0.0
    for k in range(args.warmup + args.steps):
        batches = [(spec.inputs(8, device), spec.targets(8, device)) for _ in range(micro_batches)]
        if k == args.warmup:
            phases.totals.clear()  # in place: the timers hold this dict
            total = 0.0
        start = time.process_time()
        optimizer.zero_grad(set_to_none=True)
        for index, (x, y) in enumerate(batches):
            with tracker(k, loss_fn(model(x), y), optimizer=optimizer, micro_batch=index,
                         micro_batches=micro_batches) as loss:
                loss.backward()
        optimizer.step()
        rule.update(k, tracker, optimizer)
        total += time.process_time() - start
    return [f"gpt, \"norms\" + BatchSchedule, {micro_batches} micro-batches of 8: "
            f"{1e3 * total / args.steps:.1f} ms per step"] + phases.lines(args.steps)


def _inf_norm(tensor):
    return torch.linalg.vector_norm(tensor.detach(), math.inf)


def _settings(change):
    """``(before, after)``: functions that put the step in the state without and with ``change``."""
    from cockpit_gradnoise.extensions import _squares, cost_model

    if change == "chunks":
        budget = cost_model.HOST_FORMATION_BYTES
        return (lambda: setattr(cost_model, "HOST_FORMATION_BYTES", cost_model.CHUNK_BYTES),
                lambda: setattr(cost_model, "HOST_FORMATION_BYTES", budget))
    if change == "aminmax":
        largest = _squares.largest_magnitude
        return (lambda: setattr(_squares, "largest_magnitude", _inf_norm),
                lambda: setattr(_squares, "largest_magnitude", largest))
    if change == "pieces":
        from cockpit_gradnoise.quantities import preconditioned_noise_scale as pns
        from cockpit_gradnoise.quantities import preconditioners

        pieces, sums = preconditioners.OptimizerPreconditioner.pieces, pns.preconditioned_noise_sums

        def before():
            setattr(preconditioners.OptimizerPreconditioner, "pieces",
                    lambda reader, param, size: reader.preconditioner(param))
            pns.preconditioned_noise_sums = _whole_weighted_sums

        def after():
            preconditioners.OptimizerPreconditioner.pieces, pns.preconditioned_noise_sums = pieces, sums

        return before, after
    if change == "shared-conv":
        from cockpit_gradnoise.extensions import convolution

        shares = convolution.shares_formation
        return (lambda: setattr(convolution, "shares_formation", lambda module, grad_output: False),
                lambda: setattr(convolution, "shares_formation", shares))
    if change == "zero-columns":
        from cockpit_gradnoise.extensions import conv_math

        names = ("nonzero_columns", "nonzero_columns_of_rows")
        found = {name: getattr(conv_math, name) for name in names}
        return (lambda: [setattr(conv_math, name, lambda b, a: None) for name in names],
                lambda: [setattr(conv_math, name, function) for name, function in found.items()])
    raise ValueError(f"unknown change {change!r}: chunks, aminmax, pieces, shared-conv or zero-columns")


def _whole_weighted_sums(preconditioner, sum_of_squares, sum_of_gradients, n, *, defer=False):
    """PreconditionedNoiseScale's ``(S_P, M_P)`` as before pns13 (``--ab pieces``' "without"): the
    whole ``P`` formed first, the sums flattened (copies where they are laid out channels last),
    two float64 dot products per piece of ``_device.CHUNK``. On the CPU."""
    from cockpit_gradnoise import _device

    weights, squares = preconditioner.reshape(-1), sum_of_squares.reshape(-1)
    gradients = sum_of_gradients.reshape(-1)
    size = _device.CHUNK
    weight_piece = torch.empty(min(size, weights.numel()), dtype=torch.float64)
    gradient_piece = torch.empty(min(size, weights.numel()), dtype=torch.float64)
    weighted_squares, weighted_gradients = [], []
    for start in range(0, weights.numel(), size):
        piece = slice(start, start + size)
        weight = weight_piece[: min(size, weights.numel() - start)].copy_(weights[piece])
        gradient = gradient_piece[: weight.numel()].copy_(gradients[piece]).mul_(weight)
        weighted_gradients.append(torch.dot(gradient, gradient))
        weighted_squares.append(torch.dot(weight.square_(), squares[piece].double()))
    return (float(torch.stack(weighted_squares).sum()) / n,
            float(torch.stack(weighted_gradients).sum()) / n**2)


def ab(args):
    """Each change of ``--ab`` against the step without it, interleaved in one process."""
    spec = MODELS[args.model]
    model, x, y = model_and_batch(spec, spec.batch_size, torch.device("cpu"))
    order, lines = random.Random(0), []
    for method in args.methods.split(","):
        step = METHODS[method](model, spec.loss)
        for change in args.ab.split(","):
            sides = dict(zip(("without", "with"), _settings(change)))
            times = {side: [] for side in sides}
            for _ in range(args.warmup):
                step(x, y)
            for _ in range(args.rounds):
                for side in order.sample(list(sides), 2):
                    sides[side]()
                    start = time.process_time()
                    step(x, y)
                    times[side].append(time.process_time() - start)
            sides["with"]()
            shown = ", ".join(f"{side} {1e3 * min(t):.1f} (median {1e3 * statistics.median(t):.1f})"
                              for side, t in times.items())
            lines.append(f"{args.model}, {method}, {change}: ms per step, fastest round {shown}")
    return lines


#: ``--floor --model swin``: the benchmark Swin's sequence Linears in one tracked step, ``(in, out,
#: positions per example, layers)`` (batch 32; 16 of them on the windows' rows, ``fallback/windows.py``).
SWIN_LINEARS = [(768, 192, 16, 2), (192, 768, 16, 2), (192, 192, 16, 8), (384, 192, 16, 1),
                (384, 96, 64, 2), (96, 384, 64, 2), (192, 96, 64, 1), (96, 96, 64, 8),
                (192, 48, 256, 2), (48, 192, 256, 2), (48, 48, 256, 8)]


def floor(args):
    """The benchmark GPT's sequence Linear weights (``(in, out)`` below, batch 32 x 64 tokens, random
    factors), or with ``--model swin`` the Swin's (:data:`SWIN_LINEARS`): the work of their
    weight-gradient products and of the per-example results, interleaved
    in ``--rounds`` rounds (fastest, median; CPU time of one thread). PreconditionedNoiseScale needs
    ``S_j = sum_i x_ij^2`` of every element: the formation of ``x_i`` (``bmm``, the flops of the
    plain ``mm``) where GradientNoiseScale alone takes the Gram matrices; with both, its norms come
    from the formation (``linear_weight_sums_and_squared_norms``)."""
    from cockpit_gradnoise.extensions import linear

    n, positions, width = 32, 64, 128
    pairs = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)] * 4 + [(width, 96)]
    shapes = [(i, o, positions) for i, o in pairs]
    if args.model == "swin":
        shapes = [(i, o, length) for i, o, length, layers in SWIN_LINEARS for _ in range(layers)]
    generator = torch.Generator().manual_seed(0)
    factors = [(torch.randn(n, length, i, generator=generator),
                torch.randn(n, length, o, generator=generator) * 1e-3) for i, o, length in shapes]

    def formation(a, g):
        for _ in linear.formed_contributions(g, a):
            pass

    works = {
        "plain weight gradients (mm)": lambda a, g: torch.mm(g.flatten(0, 1).T, a.flatten(0, 1)),
        "Gram matrices' norms (GradientNoiseScale alone)": lambda a, g: linear.gram_squared_norms(g, a),
        "formation of x_i alone (bmm)": formation,
        "sums and norms from the formation (both)": linear.linear_weight_sums_and_squared_norms,
    }
    times = {name: [] for name in works}
    order = random.Random(0)
    for _ in range(args.rounds):
        for name in order.sample(list(works), len(works)):
            start = time.process_time()
            for a, g in factors:
                works[name](a, g)
            times[name].append(time.process_time() - start)
    return [f"{name}: {1e3 * min(t):.1f} ms (median {1e3 * statistics.median(t):.1f})" for name, t in times.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", action="store_true", help="the norms preset and the schedule")
    parser.add_argument("--by-layer", action="store_true", help="the convolutions' functions per layer shape")
    parser.add_argument("--floor", action="store_true", help="the GPT's (Swin's) Linears' formation, Gram")
    parser.add_argument("--model", default="gpt", choices=("gpt", "resnet18", "swin"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ab", default=None, help="changes to time against the step without them")
    parser.add_argument("--rounds", type=int, default=12, help="--ab's rounds")
    parser.add_argument("--methods", default="GradientNoiseScale (Adam),"
                        "GradientNoiseScale+PreconditionedNoiseScale (Adam)",
                        help="the steps timed (the default: PreconditionedNoiseScale's, and --ab's)")
    args = parser.parse_args(argv)
    if args.model == "swin" and not args.floor:
        parser.error("--model swin is --floor's only (its sequence Linears)")
    torch.set_num_threads(1)
    if args.ab:
        lines = ab(args)
    elif args.floor:
        lines = floor(args)
    else:
        lines = (schedule if args.schedule else preconditioned)(args, Phases())
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
