"""Speed and memory of one tracked training step against a plain step.

For each model and method, one training step (forward, loss, backward) is
timed against a plain step on a model with the same architecture and weights,
interleaved in one process (plain, method A, plain, method B, ... per round),
and the median over the rounds is reported as a ratio to the plain step's
median. Peak extra memory of a step is measured separately (see
``peak_extra_bytes``) and reported as a ratio to the plain step's.

Run ``python benchmarks/benchmark.py --help``; ``benchmarks/README.md`` explains
what is measured and lists results.
"""

import argparse
import copy
import dataclasses
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
import warnings

# Hide kineto's "gpuGetDeviceCount failed" line when the profiler measures CPU memory.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)
from cockpit_gradnoise import extensions as cgn_extensions  # noqa: E402
from cockpit_gradnoise.extensions import sums as cgn_sums  # noqa: E402
from cockpit_gradnoise.schema import QUANTITIES  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from backpack import backpack, extend  # noqa: E402
from backpack.core.derivatives.convnd import weight_jac_t_save_memory  # noqa: E402
from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance  # noqa: E402
from cockpit import quantities as cockpit_quantities  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402

# BackPACK's hooks on the first layer, whose input needs no gradient: harmless.
warnings.filterwarnings("ignore", message="Full backward hook is firing")



