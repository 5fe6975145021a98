"""The streamed log's codec: its header, name tables, number encoding and paths.

What a line of a streamed log holds (:mod:`cockpit_gradnoise.logs.stream`
writes and reads them, :mod:`cockpit_gradnoise.logs.selective` reads parts of
them): the header that tells it from a JSON log, the three name tables, the
numbers as little-endian float64 and where the NaN and inf among them are.

This module imports neither torch nor Cockpit.
"""

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise.logs.schema import decode_float, encode_float, update_statistics

import numpy

FORMAT = "cockpit-gradnoise-log"
#: Version 2 added the ``{"superseded": s}`` line (a run resumed from an earlier
#: step, :func:`superseded_by`); readers take both, and a version-1 log continued by a resumed run keeps
#: its header (readers from before version 2 refuse it at a superseded line).
VERSION = 2
SUFFIX = ".jsonl"
#: The first line of every streamed log (also how a reader tells it from a JSON log).
HEADER = json.dumps({"format": FORMAT, "version": VERSION})
#: The header lines this version reads (all of the same length).
HEADERS = tuple(json.dumps({"format": FORMAT, "version": v}).encode() for v in (1, VERSION))

#: The three name tables of a streamed log, in the order its ``names`` lines list them.
TABLES = ("quantities", "params", "statistics")
#: How a record stores its numbers: little-endian float64.
DTYPE = numpy.dtype("<f8")
_UPDATE_FIELDS = ("name", "norm", "start_norm")  # frame.LoggedUpdate's, a live LayerUpdate's


def json_log_path(path) -> Path:
    """The path :func:`write_log` writes for ``path``: ``.json`` added unless it ends so."""
    path = Path(path)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def read_path(path) -> Path:
    """The file to read for ``path``: as given if it is a file, else with ``.json`` or ``.jsonl``."""
    path = Path(path)
    if path.is_file() or path.suffix in (".json", SUFFIX):
        return path
    for suffix in (".json", SUFFIX):
        candidate = path.with_name(path.name + suffix)
        if candidate.is_file():
            return candidate
    return json_log_path(path)


def category_codes(table: Sequence[str], present) -> Tuple[numpy.ndarray, List[str]]:
    """``(remap, categories)``: the present names of ``table`` sorted, and each position's code.

    ``remap[i]`` is the code of ``table[i]`` among ``categories`` (in the
    smallest integer type that holds them, as pandas stores codes); ``-1``
    for a name not present. The categories of a tidy frame's text columns.
    """
    names = sorted((table[i], i) for i in present)
    dtype = numpy.int8 if len(names) < 2**7 else numpy.int16 if len(names) < 2**15 else numpy.int32
    remap = numpy.full(len(table), -1, dtype=dtype)
    remap[[i for _, i in names]] = numpy.arange(len(names))
    return remap, [name for name, _ in names]


def _is_update(item) -> bool:
    return all(hasattr(item, attribute) for attribute in _UPDATE_FIELDS)


def per_parameter(value) -> Optional[Mapping[str, Mapping[str, Any]]]:
    """``{param: {statistic: value}}`` if ``value`` is one of this package's, else ``None``."""
    # A plain list of per-parameter items (UpdateSize: Cockpit's Distance panel
    # reads only floats and plain lists).
    if isinstance(value, list) and value and all(map(_is_update, value)):
        return update_statistics(value)
    if isinstance(value, Mapping) and value and all(
        isinstance(stats, Mapping) for stats in value.values()
    ):
        return value
    return None


def jsonable(value):
    """``value`` as plain JSON: non-finite floats encoded, NumPy arrays as lists."""
    if isinstance(value, Mapping):
        return {str(key): jsonable(val) for key, val in value.items()}
    if isinstance(value, numpy.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (list, tuple)):
        return [jsonable(val) for val in value]
    if isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    if isinstance(value, (int, numpy.integer)):
        return int(value)
    if isinstance(value, (float, numpy.floating)):
        return encode_float(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)  # an object JSON cannot hold: its text, never a crash mid-training


_CODES = {encode_float(x) for x in (math.nan, math.inf, -math.inf)}


def as_numbers(rows: Mapping[str, Mapping[str, Any]]) -> Optional[numpy.ndarray]:
    """Every value of ``rows``, row after row, as float64 (codes decoded); ``None`` if one is not a number.

    What :func:`~cockpit_gradnoise.to_frame` makes of them
    (:func:`~cockpit_gradnoise.logs.schema.decode_float` of each), faster.
    """
    flat = [number for statistics in rows.values() for number in statistics.values()]
    kinds = {number.__class__ for number in flat}
    try:
        if kinds <= {float, int, str} and all(
            number in _CODES for number in flat if number.__class__ is str
        ):
            return numpy.array(flat, dtype=DTYPE)  # floats, and the codes' text as numpy reads it
        return numpy.fromiter(map(decode_float, flat), dtype=DTYPE, count=len(flat))
    except (TypeError, ValueError, OverflowError):
        return None


