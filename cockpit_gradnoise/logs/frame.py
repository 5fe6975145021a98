"""Stored numbers in, one tidy table out; logs written without loss.

Quantities store, per step, ``{param name: {statistic: value}}``, parameters
in model order and ``"all"`` last. Non-finite values are stored as the strings
``"nan"``, ``"inf"`` and ``"-inf"`` because ``Cockpit.write`` (json_tricks
with ``allow_nan=False``) raises on a raw non-finite float. :func:`to_frame`
decodes them back to floats.

Two kinds of log are read: the JSON logs of ``Cockpit.write`` and
:func:`write_log` (the whole output at once), and the streamed logs of
:class:`~cockpit_gradnoise.logs.stream.LogStream` (JSON lines, appended step by step).
Reading either imports neither torch nor Cockpit: ``UpdateSize``'s items in a
JSON log are read as :class:`LoggedUpdate` instead of the quantity's own class.
"""

import glob
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence

from cockpit_gradnoise._ranks import WRITER_RANK, is_writer
from cockpit_gradnoise.logs.codec import (  # noqa: F401  (json_log_path: this module's name for it)
    category_codes,
    is_streamed,
    json_log_path,
    per_parameter,
    read_path,
)
from cockpit_gradnoise.logs.schema import decode_float, encode_float
from cockpit_gradnoise.logs.stream import StreamedLog, read_stream
from cockpit_gradnoise.logs.table import tidy_frame

import json_tricks
import numpy
import pandas

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


