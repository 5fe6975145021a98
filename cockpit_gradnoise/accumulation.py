"""Gradient accumulation: which micro-batch of an optimizer step a cockpit call is.

Under gradient accumulation one optimizer step differentiates ``K``
micro-batches one after the other, and ``param.grad`` sums their gradients.
Tracked around every one of them with the same step number, the quantities
report the statistics of the whole accumulated batch (``N = sum_k N_k``
examples), exactly as one call with all examples would: their declared sums
over examples (:attr:`~cockpit_gradnoise.ParameterQuantity.sums`) add across
micro-batches as they add across processes (:mod:`cockpit_gradnoise.distributed`).

A call says which micro-batch it is with two keys of Cockpit's ``info``
(the front door, :class:`~cockpit_gradnoise.Tracker`, sets them from its
``micro_batch=`` and ``micro_batches=`` arguments):

- ``info["micro_batch"]``: ``k``, from 0, the micro-batch's place in the step;
- ``info["micro_batches"]``: ``K``, the number of micro-batches of the step.

The micro-batch's loss is then ``losses.mean() / K`` or ``losses.sum()``
(:func:`micro_batch_loss_scale`): the two that make the accumulated gradient
that of one batch of all examples (for a mean, when the micro-batches are of
one size). See ``docs/accumulation.md``.
"""

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from cockpit_gradnoise import _device, functional
from cockpit_gradnoise.extensions import sharded
from cockpit_gradnoise.extensions.fallback.parameters import variables_reached

import torch

#: The keys of Cockpit's ``info`` that say which micro-batch a call is.
MICRO_BATCH, MICRO_BATCHES = "micro_batch", "micro_batches"


@dataclass(frozen=True)
class MicroBatch:
    """Micro-batch ``index`` of the ``count`` micro-batches of one optimizer step.

    Attributes:
        index: ``k``, from 0.
        count: ``K >= 2``.
    """

    index: int
    count: int

    @property
    def last(self) -> bool:
        """Whether this is the last micro-batch, after whose backward pass the quantities compute."""
        return self.index == self.count - 1


@dataclass
class MicroBatchGradient:
    """One micro-batch's own gradient on this process, kept after the step for estimators.

    The two-batch-size estimate of the noise scale (McCandlish et al. 2018,
    Appendix A) needs the squared norm of each micro-batch's gradient next to
    that of the accumulated batch's.

    Attributes:
        examples: ``N_k``.
        loss_scale: ``c_k`` (``x_i = c_k g_i``).
        squared_norms: ``{name: ||sum_{i in k} g_i||^2}`` (per-example units;
            ``||mean_i g_i||^2 = squared_norms[name] / N_k**2``), floats, or
            0-dim float64 tensors on other devices than the CPU.
    """

    examples: int
    loss_scale: float
    squared_norms: Dict[str, Any] = field(default_factory=dict)


