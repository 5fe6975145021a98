"""The streamed log's codec: its header, name tables, number encoding and paths.

What a line of a streamed log holds (:mod:`cockpit_gradnoise.logs.stream`
writes and reads them, :mod:`cockpit_gradnoise.logs.selective` reads parts of
them): the header that tells it from a JSON log, the three name tables, the
numbers as little-endian float64 and where the NaN and inf among them are.

This module imports neither torch nor Cockpit.
"""

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise.logs.schema import decode_float, encode_float, update_statistics

import numpy

FORMAT = "cockpit-gradnoise-log"
VERSION = 1
SUFFIX = ".jsonl"
#: The first line of every streamed log (also how a reader tells it from a JSON log).
HEADER = json.dumps({"format": FORMAT, "version": VERSION})

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


def is_streamed(path) -> bool:
    """Whether the file at ``path`` starts with a streamed log's header."""
    with open(path, "rb") as file:
        return file.readline(len(HEADER) + 2).rstrip(b"\r\n") == HEADER.encode()
