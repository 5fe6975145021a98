"""Send every tracked step's numbers to TensorBoard, Weights & Biases or a function.

The JSON log (:func:`~cockpit_gradnoise.write_log`) stays the reference
format; these loggers copy each number as a scalar under a tag that does not
change during a run::

    <quantity>/<parameter name>/<statistic>     e.g. GradientNoiseScale/all/b_simple

(``all`` is the network, :data:`~cockpit_gradnoise.NETWORK`). TensorBoard puts
each quantity in its own section (the part of the tag before the first ``/``).
:meth:`Tracker.log_to <cockpit_gradnoise.Tracker.log_to>` feeds them
after every tracked step.
"""

import warnings
from typing import Callable, Dict, Iterator, Mapping, Tuple

from cockpit_gradnoise.logs.frame import to_frame

#: One step's output, as Cockpit stores it: ``{quantity name: value}``.
StepOutput = Mapping[str, object]


def scalars(step: int, output: StepOutput) -> Iterator[Tuple[str, float]]:
    """``(tag, value)`` for every statistic of this package's quantities at one step.

    Non-finite values are given as they are (``nan``, ``inf``); Cockpit's own
    quantities, which are not stored per parameter, are left out, as in
    :func:`~cockpit_gradnoise.to_frame`.
    """
    frame = to_frame({step: dict(output)})
    for quantity, param, statistic, value in zip(
        frame["quantity"], frame["param"], frame["statistic"], frame["value"]
    ):
        yield f"{quantity}/{param}/{statistic}", float(value)


class TensorBoardLogger:
    """Writes each tracked step to a ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        writer: The ``SummaryWriter`` (or anything with its ``add_scalar``).
        prefix: Put before every tag (``"cgn/"`` gives ``cgn/GradientNoiseScale/...``).
    """

    def __init__(self, writer, prefix: str = ""):
        self.writer, self.prefix = writer, prefix

    def __call__(self, step: int, output: StepOutput) -> None:
        for tag, value in scalars(step, output):
            self.writer.add_scalar(self.prefix + tag, value, global_step=step)

    def purge(self, step: int) -> None:
        """Hide the events at steps ``>= step`` written before (by a run that died after its
        checkpoint), as ``SummaryWriter(purge_step=step)`` does: TensorBoard drops them
        where it reads this restart event."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        opener = getattr(self.writer, "_get_file_writer", None)  # SummaryWriter's, reopened if closed
        file_writer = opener() if opener is not None else getattr(self.writer, "file_writer", None)
        if file_writer is None:
            warnings.warn(f"{type(self.writer).__name__} has no event file: the steps a resumed "
                          "run logs again may show twice in TensorBoard", stacklevel=3)
            return
        file_writer.add_event(Event(step=step, file_version="brain.Event:2"))
        file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))


def resume_logger(logger, purge_step: int, given: Mapping[int, StepOutput]) -> None:
    """After a resume from a checkpoint: a logger that can purge (TensorBoard) hides its steps
    ``>= purge_step``, and gets again what the checkpoint's run had given it there (``given``,
    ``{step: output}``); other loggers are left as they are (they get the steps after the
    checkpoint's, as they come)."""
    purge = getattr(logger, "purge", None)
    if purge is None:
        return
    purge(purge_step)
    for step in sorted(given):
        logger(step, given[step])


class WandbLogger:
    """Logs each tracked step to a Weights & Biases run, as one ``run.log`` call.

    Args:
        run: The run of ``wandb.init()`` (or anything with its ``log``).
        prefix: Put before every key.
    """

    def __init__(self, run, prefix: str = "cgn/"):
        self.run, self.prefix = run, prefix

    def __call__(self, step: int, output: StepOutput) -> None:
        values: Dict[str, float] = {self.prefix + tag: value for tag, value in scalars(step, output)}
        if values:
            self.run.log(values, step=step)


def logger_for(target) -> Callable[[int, StepOutput], None]:
    """The logger that writes to ``target``.

    Args:
        target: A ``SummaryWriter`` (has ``add_scalar``), a W&B run (has
            ``log``), or a function ``(step, {quantity: value}) -> None``.

    Raises:
        TypeError: If ``target`` is none of these.
    """
    if hasattr(target, "add_scalar"):
        return TensorBoardLogger(target)
    if hasattr(target, "log") and callable(target.log):
        return WandbLogger(target)
    if callable(target):
        return target
    raise TypeError(
        f"cannot log to a {type(target).__name__}: give a "
        "torch.utils.tensorboard.SummaryWriter, a wandb run, or a function "
        "(step, {quantity: value}) -> None"
    )
