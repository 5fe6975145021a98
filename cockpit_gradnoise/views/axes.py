"""What every panel's axes share: colours, thinning, marks off the log scale, tick labels.

The panels (:mod:`cockpit_gradnoise.views.panels`) draw with these helpers,
so that every panel colours a layer alike, thins a long line alike and marks
zeros and infinities alike. Nothing here changes global state.
"""

import math
import re
from typing import Dict, Optional, Sequence

from cockpit_gradnoise.logs.schema import NETWORK

import matplotlib
import matplotlib.colors
import numpy
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator, NullLocator

#: How the network's line is drawn: black and bold, above the layers'.
NETWORK_STYLE = {"color": "black", "linewidth": 2.2, "zorder": 3}
_PALETTE = matplotlib.colormaps["tab10"].colors

#: Legend label of the marks of zeros, which a log scale cannot show.
ZERO_LABEL = "0 (off the log scale)"
#: Legend label of the marks of infinite noise-scale estimates.
INFINITE_LABEL = "infinite (|G|^2 est. <= 0)"

#: Legend label of the bands at the steps where the quantity went NaN or inf.
NON_FINITE_LABEL = "NaN or inf"

#: A line of more steps than this is thinned (:func:`thin`).
MAX_POINTS = 1000
#: A log axis spanning more decades than this has no minor ticks: its decade ticks are
#: close enough to read between, and ticks are most of the time to draw a large figure.
MINOR_DECADES = 3


def layer_colors(layers: Sequence[str]) -> Dict[str, tuple]:
    """``{layer: colour}``: tab10 by position in ``layers``, black for the network."""
    colors = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(layers)}
    colors[NETWORK] = NETWORK_STYLE["color"]
    return colors


def clear_panel(ax):
    """Remove what a panel drew on ``ax``, far cheaper than ``ax.clear()``.

    Redrawing a dashboard every few steps reuses its axes: this removes the
    data artists, texts and legend and restores linear scales with their
    default ticks, so any panel can draw on ``ax`` again.
    """
    for artist in [*ax.lines, *ax.collections, *ax.patches, *ax.texts, *ax.images]:
        artist.remove()
    if ax.get_legend() is not None:
        ax.get_legend().remove()
    title_at(ax, "")
    ax.set_xscale("linear")
    ax.set_yscale("linear")
    ax.relim()
    ax.set_autoscale_on(True)


def title_at(ax, title: str):
    """``ax.set_title(title)`` at a set height: that of ``rcParams["axes.titley"]``, else 1.0.

    Without a height matplotlib places a title above whatever the axes draw on
    top, measuring their tick labels at every draw to find out; a panel draws
    nothing there, so the title lands at 1.0 either way.
    """
    y = matplotlib.rcParams["axes.titley"]
    ax.set_title(title, y=1.0 if y is None else y)


def no_data(ax, title: str, reason: str):
    """Write ``reason`` in the middle of ``ax`` under ``title``; hide the ticks."""
    title_at(ax, title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, reason, ha="center", va="center", transform=ax.transAxes, color="0.35")


