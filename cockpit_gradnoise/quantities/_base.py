"""The base class of every per-parameter quantity in this package."""

import math
import warnings
from typing import Any, Dict, List, Sequence

import torch

from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.frame import encode_statistics

import_cockpit()
from cockpit.context import CockpitCTX  # noqa: E402
from cockpit.quantities.quantity import SingleStepQuantity  # noqa: E402

NETWORK = "all"
"""Name under which every quantity reports the whole network."""


class ParameterQuantity(SingleStepQuantity):
    """A Cockpit quantity that reports statistics per parameter and for ``"all"``.

    A subclass sets :attr:`extension_classes` (the BackPACK extensions whose
    results it reads, if any) and implements three small methods; the base
    class does the rest: scheduling, names, skipping parameters that have no
    result (frozen, unused, or in a layer BackPACK does not support) with one
    warning, NaN results with one warning when a gradient is not finite,
    a clear error when the model was not extended, and storing plain,
    JSON-safe numbers.

    Subclass interface:

    - ``parameter_value(param, context)``: reduce what BackPACK left on one
      parameter to what :meth:`statistics` needs (tensors, kept small).
    - ``network_value(values)``: combine the values of all parameters into the
      value of the whole network.
    - ``statistics(value)``: ``{statistic name: float}``.
    - optionally ``prepare(global_step, params)``: read ``info`` once per step
      and return a context passed to ``parameter_value``, or ``None`` to
      record nothing at this step.

    Results are stored per step as ``{param name: {statistic: value}}``, with
    non-finite values encoded as strings (``"nan"``, ``"inf"``, ``"-inf"``) so
    that ``Cockpit.write`` can save them; :func:`cockpit_gradnoise.to_frame`
    decodes them.

    Args:
        track_schedule: Function from step to bool, e.g.
            ``cockpit.utils.schedules.linear(10)``.
        param_names: Names of the parameters handed to the ``Cockpit``, in the
            same order, e.g. ``[n for n, _ in model.named_parameters()]``.
            Defaults to ``"param0"``, ``"param1"``, ...
        verbose: Print what is computed at each step.
    """

    #: BackPACK extension classes whose savefields ``parameter_value`` reads.
    extension_classes: Sequence[type] = ()

    def __init__(self, track_schedule, *, param_names=None, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._param_names = None if param_names is None else list(param_names)
        if self._param_names is not None and len(set(self._param_names)) != len(
            self._param_names
        ):
            raise ValueError("param_names must be unique")
        if NETWORK in (self._param_names or []):
            raise ValueError(f"{NETWORK!r} is reserved for the whole network")
        self._warned = set()
        # BackPACK extensions keep no state between backward passes: build them
        # once (building one costs ~0.05 ms, and Cockpit asks twice a step).
        self._extensions = tuple(cls() for cls in self.extension_classes)
        self._savefields = tuple(ext.savefield for ext in self._extensions)

    # Interface for subclasses ---------------------------------------------------

    def prepare(self, global_step: int, params: List[torch.Tensor]) -> Any:
        """Read step information (``info``) once; ``None`` skips the step."""
        return True

    def parameter_value(self, param: torch.Tensor, context: Any) -> Any:
        """Reduce one parameter's BackPACK results to what ``statistics`` needs."""
        raise NotImplementedError

    def network_value(self, values: List[Any]) -> Any:
        """Combine the values of all parameters into the network's value."""
        raise NotImplementedError

    def statistics(self, value: Any) -> Dict[str, float]:
        """Turn a parameter's (or the network's) value into named numbers."""
        raise NotImplementedError

    def statistic_names(self) -> List[str]:
        """Names reported as NaN when a parameter's gradient is not finite."""
        raise NotImplementedError

    # Helpers for subclasses -----------------------------------------------------

    def info(self, global_step: int, key: str) -> Any:
        """Return ``info[key]`` as handed to ``cockpit(step, info=...)``.

        Raises:
            KeyError: Naming the missing key and how to pass it.
        """
        try:
            return CockpitCTX.INFO[global_step][key]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__} needs info[{key!r}]: pass it as "
                f"`with cockpit(step, info={{{key!r}: ..., ...}})`"
            ) from None

    def warn_once(self, key: str, message: str):
        """Warn with ``message`` the first time ``key`` is seen by this quantity."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)

    # Cockpit interface ----------------------------------------------------------

    def extensions(self, global_step):
        """BackPACK extensions to run at ``global_step`` (none if not tracked)."""
        if not self.should_compute(global_step):
            return []
        return list(self._extensions)

    def protected_savefields(self, global_step):
        """Only ``grad_batch``, which Cockpit deletes during the backward pass.

        Cockpit frees every other savefield after every quantity has read it;
        protected, one would stay on the parameters (as large as the gradient,
        or larger) until the next tracked step.
        """
        if not self.should_compute(global_step):
            return set()
        return {field for field in self._savefields if field == "grad_batch"}

    def names(self, params) -> List[str]:
        """Names of ``params``, from ``param_names`` or ``param0, param1, ...``."""
        if self._param_names is None:
            return [f"param{i}" for i in range(len(params))]
        if len(self._param_names) != len(params):
            raise ValueError(
                f"{type(self).__name__} got {len(self._param_names)} param_names for "
                f"{len(params)} parameters: pass the names of exactly the parameters "
                "given to the Cockpit, in the same order"
            )
        return self._param_names

    def _compute(self, global_step, params, batch_loss):
        names = self.names(params)
        # Only per-example results (BackPACK's) are rank-local; param.grad is not.
        if self._savefields and _distributed_world_size() > 1:
            self.warn_once(
                "distributed",
                "BackPACK's per-example results cover only this process's batch "
                "while param.grad is averaged across processes: per-example "
                "statistics are those of the local batch, and statistics that "
                "combine both with param.grad are not valid; track on one process",
            )
        context = self.prepare(global_step, params)
        if context is None:
            return None
        usable = self._usable_parameters(names, params)
        result, values, non_finite = {}, [], []
        for name, param in usable:
            if self._is_finite(param):
                value = self.parameter_value(param, context)
                values.append(value)
                result[name] = self.statistics(value)
            else:
                non_finite.append(name)
                result[name] = dict.fromkeys(self.statistic_names(), math.nan)
        if non_finite:
            self.warn_once(
                "non-finite",
                f"gradient has NaN or Inf in {non_finite} at step {global_step}; "
                "their statistics and the network's are NaN at such steps",
            )
            result[NETWORK] = dict.fromkeys(self.statistic_names(), math.nan)
        elif values:
            network = self.network_value(values)
            del values  # free the parameters' values before the network's statistics
            result[NETWORK] = self.statistics(network)
        return {name: encode_statistics(stats) for name, stats in result.items()}

    def _save(self, global_step, result):
        # Our results are plain dicts of floats and strings: no tensor
        # conversion needed, and Cockpit's formatter would reject the strings.
        self.output[global_step] = result

    def _usable_parameters(self, names, params):
        """``(name, param)`` pairs that have every result needed; warn about the rest."""
        trainable = [(n, p) for n, p in zip(names, params) if p.requires_grad]
        no_grad = [n for n, p in trainable if p.grad is None]
        with_grad = [(n, p) for n, p in trainable if p.grad is not None]
        usable = [
            (n, p)
            for n, p in with_grad
            if all(hasattr(p, field) for field in self._savefields)
        ]
        usable_names = {n for n, _ in usable}
        unsupported = [n for n, _ in with_grad if n not in usable_names]
        if with_grad and not usable:
            raise RuntimeError(
                f"{type(self).__name__}: no parameter received BackPACK's results "
                f"({', '.join(self._savefields)}). Extend the model and the loss "
                "function with `backpack.extend(model)` and `backpack.extend(loss_fn)` "
                "before training, and make sure the model has layers BackPACK "
                "supports (Linear, Conv, BatchNorm, Embedding, RNN, LSTM). Cockpit keys "
                "results by class name: track one instance of each quantity class."
            )
        if no_grad:
            self.warn_once(
                "no-grad",
                f"parameters {no_grad} have no gradient (unused in the forward pass?); "
                f"they have no rows and are left out of {NETWORK!r}",
            )
        if unsupported:
            self.warn_once(
                "unsupported",
                f"parameters {unsupported} belong to layers BackPACK does not support; "
                f"they have no rows and are left out of {NETWORK!r}",
            )
        return usable

    def _is_finite(self, param) -> bool:
        tensors = [param.grad] + [getattr(param, field) for field in self._savefields]
        # NaN and inf propagate into a sum, so a finite sum proves every element
        # finite with one reduction; only a sum that overflowed needs the full test.
        return all(
            bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in tensors
        )


def _distributed_world_size() -> int:
    """Number of processes in the default group, 1 outside distributed training."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1
