"""Streaming logs: tracked steps appended to disk as they are computed.

A streamed log is a JSON-lines file (one JSON object per line, ``.jsonl``),
append-only, so that memory stays flat over any number of steps and a
``kill -9`` at any moment loses at most the records of the last tracked call
(a line cut mid-write is left out, with a warning, when the log is read).
Its lines, in the order they are written:

- the header, first and once: ``{"format": "cockpit-gradnoise-log", "version": 2}``
  (version 1: the same lines but ``superseded``);
- ``{"names": {"quantities": [...], "params": [...], "statistics": [...]}}``:
  names not seen before, appended to three tables (each name is stored once,
  rows refer to it by its position in its table);
- ``{"layout": [[param, [statistic, ...]], ...]}``: the shape of one
  quantity's ``{param: {statistic: value}}`` at one step, as positions in the
  tables; layouts are numbered in the order they appear (a run has a few);
- ``{"step": s, "quantity": q, "layout": l, "nonfinite": {...}, "values": "..."}``:
  the numbers of quantity ``q`` at step ``s`` in the order of layout ``l``, as
  base64 of little-endian float64 (exact, NaN and inf included, and about ten
  times faster to read than JSON numbers); ``nonfinite``: where the NaN and
  inf among them are (:func:`non_finite_runs`; ``{}``: none; logs written
  before it was added lack it);
- ``{"step": s, "quantity": q, "value": ...}``: a value that is not
  per-parameter numbers (Cockpit's own quantities, ``cockpit.log``), as JSON
  (non-finite floats as ``"nan"``, ``"inf"``, ``"-inf"``, NumPy arrays as
  lists);
- ``{"superseded": s}``: written by a resumed run (:class:`LogStream`) whose
  first step ``s`` is at or before the last step of the log: the records of
  steps ``>= s`` before this line were written by a run that died after its
  checkpoint. They stay in the file, left out of the log's steps and frame
  (:meth:`StreamedLog.superseded_records`, ``to_frame(..., superseded=True)``).
  ``{"superseded": s, "after": {quantity: t}}``: written by a run resumed
  from a tracker's checkpoint (:meth:`LogStream.continue_from`): the records
  the run that died wrote after it, those of each listed quantity at steps
  ``> t``, of others at steps ``>= s``
  (:func:`~cockpit_gradnoise.logs.codec.superseded_by`).
- last, written by :meth:`LogStream.close` (a killed writer leaves none; a
  resumed writer cuts it and writes the whole log's at its own close):
  ``{"layout": [], "summary": {"records": [[q, n], ...], "sums": [...]}}``
  (to a reader from before summaries, which refuses lines it does not know,
  an empty layout that no record names), ``n`` the
  records with numbers of quantity ``q``, and for each statistic that ranks
  layers (:data:`~cockpit_gradnoise.logs.schema.RANKINGS`) of a quantity whose
  steps only grew, ``{"quantity": q, "statistic": s, "steps": records holding
  it, "params": [...], "sums": [...], "finite": [...]}``: per parameter (in
  the order each first had a finite value) the sum of its finite values over
  the run and how many there were. The sums are pandas' compensated ones
  (:class:`~cockpit_gradnoise.logs.summary.RunningMeans`), so ``sums / finite`` are, to the bit, the means
  the ranking takes of the whole frame; a reader then need not decode
  millions of numbers to rank the layers (the views' reads).

A later record of the same step and quantity replaces an earlier one, as a
Cockpit's output dict does. :func:`read_stream` reads a log back as a
:class:`StreamedLog` (``{step: {quantity: value}}``, and the tidy frame
without per-row dicts); :func:`cockpit_gradnoise.read_log` and
:func:`cockpit_gradnoise.to_frame` read both this and the JSON logs of
``Cockpit.write`` and :func:`cockpit_gradnoise.write_log`.

This module imports neither torch nor Cockpit.
"""

import base64
import json
import operator
import warnings
from collections.abc import Mapping as MappingABC
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from cockpit_gradnoise._ranks import WRITER_RANK, is_writer
from cockpit_gradnoise.logs.codec import (
    DTYPE,
    HEADER,
    HEADERS,
    SUFFIX,
    TABLES,
    as_numbers,
    is_streamed,
    jsonable,
    keep_aside,
    non_finite_runs,
    per_parameter,
    superseded_by,
    trim_for_append,
)
from cockpit_gradnoise.logs.summary import Summary

