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

from typing import Callable, Dict, List, Sequence, Tuple

import numpy
import torch
from torch import Tensor, nn

NETWORK = "all"


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
        grad and is used by the model (unused parameters are left out).
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


def _scale(reduction: str, n: int) -> float:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return 1.0 / n if reduction == "mean" else 1.0


def _quantiles(values: numpy.ndarray, levels: Sequence[float], prefix="") -> Dict[str, float]:
    stats = {f"{prefix}q{q:g}": float(numpy.quantile(values, q)) for q in levels}
    stats[prefix + "mean"] = float(numpy.mean(values))
    return stats


def _with_network(per_param: Dict[str, Tuple], combine: Callable) -> Dict[str, Tuple]:
    per_param = dict(per_param)
    per_param[NETWORK] = combine(list(per_param.values()))
    return per_param


def gradient_variance_quantiles(
    model, per_example_loss, inputs, targets, *, reduction: str, quantiles=(0.05, 0.25, 0.5, 0.75, 0.95)
) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.GradientVarianceQuantiles`.

    ``sd_j = sqrt(N/(N-1) * sum_i (x_ij - mean_i x_ij)^2)`` with ``x_i = c g_i``
    (``c = 1/N`` for ``reduction="mean"``, ``1`` for ``"sum"``), computed from
    the stacked per-example gradients, two-pass.
    """
    grads = per_example_gradients(model, per_example_loss, inputs, targets)
    n = len(inputs)
    c = _scale(reduction, n)
    flat = {
        name: (c * g).reshape(n, -1).detach().cpu().numpy() for name, g in grads.items()
    }
    flat = _with_network(flat, lambda xs: numpy.concatenate(xs, axis=1))
    result = {}
    for name, x in flat.items():
        sd = numpy.sqrt(n / (n - 1) * ((x - x.mean(0)) ** 2).sum(0))
        grad = x.sum(0)
        stats = _quantiles(sd, quantiles)
        positive = sd > 0
        if positive.any():
            stats.update(_quantiles(numpy.abs(grad[positive]) / sd[positive], (0.5,), "snr_"))
        result[name] = stats
    return result


def per_example_grad_norm(
    model, per_example_loss, inputs, targets, *, quantiles=(0.05, 0.5, 0.95)
) -> Dict[str, Dict[str, float]]:
    """Reference for :class:`~cockpit_gradnoise.PerExampleGradNorm`: ``||g_i||`` by a loop."""
    grads = per_example_gradients(model, per_example_loss, inputs, targets)
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
