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
import functools
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
# The GPT lives in experiments/ beside benchmarks/, which `python
# benchmarks/benchmark.py` does not put on the path (appended: an installed
# cockpit_gradnoise, or PYTHONPATH, still comes first).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cockpit_gradnoise as cgn  # noqa: E402  (first: makes `import cockpit` work)
from cockpit_gradnoise import extensions as cgn_extensions  # noqa: E402
from cockpit_gradnoise.extensions import sums as cgn_sums  # noqa: E402
from cockpit_gradnoise.schema import QUANTITIES  # noqa: E402

import torch  # noqa: E402
from backpack import backpack, extend  # noqa: E402
from backpack.core.derivatives.convnd import weight_jac_t_save_memory  # noqa: E402
from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance  # noqa: E402
from cockpit import quantities as cockpit_quantities  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402

# BackPACK's hooks on the first layer, whose input needs no gradient: harmless.
warnings.filterwarnings("ignore", message="Full backward hook is firing")



def make_mlp(width=512):
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
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
    """torchvision's resnet18 for 10 classes, in eval mode (BatchNorm with running statistics).

    Its in-place ReLU and ``out += identity`` break BackPACK's hooks:
    ``cgn.prepare_model`` (:func:`extended_copy`) extends it through BackPACK's
    torch.fx converter, which keeps the parameter names.
    """
    from torchvision.models import resnet18

    return resnet18(num_classes=10).eval()


def make_gpt():
    """The GPT-style language model of the architectures issue (``experiments.models.GPT``).

    4 pre-norm blocks of width 128 with 4 heads (attention from ``nn.Linear``),
    sequence 64, vocabulary 96.
    """
    from experiments.models import GPT

    return GPT(GPT_VOCABULARY, GPT_CONTEXT, width=128, heads=4, layers=4)


GPT_VOCABULARY, GPT_CONTEXT = 96, 64


def classification_loss(reduction):
    return nn.CrossEntropyLoss(reduction=reduction)


def token_loss(reduction):
    """Per-token cross-entropy; an example's own loss (``"none"``) is the mean over its tokens."""
    from experiments.models import TokenCrossEntropy

    return TokenCrossEntropy(reduction, per_token="mean")


def images(*shape):
    return lambda n, device: torch.randn(n, *shape, device=device)


def tokens(n, device):
    return torch.randint(0, GPT_VOCABULARY, (n, GPT_CONTEXT), device=device)


def classes(n, device):
    return torch.randint(0, 10, (n,), device=device)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: object  # () -> nn.Module
    inputs: object  # (batch size, device) -> inputs
    batch_size: int  # unless --batch-size says otherwise
    targets: object = classes  # (batch size, device) -> targets
    #: ``reduction -> loss module``: ``"mean"`` trains, ``"none"`` gives each example's loss.
    loss: object = classification_loss


MODELS = {
    "mlp": ModelSpec(make_mlp, images(1, 28, 28), 128),
    "cnn": ModelSpec(make_cnn, images(1, 28, 28), 128),
    "resnet18": ModelSpec(make_resnet18, images(3, 32, 32), 64),
    "gpt": ModelSpec(make_gpt, tokens, 32, targets=tokens, loss=token_loss),
}


def extended_copy(model):
    """A BackPACK-extended deep copy, as users make it (``cgn.prepare_model``).

    It uses BackPACK's converter where in-place operations need it (resnet18).
    """
    return cgn.prepare_model(copy.deepcopy(model))


class NotSupported(Exception):
    """A method cannot compute its result for every parameter of this model."""


# Steps ---------------------------------------------------------------------------
# Each builder gets the un-extended reference model and ``loss`` (the model's
# ``ModelSpec.loss``) and returns a function step(x, y) doing one training step
# on its own copy of that model (same weights; the plain step trains the
# reference itself), with the module it trains as ``step.model``. Results a
# step computes are reduced to per-example norms or freed inside the step, as
# a training script would. A builder raises ``NotSupported`` when the method
# cannot give a result for every trainable parameter of the model.


def plain_step(model, loss):
    loss_fn = loss("mean")

    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    step.model = model
    return step


