"""Slow, obvious references for every quantity: check your own model with them.

Each reference loops over the examples of a batch with plain autograd (one
backward pass per example), never touches BackPACK or Cockpit, and computes
the statistics with NumPy. Run them on a float64 copy of the model
(``copy.deepcopy(model).double()``) to compare with a quantity's output::

    expected = references.gradient_variance_quantiles(
        model, per_example_loss, x, y, reduction="mean", quantiles=(0.5,))
    got = to_frame(cockpit)   # rows of GradientVarianceQuantiles

Results have the same layout as a quantity's stored step:
``{param name: {statistic: float}}`` plus ``"all"`` for the whole network.
"""

import copy
from typing import Callable, Dict, List, Sequence, Tuple

from cockpit_gradnoise.functional import resolvable_snr
from cockpit_gradnoise.logs.schema import NETWORK

import numpy
import torch
from torch import Tensor, nn


def per_example_gradients(
    model: nn.Module, per_example_loss: Callable, inputs: Tensor, targets: Tensor
) -> Dict[str, Tensor]:
    """Gradients ``g_i`` of each example's own loss, one backward pass each.

    Args:
        model: Any module; it is not modified (``.grad`` is left untouched).
        per_example_loss: ``per_example_loss(outputs, targets)`` returns one
            loss per example (shape ``[N]``), e.g. a loss with
            ``reduction="none"``.
        inputs: Batch of inputs, first dimension ``N``.
        targets: Batch of targets, first dimension ``N``.

    Returns:
        ``{name: tensor [N, *param.shape]}`` for every parameter that requires
        grad and is used by the model (unused parameters are left out). A
        parameter used by several layers (tied) appears once, under its
        first name, with the sum over its uses (as autograd gives it).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows: List[List[Tensor]] = []
    for i in range(len(inputs)):
        loss = per_example_loss(model(inputs[i : i + 1]), targets[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        rows.append(grads)
    result = {}
    for k, (name, _) in enumerate(named):
        if rows[0][k] is not None:
            result[name] = torch.stack([row[k] for row in rows])
    return result


def contributions_through_batch(
    model: nn.Module, loss_fn: Callable, inputs: Tensor, targets: Tensor
) -> Dict[str, Tensor]:
    """Each example's contribution ``x_i`` to ``param.grad``, from one batch backward pass.

    For models whose examples interact (BatchNorm in training mode). One
    backward pass of the whole batch's loss records every layer's input and
    output gradient; then, per example ``i``, in float64: ``Linear``
    ``x_i = sum_positions grad_out_i^T input_i``; ``Conv1d/2d/3d`` the
    weight gradient of example ``i``'s input and output gradient
    (``torch.nn.grad.conv*d_weight``); ``BatchNorm1d/2d/3d``
    ``sum_positions grad_out_i * x_hat_i`` with ``x_hat`` normalized by the
    batch's mean and (biased) variance in training mode, by the running
    statistics in eval mode. Biases: ``grad_out_i`` summed over positions.
    The contributions sum to ``param.grad``; a parameter used by several
    layers (tied) gets the sum over its uses, under its first name.

    Args:
        model: A module of these layers (others must have no parameters).
            It is not modified (a copy is run).
        loss_fn: ``loss_fn(outputs, targets)``, the batch's scalar loss.
        inputs: The batch's inputs, first dimension ``N``.
        targets: The batch's targets.

    Returns:
        ``{name: tensor [N, *param.shape]}`` (float64) for every parameter that
        requires grad.
    """
    model = copy.deepcopy(model)
    supported = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d,
                 nn.BatchNorm3d)
    records = {}

    def record(module, args, output):
        entry = records.setdefault(module, {})
        entry["input"] = args[0].detach()
        # The rest of the network gets a copy, so that in-place operations after
        # the layer (ReLU(inplace=True), a ResNet's `+=`) leave this node alone.
        recorded = output.clone()
        recorded.register_hook(lambda grad: entry.__setitem__("grad_output", grad.detach()))
        return recorded.clone()

    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and not isinstance(module, supported):
            raise ValueError(f"contributions_through_batch does not support {type(module).__name__}")
        if own:
            module.register_forward_hook(record)
    loss_fn(model(inputs), targets).backward()
    first_names = {id(p): n for n, p in model.named_parameters()}
    result = {}
    for module in model.modules():
        if module not in records:
            continue
        weight, bias = _layer_contributions(module, records[module]["input"].double(),
                                            records[module]["grad_output"].double())
        for name, value in (("weight", weight), ("bias", bias)):
            param = getattr(module, name, None)
            if param is not None and param.requires_grad:
                key = first_names[id(param)]  # a tied parameter: the sum over its uses
                result[key] = result[key] + value if key in result else value
    return result


def _layer_contributions(module, inputs, grad_output):
    """``(weight, bias)`` contributions ``[N, *shape]`` of one layer."""
    n = inputs.shape[0]
    if isinstance(module, nn.Linear):
        a, g = inputs.reshape(n, -1, inputs.shape[-1]), grad_output.reshape(n, -1, grad_output.shape[-1])
        return torch.einsum("npo,npi->noi", g, a), g.sum(1)
    positions = tuple(range(2, grad_output.dim()))
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        axes = (0,) + positions
        if module.training:
            mean = inputs.mean(axes, keepdim=True)
            var = inputs.var(axes, unbiased=False, keepdim=True)
        else:
            shape = (1, -1) + (1,) * len(positions)
            mean = module.running_mean.double().reshape(shape)
            var = module.running_var.double().reshape(shape)
        normalized = (inputs - mean) / torch.sqrt(var + module.eps)
        return (grad_output * normalized).sum(positions), grad_output.sum(positions)
    conv_weight = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight,
                   3: torch.nn.grad.conv3d_weight}[len(positions)]
    weight = torch.stack([
        conv_weight(inputs[i : i + 1], module.weight.shape, grad_output[i : i + 1],
                    module.stride, module.padding, module.dilation, module.groups)
        for i in range(n)
    ])
    return weight, grad_output.sum(positions)


def _scale(reduction: str, n: int) -> float:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return 1.0 / n if reduction == "mean" else 1.0


def _quantiles(values: numpy.ndarray, levels: Sequence[float], prefix="") -> Dict[str, float]:
    stats = {f"{prefix}q{q:g}": float(numpy.quantile(values, q)) for q in levels}
    stats[prefix + "mean"] = float(numpy.mean(values))
    return stats


def _sd_statistics(sd: numpy.ndarray, grad: numpy.ndarray, levels, limit=None) -> Dict[str, float]:
    """Quantiles and mean of ``sd``, and of ``min(|grad| / sd, limit)`` except ``0 / 0``
    (without ``limit``: of ``|grad| / sd`` where ``sd > 0``, as
    :func:`~cockpit_gradnoise.functional.signal_to_noise`)."""
    stats = _quantiles(sd, levels)
    defined = (sd > 0) if limit is None else (sd > 0) | (grad != 0)
    if defined.any():
        with numpy.errstate(divide="ignore"):
            snr = numpy.abs(grad[defined]) / sd[defined]
        if limit is not None:
            snr = numpy.minimum(snr, limit)
        stats.update(_quantiles(snr, (0.5,), "snr_"))
    return stats


def _with_network(per_param: Dict[str, Tuple], combine: Callable) -> Dict[str, Tuple]:
    per_param = dict(per_param)
    per_param[NETWORK] = combine(list(per_param.values()))
    return per_param


def gradient_variance_quantiles(
    model, per_example_loss, inputs, targets, *, reduction: str, quantiles=(0.05, 0.25, 0.5, 0.75, 0.95),
    gradients=None, dtype=torch.float64,
) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.GradientVarianceQuantiles`.

    ``sd_j = sqrt(N/(N-1) * sum_i (x_ij - mean_i x_ij)^2)`` with ``x_i = c g_i``
    (``c = 1/N`` for ``reduction="mean"``, ``1`` for ``"sum"``), computed from
    the stacked per-example gradients, two-pass. The SNR ``|grad_j| / sd_j``
    is capped at the largest the quantity resolves for a model in ``dtype``
    (:func:`~cockpit_gradnoise.functional.resolvable_snr`), ``0 / 0`` left
    out. ``gradients`` (``{name: g_i stacked}``) replaces the loop, e.g. with
    :func:`contributions_through_batch`.
    """
    grads = gradients or per_example_gradients(model, per_example_loss, inputs, targets)
    n = len(inputs)
    c = _scale(reduction, n)
    flat = {
        name: (c * g).reshape(n, -1).detach().cpu().numpy() for name, g in grads.items()
    }
    flat = _with_network(flat, lambda xs: numpy.concatenate(xs, axis=1))
    result = {}
    for name, x in flat.items():
        sd = numpy.sqrt(n / (n - 1) * ((x - x.mean(0)) ** 2).sum(0))
        result[name] = _sd_statistics(sd, x.sum(0), quantiles, resolvable_snr(n, dtype))
    return result


