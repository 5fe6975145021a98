"""The methods a tracked step is compared with, each a builder of one training step.

Each builder gets the un-extended reference model and ``loss`` (the model's
``ModelSpec.loss``) and returns a function step(x, y) doing one training step
on its own copy of that model (same weights; the plain step trains the
reference itself), with the module it trains as ``step.model``. Results a
step computes are reduced to per-example norms or freed inside the step, as
a training script would. A builder raises ``NotSupported`` when the method
cannot give a result for every trainable parameter of the model.
:data:`METHODS` names them in the table's order.
"""

import copy
import itertools
import time
import warnings

import cockpit_gradnoise as cgn  # first: makes `import cockpit` work
from cockpit_gradnoise import extensions as cgn_extensions
from cockpit_gradnoise.extensions import sums as cgn_sums
from cockpit_gradnoise.logs.schema import QUANTITIES

import torch
from backpack import backpack, extend
from backpack.core.derivatives.convnd import weight_jac_t_save_memory
from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from cockpit import quantities as cockpit_quantities
from cockpit.utils.schedules import linear
from torch import nn

# BackPACK's hooks on the first layer, whose input needs no gradient: harmless.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def extended_copy(model):
    """A deep copy prepared as users prepare it (``cgn.prepare_model``: the package's
    hooks, which run BackPACK's first-order extensions and allow resnet18's
    in-place operations)."""
    return cgn.prepare_model(copy.deepcopy(model))


class NotSupported(Exception):
    """A method cannot compute its result for every parameter of this model."""


def plain_step(model, loss):
    loss_fn = loss("mean")

    def step(x, y):
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        loss = loss_fn(model(x), y)
        forward = time.process_time()
        loss.backward()
        _note_phases(step.phases, start, forward, time.process_time())

    step.model, step.phases = model, _phases()
    return step


def _phases():
    """CPU times (``time.process_time``) of each step's phases: the forward pass (model and loss;
    tracked, also the per-example losses and the Cockpit's entry), the backward pass (the
    package's rules and blocks run in it), the Cockpit's quantities after it
    (``benchmark_cpu_ratio.py --phases``)."""
    return {"forward": [], "backward": [], "quantities": []}


def _note_phases(phases, start, forward, backward, end=None):
    phases["forward"].append(forward - start)
    phases["backward"].append(backward - forward)
    phases["quantities"].append(0.0 if end is None else end - backward)


