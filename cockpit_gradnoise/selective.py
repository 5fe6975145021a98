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
(:func:`_gather`): decoding loops over windows and plans, not records.

Which rows a view needs is the view's business (``view_rows.report_frame``,
``view_rows.plot_rows``); this module reads what it is told.

Damage is not this module's to report: anything unexpected (a line of
another shape or length, a name or layout not declared, a value record with
per-parameter numbers, invalid base64 where it decodes) makes
:func:`index_log` or :meth:`LogIndex.frame` return ``None``, and the caller
reads the log whole (:func:`cockpit_gradnoise.to_frame`), which reports it.
Numbers it never decodes are not checked.

This module imports neither pandas (only building a frame does) nor torch.
"""

from __future__ import annotations

import binascii
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from cockpit_gradnoise._views import Column, Rows
from cockpit_gradnoise.log import (
    _DTYPE,
    _TABLES,
    HEADER,
    category_codes,
    non_finite_runs,
    per_parameter,
)

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


class _Unexpected(Exception):
    """The log is not one this reader takes: the caller reads it whole."""


def _chars(count: int) -> int:
    """Length of the base64 text of ``count`` float64 numbers."""
    return 4 * -(-8 * count // 3)


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
        summary: The log's summary line (:mod:`cockpit_gradnoise.log`), if it
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
        """The rows of :meth:`frame` as :class:`~cockpit_gradnoise._views.Rows` (no pandas)."""
        try:
            return _tidy(self, picks, decode)
        except (_Unexpected, OSError, ValueError):
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
        except (_Unexpected, OSError, ValueError):
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
    except (_Unexpected, OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None  # binascii.Error and UnicodeDecodeError are ValueErrors


class _Scan:
    """What :func:`_index` gathers line by line."""

    def __init__(self):
        self.tables: Dict[str, List[str]] = {table: [] for table in _TABLES}
        self.layouts: List[Tuple[numpy.ndarray, numpy.ndarray]] = []
        self.chars: List[int] = []
        self.current: Dict[Tuple[int, int], Tuple[int, int, int, Optional[bool]]] = {}
        self.summary: Optional[dict] = None
        self.end = 0  # where the last line read whole ends

    def line(self, line: bytes):
        """A names, layout or value line (read whole; record lines are not)."""
        item = json.loads(line)
        if not isinstance(item, dict):
            raise _Unexpected
        self.summary = None  # a summary sums the records before it: it must be the last line
        if "names" in item:
            for table, names in item["names"].items():
                if table not in _TABLES or not all(isinstance(n, str) for n in names):
                    raise _Unexpected
                self.tables[table].extend(names)
        elif "summary" in item:
            self.summary = item["summary"] if isinstance(item["summary"], dict) else None
        elif "layout" in item and "step" not in item:
            self.layout(item["layout"])
        elif "step" in item and "value" in item and "layout" not in item:
            step, quantity = item["step"], item["quantity"]
            if not isinstance(step, int) or not isinstance(quantity, int) or not (
                    0 <= quantity < len(self.tables["quantities"])):
                raise _Unexpected
            if per_parameter(item["value"]) is not None:
                raise _Unexpected  # numbers the frame reads from a value: read it whole
            self.current[step, quantity] = (-1, -1, -1, None)  # replaces, adds no rows
        else:
            raise _Unexpected

    def layout(self, declared):
        """A layout line's ``[[param, [statistic, ...]], ...]``."""
        params = [p for p, names in declared for _ in names]
        statistics = [s for _, names in declared for s in names]
        layout = (numpy.asarray(params, dtype=numpy.int64),
                  numpy.asarray(statistics, dtype=numpy.int64))
        for codes, table in zip(layout, ("params", "statistics")):
            if len(codes) and not (codes.min() >= 0 and codes.max() < len(self.tables[table])):
                raise _Unexpected
        self.layouts.append(layout)
        self.chars.append(_chars(len(params)))


