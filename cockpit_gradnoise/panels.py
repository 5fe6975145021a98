"""One panel per quantity: each draws into a matplotlib ``Axes`` it is given.

Every panel reads only the tidy frame of :func:`cockpit_gradnoise.to_frame`
(columns ``step, quantity, param, statistic, value``). A panel whose quantity
is absent, or has fewer than two tracked steps, writes so in its own area
instead of drawing; no panel raises on missing data.

Layers are told apart by colour: the colour of a layer is its position in
``layers``, so panels given the same ``layers`` agree. With ``layers=None`` a
panel shows :func:`default_layers` (the ``DEFAULT_TOP_K`` noisiest). The
whole network (``"all"``) is drawn black and bold.

Nothing here changes global state: no ``rcParams``, no ``plt.ion()``, no
pyplot figures.
"""

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import matplotlib
import matplotlib.colors
import numpy
import pandas
from matplotlib.ticker import MaxNLocator

from cockpit_gradnoise.quantities._base import NETWORK
from cockpit_gradnoise.report import THRESHOLDS, noisiest_layers, sort_layers

#: Layers drawn as lines by default; more become unreadable (the heatmap shows all).
DEFAULT_TOP_K = 6

NETWORK_STYLE = {"color": "black", "linewidth": 2.2, "zorder": 3}
_PALETTE = matplotlib.colormaps["tab10"].colors
_QUANTILE = re.compile(r"^q(\d*\.?\d+(?:e-?\d+)?)$")

#: ``{(param, statistic): {step: value}}`` of one quantity.
Series = Dict[Tuple[str, str], Dict[int, float]]


def default_layers(frame: pandas.DataFrame, top_k: int = DEFAULT_TOP_K) -> List[str]:
    """The ``top_k`` noisiest layers (``report.noisiest_layers``) in ``sort_layers`` order."""
    return sort_layers(noisiest_layers(frame, top_k))


def layer_colors(layers: Sequence[str]) -> Dict[str, tuple]:
    """``{layer: colour}``: tab10 by position in ``layers``, black for the network."""
    colors = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(layers)}
    colors[NETWORK] = NETWORK_STYLE["color"]
    return colors


def quantile_levels(statistics) -> List[float]:
    """Sorted quantile levels among statistic names (``q0.05`` -> 0.05)."""
    return sorted(float(m.group(1)) for m in map(_QUANTILE.match, statistics) if m)


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
    ax.set_title("")
    ax.set_xscale("linear")
    ax.set_yscale("linear")
    ax.relim()
    ax.set_autoscale_on(True)


def no_data(ax, title: str, reason: str):
    """Write ``reason`` in the middle of ``ax`` under ``title``; hide the ticks."""
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, reason, ha="center", va="center", transform=ax.transAxes, color="0.35")


def _series(frame, quantity) -> Series:
    """Every statistic of ``quantity`` by parameter."""
    rows = frame[frame.quantity.to_numpy() == quantity]
    series: Series = {}
    columns = (rows.param.to_numpy(), rows.statistic.to_numpy(), rows.step.to_numpy(),
               rows.value.to_numpy())
    for param, statistic, step, value in zip(*columns):
        series.setdefault((param, statistic), {})[int(step)] = value
    return series


def _drawable(ax, frame, quantity, title) -> Optional[Series]:
    """The quantity's series, or ``None`` after writing in ``ax`` why there is no curve."""
    series = _series(frame, quantity)
    steps = {step for points in series.values() for step in points}
    if not steps:
        no_data(ax, title, f"no data:\n{quantity} is not in this log")
        return None
    if len(steps) < 2:
        no_data(ax, title, f"no data yet:\n{quantity} has 1 tracked step,\na curve needs two")
        return None
    return series


def _xy(series, param, statistic, finite=True):
    """Steps and values of one statistic as arrays (``None`` when absent).

    With ``finite``, infinite values become NaN: a gap in a line.
    """
    points = series.get((param, statistic))
    if not points:
        return None
    steps = sorted(points)
    values = numpy.array([points[step] for step in steps], dtype=float)
    if finite:
        values[~numpy.isfinite(values)] = math.nan
    return numpy.array(steps), values


def _layers(frame, layers):
    return default_layers(frame) if layers is None else list(layers)


def _step_axis(ax):
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(ax, title, ylabel, legend):
    ax.set_title(title)
    _step_axis(ax)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.grid(True, which="major", alpha=0.3)
    if legend:
        ax.legend(fontsize="x-small", loc="best")


