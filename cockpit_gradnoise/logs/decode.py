"""Decoding a streamed log's numbers from their base64 text, only those asked for.

:mod:`cockpit_gradnoise.logs.selective` says which numbers of which records
a view reads; this module reads the file in windows of up to 16 MB in file
order and decodes the records that read the same positions together, with
NumPy, from the characters of those numbers only (:func:`_gather`): decoding
loops over windows and plans, not records. Anything unexpected raises
:class:`Unexpected`, and the caller reads the log whole.
"""

import binascii
import os
from typing import List

from cockpit_gradnoise.logs.codec import DTYPE

import numpy


class Unexpected(Exception):
    """The log is not one this reader takes: the caller reads it whole."""


def base64_chars(count: int) -> int:
    """Length of the base64 text of ``count`` float64 numbers."""
    return 4 * -(-8 * count // 3)


def decode_all(fd, index, record: int) -> numpy.ndarray:
    """Every number of ``record`` of the :class:`~cockpit_gradnoise.logs.selective.LogIndex`
    ``index``, read from the open file ``fd``."""
    layout = int(index.layout[record])
    count = len(index.layouts[layout][0])
    text = os.pread(fd, base64_chars(count), int(index.offset[record]))
    raw = binascii.a2b_base64(text)
    if len(raw) != 8 * count:
        raise Unexpected
    return numpy.frombuffer(raw, dtype=DTYPE)


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


def by_plan(places: numpy.ndarray, plan: numpy.ndarray) -> List[numpy.ndarray]:
    """``places`` split by their plan (``plan[places]``), each part in the given order."""
    places = places[numpy.argsort(plan[places], kind="stable")]
    return numpy.split(places, numpy.flatnonzero(numpy.diff(plan[places])) + 1)


def frame_rows(firsts: numpy.ndarray, width: int) -> numpy.ndarray:
    """The frame's rows of records whose first rows are ``firsts``, ``width`` each."""
    return firsts[:, None] + numpy.arange(width)


def read_values(index, plans, firsts: numpy.ndarray, total: int) -> numpy.ndarray:
    """The numbers that ``plans`` name, at their rows of the frame, read window by window.

    ``index`` is a :class:`~cockpit_gradnoise.logs.selective.LogIndex`, ``plans``
    the positions each of its layouts is read at.

    Records are read in file order, many at a time (:func:`_windows`, one read
    into a buffer that is reused, so memory stays bounded); of each window the
    records of one plan are decoded together (:func:`_gather`).
    """
    values = numpy.empty(total)
    chars = numpy.array([base64_chars(len(index.layouts[layout][0])) for layout in plans.layout],
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
                raise Unexpected  # the file is shorter than its index says
            for members in by_plan(places, plans.plan):
                plan = int(plans.plan[members[0]])
                found = plans.positions[plan]
                values[frame_rows(firsts[members], len(found))] = _gather(
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
            raise Unexpected  # not base64 where a number is read
        bits = [part.astype(numpy.uint64) for part in bits]
        high = bits[0] << 24 | bits[1] << 12 | bits[2]
        low = bits[3] << 24 | bits[4] << 12 | bits[5]
        number = high << (numpy.uint64(28) + shift) | low >> (numpy.uint64(8) - shift)
        rows[at:at + step] = number.astype(">u8").view(DTYPE)
    return rows
