"""Loss scaling (``torch.amp.GradScaler``): statistics of the unscaled gradients, skipped steps recorded.

With a ``GradScaler`` the backward pass differentiates ``s * loss``
(``scaler.scale(loss).backward()``), so ``param.grad`` and every per-example
result are ``s`` times (squares ``s**2`` times) those of the unscaled loss;
a step whose scaled gradients overflow (an inf or NaN) is skipped by
``scaler.step(optimizer)``, and ``scaler.update()`` lowers ``s``. Give the
scaler to the tracker::

    with tracker(step, losses, optimizer=opt, scaler=scaler) as loss:
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

At a tracked step, when the ``with`` block ends (:class:`ScaledStep`):

- ``s`` is ``scaler.get_scale()``, the scale ``scaler.scale(loss)`` used (the
  scaler changes it only in ``update()``, after the block);
- if a gradient of the tracked parameters is not finite, the scaler skips
  the step: the quantities compute nothing (no rows, no NaN), and the log
  gets a row ``GradScaler / all / skipped = 1`` with the ``scale`` at that
  step (:data:`QUANTITY`); ``cgn.to_frame`` shows it like any quantity, and
  the report counts the skipped steps;
- otherwise, while the quantities compute, ``param.grad`` is replaced by
  ``param.grad / s`` (a new tensor; the scaler's own is put back after, so
  ``scaler.step`` unscales it as usual), and the package's savefields are
  divided by ``s`` (``sum_i x_i``, ``cgn_local_grad``) and ``s**2`` (sums of
  squares, per-example squared norms): every statistic is that of the
  unscaled loss, up to one rounding of the division (none for the scaler's
  default powers of two), and the log gets ``GradScaler / all / skipped = 0``
  with the ``scale``.

The gradient that reaches the loss is checked against ``s``: ``1`` while
``s != 1`` means the block called ``loss.backward()`` instead of
``scaler.scale(loss).backward()``, and raises. Call ``scaler.unscale_``
(for clipping) after the block, not inside it. Cockpit's own quantities, if
you add them, see the scaled gradients.
"""

import weakref
from typing import Dict, List, Optional

from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.logs.schema import GRAD_SCALER, LOSS_SCALE, NETWORK, SKIPPED
from cockpit_gradnoise.step_checks import version_of

import torch
from torch import Tensor

#: The name the scaler's rows are logged under (param ``"all"``: ``scale``, ``skipped``).
QUANTITY = GRAD_SCALER
_SAVEFIELDS = (SUMS_SAVEFIELD, BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)


def unscaled_savefield(field: str, value: Tensor, scale: float) -> Tensor:
    """A package savefield of the loss ``s * loss`` as it is for ``loss``: divided by
    ``s`` (sums of contributions) or ``s**2`` (their squares)."""
    if field == SUMS_SAVEFIELD:  # [sum_i x_i, sum_i x_i**2] (and R, a sum of squares)
        powers = [scale] + [scale**2] * (len(value) - 1)
        powers = torch.tensor(powers, dtype=value.dtype, device=value.device)
        return value / powers.reshape(len(value), *[1] * (value.dim() - 1))
    if field == BATCH_L2_SAVEFIELD:
        return value / scale**2
    return value / scale  # LOCAL_GRADIENT_SAVEFIELD


class ScaledStep:
    """A tracked step's loss scale: checked, divided out while the quantities compute, logged.

    Args:
        scaler: A ``torch.amp.GradScaler`` (or ``torch.cuda.amp.GradScaler``).
    """

    def __init__(self, scaler):
        if not (hasattr(scaler, "get_scale") and hasattr(scaler, "is_enabled")):
            raise TypeError(
                f"scaler= must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        self.scaler = scaler
        self.scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
        self.reached: Optional[Tensor] = None  # the gradient that reached the loss
        #: The loss differentiated when it was given already scaled (``loss_scaled=True``:
        #: ``s * loss``, as Lightning's ``on_before_backward`` hands it over); else ``None``.
        self.given: Optional[Tensor] = None
        self._originals: List = []

    def arrived(self, grad: Tensor):
        """The loss's hook: keep the gradient that reached it (``s`` after ``scaler.scale``)."""
        self.reached = grad.detach()

    def problem(self, step: int) -> Optional[str]:
        """An error message where the backward pass did not differentiate the scaled loss."""
        if self.scale != 1.0 and self.given is None and self.reached is not None and float(self.reached) == 1.0:
            return (
                f"step {step}: scaler= is given (scale {self.scale:g}) but the loss was "
                "differentiated unscaled: call scaler.scale(loss).backward() inside "
                "`with tracker(step, losses, scaler=scaler) as loss:`, or leave scaler= out"
            )
        return None

    def skipped(self, params) -> bool:
        """Whether a gradient is not finite: ``scaler.step`` will skip the optimizer's step."""
        grads = [p.grad for p in params if p.grad is not None]
        return bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def unscale(self, params, quantities=()):
        """Divide ``param.grad`` (replaced, kept for :meth:`restore`) and the savefields by ``s``.

        A ``param.grad`` that the quantities saw at their last tracked step, at the same
        version, is left from an earlier backward pass (the quantities leave it out, with a
        warning): it is kept as it is, so that they see it is the same tensor.
        """
        if self.scale == 1.0:
            return
        seen = [record for quantity in quantities
                for record in getattr(quantity, "seen_gradients", {}).values()]
        left = {(id(ref()), version) for ref, version in seen if ref() is not None}
        for param in params:
            for field in _SAVEFIELDS:
                if hasattr(param, field):
                    setattr(param, field, unscaled_savefield(field, getattr(param, field), self.scale))
            # The version as the quantities record it (a DTensor's with its shard's: FSDP2
            # accumulates into the shard in place, leaving the DTensor's own unmoved).
            if param.grad is not None and (id(param.grad), version_of(param.grad)) not in left:
                original = param.grad
                param.grad = original / self.scale
                self._originals.append((param, original, param.grad))

    def restore(self, quantities):
        """Put the scaler's ``param.grad`` back, and let the quantities' record of the
        gradients they saw (to tell a gradient left from an earlier step) name it."""
        # The copies stay alive (in _originals) until the records name the originals.
        copies: Dict[int, Tensor] = {id(copy): original for _, original, copy in self._originals}
        for param, original, _ in self._originals:
            param.grad = original
        for quantity in quantities:
            seen = getattr(quantity, "seen_gradients", None)
            for name, (ref, _) in list((seen or {}).items()):
                original = copies.get(id(ref())) if ref() is not None else None
                if original is not None:
                    seen[name] = (weakref.ref(original), version_of(original))
        self._originals = []

    def record(self, cockpit, step: int, skipped: bool):
        """Log ``GradScaler / all / {scale, skipped}`` at ``step`` (Cockpit's own output,
        which its ``get_output``, the package's logs and ``to_frame`` read)."""
        cockpit.output[step][QUANTITY] = {NETWORK: {LOSS_SCALE: self.scale, SKIPPED: float(skipped)}}

    @staticmethod
    def discard(params):
        """Free the package's savefields of a skipped step (nothing reads them)."""
        for param in params:
            for field in _SAVEFIELDS:
                if hasattr(param, field):
                    delattr(param, field)