def _lines(ax, series, statistic, layers, colors, **style):
    """One line per layer in ``layers`` and a bold one for the network."""
    for name in list(layers) + [NETWORK]:
        xy = _xy(series, name, statistic)
        if xy is not None:
            line = NETWORK_STYLE if name == NETWORK else {"color": colors[name], "linewidth": 1.2}
            ax.plot(*xy, **{"label": name, **line, **style})


def _bands(ax, series, layers, colors, legend, title, ylabel):
    """Median lines and lowest-to-highest quantile bands per layer; network median bold."""
    levels = quantile_levels({statistic for _, statistic in series})
    if not levels:  # no quantiles logged: the mean is all there is
        _lines(ax, series, "mean", layers, colors)
        _finish(ax, title, f"{ylabel}: mean", legend)
        return
    middle = f"q{min(levels, key=lambda q: abs(q - 0.5)):g}"
    low, high = f"q{levels[0]:g}", f"q{levels[-1]:g}"
    for name in layers if low != high else []:
        lower, upper = series.get((name, low), {}), series.get((name, high), {})
        steps = sorted(set(lower) & set(upper))
        bottom = numpy.array([lower[s] for s in steps])
        top = numpy.array([upper[s] for s in steps])
        # Zero or non-finite edges have no place on a log scale: no band there.
        drawable = numpy.isfinite(bottom) & numpy.isfinite(top) & (bottom > 0) & (top > 0)
        ax.fill_between(steps, bottom, top, where=drawable,
                        color=colors[name], alpha=0.12, linewidth=0)
    _lines(ax, series, middle, layers, colors)
    _finish(ax, title, f"{ylabel}: {middle}, band {low} to {high}", legend)


def gradient_variance_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer sd of the gradient elements over steps (``GradientVarianceQuantiles``).

    A band from the lowest to the highest logged quantile of ``sd_j`` over a
    layer's elements, the median (or the quantile closest to it) as a line;
    the network's median bold. Log scale; units of ``param.grad``.

    Args:
        ax: Axes to draw into.
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        layers: Parameter names to draw; default :func:`default_layers`.
        legend: Draw a legend in ``ax``.
    """
    title = "gradient noise: sd of grad elements"
    series = _drawable(ax, frame, "GradientVarianceQuantiles", title)
    if series is not None:
        layers = _layers(frame, layers)
        _bands(ax, series, layers, layer_colors(layers), legend, title, "sd")


def per_example_norm_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer per-example gradient norms ``||g_i||`` over steps (``PerExampleGradNorm``).

    Bands and median lines as :func:`gradient_variance_panel`, plus the
    largest per-example norm of the batch as a dotted line. Log scale.
    """
    title = "per-example gradient norms (dotted: max)"
    series = _drawable(ax, frame, "PerExampleGradNorm", title)
    if series is not None:
        layers = _layers(frame, layers)
        colors = layer_colors(layers)
        _lines(ax, series, "max", layers, colors, linestyle=":", linewidth=1.0, label=None)
        _bands(ax, series, layers, colors, legend, title, "||g_i||")


