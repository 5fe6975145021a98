"""A :class:`~cockpit_gradnoise.BatchSchedule` driven from a training library's loop.

Lightning's and Hugging Face's Trainers both decide where an optimizer step
ends by the place of a batch in its epoch: a step ends after batch ``c`` of
the epoch (counted from 1) when ``c`` is a multiple of the number of
micro-batches ``K``, and a step's first micro-batch (where Lightning zeroes
the gradients) is one whose index is a multiple of ``K``. A new ``K`` is
therefore honoured exactly only from a place in the epoch that is a multiple
of it: from anywhere else the next step would end early, and under
Lightning take in the gradients of the step before. So a change of the
schedule takes effect at the first end of a step where the micro-batches
done in the epoch are a multiple of the new number (at once when it shrinks
to a divisor, or at the start of an epoch; a doubling waits at most one
step), and the learning rate the schedule rescaled is held back until then,
so that batch and learning rate change together. :attr:`ScheduleDriver.applied`
lists the changes as they took effect.

The libraries' learning-rate schedulers set each group's learning rate every
step; those of :data:`SCALABLE_SCHEDULERS` compute it from their base
learning rates (or from the group's current one), which are scaled with
each change, so the rescaling lasts. Others are refused before training.
"""

from typing import Any, Dict, Iterable, List, Mapping, Optional

from cockpit_gradnoise.schedule.batch_schedule import inner_optimizer

import torch

_LR = torch.optim.lr_scheduler
#: Learning-rate schedulers whose learning rates a change scales by scaling their base
#: learning rates: those computed from ``base_lrs`` (``LambdaLR``, every schedule of
#: transformers' ``get_scheduler`` but ``"reduce_lr_on_plateau"`` and ``"greedy"``) or chained on the
#: group's current learning rate; the cosine ones only without a floor (``eta_min=0``).
SCALABLE_SCHEDULERS = (_LR.LambdaLR, _LR.MultiplicativeLR, _LR.StepLR, _LR.MultiStepLR,
                       _LR.ConstantLR, _LR.LinearLR, _LR.ExponentialLR, _LR.PolynomialLR,
                       _LR.CosineAnnealingLR, _LR.CosineAnnealingWarmRestarts)


def torch_schedulers(schedulers: Iterable[Any]) -> List[Any]:
    """The torch schedulers, out of Accelerate's wrapper (its ``.scheduler``) where wrapped."""
    return [getattr(s, "scheduler", s) for s in schedulers if s is not None]


def check_schedulers(schedulers: Iterable[Any], where: str) -> None:
    """Refuse a learning-rate scheduler that would undo or distort the schedule's rescaling.

    Raises:
        ValueError: Naming the scheduler and what to use instead.
    """
    for scheduler in torch_schedulers(schedulers):
        floor = getattr(scheduler, "eta_min", 0)
        if isinstance(scheduler, SCALABLE_SCHEDULERS) and not floor:
            continue
        name = type(scheduler).__name__ + (f"(eta_min={floor})" if floor else "")
        raise ValueError(
            f"{where}: the learning-rate scheduler {name} would not keep the rescaling of the "
            "learning rate a BatchSchedule makes when it changes the batch. Use one of "
            f"{', '.join(s.__name__ for s in SCALABLE_SCHEDULERS)} (the cosine ones with "
            "eta_min=0; a floor can be a LambdaLR), or BatchSchedule(rule=None) to leave the "
            "learning rate to the scheduler")


