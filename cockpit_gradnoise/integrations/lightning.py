"""Track a ``lightning.pytorch.Trainer`` run: one callback.

Example::

    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    class Classifier(lightning.pytorch.LightningModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = F.cross_entropy(self(x), y, reduction="none")
            self.per_example_losses = losses   # read by the callback
            return losses.mean()

    callback = TrackingCallback(every=10, log="runs/lightning")
    lightning.pytorch.Trainer(callbacks=[callback], max_steps=100).fit(Classifier(), loader)
    print(callback.tracker.report())

The callback prepares the LightningModule in place at ``setup`` (before
Lightning builds the optimizers; where the LightningModule has a
``configure_model``, which may shard it with FSDP2 as Lightning's
``ModelParallelStrategy`` asks, at ``on_fit_start``, over the parameters
as sharded: ``docs/distributed.md``), puts Lightning's backward pass of each step
inside the tracker's ``with`` statement (``on_before_backward`` /
``on_after_backward``), gives the numbers to the Trainer's TensorBoard logger
when it has one, and writes the log at the end of ``fit``.

With ``accumulate_grad_batches=K`` every micro-batch of an optimizer step
is tracked (the step is ``trainer.global_step``, the same for all ``K``),
and the quantities report the statistics of the accumulated batch
(``docs/accumulation.md``). Lightning divides each micro-batch's loss by
``K``, which is what the tracker expects. A last step of an epoch with
fewer than ``K`` micro-batches (Lightning still divides by ``K``) is not
tracked, with one warning.

Resuming: the callback keeps the tracker's state in Lightning's checkpoint
(its ``state_dict``, :meth:`Tracker.state_dict <cockpit_gradnoise.Tracker.state_dict>`),
and ``trainer.fit(model, ckpt_path=...)`` continues from it: the quantities'
running state, and the log (a streamed ``.jsonl`` log is continued, what the
run that died wrote after the checkpoint superseded; a JSON log is written at
the end of ``fit`` with the steps before the checkpoint too).

An adaptive batch schedule: ``TrackingCallback(schedule=cgn.BatchSchedule(...))``
consults the schedule after each optimizer step and sets
``trainer.accumulate_grad_batches`` to its accumulation (the DataLoader's
batch is the schedule's ``micro_batch``); its state is in the checkpoint
with the tracker's (:mod:`cockpit_gradnoise.integrations.scheduling`,
``docs/training-setups.md``).
"""

import warnings
from typing import Callable, Optional, Sequence, Union

from cockpit_gradnoise.integrations.scheduling import ScheduleDriver
from cockpit_gradnoise.tracking import track

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

#: Precisions whose backward pass the quantities support: with ``"bf16-mixed"``
#: and ``"16-mixed"`` Lightning runs the forward pass under ``torch.autocast``
#: (the extensions see each layer's factors as it computed with them,
#: :mod:`cockpit_gradnoise.extensions.precision`); ``"16-mixed"``'s GradScaler
#: is divided out and its skipped steps logged (:mod:`cockpit_gradnoise.amp`).
SUPPORTED_PRECISIONS = ("32-true", "64-true", "32", "64", "bf16-mixed", "16-mixed")
_WHERE = "TrackingCallback(schedule=)"


