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
"""

import os
import warnings
from typing import Callable, Optional

from cockpit_gradnoise.losses import sequence_losses

import torch
import torch.nn.functional as F
import transformers

IGNORE_INDEX = -100  # transformers' label of tokens without a loss
#: The file of a checkpoint folder that holds the tracker's state (``torch.save``).
TRACKER_STATE = "cockpit_gradnoise_tracker.pt"


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
        args: The Trainer's positional arguments.
        kwargs: The Trainer's keyword arguments.

    """

    def __init__(self, *args, tracker, per_example_loss: Optional[Callable] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = tracker
        self.per_example_loss = per_example_loss or per_example_cross_entropy
        self.loss_is_scaled_for_ga = True  # the loss is ours (divided by K), never divided again
        self._tracked_step = None
        self._micro = (None, -1)  # (global step, index) of the last micro-batch
        self.add_callback(_SaveTrackerState(tracker))

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
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation: the Trainer's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = self.per_example_loss(outputs["logits"], labels)
        self._tracked_step = self.tracker(self.state.global_step, losses, optimizer=self.optimizer,
                                          **self._micro_batch())
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


class _SaveTrackerState(transformers.TrainerCallback):
    """Puts the tracker's state in each checkpoint folder the Trainer saves (its ``on_save``)."""

    def __init__(self, tracker):
        self.tracker = tracker

    def on_save(self, args, state, control, **kwargs):
        # Every process takes the state (a streamed log's own is on disk first); the first writes it.
        saved = self.tracker.state_dict()
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir,
                              f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(saved, os.path.join(folder, TRACKER_STATE + ".tmp"))
        os.replace(os.path.join(folder, TRACKER_STATE + ".tmp"), os.path.join(folder, TRACKER_STATE))
