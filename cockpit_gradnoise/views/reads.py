"""The rows of a streamed log that the report and the dashboard read, and only those.

:func:`report_frame` and :func:`plot_rows` give a subset of the rows of
:func:`cockpit_gradnoise.to_frame` (same order, same categories, same
values, :mod:`cockpit_gradnoise.logs.selective`) on which
:func:`~cockpit_gradnoise.views.report.build_report` and
:func:`~cockpit_gradnoise.views.sources.plot` give what they give on the full
frame. Each pick below says which of their reads it serves; of a
10,000-step, 200-tensor log (52 M numbers) about 2 M are decoded for the
report and 0.8 M for the dashboard (``benchmarks/README.md``).

The views declare what they read and this module reads by their
declarations: the dashboard's panels (``dashboard.PANELS``), what each line
panel draws besides quantiles (``panels.DRAWN``), the quantiles of a band
(``common.band_statistics``) and the network's run history
(``findings.HISTORY``). The dashboard and the panels, and matplotlib with
them, are imported only to draw: a report needs neither.

What both views read, and the picks that serve it:

- the tracked steps and the (step, quantity) blocks (``quantity_steps``,
  ``holdings``, ``tracked_steps``): a number of every record (:func:`_base`);
- the steps that went NaN or inf (``non_finite``, ``non_finite_summary``):
  of each record, the first NaN or inf that ``non_finite`` counts (the index
  knows where they are, :func:`_alarm`); and every number at the first such
  step, where ``non_finite_summary`` lists the layers and quantities;
- the batch size (``recorded_batch_size``: the first finite ``batch_size``
  row at the latest step that has one): ``batch_size`` of each quantity's
  latest record holding a finite one (:func:`_batch_size`);
- the ranking (``noise_ranking``): from the sums of the log's summary line
  where it has one (:func:`_summed`), else the first of ``RANKINGS`` that
  the records hold for a layer, of every parameter (:func:`_ranking`);

``None`` from either: read the log whole (not a streamed log, damage, or
numbers this reader does not take).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from cockpit_gradnoise.logs import selective
from cockpit_gradnoise.logs.schema import (
    BATCH_SCHEDULE,
    BATCH_SIZE,
    COVERAGE_STATISTICS,
    GRADIENT_VARIANCE,
    MEAN,
    NETWORK,
    NOISE_SCALE,
    PER_EXAMPLE_NORM,
    PRECONDITIONED_NOISE_SCALE,
    QUANTITIES,
    RANKINGS,
    TWO_BATCH_NOISE_SCALE,
)
from cockpit_gradnoise.logs.table import Column, Rows
from cockpit_gradnoise.views.advice import READ as ADVICE_READ
from cockpit_gradnoise.views.common import (
    DEFAULT_TOP_K,
    Ranking,
    band_statistics,
    chosen_layers,
    finite_means,
    layer_order,
    lowest_first,
    non_finite,
    non_finite_summary,
    ranking_of,
    select,
    stable_order,
)
from cockpit_gradnoise.views.findings import HISTORY
from cockpit_gradnoise.views.report import finite_report_step, quantity_steps

import numpy

if TYPE_CHECKING:
    import pandas


def held(frame) -> bool:
    """Whether the frame holds one of this package's quantities (else the caller says what it holds)."""
    return not frame.empty and bool(frame.quantity.isin(QUANTITIES).any())


def _batch_size(index: selective.LogIndex, records: numpy.ndarray) -> selective.Pick:
    """``batch_size`` of each quantity's last of ``records`` that holds a finite one.

    ``recorded_batch_size`` reads the first finite ``batch_size`` row at the
    latest step that has one: the latest of these records (the index knows
    where the NaN and inf are, so nothing is decoded to find them).
    """
    positions = [index.positions(layout, statistics=[BATCH_SIZE])
                 for layout in range(len(index.layouts))]
    holding = numpy.array([len(p) > 0 for p in positions] + [False])[index.layout] & records
    missing = set(index.quantity[holding].tolist())
    chosen = numpy.zeros(len(index), dtype=bool)
    for record in numpy.flatnonzero(holding)[::-1].tolist():  # latest first
        quantity = int(index.quantity[record])
        if quantity not in missing:
            continue
        if record in index.non_finite:
            pattern = index.patterns[index.non_finite[record]]
            bad = numpy.concatenate(list(pattern.values()))
            if numpy.isin(positions[index.layout[record]], bad).all():
                continue
        missing.discard(quantity)
        chosen[record] = True
        if not missing:
            break
    return selective.named(index, chosen, statistics=[BATCH_SIZE])


