"""What both quantity bases share: the parameters' names, the call's step checked, one-time warnings."""

import warnings
from typing import Any, Dict, List, Mapping, Optional

from cockpit_gradnoise.step import Step
from cockpit_gradnoise.step_checks import check_call, check_names, parameter_names, repeated_step_message

import torch


class NamedQuantity:
    """Parameter names and one-time warnings, shared by both bases.

    Attributes:
        warned: The keys of the warnings this quantity was told (by
            :meth:`warn_once` or its step's :meth:`~cockpit_gradnoise.step.Step.warn`):
            each is told once per run.
    """

    def _init_names(self, param_names):
        self._param_names = check_names(param_names)
        self.warned = set()
        #: ``{name: (weak reference to .grad, its version)}`` at the last tracked step,
        #: to tell a gradient left from an earlier backward pass (Step.usable).
        self.seen_gradients = {}
        #: The last step a record was stored under (for a two-step quantity, the
        #: last start step, under which its record is stored); None before the first.
        self.last_recorded: Optional[int] = None
        #: The step of the current call if it repeats (see check_call), else None.
        self.skipped_step: Optional[int] = None
        #: The Cockpit's parameters, once known (the first tracked call, or the
        #: Tracker): checked before each tracked backward pass for gradients
        #: left from earlier ones (Step.check_earlier_gradients).
        self.known_params: Optional[List[torch.Tensor]] = None

    def repeats(self, global_step) -> bool:
        """Whether ``global_step`` is not after the last step recorded: its record would overwrite."""
        return self.last_recorded is not None and global_step <= self.last_recorded

    def check_call(self, global_step) -> bool:
        """Check the call's step (an int) before anything runs; whether the schedule selects it.

        At a step the schedule selects that :meth:`repeats`, warn (once for all
        quantities of the call, and once per run per quantity).

        Raises:
            TypeError: The step is not an int.
        """
        check_call(global_step)
        scheduled = bool(self._track_schedule(global_step))
        # Decided once per call: the record stored during the call must not make
        # the rest of it (Cockpit freeing the savefields) look like a repeat.
        self.skipped_step = global_step if scheduled and self.repeats(global_step) else None
        if self.skipped_step is not None:
            Step.begin(global_step).warn(
                "repeated-step", repeated_step_message(global_step, self.last_recorded), self
            )
        return scheduled

    def _record(self, global_step):
        if self.last_recorded is None or global_step > self.last_recorded:
            self.last_recorded = global_step

    def state_dict(self) -> Dict[str, Any]:
        """The running state a checkpoint keeps (torch's convention: plain numbers and lists).

        The last step recorded (a record is never overwritten after a resume)
        and the warnings told (each once per run, resumed or not); subclasses
        add theirs. :meth:`Tracker.state_dict <cockpit_gradnoise.Tracker.state_dict>`
        gathers every quantity's.
        """
        return {"last_recorded": self.last_recorded, "warned": sorted(self.warned)}

    def load_state_dict(self, state: Mapping[str, Any]):
        """Take back the running state of :meth:`state_dict`."""
        self.last_recorded = state["last_recorded"]
        self.warned = set(state["warned"])

    def names(self, params) -> List[str]:
        """Names of ``params``: by identity from the model, else from ``param_names``."""
        return parameter_names(self._param_names, params, type(self).__name__)

    def warn_once(self, key: str, message: str):
        """Warn with ``message`` the first time ``key`` is seen by this quantity."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)
