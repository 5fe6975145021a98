"""The base classes of this package's quantities: single-step and two-step.

A single-step quantity (:class:`ParameterQuantity`) turns, at each tracked
step, what the backward pass left on every parameter into named statistics,
per parameter and for the whole network (``"all"``). Its maths is always

    per-parameter sums over the batch's examples  ->  per-parameter values
    ->  network value  ->  statistics

and the sums are declared (:attr:`ParameterQuantity.sums`), as torchmetrics
declares a metric's state with its reduction: they are what combines across
examples, micro-batches and processes. A two-step quantity
(:class:`TwoStepParameterQuantity`) compares the parameters at a start step
with the next step.
"""

import math
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, distributed, functional
from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.extensions import LOCAL_GRADIENT_SAVEFIELD, LocalGradient
from cockpit_gradnoise.extensions.facts import BACKWARD_FACTS
from cockpit_gradnoise.schema import (
    NETWORK,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    encode_statistics,
)

import torch

import_cockpit()
from cockpit.context import CockpitCTX  # noqa: E402
from cockpit.quantities.quantity import Quantity, SingleStepQuantity  # noqa: E402

#: How a declared sum combines across examples of several batches (or processes).
SUM = "sum"  # elementwise addition: sums over examples (tensors of any shape, or scalars)
CAT = "cat"  # concatenation along dimension 0: one row per example
REDUCTIONS = (SUM, CAT)

_REQUIRED_METHODS = ("network_value", "statistics", "statistic_names")


@dataclass(frozen=True)
class Batch:
    """The examples a quantity's declared sums are over.

    Attributes:
        examples: Their number ``N``.
        scale: The loss scale ``c`` with ``x_i = c g_i`` (contribution to
            ``param.grad`` = ``c`` times the gradient of the example's own
            loss): ``1/N`` for a mean, ``1`` for a sum (and for one example),
            NaN when the losses are not finite. Under distributed training
            the quantities divide their sums by it (sums of squares by its
            square), so that sums of different processes add, and get the
            global batch's ``N`` and ``c`` back (see ``docs/distributed.md``).
    """

    examples: int
    scale: float

    def same_as(self, other: "Batch") -> bool:
        """Equal, with a NaN scale equal to a NaN scale."""
        return self.examples == other.examples and (
            self.scale == other.scale or math.isnan(self.scale) and math.isnan(other.scale)
        )


