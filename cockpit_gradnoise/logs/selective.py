"""Reading only some of a streamed log's numbers: the rows a view shows, fast and lean.

A 10,000-step log of a 200-tensor model holds 52 M numbers (560 MB of
text, 418 MB as float64); the report and the dashboard show a few million of
them. :func:`index_log` reads a streamed log's structure without decoding
its numbers: the name tables, the layouts, and for each record its step,
quantity, layout, where its numbers lie in the file and whether they are all
finite (the record's ``finite`` field; a record without it, from an older
writer, is decoded whole to find out, and so is one that holds a NaN or inf,
whose non-finite numbers are kept). It jumps from record to record by their
lengths, which the layouts give, so it reads a few hundred bytes per record.
:meth:`LogIndex.frame` then decodes the numbers a :class:`Pick` names, and
only those, into rows of the tidy frame of :func:`cockpit_gradnoise.to_frame`:
the same rows, in the same order, with the same categories, as the full
frame's, of which they are a subset. It reads the file in windows of up to
16 MB in file order, and decodes the records that read the same positions
together, with NumPy, from the characters of those numbers only
(:mod:`cockpit_gradnoise.logs.decode`).

Which rows a view needs is the view's business (``views.reads.report_frame``,
``views.reads.plot_rows``); this module reads what it is told.

Damage is not this module's to report: anything unexpected (a line of
another shape or length, a name or layout not declared, a value record with
per-parameter numbers, invalid base64 where it decodes) makes
:func:`index_log` or :meth:`LogIndex.frame` return ``None``, and the caller
reads the log whole (:func:`cockpit_gradnoise.to_frame`), which reports it.
Numbers it never decodes are not checked.

This module imports neither pandas (only building a frame does) nor torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from cockpit_gradnoise.logs.codec import (
    HEADERS,
    TABLES,
    category_codes,
    non_finite_runs,
    per_parameter,
    superseded_by,
)
from cockpit_gradnoise.logs.decode import (
    Unexpected,
    base64_chars,
    by_plan,
    decode_all,
    frame_rows,
    read_values,
)
from cockpit_gradnoise.logs.table import Column, Rows

import numpy

if TYPE_CHECKING:
    import pandas

# The record lines LogStream writes (json.dumps keeps the keys' order).
_RECORD = re.compile(
    rb'\{"step": (-?\d+), "quantity": (\d+), "layout": (\d+), '
    rb'(?:"nonfinite": (\{[^}]*\}), )?"values": "'
)
_TAIL = b'"}\n'
_HEAD = 200  # bytes read per record: its end and the next line's start


@dataclass
class LogIndex:
    """A streamed log's names, layouts and current records, numbers left in the file.

    Records are those :func:`cockpit_gradnoise.to_frame` reads (the last of
    each step and quantity, with at least one number), in the frame's order:
    by step, then quantity name. Arrays, one entry per record.

    Attributes:
        path: The file.
        quantities, params, statistics: The name tables.
        layouts: ``(param positions, statistic positions)`` of each layout.
        step, quantity, layout: Each record's step, quantity and layout numbers.
        offset: Where each record's base64 text starts in the file.
        finite: Whether each record's numbers are all finite.
        non_finite: ``{record: pattern}`` of the records with a NaN or inf.
        patterns: Each ``{"nan": positions, "inf": ..., "-inf": ...}``.
        summary: The log's summary line (:mod:`cockpit_gradnoise.logs.stream`), if it
            ends with one; ``None`` if it does not (a writer killed, or older).
    """

    path: str
    quantities: List[str]
    params: List[str]
    statistics: List[str]
    layouts: List[Tuple[numpy.ndarray, numpy.ndarray]]
    step: numpy.ndarray
    quantity: numpy.ndarray
    layout: numpy.ndarray
    offset: numpy.ndarray
    finite: numpy.ndarray
    non_finite: Dict[int, int]
    patterns: List[Dict[str, numpy.ndarray]]
    summary: Optional[dict] = None

    def __len__(self) -> int:
        return len(self.step)

    def records_of(self, quantity: str) -> numpy.ndarray:
        """Mask of the records of ``quantity``."""
        if quantity not in self.quantities:
            return numpy.zeros(len(self), dtype=bool)
        return self.quantity == self.quantities.index(quantity)

    def positions(self, layout: int, *, params: Optional[Sequence[str]] = None,
                  statistics: Optional[Sequence[str]] = None) -> numpy.ndarray:
        """Positions in ``layout`` of the given parameters and statistics (``None``: all)."""
        param_codes, statistic_codes = self.layouts[layout]
        mask = numpy.ones(len(param_codes), dtype=bool)
        for codes, names, table in ((param_codes, params, self.params),
                                    (statistic_codes, statistics, self.statistics)):
            if names is not None:
                wanted = [table.index(name) for name in set(names) if name in table]
                mask &= numpy.isin(codes, wanted)
        return numpy.flatnonzero(mask)

    def layouts_with(self, records: numpy.ndarray, **names) -> bool:
        """Whether any of ``records`` (a mask) has a number of the given names (see :meth:`positions`)."""
        return any(len(self.positions(int(layout), **names))
                   for layout in numpy.unique(self.layout[records]))

    def frame(self, picks: Sequence["Pick"], *, decode: bool = True
              ) -> Optional["pandas.DataFrame"]:
        """The rows of the tidy frame that any of ``picks`` names, decoded from the file.

        ``None`` where a number cannot be decoded (the caller reads the log whole).
        ``decode=False``: nothing is read; the values are the NaN and inf the
        index knows of, 0 for the others (a frame of where things are).
        """
        rows = self.rows(picks, decode=decode)
        return None if rows is None else rows.frame()

    def rows(self, picks: Sequence["Pick"], *, decode: bool = True) -> Optional[Rows]:
        """The rows of :meth:`frame` as :class:`~cockpit_gradnoise.logs.table.Rows` (no pandas)."""
        try:
            return _tidy(self, picks, decode)
        except (Unexpected, OSError, ValueError):
            return None

    def sums(self, quantity: str, statistic: str) -> Optional["Sums"]:
        """The summary's sums of ``statistic`` over every record of ``quantity``; ``None``
        without them, or where they do not match the records (then decode the numbers)."""
        if self.summary is None or quantity not in self.quantities \
                or statistic not in self.statistics:
            return None
        code, wanted = self.quantities.index(quantity), self.statistics.index(statistic)
        try:
            counted = {int(q): int(n) for q, n in self.summary["records"]}
            if counted.get(code, 0) != int(numpy.count_nonzero(self.quantity == code)):
                return None
            for entry in self.summary["sums"]:
                if (entry["quantity"], entry["statistic"]) != (code, wanted):
                    continue
                params = numpy.asarray(entry["params"], dtype=numpy.int64)
                sums = numpy.asarray(entry["sums"], dtype=numpy.float64)
                finite = numpy.asarray(entry["finite"], dtype=numpy.int64)
                if not (params.ndim == 1 and sums.shape == finite.shape == params.shape
                        and (params.size == 0 or 0 <= params.min() <= params.max()
                             < len(self.params))):
                    return None
                return Sums([self.params[p] for p in params.tolist()], sums, finite,
                            int(entry["steps"]))
        except (KeyError, TypeError, ValueError):
            return None
        return None

    def numbers(self, picks: Sequence["Pick"]) -> Optional["Numbers"]:
        """The rows of :meth:`frame` as arrays, without building the frame (nor pandas).

        ``None`` where :meth:`frame` gives ``None``.
        """
        try:
            return _numbers(self, _plans(self, picks), True)
        except (Unexpected, OSError, ValueError):
            return None


class Sums(NamedTuple):
    """A statistic's finite values summed per parameter over a log (its summary line)."""

    #: Parameters, in the order each first had a finite value (the frame's order).
    params: List[str]
    #: Their sums, as pandas' group mean adds them (``sums / finite`` is its mean).
    sums: numpy.ndarray
    #: How many finite values each.
    finite: numpy.ndarray
    #: The records holding the statistic (one per step).
    steps: int


