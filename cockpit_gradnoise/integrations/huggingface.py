"""Track a Hugging Face ``transformers.Trainer`` run: a Trainer subclass.

Example::

    from cockpit_gradnoise.integrations.huggingface import TrackingTrainer

    model, tracker = cgn.track(model, every=10)      # before the Trainer builds its optimizer
    trainer = TrackingTrainer(tracker=tracker, model=model, args=args, train_dataset=data)
    trainer.train()
    print(tracker.report())

The Trainer's ``Callback`` events have no place around the backward pass, so
this is a subclass: its ``compute_loss`` computes the per-example losses from
the model's logits and enters the tracker's ``with`` statement, and its
``training_step`` leaves it once the Trainer's backward pass is done.

The loss it differentiates is the mean of the per-example losses, which for a
causal language model (:func:`per_example_cross_entropy`) is the Trainer's own
loss: the mean over all labelled tokens of the batch (labels ``-100`` ignored).

With ``gradient_accumulation_steps=K`` every micro-batch of an optimizer
step is tracked with the same step (``state.global_step``), and the
quantities report the statistics of the accumulated batch
(``docs/accumulation.md``). Each micro-batch differentiates the mean of its
per-example losses divided by the number of micro-batches of the step (as
the Trainer does without ``num_items_in_batch``): micro-batches weigh
equally, not by their numbers of labelled tokens.

Resuming: each checkpoint folder the Trainer saves (``checkpoint-<step>``)
also holds the tracker's state (:data:`TRACKER_STATE`,
:meth:`Tracker.state_dict <cockpit_gradnoise.Tracker.state_dict>`), and
``train(resume_from_checkpoint=...)`` loads it into the tracker before
training goes on: the quantities' running state and the log continue where
the checkpoint left them.

An adaptive batch schedule: ``TrackingTrainer(schedule=cgn.BatchSchedule(...))``
sets ``args.gradient_accumulation_steps`` to the schedule's accumulation after
each optimizer step (``per_device_train_batch_size`` is its ``micro_batch``);
its state is saved in each checkpoint folder (:data:`SCHEDULE_STATE`) and the
place in the data with it (:mod:`cockpit_gradnoise.integrations.scheduling`,
``docs/training-setups.md``).
"""

import os
import sys
import warnings
from typing import Callable, Optional

from cockpit_gradnoise.integrations.scheduling import ScheduleDriver
from cockpit_gradnoise.losses import sequence_losses

import torch
import torch.nn.functional as F
import transformers

IGNORE_INDEX = -100  # transformers' label of tokens without a loss
#: The file of a checkpoint folder that holds the tracker's state (``torch.save``).
TRACKER_STATE = "cockpit_gradnoise_tracker.pt"
#: The file of a checkpoint folder that holds the batch schedule's state and the place in the data.
SCHEDULE_STATE = "cockpit_gradnoise_schedule.pt"


def per_example_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                              weighting: str = "tokens") -> torch.Tensor:
    """Each example's cross-entropy: classification (``[N, C]``) or language modelling (``[N, T, V]``).

    For ``[N, T, V]`` logits the labels are shifted by one token (each position
    predicts the next, as transformers' causal language models do), tokens
    labelled ``-100`` are ignored, and the losses are
    :func:`~cockpit_gradnoise.sequence_losses` of the token losses: with
    ``weighting="tokens"`` their mean is the Trainer's own loss (the mean
    over all labelled tokens of the batch).
    """
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels, reduction="none")
    logits, labels = logits[:, :-1], labels[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none",
                             ignore_index=IGNORE_INDEX)
    return sequence_losses(tokens, labels, ignore_index=IGNORE_INDEX, weighting=weighting)


class TrackingTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose training steps the tracker tracks.

    Args:
        tracker: The :class:`~cockpit_gradnoise.Tracker` of
            :func:`~cockpit_gradnoise.track` on the model given to the Trainer.
        per_example_loss: ``(logits, labels) -> losses [N]``;
            :func:`per_example_cross_entropy` by default.
        schedule: A :class:`~cockpit_gradnoise.BatchSchedule`: after each optimizer
            step it is updated and ``args.gradient_accumulation_steps`` set to its
            accumulation (a change takes effect where the epoch's batches allow,
            :mod:`~cockpit_gradnoise.integrations.scheduling`). With ``max_steps``
            the run takes that many optimizer steps over as many epochs as they
            need; with ``num_train_epochs`` it ends after them, its steps planned
            (the scheduler's horizon) at the first step's accumulation.
        args: The Trainer's positional arguments.
        kwargs: The Trainer's keyword arguments.

    """

    def __init__(self, *args, tracker, per_example_loss: Optional[Callable] = None,
                 schedule=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = tracker
        self.per_example_loss = per_example_loss or per_example_cross_entropy
        self.loss_is_scaled_for_ga = True  # the loss is ours (divided by K), never divided again
        self._tracked_step = None
        self._micro = (None, -1)  # (global step, index) of the last micro-batch
        self.add_callback(_SaveTrackerState(tracker))
        #: The :class:`~cockpit_gradnoise.integrations.scheduling.ScheduleDriver` of ``schedule``.
        self.driver = None if schedule is None else ScheduleDriver(schedule)
        self._place = (0, 0)  # (epoch, micro-batches done in it) of the data
        self._resumed_place = None
        self._steps_in_epoch = None
        if self.driver is not None:
            if self.is_deepspeed_enabled:
                raise ValueError("TrackingTrainer(schedule=): DeepSpeed fixes the accumulation in "
                                 "its configuration at the start; train without DeepSpeed")
            self.add_callback(_ApplySchedule(self))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``; resuming from a checkpoint, the tracker resumes from its state.

        Raises:
            ValueError: The checkpoint's tracker state does not fit the tracker
                (:meth:`Tracker.load_state_dict <cockpit_gradnoise.Tracker.load_state_dict>`).
        """
        folder = resume_from_checkpoint
        if folder is True:
            folder = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
        if folder:
            path = os.path.join(folder, TRACKER_STATE)
            if os.path.isfile(path):
                self.tracker.load_state_dict(torch.load(path, weights_only=True))
            else:
                warnings.warn(f"{folder} holds no tracker state ({TRACKER_STATE}; saved by "
                              "another Trainer?): the quantities start afresh", stacklevel=2)
        if self.driver is not None:
            self._place, self._resumed_place = (0, 0), None
            path = os.path.join(folder, SCHEDULE_STATE) if folder else None
            if path and os.path.isfile(path):
                state = torch.load(path, weights_only=True)
                self.driver.load_state_dict(state["driver"])
                self._resumed_place = tuple(state["place"])
            elif folder:
                raise ValueError(f"{folder} holds no batch schedule state ({SCHEDULE_STATE}): "
                                 "resume a run of a TrackingTrainer(schedule=) from its checkpoint")
            self.args.gradient_accumulation_steps = self.driver.accumulation
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def set_initial_training_values(self, args, dataloader):
        """The Trainer's plan; with a schedule, one whose epochs and steps any accumulation fits.

        An epoch's loop runs up to one optimizer step per batch (each takes
        ``args.gradient_accumulation_steps`` batches, fewer at the epoch's end),
        and with ``max_steps`` the epochs are not counted: the run stops at
        ``max_steps`` (as the Trainer does for data of unknown length).
        """
        if self.driver is not None and not transformers.trainer_utils.has_length(dataloader):
            raise ValueError("TrackingTrainer(schedule=) needs a training dataset with a length "
                             "(the epoch's place decides where a new accumulation can start)")
        values = list(super().set_initial_training_values(args, dataloader))
        if self.driver is not None:
            self._steps_in_epoch = values[5]
            values[1] = max(values[5], 1)  # update steps per epoch: at most one per batch
            if args.max_steps > 0:
                values[0] = sys.maxsize
        return tuple(values)

    def _init_training_state(self, *args, **kwargs):
        # With a schedule the Trainer's count of the batches seen (steps x its accumulation)
        # does not hold: the place saved with the schedule's state does.
        epochs, batches = super()._init_training_state(*args, **kwargs)
        if self.driver is not None and self._resumed_place is not None:
            epochs, batches = self._place = self._resumed_place
            if self.args.ignore_data_skip:
                batches = 0
        return epochs, batches

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation: the Trainer's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = self.per_example_loss(outputs["logits"], labels)
        # With fp16 on GPUs Accelerate's backward is scaler.scale(loss).backward(): the tracker
        # divides the scale out, and logs a step the scaler skips (cockpit_gradnoise.amp).
        scaler = getattr(self.accelerator, "scaler", None)
        self._tracked_step = self.tracker(self.state.global_step, losses, optimizer=self.optimizer,
                                          scaler=scaler, **self._micro_batch())
        loss = self._tracked_step.__enter__()
        return (loss, outputs) if return_outputs else loss

    def _micro_batch(self) -> dict:
        """``micro_batch=``/``micro_batches=`` of this micro-batch (none without accumulation).

        The Trainer counts the micro-batches of the step it is in
        (``current_gradient_accumulation_steps``: fewer at the end of an
        epoch) and increments ``global_step`` after the last.
        """
        count = getattr(self, "current_gradient_accumulation_steps",
                        self.args.gradient_accumulation_steps)
        step, index = self._micro
        index = index + 1 if step == self.state.global_step else 0
        self._micro = (self.state.global_step, index)
        return {} if count == 1 else {"micro_batch": index, "micro_batches": count}

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            result = super().training_step(model, inputs, num_items_in_batch)
        except BaseException as error:
            self._leave(type(error), error, error.__traceback__)
            raise
        self._leave(None, None, None)
        return result

    def _leave(self, *exception):
        tracked, self._tracked_step = self._tracked_step, None
        if tracked is not None:
            tracked.__exit__(*exception)


class _ApplySchedule(transformers.TrainerCallback):
    """Updates the schedule after each optimizer step and sets the Trainer's accumulation;
    saves the schedule's state and the place in the data in each checkpoint folder."""

    def __init__(self, trainer: TrackingTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.trainer.driver.check([lr_scheduler], "TrackingTrainer(schedule=)")

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        trainer = self.trainer
        epoch, done = trainer._place
        done += trainer.current_gradient_accumulation_steps
        trainer._place = (epoch, done)
        # The Trainer has stepped its scheduler; a checkpoint is saved after this.
        args.gradient_accumulation_steps = trainer.driver.after_step(
            state.global_step - 1, trainer.tracker, optimizer, [lr_scheduler],
            done % trainer._steps_in_epoch)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.trainer._place = (self.trainer._place[0] + 1, 0)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        epoch, done = self.trainer._place
        if done >= self.trainer._steps_in_epoch:  # a step that ended the epoch
            epoch, done = epoch + 1, 0
        saved = {"driver": self.trainer.driver.state_dict(), "place": [epoch, done]}
        _save(saved, args.output_dir, state.global_step, SCHEDULE_STATE)


class _SaveTrackerState(transformers.TrainerCallback):
    """Puts the tracker's state in each checkpoint folder the Trainer saves (its ``on_save``)."""

    def __init__(self, tracker):
        self.tracker = tracker

    def on_save(self, args, state, control, **kwargs):
        # Every process takes the state (a streamed log's own is on disk first); the first writes it.
        saved = self.tracker.state_dict()
        if state.is_world_process_zero:
            _save(saved, args.output_dir, state.global_step, TRACKER_STATE)


def _save(saved, output_dir: str, step: int, name: str) -> None:
    """``torch.save`` into the Trainer's checkpoint folder of ``step``, whole or not at all."""
    folder = os.path.join(output_dir, f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save(saved, os.path.join(folder, name + ".tmp"))
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