def _index(file, path: str) -> LogIndex:
    fd = file.fileno()
    size = os.fstat(fd).st_size
    header = (HEADER + "\n").encode()
    if os.pread(fd, len(header), 0) != header:
        raise _Unexpected
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
            raise _Unexpected
        start = offset + match.end()
        end = start + chars[layout]
        head = pread(fd, ahead, end)
        if head[:tail] != _TAIL and not (end + 2 == size and head == _TAIL[:2]):
            raise _Unexpected  # a line of another length: damaged, or not LogStream's
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
        raise _Unexpected
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
            runs = json.dumps(non_finite_runs(_decode_all(fd, index, record))).encode()
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
        raise _Unexpected
    pattern = {}
    for kind, pairs in parsed.items():
        positions = numpy.concatenate([numpy.arange(a, b) for a, b in pairs] or [[]]).astype(int)
        if len(positions) and not (positions.min() >= 0 and positions.max() < count):
            raise _Unexpected
        pattern[kind] = positions
    return pattern


def _decode_all(fd, index: LogIndex, record: int) -> numpy.ndarray:
    layout = int(index.layout[record])
    count = len(index.layouts[layout][0])
    text = os.pread(fd, _chars(count), int(index.offset[record]))
    raw = binascii.a2b_base64(text)
    if len(raw) != 8 * count:
        raise _Unexpected
    return numpy.frombuffer(raw, dtype=_DTYPE)


def _windows(starts: numpy.ndarray, ends: numpy.ndarray) -> List[slice]:
    """Runs of records (texts ``[starts, ends)``, ascending starts) to read at once.

    A new run starts where the texts pass a multiple of :data:`_WINDOW` bytes
    into the file, and after a gap of more than :data:`_GAP` bytes not needed.
    """
    if not len(starts):
        return []
    reach = numpy.maximum.accumulate(ends)
    block = (starts - starts[0]) // _WINDOW
    cuts = numpy.flatnonzero((starts[1:] - reach[:-1] > _GAP) | (block[1:] != block[:-1])) + 1
    bounds = [0, *cuts.tolist(), len(starts)]
    return [slice(first, end) for first, end in zip(bounds[:-1], bounds[1:])]


def _by_plan(places: numpy.ndarray, plan: numpy.ndarray) -> List[numpy.ndarray]:
    """``places`` split by their plan (``plan[places]``), each part in the given order."""
    places = places[numpy.argsort(plan[places], kind="stable")]
    return numpy.split(places, numpy.flatnonzero(numpy.diff(plan[places])) + 1)


def _rows(firsts: numpy.ndarray, width: int) -> numpy.ndarray:
    """The frame's rows of records whose first rows are ``firsts``, ``width`` each."""
    return firsts[:, None] + numpy.arange(width)


def _values(index: LogIndex, plans: "_Plans", firsts: numpy.ndarray, total: int
            ) -> numpy.ndarray:
    """The numbers that ``plans`` name, at their rows of the frame, read window by window.

    Records are read in file order, many at a time (:func:`_windows`, one read
    into a buffer that is reused, so memory stays bounded); of each window the
    records of one plan are decoded together (:func:`_gather`).
    """
    values = numpy.empty(total)
    chars = numpy.array([_chars(len(index.layouts[layout][0])) for layout in plans.layout],
                        dtype=numpy.int64)
    starts = index.offset[plans.records]
    ends = starts + chars[plans.plan]
    order = numpy.argsort(starts, kind="stable")
    buffer = numpy.empty(0, dtype=numpy.uint8)
    with open(index.path, "rb", buffering=0) as file:
        for window in _windows(starts[order], ends[order]):
            places = order[window]
            first, size = int(starts[places[0]]), int(ends[places].max() - starts[places[0]])
            if len(buffer) < size + 1:
                buffer = numpy.empty(size + 1, dtype=numpy.uint8)
            file.seek(first)
            # And the byte after the last text (a '"' there: the index checked it).
            if file.readinto(memoryview(buffer)[:size + 1]) != size + 1:
                raise _Unexpected  # the file is shorter than its index says
            for members in _by_plan(places, plans.plan):
                plan = int(plans.plan[members[0]])
                found = plans.positions[plan]
                values[_rows(firsts[members], len(found))] = _gather(
                    buffer[:size + 1], starts[members] - first, found, int(chars[plan]))
    return values


