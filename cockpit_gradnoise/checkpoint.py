"""A tracker's state for a checkpoint: saved with the model's and the optimizer's, loaded on resume.

:meth:`Tracker.state_dict <cockpit_gradnoise.Tracker.state_dict>` and
:meth:`Tracker.load_state_dict <cockpit_gradnoise.Tracker.load_state_dict>`
follow torch's convention (plain tensors, numbers, strings, lists and dicts:
``torch.save`` keeps it, ``torch.load`` with ``weights_only=True`` reads it
back)::

    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "tracker": tracker.state_dict(), "step": step}, "ckpt.pt")
    ...
    checkpoint = torch.load("ckpt.pt")
    model.load_state_dict(checkpoint["model"]); opt.load_state_dict(checkpoint["optimizer"])
    tracker.load_state_dict(checkpoint["tracker"])      # a tracker built as before

The state holds every quantity's running state (its ``state_dict``:
GradientNoiseScale's moving averages, UpdateSize's parameters cached at a
start step whose end has not come, TwoBatchNoiseScale's averages and
micro-batches, the last step recorded, the warnings told), the step of the
tracker's last call, and where its log stands: a streamed log's path and
position (:meth:`LogStream.position <cockpit_gradnoise.LogStream.position>`;
the resumed tracker continues that log and supersedes what the run that died
wrote after the checkpoint), or, for a tracker that keeps its steps in
memory, those steps. What is checked, so that the numbers after a resume are
those of a run that never stopped: the parameters' names and shapes, the
quantities, their options and their schedules.
"""

import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from cockpit_gradnoise.quantities.update_size import LayerUpdate

import torch

#: What a tracker's state says it is (its ``"format"``).
FORMAT = "cockpit-gradnoise-tracker"
#: The version of a tracker's state; :func:`load_tracker_state` reads this one and older.
VERSION = 1
#: The options of a quantity compared on load (those that change its numbers).
OPTIONS = ("smoothing", "quantiles")
#: The steps whose schedule decision is compared, from 0 and after the checkpoint's step.
SCHEDULE_WINDOW = 64
_UPDATE = "cockpit_gradnoise.LayerUpdate"  # the key of an UpdateSize item in a state


def tracker_state(tracker) -> Dict[str, Any]:
    """The state of :meth:`Tracker.state_dict <cockpit_gradnoise.Tracker.state_dict>`."""
    streamed = tracker.stream is not None
    if streamed:
        tracker.stream.append(tracker.cockpit)  # every step computed on disk, none in memory
    quantities = []
    for quantity in tracker.cockpit.quantities:
        own = getattr(quantity, "state_dict", None)
        if own is None:
            warnings.warn(
                f"{type(quantity).__name__} (not this package's) has no state_dict: a run "
                "resumed from this checkpoint starts it afresh", stacklevel=3)
        quantities.append({
            "name": type(quantity).__name__,
            "options": options_of(quantity),
            "schedule": schedule_of(quantity, tracker.last_step),
            "state": None if own is None else own(),
            "output": None if streamed else _plain_output(quantity.output,
                                                          type(quantity).__name__),
        })
    return {
        "format": FORMAT, "version": VERSION, "step": tracker.last_step,
        "params": [[name, list(param.shape)]
                   for name, param in zip(tracker.param_names, tracker.cockpit.params)],
        "quantities": quantities,
        "cockpit_output": None if streamed else _plain_output(tracker.cockpit.output,
                                                              "cockpit.log"),
        "loggers": {"logged": dict(tracker.logged),
                    "given": _plain_output(tracker.given, "the loggers") or {}},
        "log": tracker.stream.position() if streamed else None,
    }