def trainable(model):
    """Names and parameters that require gradients (Cockpit refuses frozen ones)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


def cockpit_step(model, loss, make_quantities, every=1, make_optimizer=None):
    """A step tracked by a Cockpit holding ``make_quantities(param_names, schedule)``.

    The schedule is Cockpit's ``linear(every)``: every ``every``-th step is tracked.
    The optimizer in ``info`` (never stepped): SGD, or ``make_optimizer(params)``.
    """
    model = extended_copy(model)
    loss_fn, individual_loss = extend(loss("mean")), loss("none")
    names, params = trainable(model)
    cockpit = cgn.Cockpit(params, quantities=make_quantities(names, linear(every)))
    optimizer = (make_optimizer or (lambda params: torch.optim.SGD(params, lr=0.0)))(params)
    steps = itertools.count()

    def step(x, y):
        global_step = next(steps)
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        out = model(x)
        loss = loss_fn(out, y)
        info = {
            "batch_size": len(x),
            "individual_losses": individual_loss(out.detach(), y),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(global_step, info=info):
            before = time.process_time()
            loss.backward(create_graph=cockpit.create_graph(global_step))
            backward = time.process_time()
        _note_phases(step.phases, start, before, backward, time.process_time())

    step.model, step.phases, step.cockpit = model, _phases(), cockpit
    return step


def front_door_step(model, loss, quantities, every=1):
    """A step tracked through the front door, ``cgn.track(model, every, quantities)``: one loss
    per example (``loss("none")``), computed once, and the loss the tracker hands out, their mean.

    The explicit API's ``cockpit_step`` computes the loss twice, the mean to differentiate and the
    per-example losses for ``info`` (what the README's explicit loop writes); on a language model
    the second cross-entropy over the vocabulary is a few percent of a step. Here, as through
    ``cgn.track`` in a user's loop, it is computed once.
    """
    model, tracker = cgn.track(copy.deepcopy(model), every, quantities)
    individual_loss = loss("none")
    steps = itertools.count()

    def step(x, y):
        global_step = next(steps)
        model.zero_grad(set_to_none=True)
        start = time.process_time()
        losses = individual_loss(model(x), y)
        with tracker(global_step, losses) as mean:
            before = time.process_time()
            mean.backward()
            backward = time.process_time()
        _note_phases(step.phases, start, before, backward, time.process_time())

    step.model, step.phases, step.tracker = model, _phases(), tracker
    return step


def tracked_token_step(model, cockpit, loss_fn, step, inputs, targets):
    """One step of a token model tracked by ``cockpit`` at ``step``: the mean cross-entropy over
    all tokens (``loss_fn``, extended), each example's own the mean over its tokens."""
    model.zero_grad()
    logits = model(inputs)
    loss = loss_fn(logits.flatten(0, 1), targets.flatten())
    tokens = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    info = {"batch_size": len(targets), "individual_losses": tokens.mean(1), "loss": loss}
    with cockpit(step, info=info):
        loss.backward()


def package_quantity(name):
    def build(model, loss, every=1):
        return cockpit_step(
            model,
            loss,
            lambda names, schedule: [getattr(cgn, name)(schedule, param_names=names)],
            every,
        )

    return build


def adam_with_state(params):
    """Adam whose state is that of a later step (what PreconditionedNoiseScale reads)."""
    optimizer = torch.optim.Adam(params, lr=0.0)
    for param in params:
        optimizer.state[param] = {"step": torch.tensor(10.0), "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.full_like(param, 1e-6)}
    return optimizer


def with_adam(*names):
    """A step tracking the quantities ``names`` together, with Adam in ``info``."""
    def build(model, loss, every=1):
        return cockpit_step(
            model, loss,
            lambda params, schedule: [getattr(cgn, n)(schedule, param_names=params) for n in names],
            every, make_optimizer=adam_with_state,
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


def package_sums(model, loss):
    """The package's extension behind GradientVarianceQuantiles, without the quantity."""
    extension = cgn_extensions.SumsOfContributions
    return backpack_step(model, loss, [extension], _sums(cgn_extensions.SUMS_SAVEFIELD))


def package_squared_norms(model, loss):
    """The package's extension behind PerExampleGradNorm, without the quantity."""
    extension = cgn_extensions.PerExampleSquaredNorms
    return backpack_step(model, loss, [extension], _sums(cgn_extensions.BATCH_L2_SAVEFIELD))


def with_backpack_convolution_rows(name):
    """Quantity ``name``, its extensions using BackPACK's own module extensions for convolutions.

    That is the package before it had its own (``SumGradSquared``'s and
    ``BatchL2Grad``'s rows; the latter is wrong for grouped convolutions, which
    the benchmark models do not have): a measurement of what ours save. The rows
    are replaced on the quantity's own extension instances, through BackPACK's
    ``set_module_extension`` (``cgn_extensions.override_module_extensions``).
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
        # The same rules, also summing the contributions they form.
        cgn_extensions.SumsOfContributions: {
            cls: type(f"Sums{rule.__name__}", (cgn_sums.SumsFromContributionsMixin, rule), {})()
            for cls, rule in sgs_rows.items()
        },
        cgn_extensions.PerExampleSquaredNorms: {
            nn.Conv1d: convnd.BatchL2Conv1d(),
            nn.Conv2d: convnd.BatchL2Conv2d(),
            nn.Conv3d: convnd.BatchL2Conv3d(),
            nn.ConvTranspose1d: convtransposend.BatchL2ConvTranspose1d(),
            nn.ConvTranspose2d: convtransposend.BatchL2ConvTranspose2d(),
            nn.ConvTranspose3d: convtransposend.BatchL2ConvTranspose3d(),
        },
    }

    def make_quantities(names, schedule):
        quantity = getattr(cgn, name)(schedule, param_names=names)
        # The instances the quantity keeps and hands to Cockpit at every tracked step.
        cgn_extensions.override_module_extensions(quantity.extensions(0), backpack_rows)
        return [quantity]

    def build_with_backpack_rows(model, loss):
        if not any(type(m) in sgs_rows for m in model.modules()):
            raise NotSupported("not applicable: no convolutions")
        return cockpit_step(model, loss, make_quantities)

    build_with_backpack_rows.make_quantities = make_quantities
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
    # The noise scale Adam sees, alone and beside the quantities it shares work with.
    "GradientNoiseScale (Adam)": with_adam("GradientNoiseScale"),
    "PreconditionedNoiseScale (Adam)": with_adam("PreconditionedNoiseScale"),
    "GradientNoiseScale+PreconditionedNoiseScale (Adam)": with_adam(
        "GradientNoiseScale", "PreconditionedNoiseScale"),
    "GradientVarianceQuantiles+GradientNoiseScale (Adam)": with_adam(
        "GradientVarianceQuantiles", "GradientNoiseScale"),
    "GradientVarianceQuantiles+GradientNoiseScale+PreconditionedNoiseScale (Adam)": with_adam(
        "GradientVarianceQuantiles", "GradientNoiseScale", "PreconditionedNoiseScale"),
    **{f"package: all together {label}": with_frozen(package_all, label) for label in FROZEN_LABELS},
    "GradientVarianceQuantiles (BackPACK's conv rows)": with_backpack_convolution_rows(
        "GradientVarianceQuantiles"
    ),
    "PerExampleGradNorm (BackPACK's conv rows)": with_backpack_convolution_rows("PerExampleGradNorm"),
    "package extension PerExampleSquaredNorms": package_squared_norms,
    "BackPACK BatchL2Grad": backpack_batch_l2,
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
