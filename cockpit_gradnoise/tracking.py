"""The front door: one call prepares a model and its quantities, one ``with`` line tracks a step.

In the spirit of Opacus' ``make_private`` (ready objects back) and Cockpit's
``configuration("full")`` (a preset label for a list of quantities)::

    model, tracker = cgn.track(model, every=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=opt) as loss:
            loss.backward()
        opt.step()
    tracker.write("runs/demo")
    print(tracker.report())

:func:`track` converts attention, prepares the model for BackPACK and builds
the quantities with names taken from the model; a :class:`Tracker` call builds
Cockpit's ``info`` from the per-example losses. What it does by hand is the
explicit API (``docs/getting-started.md``), which stays available.
"""

import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Union

from cockpit_gradnoise import accumulation, amp, arming, fsdp2
from cockpit_gradnoise.extensions import register_extensions
from cockpit_gradnoise.extensions.hooks import switch_of
from cockpit_gradnoise.logs.frame import json_log_path, read_log, to_frame, write_log
from cockpit_gradnoise.logs.schema import NETWORK, OPTIMIZER
from cockpit_gradnoise.logs.stream import LogStream
from cockpit_gradnoise.losses import check_loss, declared_batch, loss_to_differentiate, micro_batch_given
from cockpit_gradnoise.prepare import prepare_model
from cockpit_gradnoise.quantities.presets import build_quantities, quantity_plan, schedule_of, trainable_names
from cockpit_gradnoise.step_checks import check_individual_losses, step_number
from cockpit_gradnoise.tracked_step import Cockpit, IdleStep, TrackedStep
from cockpit_gradnoise.views.sources import advice, report

import torch
from torch import nn

#: At most so many steps of :attr:`Tracker.given` are kept (quantities on schedules far apart).
GIVEN_STEPS = 64

#: The keys of ``info`` that a :class:`Tracker` call derives from its arguments.
DERIVED_KEYS = ("batch_size", "individual_losses", "loss", "optimizer",
                accumulation.MICRO_BATCH, accumulation.MICRO_BATCHES)


