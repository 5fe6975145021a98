"""The streamed log's summary line: records per quantity and the sums that rank layers.

Gathered as a :class:`~cockpit_gradnoise.LogStream` writes its records (and
rebuilt from a log it continues); see :mod:`cockpit_gradnoise.logs.stream`
for the line's content. This module imports neither torch nor Cockpit.
"""

from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.logs.schema import RANKINGS

import numpy


class RunningMeans:
    """Per parameter, the finite values of one statistic summed as pandas' group mean sums them.

    pandas' ``groupby(...).mean()`` adds a group's values in row order with
    Kahan's compensation (``y = x - c; t = s + y; c = (t - s) - y; s = t``)
    and divides by their count; the same operations in the same order (the
    frame's rows are in step order, and steps only grow here) give the same
    sum to the bit. Stays exact only while every sum is finite (``finite``).
    """

    def __init__(self):
        self.order: List[int] = []  # parameters in the order each first had a finite value
        self.sums, self.compensations = numpy.zeros(0), numpy.zeros(0)
        self.counts = numpy.zeros(0, dtype=numpy.int64)
        self.steps = 0

    def add(self, params: numpy.ndarray, values: numpy.ndarray):
        """One record's values of the statistic, of ``params`` (table positions, each once)."""
        self.steps += 1
        kept = numpy.isfinite(values)
        params, values = params[kept], values[kept]
        if len(params) and params.max() >= len(self.sums):
            grown = int(params.max()) + 1 - len(self.sums)
            self.sums = numpy.r_[self.sums, numpy.zeros(grown)]
            self.compensations = numpy.r_[self.compensations, numpy.zeros(grown)]
            self.counts = numpy.r_[self.counts, numpy.zeros(grown, dtype=numpy.int64)]
        self.order += params[self.counts[params] == 0].tolist()
        y = values - self.compensations[params]
        t = self.sums[params] + y
        self.compensations[params] = (t - self.sums[params]) - y
        self.sums[params] = t
        self.counts[params] += 1

    def finite(self) -> bool:
        """Whether every sum is finite (pandas' sums then equal these)."""
        return bool(numpy.isfinite(self.sums).all() and numpy.isfinite(self.compensations).all())


class Summary:
    """What the summary line says, gathered as the records are written."""

    def __init__(self):
        self.last: Dict[int, int] = {}  # quantity -> its last step written
        self.grew = set()  # quantities whose steps only grew (no record replaced)
        self.records: Dict[int, int] = {}  # quantity -> records with numbers
        self.ranked: List[List[Tuple[int, numpy.ndarray, numpy.ndarray]]] = []  # per layout
        self.means: Dict[Tuple[int, int], RunningMeans] = {}

    def layout(self, layout, statistics: Dict[str, int]):
        """A new layout: where its ranked statistics are, and of which parameters."""
        params = numpy.array([p for p, names in layout for _ in names], dtype=numpy.int64)
        codes = numpy.array([s for _, names in layout for s in names], dtype=numpy.int64)
        self.ranked.append([
            (statistics[name], numpy.flatnonzero(codes == statistics[name]),
             params[codes == statistics[name]])
            for name in sorted({statistic for _, statistic, _ in RANKINGS}) if name in statistics
        ])

    def add(self, quantity: int, step: int, layout: Optional[int] = None, numbers=None):
        """A record written: of ``quantity`` at ``step``, its ``numbers`` in ``layout``."""
        if quantity not in self.last:
            self.grew.add(quantity)
        elif step <= self.last[quantity]:
            self.grew.discard(quantity)  # a step replaced or out of order: no sums
        self.last[quantity] = step
        if layout is None or not len(numbers):
            return
        self.records[quantity] = self.records.get(quantity, 0) + 1
        if quantity not in self.grew:
            return
        for statistic, positions, params in self.ranked[layout]:
            if len(positions):
                self.means.setdefault((quantity, statistic), RunningMeans()).add(
                    params, numbers[positions])

    def line(self) -> dict:
        """The summary line's content."""
        sums = [{"quantity": quantity, "statistic": statistic, "steps": means.steps,
                 "params": means.order, "sums": means.sums[means.order].tolist(),
                 "finite": means.counts[means.order].tolist()}
                for (quantity, statistic), means in self.means.items()
                if quantity in self.grew and means.finite()]
        return {"records": sorted(map(list, self.records.items())), "sums": sums}


__all__ = ["RunningMeans", "Summary"]
