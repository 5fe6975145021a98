"""The gradient-noise dashboard: the panels of the quantities present, in one figure."""

import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from cockpit_gradnoise._ranks import WRITER_RANK, is_writer
from cockpit_gradnoise.logs.schema import (
    BATCH_SCHEDULE,
    GRADIENT_VARIANCE,
    NOISE_SCALE,
    PARAM_GRAD_RATIO,
    PER_EXAMPLE_NORM,
    PRECONDITIONED_NOISE_SCALE,
    SD_MEDIAN,
    SNR_MEDIAN,
    TWO_BATCH_NOISE_SCALE,
    UPDATE_SIZE,
)
from cockpit_gradnoise.logs.table import Rows
from cockpit_gradnoise.views import panels
from cockpit_gradnoise.views.axes import clear_panel, log_labels, minor_ticks, no_data
from cockpit_gradnoise.views.common import (
    DEFAULT_TOP_K,
    default_layers,
    layer_order,
    non_finite_summary,
    recorded_batch_size,
    select,
)
from cockpit_gradnoise.views.report import holdings

from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine

#: Label of the pyplot figure that :func:`plot` reuses when given no figure.
FIGURE_LABEL = "cockpit-gradnoise"

#: Mosaic key, quantity, panel function; in dashboard order.
PANELS = (
    ("variance", GRADIENT_VARIANCE, panels.gradient_variance_panel),
    ("norms", PER_EXAMPLE_NORM, panels.per_example_norm_panel),
    ("noise_scale", NOISE_SCALE, panels.noise_scale_panel),
    ("ratio", PARAM_GRAD_RATIO, panels.param_grad_ratio_panel),
    ("update", UPDATE_SIZE, panels.update_size_panel),
)

HEATMAPS = {"sd": SD_MEDIAN, "snr": SNR_MEDIAN}

_PANEL_INCHES = (6.5, 3.3)  # width, height of one line panel

# The dashboard's own figure (no ``fig=``) is laid out from these margins, in inches
# (:func:`_place`), not by matplotlib's constrained layout, which measures every text of
# a figure by drawing it once more (half the time to save a large dashboard).
_LEFT, _RIGHT, _GAP = 0.95, 0.25, 1.0  # beside the panels: y tick labels and label
_ABOVE, _BELOW = 0.32, 0.5  # above a panel its title; below, tick labels and "step"
_TOP = 0.35  # the suptitle
_COLORBAR = (0.12, 0.22, 0.85)  # the heatmap's colour bar: gap, bar, labels
_LEGEND_ROW, _LEGEND_PAD = 0.18, 0.2  # the shared legend below the panels

#: The largest ``dpi`` :func:`plot` saves at.
MAX_DPI = 1200
#: The largest image :func:`plot` saves, in pixels (an RGBA buffer of 400 MB).
MAX_PIXELS = 100_000_000


class Ranked(list):
    """Layers that :func:`~cockpit_gradnoise.views.common.default_layers` chose, ranked elsewhere.

    Given as ``layers``, :func:`plot` draws them as the ``top_k`` noisiest
    (and says so), without ranking the frame itself: the frame of
    :func:`cockpit_gradnoise.views.reads.plot_rows` leaves out what ranked them.
    """


class ImageTooLarge(ValueError):
    """The image to save is larger than :data:`MAX_DPI` or :data:`MAX_PIXELS` allow."""


def _check_size(fig, dpi):
    """Refuse an image too large to render, before rendering starts to allocate it."""
    if not 0 < dpi <= MAX_DPI:
        raise ImageTooLarge(f"dpi must be between 1 and {MAX_DPI}, got {dpi}")
    width, height = fig.get_size_inches() * dpi
    if width * height > MAX_PIXELS:
        raise ImageTooLarge(
            f"the image would be {width:.0f} x {height:.0f} pixels, more than "
            f"{MAX_PIXELS / 1e6:.0f} megapixels: use a lower dpi (at most "
            f"{int(dpi * (MAX_PIXELS / (width * height)) ** 0.5)} for this figure)"
        )


def _check_layers(names, layers):
    unknown = [name for name in layers if name not in names]
    if unknown:
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} layers)" if len(names) > 12 else "")
        raise ValueError(f"unknown layers {unknown}: choose from {shown}")
    return list(layers)