import numpy

#: Steps a cockpit holds in its quantities' outputs after :meth:`LogStream.append`.
#: Between two appends it holds what one tracked call computed: the call's
#: step and, for a two-step quantity (``UpdateSize``), the step before.
STEPS_IN_MEMORY = 0


class LogStream:
    """Appends a cockpit's results to a streamed log and drops them from memory.

    Call :meth:`append` after each tracked step (``cgn.track(model, log=path)``
    does it for you)::

        stream = cgn.LogStream("runs/demo.jsonl")
        for step, (x, y) in enumerate(loader):
            ...
            with cockpit(step, info=info):
                loss.backward()
            stream.append(cockpit)   # written, and dropped from the cockpit
        stream.close()

    A streamed log already at ``path`` is continued (``resume=True``): its
    names, layouts and summary are read back, so the lines appended are
    coded as one run's; a line cut by a killed writer is moved to a side
    file (``run.jsonl.cut1``) with a warning. If the first step appended is
    at or before the log's last step (a restart from an earlier checkpoint),
    a ``{"superseded": s}`` line keeps the earlier lines of steps ``>= s``
    readable but out of the frame. ``resume=False`` starts afresh and keeps
    the old file under a free name (``run.1.jsonl``, :attr:`kept`); nothing
    is deleted or overwritten. Each :meth:`append` writes whole lines and
    flushes them to the operating system, so a killed process leaves a log
    that reads back up to its last append; it does not ``fsync`` (a power
    loss may lose more).

    Args:
        path: The log's path; ``.jsonl`` is added when it has no suffix.
        resume: Continue a log at ``path`` (``False``: start afresh, the old
            file kept under a new name).
        writer_rank: Under distributed training only this process writes
            (``None``: every process; give each its own path). The others
            drop the results without writing, so their memory stays flat too.

    Attributes:
        kept: Where ``resume=False`` moved the earlier file (``None``: none).

    Raises:
        ValueError: Resuming a file at ``path`` that is not a streamed log.
    """

    def __init__(self, path, *, resume: bool = True, writer_rank: Optional[int] = WRITER_RANK):
        path = Path(path)
        self.path = path if path.suffix else path.with_name(path.name + SUFFIX)
        self._tables: Dict[str, Dict[str, int]] = {table: {} for table in TABLES}
        self._layouts: Dict[tuple, int] = {}
        self._summary = Summary()
        self._file = None
        self._last: Optional[int] = None  # resumed: the log's last step, until the first append
        self._log: Optional[StreamedLog] = None  # resumed: the log read, until the first append
        self.kept: Optional[Path] = None
        self.records = 0  # record lines in the file
        self._writer = is_writer(writer_rank)
        if not self._writer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.is_file() and self.path.stat().st_size > 0
        if exists and not resume:
            self.kept = keep_aside(self.path)
        elif exists:
            self._resume()
            return
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.write(HEADER + "\n")
        self._file.flush()

    def _resume(self):
        """Continue the log at :attr:`path`: its tables, layouts and summary read back."""
        if not is_streamed(self.path):
            raise ValueError(
                f"{self.path}: not a cockpit-gradnoise streamed log, so it cannot be resumed; "
                "give resume=False to keep it under a new name and start afresh")
        trim_for_append(self.path)
        log = read_stream(self.path)
        for table in TABLES:
            self._tables[table] = {name: code for code, name in enumerate(getattr(log, table))}
        for number, (params, codes) in enumerate(log.layouts):
            key: Dict[str, list] = {}
            for param, statistic in zip(params.tolist(), codes.tolist()):
                key.setdefault(log.params[param], []).append(log.statistics[statistic])
            self._layouts.setdefault(tuple((p, tuple(names)) for p, names in key.items()), number)
        self._summarize(log)
        self._last, self._log, self.records = max(log, default=None), log, len(log.records)
        self._file = open(self.path, "a", encoding="utf-8")

    def _summarize(self, log: "StreamedLog"):
        """The summary of the records in effect in ``log`` (the file's so far), in file order."""
        self._summary = Summary()
        for key, _ in sorted(self._layouts.items(), key=operator.itemgetter(1)):
            self._summary.layout(self._declared(key), self._tables["statistics"])
        for position in sorted(log.current()):  # superseded and replaced records left out
            step, quantity, layout, values = log.records[position]
            self._summary.add(quantity, step, layout, None if layout is None else values)

    def _supersede(self, line: dict):
        """Write a superseded line, and apply it to the summary of the log read at resume."""
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        log = self._log if self._log is not None else read_stream(self.path)
        log._supersede(line)
        self._summarize(log)
        self._last, self._log = None, None

    def position(self) -> Optional[Dict[str, Any]]:
        """Where the log stands: its path, the records written, each quantity's last step.

        What a tracker's checkpoint keeps (:meth:`Tracker.state_dict
        <cockpit_gradnoise.Tracker.state_dict>`) so that the run resumed from
        it supersedes what was written after it (:meth:`continue_from`); also
        once closed. ``None`` on a process that does not write the log.
        """
        if not self._writer:
            return None
        quantities = list(self._tables["quantities"])
        return {"path": str(self.path), "records": self.records,
                "last": {quantities[q]: step for q, step in sorted(self._summary.last.items())}}

    def continue_from(self, position: Mapping[str, Any]):
        """Continue the log from a checkpoint's :meth:`position`: later records superseded.

        The records that the run which died wrote after its checkpoint (those
        of each quantity after its last step then) are set apart by a
        ``{"superseded": s, "after": {...}}`` line; the first step appended
        then supersedes nothing more. A log holding fewer records than at the
        checkpoint is continued as it is, with a warning.
        """
        if self._file is None:
            return
        if self.records < position["records"]:
            warnings.warn(
                f"{self.path} holds {self.records} records, fewer than the "
                f"{position['records']} it held at the checkpoint (the file was replaced or "
                "cut, or the checkpoint is of another run): it is continued as it is",
                stacklevel=3)
        if self.records > position["records"]:
            log = self._log if self._log is not None else read_stream(self.path)
            self._log = log
            self._supersede({"superseded": min(log, default=0), "after": dict(position["last"])})
        self._last, self._log = None, None

    def append(self, cockpit) -> int:
        """Write what ``cockpit`` holds and drop it from its quantities and itself.

        Args:
            cockpit: A ``cockpit.Cockpit`` (or anything with ``quantities``
                and ``output``).

        Returns:
            The number of records written (0 on a process that does not write).
        """
        held = _take(cockpit)
        if self._file is None or not held:
            return 0
        if self._last is not None and min(held) <= self._last:  # a restart from an earlier step
            self._supersede({"superseded": min(held)})
        self._last, self._log = None, None
        lines = [line for step, values in held.items() for line in self._lines(step, values)]
        self._file.write("".join(lines))  # one write: a kill cuts at most the last lines
        self._file.flush()
        written = sum(1 for line in lines if line.startswith('{"step"'))
        self.records += written
        return written

    @property
    def writer(self) -> bool:
        """Whether this process writes the log (open, or closed since)."""
        return self._writer

    @property
    def writes(self) -> bool:
        """Whether this process writes the log (and it is open)."""
        return self._file is not None

    def close(self):
        """Write the summary line and close the file; later appends only drop results."""
        if self._file is not None:
            summary = {"layout": [], "summary": self._summary.line()}  # see the module's doc
            self._file.write(json.dumps(summary, allow_nan=False) + "\n")
            self._file.close()
            self._file = None

    def __enter__(self) -> "LogStream":
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _lines(self, step, values) -> Iterator[str]:
        for quantity, value in values.items():
            rows = per_parameter(value)
            numbers = None if rows is None else as_numbers(rows)
            yield from self._new_names({"quantities": [quantity]})
            record = {"step": _integer(step), "quantity": self._tables["quantities"][quantity]}
            if numbers is None:
                record["value"] = jsonable(value)
                self._summary.add(record["quantity"], record["step"])
            else:
                layout, new = self._layout(rows)
                yield from new
                record["layout"] = layout
                self._summary.add(record["quantity"], record["step"], layout, numbers)
                # Where the NaN and inf are: a reader that decodes only some of the
                # numbers (cockpit_gradnoise.logs.selective) still finds every one.
                record["nonfinite"] = non_finite_runs(numbers)
                record["values"] = base64.b64encode(numbers.tobytes()).decode("ascii")
            yield json.dumps(record, allow_nan=False) + "\n"

    def _new_names(self, names: Mapping[str, List[str]]) -> Iterator[str]:
        """The names line declaring those of ``names`` not in the tables yet."""
        new = {}
        for table, candidates in names.items():
            known = self._tables[table]
            for name in candidates:
                if name not in known:
                    known[name] = len(known)
                    new.setdefault(table, []).append(name)
        if new:
            yield json.dumps({"names": new}) + "\n"

    def _declared(self, key) -> list:
        """A layout's line content, ``[[param, [statistic, ...]], ...]`` as table positions."""
        params, statistics = self._tables["params"], self._tables["statistics"]
        return [[params[param], [statistics[s] for s in names]] for param, names in key]

    def _layout(self, rows) -> Tuple[int, List[str]]:
        """The number of ``rows``' layout, and the lines declaring it if it is new."""
        key = tuple((param, tuple(statistics)) for param, statistics in rows.items())
        found = self._layouts.get(key)
        if found is not None:
            return found, []
        lines = list(self._new_names({
            "params": [param for param, _ in key],
            "statistics": [name for _, statistics in key for name in statistics],
        }))
        layout = self._declared(key)
        self._layouts[key] = len(self._layouts)
        self._summary.layout(layout, self._tables["statistics"])
        lines.append(json.dumps({"layout": layout}) + "\n")
        return self._layouts[key], lines