def _ranked_by(index: selective.LogIndex, records: numpy.ndarray):
    """``(quantity, statistic, pick)``: what ``noise_ranking`` ranks by among ``records``, and
    the pick of its numbers, of every parameter; ``None`` without one."""
    for quantity, statistic, _ in RANKINGS:
        held = records & index.records_of(quantity)
        for layout in numpy.unique(index.layout[held]).tolist():
            positions = index.positions(layout, statistics=[statistic])
            params = [index.params[p] for p in index.layouts[layout][0][positions].tolist()]
            if any(param != NETWORK for param in params):
                return quantity, statistic, selective.named(index, held, statistics=[statistic])
    return None


def _summary_sums(index: selective.LogIndex, until: Optional[int] = None):
    """``(True, (quantity, statistic), sums)``: what ``noise_ranking(frame, until)`` ranks by
    and its sums from the log's summary (:meth:`selective.LogIndex.sums`), nothing decoded;
    ``(True, None, None)`` with nothing to rank by; ``(False, None, None)`` where the summary
    does not give it (none, or ``until`` before the last step ranked)."""
    found = _ranked_by(index, numpy.ones(len(index), dtype=bool))
    if found is None:
        return True, None, None
    quantity, statistic, _ = found
    sums = index.sums(quantity, statistic)
    if sums is None or (until is not None and (index.step[index.records_of(quantity)]
                                               > until).any()):
        return False, None, None
    return True, (quantity, statistic), sums


def _summed(index: selective.LogIndex, until: Optional[int] = None
            ) -> Tuple[bool, Optional[Ranking]]:
    """``(True, noise_ranking(frame, until))`` of the full frame from the log's summary
    (:func:`_summary_sums`); ``(False, None)`` where the summary does not give it.

    ``sums / finite`` are the group means ``noise_ranking`` takes, to the bit.
    """
    import pandas

    summed, ranked_by, sums = _summary_sums(index, until)
    if sums is None:
        return summed, None
    means = pandas.Series(sums.sums / sums.finite, index=sums.params)  # each finite at least once
    return True, ranking_of(*ranked_by, means, pandas.Series(sums.finite, index=sums.params),
                            sums.steps)


def _ranking(index: selective.LogIndex, records: numpy.ndarray) -> List[selective.Pick]:
    """The statistic ``noise_ranking`` ranks by among ``records``, of every parameter."""
    found = _ranked_by(index, records)
    return [] if found is None else [found[2]]


def _noisiest(index: selective.LogIndex, top_k: int, order: List[str]) -> Optional[List[str]]:
    """``default_layers(frame, top_k, order)`` of the full frame, from the log's summary
    (:func:`_summary_sums`), else from the ranking's numbers alone: 2 M of them on a long
    run, without their frame.

    The same scores as :func:`~cockpit_gradnoise.views.common.noise_ranking`'s
    (pandas' group mean of the finite values, over the rows in the frame's
    order, groups in order of appearance), the same stable sort, the same
    choice. ``None`` where a number cannot be read. With a summary, pandas is not imported.
    """
    summed, ranked_by, sums = _summary_sums(index)
    if sums is not None:
        kept = [i for i, name in enumerate(sums.params) if name != NETWORK]
        means = (sums.sums / sums.finite)[kept]  # each finite at least once
        ranked = [sums.params[kept[i]] for i in stable_order(means, lowest_first(*ranked_by))]
        return chosen_layers(ranked, order, top_k)
    if summed:
        return chosen_layers([], order, top_k)  # nothing to rank by
    import pandas

    quantity, statistic, pick = _ranked_by(index, numpy.ones(len(index), dtype=bool))
    numbers = index.numbers([pick])
    if numbers is None:
        return None
    means, counts = finite_means(pandas.Series(numbers.value), numbers.param)
    means.index = counts.index = [index.params[p] for p in means.index.tolist()]
    ranking = ranking_of(quantity, statistic, means, counts, steps=0)  # its scores only
    return chosen_layers(ranking.scores.index.tolist(), order, top_k)