def track(
    model: nn.Module,
    every: Union[int, Callable[[int], bool]] = 10,
    quantities: Union[str, Sequence] = "all",
    *,
    quantiles: Optional[Sequence[float]] = None,
    options: Optional[Mapping[str, Mapping]] = None,
    use_converter: Optional[bool] = None,
    verbose: bool = False,
    log=None,
):
    """Make ``model`` ready for the quantities and return it with its :class:`Tracker`.

    Prepares the model for BackPACK (:func:`~cockpit_gradnoise.prepare_model`,
    which also converts every ``nn.MultiheadAttention``), and builds a ``Cockpit`` over
    the parameters that require gradients with the quantities of
    :func:`~cockpit_gradnoise.configuration`, named after the model's parameters. If a quantity
    is not this package's own (Cockpit's ``GradNorm``, say), BackPACK's own
    extensions get this package's layer support
    (:func:`~cockpit_gradnoise.register_extensions`).

    A ``torch.compile``'d model is tracked through the module it wraps: the
    parameters are named without ``_orig_mod.``, and the compiled model is
    returned. Each module with parameters of its own ends a graph (its
    output's gradient hook), so the compiled model runs as several graphs.

    Create the optimizer from the returned model (BackPACK's converter, where
    it is used, returns a new module with the same parameters), and freeze
    parameters before this call: frozen ones are left out.

    Args:
        model: The network.
        every: Track every ``every``-th step, or a schedule function ``step -> bool``.
        quantities: ``"all"`` (the five), ``"cheap"`` (all but
            GradientVarianceQuantiles), or a list; see :func:`~cockpit_gradnoise.configuration`.
        quantiles: The quantile levels of GradientVarianceQuantiles.
        options: Keyword arguments per quantity class name; ``"every"`` gives one its own
            cadence (see :func:`~cockpit_gradnoise.configuration`).
        use_converter: As :func:`~cockpit_gradnoise.prepare_model`'s.
        verbose: Cockpit's ``verbose`` for the quantities.
        log: Stream the log to this path (:meth:`Tracker.stream_to`): each
            tracked step is appended as it is computed and dropped from
            memory, so memory stays flat over any number of steps. A
            streamed log already there is continued, never replaced
            (:class:`~cockpit_gradnoise.LogStream`).

    Returns:
        ``(model, tracker)``: the model to train and its :class:`Tracker`.

    Raises:
        ValueError: If no parameter requires gradients, or for a bad
            ``every``, preset, name or option (see :func:`~cockpit_gradnoise.configuration`).
        TypeError: If the model is sharded or split across processes (FSDP,
            DeepSpeed, pipeline parallelism): only one
            process, DistributedDataParallel, FSDP2 (``fully_shard`` on a
            1-D mesh, before or after this call) and tensor parallelism (``parallelize_module``
            before this call, alone or inside FSDP2; the quantities exact there,
            such as the ``"norms"`` preset) are supported.
    """
    # A torch.compile'd model: prepare and name the module it wraps (no "_orig_mod."
    # prefix); the compiled wrapper, which calls that module, is what is returned.
    compiled = model if isinstance(model, _compiled_module_type()) else None
    if compiled is not None:
        model = compiled._orig_mod
    # Every check before the model is changed (converted in place, extended).
    trainable_names(model)
    schedule, plan = schedule_of(every), quantity_plan(quantities, quantiles, options, every)
    if fsdp2.fully_sharded(model) or fsdp2.is_sharded(model.parameters()):  # FSDP2 or tensor parallelism
        fsdp2.check_trackable(model, [entry for entry, _ in plan])
    model = prepare_model(model, use_converter=use_converter)
    if compiled is not None and model is not compiled._orig_mod:
        raise ValueError(
            "a torch.compile'd model cannot go through BackPACK's converter: call "
            "cgn.track(model) first, then torch.compile the model it returns"
        )
    names = trainable_names(model)
    # Names found by identity (a mapping), so a quantity can never mislabel a row.
    by_name = {name: param for name, param in model.named_parameters() if param.requires_grad}
    built = build_quantities(plan, schedule, by_name, verbose)
    if any(not type(q).__module__.startswith("cockpit_gradnoise.") for q in built):
        register_extensions()
    params = [param for param in model.parameters() if param.requires_grad]
    tracker = Tracker(Cockpit(params, quantities=built), names, switch=switch_of(model), model=model)
    if log is not None:
        tracker.stream_to(log)
    return (model if compiled is None else compiled), tracker


