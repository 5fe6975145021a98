"""Which forward passes the hooks record: the tracker arms them for tracked steps only.

The package's hooks record a forward pass for BackPACK's extensions: each
hooked module's inputs and a tensor hook on its output, and in the backward
pass a Python call per module (:mod:`cockpit_gradnoise.extensions.hooks`).
On a step at which no quantity needs per-example results that is all
wasted: it cost 1.01-1.7x a plain step (issue 21). The forward pass comes
before ``with tracker(step, losses)``, so the hooks must know beforehand
whether the backward pass to come is tracked. The tracker tells them, through
the model's :class:`~cockpit_gradnoise.extensions.hooks.Switch`, which parks
the hooks (out of the modules' hook tables) while it is off:

- at its call for step ``s`` (after that step's forward pass), it arms the
  hooks if ``s`` or ``s + 1`` needs BackPACK's extensions: ``s`` again is
  the next micro-batch of an accumulated step, ``s + 1`` the next step;
- after ``optimizer.step()`` of the optimizer given to that call (a step
  post hook), step ``s`` is over: it arms them if ``s + 1`` needs them;
- :meth:`Tracker.arm(step) <cockpit_gradnoise.Tracker.arm>` arms them for
  ``step`` explicitly, for loops whose step numbers are not consecutive.

Before the first call the hooks are armed. A step needs the extensions if
Cockpit would enter BackPACK's context for it (a quantity's ``extensions``):
UpdateSize's end step reads the parameters only, and is not armed for.

If a step that needs the extensions comes after a forward pass that the
hooks did not record (the step numbers jumped past what was armed), the
tracker refuses it with the fix, before anything is computed: its numbers
would be missing, never wrong.
"""

import functools
import weakref
from typing import Optional

from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.extensions.hooks import Switch

import_cockpit()
from cockpit.quantities.quantity import Quantity  # noqa: E402


class Arming:
    """What a :class:`~cockpit_gradnoise.Tracker` tells the hooks of its model.

    Args:
        cockpit: The tracker's ``Cockpit`` (its quantities decide what a step needs).
        switch: The model's switch, or ``None`` (a model without it: nothing to arm).
    """

    def __init__(self, cockpit, switch: Optional[Switch]):
        self.cockpit, self.switch = cockpit, switch
        self.last_step: Optional[int] = None  # of the tracker's last call
        self._watched = weakref.WeakKeyDictionary()  # optimizer -> its step post hook's handle
        # needs(last_step + 1), as the last call found it: the optimizer's step hook reuses it
        # (each Python call on an untracked step costs, with caches cold from the layers' work).
        self._next_needed: Optional[bool] = None

    def needs(self, step: int) -> bool:
        """Whether ``step``'s backward pass runs BackPACK's extensions (so its forward
        pass must be recorded): whether Cockpit's ``_get_extensions(step)`` is not
        empty, without building its list."""
        return any(q.extensions(step) for q in self.cockpit.quantities)

    def arm(self, step: int) -> bool:
        """Set the hooks for the forward pass of ``step``; whether it is recorded."""
        needed = self.needs(step)
        if self.switch is not None:
            self.switch.armed, self.switch.step = needed, step
        return needed

    def at_call(self, step: int, optimizer=None, tracked: bool = True):
        """At the tracker's call for ``step``: refuse it if it needs the extensions and
        its forward pass went unrecorded; then arm the hooks for what may come next.

        ``tracked``: whether any quantity computes at ``step`` (if not, none needs
        the extensions).

        Raises:
            RuntimeError: Naming the fix, if the forward pass was not recorded.
        """
        switch = self.switch
        if switch is None:
            return
        needed = tracked and self.needs(step)
        if needed and switch.missed:
            raise RuntimeError(unrecorded_message(step, switch.step, self.last_step))
        self.last_step, self._next_needed = step, self.needs(step + 1)
        switch.armed, switch.step = needed or self._next_needed, step + 1
        if optimizer is not None and optimizer not in self._watched:
            self._watch(optimizer)

    def _watch(self, optimizer):
        """Arm for the next step after each ``optimizer.step()``. An optimizer without
        torch's step hooks (a wrapper) is left alone: the hooks stay armed as
        :meth:`at_call` left them, for ``s`` or ``s + 1``."""
        handle = None
        register = getattr(optimizer, "register_step_post_hook", None)
        try:
            if register is not None:
                # A weak reference: the optimizer does not keep the tracker alive.
                handle = register(functools.partial(_stepped, weakref.ref(self)))
        except (AttributeError, TypeError):  # a wrapper without torch's hook tables
            pass
        try:
            self._watched[optimizer] = handle  # tried once per optimizer
        except TypeError:  # not weakly referenceable: tried again at the next call
            pass

    def stepped(self):
        """After ``optimizer.step()``: the last call's step is over; arm for the next
        (as the last call found that step's needs)."""
        if self.last_step is not None and self.switch is not None:
            self.switch.armed, self.switch.step = self._next_needed, self.last_step + 1


def _stepped(arming: "weakref.ref[Arming]", optimizer, args, kwargs):
    """The optimizer's step post hook (a module-level function: no cycle through it)."""
    alive = arming()
    if alive is not None:
        alive.stepped()


def unrecorded_message(step: int, armed_for: Optional[int], last_call: Optional[int]) -> str:
    """The error of a tracked step whose forward pass the hooks did not record."""
    after = "" if last_call is None else f" after the tracker's call for step {last_call}"
    return (
        f"step {step} is tracked, but its forward pass was not recorded: the hooks were "
        f"idle{after}, set for step {armed_for}, at which no quantity needs per-example "
        "results. When steps are not numbered consecutively, call tracker.arm(step) before "
        "each step's forward pass (and give the tracker optimizer= so it knows when a step "
        "ends)."
    )


def idle_step(cockpit, tracked: bool) -> bool:
    """Whether a call may skip Cockpit's context altogether: no quantity computes at this
    step (``tracked`` is ``False``) and each uses Cockpit's own ``track``, which does
    nothing then (Cockpit's ``GradHist1d`` adapts its range on a schedule of its own),
    or declares that its own does nothing then (``idle_when_untracked``:
    :class:`~cockpit_gradnoise.TwoBatchNoiseScale`)."""
    return not tracked and all(type(q).track is Quantity.track or getattr(q, "idle_when_untracked", False)
                               for q in cockpit.quantities)