def param_grad_ratio_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer ``norm_ratio = ||theta|| / ||grad||`` over steps (``ParamGradRatio``).

    The LARS trust ratio: how many gradient norms fit in the weights. Log scale.
    """
    title = "weights / gradient: ||theta|| / ||grad||"
    series = _drawable(ax, frame, "ParamGradRatio", title)
    if series is not None:
        layers = _layers(frame, layers)
        _lines(ax, series, "norm_ratio", layers, layer_colors(layers))
        _finish(ax, title, "norm_ratio", legend)


def update_size_panel(ax, frame, *, layers=None, legend=True):
    """Per-layer relative update ``||theta(s+1) - theta(s)|| / ||theta(s)||`` (``UpdateSize``).

    The grey band is the range of relative updates that the report does not
    flag, around the usual 1e-3 (:data:`cockpit_gradnoise.report.THRESHOLDS`).
    Log scale.
    """
    title = "relative update size per step"
    series = _drawable(ax, frame, "UpdateSize", title)
    if series is not None:
        layers = _layers(frame, layers)
        low, high = THRESHOLDS.relative_update_range()
        ax.axhspan(low, high, color="0.88", zorder=0,
                   label=f"usual {THRESHOLDS.usual_relative_update:g}")
        _lines(ax, series, "relative", layers, layer_colors(layers))
        _finish(ax, title, "||update|| / ||theta||", legend)


def noise_scale_panel(ax, frame, *, batch_size: Optional[int] = None, param: str = NETWORK,
                      legend=True):
    """The gradient noise scale ``B_simple`` over steps (``GradientNoiseScale``).

    ``b_simple`` of each batch as faint points, ``b_simple_smoothed`` as a
    line, and the batch size used as a dashed horizontal line: a batch well
    below the noise scale means larger batches would cut the number of steps
    almost linearly (McCandlish et al. 2018). Steps where the estimate is
    infinite (the estimated ``|G|^2 <= 0``: no signal resolved) are marked by
    triangles at the top edge. Log scale; units: examples.

    Args:
        ax: Axes to draw into.
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        batch_size: The batch size used; without it no line is drawn and the
            panel says so.
        param: Parameter name; the network (``"all"``) by default.
        legend: Draw a legend in ``ax``.
    """
    title = "gradient noise scale B_simple" + ("" if param == NETWORK else f" ({param})")
    series = _drawable(ax, frame, "GradientNoiseScale", title)
    if series is None:
        return
    raw = _xy(series, param, "b_simple", finite=False)
    if raw is not None:
        steps, values = raw
        finite, infinite = numpy.isfinite(values), numpy.isposinf(values)
        ax.plot(steps[finite], values[finite], "o", color="tab:blue", alpha=0.3, markersize=3,
                label="b_simple (one batch)")
        if infinite.any():
            ax.plot(steps[infinite], [0.97] * infinite.sum(), "^", color="tab:red", alpha=0.6,
                    transform=ax.get_xaxis_transform(), label="infinite (|G|^2 est. <= 0)")
    smoothed = _xy(series, param, "b_simple_smoothed")
    if smoothed is not None:
        ax.plot(*smoothed, color="tab:blue", linewidth=2, label="b_simple_smoothed")
    if batch_size is None:
        ax.text(0.02, 0.03, "batch size unknown: pass batch_size=", transform=ax.transAxes,
                fontsize="x-small", color="0.35")
    else:
        ax.axhline(batch_size, color="tab:orange", linestyle="--", linewidth=1.5,
                   label=f"batch size {batch_size}")
    _finish(ax, title, "B_simple (examples)", legend)


def noise_heatmap_panel(ax, frame, *, statistic: str = "q0.5", layers=None, colorbar=True):
    """Layer-by-step heatmap of a ``GradientVarianceQuantiles`` statistic.

    For models with many layers, where lines become unreadable: one row per
    layer (``report.sort_layers`` order, first on top), one column per tracked
    step, colour on a log scale; white cells are zero or missing. ``statistic="q0.5"`` shows
    the median sd, ``"snr_q0.5"`` the median signal-to-noise ratio.

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
    label = {"q0.5": "median sd", "snr_q0.5": "median SNR"}.get(statistic, statistic)
    title = f"{label} per layer (GradientVarianceQuantiles {statistic})"
    series = _drawable(ax, frame, "GradientVarianceQuantiles", title)
    if series is None:
        return None
    present = {param for param, stat in series if stat == statistic and param != NETWORK}
    names = sort_layers(present) if layers is None else [n for n in layers if n in present]
    steps = sorted({step for points in series.values() for step in points})
    values = numpy.array(
        [[series[(name, statistic)].get(step, math.nan) for step in steps] for name in names]
    ).reshape(len(names), len(steps))
    positive = values[numpy.isfinite(values) & (values > 0)]
    if positive.size == 0:
        no_data(ax, title, f"no data:\nno positive {statistic} values to show")
        return None
    norm = matplotlib.colors.LogNorm(positive.min(), max(positive.max(), positive.min() * 1.01))
    mesh = ax.pcolormesh(steps, numpy.arange(len(names)), numpy.ma.masked_invalid(values),
                         norm=norm, shading="nearest", cmap="viridis", label=label)
    # Small enough that every label fits its row, never below 4 pt.
    ax.set_yticks(numpy.arange(len(names)), names,
                  fontsize=max(4.0, min(8.0, 360.0 / len(names))))
    ax.set_ylim(len(names) - 0.5, -0.5)  # first layer on top
    ax.set_title(title)
    _step_axis(ax)
    if colorbar:
        ax.get_figure().colorbar(mesh, ax=ax, label=label, pad=0.01)
    return mesh


__all__ = [
    "DEFAULT_TOP_K",
    "default_layers",
    "layer_colors",
    "quantile_levels",
    "clear_panel",
    "no_data",
    "gradient_variance_panel",
    "per_example_norm_panel",
    "param_grad_ratio_panel",
    "update_size_panel",
    "noise_scale_panel",
    "noise_heatmap_panel",
]
