"""The rows of a streamed log that the report and the dashboard read, and only those.

:func:`report_frame` and :func:`plot_frame` give a subset of the rows of
:func:`cockpit_gradnoise.to_frame` (same order, same categories, same
values, :mod:`cockpit_gradnoise.selective`) on which
:func:`~cockpit_gradnoise.findings.build_report` and
:func:`~cockpit_gradnoise.dashboard.plot` give what they give on the full
frame. Each pick below says which of their reads it serves; the subset is
what makes a 10,000-step, 200-tensor log (52 M numbers) readable in a
second: a few million of its numbers are decoded.

What every view reads, and the picks that serve it (:func:`_base`):

- the tracked steps and the (step, quantity) blocks (``quantity_steps``,
  ``holdings``, ``tracked_steps``): the first number of every record;
- the steps that went NaN or inf (``non_finite``, ``non_finite_summary``):
  of each record, the first NaN or inf that ``non_finite`` counts (the index
  knows where they are); and every number at the first such step, where
  ``non_finite_summary`` lists the layers and quantities;
- the batch size (``recorded_batch_size``: the first finite ``batch_size``
  row at the latest step that has one): ``batch_size`` of every record
  holding a NaN or inf, and of each quantity's last all-finite record;
- the ranking (``noise_ranking``): the first of ``RANKINGS`` that the
  records hold for a layer, of every parameter;

``None`` from either: read the log whole (not a streamed log, damage, or
numbers this reader does not take).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence

from cockpit_gradnoise import selective
from cockpit_gradnoise._views import (
    DEFAULT_TOP_K,
    RANKINGS,
    default_layers,
    layer_order,
    non_finite,
    non_finite_summary,
    select,
)
from cockpit_gradnoise.schema import (
    B_SIMPLE,
    BATCH_SIZE,
    COVERAGE_STATISTICS,
    GRADIENT_VARIANCE,
    NETWORK,
    NOISE_SCALE,
    QUANTITIES,
    UPDATE_RELATIVE,
    ZERO_GRAD_FRACTION,
)

import numpy

if TYPE_CHECKING:
    import pandas


def _held(frame) -> bool:
    """Whether the frame holds one of this package's quantities (else the caller says what it holds)."""
    return not frame.empty and bool(frame.quantity.isin(QUANTITIES).any())


def _batch_size(index: selective.LogIndex, records: numpy.ndarray) -> selective.Pick:
    """``batch_size`` of the ``records`` with a NaN or inf, and of each quantity's last finite one.

    The latest finite ``batch_size`` row is in one of these: a later
    all-finite record with the statistic would hold a later one.
    """
    holds = numpy.array([len(index.positions(layout, statistics=[BATCH_SIZE])) > 0
                         for layout in range(len(index.layouts))], dtype=bool)
    candidates = records & holds[index.layout] if len(holds) else records & False
    chosen = candidates & ~index.finite
    finite = numpy.flatnonzero(candidates & index.finite)
    if len(finite):
        quantities = index.quantity[finite]
        # The last of each quantity: records are in step order.
        last = len(finite) - 1 - numpy.unique(quantities[::-1], return_index=True)[1]
        chosen[finite[last]] = True
    return selective.named(index, chosen, statistics=[BATCH_SIZE])


def _ranking(index: selective.LogIndex, records: numpy.ndarray) -> List[selective.Pick]:
    """The statistic ``noise_ranking`` ranks by among ``records``, of every parameter."""
    for quantity, statistic, _ in RANKINGS:
        held = records & index.records_of(quantity)
        for layout in numpy.unique(index.layout[held]).tolist():
            positions = index.positions(layout, statistics=[statistic])
            params = [index.params[p] for p in index.layouts[layout][0][positions].tolist()]
            if any(param != NETWORK for param in params):
                return [selective.named(index, held, statistics=[statistic])]
    return []


