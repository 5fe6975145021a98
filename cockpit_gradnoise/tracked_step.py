"""What ``with tracker(step, losses)`` enters: :class:`TrackedStep` at a tracked step, :class:`IdleStep` at others.

Both check on the way out that the loss they gave was differentiated. A
tracked step begins the call's :class:`~cockpit_gradnoise.step.Step` with
the batch the tracker declared, enters Cockpit's context and, where a
``GradScaler`` scaled the loss, lets the quantities compute on the unscaled
gradients (:mod:`cockpit_gradnoise.amp`).
"""

from typing import Callable, Optional

from cockpit_gradnoise import accumulation, amp
from cockpit_gradnoise.logs.schema import NETWORK, OPTIMIZER, optimizer_statistics
from cockpit_gradnoise.step import Step

import torch
from backpack import disable
from cockpit import Cockpit as BaseCockpit
from cockpit.context import CockpitCTX


class Cockpit(BaseCockpit):
    """The tracker's ``Cockpit``: Cockpit's, but for how it frees BackPACK's buffers.

    Named as Cockpit's own: what names it (a report's header, ``cgn.report(tracker.cockpit)``)
    names it as before; ``isinstance(tracker.cockpit, cockpit.Cockpit)`` holds.

    After every tracked backward pass Cockpit deletes each savefield of the step's
    extensions (and ``grad_batch_transforms``) from every parameter, by trying and
    catching the ``AttributeError`` of each absent one: 49 exceptions per micro-batch on
    the benchmark GPT with the ``"norms"`` preset, which leaves nothing there.
    :meth:`_free_backpack_buffers` deletes the same attributes, only those present.
    """

    def _free_backpack_buffers(self, global_step, protected_savefields, verbose=False):
        """Delete the unprotected savefields of ``global_step``'s extensions from the
        parameters that hold them (Cockpit's ``_free_backpack_buffers``, same arguments)."""
        fields = [ext.savefield for ext in self._get_extensions(global_step)] + ["grad_batch_transforms"]
        fields = [field for field in fields if field not in protected_savefields]
        for param in self.params:
            held = getattr(param, "__dict__", None)
            for field in fields:
                if held is None or field in held:  # no __dict__: tried as Cockpit does
                    try:
                        delattr(param, field)
                    except AttributeError:
                        continue
                    if verbose:
                        print(f"Deleting '{field}' from param of shape {param.shape}")


class TrackedStep:
    """What ``with tracker(step, losses)`` enters: Cockpit's context, checked on the way out.

    On the way out it checks that the loss it gave was differentiated
    (the gradient that reached it is ``1``, or the GradScaler's scale: not a
    multiple of it, as ``accelerator.backward`` under accumulation makes), and
    with the graph kept where Cockpit's ``create_graph`` asks for it, before
    the quantities compute; if the body raised, nothing is tracked at this
    step and the body's error is the one raised.
    """

    def __init__(self, cockpit: Cockpit, step: int, info: dict, after: Optional[Callable] = None,
                 scaled: Optional[amp.ScaledStep] = None, declared: Optional[tuple] = None):
        self.cockpit, self.step, self.info, self.after = cockpit, step, info, after
        self.scaled = scaled  # the loss scale of a GradScaler, at a tracked step
        # (Batch, whether its losses are finite) of losses.declared_batch, at a tracked step.
        self.declared = declared
        self._backward_reached_loss = self._computed = False
        self._context = self._hook = None
        self._reached_grad: Optional[torch.Tensor] = None  # the gradient that reached the loss

    def __enter__(self) -> torch.Tensor:
        loss = self.info["loss"] if self.scaled is None or self.scaled.given is None else self.scaled.given
        self._hook = loss.register_hook(self._reached)
        if self.declared is not None:  # before Cockpit asks the quantities (Step.begin)
            batch, finite = self.declared
            Step.begin(self.step, batch=batch, losses_finite=finite)
        self._context = self.cockpit(self.step, info=self.info)
        self._context.__enter__()
        return loss

    def _reached(self, grad):
        self._backward_reached_loss = True
        self._reached_grad = grad.detach()
        if self.scaled is not None:
            self.scaled.arrived(grad)

    def __exit__(self, kind, error, traceback):
        self._hook.remove()
        problem = None if kind is not None else self._problem()
        if kind is None and problem is None:
            if self.scaled is not None and self.scaled.skipped(self.cockpit.params):
                self._leave(None, None, None)  # the scaler skips this step: no rows
                self.scaled.discard(self.cockpit.params)
                for quantity in self.cockpit.quantities:  # its micro-batches so far: dropped
                    getattr(quantity, "forget_step", lambda step: None)(self.step)
            else:
                self._compute()
            if self.scaled is not None:
                self.scaled.record(self.cockpit, self.step, skipped=not self._computed)
            if any(self.step in quantity.output for quantity in self.cockpit.quantities) or self._scheduled():
                # Not at a step only a two-step quantity ends (it stores under its start).
                record_optimizer(self.cockpit, self.step, self.info.get("optimizer"))
            if self.after is not None:
                self.after()  # the tracker's loggers and stream
            return False
        self._leave(kind, error, traceback)
        if problem is not None:
            raise RuntimeError(problem)
        return False

    def _scheduled(self) -> bool:
        """Whether this call computed the step's last micro-batch and a quantity's own schedule
        tracks the step: its optimizer is logged even where none recorded a row (a noise scale
        from one small batch), so that a quantity on a sparser cadence loses no step's ``lr``."""
        micro, count = self.info.get(accumulation.MICRO_BATCH), self.info.get(accumulation.MICRO_BATCHES)
        return self._computed and (micro is None or micro == count - 1) and any(
            getattr(quantity, "_track_schedule", lambda step: False)(self.step)
            for quantity in self.cockpit.quantities)

    def _compute(self):
        """The quantities compute, of the unscaled loss where a GradScaler scaled it."""
        if self.scaled is None:
            self._context.__exit__(None, None, None)
        else:
            self.scaled.unscale(self.cockpit.params, self.cockpit.quantities)
            try:
                self._context.__exit__(None, None, None)
            finally:
                self.scaled.restore(self.cockpit.quantities)
        self._computed = True

    def _leave(self, kind, error, traceback):
        """Leave BackPACK's context without tracking: nothing of this step is recorded."""
        for context in self._context.contexts:
            context.__exit__(kind, error, traceback)
        CockpitCTX.erase()

    def _problem(self) -> Optional[str]:
        if not self._backward_reached_loss:
            return not_differentiated(self.step)
        if self.scaled is not None and self.scaled.problem(self.step):
            return self.scaled.problem(self.step)
        expected = 1.0 if self.scaled is None or self.scaled.given is not None else self.scaled.scale
        if self._reached_grad is not None and not differentiated_once(self._reached_grad, expected):
            return scaled_again(self.step, float(self._reached_grad) / expected)
        if self.cockpit.create_graph(self.step) and not any(
            p.grad is not None and p.grad.requires_grad for p in self.cockpit.params
        ):
            return (
                f"step {self.step}: a quantity needs the graph: call "
                "loss.backward(create_graph=tracker.create_graph(step))"
            )
        return None