def _integer(value, key) -> int:
    """``value`` as an int: a Python or NumPy integer, or a 0-dim integer tensor."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{key} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def micro_batch_of(info: Mapping) -> Optional[MicroBatch]:
    """The :class:`MicroBatch` that ``info`` names; ``None`` without accumulation (or ``K = 1``).

    Raises:
        TypeError / ValueError: Only one of the two keys, not ints, or not
            ``0 <= micro_batch < micro_batches``, naming the fix.
    """
    given = [key for key in (MICRO_BATCH, MICRO_BATCHES) if key in info]
    if not given:
        return None
    if len(given) == 1:
        raise ValueError(
            f"info holds {given[0]!r} without "
            f"{({MICRO_BATCH, MICRO_BATCHES} - set(given)).pop()!r}: under gradient accumulation "
            "pass both, micro_batch=k (from 0) and micro_batches=K (docs/accumulation.md)"
        )
    index, count = _integer(info[MICRO_BATCH], MICRO_BATCH), _integer(info[MICRO_BATCHES], MICRO_BATCHES)
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"micro_batch={index}, micro_batches={count}: micro_batch counts the micro-batches "
            "of one optimizer step from 0 to micro_batches - 1"
        )
    return None if count == 1 else MicroBatch(index, count)


def micro_batch_loss_scale(loss: torch.Tensor, individual_losses: torch.Tensor, count: int) -> float:
    """``c_k`` with ``loss = c_k sum_i l_i`` for a micro-batch of ``N_k`` examples of ``K = count``.

    Example ``i``'s contribution to ``param.grad`` is ``x_i = c_k g_i``. The
    two losses accepted are those that make the accumulated gradient that of
    one batch of all examples:

    - ``losses.mean() / K``: ``c_k = 1 / (K N_k)`` (equal micro-batches: the
      mean over all ``N = K N_k`` examples);
    - ``losses.sum()``: ``c_k = 1`` (the sum over all examples).

    The two never coincide (``K N_k >= 2``). Compared as
    :func:`~cockpit_gradnoise.functional.loss_scale` compares.

    Returns:
        ``c_k``; NaN when the losses are not finite.

    Raises:
        ValueError: Any other loss (the micro-batch's mean not divided by
            ``K``, say), naming the two.
    """
    n = individual_losses.numel()
    scale, total, value = functional.matching_loss_scale(
        loss, individual_losses, (1.0 / (count * n), 1.0))
    if scale is not None:
        return scale
    raise ValueError(
        f"the loss of a micro-batch of {n} examples is {value:.6g}, neither their mean divided by "
        f"micro_batches={count} ({total / n / count:.6g}) nor their sum ({total:.6g}): under "
        "gradient accumulation differentiate losses.mean() / micro_batches (then the "
        "accumulated gradient is the mean over all examples) or losses.sum() "
        "(docs/accumulation.md)"
    )


def parameters_reached(loss) -> list:
    """The tensors a backward pass of ``loss`` accumulates gradients into (the variables of
    its graph's ``AccumulateGrad`` nodes), in no particular order; ``[]`` without a graph.

    Before the first tracked backward pass of a plain cockpit call, Cockpit has not given
    the quantities its parameters yet: these are the ones the pass will add to.
    """
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return []
    return variables_reached(loss.grad_fn)


def gradients_held(params) -> list:
    """Positions in ``params`` of those whose ``.grad`` holds a non-zero element.

    Free where no gradient exists (``optimizer.zero_grad()`` sets them to
    ``None``); one pass over the gradients that exist otherwise.
    """
    present = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    if not present:
        return []
    # This process's shard of an FSDP2 gradient (a DTensor).
    nonzero = _device.transfer([sharded.local_tensor(grad.detach()).ne(0).any() for _, grad in present])
    return [i for (i, _), flag in zip(present, nonzero) if flag]


def earlier_gradients_message(global_step, names, micro: Optional[MicroBatch]) -> str:
    """The warning when ``param.grad`` holds gradients before a tracked backward pass."""
    shown = ", ".join(repr(n) for n in names[:2]) + (", ..." if len(names) > 2 else "")
    held = f"param.grad of {len(names)} parameters ({shown}) already holds gradients"
    if micro is not None:
        return (
            f"{held} before the first micro-batch of step {global_step}: ParamGradRatio reads "
            "them as part of the accumulated gradient, the per-example quantities do not. "
            "Call optimizer.zero_grad() before the first micro-batch of every optimizer step"
        )
    return (
        f"{held} before the tracked backward pass of step {global_step} (gradient "
        "accumulation with the cockpit around the last micro-batch only?): the per-example "
        "quantities describe this backward pass's examples only (GradientNoiseScale uses "
        "this backward pass's own gradient, not param.grad), ParamGradRatio the accumulated "
        "param.grad. To track the accumulated batch, track every micro-batch with the same "
        "step: tracker(step, losses, micro_batch=k, micro_batches=K), or info['micro_batch'] "
        "and info['micro_batches'] (docs/accumulation.md); otherwise call "
        "optimizer.zero_grad() before each tracked backward pass"
    )
