"""One panel per quantity: each draws into a matplotlib ``Axes`` it is given.

Every panel reads only the tidy frame of :func:`cockpit_gradnoise.to_frame`
(columns ``step, quantity, param, statistic, value``). A panel whose quantity
is absent, or has fewer than two tracked steps, writes so in its own area
instead of drawing; no panel raises on missing data.

Layers are told apart by colour: the colour of a layer is its position in
``layers``, so panels given the same ``layers`` agree. With ``layers=None`` a
panel shows :func:`~cockpit_gradnoise.views.common.default_layers` (the
``DEFAULT_TOP_K`` noisiest, ranked as the report ranks them, in model order).
The whole network (``"all"``) is drawn black and bold; when its row covers
only some parameters, the title says so (``"all: 7 of 15 parameters"``).

Values a log scale cannot show are marked on the figure: a zero as a gap in
its line with a downward triangle at the bottom edge (an ``x`` in the
heatmap), an infinite noise scale as an upward triangle at the top edge.
Steps at which the panel's quantity went NaN or inf
(:func:`~cockpit_gradnoise.views.common.non_finite`) are red bands; the finite part
of each line is drawn as usual.

Plot time does not grow with the run's length: a line of more than
:data:`~cockpit_gradnoise.views.axes.MAX_POINTS` steps is thinned to a min/max envelope
(:func:`~cockpit_gradnoise.views.axes.thin`),
the heatmap to at most :data:`MAX_COLUMNS` evenly spaced steps, and runs of
non-finite steps to at most :data:`MAX_BANDS` bands.

Nothing here changes global state: no ``rcParams``, no ``plt.ion()``, no
pyplot figures.
"""

import math
from typing import List, Optional, Tuple

from cockpit_gradnoise.logs.schema import (
    B_SIMPLE,
    B_SIMPLE_SMOOTHED,
    GRADIENT_VARIANCE,
    MAX,
    MEAN,
    NETWORK,
    NOISE_SCALE,
    NORM_RATIO,
    PARAM_GRAD_RATIO,
    PER_EXAMPLE_NORM,
    PRECONDITIONED_NOISE_SCALE,
    SD_MEDIAN,
    SNR_MEDIAN,
    TWO_BATCH_NOISE_SCALE,
    UPDATE_RELATIVE,
    UPDATE_SIZE,
    median_name,
)
from cockpit_gradnoise.logs.table import Column, steps_of, values_of
from cockpit_gradnoise.views.axes import (
    INFINITE_LABEL,
    NETWORK_STYLE,
    NON_FINITE_LABEL,
    ZERO_LABEL,
    ZERO_MARKS,
    change_marks,
    clear_panel,
    edge_marks,
    layer_colors,
    line_order,
    log_labels,
    minor_ticks,
    no_data,
    on_log_scale,
    step_axis,
    thin,
    title_at,
    zero_marks,
)
from cockpit_gradnoise.views.common import (
    THRESHOLDS,
    band_statistics,
    coverage_note,
    default_layers,
    distinct,
    equals,
    layer_order,
    median_note,
    network_coverage,
    non_finite,
    schedule_changes,
    select,
    tracked_steps,
)

import matplotlib
import matplotlib.colors
import numpy

#: The heatmap shows at most this many steps, evenly spaced over the run.
MAX_COLUMNS = 500
#: Non-finite steps are shown as at most this many bands (nearby runs merged).
MAX_BANDS = 100
#: The heatmap labels at most this many rows (every k-th layer beyond): so that each
#: label is at least 6 pt (:func:`noise_heatmap_panel`), and few (each costs the drawing).
MAX_ROW_LABELS = 60

#: What each line panel draws of its quantity besides quantiles (the ones ``_bands`` draws):
#: the declaration :mod:`cockpit_gradnoise.views.reads` reads a streamed log by.
DRAWN = {
    PER_EXAMPLE_NORM: [MAX], PARAM_GRAD_RATIO: [NORM_RATIO],
    UPDATE_SIZE: [UPDATE_RELATIVE], NOISE_SCALE: [B_SIMPLE, B_SIMPLE_SMOOTHED],
    PRECONDITIONED_NOISE_SCALE: [B_SIMPLE, B_SIMPLE_SMOOTHED],  # in the noise scale's panel
    TWO_BATCH_NOISE_SCALE: [B_SIMPLE, B_SIMPLE_SMOOTHED],  # the noise scale's panel without those
}