def differentiated_once(reached: torch.Tensor, expected: float) -> bool:
    """Whether the gradient that reached the tracker's loss is ``expected`` (``1``, or a
    GradScaler's scale), up to one rounding to the loss's dtype: the backward pass
    differentiated the loss the tracker gave, not a multiple of it."""
    tolerance = torch.finfo(reached.dtype).eps * abs(expected) if reached.is_floating_point() else 0.0
    return reached.numel() == 1 and abs(float(reached) - expected) <= tolerance


def scaled_again(step: int, factor: float) -> str:
    """The error of a block that differentiated ``factor`` times the tracker's loss."""
    return (
        f"step {step}: the backward pass differentiated {factor:.9g} times the loss the tracker "
        "gave, so every statistic would be off by that factor: call loss.backward() on the loss "
        "it gives. Accelerate's accelerator.backward(loss) divides the loss by its "
        "gradient_accumulation_steps, and the tracker's loss is already divided by "
        "micro_batches: inside `with accelerator.accumulate(model):` call loss.backward(). "
        "With a GradScaler, pass scaler= and call scaler.scale(loss).backward()"
    )


def record_optimizer(cockpit: Cockpit, step: int, optimizer) -> None:
    """Log ``Optimizer / all / {class:<name>, lr}`` at ``step``: what the advice reads to
    choose its learning-rate rule (:func:`~cockpit_gradnoise.logs.schema.optimizer_statistics`).

    ``lr`` is the first parameter group's; a wrapper (Lightning's ``LightningOptimizer``,
    Accelerate's ``AcceleratedOptimizer``) is named by the optimizer it wraps. Nothing is
    logged without an optimizer.
    """
    for _ in range(4):  # wrappers hold the optimizer as .optimizer (Accelerate's is an Optimizer too)
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    if optimizer is None:
        return
    groups = getattr(optimizer, "param_groups", None) or [{}]
    lr = groups[0].get("lr")
    try:
        lr = None if lr is None else float(lr)  # a tensor lr (capturable Adam) too
    except (TypeError, ValueError):
        lr = None
    cockpit.output[step][OPTIMIZER] = {NETWORK: optimizer_statistics(type(optimizer).__name__, lr)}


class IdleStep:
    """What ``with tracker(step, losses)`` enters at a step where no quantity computes.

    Only what Cockpit does then: ``backpack.disable()`` for the block; and, as
    at every step, the check on the way out that the loss it gave was
    differentiated. The fewest Python operations, for what they cost per
    untracked step (issue 21): a lean class, not Cockpit's context.
    """

    __slots__ = ("step", "info", "_arrived", "_store_io")

    def __init__(self, step: int, info: dict):
        self.step, self.info = step, info  # info: as a TrackedStep's
        self._arrived = []  # the loss's gradient, once the backward pass reaches it

    def __enter__(self) -> torch.Tensor:
        loss = self.info["loss"]
        # Left on the loss (it goes with the step): the hook holds only the list, no cycle.
        loss.register_hook(self._arrived.append)
        self._store_io, disable.store_io = disable.store_io, False  # backpack.disable().__enter__
        return loss

    def __exit__(self, kind, error, traceback):
        disable.store_io = self._store_io
        if kind is None and not self._arrived:
            raise RuntimeError(not_differentiated(self.step))
        return False


def not_differentiated(step: int) -> str:
    """The error of a ``with tracker(step, losses)`` block that did not differentiate its loss."""
    return (f"step {step}: call loss.backward() inside `with tracker(step, losses) as loss:`, "
            "on the loss it gives")