def _alarm(index: selective.LogIndex):
    """For :func:`selective.non_finite_rows`: of a record's NaN and inf, the first that
    :func:`~cockpit_gradnoise._views.non_finite` counts (none if it counts none).

    ``non_finite_summary`` needs of each step only whether it holds one, and
    every row of its first such step (:func:`_first_bad`).
    """
    import pandas

    def first(quantity: int, layout: int, pattern) -> numpy.ndarray:
        positions = numpy.concatenate(list(pattern.values()))
        values = numpy.concatenate([numpy.full(len(p), float(kind)) for kind, p in pattern.items()])
        params, statistics = index.layouts[layout]
        rows = pandas.DataFrame({
            "quantity": [index.quantities[quantity]] * len(positions),
            "param": [index.params[p] for p in params[positions].tolist()],
            "statistic": [index.statistics[s] for s in statistics[positions].tolist()],
            "value": values,
        })
        return numpy.sort(positions[non_finite(rows)])[:1]

    return first


def _base(index: selective.LogIndex):
    """The first number of every record and the NaN and inf that count: blocks, steps, divergence."""
    picks = [selective.first_rows(index), selective.non_finite_rows(index, _alarm(index))]
    return picks, index.frame(picks)


def _first_bad(index: selective.LogIndex, summary) -> List[selective.Pick]:
    if summary is None:
        return []
    return [selective.whole(index, index.step == summary.first)]


def report_frame(path, step: Optional[int] = None) -> Optional["pandas.DataFrame"]:
    """The rows of the streamed log at ``path`` that ``build_report(frame, step=step)`` reads.

    Besides :func:`_base`'s: every number of the records at the steps the
    report reads each quantity at (its table and coverage), and of the
    network's rows the statistics of its run history, up to the report's step.
    Where ``build_report`` raises (``step`` outside the log, none of this
    package's quantities), the first numbers alone: it raises the same on them.
    """
    from cockpit_gradnoise.findings import finite_report_step, quantity_steps

    index = selective.index_log(path)
    if index is None:
        return None
    picks, base = _base(index)
    if base is None or not _held(base):
        return base
    summary = non_finite_summary(base)  # its steps are the full frame's
    try:
        steps = quantity_steps(base, finite_report_step(summary, step))
    except ValueError:
        return base
    upto = index.step <= max(steps.values())
    picks += _first_bad(index, summary) + _ranking(index, upto) + [
        selective.whole(index, numpy.isin(index.step, list(set(steps.values())))),
        selective.named(index, upto, params=[NETWORK],
                        statistics=[ZERO_GRAD_FRACTION, UPDATE_RELATIVE, B_SIMPLE]),
        _batch_size(index, upto),
    ]
    return index.frame(picks)


def plot_frame(path, *, layers: Optional[Sequence[str]] = None, top_k: int = DEFAULT_TOP_K,
               heatmap: str = "auto") -> Optional["pandas.DataFrame"]:
    """The rows of the streamed log at ``path`` that ``dashboard.plot`` reads with these arguments.

    Besides :func:`_base`'s: the first record of each quantity and layout
    whole (``layer_order``), the network's coverage, every number of the
    drawn layers and the network (the network only, for the noise scale),
    and the heatmap's statistic at its steps.
    """
    from cockpit_gradnoise import dashboard, panels

    index = selective.index_log(path)
    if index is None:
        return None
    picks, base = _base(index)
    if base is None or not _held(base):
        return base
    everything = numpy.ones(len(index), dtype=bool)
    picks += _first_bad(index, non_finite_summary(base)) + _ranking(index, everything) + [
        selective.first_of_each_layout(index),
        selective.named(index, everything, params=[NETWORK], statistics=COVERAGE_STATISTICS),
        _batch_size(index, everything),
    ]
    ranked = index.frame(picks)
    if ranked is None:
        return None
    order = layer_order(ranked)
    drawn = default_layers(ranked, top_k, order) if layers is None else list(layers)
    noise_scale = index.records_of(NOISE_SCALE)
    panel_records = numpy.any([index.records_of(q) for _, q, _ in dashboard.PANELS], axis=0)
    picks += [selective.named(index, panel_records & ~noise_scale, params=[*drawn, NETWORK]),
              selective.named(index, noise_scale, params=[NETWORK])]
    try:
        statistic = dashboard._heatmap_statistic(
            heatmap, select(ranked, GRADIENT_VARIANCE), len(drawn), len(order))
    except ValueError:
        statistic = None  # plot raises the same
    if statistic:
        variance = index.records_of(GRADIENT_VARIANCE)
        shown = panels.heatmap_steps(numpy.unique(index.step[variance]))
        picks.append(selective.named(index, variance & numpy.isin(index.step, shown),
                                     statistics=[statistic]))
    return index.frame(picks)