def heatmap_statistic(heatmap, variance: bool, n_shown, n_layers):
    """The heatmap's statistic, or ``None`` for no heatmap; ``variance``: the frame holds
    ``GradientVarianceQuantiles`` rows.

    Raises:
        ValueError: If ``heatmap`` is not ``"auto"``, ``"off"``, ``"sd"`` or ``"snr"``.
    """
    if heatmap not in ("auto", "off", *HEATMAPS):
        raise ValueError(f"heatmap must be 'auto', 'off', 'sd' or 'snr', got {heatmap!r}")
    if heatmap == "off" or not variance:
        return None
    if heatmap == "auto":
        return HEATMAPS["sd"] if n_layers > n_shown else None
    return HEATMAPS[heatmap]


def _mosaic(keys, heatmap_rows):
    """Two panels per row (a lone last one spans the row), the heatmap below."""
    rows = [list(keys[i:i + 2]) * (2 if len(keys[i:i + 2]) == 1 else 1)
            for i in range(0, len(keys), 2)]
    heights = [_PANEL_INCHES[1]] * len(rows)
    if heatmap_rows:
        rows.append(["heatmap", "heatmap"])
        labelled = math.ceil(heatmap_rows / panels.label_stride(heatmap_rows))
        heights.append(max(2.8, 0.14 * labelled + 1.3))
    return rows, heights


@dataclass
class _Layout:
    """The axes :func:`plot` made in a figure, reused while the layout stays the same.

    ``fixed``: the dashboard's own figure, laid out by :func:`_place`.
    """

    mosaic: tuple
    axes: dict
    colorbar: Optional[object] = None
    fixed: bool = False


# Axes creation dominates the cost of a redraw; keep them per figure.
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class OwnFigure(Figure):
    """A figure of the dashboard's own, outside pyplot: :func:`plot` lays it out as the figure
    it makes itself (:func:`_place`), as ``fig``. For saving only (the command line): it
    spares importing pyplot and a GUI backend."""

    def __init__(self):
        super().__init__(layout="none")


def _figure(fig, size):
    """``fig``, or the reused pyplot figure of the dashboard, sized ``size``."""
    if fig is None:
        import matplotlib.pyplot as plt  # only here: the command line draws without it

        fig = plt.figure(num=FIGURE_LABEL, layout="none")  # laid out by _place
        if tuple(fig.get_size_inches()) != size:
            fig.set_size_inches(size)
    return fig


def _layout(fig, mosaic, heights, fixed: bool) -> _Layout:
    """Axes for ``mosaic``: the previous call's, emptied, if the layout is unchanged."""
    key = (tuple(map(tuple, mosaic)), tuple(heights), fixed)
    layout = _LAYOUTS.get(fig)
    if layout is not None and layout.mosaic == key and all(
        ax in fig.axes for ax in layout.axes.values()
    ):
        if layout.colorbar is not None:  # tied to the mesh about to go: a new one follows
            layout.colorbar.remove()
            layout.colorbar = None
        for ax in layout.axes.values():
            clear_panel(ax)
        for legend in list(fig.legends):
            legend.remove()
        return layout
    fig.clear()
    layout = _Layout(key, fig.subplot_mosaic(mosaic, height_ratios=heights), fixed=fixed)
    _LAYOUTS[fig] = layout
    return layout


def _heatmap(layout, frame, statistic):
    """Draw the heatmap and its colour bar (placed by :func:`_place` in a fixed layout)."""
    ax = layout.axes["heatmap"]
    mesh = panels.noise_heatmap_panel(ax, frame, statistic=statistic, colorbar=False)
    if mesh is None:
        return
    fig = ax.get_figure()
    if layout.fixed:
        layout.colorbar = fig.colorbar(mesh, cax=fig.add_axes((0, 0, 1, 1)),
                                       label=mesh.get_label())
    else:
        layout.colorbar = fig.colorbar(mesh, ax=ax, pad=0.01, label=mesh.get_label())
    log_labels(layout.colorbar.ax.yaxis)
    minor_ticks(layout.colorbar.ax.yaxis, mesh.norm.vmin, mesh.norm.vmax)