def per_example_grad_norm(
    model, per_example_loss, inputs, targets, *, quantiles=(0.05, 0.5, 0.95), gradients=None
) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.PerExampleGradNorm`: ``||g_i||`` by a loop.

    ``gradients`` (``{name: g_i stacked}``) replaces the loop.
    """
    grads = gradients or per_example_gradients(model, per_example_loss, inputs, targets)
    n = len(inputs)
    flat = {name: g.reshape(n, -1).detach().cpu().numpy() for name, g in grads.items()}
    flat = _with_network(flat, lambda xs: numpy.concatenate(xs, axis=1))
    result = {}
    for name, g in flat.items():
        norms = numpy.sqrt((g**2).sum(1))
        stats = _quantiles(norms, quantiles)
        stats["max"] = float(norms.max())
        result[name] = stats
    return result


def param_grad_ratio(model, loss_fn, inputs, targets) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.ParamGradRatio`.

    ``grad`` is the gradient of ``loss_fn(model(inputs), targets)`` (what
    ``param.grad`` holds after ``loss.backward()``), by plain autograd; the
    statistics of ``|theta_j| / |grad_j|`` over elements with ``grad_j != 0``
    and both finite come from NumPy (``numpy.median``).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = loss_fn(model(inputs), targets)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    pairs = {
        name: (p.detach().reshape(-1).cpu().numpy(), g.reshape(-1).cpu().numpy())
        for (name, p), g in zip(named, grads)
        if g is not None
    }
    result = {}
    for name, (theta, grad) in _with_network(pairs, _concatenate_pairs).items():
        stats = {}
        valid = numpy.isfinite(theta) & numpy.isfinite(grad) & (grad != 0)
        if name != NETWORK and valid.any():
            ratio = numpy.abs(theta[valid]) / numpy.abs(grad[valid])
            stats = {
                "mean": float(numpy.mean(ratio)),
                "median": float(numpy.median(ratio)),
                "min": float(numpy.min(ratio)),
                "max": float(numpy.max(ratio)),
            }
        theta_norm, grad_norm = numpy.linalg.norm(theta), numpy.linalg.norm(grad)
        stats["zero_grad_fraction"] = float(numpy.mean(grad == 0))
        stats["norm_ratio"] = float(theta_norm / grad_norm) if grad_norm > 0 else numpy.inf
        result[name] = stats
    return result