def non_finite_runs(numbers: numpy.ndarray) -> Dict[str, List[List[int]]]:
    """``{"nan": [[start, stop], ...], "inf": ..., "-inf": ...}``: the runs of positions of each.

    Runs, not positions: a diverged step (every number NaN) is one run, a
    healthy one none.
    """
    if numpy.isfinite(numbers).all():
        return {}
    runs = {}
    for kind, mask in (("nan", numpy.isnan(numbers)), ("inf", numbers == math.inf),
                       ("-inf", numbers == -math.inf)):
        if mask.any():
            edges = numpy.flatnonzero(numpy.diff(numpy.concatenate(([0], mask.view(numpy.int8), [0]))))
            runs[kind] = edges.reshape(-1, 2).tolist()
    return runs


def superseded_by(item: Mapping) -> Callable[[int, str], bool]:
    """Which records a ``{"superseded": s, "after": {quantity: t}}`` line sets apart.

    Of the records before the line: those of a quantity listed in ``after``
    at steps ``> t`` (a run resumed from a checkpoint at which the quantity's
    last record was of step ``t``), and of any other quantity at steps
    ``>= s``. Without ``after`` (a restart at step ``s`` without a
    checkpoint): every record of a step ``>= s``.

    Returns:
        ``(step, quantity name) -> bool``: whether that record is superseded.

    Raises:
        ValueError: The line's steps are not integers.
    """
    first, after = item["superseded"], item.get("after", {})
    if not isinstance(first, int) or not isinstance(after, dict) or not all(
            isinstance(step, int) for step in after.values()):
        raise ValueError("a superseded line's steps are not integers")

    def superseded(step: int, quantity: str) -> bool:
        last = after.get(quantity)
        return step >= first if last is None else step > last

    return superseded


def is_streamed(path) -> bool:
    """Whether the file at ``path`` starts with a streamed log's header."""
    with open(path, "rb") as file:
        return file.readline(len(HEADER) + 2).rstrip(b"\r\n") in HEADERS


def free_name(path: Path, template: str) -> Path:
    """The first of ``template.format(stem=..., n=1, suffix=...)``, ``n=2``, ... not taken."""
    number = 1
    while True:
        candidate = path.with_name(template.format(stem=path.stem, n=number, suffix=path.suffix,
                                                   name=path.name))
        if not os.path.lexists(candidate):
            return candidate
        number += 1


def keep_aside(path: Path) -> Path:
    """Move the file at ``path`` to a free name (``run.jsonl`` -> ``run.1.jsonl``, ...); that name.

    A hard link, then the old name removed: an existing file is never overwritten.
    """
    while True:
        kept = free_name(path, "{stem}.{n}{suffix}")
        try:
            os.link(path, kept)
        except FileExistsError:  # taken meanwhile
            continue
        except OSError:  # no hard links here: a rename to the name found free
            os.rename(path, kept)
            return kept
        os.unlink(path)
        return kept


def trim_for_append(path: Path):
    """Make the streamed log at ``path`` ready to append to: cut after its last whole line,
    and a summary line there (a resumed writer rewrites it, whole, at close).

    A cut line (a writer killed mid-write) goes to a side file, with a warning.
    """
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # the end of the last whole line, read backwards in chunks
            start = max(0, end - (1 << 16))
            file.seek(start)
            cut = file.read(end - start).rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
        if end < size:
            file.seek(end)
            side = free_name(path, "{name}.cut{n}")
            side.write_bytes(file.read())
            warnings.warn(f"{path}: its last line was cut short (the writer stopped mid-write); "
                          f"moved to {side}, the log continues after the last whole line",
                          stacklevel=4)
        if end > 0:  # the summary of the run that closed: the next close writes all of it
            file.seek(max(0, end - (1 << 20)))
            tail = file.read(end - file.tell())
            line = tail[tail.rfind(b"\n", 0, len(tail) - 1) + 1:]
            if line.startswith(b'{"layout": [], "summary": '):
                end -= len(line)
        if end < len(HEADER) + 1:  # nothing but a (cut) header
            file.seek(0)
            file.write((HEADER + "\n").encode())
            end = len(HEADER) + 1
        file.truncate(end)