def thin(steps: numpy.ndarray, *values: numpy.ndarray, limit: Optional[int] = None) -> numpy.ndarray:
    """Indices of at most about ``limit`` points of a line that keep its look.

    The steps are cut into ``(limit - 2) // 2`` bins of equal width in steps;
    in each bin the smallest and the largest drawable value (finite and
    positive, for log scales) are kept, and the first and last of each kind a
    log scale cannot show (0, ``+inf``, NaN or ``-inf``), so that spikes, gaps
    and their marks survive; the first and last step are always kept. Lines
    of at most ``limit`` points (default :data:`MAX_POINTS`) are kept whole.
    Several ``values`` (a band's edges): the union of their points.

    Returns:
        Ascending indices into ``steps``.
    """
    n, limit = len(steps), MAX_POINTS if limit is None else limit
    if n <= limit:
        return numpy.arange(n)
    steps = numpy.asarray(steps, dtype=float)
    bins = max((limit - 2) // 2, 1)  # two points each, and both ends
    span = max(steps[-1] - steps[0], 1.0)
    position = numpy.minimum(((steps - steps[0]) * bins / span).astype(numpy.int64), bins - 1)
    kept = [numpy.array([0, n - 1])]
    for value in values:
        value = numpy.asarray(value, dtype=float)
        kind = numpy.select(
            [numpy.isfinite(value) & (value > 0), value == 0, value == math.inf], [0, 1, 2], 3
        )
        group = position * 4 + kind
        # Each group's smallest and largest value, the first and last of equal ones: what
        # sorting each group by value gave, without that sort (most of the time here).
        order = numpy.argsort(group, kind="stable")  # a group's points in step order
        ordered, by_group = group[order], value[order]
        by_group[numpy.isnan(by_group)] = math.inf  # NaN (kind 3) counts as the largest
        head = numpy.r_[True, ordered[1:] != ordered[:-1]]
        segment, heads = numpy.cumsum(head) - 1, numpy.flatnonzero(head)
        lowest = numpy.flatnonzero(numpy.minimum.reduceat(by_group, heads)[segment] == by_group)
        highest = numpy.flatnonzero(numpy.maximum.reduceat(by_group, heads)[segment] == by_group)
        first = lowest[numpy.r_[True, segment[lowest][1:] != segment[lowest][:-1]]]
        last = highest[numpy.r_[segment[highest][1:] != segment[highest][:-1], True]]
        kept += [order[first], order[last]]
    return numpy.unique(numpy.concatenate(kept))


def line_order(key: numpy.ndarray, steps: numpy.ndarray) -> numpy.ndarray:
    """``numpy.lexsort((steps, key))``: the rows by line (``key``), then step; stable, so
    equal steps keep the frame's order.

    Where the steps already ascend (a frame's do), a stable sort by ``key`` alone
    keeps them so; as 16-bit integers NumPy sorts those by radix, three times as fast.
    """
    if len(key) > 1 and key.max() < 2**15 and key.min() >= 0 and (steps[1:] >= steps[:-1]).all():
        return numpy.argsort(key.astype(numpy.int16), kind="stable")
    return numpy.lexsort((steps, key))


def on_log_scale(values):
    """``values`` with the ones a log scale cannot show (0, inf, NaN) as NaN: gaps."""
    return numpy.where(numpy.isfinite(values) & (values != 0), values, math.nan)


def edge_marks(ax, steps, *, top, label, **style):
    """Triangles at the top or bottom edge of ``ax`` at ``steps``."""
    ax.plot(steps, [0.97 if top else 0.03] * len(steps), "^" if top else "v",
            transform=ax.get_xaxis_transform(), clip_on=False, label=label,
            **{"alpha": 0.7, "markersize": 5, **style})


#: At most so many changes of a batch schedule are labelled with their batches.
MAX_CHANGE_LABELS = 20


def change_marks(ax, steps, texts, *, label, color="tab:green"):
    """Vertical dotted lines at ``steps`` (one legend entry), each labelled with its text
    along it at the top (the first :data:`MAX_CHANGE_LABELS`)."""
    for k, step in enumerate(steps):
        ax.axvline(step, color=color, linestyle=":", linewidth=1.2, alpha=0.9,
                   label=label if k == 0 else "_change")
        if k < MAX_CHANGE_LABELS:
            ax.text(step, 0.96, texts[k], transform=ax.get_xaxis_transform(), rotation=90,
                    ha="right", va="top", fontsize="xx-small", color=color)


#: The label of each layer's zero marks: no legend entry of its own.
ZERO_MARKS = "_zero"


def zero_marks(ax, steps, values, color):
    """Mark the steps where ``values`` is 0 at the bottom edge, in ``color``."""
    zero = values == 0
    if zero.any():
        edge_marks(ax, steps[zero], top=False, label=ZERO_MARKS, color=color)


def minor_ticks(axis, low, high):
    """No minor ticks on the log ``axis`` from ``low`` to ``high`` if it spans more than
    :data:`MINOR_DECADES` decades (fewer keep matplotlib's, labelled below one decade)."""
    if 0 < low and 0 < high and max(high / low, low / high) > 10.0 ** MINOR_DECADES:
        axis.set_minor_locator(NullLocator())


_SUPERSCRIPTS = str.maketrans("0123456789-", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b")
# The labels LogFormatterSciNotation writes: "$\mathdefault{10^{-2}}$", "$\mathdefault{2\times10^{-1}}$".
_MATHTEXT_POWER = re.compile(r"^\$\\mathdefault\{(-?)(?:([0-9.]+)\\times)?(\d+)\^\{(-?\d+)\}\}\$$")


class PlainLogFormatter(LogFormatterSciNotation):
    """Log-axis labels as ``LogFormatterSciNotation`` writes them, in plain text (``10\u207b\u00b2``).

    The same numbers and layout, with Unicode superscripts instead of
    mathtext: parsing mathtext is a fifth of the time to draw the dashboard
    (its parser is built on first use, then each label parsed). A label of
    another form (a non-integer exponent) stays mathtext.
    """

    def __call__(self, x, pos=None):
        label = super().__call__(x, pos)
        match = _MATHTEXT_POWER.match(label)
        if match is None:
            return label
        sign, coefficient, base, exponent = match.groups()
        times = f"{coefficient}\u00d7" if coefficient else ""
        return f"{sign}{times}{base}{exponent.translate(_SUPERSCRIPTS)}"


def log_labels(axis):
    """Label the log ``axis`` (major and minor ticks) with :class:`PlainLogFormatter`."""
    for formatter, setter in ((axis.get_major_formatter(), axis.set_major_formatter),
                              (axis.get_minor_formatter(), axis.set_minor_formatter)):
        if type(formatter) is LogFormatterSciNotation:
            plain = PlainLogFormatter(formatter._base, labelOnlyBase=formatter.labelOnlyBase,
                                      minor_thresholds=formatter.minor_thresholds,
                                      linthresh=formatter._linthresh)
            setter(plain)


def step_axis(ax):
    """Label ``ax``'s x axis ``step``, with integer ticks."""
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