def _concatenate_pairs(pairs):
    """``[(a1, b1), (a2, b2), ...]`` to ``(concat(a1, a2, ...), concat(b1, b2, ...))``."""
    return tuple(numpy.concatenate(side) for side in zip(*pairs))


def update_size(before: Dict[str, Tensor], after: Dict[str, Tensor]) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.UpdateSize` from two snapshots.

    Args:
        before: ``{name: theta(s)}``, e.g. ``{n: p.detach().clone() for n, p in
            model.named_parameters()}`` taken when the cockpit is called at ``s``.
        after: ``{name: theta(s+1)}``, same names.

    Returns:
        ``norm = ||after - before||`` and ``relative = norm / ||before||``
        (``inf`` when ``before`` is all zero), per name and for ``"all"``.
    """
    flat = {
        name: (before[name].reshape(-1).double().cpu().numpy(),
               after[name].reshape(-1).double().cpu().numpy())
        for name in before
    }
    flat = _with_network(flat, _concatenate_pairs)
    result = {}
    for name, (start, end) in flat.items():
        norm, start_norm = numpy.linalg.norm(end - start), numpy.linalg.norm(start)
        relative = float(norm / start_norm) if start_norm > 0 else numpy.inf
        result[name] = {"norm": float(norm), "relative": relative}
    return result


def gradient_noise_scale(
    model, per_example_loss, inputs, targets, *, gradients=None
) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.GradientNoiseScale` (without smoothing).

    From the per-example gradients ``g_i`` (a loop), in float64: ``grad_sq``
    is the mean of ``g_i . g_j`` over all pairs ``i != j``, ``trace_cov`` the
    sample variance ``sum_i ||g_i - mean g||^2 / (N - 1)`` (two-pass), and
    ``b_simple = trace_cov / grad_sq`` (``inf`` when ``grad_sq <= 0``).
    ``gradients`` (``{name: g_i stacked}``) replaces the loop.
    """
    grads = gradients or per_example_gradients(model, per_example_loss, inputs, targets)
    n = len(inputs)
    if n < 2:
        raise ValueError(f"the gradient noise scale needs at least 2 examples, got {n}")
    flat = {name: g.reshape(n, -1).detach().double().cpu().numpy() for name, g in grads.items()}
    flat = _with_network(flat, lambda xs: numpy.concatenate(xs, axis=1))
    off_diagonal = ~numpy.eye(n, dtype=bool)
    result = {}
    for name, g in flat.items():
        grad_sq = float(numpy.mean((g @ g.T)[off_diagonal]))
        trace_cov = float(((g - g.mean(0)) ** 2).sum() / (n - 1))
        b_simple = trace_cov / grad_sq if grad_sq > 0 else numpy.inf
        result[name] = {"grad_sq": grad_sq, "trace_cov": trace_cov, "b_simple": b_simple}
    return result


def batch_gradients(model: nn.Module, batches, loss_fn: Callable) -> Dict[str, numpy.ndarray]:
    """Every batch's gradient, by ``loss.backward()`` on a copy of ``model``.

    Returns:
        ``{name: float64 array [number of batches, param.numel()]}`` for every
        trainable parameter that gets a gradient in some batch; zeros in the
        rows of batches that gave it none.
    """
    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for inputs, targets in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        rows.append([None if p.grad is None else p.grad.double().flatten() for _, p in named])
    result = {}
    for k, (name, param) in enumerate(named):
        if any(row[k] is not None for row in rows):
            zeros = torch.zeros(param.numel(), dtype=torch.float64)
            stacked = torch.stack([zeros if row[k] is None else row[k] for row in rows])
            result[name] = stacked.numpy()
    return result


def minibatch_gradient_stats(
    model, batches, loss_fn, *, quantiles=(0.05, 0.25, 0.5, 0.75, 0.95)
) -> Dict[str, Dict[str, float]]:
    """Reference for :func:`~cockpit_gradnoise.minibatch_gradient_stats`.

    Stacks every batch's gradient (:func:`batch_gradients`) and takes the
    two-pass standard deviation over batches with ``ddof=1``.
    """
    grads = _with_network(batch_gradients(model, batches, loss_fn), numpy.hstack)
    return {
        name: _sd_statistics(g.std(0, ddof=1), g.mean(0), quantiles)
        for name, g in grads.items()
    }


def dataset_gradient(model, batches, loss_fn, *, reduction: str = "mean") -> Dict[str, Tensor]:
    """Reference for :func:`~cockpit_gradnoise.dataset_gradient`: one batch of everything.

    Concatenates all inputs and targets and differentiates the loss of that
    one batch (divided by the number of examples for ``reduction="sum"``).
    Right for models whose output for an example does not depend on the
    other examples of its batch (not BatchNorm in training mode).
    """
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    model = copy.deepcopy(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    loss = loss_fn(model(inputs), targets)
    _scale(reduction, len(targets))  # checks the name
    if reduction == "sum":
        loss = loss / len(targets)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {name: g for (name, _), g in zip(named, grads) if g is not None}
