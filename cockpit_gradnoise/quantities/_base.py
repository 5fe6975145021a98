"""The single-step quantity's interface: what a subclass declares and implements.

A single-step quantity (:class:`ParameterQuantity`) turns, at each tracked
step, what the backward pass left on every parameter into named statistics,
per parameter and for the whole network (``"all"``). Its maths is always

    per-parameter sums over the batch's examples  ->  per-parameter values
    ->  network value  ->  statistics

and the sums are declared (:attr:`ParameterQuantity.sums`), as torchmetrics
declares a metric's state with its reduction: they are what combines across
examples, micro-batches and processes. What a quantity shares with the others
of its cockpit call (the batch, usable parameters, warnings, finiteness, the
distributed reduction) is the call's :class:`~cockpit_gradnoise.step.Step`.
Its declared sums across micro-batches and processes are formed by its part
:class:`~cockpit_gradnoise.quantities._sums.DeclaredSums`; what both bases
share is :class:`~cockpit_gradnoise.quantities._named.NamedQuantity`; the
two-step base is in :mod:`cockpit_gradnoise.quantities._two_step`.
"""

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, distributed
from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.accumulation import MicroBatchGradient, parameters_reached
from cockpit_gradnoise.extensions import LOCAL_GRADIENT_SAVEFIELD, LocalGradient, sharded, tensor_parallel
from cockpit_gradnoise.extensions.precision import widened
from cockpit_gradnoise.logs.schema import NETWORK, PARAMS_COVERED, PARAMS_TOTAL, encode_statistics
from cockpit_gradnoise.quantities._accumulation import Accumulation
from cockpit_gradnoise.quantities._declarations import check_declarations, check_statistic_names
from cockpit_gradnoise.quantities._named import NamedQuantity
from cockpit_gradnoise.quantities._sums import DeclaredSums
from cockpit_gradnoise.step import Batch, Step, backward_failed

import torch

import_cockpit()
from cockpit.context import CockpitCTX  # noqa: E402
from cockpit.quantities.quantity import SingleStepQuantity  # noqa: E402