def _widest(strings, font) -> float:
    """The width of the widest of ``strings`` in ``font`` (``FontProperties``), in inches,
    from the font alone (no drawing)."""
    from matplotlib.textpath import text_to_path

    return max((text_to_path.get_text_width_height_descent(text, font, ismath=False)[0]
                for text in strings if text), default=0.0) / 72


def _place(fig, layout: _Layout, mosaic, heights, legend_rows: int, title):
    """Lay out the dashboard's own figure: rows of ``heights`` inches, fixed margins.

    Each row holds two panels or one spanning it; a panel's axes leave
    :data:`_ABOVE` for its title and :data:`_BELOW` for its step axis; the
    heatmap's axes leave room for its widest row label and its colour bar.
    The figure's height follows the rows, the suptitle and the legend's rows.
    """
    width = 2 * _PANEL_INCHES[0]
    height = _TOP + sum(heights) + (_LEGEND_PAD + _LEGEND_ROW * legend_rows if legend_rows else 0.1)
    fig.set_size_inches(width, height)
    top = height - _TOP
    for row, row_height in zip(mosaic, heights):
        left, right = _LEFT, width - _RIGHT
        if row[0] == "heatmap":
            texts = layout.axes["heatmap"].get_yticklabels()
            labels = _widest([t.get_text() for t in texts], texts[0].get_fontproperties()
                             ) if texts else 0.0
            left, right = max(_LEFT, labels + 0.25), right - sum(_COLORBAR)
        middle = (left + right) / 2
        cells = ([(left, right)] if row[0] == row[1]
                 else [(left, middle - _GAP / 2), (middle + _GAP / 2, right)])
        bottom, tall = top - row_height + _BELOW, row_height - _ABOVE - _BELOW
        for key, (start, end) in zip(dict.fromkeys(row), cells):
            layout.axes[key].set_position(
                (start / width, bottom / height, (end - start) / width, tall / height))
        if row[0] == "heatmap" and layout.colorbar is not None:
            layout.colorbar.ax.set_position(((right + _COLORBAR[0]) / width, bottom / height,
                                             _COLORBAR[1] / width, tall / height))
        top -= row_height
    if title is not None:
        title.set_y(1 - 0.1 / height)


