"""Stored numbers in, one tidy table out; logs written without loss.

Quantities store, per step, ``{param name: {statistic: value}}``. Non-finite
values are stored as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` because
``Cockpit.write`` (json_tricks with ``allow_nan=False``) raises on a raw
non-finite float. :func:`to_frame` decodes them back to floats.
"""

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import json_tricks
import numpy
import pandas

from cockpit_gradnoise.distributed import WRITER_RANK, is_writer
from cockpit_gradnoise.schema import (  # noqa: F401  (re-exported)
    decode_float,
    encode_float,
    encode_statistics,
)

COLUMNS = ["step", "quantity", "param", "statistic", "value"]


def _log_path(path) -> Path:
    path = Path(path)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def read_log(path) -> Dict[int, Dict[str, Any]]:
    """Read a log written by ``Cockpit.write`` or :func:`write_log`.

    Args:
        path: The log's path, with or without the ``.json`` suffix.

    Returns:
        ``{step: {quantity name: value}}`` with integer steps.

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
        output = json_tricks.loads(text)
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
    previous log is intact.

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
    text = json_tricks.dumps(
        _sanitize(dict(cockpit.get_output())), indent=4, sort_keys=True, allow_nan=True
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def _per_parameter(value):
    """``{param: {statistic: value}}`` if ``value`` is one of ours, else ``None``."""
    # A plain list of per-parameter items (UpdateSize: Cockpit's Distance panel
    # reads only floats and plain lists) whose class combines them.
    if isinstance(value, list) and value and hasattr(value[0], "statistics_of_list"):
        return type(value[0]).statistics_of_list(value)
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
        per number, sorted by step, quantity, param and statistic. A live
        cockpit and its log give identical frames. Cockpit's own quantities
        (not stored per parameter) are left out.
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
    return frame.sort_values(COLUMNS[:4], ignore_index=True)