def trainable(model):
    """Names and parameters that require gradients (Cockpit refuses frozen ones)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def cockpit_step(model, loss, make_quantities, every=1):
    """A step tracked by a Cockpit holding ``make_quantities(param_names, schedule)``.

    The schedule is Cockpit's ``linear(every)``: every ``every``-th step is tracked.
    """
    model = extended_copy(model)
    loss_fn, individual_loss = extend(loss("mean")), loss("none")
    names, params = trainable(model)
    cockpit = cgn.Cockpit(params, quantities=make_quantities(names, linear(every)))
    optimizer = torch.optim.SGD(params, lr=0.0)
    steps = itertools.count()

    def step(x, y):
        global_step = next(steps)
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, y)
        info = {
            "batch_size": len(x),
            "individual_losses": individual_loss(out.detach(), y),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(global_step, info=info):
            loss.backward(create_graph=cockpit.create_graph(global_step))

    step.model = model
    return step


def package_quantity(name):
    def build(model, loss, every=1):
        return cockpit_step(
            model,
            loss,
            lambda names, schedule: [getattr(cgn, name)(schedule, param_names=names)],
            every,
        )

    return build


def package_all(model, loss, every=1):
    available = [getattr(cgn, n) for n in QUANTITIES if hasattr(cgn, n)]
    return cockpit_step(
        model,
        loss,
        lambda names, schedule: [cls(schedule, param_names=names) for cls in available],
        every,
    )


def empty_cockpit(model, loss, every=1):
    """The floor of every package row: an extended model inside a Cockpit with no quantity."""
    return cockpit_step(model, loss, lambda names, schedule: [], every)


def extended_no_cockpit(model, loss):
    """A plain step on a BackPACK-extended model (its hooks run, no extension is active)."""
    model = extended_copy(model)
    loss_fn = extend(loss("mean"))

    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    step.model = model
    return step


def cockpit_own(model, loss):
    def quantities(names, schedule):
        chosen = [
            cockpit_quantities.GradNorm(schedule),
            cockpit_quantities.MeanGSNR(schedule),
            cockpit_quantities.NormTest(schedule),
        ]
        refuse_unsupported(model, [e for q in chosen for e in q.extensions(0)])
        return chosen

    return cockpit_step(model, loss, quantities)


def refuse_unsupported(model, extensions):
    """Raise ``NotSupported`` if a BackPACK extension has no rows for a trainable layer.

    BackPACK skips such layers (a warning; Cockpit's quantities then fail on a
    missing result), so the method would not compute what it claims.
    """
    for extension in extensions:
        # BackPACK's table of module class -> module extension (no public getter).
        rows = vars(extension)["_BackpropExtension__module_extensions"]
        missing = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if type(m) not in rows and any(p.requires_grad for p in m.parameters(False))
            }
        )
        if missing:
            raise NotSupported(
                f"not supported: BackPACK's {type(extension).__name__} has no rows for "
                + ", ".join(missing)
            )


def _frozen_families():
    """Label -> module classes whose parameters a frozen row freezes (issue 9's support cost),
    or a predicate ``(module name, module) -> bool``."""
    from experiments.models import CausalSelfAttention

    attention = (CausalSelfAttention, cgn.LinearAttention)
    return {
        FROZEN: (nn.LayerNorm, nn.Embedding, *attention),
        "(LayerNorm frozen)": (nn.LayerNorm,),
        "(embedding frozen)": (nn.Embedding,),
        "(attention frozen)": attention,
        # A control for --support-cost: Linear layers on sequences the package
        # supported before issue 9 (the blocks' MLP), measured the same way.
        MLP_FROZEN: lambda name, module: isinstance(module, nn.Linear) and ".mlp." in name,
    }


MLP_FROZEN = "(MLP frozen)"


def family_members(model, family):
    """The modules of ``model`` in ``family`` (classes, or a predicate on name and module)."""
    if isinstance(family, tuple):
        return [m for m in model.modules() if isinstance(m, family)]
    return [m for name, m in model.named_modules() if family(name, m)]


FROZEN = "(LayerNorm/embedding/attention frozen)"
FROZEN_LABELS = [FROZEN, "(LayerNorm frozen)", "(embedding frozen)", "(attention frozen)"]


def frozen_label(method):
    """The frozen label a method's name ends with, or None."""
    return next((label for label in FROZEN_LABELS if method.endswith(label)), None)


def with_frozen(build, label):
    """``build`` on a copy whose modules of one family (``label``) are frozen.

    The step carries its own plain step (``step.plain``) on that frozen copy:
    its ratio to that plain step is what the model costs without those layers'
    rows, to compare with ``build``'s ratio on the whole model.
    """

    def build_frozen(model, loss):
        frozen = copy.deepcopy(model)
        modules = family_members(frozen, _frozen_families()[label])
        if not modules:
            raise NotSupported(f"not applicable: no module to freeze {label}")
        for module in modules:
            module.requires_grad_(False)
        step = build(frozen, loss)
        step.plain = plain_step(frozen, loss)
        return step

    return build_frozen


def backpack_step(model, loss, extensions, reduce):
    """A step with BackPACK ``extensions`` (conv memory setting as Cockpit's)."""
    model = extended_copy(model)
    loss_fn = extend(loss("mean"))
    _, params = trainable(model)
    refuse_unsupported(model, [ext() for ext in extensions])
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


def backpack_batch_l2(model, loss):
    return backpack_step(model, loss, [BatchL2Grad], _batch_l2)


def backpack_variance(model, loss):
    return backpack_step(model, loss, [Variance, SumGradSquared], _variance)


def backpack_batch_grad(model, loss):
    return backpack_step(model, loss, [BatchGrad], _batch_grad_norms)


def _sums(savefield):
    return lambda params: [getattr(p, savefield).sum() for p in params]


def backpack_sum_grad_squared(model, loss):
    return backpack_step(model, loss, [SumGradSquared], _sums("sum_grad_squared"))


def package_sum_of_squares(model, loss):
    """The package's sum of squares alone (GradientVarianceQuantiles also sums the contributions)."""
    extension = cgn_extensions.SumOfSquaredContributions
    return backpack_step(model, loss, [extension], _sums(cgn_extensions.SUM_GRAD_SQUARED_SAVEFIELD))


def package_sums(model, loss):
    """The package's extension behind GradientVarianceQuantiles, without the quantity."""
    extension = cgn_extensions.SumsOfContributions
    return backpack_step(model, loss, [extension], _sums(cgn_extensions.SUMS_SAVEFIELD))


def package_squared_norms(model, loss):
    """The package's extension behind PerExampleGradNorm, without the quantity."""
    extension = cgn_extensions.PerExampleSquaredNorms
    return backpack_step(model, loss, [extension], _sums(cgn_extensions.BATCH_L2_SAVEFIELD))


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

    def build_with_backpack_rows(model, loss):
        if not any(type(m) in backpack_rows[cgn_extensions.sum_of_squares_table] for m in model.modules()):
            raise NotSupported("not applicable: no convolutions")
        # The quantities instantiate their extensions, and so read the tables, when built.
        originals = list(backpack_rows)
        for table in originals:
            setattr(cgn_extensions, table.__name__, patched(table))
        try:
            return build(model, loss)
        finally:
            for table in originals:
                setattr(cgn_extensions, table.__name__, table)

    return build_with_backpack_rows


def torch_func_vmap(model, loss):
    """Per-example gradients with torch.func, their norms, and ``param.grad``.

    torch.func cannot run on a BackPACK-extended module: this uses a plain copy.
    """
    from torch.func import functional_call, grad, vmap

    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    loss_fn = loss("mean")

    def example_loss(weights, x, y):
        out = functional_call(model, weights, (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    per_example_grad = vmap(grad(example_loss), in_dims=(None, 0, 0))

    def step(x, y):
        detached = {name: p.detach() for name, p in params.items()}
        grads = per_example_grad(detached, x, y)
        sum(g.flatten(start_dim=1).pow(2).sum(1) for g in grads.values()).sqrt()
        for name, p in params.items():
            p.grad = grads[name].mean(0)  # the mean-reduced loss's gradient

    step.model = model
    return step


def opacus_ghost(model, loss):
    """Opacus ghost clipping's per-example norms (first of its two backward passes)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    module = GradSampleModuleFastGradientClipping(
        copy.deepcopy(model), max_grad_norm=1e9, use_ghost_clipping=True
    )

    loss_fn = loss("mean")

    def step(x, y):
        module.zero_grad(set_to_none=True)
        loss_fn(module(x), y).backward()
        module.get_norm_sample()

    step.model = module
    return step


#: Method name -> builder, in the table's order.
METHODS = {
    "extended model (no Cockpit)": extended_no_cockpit,
    "empty Cockpit": empty_cockpit,
    **{name: package_quantity(name) for name in QUANTITIES},
    "package: all together": package_all,
    **{f"package: all together {label}": with_frozen(package_all, label) for label in FROZEN_LABELS},
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


def model_and_batch(spec, batch_size, device):
    """The seeded model of ``spec`` and a random batch of ``batch_size`` inputs and targets."""
    torch.manual_seed(0)
    model = spec.make().to(device)
    return model, spec.inputs(batch_size, device), spec.targets(batch_size, device)


def build_steps(builders, model, loss, x, y, warmup):
    """``{name: step}`` of the builders that run on this model, and ``{name: note}`` of the others.

    A builder's failure is shown in the table (the others still run):
    ``NotSupported`` by its message, anything else as an error.
    """
    steps, notes = {}, {}
    for name, build in builders.items():
        notes[name] = unavailable(name)
        if notes[name] is not None:
            continue
        try:
            step = build(model, loss)
            for _ in range(warmup):
                step(x, y)
                if hasattr(step, "plain"):
                    step.plain(x, y)
            steps[name] = step
        except NotSupported as error:
            notes[name] = str(error)
        except Exception as error:
            notes[name] = f"error: {type(error).__name__}: {error}"
    return steps, notes


def benchmark_model(label, spec, method_names, args, device, batch_size=None, memory=True):
    """Rows of the table for one model (``memory=False``: times only).

    Each round times, for every method, a plain step and then the method's
    step. A method with its own plain step (``step.plain``: the same model
    frozen alike) is timed against that one, and that plain step gets a row
    of its own, relative to the model's plain step.
    """
    model, x, y = model_and_batch(spec, batch_size or args.batch_size or spec.batch_size, device)
    plain = plain_step(model, spec.loss)
    steps, notes = build_steps(
        {name: METHODS[name] for name in method_names}, model, spec.loss, x, y, args.warmup
    )
    for _ in range(args.warmup):
        plain(x, y)

    times = {name: [] for name in steps}
    own_plain_times = {name: [] for name in steps if hasattr(steps[name], "plain")}
    plain_times = []
    print(f"{label}: timing {len(steps)} methods, {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, step in steps.items():
            plain_times.append(timed(plain, x, y, device))
            if name in own_plain_times:
                own_plain_times[name].append(timed(step.plain, x, y, device))
            times[name].append(timed(step, x, y, device))
    if not steps:  # only the plain step was asked for
        plain_times = [timed(plain, x, y, device) for _ in range(args.rounds)]

    def measured(step):
        if not memory:
            return None
        bytes_ = peak_extra_bytes(step, x, y, device)
        _drop_step_state(step)
        return bytes_

    if memory:
        print(f"{label}: measuring memory", file=sys.stderr)

    def row(method, step_times, step_memory, reference):
        median = statistics.median(step_times)
        result = {"model": label, "method": method, "median_ms": 1e3 * median, "note": None}
        result["ratio"] = median / reference[0]
        if memory:
            result["peak_extra_mib"] = step_memory / 2**20
            result["memory_ratio"] = step_memory / reference[1]
        return result

    plain_reference = (statistics.median(plain_times), measured(plain))
    table = [row("plain step", plain_times, plain_reference[1], plain_reference)]
    for name in method_names:
        if name not in steps:
            table.append({"model": label, "method": name, "note": notes[name]})
            continue
        reference = plain_reference
        if name in own_plain_times:
            reference = (statistics.median(own_plain_times[name]), measured(steps[name].plain))
            own_plain = row(f"plain step {frozen_label(name)}", own_plain_times[name], reference[1],
                            plain_reference)
            table.append(own_plain)
        table.append(row(name, times[name], measured(steps[name]), reference))
    return table


# Issue 9's support cost, in CPU time ------------------------------------------------

SUPPORT_LABELS = [*FROZEN_LABELS, MLP_FROZEN]


def support_cost_rows(args):
    """Issue 9's support cost on the GPT: CPU time of one thread, min over interleaved rounds.

    The main table's support cost is a ratio of two ratios of medians of wall
    time on two threads, and moved by up to 10 points from run to run on a
    shared machine. Here every step of a round (the plain step, all five, and
    per family its frozen plain step and all five on the frozen copy) is timed
    by ``time.process_time`` on one thread, interleaved, and each step's
    fastest round is taken: on a shared machine the noise only ever adds time.

    Per family, the rows' cost ``ratio(all five) / ratio(all five, frozen) - 1``,
    its spread (quartiles over rounds of the same formula on that round's
    four times), the family's own weight-gradient time ``w`` (plain step minus
    frozen plain step) and its rows' time ``r`` (what all five add over the
    frozen copy's all five, minus ``w``); both are differences of two minima,
    so a few ms of noise.
    """
    spec = MODELS["gpt"]
    device = torch.device("cpu")
    model, x, y = model_and_batch(spec, args.batch_size or spec.batch_size, device)
    steps = {"plain": plain_step(model, spec.loss), "all": package_all(model, spec.loss)}
    for label in SUPPORT_LABELS:
        frozen = with_frozen(package_all, label)(model, spec.loss)
        steps[f"plain {label}"], steps[f"all {label}"] = frozen.plain, frozen
    for step in steps.values():
        for _ in range(args.warmup):
            step(x, y)
    times = {name: [] for name in steps}
    print(f"gpt: support cost, {len(steps)} steps, {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.process_time()
            step(x, y)
            times[name].append(time.process_time() - start)
    best = {name: 1e3 * min(t) for name, t in times.items()}
    rows = []
    for label in SUPPORT_LABELS:
        per_round = [
            (a / p) / (b / q) - 1
            for a, p, b, q in zip(times["all"], times["plain"], times[f"all {label}"],
                                  times[f"plain {label}"])
        ]
        quartiles = statistics.quantiles(per_round, n=4)
        w = best["plain"] - best[f"plain {label}"]
        all_ratio = best["all"] / best["plain"]
        frozen_ratio = best[f"all {label}"] / best[f"plain {label}"]
        rows.append({
            "family": label,
            "all_ratio": all_ratio,
            "frozen_ratio": frozen_ratio,
            "cost": all_ratio / frozen_ratio - 1,
            "cost_quartiles": (quartiles[0], quartiles[2]),
            "weight_gradient_ms": w,
            "rows_ms": best["all"] - best[f"all {label}"] - w,
        })
    return rows, best


def support_cost_markdown_cpu(rows, best):
    """``support_cost_rows``' results as the README shows them."""
    lines = [
        f"Plain step {best['plain']:.1f} ms, all five {best['all']:.1f} ms (CPU time, one thread).",
        "",
        "| family | all five / plain | frozen: all five / plain | rows cost (quartiles over rounds) "
        "| target | weight gradient w, ms | rows r, ms |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for row in rows:
        control = row["family"] == MLP_FROZEN
        verdict = "control" if control else (
            "met" if row["cost"] <= SUPPORT_COST_TARGET else "missed")
        low, high = row["cost_quartiles"]
        lines.append(
            f"| {row['family'][1:-1]} | {row['all_ratio']:.2f} | {row['frozen_ratio']:.2f} | "
            f"**{100 * row['cost']:+.1f}%** ({100 * low:+.0f}% to {100 * high:+.0f}%) | {verdict} | "
            f"{row['weight_gradient_ms']:.1f} | {row['rows_ms']:.1f} |"
        )
    return "\n".join(lines)


# Scaling, schedules and the floor's profile ---------------------------------------

SCALING_METHODS = [*QUANTITIES, "package: all together"]


def mlp_of_width(width):
    return dataclasses.replace(MODELS["mlp"], make=functools.partial(make_mlp, width))


def scaling_columns(args, device):
    """``{column label: rows}``: the MLP at each batch size (width 512) and width (batch 128)."""
    mlp = MODELS["mlp"]
    runs = [(f"batch {n}", mlp, n) for n in args.scaling_batch_sizes]
    runs += [(f"width {w}", mlp_of_width(w), args.batch_size or mlp.batch_size) for w in args.scaling_widths]
    return {
        label: benchmark_model(f"mlp {label}", spec, SCALING_METHODS, args, device, n, memory=False)
        for label, spec, n in runs
    }


def schedule_rows(args, device, every=10):
    """Mean time per step with Cockpit's ``linear(every)`` against every step tracked (MLP).

    Each round times, per method, one plain step, one step tracked every time,
    then ``every`` consecutive plain steps and ``every`` consecutive steps under
    ``linear(every)`` (one of them tracked, whichever it is). Ratios are medians
    over rounds; the block ratio is the average cost per step of a run.
    """
    spec = MODELS["mlp"]
    model, x, y = model_and_batch(spec, args.batch_size or spec.batch_size, device)
    plain = plain_step(model, spec.loss)
    methods = ["empty Cockpit", *SCALING_METHODS]
    every_step, _ = build_steps({m: METHODS[m] for m in methods}, model, spec.loss, x, y, args.warmup)
    scheduled, _ = build_steps(
        {m: functools.partial(METHODS[m], every=every) for m in methods},
        model, spec.loss, x, y, every,
    )
    times = {m: {"plain": [], "every": [], "plain block": [], "block": []} for m in every_step}
    print(f"schedule linear({every}): {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, record in times.items():
            record["plain"].append(timed(plain, x, y, device))
            record["every"].append(timed(every_step[name], x, y, device))
            record["plain block"].append(sum(timed(plain, x, y, device) for _ in range(every)))
            record["block"].append(sum(timed(scheduled[name], x, y, device) for _ in range(every)))
    rows = []
    for name, record in times.items():
        median = {key: statistics.median(values) for key, values in record.items()}
        rows.append(
            {
                "method": name,
                "every step": median["every"] / median["plain"],
                "scheduled": median["block"] / median["plain block"],
            }
        )
    return rows


def scaling_page(columns, schedule, env, every=10):
    """The docs page (markdown) of the scaling measurement."""
    labels = list(columns)
    batch = env["batch_size"] or MODELS["mlp"].batch_size
    ratio = {
        (label, row["method"]): row for label, rows in columns.items() for row in rows
    }
    header = "| | " + " | ".join(labels) + " |"
    lines = [
        "# Scaling: cost against batch size and width",
        "",
        "Generated by `python benchmarks/benchmark.py --scaling docs/scaling.md`; do not",
        "edit by hand. Ratio of a tracked training step to a plain step of the",
        "benchmark MLP (784-w-w-10, ReLU, 10 classes), each quantity alone in a",
        "Cockpit tracking every step, measured as in [the benchmark](benchmark.md)",
        "(median of interleaved rounds). Batch sizes at width 512, widths at batch",
        f"{batch}.",
        "",
        f"Measured on {env['cpus']} CPUs, torch {env['torch']}, {env['threads']} threads, "
        f"{env['rounds']} rounds, 1-minute load average {env['load_average_1min_at_start']} "
        f"at the start and {env['load_average_1min_at_end']} at the end.",
        *_load_warning(env),
        "",
        header,
        "|---|" + "---:|" * len(labels),
        "| plain step (ms) | "
        + " | ".join(f"{ratio[(label, 'plain step')]['median_ms']:.1f}" for label in labels)
        + " |",
    ]
    for method in SCALING_METHODS:
        cells = [
            f"{ratio[(label, method)]['ratio']:.2f}" if "ratio" in ratio[(label, method)]
            else ratio[(label, method)]["note"]
            for label in labels
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", growth_sentence(columns, "batch"), "", growth_sentence(columns, "width"), ""]
    lines += [
        f"## Tracking one step in {every}: `linear({every})`",
        "",
        f"Cockpit's `linear({every})` schedule tracks one step in {every}. Mean time per",
        f"step over runs of {every} consecutive steps against as many plain steps",
        f"(MLP, width 512, batch {batch}), next to the ratio with",
        f"every step tracked `r` and what `1 + (r - 1) / {every}` predicts. The untracked",
        "steps still run BackPACK's hooks of the extended model and Cockpit's",
        "context: they cost the floor, the `empty Cockpit` row.",
        "",
        f"| quantity | every step `r` | `linear({every})`, measured | `1 + (r - 1) / {every}` |",
        "|---|---:|---:|---:|",
    ]
    for row in schedule:
        predicted = 1 + (row["every step"] - 1) / every
        lines.append(
            f"| {row['method']} | {row['every step']:.2f} | {row['scheduled']:.2f} "
            f"| {predicted:.2f} |"
        )
    lines += ["", schedule_sentence(schedule, every)]
    return "\n".join(lines) + "\n"


def schedule_sentence(schedule, every):
    """How the measured cost of ``linear(every)`` compares with the two predictions."""
    rows = {row["method"]: row for row in schedule}
    floor, whole = rows["empty Cockpit"]["scheduled"], rows["package: all together"]
    r = whole["every step"]
    return (
        f"With all five quantities, `linear({every})` measured {whole['scheduled']:.2f}x a plain "
        f"step on average against {1 + (r - 1) / every:.2f}x from `1 + (r - 1) / {every}`: "
        f"that formula prices the {every - 1} untracked steps as plain ones, but they pay the "
        f"floor ({floor:.2f}x measured for an empty Cockpit under the same schedule), so "
        f"`f + (r - f) / {every}` = {floor + (r - floor) / every:.2f}x is the better estimate."
    )


def _load_warning(env):
    """A warning line when other processes competed for the CPUs (see benchmarks/README.md)."""
    load = max(env["load_average_1min_at_start"], env["load_average_1min_at_end"])
    if env["device"] != "cpu" or load <= env["cpus"]:
        return []
    return [
        "**The load average exceeded the number of CPUs: other processes competed for "
        "them, and these ratios are not reliable. Re-run on a quiet machine.**"
    ]


def growth_sentence(columns, axis):
    """One sentence: how the plain step and each quantity's ratio change along ``axis``."""
    labels = [label for label in columns if label.startswith(axis)]
    first, last = labels[0], labels[-1]

    def row(label, method):
        return next(r for r in columns[label] if r["method"] == method)

    plain = row(last, "plain step")["median_ms"] / row(first, "plain step")["median_ms"]
    changes = [
        f"{method} {row(first, method)['ratio']:.2f} to {row(last, method)['ratio']:.2f}"
        for method in SCALING_METHODS
        if "ratio" in row(first, method) and "ratio" in row(last, method)
    ]
    return (
        f"From {first} to {last} the plain step takes {plain:.1f}x as long and the ratios "
        f"go from {', '.join(changes)}: a ratio that falls has a per-step part "
        "(bookkeeping, hooks, Python) that the larger step amortizes; one that rises "
        "grows faster than the step's own work."
    )


def profile_floor(args, device, steps=50):
    """Where an empty Cockpit's extra time goes, on the MLP (one thread, CPU time).

    Times plain, extended (no Cockpit) and empty-Cockpit steps with
    ``time.process_time`` (interleaved, median of rounds), then profiles the
    empty-Cockpit step with cProfile and sums the functions' own time by
    where they live.
    """
    import cProfile
    import pstats

    spec = MODELS["mlp"]
    model, x, y = model_and_batch(spec, spec.batch_size, device)
    builders = {
        "plain step": plain_step,
        "extended model (no Cockpit)": extended_no_cockpit,
        "empty Cockpit": empty_cockpit,
    }
    steps_, _ = build_steps(builders, model, spec.loss, x, y, args.warmup)
    cpu = {name: [] for name in steps_}
    for _ in range(args.rounds):
        for name, step in steps_.items():
            start = time.process_time()
            for _ in range(10):
                step(x, y)
            cpu[name].append((time.process_time() - start) / 10)
    threads = torch.get_num_threads()
    lines = [f"CPU time per step (median of {args.rounds} rounds of 10 steps, {threads} threads):"]
    lines += [f"  {name}: {1e3 * statistics.median(t):.2f} ms" for name, t in cpu.items()]
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust to other processes
    profiler.enable()
    for _ in range(steps):
        steps_["empty Cockpit"](x, y)
    profiler.disable()
    groups = {}
    for (path, _, function), stat in pstats.Stats(profiler).stats.items():
        group = _profile_group(path, function)
        groups[group] = groups.get(group, 0) + stat[2]  # the function's own time
    lines.append(
        f"empty Cockpit under cProfile (CPU time, slower when profiled): own time by place, "
        f"ms per step ({steps} steps):"
    )
    for group, seconds in sorted(groups.items(), key=lambda item: -item[1]):
        lines.append(f"  {1e3 * seconds / steps:7.3f}  {group}")
    return "\n".join(lines)


def _profile_group(path, function):
    """Where a profiled function lives, for :func:`profile_floor`."""
    for marker, group in [
        ("cockpit_gradnoise", "cockpit_gradnoise (ours)"),
        ("/cockpit/", "Cockpit (context, track, bookkeeping)"),
        ("/backpack/", "BackPACK (its hooks' Python)"),
        ("torch/utils/hooks.py", "torch's module-hook machinery (BackPACK's hooks)"),
        ("torch/autograd/function.py", "torch's module-hook machinery (BackPACK's hooks)"),
        ("torch/nn/modules/module.py", "torch.nn.Module call machinery"),
    ]:
        if marker in path:
            return group
    if function.startswith("<built-in method apply") or "BackwardHook" in function:
        return "torch's module-hook machinery (BackPACK's hooks)"
    if "run_backward" in function or "torch._C._nn" in function or "built-in method torch" in function:
        return "torch kernels and autograd engine"
    return "other (benchmark loop, Python, torch tensor methods)"


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
            memory = ["not measured", "-"]
            if "peak_extra_mib" in row:
                memory = [f"{row['peak_extra_mib']:.1f} MiB", f"{row['memory_ratio']:.2f}"]
            cells = [f"{row['median_ms']:.2f}", f"{row['ratio']:.2f}", *memory]
        else:
            cells = [row["note"], "-", "-", "-"]
        lines.append("| " + " | ".join([row["model"], row["method"], *cells]) + " |")
    return "\n".join(lines)


#: Issue 10's targets: ratio to a plain step of the same model (its default batch size).
TARGETS = {
    "mlp": (2.5, 1.6, 1.6, 1.3, 1.3, 3),
    "cnn": (2, 1.8, 1.8, 1.15, 1.15, 2.5),
    "resnet18": (3, 2, 2, 1.2, 1.2, 4),
    "gpt": (2.5, 2, 2, 1.2, 1.2, 3.5),
}
TARGET_METHODS = (
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "GradientNoiseScale",
    "ParamGradRatio",
    "UpdateSize",
    "package: all together",
)
#: Rows measuring the package before its own convolution extensions (issue 10's "before").
BEFORE = "{} (BackPACK's conv rows)"
#: The cost of LayerNorm/embedding/attention rows may be this much above the model without them.
SUPPORT_COST_TARGET = 0.10


def targets_markdown(table):
    """Issue 10's targets against the measured ratios (and "before" where measured)."""
    ratios = {(r["model"], r["method"]): r["ratio"] for r in table if "ratio" in r}
    models = [m for m in dict.fromkeys(r["model"] for r in table) if m in TARGETS]
    lines = [
        "| model | " + " | ".join(TARGET_METHODS).replace("package: all together", "all five")
        + " | floor: extended model, empty Cockpit |",
        "|---|" + "---|" * (len(TARGET_METHODS) + 1),
    ]
    for model in models:
        cells = []
        for method, target in zip(TARGET_METHODS, TARGETS[model]):
            after = ratios.get((model, method))
            if after is None:
                cells.append(f"not measured (<= {target:g})")
                continue
            before = ratios.get((model, BEFORE.format(method)))
            verdict = "met" if after <= target else f"missed by {after - target:.2f}"
            was = f"{before:.2f} before, " if before is not None else ""
            cells.append(f"{was}**{after:.2f}** (<= {target:g}: {verdict})")
        floor = [ratios.get((model, m)) for m in ("extended model (no Cockpit)", "empty Cockpit")]
        cells.append(" / ".join("-" if f is None else f"{f:.2f}" for f in floor))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def support_cost_markdown(table):
    """What the LayerNorm, embedding and attention rows add, where measured (issue 9)."""
    ratios = {(r["model"], r["method"]): r["ratio"] for r in table if "ratio" in r}
    lines = []
    for model in dict.fromkeys(r["model"] for r in table):
        whole = ratios.get((model, "package: all together"))
        for label in FROZEN_LABELS:
            without = ratios.get((model, f"package: all together {label}"))
            if whole is None or without is None:
                continue
            cost = whole / without - 1
            verdict = "met" if cost <= SUPPORT_COST_TARGET else "missed"
            lines.append(
                f"- {model}: all five {whole:.2f}x a plain step; {label[1:-1]} (in the plain "
                f"step too) {without:.2f}x; their rows cost {100 * cost:+.0f}% "
                f"(target <= +{100 * SUPPORT_COST_TARGET:.0f}%: {verdict})."
            )
    return "\n".join(lines)


def report_markdown(table):
    """The results table, the targets table and the support cost: what the README shows."""
    parts = [markdown(table), targets_markdown(table), support_cost_markdown(table)]
    return "\n\n".join(part for part in parts if part)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,cnn,resnet18,gpt", help="comma-separated: " + ",".join(MODELS)
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
    parser.add_argument(
        "--no-memory", dest="memory", action="store_false", help="time only (faster)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also save here")
    parser.add_argument(
        "--markdown", default=None, metavar="PATH",
        help="also write the README's tables (results, targets, support cost) here",
    )
    parser.add_argument(
        "--from-json", default=None, metavar="PATH",
        help="print (and --markdown) the tables of a saved --json run; measure nothing",
    )
    parser.add_argument(
        "--scaling", default=None, metavar="PATH",
        help="measure the MLP against batch size and width and a linear(10) schedule "
        "instead; write the docs page here (e.g. docs/scaling.md)",
    )
    parser.add_argument("--scaling-batch-sizes", default="16,64,256")
    parser.add_argument("--scaling-widths", default="256,1024,4096")
    parser.add_argument(
        "--every", type=int, default=10, help="--scaling's schedule: linear(EVERY)"
    )
    parser.add_argument(
        "--support-cost", default=None, metavar="PATH",
        help="instead: issue 9's support cost on the GPT in CPU time of one thread "
        "(min over interleaved rounds, with a control family); write its table here",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="instead: where an empty Cockpit's time goes on the MLP (cProfile)",
    )
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
    args.scaling_batch_sizes = [int(n) for n in args.scaling_batch_sizes.split(",")]
    args.scaling_widths = [int(n) for n in args.scaling_widths.split(",")]
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
    if args.from_json:
        with open(args.from_json) as file:
            table = json.load(file)["rows"]
        return write_report(table, args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    if args.support_cost:
        args.threads = 1  # CPU time of one thread (support_cost_rows)
    torch.set_num_threads(args.threads)
    env = environment(args, device)
    for key, value in env.items():
        print(f"{key}: {value}")
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    print()
    if args.profile:
        print(profile_floor(args, device))
        return None
    if args.support_cost:
        rows, best = support_cost_rows(args)
        page = support_cost_markdown_cpu(rows, best)
        with open(args.support_cost, "w") as file:
            file.write(page + "\n")
        print(page)
        return rows
    if args.scaling:
        columns = scaling_columns(args, device)
        schedule = schedule_rows(args, device, args.every)
        env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        page = scaling_page(columns, schedule, env, args.every)
        with open(args.scaling, "w") as file:
            file.write(page)
        print(page)
        return columns
    table = []
    for model_name in args.models:
        spec = MODELS[model_name]
        table += benchmark_model(model_name, spec, args.methods, args, device, memory=args.memory)
        env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        if args.json:  # after every model: a long run stopped early keeps what it measured
            with open(args.json, "w") as file:
                json.dump({"environment": env, "rows": table}, file, indent=1)
    write_report(table, args)
    print(f"\nload average (1 min) at end: {env['load_average_1min_at_end']}")
    return table


def write_report(table, args):
    """Print the tables, and write them to ``--markdown`` if given."""
    report = report_markdown(table)
    print(report)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(report + "\n")
    return table


if __name__ == "__main__":
    main()