def _title(frame, quantity, title) -> str:
    """``title``, with what the network's row covers when it leaves parameters out."""
    note = coverage_note(network_coverage(frame, quantity))
    return f"{title} ({note})" if note else title


class Series:
    """One quantity's rows, each ``(param, statistic)`` as arrays sorted by step.

    Built once per panel by one sort of integer codes; reading a line is then
    a slice, never a loop over rows. Of a step logged twice, the later row
    counts, as in the log's dict.
    """

    def __init__(self, rows):
        self.rows = rows
        params, param_names = rows.param.factorize()
        statistics, self._statistics = rows.statistic.factorize()
        key = params.astype(numpy.int64) * max(len(self._statistics), 1) + statistics
        steps = self._row_steps = steps_of(rows)
        order = line_order(key, steps)
        key, steps = key[order], steps[order]
        last = numpy.r_[(key[1:] != key[:-1]) | (steps[1:] != steps[:-1]), True][:len(key)]
        self._key, self._steps = key[last], steps[last]
        self._values = values_of(rows)[order][last]
        starts = numpy.flatnonzero(numpy.r_[True, self._key[1:] != self._key[:-1]]
                                   [:len(self._key)])
        ends = numpy.r_[starts[1:], len(self._key)]
        width = max(len(self._statistics), 1)
        self._lines = {
            (param_names[k // width], self._statistics[k % width]): (start, end)
            for k, start, end in zip(self._key[starts].tolist(), starts, ends)
        }

    def steps(self) -> List[int]:
        """The quantity's tracked steps, ascending."""
        return distinct(self._row_steps).astype(numpy.int64).tolist()

    def statistics(self) -> List[str]:
        """The statistics the quantity logged."""
        return list(self._statistics)

    def of_statistic(self, statistic):
        """The rows of one statistic."""
        return self.rows[equals(self.rows.statistic, statistic)]

    def xy(self, param, statistic) -> Optional[Tuple[numpy.ndarray, numpy.ndarray]]:
        """Steps (ascending) and values of one statistic (``None`` when absent)."""
        found = self._lines.get((param, statistic))
        if found is None:
            return None
        start, end = found
        return self._steps[start:end], self._values[start:end]


def _series(frame, quantity, params=None) -> Series:
    """The :class:`Series` of ``quantity``, of ``params`` only if given."""
    rows = select(frame, quantity)
    if params is not None:
        rows = rows[numpy.asarray(rows.param.isin(list(params)), dtype=bool)]
    return Series(rows)


def _drawable(ax, frame, quantity, title, params=None) -> Optional[Series]:
    """The quantity's series, or ``None`` after writing in ``ax`` why there is no curve."""
    series = _series(frame, quantity, params)
    steps = series.steps()
    if not steps:
        no_data(ax, title, f"no data:\n{quantity} is not in this log")
        return None
    if len(steps) < 2:
        no_data(ax, title, f"no data yet:\n{quantity} has 1 tracked step,\na curve needs two")
        return None
    return series


def _xy(series: Series, param, statistic):
    """Steps and values of one statistic, thinned (:func:`thin`); ``None`` when absent."""
    xy = series.xy(param, statistic)
    if xy is None:
        return None
    kept = thin(*xy)
    return xy[0][kept], xy[1][kept]


def non_finite_bands(ax, frame, quantity):
    """Red bands at the tracked steps where ``quantity`` is NaN or inf in any parameter.

    Each band covers its steps and half the tracking interval on either side;
    runs of such steps closer than the run's length over :data:`MAX_BANDS`
    merge into one band. Returns the steps marked.
    """
    rows = select(frame, quantity)
    bad_steps = tracked_steps(rows[non_finite(rows)])
    if not bad_steps:
        return []
    tracked = numpy.array(tracked_steps(rows))
    bad = numpy.searchsorted(tracked, bad_steps)
    gap = numpy.median(numpy.diff(tracked)) if len(tracked) > 1 else 1.0
    merge = max(1, math.ceil(len(tracked) / MAX_BANDS))
    breaks = numpy.flatnonzero(numpy.diff(bad) > merge)
    starts, ends = bad[numpy.r_[0, breaks + 1]], bad[numpy.r_[breaks, len(bad) - 1]]
    for k, (start, end) in enumerate(zip(tracked[starts], tracked[ends])):
        ax.axvspan(start - gap / 2, end + gap / 2, color="tab:red", alpha=0.15, linewidth=0,
                   zorder=0, label=NON_FINITE_LABEL if k == 0 else "_non_finite")
    return bad_steps


def _layers(frame, layers):
    return default_layers(frame) if layers is None else list(layers)


def _finish(ax, title, ylabel, legend):
    if any(line.get_label() == ZERO_MARKS for line in ax.lines):
        # One legend entry for the zero marks of every layer (each in its colour).
        ax.plot([], [], "v", color="0.4", label=ZERO_LABEL)
    title_at(ax, title)
    step_axis(ax)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    log_labels(ax.yaxis)
    minor_ticks(ax.yaxis, *ax.get_ylim())
    ax.grid(True, which="major", alpha=0.3)
    if legend:
        ax.legend(fontsize="x-small", loc="best")


def _lines(ax, series, statistic, layers, colors, **style):
    """One line per layer in ``layers`` and a bold one for the network.

    Zeros are gaps in the lines, marked at the bottom edge in the line's colour.
    """
    for name in list(layers) + [NETWORK]:
        xy = _xy(series, name, statistic)
        if xy is not None:
            steps, values = xy
            line = NETWORK_STYLE if name == NETWORK else {"color": colors[name], "linewidth": 1.2}
            ax.plot(steps, on_log_scale(values), **{"label": name, **line, **style})
            zero_marks(ax, steps, values, line["color"])


def _band(ax, series, name, low, high, color):
    """The band of one layer between its quantiles ``low`` and ``high``, thinned."""
    lower, upper = series.xy(name, low), series.xy(name, high)
    if lower is None or upper is None:
        return
    steps, at_lower, at_upper = numpy.intersect1d(lower[0], upper[0], return_indices=True)
    bottom, top = lower[1][at_lower], upper[1][at_upper]
    kept = thin(steps, bottom, top)
    steps, bottom, top = steps[kept], bottom[kept], top[kept]
    # Zero or non-finite edges have no place on a log scale: no band there.
    drawable = numpy.isfinite(bottom) & numpy.isfinite(top) & (bottom > 0) & (top > 0)
    # An edge colour, even at linewidth 0, makes Agg stroke a hairline along every
    # zig-zag of the edges: three quarters of the time to draw a long run's bands.
    ax.fill_between(steps, bottom, top, where=drawable, facecolor=color, edgecolor="none",
                    linewidth=0, alpha=0.12)


def _bands(ax, series, layers, colors, legend, title, ylabel):
    """Median lines and lowest-to-highest quantile bands per layer; network median bold."""
    band = band_statistics(series.statistics())
    if band is None:  # no quantiles logged: the mean is all there is
        _lines(ax, series, MEAN, layers, colors)
        _finish(ax, title, f"{ylabel}: {MEAN}", legend)
        return
    low, middle, high = band
    for name in layers if low != high else []:
        _band(ax, series, name, low, high, colors[name])
    _lines(ax, series, middle, layers, colors)
    # Where no median was logged the line is another quantile: the label says so.
    missing = " (no median)" if median_name(series.statistics()) is None else ""
    _finish(ax, title, f"{ylabel}: {middle}{missing}, band {low} to {high}", legend)


def gradient_variance_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer sd of the gradient elements over steps (``GradientVarianceQuantiles``).

    A band from the lowest to the highest logged quantile of ``sd_j`` over a
    layer's elements, the median (or the quantile closest to it) as a line;
    the network's median bold. Log scale; units of ``param.grad``.

    Args:
        ax: Axes to draw into.
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        layers: Parameter names to draw; default
            :func:`~cockpit_gradnoise.views.common.default_layers`.
        legend: Draw a legend in ``ax``.
    """
    title = _title(frame, GRADIENT_VARIANCE, "gradient noise: sd of grad elements")
    layers = _layers(frame, layers)
    series = _drawable(ax, frame, GRADIENT_VARIANCE, title, [*layers, NETWORK])
    if series is not None:
        non_finite_bands(ax, frame, GRADIENT_VARIANCE)
        _bands(ax, series, layers, layer_colors(layers), legend, title, "sd")


def per_example_norm_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer per-example gradient norms ``||g_i||`` over steps (``PerExampleGradNorm``).

    Bands and median lines as :func:`gradient_variance_panel`, plus the
    largest per-example norm of the batch as a dotted line. Log scale.
    """
    title = _title(frame, PER_EXAMPLE_NORM, "per-example gradient norms (dotted: max)")
    layers = _layers(frame, layers)
    series = _drawable(ax, frame, PER_EXAMPLE_NORM, title, [*layers, NETWORK])
    if series is not None:
        non_finite_bands(ax, frame, PER_EXAMPLE_NORM)
        colors = layer_colors(layers)
        _lines(ax, series, MAX, layers, colors, linestyle=":", linewidth=1.0, label=None)
        _bands(ax, series, layers, colors, legend, title, "||g_i||")


def param_grad_ratio_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer ``norm_ratio = ||theta|| / ||grad||`` over steps (``ParamGradRatio``).

    The LARS trust ratio: how many gradient norms fit in the weights. Log scale.
    """
    title = _title(frame, PARAM_GRAD_RATIO, "weights / gradient: ||theta|| / ||grad||")
    layers = _layers(frame, layers)
    series = _drawable(ax, frame, PARAM_GRAD_RATIO, title, [*layers, NETWORK])
    if series is not None:
        non_finite_bands(ax, frame, PARAM_GRAD_RATIO)
        _lines(ax, series, NORM_RATIO, layers, layer_colors(layers))
        _finish(ax, title, NORM_RATIO, legend)


def update_size_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer relative update ``||theta(s+1) - theta(s)|| / ||theta(s)||`` (``UpdateSize``).

    The grey band is the range of relative updates that the report does not
    flag, around the usual 1e-3 (:data:`cockpit_gradnoise.views.common.THRESHOLDS`).
    Log scale.
    """
    title = _title(frame, UPDATE_SIZE, "relative update size per step")
    layers = _layers(frame, layers)
    series = _drawable(ax, frame, UPDATE_SIZE, title, [*layers, NETWORK])
    if series is not None:
        non_finite_bands(ax, frame, UPDATE_SIZE)
        low, high = THRESHOLDS.relative_update_range()
        ax.axhspan(low, high, color="0.88", zorder=0,
                   label=f"usual {THRESHOLDS.usual_relative_update:g}")
        _lines(ax, series, UPDATE_RELATIVE, layers, layer_colors(layers))
        _finish(ax, title, "||update|| / ||theta||", legend)


def noise_scale_panel(ax, frame, *, batch_size: Optional[int] = None, param: str = NETWORK,
                      legend=True, preconditioned=None, two_batch=None, schedule=None):
    """The gradient noise scale ``B_simple`` over steps (``GradientNoiseScale``).

    ``b_simple`` of each batch as faint points, ``b_simple_smoothed`` as a
    line, and the batch size used as a dashed horizontal line: a batch well
    below the noise scale means larger batches would cut the number of steps
    almost linearly (McCandlish et al. 2018). Steps where the estimate is
    infinite (the estimated ``|G|^2 <= 0``: no signal resolved) are marked by
    triangles at the top edge, steps where it is 0 at the bottom edge. Log
    scale; units: examples.

    Where the log also holds ``PreconditionedNoiseScale`` (the noise scale of
    the gradients preconditioned as the optimizer's update sees them, Adam's
    ``P g_i``), it is drawn beside, alike in purple; where it holds only that
    one, it is drawn alone. Without either, ``TwoBatchNoiseScale`` (the
    ``"norms"`` preset) is drawn. The changes of a batch schedule
    (``BatchSchedule`` rows, :class:`~cockpit_gradnoise.BatchSchedule`) are
    green dotted vertical lines at the steps that decided them, labelled
    ``old -> new`` batch, and the batch line follows them.

    Args:
        ax: Axes to draw into.
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        batch_size: The batch size used; without it no line is drawn and the
            panel says so.
        param: Parameter name; the network (``"all"``) by default.
        legend: Draw a legend in ``ax``.
        preconditioned: The rows of ``PreconditionedNoiseScale`` (default:
            those in ``frame``).
        two_batch: The rows of ``TwoBatchNoiseScale`` (default: those in ``frame``).
        schedule: The rows of ``BatchSchedule`` (default: those in ``frame``).
    """
    changes = schedule_changes(frame if schedule is None else schedule)
    two_batch = select(frame if two_batch is None else two_batch, TWO_BATCH_NOISE_SCALE)
    extra = _series(frame if preconditioned is None else preconditioned,
                    PRECONDITIONED_NOISE_SCALE, [param])
    quantity, name = NOISE_SCALE, "gradient noise scale B_simple"
    if not extra.steps():
        extra = None
    elif select(frame, NOISE_SCALE).empty:  # the preconditioned one alone
        quantity, name, extra = PRECONDITIONED_NOISE_SCALE, "preconditioned noise scale B_simple", None
        frame = frame if preconditioned is None else preconditioned
    if extra is None and quantity == NOISE_SCALE and select(frame, NOISE_SCALE).empty \
            and not two_batch.empty:  # the "norms" preset's
        quantity, name, frame = TWO_BATCH_NOISE_SCALE, "two-batch noise scale B_simple", two_batch
    if extra is not None:
        name += " (purple: preconditioned as the optimizer sees it)"
    title = _title(frame, quantity, name) if param == NETWORK else f"{name} ({param})"
    series = _drawable(ax, frame, quantity, title, [param])
    if series is None:
        return
    non_finite_bands(ax, frame, quantity)
    _noise_scale_lines(ax, series, param, "tab:blue", "")
    if extra is not None:
        _noise_scale_lines(ax, extra, param, "tab:purple", " preconditioned")
    if changes:
        _schedule_lines(ax, changes, series.steps())
    elif batch_size is None:
        ax.text(0.02, 0.03, "batch size unknown: pass batch_size=", transform=ax.transAxes,
                fontsize="x-small", color="0.35")
    else:
        ax.axhline(batch_size, color="tab:orange", linestyle="--", linewidth=1.5,
                   label=f"batch size {batch_size}")
    _finish(ax, title, "B_simple (examples)", legend)


def _schedule_lines(ax, changes, steps):
    """A batch schedule's changes as vertical marks, and the batch used as a dashed staircase
    (a change decided at step ``s`` applies from ``s + 1``)."""
    change_marks(ax, [c["step"] for c in changes],
                 [f"{c['batch']:g}->{c['new_batch']:g}" for c in changes], label="batch schedule change")
    x = [min(steps[0], changes[0]["step"])] + [c["step"] + 1 for c in changes]
    y = [changes[0]["batch"]] + [c["new_batch"] for c in changes]
    ax.step(x + [max(steps[-1], x[-1])], y + [y[-1]], where="post", color="tab:orange",
            linestyle="--", linewidth=1.5, label="batch size (schedule)")


def _noise_scale_lines(ax, series, param, color, suffix):
    """``b_simple`` as faint points (infinite ones at the top edge), ``b_simple_smoothed`` as a line."""
    raw = _xy(series, param, B_SIMPLE)
    if raw is not None:
        steps, values = raw
        shown, infinite = numpy.isfinite(values) & (values != 0), numpy.isposinf(values)
        ax.plot(steps[shown], values[shown], "o", color=color, alpha=0.3, markersize=3,
                label=f"{B_SIMPLE}{suffix} (one batch)")
        if infinite.any():
            edge_marks(ax, steps[infinite], top=True,
                       label=INFINITE_LABEL + suffix, color="tab:red" if not suffix else color)
        zero_marks(ax, steps, values, color)
    smoothed = _xy(series, param, B_SIMPLE_SMOOTHED)
    if smoothed is not None:
        steps, values = smoothed
        ax.plot(steps, on_log_scale(values), color=color, linewidth=2,
                label=B_SIMPLE_SMOOTHED + suffix)
        zero_marks(ax, steps, values, color)


def label_stride(n_rows: int) -> int:
    """Label every k-th of ``n_rows`` heatmap rows: k, at most :data:`MAX_ROW_LABELS` labels."""
    return max(1, math.ceil(n_rows / MAX_ROW_LABELS))


def heatmap_steps(steps: numpy.ndarray) -> numpy.ndarray:
    """The heatmap's columns of the tracked ``steps`` (ascending): all, or at most
    :data:`MAX_COLUMNS`: the first of each of ``MAX_COLUMNS - 1`` bins of equal
    width in steps, and the last step."""
    if len(steps) <= MAX_COLUMNS:
        return steps
    n_bins = MAX_COLUMNS - 1  # and the last step
    bins = numpy.minimum(((steps - steps[0]) * n_bins
                          / max(steps[-1] - steps[0], 1)).astype(numpy.int64), n_bins - 1)
    return steps[numpy.unique(numpy.r_[numpy.unique(bins, return_index=True)[1],
                                       len(steps) - 1])]


def _heatmap_values(frame, series, statistic, layers):
    """Rows (layers), columns (steps) and values of the heatmap.

    At most :data:`MAX_COLUMNS` steps: the first of each of ``MAX_COLUMNS - 1``
    bins of equal width in steps, and the last step; NaN where a layer has no
    value at a step.
    """
    steps = heatmap_steps(numpy.array(series.steps()))
    rows = series.of_statistic(statistic)
    rows = rows[numpy.isin(steps_of(rows), steps)]
    present = set(rows.param.unique()) - {NETWORK}
    names = [name for name in (layer_order(frame) if layers is None else layers)
             if name in present]
    row = _positions(rows.param, names)
    values = numpy.full((len(names), len(steps)), math.nan)
    shown = row >= 0
    # Rows in frame order: of a step logged twice, the later row counts.
    values[row[shown], numpy.searchsorted(steps, steps_of(rows)[shown])] = (
        values_of(rows)[shown])
    return names, steps, values


def _positions(column, names) -> numpy.ndarray:
    """The position of each value of ``column`` in ``names``; -1 for the others."""
    if isinstance(column, Column):
        where = {name: i for i, name in enumerate(names)}
        # And a last -1, which a missing name's code -1 picks.
        return numpy.array([where.get(name, -1) for name in column.categories] + [-1])[
            column.codes]
    return column.astype("category").cat.set_categories(names).cat.codes.to_numpy()


def noise_heatmap_panel(ax, frame, *, statistic: str = SD_MEDIAN, layers=None, colorbar=True):
    """Layer-by-step heatmap of a ``GradientVarianceQuantiles`` statistic.

    For models with many layers, where lines become unreadable: one row per
    layer (model order, first on top), one column per tracked step, colour on
    a log scale. A zero, which has no colour there, is a white cell with an
    ``x`` (the title then says so); a white cell without one is missing or
    not finite. ``statistic="q0.5"`` shows the median sd, ``"snr_q0.5"`` the
    median signal-to-noise ratio.

    Args:
        ax: Axes to draw into.
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        statistic: Statistic of ``GradientVarianceQuantiles`` to show.
        layers: Rows to show; every layer by default.
        colorbar: Add a colour bar beside ``ax``.

    Returns:
        The ``QuadMesh`` drawn (for a colour bar), or ``None`` when there was
        nothing to draw.
    """
    label = {SD_MEDIAN: "median sd", SNR_MEDIAN: "median SNR"}.get(statistic, statistic)
    title = f"{label} per layer ({GRADIENT_VARIANCE} {statistic})"
    series = _drawable(ax, frame, GRADIENT_VARIANCE, title)
    if series is None:
        return None
    if statistic == SD_MEDIAN and median_name(series.statistics()) is None:
        no_data(ax, title, "no data:\n" + median_note("sd", series.statistics()))
        return None
    names, steps, values = _heatmap_values(frame, series, statistic, layers)
    positive = values[numpy.isfinite(values) & (values > 0)]
    if positive.size == 0:
        no_data(ax, title, f"no data:\nno positive {statistic} values to show")
        return None
    norm = matplotlib.colors.LogNorm(positive.min(), max(positive.max(), positive.min() * 1.01))
    mesh = ax.pcolormesh(steps, numpy.arange(len(names)), numpy.ma.masked_invalid(values),
                         norm=norm, shading="nearest", cmap="viridis", label=label)
    # Every k-th row labelled (at most MAX_ROW_LABELS: text layout is most of
    # a large figure's time), small enough to fit its rows (at least 6 pt, 360 pt / 60).
    every = label_stride(len(names))
    ax.set_yticks(numpy.arange(0, len(names), every), names[::every],
                  fontsize=max(4.0, min(8.0, 360.0 * every / len(names))))
    ax.set_ylim(len(names) - 0.5, -0.5)  # first layer on top
    rows, columns = numpy.nonzero(values == 0)
    if rows.size:
        ax.plot(numpy.asarray(steps)[columns], rows, "x", color="0.3", linestyle="none",
                markersize=max(2.0, min(5.0, 200.0 / len(names))), label=ZERO_LABEL)
        title += "; x: 0"
    non_finite_bands(ax, frame, GRADIENT_VARIANCE)
    title_at(ax, title)
    step_axis(ax)
    if colorbar:
        log_labels(ax.get_figure().colorbar(mesh, ax=ax, label=label, pad=0.01).ax.yaxis)
    return mesh


__all__ = [
    "layer_colors",
    "clear_panel",
    "no_data",
    "gradient_variance_panel",
    "per_example_norm_panel",
    "param_grad_ratio_panel",
    "update_size_panel",
    "noise_scale_panel",
    "noise_heatmap_panel",
    "non_finite_bands",
    "thin",
]