def _alarm(index: selective.LogIndex):
    """For :func:`selective.non_finite_rows`: of a record's NaN and inf, the first that
    :func:`~cockpit_gradnoise.views.common.non_finite` counts (none if it counts none).

    ``non_finite_summary`` needs of each step only whether it holds one, and
    every row of its first such step (:func:`_first_bad`).
    """
    def first(quantity: int, layout: int, pattern) -> numpy.ndarray:
        positions = numpy.concatenate(list(pattern.values()))
        values = numpy.concatenate([numpy.full(len(p), float(kind)) for kind, p in pattern.items()])
        params, statistics = index.layouts[layout]
        rows = Rows(numpy.zeros(len(positions), dtype=numpy.int64),
                    Column(numpy.zeros(len(positions), dtype=numpy.int64),
                           [index.quantities[quantity]]),
                    Column(params[positions], index.params),
                    Column(statistics[positions], index.statistics), values)
        return numpy.sort(positions[non_finite(rows)])[:1]

    return first


def _base(index: selective.LogIndex):
    """A number of every record and the NaN and inf that count: blocks, steps, divergence.

    The rows of where they are, nothing decoded (:meth:`selective.LogIndex.rows`).
    """
    picks = [selective.first_rows(index), selective.non_finite_rows(index, _alarm(index))]
    return picks, index.rows(picks, decode=False)


def _indexed(path):
    """``(index, picks, base)`` of :func:`_base` for the log at ``path``; ``None`` where the
    fast path does not apply (not indexable, or none of this package's quantities)."""
    index = selective.index_log(path)
    if index is None:
        return None
    picks, base = _base(index)
    if base is None or not held(base):
        return None
    return index, picks, base


def _first_bad(index: selective.LogIndex, summary) -> List[selective.Pick]:
    if summary is None:
        return []
    return [selective.whole(index, index.step == summary.first)]


def report_frame(path, step: Optional[int] = None
                 ) -> Optional[Tuple["pandas.DataFrame", Optional[Ranking]]]:
    """The rows of the streamed log at ``path`` that ``build_report(frame, step=step)`` reads.

    Besides :func:`_base`'s: every number of the records at the steps the
    report reads each quantity at (its table and coverage), and of the
    network's rows the statistics of its run history and of the advice
    (``advice.READ``: recent noise scales, batch, learning rate), up to the report's step.
    Where ``build_report`` raises (``step`` outside the log, none of this
    package's quantities), the first numbers alone: it raises the same on them.

    Returns:
        ``(frame, ranking)``, ``ranking`` the full frame's ``noise_ranking`` up to
        the report's step from the log's summary (:func:`_summed`), the frame
        then without the ranking's rows; or ``(frame, None)``, the frame with
        them (``build_report`` ranks them). ``None``: read the log whole.
    """
    found = _indexed(path)
    if found is None:
        return None
    index, picks, base = found
    base = base.frame()  # what the report's functions take
    summary = non_finite_summary(base)  # its steps are the full frame's
    try:
        steps = quantity_steps(base, finite_report_step(summary, step))
    except ValueError:
        frame = index.frame(picks)  # build_report raises the same on it
        return None if frame is None else (frame, None)
    upto = index.step <= max(steps.values())
    summed, ranking = _summed(index, max(steps.values()))
    picks += _first_bad(index, summary) + ([] if summed else _ranking(index, upto)) + [
        selective.whole(index, numpy.isin(index.step, list(set(steps.values())))),
        selective.named(index, upto, params=[NETWORK], statistics=sorted({*HISTORY, *ADVICE_READ})),
        _batch_size(index, upto),
        selective.whole(index, upto & index.records_of(BATCH_SCHEDULE)),  # the advice's schedule
    ]
    frame = index.frame(picks)
    return None if frame is None else (frame, ranking)