def _integer(step) -> int:
    try:
        return operator.index(step)
    except TypeError:
        raise ValueError(
            f"step {step!r} ({type(step).__name__}) is not an integer: give the cockpit "
            "integer global steps"
        ) from None


def _take(cockpit) -> Dict[int, Dict[str, Any]]:
    """``{step: {quantity: value}}`` that ``cockpit`` holds, removed from it.

    As ``Cockpit.get_output`` merges it (quantities by class name, and what
    ``cockpit.log`` stored), steps in order.
    """
    held: Dict[int, Dict[str, Any]] = {}
    # What get_output merged from the quantities is taken from them, below.
    merged = {type(quantity).__name__ for quantity in cockpit.quantities}
    for step, values in getattr(cockpit, "output", {}).items():
        held.setdefault(step, {}).update(
            (key, value) for key, value in values.items() if key not in merged
        )
    for quantity in cockpit.quantities:
        for step, value in quantity.output.items():
            held.setdefault(step, {})[type(quantity).__name__] = value
        quantity.output.clear()
    if hasattr(cockpit, "output"):
        cockpit.output.clear()
    return {step: held[step] for step in sorted(held) if held[step]}


class StreamedLog(MappingABC):
    """A streamed log read back: ``{step: {quantity: value}}``, stored by columns.

    Steps are in the order they first appear; a quantity's per-parameter
    values come back as ``{param: {statistic: float}}`` (``UpdateSize``'s
    too), built when a step is looked up. :meth:`frame` builds the tidy frame
    from the columns, without a dict per row.

    Attributes:
        path: The file read.
        quantities, params, statistics: The name tables.
    """

    def __init__(self, path: Path):
        self.path = path
        self.quantities: List[str] = []
        self.params: List[str] = []
        self.statistics: List[str] = []
        # Layouts: (param position per number, statistic position per number).
        self.layouts: List[Tuple[numpy.ndarray, numpy.ndarray]] = []
        # Records, each (step, quantity position, layout or None, values or JSON value).
        self.records: List[Tuple[int, int, Optional[int], Any]] = []
        self._index: Dict[int, Dict[int, int]] = {}  # step -> quantity -> last record
        self._superseded: List[int] = []  # records a resumed run superseded

    def _add(self, record: Tuple[int, int, Optional[int], Any]):
        self._index.setdefault(record[0], {})[record[1]] = len(self.records)
        self.records.append(record)

    def _supersede(self, line: Mapping):
        """A superseded line: the records so far that it names set apart (:func:`superseded_by`)."""
        superseded = superseded_by(line)
        for step in list(self._index):
            quantities = self._index[step]
            for quantity in [q for q in quantities if superseded(step, self.quantities[q])]:
                self._superseded.append(quantities.pop(quantity))
            if not quantities:
                del self._index[step]

    def superseded_records(self) -> List[Tuple[int, str, Any]]:
        """``(step, quantity, value)`` of each record a resumed run superseded, in file order.

        The lines of steps at and after a resumed run's first step that the
        run which died wrote: kept in the file, left out of the log's steps.
        """
        return [(self.records[r][0], self.quantities[self.records[r][1]],
                 self._value(self.records[r])) for r in sorted(self._superseded)]

    def superseded(self) -> List[int]:
        """The positions in :attr:`records` of the superseded records, in file order."""
        return sorted(self._superseded)

    def __iter__(self) -> Iterator[int]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, step) -> Dict[str, Any]:
        return {self.quantities[q]: self._value(self.records[r]) for q, r in self._index[step].items()}

    def _value(self, record):
        _, _, layout, values = record
        if layout is None:
            return values
        params, statistics = self.layouts[layout]
        value: Dict[str, Dict[str, float]] = {}
        for param, statistic, number in zip(params, statistics, values.tolist()):
            value.setdefault(self.params[param], {})[self.statistics[statistic]] = number
        return value

    def current(self) -> List[int]:
        """The records in effect (the last of each step and quantity), in step order."""
        return [r for quantities in self._index.values() for r in quantities.values()]