@dataclass
class Pick:
    """Rows to read: of the ``records`` (a mask), the numbers at ``positions(layout)``.

    ``positions`` maps a layout number to positions in it (``None``: every
    number of the record). ``each``: ``{record: positions}`` read besides.
    """

    records: numpy.ndarray
    positions: Optional[Callable[[int], numpy.ndarray]] = None
    each: Optional[Dict[int, numpy.ndarray]] = None
    #: Read only in records where no other pick reads anything.
    fallback: bool = False

    def of(self, layout: int) -> numpy.ndarray:
        return self.positions(layout)


def index_log(path) -> Optional[LogIndex]:
    """The :class:`LogIndex` of the streamed log at ``path``; ``None`` if it is not one this reads.

    ``None`` also for any damage, and for value records holding per-parameter
    numbers (read whole by :func:`cockpit_gradnoise.to_frame`).
    """
    try:
        with open(path, "rb") as file:
            return _index(file, str(path))
    except (Unexpected, OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None  # binascii.Error and UnicodeDecodeError are ValueErrors


class _Scan:
    """What :func:`_index` gathers line by line."""

    def __init__(self):
        self.tables: Dict[str, List[str]] = {table: [] for table in TABLES}
        self.layouts: List[Tuple[numpy.ndarray, numpy.ndarray]] = []
        self.chars: List[int] = []
        self.current: Dict[Tuple[int, int], Tuple[int, int, int, Optional[bool]]] = {}
        self.summary: Optional[dict] = None
        self.end = 0  # where the last line read whole ends

    def line(self, line: bytes):
        """A names, layout or value line (read whole; record lines are not)."""
        item = json.loads(line)
        if not isinstance(item, dict):
            raise Unexpected
        self.summary = None  # a summary sums the records before it: it must be the last line
        if "names" in item:
            for table, names in item["names"].items():
                if table not in TABLES or not all(isinstance(n, str) for n in names):
                    raise Unexpected
                self.tables[table].extend(names)
        elif "summary" in item:
            self.summary = item["summary"] if isinstance(item["summary"], dict) else None
        elif "superseded" in item:
            self.supersede(item)
        elif "layout" in item and "step" not in item:
            self.layout(item["layout"])
        elif "step" in item and "value" in item and "layout" not in item:
            step, quantity = item["step"], item["quantity"]
            if not isinstance(step, int) or not isinstance(quantity, int) or not (
                    0 <= quantity < len(self.tables["quantities"])):
                raise Unexpected
            if per_parameter(item["value"]) is not None:
                raise Unexpected  # numbers the frame reads from a value: read it whole
            self.current[step, quantity] = (-1, -1, -1, None)  # replaces, adds no rows
        else:
            raise Unexpected

    def supersede(self, line):
        """A resumed run's superseded line: the records so far that it names set apart
        (:func:`~cockpit_gradnoise.logs.codec.superseded_by`)."""
        superseded, quantities = superseded_by(line), self.tables["quantities"]
        for key in [key for key in self.current if superseded(key[0], quantities[key[1]])]:
            del self.current[key]

    def layout(self, declared):
        """A layout line's ``[[param, [statistic, ...]], ...]``."""
        params = [p for p, names in declared for _ in names]
        statistics = [s for _, names in declared for s in names]
        layout = (numpy.asarray(params, dtype=numpy.int64),
                  numpy.asarray(statistics, dtype=numpy.int64))
        for codes, table in zip(layout, ("params", "statistics")):
            if len(codes) and not (codes.min() >= 0 and codes.max() < len(self.tables[table])):
                raise Unexpected
        self.layouts.append(layout)
        self.chars.append(base64_chars(len(params)))


def _index(file, path: str) -> LogIndex:
    fd = file.fileno()
    size = os.fstat(fd).st_size
    header = os.pread(fd, len(HEADERS[0]) + 1, 0)
    if header[:-1] not in HEADERS or header[-1:] != b"\n":
        raise Unexpected
    scan, offset = _Scan(), len(header)
    # Once per record: the names the loop reads looked up once (the lists grow in place).
    current, chars, layouts = scan.current, scan.chars, scan.layouts
    quantities, match_record, pread = scan.tables["quantities"], _RECORD.match, os.pread
    tail, ahead = len(_TAIL), len(_TAIL) + _HEAD
    head = pread(fd, _HEAD, offset)
    while offset < size:
        match = match_record(head)
        if match is None and head.startswith(b'{"step"') and b'"values": "' not in head:
            head = pread(fd, 1 << 20, offset)  # a long list of non-finite runs
            match = match_record(head)
        if match is None:
            offset, head = _other_line(fd, scan, offset, size)
            continue
        step, quantity, layout, runs = match.groups()
        quantity, layout = int(quantity), int(layout)
        if quantity >= len(quantities) or layout >= len(layouts):
            raise Unexpected
        start = offset + match.end()
        end = start + chars[layout]
        head = pread(fd, ahead, end)
        if head[:tail] != _TAIL and not (end + 2 == size and head == _TAIL[:2]):
            raise Unexpected  # a line of another length: damaged, or not LogStream's
        current[int(step), quantity] = (layout, start, runs)
        offset, head = end + tail, head[tail:]
    if scan.end != size:
        scan.summary = None  # only a summary at the end sums every record before it
    return _finish(fd, scan, path)


def _other_line(fd, scan: _Scan, offset: int, size: int) -> Tuple[int, bytes]:
    """Read the whole line at ``offset``; the next line's offset and start."""
    parts = []
    while True:
        chunk = os.pread(fd, 1 << 16, offset + sum(map(len, parts)))
        cut = chunk.find(b"\n")
        parts.append(chunk if cut < 0 else chunk[:cut + 1])
        if cut >= 0 or not chunk:
            break
    line = b"".join(parts)
    if not line.endswith(b"\n") and offset + len(line) < size:
        raise Unexpected
    scan.line(line)
    offset += len(line)
    scan.end = offset
    return offset, os.pread(fd, _HEAD, offset)


_FINITE = b"{}"


def _finish(fd, scan: _Scan, path: str) -> LogIndex:
    quantities = scan.tables["quantities"]
    keys, rests = list(scan.current), list(scan.current.values())
    steps = numpy.array([step for step, _ in keys], dtype=numpy.int64)
    quantity = numpy.array([code for _, code in keys], dtype=numpy.int64)
    layout = numpy.array([rest[0] for rest in rests], dtype=numpy.int64)
    offset = numpy.array([rest[1] for rest in rests], dtype=numpy.int64)
    # Records with numbers (a value line's layout is -1: none).
    counts = numpy.array([len(params) for params, _ in scan.layouts] + [0], dtype=numpy.int64)
    kept = numpy.flatnonzero(counts[layout] > 0)
    # The frame's order: by step, then quantity name.
    rank = numpy.zeros(len(quantities), dtype=numpy.int64)
    rank[sorted(range(len(quantities)), key=quantities.__getitem__)] = numpy.arange(len(quantities))
    kept = kept[numpy.lexsort((rank[quantity[kept]], steps[kept]))]
    index = LogIndex(
        path, quantities, scan.tables["params"], scan.tables["statistics"], scan.layouts,
        steps[kept], quantity[kept], layout[kept], offset[kept],
        finite=numpy.ones(len(kept), dtype=bool), non_finite={}, patterns=[],
        summary=scan.summary,
    )
    texts = [rests[record][2] for record in kept.tolist()]
    found: Dict[bytes, int] = {}
    for record in [r for r, runs in enumerate(texts) if runs != _FINITE]:
        runs = texts[record]
        if runs is None:  # written before records said: decode to find out
            runs = json.dumps(non_finite_runs(decode_all(fd, index, record))).encode()
            if runs == _FINITE:
                continue
        key = b"%d:%s" % (index.layout[record], runs)
        if key not in found:
            found[key] = len(index.patterns)
            index.patterns.append(_pattern(runs, len(index.layouts[index.layout[record]][0])))
        index.finite[record] = False
        index.non_finite[record] = found[key]
    return index


def _pattern(runs: bytes, count: int) -> Dict[str, numpy.ndarray]:
    """``{"nan": positions, "inf": ..., "-inf": ...}`` of a record's ``nonfinite`` runs."""
    parsed = json.loads(runs)
    if not isinstance(parsed, dict) or not set(parsed) <= {"nan", "inf", "-inf"}:
        raise Unexpected
    pattern = {}
    for kind, pairs in parsed.items():
        positions = numpy.concatenate([numpy.arange(a, b) for a, b in pairs] or [[]]).astype(int)
        if len(positions) and not (positions.min() >= 0 and positions.max() < count):
            raise Unexpected
        pattern[kind] = positions
    return pattern


def _signed(index: LogIndex, picks: Sequence[Pick], bits: int, layout: int) -> numpy.ndarray:
    """The positions in ``layout`` that the picks numbered by the set ``bits`` read."""
    count = len(index.layouts[layout][0])
    mask = numpy.zeros(count, dtype=bool)
    for bit, pick in enumerate(picks):
        if bits >> bit & 1 and not pick.fallback:
            mask[numpy.arange(count) if pick.positions is None else pick.of(layout)] = True
    if not mask.any():  # a fallback pick reads where no other does
        for bit, pick in enumerate(picks):
            if bits >> bit & 1 and pick.fallback:
                mask[pick.of(layout)] = True
    return numpy.flatnonzero(mask)


class _Plans(NamedTuple):
    """What :meth:`LogIndex.frame` reads: the ``records`` (frame order) with a number to
    read, each one's ``plan``, and of each plan the ``positions`` read and the ``layout``."""

    records: numpy.ndarray
    plan: numpy.ndarray
    positions: List[numpy.ndarray]
    layout: List[int]


def _plans(index: LogIndex, picks: Sequence[Pick]) -> _Plans:
    """The records any of ``picks`` names and the positions read of each, by plan."""
    # Records that share a layout and the picks naming them share their positions.
    stride = len(index.layouts) + 1
    signature = numpy.zeros(len(index), dtype=numpy.int64)
    for bit, pick in enumerate(picks):
        signature |= pick.records.astype(numpy.int64) << bit
    keys, plan = numpy.unique(signature * stride + index.layout, return_inverse=True)
    plan = plan.reshape(-1).astype(numpy.int64)
    positions, layouts = [], []
    for key in keys.tolist():
        bits, layout = divmod(key, stride)
        positions.append(_signed(index, picks, bits, layout))
        layouts.append(layout)
    each: Dict[int, list] = {}
    for pick in picks:
        for record, found in (pick.each or {}).items():
            each.setdefault(record, []).append(found)
    merged: Dict[tuple, int] = {}
    for record, extra in each.items():  # few records: those with a NaN or inf
        union = (int(plan[record]), *map(id, extra))
        if union not in merged:
            merged[union] = len(positions)
            positions.append(numpy.unique(numpy.concatenate([positions[union[0]], *extra])))
            layouts.append(layouts[union[0]])
        plan[record] = merged[union]
    lengths = numpy.array([len(found) for found in positions], dtype=numpy.int64)
    records = numpy.flatnonzero(lengths[plan] > 0)
    return _Plans(records, plan[records], positions, layouts)


def _known(index: LogIndex, plans: _Plans, firsts: numpy.ndarray, total: int) -> numpy.ndarray:
    """The values the patterns know of the numbers ``plans`` name: NaN and inf, 0 elsewhere."""
    values = numpy.zeros(total)
    bad = numpy.zeros(len(index), dtype=bool)
    bad[list(index.non_finite)] = True
    groups: Dict[tuple, List[int]] = {}
    for place in numpy.flatnonzero(bad[plans.records]).tolist():
        key = (int(plans.plan[place]), index.non_finite[int(plans.records[place])])
        groups.setdefault(key, []).append(place)
    for (plan, pattern), places in groups.items():
        found = plans.positions[plan]
        for kind, positions in index.patterns[pattern].items():
            hit = numpy.flatnonzero(numpy.isin(found, positions))
            values[firsts[places][:, None] + hit] = float(kind)
    return values


class Numbers(NamedTuple):
    """Rows of the tidy frame as arrays (:meth:`LogIndex.numbers`), in the frame's order.

    ``records``: the records read; ``counts``: how many rows each; ``param``,
    ``statistic``: each row's position in the index's name tables; ``value``.
    """

    records: numpy.ndarray
    counts: numpy.ndarray
    param: numpy.ndarray
    statistic: numpy.ndarray
    value: numpy.ndarray


def _numbers(index: LogIndex, plans: _Plans, decode: bool) -> Numbers:
    records = plans.records
    counts = numpy.array([len(found) for found in plans.positions], dtype=numpy.int64)[plans.plan]
    firsts = numpy.cumsum(counts) - counts  # each record's first row
    total = int(counts.sum())
    names = [numpy.empty(total, dtype=numpy.int64), numpy.empty(total, dtype=numpy.int64)]
    for members in by_plan(numpy.arange(len(records)), plans.plan) if total else []:
        plan = int(plans.plan[members[0]])
        found, layout = plans.positions[plan], index.layouts[plans.layout[plan]]
        rows = frame_rows(firsts[members], len(found))
        for column, positions in zip(names, layout):
            column[rows] = positions[found]
    values = (read_values if decode else _known)(index, plans, firsts, total)
    return Numbers(records, counts, *names, values)


def _tidy(index: LogIndex, picks: Sequence[Pick], decode: bool = True) -> Rows:
    found = _numbers(index, _plans(index, picks), decode)
    records, counts = found.records, found.counts
    # Categories as the full frame's: the names of every record's layout.
    used = numpy.unique(index.layout).tolist()
    quantities = category_codes(index.quantities, set(index.quantity.tolist()))
    params, statistics = (
        category_codes(table, set().union(*(index.layouts[layout][i].tolist() for layout in used)))
        for i, table in ((0, index.params), (1, index.statistics))
    )
    return Rows(numpy.repeat(index.step[records], counts),
                Column(numpy.repeat(quantities[0][index.quantity[records]], counts),
                       quantities[1]),
                Column(params[0][found.param], params[1]),
                Column(statistics[0][found.statistic], statistics[1]), found.value)


def first_rows(index: LogIndex) -> Pick:
    """A number of every record: each record's step, quantity and presence.

    The first, of a record no other pick reads.
    """
    return Pick(numpy.ones(len(index), dtype=bool), lambda layout: numpy.array([0]),
                fallback=True)


def non_finite_rows(index: LogIndex, reduce: Optional[Callable] = None) -> Pick:
    """The NaN and inf of the log: all, or ``reduce(quantity, layout, pattern)`` of each record's.

    ``pattern`` is ``{"nan": positions, "inf": ..., "-inf": ...}``; ``reduce``
    returns the positions to read, and is called once per distinct
    quantity, layout and pattern.
    """
    reduced: Dict[tuple, numpy.ndarray] = {}
    each = {}
    for record, pattern in index.non_finite.items():
        key = (int(index.quantity[record]), int(index.layout[record]), pattern)
        if key not in reduced:
            found = index.patterns[pattern]
            reduced[key] = (numpy.unique(numpy.concatenate(list(found.values())))
                            if reduce is None else numpy.asarray(reduce(*key[:2], found), int))
        each[record] = reduced[key]
    return Pick(numpy.zeros(len(index), dtype=bool), each=each)


def whole(index: LogIndex, records: numpy.ndarray) -> Pick:
    """Every number of ``records`` (a mask)."""
    return Pick(records)


def first_of_each_layout(index: LogIndex) -> Pick:
    """Every number of the first record of each quantity and layout.

    A parameter first appears in the frame (or in any quantity's rows) in the
    first record of its quantity and layout that holds it, so these give
    the layer order the views take of the full frame.
    """
    key = index.quantity * (len(index.layouts) + 1) + index.layout
    mask = numpy.zeros(len(index), dtype=bool)
    mask[numpy.unique(key, return_index=True)[1]] = True
    return Pick(mask)


def named(index: LogIndex, records: numpy.ndarray, **names) -> Pick:
    """Of ``records`` (a mask), the numbers of the given parameters and statistics."""
    cache: Dict[int, numpy.ndarray] = {}

    def positions(layout):
        if layout not in cache:
            cache[layout] = index.positions(layout, **names)
        return cache[layout]

    return Pick(records, positions)


__all__ = ["LogIndex", "Numbers", "Pick", "Sums", "index_log", "first_rows", "non_finite_rows", "whole",
           "first_of_each_layout", "named"]
