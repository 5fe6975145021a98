"""One quantity's declared sums over the micro-batches of an optimizer step so far.

Each micro-batch's sums are in per-example units (divided by its loss scale
``c_k``, sums of squares by ``c_k**2``), so they add across micro-batches as
across processes; ratios and quantiles are formed once, after the last
micro-batch, from the sums of all of them (:mod:`cockpit_gradnoise.accumulation`).
What is held between micro-batches is what the quantity declares: per
parameter sums over examples (parameter-sized tensors, scalars) and, for a
``"cat"`` sum, one row per example (a per-example squared norm), never
per-example gradients.
"""

import math
from typing import Any, Dict, List, Mapping, Optional

from cockpit_gradnoise import functional
from cockpit_gradnoise.accumulation import MicroBatchGradient
from cockpit_gradnoise.step import Batch

import torch


def accumulated_batch(batches: List[Batch], global_step) -> Batch:
    """The :class:`Batch` of all micro-batches: ``N = sum_k N_k``, ``c = 1/N`` (mean) or ``1`` (sum).

    Raises:
        ValueError: Some micro-batches differentiated their mean, others their sum.
    """
    n = sum(batch.examples for batch in batches)
    scales = [batch.loss_scale for batch in batches]
    if any(math.isnan(scale) for scale in scales):
        return Batch(n, math.nan)
    sums = [scale == 1.0 for scale in scales]  # a mean is 1 / (K N_k) < 1
    if all(sums):
        return Batch(n, 1.0)
    if not any(sums):
        return Batch(n, 1.0 / n)
    raise ValueError(
        f"the micro-batches of step {global_step} differentiate a mean (losses.mean() / K) "
        "in some and a sum (losses.sum()) in others: use one reduction for every micro-batch"
    )


class Accumulation:
    """The declared sums of the micro-batches ``0 .. next - 1`` of step ``global_step``.

    Attributes:
        global_step: The optimizer step.
        count: ``K``, its number of micro-batches.
        next: The index of the micro-batch expected next.
        dropped: Names of parameters left out because some micro-batch gave
            them no sums (unused in its forward pass).
        micro_batches: One :class:`MicroBatchGradient` per micro-batch added,
            where the quantity names its gradient sum.
        error: An exception raised while adding a micro-batch under
            distributed training, raised at the last micro-batch, where every
            process raises together.
        void: Whether some micro-batch recorded nothing (its quantity's
            ``step_context`` returned ``None``): then neither does the step.
    """

    def __init__(self, global_step: int, count: int):
        self.global_step, self.count, self.next = global_step, count, 0
        self.batches: List[Batch] = []
        self.sums: Optional[Dict[str, Dict[str, Any]]] = None
        self.dropped: List[str] = []
        self.micro_batches: List[MicroBatchGradient] = []
        self.error: Optional[Exception] = None
        self.void = False

    def expects(self, global_step: int, index: int, count: int) -> bool:
        """Whether micro-batch ``index`` of ``count`` at ``global_step`` is the one expected next."""
        return (global_step, count, index) == (self.global_step, self.count, self.next)

    def add(self, batch: Batch, sums: Mapping[str, Mapping[str, torch.Tensor]],
            reductions: Mapping[str, str], gradient_sum: Optional[str] = None,
            squared_norms: Optional[Mapping[str, Any]] = None):
        """Add one micro-batch's ``{name: declared sums}`` (per-example units).

        ``"sum"`` sums are added (the first kept as given: never altered in
        place, it may be a view of what the backward pass left); ``"cat"``
        rows are kept per micro-batch and joined by :meth:`total`.
        ``gradient_sum`` names the sum that is the micro-batch's gradient,
        whose squared norm is recorded in :attr:`micro_batches` (``squared_norms[name]``
        where given: that of this process's gradient, whose sum holds only its rows of every
        process's under FSDP2).
        """
        self.next += 1
        self.batches.append(batch)
        if gradient_sum is not None:
            self.micro_batches.append(MicroBatchGradient(batch.examples, batch.loss_scale, {
                name: squared_norms[name] if name in (squared_norms or {})
                else functional.squared_norm(named[gradient_sum], defer=True)
                for name, named in sums.items()
            }))
        if self.sums is None:
            self.sums = {
                name: {key: [value] if reductions[key] == "cat" else value
                       for key, value in named.items()}
                for name, named in sums.items()
            }
            return
        for name in [n for n in self.sums if n not in sums] + [n for n in sums if n not in self.sums]:
            self.sums.pop(name, None)
            self.dropped.append(name)
        for name, held in self.sums.items():
            for key, value in sums[name].items():
                if reductions[key] == "cat":
                    held[key].append(value)
                else:
                    held[key] = held[key] + value

    def total(self):
        """``(Batch of all micro-batches, {name: declared sums over all their examples})``."""
        batch = accumulated_batch(self.batches, self.global_step)
        sums = {
            name: {key: torch.cat(value) if isinstance(value, list) else value
                   for key, value in named.items()}
            for name, named in (self.sums or {}).items()
        }
        return batch, sums