def read_stream(path) -> StreamedLog:
    """Read a streamed log.

    A last line cut mid-write (the writer was killed) is left out with a
    warning; any other damage raises.

    Raises:
        ValueError: Naming the file and the line, if it is not a streamed
            log or a line other than the last is damaged.
    """
    path = Path(path)
    log = StreamedLog(path)
    with open(path, "rb") as file:
        first = file.readline()
        if first.rstrip(b"\r\n") not in HEADERS:
            raise ValueError(f"{path}: not a cockpit-gradnoise streamed log (no header line)")
        number = 1
        for number, line in enumerate(file, start=2):
            try:
                _read_line(log, line)
            except ValueError as error:
                if line.endswith(b"\n") or file.read(1):
                    raise ValueError(f"{path}: line {number}: {error}") from None
                warnings.warn(
                    f"{path}: the last line (line {number}) is cut short (the writer "
                    "stopped mid-write); it is left out", stacklevel=2,
                )
    return log


def _read_line(log: StreamedLog, line: bytes):
    """Add one line's names, layout or record to ``log``; ``ValueError`` if it is damaged."""
    try:
        item = json.loads(line)
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(item, dict):
        raise ValueError("not a log line (expected a JSON object)")
    try:
        if "step" in item:
            log._add(_record(log, item))
        elif "names" in item:
            for table, names in item["names"].items():
                if table not in TABLES or not all(isinstance(n, str) for n in names):
                    raise ValueError(f"bad names table {table!r}")
                getattr(log, table).extend(names)
        elif "summary" in item:
            pass  # sums of numbers the log holds, for a faster reader (selective)
        elif "superseded" in item:
            log._supersede(item)
        elif "layout" in item:
            log.layouts.append(_layout(log, item["layout"]))
        else:
            raise ValueError(f"unknown line with keys {sorted(item)}")
    except (KeyError, TypeError, IndexError) as error:
        raise ValueError(f"malformed line ({type(error).__name__}: {error})") from None