class _NamedParameters:
    """Names of the parameters, ``info`` and one-time warnings, shared by both bases."""

    def _init_names(self, param_names):
        self._param_names = None if param_names is None else [str(n) for n in param_names]
        if self._param_names is not None and len(set(self._param_names)) != len(
            self._param_names
        ):
            raise ValueError("param_names must be unique")
        if NETWORK in (self._param_names or []):
            raise ValueError(f"{NETWORK!r} is reserved for the whole network")
        self._warned = set()

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

    def _check_one_instance_per_class(self, global_step, params):
        """Raise if another instance of this class computes in the same cockpit call.

        Cockpit keys results by class name, so the second would silently
        overwrite the first. Quantities of one cockpit call see the same
        ``CockpitCTX.INFO`` dict (replaced after every call) and ``params`` list.
        """
        call = (id(CockpitCTX.INFO), id(params), global_step)
        if _CURRENT_CALL.get("call") != call:
            _CURRENT_CALL.clear()
            _CURRENT_CALL.update(call=call, instances=weakref.WeakValueDictionary())
        other = _CURRENT_CALL["instances"].setdefault(type(self), self)
        if other is not self:
            raise RuntimeError(
                f"two {type(self).__name__} quantities in one Cockpit: Cockpit keys results "
                "by class name, so one would overwrite the other. Track one instance of "
                "each quantity class (one with all the quantiles you need, say)."
            )

    def warn_once(self, key: str, message: str):
        """Warn with ``message`` the first time ``key`` is seen by this quantity."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)


# The cockpit call being computed and the quantity instances computed in it, by class.
_CURRENT_CALL: Dict[str, Any] = {}

# The last loss tensors read by loss_batch (held weakly) and their Batch.
_LOSS_BATCH: Dict[str, Any] = {}


def _weak(key):
    loss, individual_losses, *versions = key
    return (weakref.ref(loss), weakref.ref(individual_losses), *versions)


def _same_tensors(weak_key, key) -> bool:
    loss, individual_losses, *versions = weak_key
    return (
        loss() is key[0] and individual_losses() is key[1] and list(versions) == list(key[2:])
    )


def backward_failed() -> bool:
    """Whether the cockpit's context is being left because of an exception.

    Cockpit runs its quantities in ``__exit__`` even when ``loss.backward()``
    raised; the exception is then the one being handled.
    """
    return sys.exc_info()[1] is not None


class ParameterQuantity(_NamedParameters, SingleStepQuantity):
    """A Cockpit quantity that reports statistics per parameter and for ``"all"``.

    A subclass declares what it reads and implements four methods; the base
    class does the rest: scheduling, names, skipping parameters that have no
    result (frozen, unused, or in a layer BackPACK does not support) with one
    warning, NaN results with one warning when a gradient is not finite, a
    clear error when the model was not extended, nothing at all for a step
    whose backward pass raised, and storing plain JSON-safe numbers (non-finite
    ones encoded as ``"nan"``, ``"inf"``, ``"-inf"``; :func:`~cockpit_gradnoise.to_frame`
    decodes them).

    Class attributes:

    - ``extension_classes``: the BackPACK extensions whose savefields it reads
      (none for a quantity that reads only ``param`` and ``param.grad``).
    - ``sums``: ``{name: reduction}``, the per-parameter sums over the batch's
      examples that its values are formed from, each combined across batches
      or processes by ``"sum"`` (add) or ``"cat"`` (one row per example,
      concatenated). Leave it empty for a quantity that reads only
      ``param`` and ``param.grad``, which are the same on every process.
      With sums, ``prepare`` returns a :class:`Batch`, and under distributed
      training ``parameter_sums`` returns them in per-example units (divided
      by ``batch.scale``, sums of squares by its square) so that the sums of
      the processes add; ``value_from_sums`` then gets the global batch.
    - ``reads_local_gradient``: whether ``parameter_sums`` reads this
      backward pass's gradient through :meth:`local_gradient` (under
      distributed training ``param.grad`` is averaged across processes, so
      the gradient is then requested from BackPACK).

    Methods to implement (checked when the class is defined):

    - ``parameter_value(param, context)`` (without declared sums), or
      ``parameter_sums(param, context)`` returning the declared sums and
      ``value_from_sums(sums, context)`` (with declared sums): the parameter's
      value, kept small (tensors or numbers);
    - ``network_value(values)``: the whole network's value from the
      parameters' values;
    - ``statistics(value)``: ``{statistic name: float}`` of one value; a
      number may be a 0-dim tensor left on the device: the base copies all
      of a step's to the host at once, at the end (on a GPU the host waits
      there only; see ``docs/quantities.md``), before ``derived_statistics``;
    - ``statistic_names()``: every name ``statistics`` or
      ``derived_statistics`` can return (a non-finite gradient gives NaN
      under each of them; a name that is not declared raises at the first
      tracked step).

    Optional hooks:

    - ``prepare(global_step, params)``: read ``info`` once per step and return
      the context passed to the methods above, or ``None`` to record nothing;
    - ``accepts(batch)`` (with declared sums): whether a batch defines the
      quantity (e.g. a variance needs two examples); under distributed
      training it is asked about the global batch;
    - ``derived_statistics(name, statistics)``: more statistics of one row
      (a parameter's or ``"all"``'s) computed from its others, e.g. moving
      averages over steps; called once per row and step, in order.

    When the network's row leaves out parameters (unused, or in layers without
    per-example support), it also holds ``params_covered`` and
    ``params_total``: how many of the given parameters (with
    ``requires_grad``) it covers.

    Args:
        track_schedule: Function from step to bool, e.g.
            ``cockpit.utils.schedules.linear(10)``.
        param_names: Names of the parameters handed to the ``Cockpit``, in the
            same order, e.g. ``[n for n, _ in model.named_parameters()]``.
            Defaults to ``"param0"``, ``"param1"``, ...
        verbose: Print what is computed at each step.
    """

    extension_classes: Sequence[type] = ()
    sums: Mapping[str, str] = {}
    reads_local_gradient: bool = False
    #: Added to the warning when examples interact (BatchNorm in training mode).
    interaction_caveat: str = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        bad = {name: how for name, how in cls.sums.items() if how not in REDUCTIONS}
        if bad:
            raise TypeError(f"{cls.__name__}.sums: reductions must be one of {REDUCTIONS}, got {bad}")
        required = list(_REQUIRED_METHODS)
        required += ["parameter_sums", "value_from_sums"] if cls.sums else ["parameter_value"]
        missing = [m for m in required if getattr(cls, m) is getattr(ParameterQuantity, m)]
        if missing:
            raise TypeError(
                f"{cls.__name__} must implement {', '.join(missing)} "
                "(see cockpit_gradnoise.ParameterQuantity)"
            )

    def __init__(self, track_schedule, *, param_names=None, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._init_names(param_names)
        # BackPACK extensions keep no state between backward passes: build them
        # once (building one costs ~0.05 ms, and Cockpit asks twice a step).
        self._extensions = tuple(cls() for cls in self.extension_classes)
        self._savefields = tuple(ext.savefield for ext in self._extensions)
        self._checked_names = False
        # Under distributed training (see _step_extensions).
        self._distributed_extensions = self._extensions + (
            (LocalGradient(),) if self.reads_local_gradient else ()
        )

    # Interface for subclasses ---------------------------------------------------

    def prepare(self, global_step: int, params: List[torch.Tensor]) -> Any:
        """Read step information (``info``) once; ``None`` skips the step."""
        return True

    def parameter_value(self, param: torch.Tensor, context: Any) -> Any:
        """Reduce one parameter's results to what ``statistics`` needs (no declared sums)."""
        raise NotImplementedError

    def parameter_sums(self, param: torch.Tensor, context: Any) -> Dict[str, torch.Tensor]:
        """The declared :attr:`sums` of one parameter over this batch's examples."""
        raise NotImplementedError

    def value_from_sums(self, sums: Dict[str, torch.Tensor], context: Any) -> Any:
        """One parameter's value from its declared sums."""
        raise NotImplementedError

    def accepts(self, batch: Batch) -> bool:
        """Whether ``batch`` defines the quantity (with declared sums); ``False`` records nothing."""
        return True

    def network_value(self, values: List[Any]) -> Any:
        """Combine the values of all parameters into the network's value."""
        raise NotImplementedError

    def statistics(self, value: Any) -> Dict[str, float]:
        """Turn a parameter's (or the network's) value into named numbers (or 0-dim tensors)."""
        raise NotImplementedError

    def statistic_names(self) -> List[str]:
        """Every statistic name this quantity reports (NaN when a gradient is not finite)."""
        raise NotImplementedError

    def statistics_of_values(
        self, values: List[Any], network: bool
    ) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
        """Statistics of each parameter's value and, if ``network``, of the network's.

        By default :meth:`statistics` of each value and of :meth:`network_value`;
        override to share work between the two (the network's quantiles count
        the layers' elements once more otherwise).
        """
        rows = [self.statistics(value) for value in values]
        return rows, self.statistics(self.network_value(values)) if network else None

    def derived_statistics(self, name: str, statistics: Dict[str, float]) -> Dict[str, float]:
        """More statistics of row ``name`` from its others (none by default)."""
        return {}

    # Helpers for subclasses -----------------------------------------------------

    def loss_batch(self, global_step: int) -> Batch:
        """The :class:`Batch` of ``info["individual_losses"]`` and ``info["loss"]``.

        Telling a mean from a sum needs the losses' values on the host: one
        transfer per step, shared by the quantities that read the same
        tensors.
        """
        individual_losses = self.info(global_step, "individual_losses")
        loss = self.info(global_step, "loss")
        key = (loss, individual_losses, loss._version, individual_losses._version)
        last = _LOSS_BATCH.get("last")
        if last is not None and _same_tensors(last[0], key):
            return last[1]
        batch = Batch(individual_losses.numel(), functional.loss_scale(loss, individual_losses))
        _LOSS_BATCH["last"] = (_weak(key), batch)
        return batch

    def local_gradient(self, param: torch.Tensor) -> torch.Tensor:
        """``sum_i x_i`` of this backward pass on this process (for ``reads_local_gradient``).

        ``param.grad`` on one process; under distributed training, where
        ``param.grad`` is averaged across processes (and accumulates inside
        ``no_sync()``), the same computed by BackPACK.
        """
        return getattr(param, LOCAL_GRADIENT_SAVEFIELD, param.grad).detach()

    # Cockpit interface ----------------------------------------------------------

    def extensions(self, global_step):
        """BackPACK extensions to run at ``global_step`` (none if not tracked)."""
        if not self.should_compute(global_step):
            return []
        if self._extensions:
            BACKWARD_FACTS.reset()  # Cockpit asks before the backward pass and after
        return list(self._step_extensions())

    def protected_savefields(self, global_step):
        """Only ``grad_batch``, which Cockpit deletes during the backward pass.

        Cockpit frees every other savefield after every quantity has read it;
        protected, one would stay on the parameters (as large as the gradient,
        or larger) until the next tracked step.
        """
        if not self.should_compute(global_step):
            return set()
        if self.sums and distributed.world_size() > 1:
            # Cockpit asks once per call, before the backward pass: the time to
            # join this call's reduction (see _StepReduction).
            _StepReduction.register(self)
        return {field for field in self._savefields if field == "grad_batch"}

    def _compute(self, global_step, params, batch_loss) -> Optional[Dict[str, Dict[str, float]]]:
        if backward_failed():
            return None
        self._check_one_instance_per_class(global_step, params)
        names = self.names(params)
        is_distributed = distributed.world_size() > 1
        if is_distributed:
            distributed.check_not_sharded(params)
            self._warn_if_rank_local()
        if self.sums and is_distributed:
            found = self._global_values(global_step, params)
        else:
            found = self._local_values(global_step, params, names)
        if found is None:
            return None
        usable, values, finite = found
        del found  # values is the only reference: freed once the statistics are taken
        network = bool(values) and not any(flag is False for flag in finite.values())
        names_with_values = [name for name, _ in values]
        each, network_row = self.statistics_of_values([value for _, value in values], network)
        del values
        rows = dict(zip(names_with_values, each))
        if network:
            rows[NETWORK] = network_row
        # On a GPU everything so far stayed on the device (finiteness too): the
        # step's one transfer; what depends on the numbers is decided after it.
        rows, finite = _device.resolve((rows, finite))
        non_finite = [name for name in usable if not finite[name]]
        nan_row = dict.fromkeys(self.statistic_names(), math.nan)
        rows = {
            name: nan_row if name in non_finite else rows[name]
            for name in usable + [NETWORK]
            if name in rows or name in non_finite
        }  # parameters in the given order
        if non_finite:
            self.warn_once(
                "non-finite",
                f"gradient has NaN or Inf in {non_finite} at step {global_step}; "
                "their statistics and the network's are NaN at such steps",
            )
            rows[NETWORK] = nan_row
        rows = {name: {**row, **self.derived_statistics(name, row)} for name, row in rows.items()}
        self._check_statistic_names(rows)
        total = sum(1 for p in params if p.requires_grad)
        if NETWORK in rows and len(usable) < total:
            rows[NETWORK].update({PARAMS_COVERED: float(len(usable)), PARAMS_TOTAL: float(total)})
        return rows

    def _save(self, global_step, result):
        # Encoded once, here: Cockpit.write refuses raw non-finite floats, and
        # Cockpit's own formatter would reject the strings.
        self.output[global_step] = {name: encode_statistics(row) for name, row in result.items()}

    # Internals ------------------------------------------------------------------

    def _local_values(self, global_step, params, names):
        """``(usable names, [(name, value)], {name: finite})`` of this batch.

        Finite: a bool on CPU, where the values of non-finite parameters are
        not formed; a 0-dim tensor on other devices (known after the step's
        transfer), where every value is formed, without the host waiting.
        """
        context = self.prepare(global_step, params)
        if context is None or (self.sums and not self.accepts(context)):
            return None
        self._warn_if_examples_interact()
        usable = self._usable_parameters(names, params, self._batch_size(global_step))
        finite = {name: self._is_finite(param) for name, param in usable}
        # One parameter at a time: a parameter's sums are freed once its value is formed.
        values = [
            (name, self._value(param, context))
            for name, param in usable
            if finite[name] is not False
        ]
        return [name for name, _ in usable], values, finite

    def _global_values(self, global_step, params):
        """As :meth:`_local_values`, for the global batch: the sums reduced across processes."""
        reduced = _StepReduction.of(self).take(self, global_step, params)
        if reduced is None:
            return None
        batch, sums = reduced
        if not self.accepts(batch):
            return None
        # The parameters with results on every process, in order (see _local_part);
        # the reduced sums are identical on every process, so is this split.
        usable = list(sums)
        finite = {name: _all_finite(sums[name].values()) for name in usable}
        values = [
            (name, self.value_from_sums(sums.pop(name), batch)) for name in usable if finite[name]
        ]
        return usable, values, finite

    def _local_part(self, global_step, params):
        """This process's :class:`Batch` and ``{name: sums}`` at a distributed step.

        ``None`` when ``prepare`` records nothing. Sums of the usable
        parameters (with every result, :meth:`_has_local_results`; warned
        about as on one process), in per-example units.
        """
        batch = self.prepare(global_step, params)
        if batch is None:
            return None
        if not isinstance(batch, Batch):
            raise TypeError(
                f"{type(self).__name__}.prepare returned {type(batch).__name__}: a quantity "
                "with declared sums returns a Batch, whose examples and loss scale are "
                "combined across processes"
            )
        self._warn_if_examples_interact()
        usable = self._usable_parameters(
            self.names(params), params, batch.examples, lambda _, p: self._has_local_results(p)
        )
        return batch, {name: self._checked_sums(param, batch) for name, param in usable}

    def _trainable(self, params):
        return [(n, p) for n, p in zip(self.names(params), params) if p.requires_grad]

    def _has_local_results(self, param) -> bool:
        return all(hasattr(param, ext.savefield) for ext in self._step_extensions())

    def _step_extensions(self):
        if self.reads_local_gradient and distributed.world_size() > 1:
            return self._distributed_extensions
        return self._extensions

    def _value(self, param, context) -> Any:
        if not self.sums:
            return self.parameter_value(param, context)
        return self.value_from_sums(self._checked_sums(param, context), context)

    def _checked_sums(self, param, context) -> Dict[str, torch.Tensor]:
        sums = self.parameter_sums(param, context)
        if set(sums) != set(self.sums):
            raise TypeError(
                f"{type(self).__name__}.parameter_sums returned {sorted(sums)}, "
                f"but the class declares sums {sorted(self.sums)}"
            )
        return sums

    def _check_statistic_names(self, rows):
        if self._checked_names:
            return
        declared = set(self.statistic_names())
        undeclared = sorted({s for row in rows.values() for s in row} - declared)
        if undeclared:
            raise TypeError(
                f"{type(self).__name__}.statistics returned {undeclared}, which "
                "statistic_names() does not list: declare every name it can return"
            )
        self._checked_names = True

    def _warn_if_examples_interact(self):
        if self._extensions and BACKWARD_FACTS.examples_interact:
            self.warn_once(
                "examples-interact",
                "a BatchNorm layer is in training mode, so examples interact through "
                "the batch statistics: the statistics are those of each example's "
                "contribution to param.grad backpropagated through the batch (they "
                "sum to param.grad), not of independent per-example gradients"
                + self.interaction_caveat,
            )

    def _warn_if_rank_local(self):
        # Declared sums are reduced across processes; BackPACK's results read
        # without them cover only this process's batch.
        if self._savefields and not self.sums:
            self.warn_once(
                "distributed",
                "BackPACK's per-example results cover only this process's batch "
                "while param.grad is averaged across processes, and this quantity "
                "declares no sums to reduce across them: its statistics are those "
                "of the local batch (see docs/distributed.md)",
            )

    def _refuse_shared(self, named):
        shared = [n for n, p in named if BACKWARD_FACTS.shared(p)]
        if shared:
            raise ValueError(
                f"{type(self).__name__}: parameters {shared} are used by several layers "
                "(tied weights, e.g. an output layer sharing the embedding matrix). "
                "BackPACK's per-example results of one use would overwrite the "
                "other's, so no per-example statistic of them would be right: untie "
                "them, or track them with ParamGradRatio and UpdateSize only"
            )

    def _without_batchless(self, named, batch_size):
        """``named`` without parameters of layers applied without the batch dimension."""
        sizes = [BACKWARD_FACTS.leading_sizes[id(p)] for _, p in named
                 if id(p) in BACKWARD_FACTS.leading_sizes]
        if batch_size is None or not sizes:
            return named
        # Most layers see the batch: a count in info that disagrees with them is wrong.
        check_example_count(max(set(sizes), key=sizes.count), batch_size)
        batchless = {
            n: BACKWARD_FACTS.leading_sizes[id(p)]
            for n, p in named
            if BACKWARD_FACTS.leading_sizes.get(id(p), batch_size) != batch_size
        }
        if batchless:
            self.warn_once(
                "batchless",
                f"parameters {sorted(batchless)} belong to layers applied without the "
                f"batch dimension (their output leads with {sorted(set(batchless.values()))}, "
                f"the batch has {batch_size} examples), e.g. wpe(torch.arange(T)) "
                "broadcast over the batch: apply them to every example, "
                "wpe(pos.expand(B, T)), to get their rows; they have no rows and are "
                f"left out of {NETWORK!r}",
            )
        return [(n, p) for n, p in named if n not in batchless]

    def _batch_size(self, global_step) -> Optional[int]:
        """The batch's number of examples from ``info``, ``None`` if it holds none."""
        info = CockpitCTX.INFO.get(global_step, {})
        if "individual_losses" in info:
            return int(info["individual_losses"].shape[0])
        if "batch_size" in info:
            return int(info["batch_size"])
        return None

    def _usable_parameters(self, names, params, batch_size=None, has_results=None):
        """``(name, param)`` pairs that have every result needed; warn about the rest.

        ``has_results(name, param)``: whether a parameter has them; by default,
        whether BackPACK left every savefield on it.
        """
        if has_results is None:
            def has_results(name, param):
                return all(hasattr(param, field) for field in self._savefields)

        trainable = [(n, p) for n, p in zip(names, params) if p.requires_grad]
        no_grad = [n for n, p in trainable if p.grad is None]
        with_grad = [(n, p) for n, p in trainable if p.grad is not None]
        usable = [(n, p) for n, p in with_grad if has_results(n, p)]
        supported = {n for n, _ in usable}
        unsupported = [n for n, _ in with_grad if n not in supported]
        if self._savefields:
            self._refuse_shared(usable)
            usable = self._without_batchless(usable, batch_size)
        if with_grad and not supported:
            raise RuntimeError(
                f"{type(self).__name__}: no parameter received BackPACK's results "
                f"({', '.join(self._savefields)}). Extend the model and the loss "
                "function with `backpack.extend(model)` and `backpack.extend(loss_fn)` "
                "before training, and make sure the model has layers BackPACK "
                "supports (Linear, Conv, BatchNorm, Embedding, RNN, LSTM)."
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

    def _is_finite(self, param):
        """Whether the gradient and every savefield are finite: a bool on CPU, else a tensor."""
        tensors = [param.grad] + [getattr(param, field) for field in self._savefields]
        if _device.on_host(param.grad):
            return _all_finite(tensors)
        return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def _all_finite(tensors) -> bool:
    return all(map(_finite, tensors))


#: ``{id(tensor): (weak reference, tensor._version, finite)}``: every quantity of
#: a step asks about the same ``param.grad`` (and shared savefields); asked
#: again, an unchanged tensor (same object, same version) is not summed again.
_FINITE: Dict[int, Tuple[Any, int, bool]] = {}


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a CPU tensor is finite."""
    known = _FINITE.get(id(tensor))
    if known is not None and known[0]() is tensor and known[1] == tensor._version:
        return known[2]
    # NaN and inf propagate into a sum, so a finite sum proves every element
    # finite with one reduction; only a sum that overflowed needs the full test.
    finite = bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
    key = id(tensor)
    _FINITE[key] = (weakref.ref(tensor, lambda _: _FINITE.pop(key, None)), tensor._version, finite)
    return finite


class _StepReduction:
    """The declared sums of the quantities computed in one cockpit call, reduced together.

    Cockpit asks each quantity for its protected savefields once per call,
    before the backward pass, in its own order: the quantities that will
    compute register then. The first of them to compute forms every
    registered quantity's local sums and reduces them all with one round of
    collectives (:func:`~cockpit_gradnoise.distributed.reduce_step`); the
    others take their results, so no collective runs after the first
    quantity, whatever happens later in the call. A quantity computed without
    having registered (called outside a cockpit) reduces alone.
    """

    # The call being prepared or computed; holding its CockpitCTX.INFO (which
    # Cockpit replaces after every call) identifies the call.
    current: Optional["_StepReduction"] = None

    def __init__(self, quantities):
        self.info = CockpitCTX.INFO
        self.quantities = list(quantities)
        self.results: Optional[Dict[Any, Any]] = None

    @classmethod
    def register(cls, quantity):
        call = cls.current
        # A quantity registers once per call: seeing it again starts a new call
        # (Cockpit keeps CockpitCTX.INFO when a quantity raised in the last one).
        if (
            call is None
            or call.info is not CockpitCTX.INFO
            or call.results is not None
            or quantity in call.quantities
        ):
            call = cls.current = cls([])
        call.quantities.append(quantity)

    @classmethod
    def of(cls, quantity) -> "_StepReduction":
        call = cls.current
        if call is not None and call.info is CockpitCTX.INFO and quantity in call.quantities:
            return call
        return cls([quantity])

    def take(self, quantity, global_step, params):
        """``(global Batch, {name: reduced sums})`` of ``quantity``, or ``None`` (skipped)."""
        if self.results is None:
            self.results = {}  # taken, also if the reduction raises
            self.results = self._reduce(global_step, params)
        result = self.results.pop(quantity, None)
        if not self.results and _StepReduction.current is self:
            _StepReduction.current = None  # every result taken: hold nothing
        return result

    def _reduce(self, global_step, params):
        # Fixed by the model and the quantities, so the header has one length everywhere.
        slots = [(q, name) for q in self.quantities for name, _ in q._trainable(params)]
        contribution = distributed.Contribution(
            slots=[f"{type(q).__name__}:{name}" for q, name in slots]
        )
        parts = {}
        try:
            for q in self.quantities:
                parts[q] = q._local_part(global_step, params)
            batches = [part[0] for part in parts.values() if part is not None]
            if any(not b.same_as(batches[0]) for b in batches):
                raise ValueError(
                    f"the quantities read different batches from info at step {global_step}: "
                    f"{batches}; pass consistent 'batch_size', 'individual_losses' and 'loss'"
                )
            if batches:
                contribution.examples, contribution.scale = batches[0].examples, batches[0].scale
            contribution.sums = [
                (sums[sum_name], how)
                for q, part in parts.items()
                if part is not None
                for sums in part[1].values()
                for sum_name, how in q.sums.items()
            ]
        except Exception as error:  # every process must still take part, to raise together
            contribution.error, contribution.sums = error, []
        contribution.available = [
            parts.get(q) is not None and name in parts[q][1] for q, name in slots
        ]
        device = params[0].device if params else torch.device("cpu")
        reduced = distributed.reduce_step(contribution, device, global_step)
        batch = Batch(reduced.examples, reduced.scale)
        values = iter(reduced.sums)
        results = {}
        for q, part in parts.items():
            if part is None:
                results[q] = None
                continue
            sums = {name: {sum_name: next(values) for sum_name in q.sums} for name in part[1]}
            results[q] = (batch, sums)
        return results


class TwoStepParameterQuantity(_NamedParameters, Quantity):
    """A quantity that compares the parameters at a start step ``s`` with step ``s + 1``.

    At a step the schedule selects, :meth:`start` caches what it needs; at the
    next call of the cockpit, if that call is step ``s + 1``, :meth:`end`
    measures against the cache and the result is stored under ``s``.
    Otherwise (a start without an end, an end without a tracked start, a
    schedule that skips steps, a loop that calls the cockpit every other
    step) nothing is stored for ``s`` and the cache is dropped at the next
    call, so nothing wrong is stored and nothing is kept behind. A step whose
    backward pass raised computes nothing and keeps the cache as it was.

    Methods to implement:

    - ``start(params, reuse)``: the cache for this step; ``reuse`` is the
      previous cache (or ``None``), whose memory may be reused;
    - ``end(cache, params, names)``: the value to store (may overwrite
      ``cache``, which is reused or dropped right after).
    - ``cache_matches(cache, params)`` (optional): whether ``cache`` fits
      ``params``; when it does not, nothing is stored.

    Args:
        track_schedule: Function from step to bool: the start steps ``s``.
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

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

    def extensions(self, global_step):
        """No BackPACK extension."""
        return []

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
        self._check_one_instance_per_class(global_step, params)
        names = self.names(params)
        if distributed.world_size() > 1:
            # Parameters are the same on every process (DDP): nothing to reduce.
            distributed.check_not_sharded(params)
        start, cache = self._cache_step, self._cache
        self._cache_step, self._cache = None, None
        value = None
        if start == global_step - 1 and self.cache_matches(cache, params):
            value = self.end(cache, params, names)
        if self._track_schedule(global_step):
            self._cache_step, self._cache = global_step, self.start(params, cache)
        return (start, value) if value is not None else (global_step, None)

    def _save(self, global_step, result):
        self.output[global_step] = result


def check_example_count(results: int, individual_losses: int):
    """Raise if BackPACK's per-example results and ``info["individual_losses"]`` disagree.

    Raises:
        ValueError: Naming both counts and the fix.
    """
    if results != individual_losses:
        raise ValueError(
            f"info['individual_losses'] has {individual_losses} values but the batch "
            f"has {results} examples: pass one loss per example of the batch that was "
            "differentiated, e.g. loss_fn_none(out, y) with reduction='none'"
        )