def _drawn(index: selective.LogIndex, quantity: str, params: List[str], declared: List[str]
           ) -> List[selective.Pick]:
    """What a line panel reads of ``params``: its statistics, and one number per record.

    ``declared``: the statistics the panel draws besides quantiles
    (:data:`~cockpit_gradnoise.views.panels.DRAWN`).

    Of the quantiles, the lowest, the highest and the median or the one
    closest to it (:func:`~cockpit_gradnoise.views.common.band_statistics`, as
    ``panels._bands`` draws; the mean only without quantiles);
    one number of each record holding one of ``params`` keeps the panel's
    steps those of the full frame.
    """
    records = index.records_of(quantity)
    names = {index.statistics[s] for layout in numpy.unique(index.layout[records]).tolist()
             for s in index.layouts[layout][1][index.positions(layout, params=params)].tolist()}
    wanted = set(declared) & names
    band = band_statistics(names)
    if quantity in (GRADIENT_VARIANCE, PER_EXAMPLE_NORM) and band is not None:
        wanted |= set(band)
    elif quantity in (GRADIENT_VARIANCE, PER_EXAMPLE_NORM):
        wanted |= {MEAN} & names

    def one(layout):
        return index.positions(layout, params=params)[:1]

    return [selective.named(index, records, params=params, statistics=sorted(wanted)),
            selective.Pick(records, one)]


def plot_rows(path, *, layers: Optional[Sequence[str]] = None, top_k: int = DEFAULT_TOP_K,
              heatmap: str = "auto") -> Optional[Tuple[Rows, List[str]]]:
    """The rows of the streamed log at ``path`` that ``dashboard.figure`` reads, and its layers.

    ``figure(frame, layers=drawn, top_k=top_k, heatmap=heatmap)`` with the
    returned ``(frame, drawn)`` draws the dashboard of the full log with
    ``layers``: without them, ``drawn`` are the ``top_k`` noisiest as a
    :class:`~cockpit_gradnoise.views.dashboard.Ranked` (ranked here, on every
    layer's SNR, which the frame then leaves out).

    Besides :func:`_base`'s: the first record of each quantity and layout
    whole (``layer_order``), the network's coverage, what the line panels
    draw of the drawn layers and the network (:func:`_drawn`; the network
    only, for the noise scale), and the heatmap's statistic at its steps.
    """
    # The views' declarations, and matplotlib with them: only to draw (a report needs neither).
    from cockpit_gradnoise.views import dashboard, panels

    found = _indexed(path)
    if found is None:
        return None
    index, picks, base = found
    everything = numpy.ones(len(index), dtype=bool)
    first = selective.first_of_each_layout(index)
    picks += _first_bad(index, non_finite_summary(base)) + [
        first,
        selective.named(index, everything, params=[NETWORK], statistics=COVERAGE_STATISTICS),
        _batch_size(index, everything),
    ]
    # The layers' order (every layer is in the first record of a quantity and layout),
    # and the ranking's rows apart (the frame drawn leaves them out).
    firsts = index.rows([first])
    if firsts is None:
        return None
    order, drawn = layer_order(firsts), list(layers or [])
    if layers is None:
        noisiest = _noisiest(index, top_k, order)
        if noisiest is None:
            return None
        drawn = dashboard.Ranked(noisiest)
    variance_rows = not select(firsts, GRADIENT_VARIANCE).empty
    for _, quantity, _ in dashboard.PANELS:
        picks += _drawn(index, quantity, [NETWORK] if quantity == NOISE_SCALE
                        else [*drawn, NETWORK], panels.DRAWN.get(quantity, []))
    for quantity in (PRECONDITIONED_NOISE_SCALE, TWO_BATCH_NOISE_SCALE):  # the noise scale's panel
        picks += _drawn(index, quantity, [NETWORK], panels.DRAWN[quantity])
    picks.append(selective.whole(index, index.records_of(BATCH_SCHEDULE)))  # its marks
    try:
        statistic = dashboard.heatmap_statistic(heatmap, variance_rows, len(drawn), len(order))
    except ValueError:
        statistic = None  # plot raises the same
    if statistic:
        variance = index.records_of(GRADIENT_VARIANCE)
        shown = panels.heatmap_steps(numpy.unique(index.step[variance]))
        picks.append(selective.named(index, variance & numpy.isin(index.step, shown),
                                     statistics=[statistic]))
    rows = index.rows(picks)
    return None if rows is None else (rows, drawn)
