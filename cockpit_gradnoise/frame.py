"""Stored numbers in, one tidy table out; logs written without loss.

Quantities store, per step, ``{param name: {statistic: value}}``, parameters
in model order and ``"all"`` last. Non-finite values are stored as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` because ``Cockpit.write`` (json_tricks
with ``allow_nan=False``) raises on a raw non-finite float. :func:`to_frame`
decodes them back to floats.

Reading a log imports neither torch nor Cockpit: ``UpdateSize``'s items are
read as :class:`LoggedUpdate` instead of the quantity's own class.
"""

import os
import uuid
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional

from cockpit_gradnoise.distributed import WRITER_RANK, is_writer
from cockpit_gradnoise.schema import decode_float, encode_float, update_statistics

import json_tricks
import numpy
import pandas

COLUMNS = ["step", "quantity", "param", "statistic", "value"]

#: The class ``UpdateSize`` stores its items as; json_tricks records it in logs.
_UPDATE_CLASS = "LayerUpdate"


class LoggedUpdate(NamedTuple):
    """One parameter's update as read from a log (``UpdateSize``'s stored item).

    json_tricks would rebuild the stored item by importing the quantity's
    module, which imports torch and Cockpit; :func:`read_log` reads it as
    this instead, with the same attributes.
    """

    name: str
    norm: float
    start_norm: float


def _logged_update_hook(dct, properties=None):
    """json_tricks hook: a stored ``LayerUpdate`` as a :class:`LoggedUpdate`."""
    instance_type = dct.get("__instance_type__")
    if not instance_type or list(instance_type)[-1:] != [_UPDATE_CLASS]:
        return dct
    module = instance_type[0] or ""
    if not module.startswith("cockpit_gradnoise"):
        return dct
    attributes = dct["attributes"]
    return LoggedUpdate(
        str(attributes["name"]),
        decode_float(attributes["norm"]),
        decode_float(attributes["start_norm"]),
    )


def _log_path(path) -> Path:
    path = Path(path)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def read_log(path) -> Dict[int, Dict[str, Any]]:
    """Read a log written by ``Cockpit.write`` or :func:`write_log`.

    Args:
        path: The log's path, with or without the ``.json`` suffix.

    Returns:
        ``{step: {quantity name: value}}`` with integer steps, in the log's
        order; ``UpdateSize``'s items as :class:`LoggedUpdate`.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is empty, truncated or not a Cockpit log.
    """
    path = _log_path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such log file")
    text = path.read_text()
    if not text.strip():
        raise ValueError(f"{path}: the log file is empty")
    try:
        output = json_tricks.loads(text, extra_obj_pairs_hooks=(_logged_update_hook,))
    except Exception as error:  # json_tricks raises several types
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    try:
        return {int(step): dict(values) for step, values in output.items()}
    except (AttributeError, TypeError, ValueError):
        raise ValueError(
            f"{path}: not a Cockpit log (expected {{step: {{quantity: value}}}})"
        ) from None


def _sanitize(value):
    """Replace non-finite floats anywhere in ``value`` by their string codes."""
    if isinstance(value, dict):
        return {key: _sanitize(val) for key, val in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_sanitize(val) for val in value)
    if isinstance(value, (float, numpy.floating)):
        return encode_float(value)
    return value


def write_log(cockpit, path, *, writer_rank: Optional[int] = WRITER_RANK) -> Optional[Path]:
    """Write a Cockpit's output as ``Cockpit.write`` does, without ever losing a log.

    Unlike ``Cockpit.write``, non-finite numbers anywhere in the output are
    encoded instead of raising, the JSON text is built before the file is
    touched, and the file is replaced atomically: if anything fails, the
    previous log is intact. Keys keep their order (parameters in model
    order, as the quantities store them), where ``Cockpit.write`` sorts them
    by name. The log gets the permissions of any new file under the current
    umask (usually ``rw-r--r--``), also when it replaces an older log.

    Args:
        cockpit: A ``cockpit.Cockpit``.
        path: Log path, with or without the ``.json`` suffix.
        writer_rank: Under distributed training only this process writes
            (``None``: every process; give each its own path).

    Returns:
        The path written; ``None`` on a process that does not write.
    """
    if not is_writer(writer_rank):
        return None
    path = _log_path(path)
    text = json_tricks.dumps(_sanitize(dict(cockpit.get_output())), indent=4, allow_nan=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    # os.open applies the umask to 0o666, as for any new file (mkstemp gives 0o600).
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def _is_update(item) -> bool:
    return all(hasattr(item, attribute) for attribute in LoggedUpdate._fields)


def _per_parameter(value):
    """``{param: {statistic: value}}`` if ``value`` is one of ours, else ``None``."""
    # A plain list of per-parameter items (UpdateSize: Cockpit's Distance panel
    # reads only floats and plain lists).
    if isinstance(value, list) and value and all(map(_is_update, value)):
        return update_statistics(value)
    if isinstance(value, Mapping) and value and all(
        isinstance(stats, Mapping) for stats in value.values()
    ):
        return value
    return None


def to_frame(source) -> pandas.DataFrame:
    """One tidy table of every statistic of this package's quantities.

    Args:
        source: A live ``cockpit.Cockpit``, its ``get_output()`` dict, or the
            path of a log written by ``Cockpit.write`` or :func:`write_log`
            (with or without ``.json``).

    Returns:
        A DataFrame with columns ``step`` (int), ``quantity``, ``param``,
        ``statistic`` (str) and ``value`` (float, NaN and inf decoded), one row
        per number, sorted by step and quantity; within them parameters and
        statistics keep the stored order (parameters in model order, the
        network last). A live cockpit and its :func:`write_log` log give
        identical frames; a ``Cockpit.write`` log, whose keys are sorted, the
        same rows with parameters and statistics by name. Cockpit's own
        quantities (not stored per parameter) are left out.
    """
    if isinstance(source, (str, os.PathLike)):
        output = read_log(source)
    elif hasattr(source, "get_output"):
        output = source.get_output()
    else:
        output = source
    rows = []
    for step, quantities in output.items():
        for quantity, value in quantities.items():
            per_parameter = _per_parameter(value)
            if per_parameter is None:
                continue
            for param, statistics in per_parameter.items():
                for statistic, number in statistics.items():
                    rows.append((int(step), quantity, param, statistic, decode_float(number)))
    frame = pandas.DataFrame(rows, columns=COLUMNS)
    frame = frame.astype(
        {"step": "int64", "quantity": str, "param": str, "statistic": str, "value": "float64"}
    )
    return frame.sort_values(COLUMNS[:2], kind="stable", ignore_index=True)
