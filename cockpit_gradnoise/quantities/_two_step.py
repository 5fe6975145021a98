"""The two-step quantity's base: compare the parameters at a start step with the next."""

from typing import Any, Optional

from cockpit_gradnoise import distributed
from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.quantities._named import NamedQuantity
from cockpit_gradnoise.step import Step, backward_failed

import_cockpit()
from cockpit.quantities.quantity import Quantity  # noqa: E402


class TwoStepParameterQuantity(NamedQuantity, Quantity):
    """A quantity that compares the parameters at a start step ``s`` with step ``s + 1``.

    At a step the schedule selects, :meth:`start` caches what it needs; at the
    next call of the cockpit, if that call is step ``s + 1``, :meth:`end`
    measures against the cache and the result is stored under ``s``.
    Otherwise (a start without an end, an end without a tracked start, a
    schedule that skips steps, a loop that calls the cockpit every other
    step) nothing is stored for ``s`` and the cache is dropped at the next
    call, so nothing wrong is stored and nothing is kept behind. A step whose
    backward pass raised computes nothing and keeps the cache as it was. A
    start step not after the last step recorded (steps that restart every
    epoch) starts nothing, with one warning: a record is never overwritten.
    Under gradient accumulation only the last micro-batch of a step ends or
    starts (the parameters are those of the step at every micro-batch).

    Methods to implement:

    - ``start(params, reuse)``: the cache for this step; ``reuse`` is the
      previous cache (or ``None``), whose memory may be reused;
    - ``end(cache, params, names)``: the value to store (may overwrite
      ``cache``, which is reused or dropped right after).
    - ``cache_matches(cache, params)`` (optional): whether ``cache`` fits
      ``params``; when it does not, nothing is stored.

    Args:
        track_schedule: Function from step to bool: the start steps ``s``.
        param_names: The model (names by identity), a mapping
            ``{name: parameter}``, or the Cockpit's parameters' names in order.
        verbose: Print what is computed.
    """

    #: Exact under FSDP2 (``fully_shard``); else FSDP2 is refused.
    supports_fsdp2: bool = False
    #: Exact under HSDP (FSDP2 on a replicate x shard mesh); else refused there.
    supports_hsdp: bool = False
    #: Exact under tensor parallelism; else it is refused.
    supports_tensor_parallel: bool = False
    #: Exact under FSDP2 over tensor parallelism (a ``("dp", "tp")`` mesh); else it is refused.
    supports_fsdp2_tensor_parallel: bool = False

    def __init__(self, track_schedule, *, param_names=None, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._init_names(param_names)
        self._cache_step: Optional[int] = None
        self._cache: Any = None

    def start(self, params, reuse) -> Any:
        """Cache what :meth:`end` needs at the next step."""
        raise NotImplementedError

    def end(self, cache, params, names) -> Any:
        """The value to store under the start step."""
        raise NotImplementedError

    def cache_matches(self, cache, params) -> bool:
        """Whether ``cache`` was taken from parameters like ``params``."""
        return True

    def state_dict(self):
        """As the base's, with the start step cached and its cache (:meth:`cache_state`)."""
        cache = None if self._cache_step is None else self.cache_state(self._cache)
        return {**super().state_dict(), "cache_step": self._cache_step, "cache": cache}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._cache_step = state["cache_step"]
        self._cache = None if self._cache_step is None else self.cache_from_state(state["cache"])

    def cache_state(self, cache) -> Any:
        """``cache`` as a checkpoint keeps it (a copy: the cache is reused in place)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to save its cache")

    def cache_from_state(self, state) -> Any:
        """The cache from what :meth:`cache_state` gave."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to load its cache")

    def extensions(self, global_step):
        """No BackPACK extension."""
        return []

    def protected_savefields(self, global_step):
        """Nothing to protect; the call's step is checked here, before the backward pass."""
        self.check_call(global_step)
        return set()

    def should_compute(self, global_step):
        # Also run at the call after a start, to use or drop the cache.
        return bool(self._track_schedule(global_step)) or self._cache_step is not None

    def compute(self, global_step, params, batch_loss):
        """End the cached start if this is its next step, then start if scheduled.

        Returns:
            ``(s, value)`` when the cache holds step ``s = global_step - 1``,
            else ``(global_step, None)`` (nothing stored).
        """
        if backward_failed():
            return global_step, None
        micro = Step.of(self, global_step).micro_batch()  # one instance per cockpit call
        if micro is not None and not micro.last:
            return global_step, None  # the parameters change after the last micro-batch only
        names = self.names(params)
        # Parameters are the same on every process (DDP): nothing to reduce.
        distributed.check_not_sharded(params, fsdp2=self.supports_fsdp2,
                                      tensor_parallel=self.supports_tensor_parallel,
                                      fsdp2_tensor_parallel=self.supports_fsdp2_tensor_parallel,
                                      hsdp=self.supports_hsdp, quantity=type(self).__name__)
        start, cache = self._cache_step, self._cache
        self._cache_step, self._cache = None, None
        value = None
        if start == global_step - 1 and self.cache_matches(cache, params):
            value = self.end(cache, params, names)
        # Records are stored under start steps: one at a step not after the last
        # record could overwrite it (see NamedQuantity.repeats).
        if self._track_schedule(global_step) and not self.repeats(global_step):
            self._cache_step, self._cache = global_step, self.start(params, cache)
        return (start, value) if value is not None else (global_step, None)

    def _save(self, global_step, result):
        self.output[int(global_step)] = result  # a NumPy integer's under its int (step_number)
        self._record(int(global_step))