def _legend(fig, axes, fixed: bool):
    """One legend for the layer colours, shared by the line panels; its number of rows.

    At most 8 columns; in a fixed layout (:func:`_place`) only as many as the
    widest entry leaves room for.
    """
    handles = {}
    for key, _, _ in PANELS:
        if key in axes and key != "noise_scale":
            for handle, label in zip(*axes[key].get_legend_handles_labels()):
                handles.setdefault(label, handle)
    if not handles:
        return 0
    constrained = isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    columns = min(len(handles), 8)
    if fixed:  # an entry: its handle and gaps (4.8 font sizes, 0.56 inch), its text
        from matplotlib.font_manager import FontProperties

        entry = _widest(handles, FontProperties(size="small")) + 0.56
        columns = max(1, min(columns, int((2 * _PANEL_INCHES[0] - 0.4) // entry)))
    fig.legend(
        handles.values(), handles.keys(), ncols=columns, fontsize="small",
        loc="outside lower center" if constrained else "lower center",
    )
    return math.ceil(len(handles) / columns)


def _nothing_tracked(frame) -> str:
    """What the empty dashboard says: nothing yet, or which other quantities the frame holds."""
    if frame.empty:
        return "no cockpit-gradnoise quantities tracked yet"
    if isinstance(frame, Rows):
        frame = frame.frame()
    return "none of cockpit-gradnoise's quantities in this log;\nit holds " + holdings(frame)


def _non_finite_note(frame) -> str:
    """``", NaN or inf at 3 steps from step 120 (red)"``, or ``""``."""
    summary = non_finite_summary(frame)
    if summary is None:
        return ""
    counted = "1 step" if len(summary.steps) == 1 else f"{len(summary.steps)} steps"
    return f", NaN or inf at {counted} from step {summary.first} (red)"


def figure(
    frame,
    *,
    savefig=None,
    layers: Optional[Sequence[str]] = None,
    top_k: int = DEFAULT_TOP_K,
    batch_size: Optional[int] = None,
    heatmap: str = "auto",
    fig=None,
    dpi: int = 100,
    writer_rank: Optional[int] = WRITER_RANK,
):
    """Draw the gradient-noise dashboard of ``frame``: one panel per quantity present.

    What :func:`cockpit_gradnoise.plot` draws once its source became rows
    (:mod:`cockpit_gradnoise.views.sources`); the arguments are its own.

    Args:
        frame: A tidy frame of :func:`cockpit_gradnoise.to_frame`, or its
            :class:`~cockpit_gradnoise.logs.table.Rows` (the command line's).
        savefig: See :func:`cockpit_gradnoise.plot`, as every argument below.
        layers: ``None``: the ``top_k`` noisiest; a :class:`Ranked` list: those,
            ranked elsewhere; else the layers chosen.
        top_k: How many layers to draw by default.
        batch_size: Batch size used in training (default: the one recorded).
        heatmap: ``"sd"``, ``"snr"``, ``"off"`` or ``"auto"``.
        fig: A ``Figure`` or ``SubFigure`` to draw into.
        dpi: Resolution when saving.
        writer_rank: The process that saves the figure.

    Returns:
        The figure drawn into.

    Raises:
        ValueError: If ``layers`` names a parameter not in ``frame``, or
            ``heatmap`` is not one of the values above.
        ImageTooLarge: If the image to save exceeds ``MAX_DPI`` or ``MAX_PIXELS``.
    """
    # Each panel reads its own quantity's rows: split once, not once per panel.
    parts = {quantity: select(frame, quantity) for _, quantity, _ in PANELS}
    # Drawn in the noise scale's panel, beside it (or alone).
    preconditioned = select(frame, PRECONDITIONED_NOISE_SCALE)
    # Drawn there without either (the "norms" preset), with a batch schedule's changes.
    two_batch, schedule = select(frame, TWO_BATCH_NOISE_SCALE), select(frame, BATCH_SCHEDULE)
    order = layer_order(frame)  # reads every row: once
    if layers is None:  # ranked on a pandas frame (its group means)
        layers = default_layers(frame.frame() if isinstance(frame, Rows) else frame, top_k, order)
        chosen = "noisiest"
    else:
        chosen = "noisiest" if isinstance(layers, Ranked) else "chosen"
        layers = _check_layers(order, layers)
    if batch_size is None:
        batch_size = recorded_batch_size(frame)
    keys = [key for key, quantity, _ in PANELS
            if not parts[quantity].empty or key == "noise_scale" and not (preconditioned.empty
                                                                           and two_batch.empty)]
    n_layers = len(order)
    statistic = heatmap_statistic(heatmap, not parts[GRADIENT_VARIANCE].empty, len(layers),
                                   n_layers)
    mosaic, heights = _mosaic(keys or ["empty"], n_layers if statistic else 0)
    fixed = fig is None or isinstance(fig, OwnFigure)
    fig = _figure(fig, (2 * _PANEL_INCHES[0], sum(heights) + 0.8))
    layout = _layout(fig, mosaic, heights, fixed)
    axes = layout.axes
    if not keys:
        no_data(axes["empty"], "cockpit-gradnoise", _nothing_tracked(frame))
    for key, quantity, panel in PANELS:
        if key == "noise_scale" and key in axes:
            panel(axes[key], parts[quantity], batch_size=batch_size, preconditioned=preconditioned,
                  two_batch=two_batch, schedule=schedule)
        elif key in axes:
            panel(axes[key], parts[quantity], layers=layers, legend=False)
    if statistic:
        _heatmap(layout, parts[GRADIENT_VARIANCE], statistic)
    legend_rows = _legend(fig, axes, fixed)
    title = None
    if keys:
        steps = f"steps {frame.step.min()}-{frame.step.max()}"
        lines = f"lines: {len(layers)} {chosen} of {n_layers} layers and the network"
        title = fig.suptitle(f"gradient noise, {steps}{_non_finite_note(frame)}; {lines}",
                             fontsize="medium")
    if fixed:
        _place(fig, layout, mosaic, heights, legend_rows, title)
    if savefig is not None and is_writer(writer_rank):
        _check_size(fig, dpi)
        Path(savefig).parent.mkdir(parents=True, exist_ok=True)
        # zlib level 3, not 6: half the time to compress a large PNG, 7% larger.
        png = Path(savefig).suffix.lower() == ".png"
        fig.savefig(savefig, dpi=dpi, **({"pil_kwargs": {"compress_level": 3}} if png else {}))
    return fig