def read_log(path) -> Mapping[int, Dict[str, Any]]:
    """Read a log written by ``Cockpit.write``, :func:`write_log` or a :class:`~cockpit_gradnoise.LogStream`.

    Args:
        path: The log's path; without a suffix, ``path.json`` or else
            ``path.jsonl``.

    Returns:
        ``{step: {quantity name: value}}`` with integer steps, in the log's
        order. From a JSON log, a dict with ``UpdateSize``'s items as
        :class:`LoggedUpdate`; from a streamed log, a
        :class:`~cockpit_gradnoise.logs.stream.StreamedLog` mapping, per-parameter
        values (``UpdateSize``'s too) as ``{param: {statistic: float}}``.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is empty, truncated (a JSON log; a streamed
            log's cut last line is left out with a warning) or not a log.
    """
    path = read_path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such log file")
    if is_streamed(path):
        return read_stream(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a text file ({error.reason} at byte {error.start})") from None
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


#: A temporary file of an interrupted :func:`write_log` is removed by the next
#: write of the same log once its writer process is gone, or, where that cannot
#: be known (another machine's process, pid reused), once it is this old.
STALE_SECONDS = 600.0


def write_log(cockpit, path, *, writer_rank: Optional[int] = WRITER_RANK) -> Optional[Path]:
    """Write a Cockpit's output as ``Cockpit.write`` does, without ever losing a log.

    Unlike ``Cockpit.write``, non-finite numbers anywhere in the output are
    encoded instead of raising, the JSON text is built before the file is
    touched, and the file is replaced atomically: if anything fails, the
    previous log is intact. Keys keep their order (parameters in model
    order, as the quantities store them), where ``Cockpit.write`` sorts them
    by name. The log gets the permissions of any new file under the current
    umask (usually ``rw-r--r--``), also when it replaces an older log.

    The text goes to a hidden ``.<name>.<pid>.<random>.tmp`` beside the log,
    renamed over it when complete. A process killed in between leaves that
    file behind; each write removes those of the same log that are stale:
    their writer's process id is not running on this machine, or they are
    older than :data:`STALE_SECONDS`.

    Args:
        cockpit: A ``cockpit.Cockpit`` (or anything with ``get_output()``,
            such as a streaming :class:`~cockpit_gradnoise.Tracker`).
        path: Log path, with or without the ``.json`` suffix.
        writer_rank: Under distributed training only this process writes
            (``None``: every process; give each its own path).

    Returns:
        The path written; ``None`` on a process that does not write.
    """
    if not is_writer(writer_rank):
        return None
    path = json_log_path(path)
    text = json_tricks.dumps(_sanitize(dict(cockpit.get_output())), indent=4, allow_nan=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
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


_TEMPORARY = re.compile(r"^(?:(?P<pid>\d+)\.)?[0-9a-f]{32}\.tmp$")  # after ".<name>."


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (``True`` where it cannot be told)."""
    if os.name == "nt":  # os.kill(pid, 0) would end the process there
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    return True


def remove_stale_temporaries(path) -> List[Path]:
    """Remove the stale temporary files that interrupted writes of the log ``path`` left.

    Stale: named for this log (``.<name>.<pid>.<random>.tmp``, or
    ``.<name>.<random>.tmp`` from older versions) and either their writer's
    process is not running on this machine or they are older than
    :data:`STALE_SECONDS`. A write in progress is never removed: its process
    runs, and its file is seconds old.

    Returns:
        The files removed.
    """
    path = Path(path)
    prefix = f".{path.name}."
    removed = []
    for candidate in path.parent.glob(glob.escape(prefix) + "*.tmp"):
        match = _TEMPORARY.match(candidate.name[len(prefix):])
        if match is None:
            continue  # another log's (a longer name sharing the prefix), or not ours
        try:
            age = time.time() - candidate.stat().st_mtime
        except FileNotFoundError:  # its writer finished meanwhile
            continue
        pid = match["pid"]
        if age > STALE_SECONDS or (pid is not None and not _running(int(pid))):
            try:
                candidate.unlink()
            except FileNotFoundError:
                continue
            removed.append(candidate)
    return removed


def to_frame(source, *, superseded: bool = False) -> pandas.DataFrame:
    """One tidy table of every statistic of this package's quantities.

    Args:
        source: A live ``cockpit.Cockpit`` or :class:`~cockpit_gradnoise.Tracker`,
            their ``get_output()``, the :func:`read_log` of a log, or the path
            of a log written by ``Cockpit.write``, :func:`write_log` or a
            :class:`~cockpit_gradnoise.LogStream` (see :func:`read_log`).
        superseded: Add the rows a resumed run superseded (a streamed log's
            steps written after the checkpoint it restarted from, see
            :class:`~cockpit_gradnoise.LogStream`) and a boolean column
            ``superseded`` that tells them (within a step and quantity,
            before the rows that replaced them).

    Returns:
        A DataFrame with columns ``step`` (int64), ``quantity``, ``param``,
        ``statistic`` (categorical, categories sorted by name) and ``value``
        (float64, NaN and inf decoded), one row per number, sorted by step and
        quantity; within them parameters and statistics keep the stored order
        (parameters in model order, the network last). A live cockpit, its
        :func:`write_log` log and its streamed log give identical frames; a
        ``Cockpit.write`` log, whose keys are sorted, the same rows with
        parameters and statistics by name. Cockpit's own quantities (not
        stored per parameter) are left out.
    """
    if isinstance(source, (str, os.PathLike)):
        output = read_log(source)
    elif hasattr(source, "get_output"):
        output = source.get_output()
    else:
        output = source
    if isinstance(output, StreamedLog):
        return _streamed_frame(output, superseded)
    frame = _output_frame(output)
    if superseded:  # only a streamed log holds superseded rows
        frame["superseded"] = numpy.zeros(len(frame), dtype=bool)
    return frame


class _Codes(dict):
    """Name -> position in the order first seen: the codes of one name column."""

    def of(self, name) -> int:
        code = self.get(name)
        if code is None:
            code = self[name] = len(self)
        return code


def _output_frame(output) -> pandas.DataFrame:
    """The frame of ``{step: {quantity: value}}``: numbers and name codes gathered in lists."""
    tables = [_Codes(), _Codes(), _Codes()]  # quantity, param, statistic
    steps, codes, values = [], ([], [], []), []
    for step, quantities in output.items():
        for quantity, value in quantities.items():
            rows = per_parameter(value)
            if rows is None:
                continue
            quantity_code = tables[0].of(quantity)
            for param, statistics in rows.items():
                param_code = tables[1].of(param)
                for statistic, number in statistics.items():
                    codes[0].append(quantity_code)
                    codes[1].append(param_code)
                    codes[2].append(tables[2].of(statistic))
                    values.append(decode_float(number))
            steps.extend([int(step)] * (len(codes[0]) - len(steps)))
    names = [_names(list(table), range(len(table))) for table in tables]
    columns = [remap[numpy.asarray(c, dtype=numpy.int64)] for c, (remap, _) in zip(codes, names)]
    frame = tidy_frame(numpy.asarray(steps, dtype=numpy.int64), columns,
                   [categories for _, categories in names], numpy.asarray(values, dtype=numpy.float64))
    # Sorted by step and quantity name; stable, so the stored order stays within them.
    order = numpy.lexsort((frame.quantity.cat.codes.to_numpy(), frame.step.to_numpy()))
    return frame.take(order).reset_index(drop=True)


def _streamed_frame(log: StreamedLog, superseded: bool = False) -> pandas.DataFrame:
    """The frame of a streamed log, from its columns: one array per record, no dict per row.

    Names are coded per layout (a few small arrays), then the layouts of the
    records are concatenated: nothing is done per number but copying it.
    """
    old = log.superseded() if superseded else []
    records = [log.records[r] for r in log.current()]
    if any(layout is None and per_parameter(value) is not None
           for *_, layout, value in records + [log.records[r] for r in old]):
        # per-parameter values that are not all numbers: as in memory
        frame = _output_frame(log)
        if superseded:
            frame["superseded"] = numpy.zeros(len(frame), dtype=bool)
        return frame
    kept = [(record, flag) for flag, part in ((False, records), (True, [log.records[r] for r in old]))
            for record in part if record[2] is not None and len(record[3])]
    records, flags = [record for record, _ in kept], [flag for _, flag in kept]
    used = sorted({layout for _, _, layout, _ in records})
    quantities = _names(log.quantities, {quantity for _, quantity, _, _ in records})
    params, statistics = (
        _names(table, set().union(*(log.layouts[layout][i].tolist() for layout in used)))
        for i, table in ((0, log.params), (1, log.statistics))
    )
    layouts = {layout: (params[0][log.layouts[layout][0]], statistics[0][log.layouts[layout][1]])
               for layout in used}
    # Sorted by step and quantity name, as the in-memory frame (superseded rows first).
    order = sorted(range(len(records)),
                   key=lambda r: (records[r][0], quantities[0][records[r][1]], not flags[r]))
    records, flags = [records[r] for r in order], [flags[r] for r in order]
    counts = numpy.asarray([len(values) for *_, values in records], dtype=numpy.int64)
    steps = numpy.repeat(numpy.asarray([step for step, *_ in records], dtype=numpy.int64), counts)
    quantity_codes = quantities[0][[quantity for _, quantity, _, _ in records]]
    columns = [numpy.repeat(quantity_codes, counts)] + [
        numpy.concatenate([layouts[layout][i] for _, _, layout, _ in records])
        if records else numpy.empty(0, dtype=numpy.int8)
        for i in (0, 1)
    ]
    values = numpy.concatenate([values for *_, values in records] or [numpy.empty(0)])
    frame = tidy_frame(steps, columns, [quantities[1], params[1], statistics[1]], values)
    if superseded:
        frame["superseded"] = numpy.repeat(numpy.asarray(flags, dtype=bool), counts)
    return frame


def _names(table: Sequence[str], present) -> tuple:
    """:func:`~cockpit_gradnoise.logs.codec.category_codes`, the categories as a pandas ``Index``."""
    remap, names = category_codes(table, present)
    return remap, pandas.Index(names, dtype=str)