class ParameterQuantity(NamedQuantity, DeclaredSums, SingleStepQuantity):
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
      With sums, ``step_context`` returns a :class:`Batch`, and under distributed
      training ``parameter_sums`` returns them in per-example units (divided
      by ``batch.loss_scale``, sums of squares by its square) so that the sums of
      the processes add; ``value_from_sums`` then gets the global batch.
    - ``loss_free_statistics`` (with sums): the statistics that do not depend
      on the loss scale ``c`` (``x_i = c g_i``). Where the loss is not finite
      while the gradients are (a ``-inf`` logit on a label), ``c`` cannot be
      told: the values are then formed with ``c = 1`` (on other devices than
      the CPU, with the front door's declared ``c``: the same, to rounding)
      and every other statistic is NaN, with one warning. Default: none.
    - ``reads_local_gradient``: whether ``parameter_sums`` reads this
      backward pass's gradient through :meth:`local_gradient` (under
      distributed training ``param.grad`` is averaged across processes, and
      under gradient accumulation it holds the earlier micro-batches too, so
      the gradient is then requested from BackPACK).
    - ``micro_batch_gradient`` (with sums): the name of the declared sum that
      is the batch's gradient, ``sum_i g_i``; under gradient accumulation
      the squared norm of each micro-batch's is kept
      (:attr:`micro_batch_gradients`). Default: none.

    Under gradient accumulation (``info["micro_batch"]`` and
    ``info["micro_batches"]``, see :mod:`cockpit_gradnoise.accumulation`)
    the declared sums of every micro-batch are added, and the values are
    formed once, after the last micro-batch's backward pass, from the sums
    of all of them, as for one batch of all examples; a quantity without
    declared sums computes at the last micro-batch only (``param.grad`` is
    then the accumulated gradient).

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

    - ``step_context(step, params)``: read the step's ``info`` once (through
      the call's :class:`~cockpit_gradnoise.step.Step`: ``step.info(key,
      owner)``, ``step.examples(owner)``, ``step.loss_batch(owner)``) and
      return the context passed to the methods above, or ``None`` to record
      nothing;
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
        param_names: The model (names found by identity, the safe choice), a
            mapping ``{name: parameter}``, or the names of the parameters
            handed to the ``Cockpit`` in the same order. Defaults to
            ``"param0"``, ``"param1"``, ...
        verbose: Print what is computed at each step.
    """

    extension_classes: Sequence[type] = ()
    sums: Mapping[str, str] = {}
    reads_local_gradient: bool = False
    loss_free_statistics: Sequence[str] = ()
    micro_batch_gradient: Optional[str] = None
    #: Exact under FSDP2 (``fully_shard``): its results are collected onto the sharded
    #: parameters (:mod:`~cockpit_gradnoise.extensions.sharded`); else FSDP2 is refused.
    supports_fsdp2: bool = False
    #: Exact under HSDP (FSDP2 on a replicate x shard mesh); else refused there.
    supports_hsdp: bool = False
    #: Exact under tensor parallelism (:mod:`~cockpit_gradnoise.extensions.tensor_parallel`).
    supports_tensor_parallel: bool = False
    #: Exact under FSDP2 over tensor parallelism (a ``("dp", "tp")`` mesh); else refused there.
    supports_fsdp2_tensor_parallel: bool = False
    #: Its sums are per element: under tensor parallelism a split parameter's stay with the
    #: process holding the shard, not reduced (``quantities/_sums.py``).
    per_element_sums_stay: bool = False
    #: Under FSDP2, the savefield whose per-element sums (all its declared sums but 0-dim
    #: ones) are reduce-scattered inside the backward pass, each process keeping its rows
    #: (:meth:`arm_reduction_in_backward`); ``None``: reduced after it, whole.
    sums_sharded_in_backward: Optional[str] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_declarations(cls, ParameterQuantity)

    def __init__(self, track_schedule, *, param_names=None, verbose=False):
        super().__init__(track_schedule, verbose=verbose)
        self._init_names(param_names)
        # BackPACK extensions keep no state between backward passes: build them once.
        self._extensions = tuple(cls() for cls in self.extension_classes)
        self._savefields = tuple(ext.savefield for ext in self._extensions)
        self._checked_names = False
        # Under distributed training or accumulation (see _step_extensions).
        self._distributed_extensions = self._extensions + (
            (LocalGradient(),) if self.reads_local_gradient else ()
        )
        self._own_gradient = False  # param.grad is not this backward pass's (this call)
        self._accumulation: Optional[Accumulation] = None
        #: ``{step: [MicroBatchGradient per micro-batch]}`` of the last accumulated
        #: step recorded, where ``micro_batch_gradient`` is declared (this process's).
        self.micro_batch_gradients: Dict[int, List[MicroBatchGradient]] = {}

    # Interface for subclasses ---------------------------------------------------

    def step_context(self, step: Step, params: List[torch.Tensor]) -> Any:
        """Read the step's information (``step.info(...)``, ``step.loss_batch(...)``) once.

        Returns:
            The context handed to the methods below; ``None`` skips the step.
        """
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

    def named_value_from_sums(self, name: str, sums: Dict[str, torch.Tensor], context: Any) -> Any:
        """:meth:`value_from_sums` of the parameter ``name``; what the base calls.

        Override it instead of :meth:`value_from_sums` where the value needs
        more of the parameter than its sums (the optimizer's state:
        :class:`~cockpit_gradnoise.PreconditionedNoiseScale`).
        """
        return self.value_from_sums(sums, context)

    def values_of_many(self, items: List[Tuple[str, torch.Tensor]], context: Any,
                       deferred: list) -> Optional[Dict[str, Any]]:
        """``{name: value}`` of every ``(name, param)`` of ``items`` (one step's, of one process,
        all plain tensors) formed together, as :meth:`named_value_from_sums` of
        :meth:`parameter_sums` forms each (on other devices a few launches for all, not a few per
        parameter), with ``(name, param, {key: sums[key] for key in unresolved_reads})`` of each
        appended to ``deferred`` (:meth:`unresolved_of_many`); ``None`` (the default): one
        parameter at a time."""
        return None

    def forms_values_together(self, base: type, items: list,
                              hooks: Sequence[str] = ("parameter_sums", "value_from_sums", "named_value_from_sums")
                              ) -> bool:
        """Whether :meth:`values_of_many` may form ``items``' values together: there are some, on
        another device than the CPU (where one at a time costs a few microseconds a parameter),
        and this quantity's class keeps ``base``'s ``hooks`` (a subclass's own sums or values are
        formed one at a time)."""
        return bool(items) and not _device.on_host(items[0][1]) and all(
            getattr(type(self), hook) is getattr(base, hook) for hook in hooks)

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

    def local_gradient(self, param: torch.Tensor) -> torch.Tensor:
        """``sum_i x_i`` of this backward pass on this process (for ``reads_local_gradient``).

        ``param.grad`` on one process; under distributed training, where
        ``param.grad`` is averaged across processes (and accumulates inside
        ``no_sync()``), and under gradient accumulation (or where
        ``param.grad`` held gradients before the backward pass), the same
        computed by BackPACK. In float32 for bfloat16 and float16 parameters
        (exact), so that dividing it by the loss scale adds no rounding of the
        low dtype.
        """
        return widened(getattr(param, LOCAL_GRADIENT_SAVEFIELD, param.grad).detach())

    # What the Step asks ---------------------------------------------------------

    def trainable(self, params) -> List[Tuple[str, torch.Tensor]]:
        """``(name, param)`` of the parameters that require gradients, in order."""
        return [(n, p) for n, p in zip(self.names(params), params) if p.requires_grad]

    # Cockpit interface ----------------------------------------------------------

    def extensions(self, global_step):
        """BackPACK extensions to run at ``global_step`` (none if not tracked)."""
        if not self.should_compute(global_step):
            return []
        return list(self._step_extensions())

    def should_compute(self, global_step):
        """Whether the schedule selects ``global_step`` and the call does not repeat a recorded step."""
        return bool(self._track_schedule(global_step)) and global_step != self.skipped_step

    def protected_savefields(self, global_step):
        """Only ``grad_batch``, which Cockpit deletes during the backward pass.

        Cockpit asks every quantity once per call, before the backward pass:
        the call's :class:`~cockpit_gradnoise.step.Step` begins here (new
        backward facts; under distributed training this quantity joins the
        call's one reduction). Cockpit frees every other savefield after every
        quantity has read it; protected, one would stay on the parameters
        until the next tracked step.
        """
        if not self.check_call(global_step) or not self.should_compute(global_step):
            return set()
        joins = self.sums and distributed.world_size() > 1
        if self.supports_fsdp2 and joins:
            sharded.clear()  # what a failed backward pass left on FSDP2's unsharded parameters
        step = Step.begin(global_step, self if joins else None)
        for field in self._savefields + ((LOCAL_GRADIENT_SAVEFIELD,) if self.reads_local_gradient else ()):
            readers = step.readers.setdefault(field, [])
            readers += [] if self in readers else [self]
        if joins:
            self.arm_reduction_in_backward(step, self._params_of_call(global_step))
        try:
            micro = step.micro_batch()
        except (TypeError, ValueError):
            CockpitCTX.erase()  # a refused call leaves nothing behind
            raise
        if self._extensions:
            # Per-example results describe this backward pass only; param.grad
            # alone (ParamGradRatio) is the optimizer's, however accumulated. At the
            # first call Cockpit has not given its parameters yet: those the loss
            # reaches, named once they are known (warn_earlier_gradients).
            named = (self.trainable(self.known_params) if self.known_params is not None
                     else [(None, p) for p in self._params_of_call(global_step)])
            step.check_earlier_gradients(self, named)
        self._own_gradient = micro is not None or step.earlier_gradients
        return {field for field in self._savefields if field == "grad_batch"}

    def _params_of_call(self, global_step) -> list:
        """The parameters of this call before the backward pass: Cockpit's (known from the
        first call on), or at the first call those the loss reaches."""
        if self.known_params is not None:
            return list(self.known_params)
        return parameters_reached(CockpitCTX.INFO.get(global_step, {}).get("loss"))

    def _compute(self, global_step, params, batch_loss) -> Optional[Dict[str, Dict[str, float]]]:
        if backward_failed() or self.repeats(global_step):  # the latter outside a Cockpit only
            return None
        self.known_params = params
        step = Step.of(self, global_step)
        step.warn_frozen(self, list(zip(self.names(params), params)))
        if self._extensions:
            step.warn_earlier_gradients(self, {id(p): n for n, p in self.trainable(params)})
        if self.supports_fsdp2:
            sharded.collect(params)  # FSDP2: the unsharded parameters' results onto the sharded
        # A DTensor breaks every other formula, one process or many.
        distributed.check_not_sharded(params, fsdp2=self.supports_fsdp2,
                                      tensor_parallel=self.supports_tensor_parallel,
                                      fsdp2_tensor_parallel=self.supports_fsdp2_tensor_parallel,
                                      hsdp=self.supports_hsdp, quantity=type(self).__name__)
        if self.supports_tensor_parallel:
            # Split layers' results completed over their mesh (but the shards of a local
            # gradient kept in the backward pass: GradientNoiseScale's, never gathered).
            tensor_parallel.collect(params, kept=step.presharded.get(LOCAL_GRADIENT_SAVEFIELD, {}))
        if distributed.world_size() > 1:
            self._warn_if_rank_local()
        found = self._values(step, params)
        if found is None:
            return None
        usable, values, finite, loss_known = found
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
        deferred = isinstance(loss_known, torch.Tensor)
        pending, self._unresolved_pending = getattr(self, "_unresolved_pending", {}), {}
        rows, finite, loss_known, counts = _device.resolve(
            (rows, finite, loss_known, {name: count for name, (count, _) in pending.items()}))
        underflow = self._told_unresolved(step, pending, counts, f"their rows and {NETWORK!r}'s are NaN "
                                          "at such steps (on this device)")
        rows = self._with_nan_rows(step, rows, usable, finite, underflow)
        if not loss_known:
            if deferred:
                self._warn_if_loss_not_finite(step)
            kept = set(self.loss_free_statistics)
            rows = {name: {k: v if k in kept else math.nan for k, v in row.items()}
                    for name, row in rows.items()}
        rows = {name: {**row, **self.derived_statistics(name, row)} for name, row in rows.items()}
        self._check_statistic_names(rows)
        total = sum(1 for p in params if p.requires_grad)
        if NETWORK in rows and len(usable) < total:
            rows[NETWORK].update({PARAMS_COVERED: float(len(usable)), PARAMS_TOTAL: float(total)})
        return rows

    def _save(self, global_step, result):
        # Encoded once, here: Cockpit.write refuses raw non-finite floats, and
        # Cockpit's own formatter would reject the strings.
        step = int(global_step)  # a NumPy integer's record under its int (step_number)
        self.output[step] = {name: encode_statistics(row) for name, row in result.items()}
        self._record(step)

    # Internals ------------------------------------------------------------------

    def _values(self, step, params):
        """``(usable names, [(name, value)], {name: finite}, loss known)``, or ``None``.

        Under accumulation: ``None`` before the last micro-batch (whose sums
        are added to the step's), then the values of all micro-batches' sums
        (without sums: of ``param.grad``); ``None`` for a step whose
        micro-batches did not all come, in order.
        """
        micro = step.micro_batch()
        if micro is not None and (not micro.last or not self.sums):
            # With sums, the last micro-batch is added where the sums are read (step_sums).
            if self._accumulate(step, params, micro) is None or not micro.last:
                return None
        if self.sums and distributed.world_size() > 1:
            return self._global_values(step, params)
        if self.sums and micro is not None:
            part = self.step_sums(step, params)
            return None if part is None else self._values_of_sums(step, *part)
        if micro is not None and self._savefields:
            self.warn_once(
                "micro-batch-local",
                "this quantity declares no sums, so under gradient accumulation it reads "
                "BackPACK's results of the last micro-batch only (see docs/accumulation.md)",
            )
        return self._local_values(step, params)

    def _local_values(self, step, params):
        """``(usable names, [(name, value)], {name: finite}, loss known)`` of this batch.

        Finite: a bool on CPU, where the values of non-finite parameters are
        not formed; a 0-dim tensor on other devices (known after the step's
        transfer), where every value is formed, without the host waiting.
        Loss known: likewise a 0-dim tensor for a batch the front door
        declared on other devices (:meth:`Step.loss_known`): the values are
        formed with its scale, and what depends on it is NaN after the
        transfer if the losses were not finite.
        """
        with step.deferred_loss_check():
            context = self.step_context(step, params)
        if context is None:
            return None
        # True, False, or (a declared batch on a device) a 0-dim tensor read with the values.
        loss_known = step.loss_known(context)
        if loss_known is False:
            # Units of x_i (scale 1) for what is free of the scale; the rest is NaN (_compute).
            self._warn_if_loss_not_finite(step)
            context = Batch(context.examples, 1.0)
        if self.sums and not self.accepts(context):
            return None
        self._warn_if_examples_interact(step)
        examples = step.examples_if_known() if self._savefields else None
        usable = step.usable(self, self.trainable(params), self._savefields,
                             self._has_local_results, examples=examples)
        finite, values, unresolved, deferred = {}, [], {}, []
        # Finiteness of every parameter at once (on other devices a few kernels for all, not
        # a handful each), but of FSDP2's sharded ones, gathered one at a time below.
        whole = not any(type(param).__name__ == "DTensor" for _, param in usable)
        checked = step.finite_each([self._read_tensors(param) for _, param in usable]) if whole else None
        # All together where the quantity forms them so (values_of_many); else one parameter
        # at a time: a parameter's sums (under FSDP2 its unsharded values, gathered on every
        # process alike) are freed once its value is formed.
        together = self.values_of_many([item for item, ok in zip(usable, checked) if ok is not False],
                                       context, deferred) if whole else None
        for i, (name, param) in enumerate(usable):
            param = sharded.gathered(param) if self.supports_fsdp2 else param
            finite[name] = checked[i] if whole else step.finite(self._read_tensors(param))
            if finite[name] is not False:
                values.append((name, together[name] if together is not None else
                               self._value(name, param, context, unresolved, deferred if whole else None)))
        # Squares that underflow lost (.functional.underflow): left out, named; on other
        # devices than the CPU known after the step's transfer, then NaN (_compute).
        if deferred:
            unresolved.update(self.unresolved_of_many(deferred, context))
        found = {name: pair for name, pair in unresolved.items() if pair is not None}
        self._unresolved_pending = {n: pair for n, pair in found.items() if isinstance(pair[0], torch.Tensor)}
        _and_resolved(finite, self._unresolved_pending)
        now = {name: count for name, (count, _) in found.items() if name not in self._unresolved_pending}
        left_out = self._told_unresolved(step, found, now, "they have no rows at such steps and are "
                                         f"left out of {NETWORK!r}")
        values = [(name, value) for name, value in values if name not in left_out]
        return [name for name, _ in usable if name not in left_out], values, finite, loss_known

    def _with_nan_rows(self, step, rows, usable, finite, underflow=()):
        """The rows in the given order, NaN for parameters whose gradient is not finite
        (or, ``underflow``, whose squares underflow lost: told about already)."""
        non_finite = [name for name in usable if not finite[name]]
        nan_row = dict.fromkeys(self.statistic_names(), math.nan)
        rows = {
            name: nan_row if name in non_finite else rows[name]
            for name in usable + [NETWORK]
            if name in rows or name in non_finite
        }
        if non_finite:  # underflow's too: the network's sums lack them
            rows[NETWORK] = nan_row
        told = [name for name in non_finite if name not in underflow]
        if told:
            step.warn(
                "non-finite",
                f"gradient has NaN or Inf in {told} at step {step.global_step}; "
                "their statistics and the network's are NaN at such steps",
                self,
            )
        return rows

    def _read_tensors(self, param) -> List[torch.Tensor]:
        """The gradient and every savefield this quantity reads."""
        return [param.grad] + [getattr(param, field) for field in self._savefields]

    def _has_local_results(self, param) -> bool:
        return all(hasattr(param, ext.savefield) for ext in self._step_extensions())

    def _step_extensions(self):
        if self.reads_local_gradient and (self._own_gradient or distributed.world_size() > 1):
            return self._distributed_extensions
        return self._extensions

    def _value(self, name, param, context, unresolved, deferred=None) -> Any:
        """The value of ``param``; what :meth:`unresolved` finds in its sums into ``unresolved``,
        or, where the quantity checks a step's parameters together (:attr:`unresolved_reads`)
        and ``deferred`` is a list, ``(name, param, the sums it reads)`` into it."""
        if not self.sums:
            return self.parameter_value(param, context)
        sums = self._checked_sums(param, context)
        if deferred is None or self.unresolved_reads is None:
            unresolved[name] = self.unresolved(param, sums, context)
        else:  # only the small sums the check reads are kept past this parameter
            deferred.append((name, param, {key: sums[key] for key in self.unresolved_reads}))
        return self.named_value_from_sums(name, sums, context)

    def _check_statistic_names(self, rows):
        if not self._checked_names:
            check_statistic_names(self, rows)
            self._checked_names = True

    def _warn_if_examples_interact(self, step):
        if self._extensions and step.facts.examples_interact:
            step.warn(
                "examples-interact",
                "a BatchNorm layer is in training mode, so examples interact through "
                "the batch statistics: the statistics are those of each example's "
                "contribution to param.grad backpropagated through the batch (they "
                "sum to param.grad), not of independent per-example gradients (and "
                "GradientNoiseScale's estimates, unbiased for independent examples, "
                "may be biased)",
                self,
            )

    def _warn_if_loss_not_finite(self, step):
        step.warn(
            "non-finite-loss",
            f"info['loss'] or info['individual_losses'] is not finite at step "
            f"{step.global_step} (a -inf logit on a label, say), so whether the loss is a "
            "mean or a sum of the examples' losses cannot be told: the statistics that "
            "depend on it are NaN at such steps (PerExampleGradNorm's, and "
            "GradientNoiseScale's but b_simple and batch_size); those free of it "
            "(GradientVarianceQuantiles on one process, ParamGradRatio, UpdateSize, "
            "b_simple) are computed from the gradients where they are finite",
            self,
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


def _and_resolved(finite: Dict[str, Any], pending: Dict[str, Tuple[torch.Tensor, Any]]):
    """``finite[name]`` and ``count == 0`` for each pending underflow count (0-dim tensors on a
    device), in place: per device one stack and one comparison for all (on a GPU a
    launch each), not two per parameter."""
    by_device: Dict[torch.device, List[str]] = {}
    for name, (count, _) in pending.items():
        by_device.setdefault(count.device, []).append(name)
    for device, names in by_device.items():
        resolved = torch.stack([pending[name][0] for name in names]) == 0
        known = torch.stack([torch.as_tensor(finite[name], device=device) for name in names])
        for name, flag in zip(names, torch.logical_and(known, resolved).unbind()):
            finite[name] = flag