def load_tracker_state(tracker, state: Mapping[str, Any]):
    """Load ``state`` into ``tracker`` after checking that it fits (nothing loaded if not).

    Raises:
        ValueError: Naming each difference and the fix: not a tracker's
            state, other parameters (names or shapes), other quantities,
            options or schedules.
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise ValueError("not a tracker's state: give tracker.load_state_dict what "
                         "tracker.state_dict() returned (saved with torch.save)")
    if state["version"] > VERSION:
        raise ValueError(f"the tracker state is of version {state['version']}, newer than this "
                         f"package reads ({VERSION}): update cockpit-gradnoise")
    differences = _differences(tracker, state)
    if differences:
        raise ValueError(
            "the tracker state does not fit this tracker:\n- " + "\n- ".join(differences)
            + "\nBuild the tracker as the run that saved it did (cgn.track on the same model, "
            "with the same quantities=, options=, every= and frozen parameters), or start "
            "afresh without load_state_dict")
    for quantity, saved in zip(_by_name(tracker.cockpit.quantities, state), state["quantities"]):
        if saved["state"] is not None and hasattr(quantity, "load_state_dict"):
            quantity.load_state_dict(saved["state"])
        if saved["output"] is not None:
            quantity.output.update(_from_plain(saved["output"]))
    if state["cockpit_output"] is not None:
        tracker.cockpit.output.update(_from_plain(state["cockpit_output"]))
    tracker.last_step = state["step"]
    _resume_loggers(tracker, state["loggers"])
    log = state["log"]
    if log is None:
        return
    if tracker.stream is None:
        tracker.stream_to(log["path"])
    elif Path(log["path"]).resolve() != tracker.stream.path.resolve():
        warnings.warn(f"the tracker streams to {tracker.stream.path}, the checkpoint's log is "
                      f"{log['path']}: the tracker's log is continued, the checkpoint's left as it "
                      "is", stacklevel=3)
        return
    tracker.stream.continue_from(log)


def _resume_loggers(tracker, saved):
    """The steps given to the loggers; a TensorBoard's steps from the first one the resumed
    run gives are purged (the run that died logged them) and what the checkpoint's run gave
    there is given again (:func:`~cockpit_gradnoise.logs.loggers.resume_logger`)."""
    from cockpit_gradnoise.logs.loggers import resume_logger

    tracker.logged.update(saved["logged"])
    tracker.given = _from_plain(saved["given"])
    # Every quantity gives steps after its own last one (logged): the first of them is the
    # earliest step given but not by all, or after the last.
    purge = min(tracker.given, default=max(tracker.logged.values(), default=-1) + 1)
    tracker.resumed_loggers = (purge, dict(tracker.given))
    for logger in tracker.loggers:
        resume_logger(logger, *tracker.resumed_loggers)


def options_of(quantity) -> Dict[str, Any]:
    """The options of ``quantity`` that change its numbers (:data:`OPTIONS`), as plain values."""
    found = {}
    for name in OPTIONS:
        value = getattr(quantity, name, None)
        if value is not None:
            found[name] = list(value) if isinstance(value, (tuple, list)) else value
    return found


def schedule_of(quantity, step: Optional[int]) -> List[int]:
    """The steps ``quantity``'s schedule tracks among the first :data:`SCHEDULE_WINDOW` and
    as many after ``step`` (a schedule is a function: compared by what it decides)."""
    schedule = getattr(quantity, "_track_schedule", None)
    if schedule is None:
        return []
    after = 0 if step is None else step + 1
    steps = sorted(set(range(SCHEDULE_WINDOW)) | set(range(after, after + SCHEDULE_WINDOW)))
    return [s for s in steps if schedule(s)]


def _differences(tracker, state) -> List[str]:
    found = []
    saved = {name: shape for name, shape in state["params"]}
    here = {name: list(param.shape) for name, param in zip(tracker.param_names, tracker.cockpit.params)}
    missing, extra = sorted(set(saved) - set(here)), sorted(set(here) - set(saved))
    if missing or extra:
        found.append(f"parameters: the state's model has {missing} that this one lacks, "
                     f"this one has {extra} that the state's lacks")
    elif list(saved) != list(here):
        found.append("parameters: the same names in another order")
    shapes = [f"{name} {saved[name]} there, {shape} here" for name, shape in here.items()
              if name in saved and saved[name] != shape]
    if shapes:
        found.append(f"parameter shapes differ: {'; '.join(shapes)}")
    names = [q["name"] for q in state["quantities"]]
    ours = [type(q).__name__ for q in tracker.cockpit.quantities]
    if sorted(names) != sorted(ours):
        found.append(f"quantities: the state's are {names}, this tracker's {ours}")
        return found
    for quantity, saved_quantity in zip(_by_name(tracker.cockpit.quantities, state),
                                        state["quantities"]):
        name, options = saved_quantity["name"], options_of(quantity)
        if options != saved_quantity["options"]:
            found.append(f"{name}: options {saved_quantity['options']} in the state, "
                         f"{options} here")
        schedule = schedule_of(quantity, state["step"])
        if schedule != saved_quantity["schedule"]:
            differ = sorted(set(schedule) ^ set(saved_quantity["schedule"]))
            found.append(f"{name}: another schedule (every=): steps {differ[:8]} are tracked by "
                         "one and not the other")
    return found


def _by_name(quantities, state) -> list:
    """``quantities`` in the order of the state's."""
    by_name = {type(q).__name__: q for q in quantities}
    return [by_name[saved["name"]] for saved in state["quantities"]]


def _plain_output(output: Mapping, owner: str) -> Optional[Dict[int, Any]]:
    """``{step: value}`` as plain data (:func:`_plain`); ``None`` if a value is not plain
    (a foreign quantity's arrays), with a warning."""
    try:
        return {int(step): _plain(value) for step, value in output.items()}
    except TypeError:
        warnings.warn(
            f"{owner}: its stored values are not plain numbers, lists and dicts, so the "
            "checkpoint does not keep them: stream the log (cgn.track(..., log=path)) to keep "
            "every step", stacklevel=4)
        return None


def _plain(value):
    """``value`` as plain data, an UpdateSize item as ``{_UPDATE: [name, norm, start norm]}``.

    Raises:
        TypeError: A value that ``torch.load(weights_only=True)`` would refuse.
    """
    if isinstance(value, LayerUpdate):
        return {_UPDATE: [value.name, value.norm, value.start_norm]}
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, (str, int)) for key in value):
        return {key: _plain(item) for key, item in value.items()}
    raise TypeError(f"{type(value).__name__} is not plain data")


def _from_plain(value):
    """The value :func:`_plain` was given (tuples come back as lists)."""
    if isinstance(value, dict):
        if set(value) == {_UPDATE}:
            return LayerUpdate(*value[_UPDATE])
        return {key: _from_plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_plain(item) for item in value]
    return value


__all__ = ["tracker_state", "load_tracker_state", "options_of", "schedule_of", "FORMAT", "VERSION"]