#: Bytes of the file read at once (at most; a longer record is read whole), and the
#: largest gap of unneeded bytes read through rather than skipped.
_WINDOW, _GAP = 1 << 24, 1 << 20
#: Numbers decoded together by :func:`_gather` (bounds its arrays).
_GATHER = 1 << 16


def _pair_table() -> numpy.ndarray:
    """The 12 bits of each pair of base64 characters, by the pair read as a little-endian
    ``uint16``; ``1 << 12`` for a pair with a character that is not base64 (``=``: 0)."""
    sixes = numpy.full(256, 64, dtype=numpy.uint16)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    sixes[numpy.frombuffer(alphabet, dtype=numpy.uint8)] = numpy.arange(64)
    sixes[ord("=")] = 0
    byte = numpy.arange(256)
    table = numpy.full(1 << 16, 1 << 12, dtype=numpy.uint16)
    valid = (sixes[:, None] < 64) & (sixes[None, :] < 64)
    # [first, second] character: first | second << 8 as a little-endian uint16.
    table[(byte[:, None] | byte[None, :] << 8).ravel()] = numpy.where(
        valid, sixes[:, None] << 6 | sixes[None, :], 1 << 12).ravel()
    return table


_PAIRS = _pair_table()


def _gather(text: numpy.ndarray, starts: numpy.ndarray, positions: numpy.ndarray, chars: int):
    """The numbers at ``positions`` of the base64 texts of ``chars`` characters at ``starts``.

    Only the characters of those numbers are decoded, all texts at once. The
    64 bits of number ``p`` start at bit ``64 p`` of the decoded text: in
    character ``c = 64 p // 6``, ``r = 64 p - 6 c`` (0, 2 or 4) bits in. Twelve
    characters from ``c`` (72 bits) hold them: read as six pairs
    (:data:`_PAIRS`: 12 bits each), the 64 bits from bit ``r`` are the
    number's bytes, first byte highest.

    ``text`` must hold one byte after each text, which this overwrites: the
    twelfth character of the last number runs one past a text whose count of
    numbers divides by 3, and is then not needed (``r = 2``).

    Returns:
        The numbers, one row per text.
    """
    first = 32 * positions // 3  # = 64 p // 6
    shift = (64 * positions - 6 * first).astype(numpy.uint64)
    text[starts + chars] = ord("A")
    pairs = [numpy.ndarray((len(text) - 1 - 2 * j,), numpy.dtype("<u2"), text, 2 * j, (1,))
             for j in range(6)]
    rows = numpy.empty((len(starts), len(positions)))
    step = max(1, _GATHER // max(len(positions), 1))
    for at in range(0, len(starts), step):
        where = starts[at:at + step, None] + first
        bits = [_PAIRS[pair[where]] for pair in pairs]
        if any((part >> 12).any() for part in bits):
            raise _Unexpected  # not base64 where a number is read
        bits = [part.astype(numpy.uint64) for part in bits]
        high = bits[0] << 24 | bits[1] << 12 | bits[2]
        low = bits[3] << 24 | bits[4] << 12 | bits[5]
        number = high << (numpy.uint64(28) + shift) | low >> (numpy.uint64(8) - shift)
        rows[at:at + step] = number.astype(">u8").view(_DTYPE)
    return rows


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
    for members in _by_plan(numpy.arange(len(records)), plans.plan) if total else []:
        plan = int(plans.plan[members[0]])
        found, layout = plans.positions[plan], index.layouts[plans.layout[plan]]
        rows = _rows(firsts[members], len(found))
        for column, positions in zip(names, layout):
            column[rows] = positions[found]
    values = (_values if decode else _known)(index, plans, firsts, total)
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
    :func:`~cockpit_gradnoise._views.layer_order` of the full frame.
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