def make_mlp():
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(9216, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_resnet18():
    """torchvision's resnet18 for 10 classes, in eval mode (BackPACK refuses BatchNorm in training).

    Its in-place ReLU and ``out += identity`` break BackPACK's hooks:
    ``backpack_converter`` asks :func:`extended_copy` for BackPACK's torch.fx
    converter, which keeps the parameter names.
    """
    from torchvision.models import resnet18

    model = resnet18(num_classes=10).eval()
    model.backpack_converter = True
    return model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: object  # () -> nn.Module
    example_shape: tuple
    batch_size: int  # unless --batch-size says otherwise


MODELS = {
    "mlp": ModelSpec(make_mlp, (1, 28, 28), 128),
    "cnn": ModelSpec(make_cnn, (1, 28, 28), 128),
    "resnet18": ModelSpec(make_resnet18, (3, 32, 32), 64),
}


def extended_copy(model):
    """A BackPACK-extended deep copy (through BackPACK's converter where the model asks)."""
    converter = getattr(model, "backpack_converter", False)
    return extend(copy.deepcopy(model), use_converter=converter)


# Steps ---------------------------------------------------------------------------
# Each builder gets the un-extended reference model and returns a function
# step(x, y) doing one training step on its own copy of that model (same
# weights; the plain step trains the reference itself), with the module it
# trains as ``step.model``. Results a step computes are reduced to per-example
# norms or freed inside the step, as a training script would.


def plain_step(model):
    def step(x, y):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    step.model = model
    return step


def cockpit_step(model, make_quantities):
    """A step tracked by a Cockpit holding ``make_quantities(param_names)``."""
    model = extended_copy(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    names = [n for n, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(model.parameters(), quantities=make_quantities(names))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = itertools.count()

    def step(x, y):
        global_step = next(steps)
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, y)
        info = {
            "batch_size": len(x),
            "individual_losses": F.cross_entropy(out.detach(), y, reduction="none"),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(global_step, info=info):
            loss.backward(create_graph=cockpit.create_graph(global_step))

    step.model = model
    return step


def package_quantity(name):
    return lambda model: cockpit_step(
        model, lambda names: [getattr(cgn, name)(linear(1), param_names=names)]
    )


def package_all(model):
    available = [getattr(cgn, n) for n in QUANTITIES if hasattr(cgn, n)]
    return cockpit_step(
        model, lambda names: [cls(linear(1), param_names=names) for cls in available]
    )


def cockpit_own(model):
    return cockpit_step(
        model,
        lambda names: [
            cockpit_quantities.GradNorm(linear(1)),
            cockpit_quantities.MeanGSNR(linear(1)),
            cockpit_quantities.NormTest(linear(1)),
        ],
    )


def backpack_step(model, extensions, reduce):
    """A step with BackPACK ``extensions`` (conv memory setting as Cockpit's)."""
    model = extended_copy(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    params = list(model.parameters())
    savefields = [ext().savefield for ext in extensions]

    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        with backpack(*[ext() for ext in extensions]), weight_jac_t_save_memory(True):
            loss.backward()
        reduce(params)
        for param in params:
            for field in savefields:
                delattr(param, field)

    step.model = model
    return step


def _batch_l2(params):
    return sum(p.batch_l2 for p in params).sqrt()


def _variance(params):
    return [(p.variance.sum(), p.sum_grad_squared.sum()) for p in params]


def _batch_grad_norms(params):
    return sum(p.grad_batch.flatten(start_dim=1).pow(2).sum(1) for p in params).sqrt()


def backpack_batch_l2(model):
    return backpack_step(model, [BatchL2Grad], _batch_l2)


def backpack_variance(model):
    return backpack_step(model, [Variance, SumGradSquared], _variance)


def backpack_batch_grad(model):
    return backpack_step(model, [BatchGrad], _batch_grad_norms)


def _sums(savefield):
    return lambda params: [getattr(p, savefield).sum() for p in params]


def backpack_sum_grad_squared(model):
    return backpack_step(model, [SumGradSquared], _sums("sum_grad_squared"))


def package_sum_of_squares(model):
    """The package's sum of squares alone (GradientVarianceQuantiles also sums the contributions)."""
    extension = cgn_extensions.SumOfSquaredContributions
    return backpack_step(model, [extension], _sums(cgn_extensions.SUM_GRAD_SQUARED_SAVEFIELD))


def package_sums(model):
    """The package's extension behind GradientVarianceQuantiles, without the quantity."""
    extension = cgn_extensions.SumsOfContributions
    return backpack_step(model, [extension], _sums(cgn_extensions.SUMS_SAVEFIELD))


def package_squared_norms(model):
    """The package's extension behind PerExampleGradNorm, without the quantity."""
    extension = cgn_extensions.PerExampleSquaredNorms
    return backpack_step(model, [extension], _sums(cgn_extensions.BATCH_L2_SAVEFIELD))


def with_backpack_convolution_rows(build):
    """``build``, its quantities using BackPACK's own module extensions for convolutions.

    That is the package before it had its own (``SumGradSquared``'s and
    ``BatchL2Grad``'s rows; the latter is wrong for grouped convolutions, which
    the benchmark models do not have): a measurement of what ours save.
    """
    from backpack.extensions.firstorder.batch_l2_grad import convnd, convtransposend
    from backpack.extensions.firstorder.sum_grad_squared import (
        conv1d,
        conv2d,
        conv3d,
        convtranspose1d,
        convtranspose2d,
        convtranspose3d,
    )

    sgs_rows = {
        nn.Conv1d: conv1d.SGSConv1d,
        nn.Conv2d: conv2d.SGSConv2d,
        nn.Conv3d: conv3d.SGSConv3d,
        nn.ConvTranspose1d: convtranspose1d.SGSConvTranspose1d,
        nn.ConvTranspose2d: convtranspose2d.SGSConvTranspose2d,
        nn.ConvTranspose3d: convtranspose3d.SGSConvTranspose3d,
    }
    backpack_rows = {
        cgn_extensions.sum_of_squares_table: sgs_rows,
        # The same rules, also summing the contributions they form.
        cgn_extensions.sums_table: {
            cls: type(f"Sums{rule.__name__}", (cgn_sums.SumsFromContributionsMixin, rule), {})
            for cls, rule in sgs_rows.items()
        },
        cgn_extensions.per_example_squared_norm_table: {
            nn.Conv1d: convnd.BatchL2Conv1d,
            nn.Conv2d: convnd.BatchL2Conv2d,
            nn.Conv3d: convnd.BatchL2Conv3d,
            nn.ConvTranspose1d: convtransposend.BatchL2ConvTranspose1d,
            nn.ConvTranspose2d: convtransposend.BatchL2ConvTranspose2d,
            nn.ConvTranspose3d: convtransposend.BatchL2ConvTranspose3d,
        },
    }

    def patched(table):
        return lambda: {**table(), **{cls: ext() for cls, ext in backpack_rows[table].items()}}

    def build_with_backpack_rows(model):
        # The quantities instantiate their extensions, and so read the tables, when built.
        originals = list(backpack_rows)
        for table in originals:
            setattr(cgn_extensions, table.__name__, patched(table))
        try:
            return build(model)
        finally:
            for table in originals:
                setattr(cgn_extensions, table.__name__, table)

    return build_with_backpack_rows


def torch_func_vmap(model):
    """Per-example gradients with torch.func, their norms, and ``param.grad``.

    torch.func cannot run on a BackPACK-extended module: this uses a plain copy.
    """
    from torch.func import functional_call, grad, vmap

    model = copy.deepcopy(model)
    params = dict(model.named_parameters())

    def example_loss(weights, x, y):
        out = functional_call(model, weights, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    per_example_grad = vmap(grad(example_loss), in_dims=(None, 0, 0))

    def step(x, y):
        detached = {name: p.detach() for name, p in params.items()}
        grads = per_example_grad(detached, x, y)
        sum(g.flatten(start_dim=1).pow(2).sum(1) for g in grads.values()).sqrt()
        for name, p in params.items():
            p.grad = grads[name].mean(0)  # the mean-reduced loss's gradient

    step.model = model
    return step


def opacus_ghost(model):
    """Opacus ghost clipping's per-example norms (first of its two backward passes)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    module = GradSampleModuleFastGradientClipping(
        copy.deepcopy(model), max_grad_norm=1e9, use_ghost_clipping=True
    )

    def step(x, y):
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        module.get_norm_sample()

    step.model = module
    return step


#: Method name -> builder, in the table's order.
METHODS = {
    **{name: package_quantity(name) for name in QUANTITIES},
    "package: all together": package_all,
    "GradientVarianceQuantiles (BackPACK's conv rows)": with_backpack_convolution_rows(
        package_quantity("GradientVarianceQuantiles")
    ),
    "PerExampleGradNorm (BackPACK's conv rows)": with_backpack_convolution_rows(
        package_quantity("PerExampleGradNorm")
    ),
    "package extension PerExampleSquaredNorms": package_squared_norms,
    "BackPACK BatchL2Grad": backpack_batch_l2,
    "package extension SumOfSquaredContributions": package_sum_of_squares,
    "package extension SumsOfContributions": package_sums,
    "BackPACK SumGradSquared": backpack_sum_grad_squared,
    "BackPACK Variance+SumGradSquared": backpack_variance,
    "BackPACK BatchGrad": backpack_batch_grad,
    "torch.func vmap norms": torch_func_vmap,
    "Opacus ghost-clipping norms": opacus_ghost,
    "Cockpit GradNorm+MeanGSNR+NormTest": cockpit_own,
}


def unavailable(name):
    """Why method ``name`` cannot run here, or ``None``."""
    present = [n for n in QUANTITIES if hasattr(cgn, n)]
    if name in QUANTITIES and name not in present:
        return "not in cockpit_gradnoise yet"
    if name == "package: all together" and not present:
        return "no quantity available"
    if name == "Opacus ghost-clipping norms":
        try:
            import opacus  # noqa: F401
        except ImportError:
            return "not installed"
    return None


# Measurement ---------------------------------------------------------------------


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, x, y, device):
    synchronize(device)
    start = time.perf_counter()
    step(x, y)
    synchronize(device)
    return time.perf_counter() - start


def _drop_step_state(step):
    """Free what a step left on its model (gradients, BackPACK results, inputs)."""
    for module in step.model.modules():
        for param in module.parameters(recurse=False):
            param.grad = None
            for field in [k for k in vars(param) if not k.startswith("_")]:
                delattr(param, field)
        for field in ("input0", "output"):
            if hasattr(module, field):
                delattr(module, field)


def peak_extra_bytes(step, x, y, device):
    """Peak memory two consecutive steps allocate above a clean start, in bytes.

    Starts from no gradients and no BackPACK results, then runs two steps, so
    that the second shows the steady state (what one step leaves behind is
    still alive while the next one computes).

    On CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated at
    the start. On CPU: torch's profiler records every allocation and free made
    through torch's allocator, with its size; the running sum of those in time
    order is torch's memory in use above the start, and its maximum is torch's
    peak. Allocations outside torch (NumPy arrays, Python objects) are invisible
    to it; ``tracemalloc`` sees those, and its peak is added. The sum is an
    upper bound of the joint peak (the two peaks may not coincide). Both count
    bytes requested from the allocator, not resident memory (glibc may keep
    freed memory mapped, or return it).
    """
    _drop_step_state(step)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step(x, y)
        step(x, y)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    tracemalloc.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(x, y)
            step(x, y)
        _, outside_torch = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    in_use = torch_peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        in_use += event.nbytes()
        torch_peak = max(torch_peak, in_use)
    return torch_peak + outside_torch


def model_and_batch(model_name, args, device):
    """The seeded model and a random batch of its inputs (``--batch-size`` or its own)."""
    torch.manual_seed(0)
    spec = MODELS[model_name]
    batch_size = args.batch_size or spec.batch_size
    model = spec.make().to(device)
    x = torch.randn(batch_size, *spec.example_shape, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    return model, x, y


def benchmark_model(model_name, method_names, args, device):
    """Rows of the table for one model."""
    model, x, y = model_and_batch(model_name, args, device)
    plain = plain_step(model)
    steps, rows = {}, []
    for name in method_names:
        reason = unavailable(name)
        if reason is None:
            try:
                steps[name] = METHODS[name](model)
                for _ in range(args.warmup):
                    steps[name](x, y)
            except Exception as error:  # shown in the table, the others still run
                reason = f"error: {type(error).__name__}: {error}"
                steps.pop(name, None)
        rows.append({"model": model_name, "method": name, "note": reason})
    for _ in range(args.warmup):
        plain(x, y)

    plain_times, method_times = [], {name: [] for name in steps}
    print(f"{model_name}: timing {len(steps)} methods, {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, step in steps.items():
            plain_times.append(timed(plain, x, y, device))
            method_times[name].append(timed(step, x, y, device))
    if not steps:  # only the plain step was asked for
        plain_times = [timed(plain, x, y, device) for _ in range(args.rounds)]
    plain_median = statistics.median(plain_times)

    print(f"{model_name}: measuring memory", file=sys.stderr)
    plain_memory = peak_extra_bytes(plain, x, y, device)
    _drop_step_state(plain)
    table = [
        {
            "model": model_name,
            "method": "plain step",
            "median_ms": 1e3 * plain_median,
            "ratio": 1.0,
            "peak_extra_mib": plain_memory / 2**20,
            "memory_ratio": 1.0,
            "note": None,
        }
    ]
    for row in rows:
        name = row["method"]
        if name in steps:
            median = statistics.median(method_times[name])
            memory = peak_extra_bytes(steps[name], x, y, device)
            _drop_step_state(steps[name])
            row.update(
                median_ms=1e3 * median,
                ratio=median / plain_median,
                peak_extra_mib=memory / 2**20,
                memory_ratio=memory / plain_memory,
            )
        table.append(row)
    return table


# Output --------------------------------------------------------------------------


def allocator():
    """Which memory allocator the process uses, as far as the environment tells."""
    preload = os.environ.get("LD_PRELOAD", "")
    tuned = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    libc = " ".join(platform.libc_ver()) or "unknown libc"
    if preload:
        return f"LD_PRELOAD={preload} (NOT the default allocator)"
    settings = f"; tuned by {', '.join(tuned)}" if tuned else ", untuned"
    return f"default glibc malloc ({libc}, no LD_PRELOAD{settings}), as users get it"


def environment(args, device):
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "torch": torch.__version__,
        "backpack-for-pytorch": version("backpack-for-pytorch"),
        "cockpit-for-pytorch": version("cockpit-for-pytorch"),
        "cockpit-gradnoise": version("cockpit-gradnoise"),
        # Which checkout is measured: the installed one unless PYTHONPATH says otherwise.
        "cockpit-gradnoise location": os.path.dirname(os.path.dirname(cgn.__file__)),
        "opt_einsum": version("opt_einsum"),
        "opacus": version("opacus"),
        "python": platform.python_version(),
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "memory_allocator": allocator(),
        "batch_size": args.batch_size,  # None: each model's own (batch_sizes)
        "batch_sizes": {m: args.batch_size or MODELS[m].batch_size for m in args.models},
        "rounds": args.rounds,
        "dtype": "float32",
    }


def markdown(table):
    lines = [
        "| model | method | median ms | ratio to plain | peak extra memory | memory ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in table:
        if "median_ms" in row:
            cells = [
                f"{row['median_ms']:.2f}",
                f"{row['ratio']:.2f}",
                f"{row['peak_extra_mib']:.1f} MiB",
                f"{row['memory_ratio']:.2f}",
            ]
        else:
            cells = [row["note"], "-", "-", "-"]
        lines.append("| " + " | ".join([row["model"], row["method"], *cells]) + " |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,cnn", help="comma-separated: " + ",".join(MODELS)
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names (default: all): " + ", ".join(METHODS),
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="for every model (default: each model's own: "
        + ", ".join(f"{name} {spec.batch_size}" for name, spec in MODELS.items())
        + ")",
    )
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (>= 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", default=None, metavar="PATH", help="also save here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 3 rounds, 1 warmup step, batch size 8 (not a measurement)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.batch_size = 3, 1, 8
    elif args.rounds < 15:
        parser.error("--rounds must be at least 15 for a measurement (or use --quick)")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.methods is None:
        args.methods = list(METHODS)
    else:
        args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown:
            parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    torch.set_num_threads(args.threads)
    env = environment(args, device)
    for key, value in env.items():
        print(f"{key}: {value}")
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    print()
    table = []
    for model_name in args.models:
        table += benchmark_model(model_name, args.methods, args, device)
    env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
    print(markdown(table))
    print(f"\nload average (1 min) at end: {env['load_average_1min_at_end']}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"environment": env, "rows": table}, file, indent=1)
    return table


if __name__ == "__main__":
    main()