def _layout(log: StreamedLog, declared) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """A layout line's ``[[param, [statistic, ...]], ...]`` as positions per number."""
    params = [p for p, names in declared for _ in names]
    statistics = [s for _, names in declared for s in names]
    layout = (numpy.asarray(params, dtype=numpy.int64),
              numpy.asarray(statistics, dtype=numpy.int64))
    if any(len(a) and not (0 <= a.min() and a.max() < len(t))
           for a, t in zip(layout, (log.params, log.statistics))):
        raise ValueError("layout names a parameter or statistic not declared")
    return layout


def _record(log: StreamedLog, item) -> Tuple[int, int, Optional[int], Any]:
    step, quantity = item["step"], item["quantity"]
    if not isinstance(step, int) or not isinstance(quantity, int) or not (
        0 <= quantity < len(log.quantities)
    ):
        raise ValueError("a record's step or quantity is not a declared integer")
    if "layout" not in item:
        return step, quantity, None, item["value"]
    layout = item["layout"]
    if not isinstance(layout, int) or not 0 <= layout < len(log.layouts):
        raise ValueError(f"record names layout {layout!r}, which is not declared")
    try:
        raw = base64.b64decode(item["values"], validate=True)
    except (ValueError, TypeError) as error:
        raise ValueError(f"values are not base64 ({error})") from None
    values = numpy.frombuffer(raw, dtype=DTYPE) if len(raw) % 8 == 0 else None
    if values is None or len(values) != len(log.layouts[layout][0]):
        raise ValueError(
            f"record holds {len(raw) / 8:g} numbers, its layout {len(log.layouts[layout][0])}"
        )
    return step, quantity, layout, values


__all__ = ["LogStream", "StreamedLog", "read_stream", "STEPS_IN_MEMORY"]