class TrackingCallback(pl.Callback):
    """Tracks the quantities of :func:`~cockpit_gradnoise.track` during ``Trainer.fit``.

    Args:
        every: Track every ``every``-th optimizer step (``trainer.global_step``),
            or a schedule function ``step -> bool``.
        quantities: As :func:`~cockpit_gradnoise.track`'s (``"all"``, ``"cheap"``, a list).
        losses_attribute: The LightningModule attribute that its
            ``training_step`` sets to the batch's per-example losses (shape
            ``[N]``); the loss it returns must be their mean or their sum.
        log: Where to write the log at the end of ``fit`` (``None``: not written); a
            path ending in ``.jsonl`` is streamed during ``fit`` instead
            (:meth:`Tracker.stream_to <cockpit_gradnoise.Tracker.stream_to>`).
        tensorboard: Give every tracked step to the Trainer's logger when it
            is a TensorBoard logger (tags ``<quantity>/<parameter>/<statistic>``).
        schedule: A :class:`~cockpit_gradnoise.BatchSchedule`: after each optimizer
            step it is updated and ``trainer.accumulate_grad_batches`` set to its
            accumulation (a change takes effect where the epoch's batches allow,
            :mod:`~cockpit_gradnoise.integrations.scheduling`); ``None``: the
            Trainer's accumulation is left alone.
        **track_options: ``quantiles=``, ``options=``, ``verbose=`` of
            :func:`~cockpit_gradnoise.track`.

    Attributes:
        tracker: The :class:`~cockpit_gradnoise.Tracker`, once ``fit`` has
            started: ``callback.tracker.report()``, ``.frame()``, ``.plot()``.
        driver: The :class:`~cockpit_gradnoise.integrations.scheduling.ScheduleDriver`
            of ``schedule`` (its ``applied``: the changes as they took effect), or ``None``.
    """

    def __init__(self, every: Union[int, Callable[[int], bool]] = 10,
                 quantities: Union[str, Sequence] = "all", *,
                 losses_attribute: str = "per_example_losses", log=None,
                 tensorboard: bool = True, schedule=None, **track_options):
        self.every, self.quantities, self.track_options = every, quantities, track_options
        self.losses_attribute, self.log_path, self.tensorboard = losses_attribute, log, tensorboard
        self.tracker = None
        self._loaded = None  # a checkpoint's tracker state loaded before setup
        self._tracked_step = None
        self._batch_idx = 0
        self._warned_short = False
        self.driver = None if schedule is None else ScheduleDriver(schedule)
        self._steps_before = 0  # trainer.global_step at the batch's start

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.tracker is not None:  # another fit: its streamed log continued
            if self._streamed() and not self.tracker.stream.writes:
                self.tracker.stream_to(self.log_path)
            return
        _check_trainer(trainer)
        if not is_overridden("configure_model", pl_module):  # else at on_fit_start, as sharded
            self._start(trainer, pl_module)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.tracker is None:  # configure_model ran since setup: its parameters (FSDP2's)
            self._start(trainer, pl_module)

    def _start(self, trainer, pl_module) -> None:
        """Prepare the LightningModule in place and build the tracker over its parameters."""
        prepared, self.tracker = track(pl_module, self.every, self.quantities,
                                       use_converter=False, **self.track_options,
                                       log=self.log_path if self._streamed() else None)
        if prepared is not pl_module:  # cannot happen without the converter; say so if it does
            raise RuntimeError("the LightningModule must be prepared in place")
        experiment = getattr(trainer.logger, "experiment", None)
        if self.tensorboard and hasattr(experiment, "add_scalar"):
            self.tracker.log_to(experiment)
        if self._loaded is not None:
            self.tracker.load_state_dict(self._loaded)
            self._loaded = None

    def state_dict(self) -> dict:
        """The tracker's state, for Lightning's checkpoint (:meth:`Tracker.state_dict
        <cockpit_gradnoise.Tracker.state_dict>`); empty before ``fit``."""
        state = {} if self.tracker is None else {"tracker": self.tracker.state_dict()}
        if self.driver is not None:
            state["schedule"] = self.driver.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume the tracker (and the schedule) from Lightning's checkpoint (``fit(ckpt_path=...)``)."""
        if self.driver is not None and "schedule" in state_dict:
            self.driver.load_state_dict(state_dict["schedule"])
        state = state_dict.get("tracker")
        if state is None:
            return
        if self.tracker is None:  # Lightning restores after setup; kept for setup if not
            self._loaded = state
        else:
            self.tracker.load_state_dict(state)

    def _streamed(self) -> bool:
        return self.log_path is not None and str(self.log_path).endswith(".jsonl")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.driver is not None:  # the checkpoint's accumulation when resumed
            _check_schedulable(trainer)
            self.driver.check([c.scheduler for c in trainer.lr_scheduler_configs], _WHERE)
            trainer.accumulate_grad_batches = self.driver.accumulation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx  # its place in the epoch: the micro-batch's
        self._steps_before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.driver is None or trainer.global_step == self._steps_before:
            return  # no schedule, or no optimizer step after this batch
        # Lightning has stepped its schedulers; ModelCheckpoint saves after this (it runs last).
        position = (batch_idx + 1) % trainer.num_training_batches  # 0: the epoch's end
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        trainer.accumulate_grad_batches = self.driver.after_step(
            trainer.global_step - 1, self.tracker, _optimizer(trainer), schedulers, position)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        losses = getattr(pl_module, self.losses_attribute, None)
        if losses is None:
            raise ValueError(
                f"TrackingCallback: {type(pl_module).__name__}.training_step must set "
                f"self.{self.losses_attribute} to the batch's per-example losses, e.g. "
                f"`losses = F.cross_entropy(out, y, reduction='none'); "
                f"self.{self.losses_attribute} = losses; return losses.mean()`"
            )
        setattr(pl_module, self.losses_attribute, None)  # never read twice
        micro = self._micro_batch(trainer)
        if micro is False:
            return
        # Under "16-mixed" Lightning hands over the loss its GradScaler has scaled.
        scaler = trainer.scaler
        self._tracked_step = self.tracker(
            trainer.global_step, losses, loss=loss, optimizer=_optimizer(trainer),
            scaler=scaler, loss_scaled=scaler is not None, **micro
        )
        self._tracked_step.__enter__()

    def _micro_batch(self, trainer):
        """``micro_batch=``/``micro_batches=`` of this backward pass; ``False``: not tracked.

        Lightning steps the optimizer after ``accumulate_grad_batches``
        batches of an epoch, and after its last batch.
        """
        count = trainer.accumulate_grad_batches
        if count == 1:
            return {}
        index = self._batch_idx % count
        in_step = min(count, trainer.num_training_batches - (self._batch_idx - index))
        if in_step < count:  # the loss is divided by count all the same
            if not self._warned_short:
                self._warned_short = True
                warnings.warn(
                    f"TrackingCallback: the last optimizer step of an epoch accumulates "
                    f"{in_step} batches, fewer than accumulate_grad_batches={count}, and "
                    f"Lightning divides their losses by {count} all the same: such steps are "
                    "not tracked. Make the number of batches per epoch a multiple of "
                    "accumulate_grad_batches to track every step",
                    stacklevel=2,
                )
            return False
        return {"micro_batch": index, "micro_batches": count}


    def on_after_backward(self, trainer, pl_module) -> None:
        tracked, self._tracked_step = self._tracked_step, None
        if tracked is not None:
            tracked.__exit__(None, None, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        tracked, self._tracked_step = self._tracked_step, None
        if tracked is not None:  # leave BackPACK's context; nothing of this step is kept
            tracked.__exit__(type(exception), exception, exception.__traceback__)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.tracker is not None and self._streamed():
            self.tracker.close()  # its summary line written
        elif self.log_path is not None and self.tracker is not None:
            self.tracker.write(self.log_path)


def _check_trainer(trainer) -> None:
    precision = str(trainer.precision)
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"TrackingCallback: precision={precision!r} is not supported yet: use "
            f"one of {SUPPORTED_PRECISIONS}"
        )


def _check_schedulable(trainer) -> None:
    """A schedule needs Lightning's own accumulation of one optimizer, and schedulers it can scale."""
    where = _WHERE
    if not trainer.lightning_module.automatic_optimization or len(trainer.optimizers) != 1:
        raise ValueError(f"{where} needs automatic optimization with one optimizer: the "
                         "accumulation it sets is Lightning's accumulate_grad_batches")
    for callback in trainer.callbacks:
        if isinstance(callback, pl.callbacks.GradientAccumulationScheduler):
            raise ValueError(f"{where}: remove the GradientAccumulationScheduler, the schedule "
                             "sets accumulate_grad_batches")
    if "deepspeed" in type(trainer.strategy).__name__.lower():
        raise ValueError(f"{where}: DeepSpeed fixes the accumulation in its configuration at "
                         "the start; use the schedule with the default strategy or DDP")


def _optimizer(trainer) -> Optional[object]:
    optimizers = trainer.optimizers
    return optimizers[0] if len(optimizers) == 1 else None