def _compiled_module_type() -> Union[type, tuple]:
    """The class ``torch.compile`` wraps a module in (``OptimizedModule``); ``()`` (no class)
    while ``torch._dynamo`` is not imported: no module can be compiled then, and importing it
    costs seconds."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return () if eval_frame is None else eval_frame.OptimizedModule


class Tracker:
    """A ``Cockpit`` with a step helper that builds its ``info`` from the per-example losses.

    Build it with :func:`track`. Besides its own methods it passes for the
    Cockpit where one is read (``cgn.to_frame(tracker)``, ``cgn.plot(tracker)``,
    ``cgn.write_log(tracker, path)``).

    Attributes:
        cockpit: The ``cockpit.Cockpit`` (its quantities: ``cockpit.quantities``).
        param_names: Names of the Cockpit's parameters, in its order.
        stream: The :class:`~cockpit_gradnoise.LogStream` of :meth:`stream_to`, or ``None``.
        latest: ``{quantity: (step, {statistic: value})}``: each quantity's newest row of
            the network, what a :class:`~cockpit_gradnoise.BatchSchedule` reads each step.
    """

    def __init__(self, cockpit: Cockpit, param_names: Sequence[str], switch=None,
                 model: Optional[nn.Module] = None):
        self.cockpit = cockpit
        # The model cgn.track prepared (weakly: the tracker may outlive it) and its parameters
        # then, checked at each tracked call (fsdp2.replaced_after_tracking).
        self._model = None if model is None else weakref.ref(model)
        self._tracked = dict(zip(param_names, cockpit.params))
        self.arming = arming.Arming(cockpit, switch)  # the hooks idle at untracked steps
        # Whether untracked steps may skip Cockpit's context (of the quantities it was built with).
        self._idles = arming.idle_step(cockpit, tracked=False)
        self.param_names = list(param_names)
        self.log = None  # the last log written, named in the report
        self.loggers = []
        #: Quantity name -> the last step given to the loggers (kept in :meth:`state_dict`).
        self.logged: Dict[str, int] = {}
        #: ``{step: {quantity: value}}`` given to the loggers after the step every quantity
        #: has given (what a resumed TensorBoard gets again after its purge).
        self.given: Dict[int, Dict[str, Any]] = {}
        #: ``(purge step, given)`` of a state loaded, for the loggers until the next step.
        self.resumed_loggers = None
        #: The step of the last call (``None`` before the first).
        self.last_step: Optional[int] = None
        self.stream: Optional[LogStream] = None
        # Kept as each step is computed (a stream then drops it from memory): a schedule
        # reads it each step without building a frame.
        self.latest: Dict[str, Tuple[int, Mapping[str, float]]] = {}
        for quantity in cockpit.quantities:  # checked for earlier gradients from the first step
            if hasattr(quantity, "known_params"):
                quantity.known_params = list(cockpit.params)

    def stream_to(self, path, *, resume: bool = True) -> Path:
        """Append each tracked step to the streamed log at ``path`` and drop it from memory.

        From now on the steps are written as they are computed (a JSON-lines
        log, :class:`~cockpit_gradnoise.LogStream`; ``.jsonl`` is added to a
        path without a suffix; a streamed log there is continued, or with
        ``resume=False`` kept under a new name), starting with what
        was tracked before. The quantities then hold no step between tracked
        calls (:data:`~cockpit_gradnoise.logs.stream.STEPS_IN_MEMORY`); :meth:`get_output`,
        :meth:`frame`, :meth:`plot`, :meth:`report` and :meth:`write` read
        the streamed log. A ``kill -9`` loses at most the last tracked step.

        Returns:
            The log's path.
        """
        if self.stream is not None:
            self.stream.close()
        self.stream = LogStream(path, resume=resume)
        self.stream.append(self.cockpit)
        self.log = self.stream.path
        return self.stream.path

    def state_dict(self) -> Dict[str, Any]:
        """The tracker's state for a checkpoint, saved next to the model's and optimizer's.

        Example::

            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "tracker": tracker.state_dict()}, path)

        Plain tensors, numbers, lists and dicts (``torch.load`` reads it with
        ``weights_only=True``): every quantity's running state, the step of
        the last call, and the log's path and position when streaming (the
        steps written so far are on disk first), else the steps tracked so far
        (:mod:`cockpit_gradnoise.checkpoint`).
        """
        from cockpit_gradnoise.checkpoint import tracker_state

        return tracker_state(self)

    def load_state_dict(self, state: Mapping[str, Any]):
        """Resume from :meth:`state_dict`: a tracker built as before continues where it was.

        The quantities' running state comes back, and the log is continued:
        a streamed log's records written after the checkpoint (by the run that
        died) are superseded, kept in the file but out of the frame
        (:meth:`LogStream.continue_from <cockpit_gradnoise.LogStream.continue_from>`);
        a tracker without a stream streams to the checkpoint's log.

        Raises:
            ValueError: Naming what differs, if the state is of a model with
                other parameters (names, shapes) or of other quantities,
                options or schedules.
        """
        from cockpit_gradnoise.checkpoint import load_tracker_state

        load_tracker_state(self, state)

    def close(self):
        """Close the streamed log's file (nothing to do without :meth:`stream_to`)."""
        if self.stream is not None:
            self.stream.close()

    def _append(self):
        if self.stream is not None:
            self.stream.append(self.cockpit)

    def __call__(self, step: int, losses: torch.Tensor, *, optimizer=None, loss=None,
                 reduction: Optional[str] = None, batch_size: Optional[int] = None,
                 info: Optional[Mapping] = None, micro_batch: Optional[int] = None,
                 micro_batches: Optional[int] = None, scaler=None,
                 loss_scaled: bool = False) -> "TrackedStep":
        """The ``with`` statement around one backward pass; it gives the loss to differentiate.

        Example::

            losses = F.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=opt) as loss:   # loss = losses.mean()
                loss.backward()

        Cockpit's ``info`` is ``{"batch_size": len(losses), "individual_losses":
        losses, "loss": loss}`` and ``"optimizer"`` when given, at every step
        and for every quantity. The package's quantities take the batch's size
        and the loss's scale (``1/N`` for the mean, ``1`` for the sum) from the
        tracker, which chose the loss, rather than back from ``info``'s values
        (:meth:`Step.begin <cockpit_gradnoise.step.Step.begin>`). With a
        quantity that needs the graph (Cockpit's ``HessMaxEV``), write
        ``loss.backward(create_graph=tracker.create_graph(step))``.

        Gradient accumulation: call it around every micro-batch of the
        optimizer step, with the same ``step``, ``micro_batch=k`` and
        ``micro_batches=K``; the loss it gives is ``losses.mean() / K``
        (``losses.sum()`` with ``reduction="sum"``), so that the accumulated
        gradient is that of one batch of all examples, and the quantities
        report the statistics of that batch after the last micro-batch
        (``docs/accumulation.md``)::

            opt.zero_grad()
            for k, (x, y) in enumerate(micro_batches):
                losses = F.cross_entropy(model(x), y, reduction="none")
                with tracker(step, losses, optimizer=opt, micro_batch=k,
                             micro_batches=len(micro_batches)) as loss:
                    loss.backward()                  # loss = losses.mean() / K
            opt.step()

        Args:
            step: The global step: an int (a NumPy integer or a 0-dim integer
                tensor is converted), growing over the whole run.
            losses: One loss per example, shape ``[N]`` (``reduction="none"``).
            optimizer: The optimizer (Cockpit's ``info["optimizer"]``).
            loss: The loss to differentiate, if not ``losses``' mean or sum;
                checked at tracked steps to be their mean or their sum.
            reduction: ``"mean"`` (default) or ``"sum"``: ``loss`` is
                ``losses.mean()`` or ``losses.sum()``. Not with ``loss``.
            batch_size: Checked to be ``len(losses)``.
            info: More keys for quantities of your own; not the four above.
            micro_batch: Under gradient accumulation, this micro-batch's
                place in the optimizer step, from 0.
            micro_batches: Under gradient accumulation, the number ``K`` of
                micro-batches of the optimizer step; ``loss=``, if given,
                must then be ``losses.mean() / K`` or ``losses.sum()``.
            scaler: The ``torch.amp.GradScaler`` whose ``scaler.scale(loss).backward()``
                the block runs: the statistics are those of the unscaled loss, and a
                step it skips (inf/NaN gradients) is logged as skipped, without rows
                (:mod:`cockpit_gradnoise.amp`).
            loss_scaled: ``loss=`` is already the scaled loss ``scaler.scale(loss)``, and
                the block differentiates it (what Lightning hands its callbacks).

        Raises:
            TypeError: If ``step`` is not an integer or ``losses`` not a tensor.
            ValueError: Naming the fix, if ``losses`` is not one loss per
                example, ``loss`` is neither their mean nor their sum, both
                ``loss`` and ``reduction`` or a wrong ``batch_size`` are
                given, or the loss does not depend on the parameters.
            RuntimeError: At a tracked step (its first micro-batch), if the model's parameters are not those
                ``cgn.track`` found (sharded by ``fully_shard`` after it, as Accelerate's
                ``prepare`` does, or replaced); on the way out of the block, if the
                backward pass differentiated a multiple of the loss it gave
                (``accelerator.backward`` under accumulation).
        """
        step = step_number(step, convert=True)  # a plain int before Cockpit keys anything by it
        losses = check_individual_losses(losses, "losses")  # the step's one check of them
        self.last_step = step
        tracked = self._tracks(step)
        micro = micro_batch_given(micro_batch, micro_batches)
        given = loss is not None
        loss = loss_to_differentiate(losses, loss, reduction, micro)
        scaled = amp.ScaledStep(scaler) if scaler is not None and tracked else None
        if loss_scaled and scaler is None:
            raise ValueError("loss_scaled=True needs scaler=, the GradScaler that scaled it")
        info_loss = loss
        if scaled is not None and loss_scaled:
            scaled.given, info_loss = loss, loss.detach() / scaled.scale  # the info's: unscaled
        scale = check_loss(info_loss, losses, tracked=tracked, micro=micro) if given else None
        if batch_size is not None and batch_size != len(losses):
            raise ValueError(
                f"batch_size={batch_size} but losses holds {len(losses)} per-example losses: "
                "leave batch_size out (it is len(losses))"
            )
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not require gradients: compute losses from the model's "
                "output outside torch.no_grad(), and do not detach them"
            )
        clashes = sorted(set(info) & set(DERIVED_KEYS)) if info else ()
        if clashes:
            raise ValueError(f"info= must not hold {clashes}: pass them as arguments")
        full = {"batch_size": losses.shape[0], "individual_losses": losses, "loss": info_loss,
                **({} if optimizer is None else {"optimizer": optimizer}), **(info or {})}
        if micro is not None:
            full.update({accumulation.MICRO_BATCH: micro.index,
                         accumulation.MICRO_BATCHES: micro.count})
        # At a tracked step's first call (its first micro-batch): a walk of the model's modules
        # and parameters, about 0.1 ms on the benchmark GPT, once per optimizer step and not
        # at each of its K micro-batches (nothing replaces parameters inside accumulation).
        first = micro is None or micro.index == 0
        model = None if self._model is None or not (tracked and first) else self._model()
        replaced = None if model is None else fsdp2.replaced_after_tracking(model, self._tracked)
        if replaced is not None:
            raise RuntimeError(f"step {step}: {replaced}")
        self.arming.at_call(step, optimizer, tracked)  # refuses a tracked step no hook recorded
        if not tracked and self._idles:
            return IdleStep(step, full)  # scaled is None: a GradScaler is divided out at tracked steps
        # The reduction is declared, not inferred back from the values (Opacus' loss_reduction).
        declared = declared_batch(losses, info_loss, reduction, micro, scale) if tracked else None
        return TrackedStep(self.cockpit, step, full, after=self._after_step, scaled=scaled,
                           declared=declared)

    def arm(self, step: int) -> bool:
        """Get the model's hooks ready for the forward pass of ``step``; whether they record it.

        The tracker arms them by itself for the step after each call (and after
        ``optimizer.step()`` of the optimizer it was given); call this before a
        step's forward pass when steps are not numbered consecutively. The hooks
        record only forward passes whose step needs per-example results
        (:mod:`cockpit_gradnoise.arming`).
        """
        return self.arming.arm(step_number(step, convert=True))

    def log_to(self, target) -> "Tracker":
        """Send every tracked step's numbers to ``target`` from now on; returns the tracker.

        Example::

            from torch.utils.tensorboard import SummaryWriter
            tracker.log_to(SummaryWriter("runs/tb"))   # or a wandb run, or a function

        Tags are ``<quantity>/<parameter>/<statistic>``
        (:mod:`cockpit_gradnoise.logs.loggers`). The tracker's own
        log (:meth:`write`) is unchanged.

        Args:
            target: A ``torch.utils.tensorboard.SummaryWriter``, a Weights &
                Biases run, or a function ``(step, {quantity: value}) -> None``.
        """
        from cockpit_gradnoise.logs.loggers import logger_for, resume_logger

        self.loggers.append(logger_for(target))
        if self.resumed_loggers is not None:  # a state loaded: its TensorBoard steps purged
            resume_logger(self.loggers[-1], *self.resumed_loggers)
        return self

    def _to_loggers(self):
        """Give the loggers each quantity's results stored since they last saw it."""
        if not self.loggers:
            return
        self.resumed_loggers = None
        new = {}
        for quantity in self.cockpit.quantities:
            self._new_results(new, type(quantity).__name__, quantity.output, lambda value: value)
        # The optimizer the tracker logs, in Cockpit's own output (tracked_step.record_optimizer).
        self._new_results(new, OPTIMIZER, self.cockpit.output, lambda values: values.get(OPTIMIZER))
        for step in sorted(new):
            for logger in self.loggers:
                logger(step, new[step])
            self.given.setdefault(step, {}).update(new[step])
        floor = min(self.logged.values(), default=None)  # every quantity has given up to it
        stale = [step for step in self.given if floor is not None and step <= floor]
        for step in stale + sorted(self.given)[:-GIVEN_STEPS]:
            self.given.pop(step, None)

    def _new_results(self, new: dict, name: str, output: Mapping, pick: Callable):
        """Add to ``new`` (``{step: {name: value}}``) ``pick(output[step])`` of the steps after
        the last one given to the loggers under ``name`` (``None``: nothing at that step)."""
        last = self.logged.get(name)
        # Newest first, stopping at the last one given: steps increase, so this reads
        # only the new results however long the run.
        for step in reversed(output):
            if last is not None and step <= last:
                break
            value = pick(output[step])
            if value is not None:
                new.setdefault(step, {})[name] = value
                self.logged[name] = max(step, self.logged.get(name, step))

    def _after_step(self):
        """After the quantities computed: the loggers get the new numbers, then the stream."""
        self._keep_latest()
        self._to_loggers()
        self._append()

    def _keep_latest(self):
        """:attr:`latest`: each quantity's newest row of the network (steps only grow, so
        the newest is the last one stored)."""
        for quantity in self.cockpit.quantities:
            if quantity.output:
                step = next(reversed(quantity.output))
                rows = quantity.output[step]
                if isinstance(rows, Mapping) and NETWORK in rows:
                    self.latest[type(quantity).__name__] = (step, rows[NETWORK])

    def record(self, step: int, quantity: str, statistics: Mapping[str, float]) -> None:
        """Log ``statistics`` of the network (``{name: number}``) under ``quantity`` at ``step``.

        Rows beside the quantities' (what a :class:`~cockpit_gradnoise.BatchSchedule`
        changed, and why), as the tracker's ``Optimizer`` rows: in the frame, the written
        and the streamed log (appended now), the checkpoint and the loggers.
        """
        step = step_number(step, convert=True)
        value = {NETWORK: {name: float(number) for name, number in statistics.items()}}
        self.cockpit.output[step][quantity] = value
        for logger in self.loggers:
            logger(step, {quantity: value})
        self._append()

    def _tracks(self, step) -> bool:
        return any(q.should_compute(step) for q in self.cockpit.quantities)

    def create_graph(self, step: int) -> bool:
        """Whether ``loss.backward`` must keep the graph at ``step`` (Cockpit's ``create_graph``)."""
        return self.cockpit.create_graph(step)

    def get_output(self) -> Mapping:
        """The output: ``{step: {quantity: result}}``; when streaming, the streamed log read back."""
        if self.stream is None:
            return self.cockpit.get_output()
        self._append()
        return read_log(self.stream.path) if self.stream.writer else {}

    def frame(self):
        """The tidy frame of every statistic tracked so far (:func:`~cockpit_gradnoise.to_frame`)."""
        return to_frame(self)

    def write(self, path) -> Optional[Path]:
        """Write the JSON log atomically (:func:`~cockpit_gradnoise.write_log`); return its path.

        Raises:
            ValueError: If ``path`` is the streamed log's (:meth:`stream_to`).
        """
        if self.stream is not None and json_log_path(path).resolve() == self.stream.path.resolve():
            raise ValueError(
                f"{self.stream.path} is the streamed log, which is already on disk: write the "
                "JSON log to another path"
            )
        written = write_log(self, path)
        self.log = written or self.log
        return written

    def plot(self, **kwargs):
        """The dashboard of what is tracked so far: :func:`~cockpit_gradnoise.plot`'s arguments."""
        from cockpit_gradnoise.views.sources import plot  # matplotlib only where a figure is drawn

        return plot(self, **kwargs)

    def advice(self, **kwargs):
        """What the noise scale tracked so far advises: :func:`~cockpit_gradnoise.advice`'s
        arguments; ``print`` it (``docs/advice.md``)."""
        if self.stream is not None:
            self._append()
            return advice(self.stream.path, **kwargs)
        return advice(self, **kwargs)

    def report(self, path=None, **kwargs) -> str:
        """The report of what is tracked so far: :func:`~cockpit_gradnoise.report`'s arguments."""
        if self.stream is not None:
            self._append()
            return report(self.stream.path, path, **kwargs)
        return report(self, path, **kwargs)


__all__ = ["track", "Tracker"]