class ScheduleDriver:
    """Applies a :class:`~cockpit_gradnoise.BatchSchedule`'s accumulation and learning rate to a library.

    Args:
        schedule: The schedule; its :attr:`accumulation` is that of the first step.

    Attributes:
        accumulation: The micro-batches per optimizer step in effect in the library.
        applied: One dict per change as it took effect: ``step`` (the first optimizer
            step with it), ``accumulation``, ``lr_factor`` (the learning rate's, 1.0
            when unchanged) and ``decided`` (the step of the schedule's change).
    """

    def __init__(self, schedule):
        for name in ("accumulation", "changes", "update", "state_dict", "load_state_dict"):
            if not hasattr(schedule, name):
                raise TypeError(f"schedule= takes a cgn.BatchSchedule, got {type(schedule).__name__}")
        self.schedule = schedule
        self.accumulation = int(schedule.accumulation)
        self.applied: List[Dict[str, Any]] = []
        self._held = 1.0  # the learning-rate factor of changes not in effect yet
        self._decided: Optional[int] = None  # the step of the oldest change not in effect

    def check(self, schedulers: Iterable[Any], where: str) -> None:
        """Before training: refuse schedulers that would undo the learning rate's rescaling
        (:func:`check_schedulers`), unless the schedule leaves the learning rate alone."""
        if getattr(self.schedule, "rule", "auto") is not None:
            check_schedulers(schedulers, where)

    def after_step(self, step: int, tracker, optimizer, schedulers: Iterable[Any],
                   position: int) -> int:
        """After optimizer step ``step``: update the schedule and apply what can be applied.

        Args:
            step: The optimizer step just taken (the tracker's step).
            tracker: The :class:`~cockpit_gradnoise.Tracker` the schedule reads.
            optimizer: The optimizer whose learning rates the schedule rescales.
            schedulers: The learning-rate schedulers of ``optimizer``.
            position: The micro-batches done in the current epoch (0 at its end).

        Returns:
            The micro-batches of the next optimizer step (:attr:`accumulation`).
        """
        groups = inner_optimizer(optimizer).param_groups
        before = [_copy(group["lr"]) for group in groups]
        known = len(self.schedule.changes)
        self.schedule.update(step, tracker, optimizer)
        factor = 1.0
        for change in self.schedule.changes[known:]:
            factor *= change["lr_factor"]
            self._decided = change["step"] if self._decided is None else self._decided
        wanted = int(self.schedule.accumulation)
        if wanted != self.accumulation and position % wanted:  # not from here: held back
            for group, lr in zip(groups, before):
                _set(group, lr)
            self._held *= factor
            return self.accumulation
        factor *= self._held
        if self._held != 1.0:
            _scale(groups, self._held)
        if factor != 1.0:
            for scheduler in torch_schedulers(schedulers):  # their next learning rates keep the rescaling
                scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
                scheduler._last_lr = [float(group["lr"]) for group in groups]  # as logged
            _scale_initial(groups, factor)
        if wanted != self.accumulation or factor != 1.0:
            self.applied.append({"step": step + 1, "accumulation": wanted, "lr_factor": factor,
                                 "decided": self._decided})
        self.accumulation, self._held, self._decided = wanted, 1.0, None
        return wanted

    def state_dict(self) -> Dict[str, Any]:
        """The schedule's state and what is in effect, for the library's checkpoint."""
        return {"schedule": self.schedule.state_dict(), "accumulation": self.accumulation,
                "applied": [dict(a) for a in self.applied], "held": self._held,
                "decided": self._decided}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (the learning rates come with the optimizer's state)."""
        self.schedule.load_state_dict(state["schedule"])
        self.accumulation = int(state["accumulation"])
        self.applied = [dict(a) for a in state["applied"]]
        self._held, self._decided = float(state["held"]), state["decided"]


def _copy(lr):
    return lr.clone() if isinstance(lr, torch.Tensor) else lr


def _set(group, lr) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].copy_(lr)  # a tensor lr (capturable Adam) is kept in place
    else:
        group["lr"] = lr


def _scale(groups, factor: float) -> None:
    for group in groups:
        _set(group, group["lr"] * factor)


def _scale_initial(groups, factor: float) -> None:
    """The groups' ``initial_lr`` (a scheduler built again from them starts from the scaled ones)."""
    for group in groups:
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * factor
