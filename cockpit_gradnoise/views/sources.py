"""Where a source becomes the rows a view reads: :func:`plot` and :func:`report`.

A source is the path of a log, a live ``Cockpit`` or
:class:`~cockpit_gradnoise.Tracker`, a Cockpit's output dict, or a tidy frame
of :func:`cockpit_gradnoise.to_frame`. Of a streamed log only the rows a view
reads are decoded (:mod:`cockpit_gradnoise.views.reads`); any other source,
or a streamed log that path cannot take, is read whole. :func:`plot`,
:func:`report` and the command line all read their sources here.

Importing this module imports neither pandas nor matplotlib: pandas where a
frame is built, matplotlib where a figure is drawn.
"""

import os
from pathlib import Path
from typing import Optional, Sequence

from cockpit_gradnoise._ranks import WRITER_RANK
from cockpit_gradnoise.logs.codec import is_streamed, read_path
from cockpit_gradnoise.logs.table import Rows
from cockpit_gradnoise.views.common import DEFAULT_TOP_K
from cockpit_gradnoise.views.reads import held, plot_rows, report_frame
from cockpit_gradnoise.views.report import build_report, format_report


def frame_of(source):
    """The tidy frame of ``source``: a frame (or :class:`~cockpit_gradnoise.logs.table.Rows`)
    itself, else :func:`~cockpit_gradnoise.to_frame` of it."""
    if isinstance(source, Rows):
        return source
    from cockpit_gradnoise.logs.frame import to_frame

    import pandas

    return source if isinstance(source, pandas.DataFrame) else to_frame(source)


def streamed_rows(path, read):
    """``read(file)`` if ``path`` names a streamed log, and it holds this package's quantities.

    ``read`` is :func:`~cockpit_gradnoise.views.reads.report_frame` or
    :func:`~cockpit_gradnoise.views.reads.plot_rows` (with the file);
    ``None`` (another kind of log, damage, nothing of this package's): read
    the log whole, which says what is wrong.
    """
    try:
        file = read_path(path)
        if not (file.is_file() and is_streamed(file)):
            return None
        found = read(file)
    except (OSError, ValueError):
        return None
    frame = found[0] if isinstance(found, tuple) else found
    if frame is None or not held(frame):
        return None
    return found


def rows_to_plot(source, *, layers: Optional[Sequence[str]] = None, top_k: int = DEFAULT_TOP_K,
                 heatmap: str = "auto", whole=frame_of):
    """``(frame, layers)`` that the dashboard draws of ``source``.

    Of a streamed log only the rows drawn, and its ``top_k`` noisiest layers
    ranked from the log (:func:`~cockpit_gradnoise.views.reads.plot_rows`);
    else ``whole(source)`` and ``layers`` as given. ``whole``: how a source is
    read whole (the command line's says what is wrong with a log).
    """
    if isinstance(source, (str, os.PathLike)):
        found = streamed_rows(source, lambda path: plot_rows(
            path, layers=layers, top_k=top_k, heatmap=heatmap))
        if found is not None:
            return found
    return whole(source), layers


def rows_to_report(source, step: Optional[int] = None, *, whole=frame_of):
    """``(frame, ranking)`` that the report of ``source`` at ``step`` reads.

    Of a streamed log only the rows the report reads, and the ranking from its
    summary where it has one (:func:`~cockpit_gradnoise.views.reads.report_frame`);
    else ``(whole(source), None)``.
    """
    if isinstance(source, (str, os.PathLike)):
        found = streamed_rows(source, lambda path: report_frame(path, step))
        if found is not None:
            return found
    return whole(source), None


def source_name(source) -> str:
    """What a report's header names: the log, else what was reported (``"Tracker"``, ...)."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if hasattr(source, "cockpit"):  # a Tracker: its get_output reads a streamed log back
        return str(source.log or "Tracker")
    return type(source).__name__


def plot(
    source,
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
    """Draw the gradient-noise dashboard: one panel per quantity present.

    Call it offline on a log, or during training every k steps on the live
    Cockpit: without ``fig`` it clears and redraws one pyplot figure (label
    ``"cockpit-gradnoise"``), so repeated calls create no new figures. In a
    GUI session, ``plt.pause(0.001)`` after it shows the update. Nothing
    global is changed (no ``rcParams``, no interactive mode).

    Args:
        source: A live ``Cockpit`` or :class:`~cockpit_gradnoise.Tracker`,
            the path of a log (with or without ``.json``), its ``get_output()``
            dict, or a frame from :func:`cockpit_gradnoise.to_frame`.
        savefig: Path to save the figure to (format from the suffix); parent
            folders are created.
        layers: Names of the parameters drawn as lines; default the ``top_k``
            noisiest, ranked as the report ranks them, in model order
            (:func:`cockpit_gradnoise.views.common.default_layers`). The network
            (``"all"``) is always drawn, black and bold.
        top_k: How many layers to draw by default.
        batch_size: Batch size used in training, drawn in the noise-scale
            panel; default:
            :func:`cockpit_gradnoise.views.common.recorded_batch_size`.
        heatmap: Layer-by-step heatmap of the median sd (``"sd"``) or median
            SNR (``"snr"``), ``"off"``, or ``"auto"``: the sd heatmap when the
            model has more layers than are drawn as lines.
        fig: A ``Figure`` or ``SubFigure`` to draw into (cleared first), e.g.
            one half of a figure whose other half holds Cockpit's own
            dashboard (see ``docs/dashboard.md``). An
            :class:`~cockpit_gradnoise.views.dashboard.OwnFigure` is laid out
            as the figure made without ``fig``.
        dpi: Resolution when saving, at most
            :data:`~cockpit_gradnoise.views.dashboard.MAX_DPI`; the image at most
            :data:`~cockpit_gradnoise.views.dashboard.MAX_PIXELS` pixels.
        writer_rank: Under distributed training only this process saves the
            figure (``None``: every process).

    Returns:
        The figure drawn into.

    Raises:
        ValueError: If ``layers`` names a parameter not in ``source``, or
            ``heatmap`` is not one of the values above.
        ~cockpit_gradnoise.views.dashboard.ImageTooLarge: If the image to
            save exceeds ``MAX_DPI`` or ``MAX_PIXELS``.
    """
    from cockpit_gradnoise.views.dashboard import figure  # matplotlib: only to draw

    frame, layers = rows_to_plot(source, layers=layers, top_k=top_k, heatmap=heatmap)
    return figure(frame, savefig=savefig, layers=layers, top_k=top_k, batch_size=batch_size,
                  heatmap=heatmap, fig=fig, dpi=dpi, writer_rank=writer_rank)


def advice(source, *, step: Optional[int] = None, batch_size: Optional[int] = None):
    """What the noise scale of ``source`` advises: batch size, trade-off, learning rate.

    The :class:`~cockpit_gradnoise.views.advice.Advice` that is the first
    block of :func:`report` (the same step, the same numbers); ``print`` it
    for its sentences.

    Args:
        source: As :func:`report`'s.
        step: The step to advise at (default: the last tracked step; the last
            without NaN or inf where the run diverged).
        batch_size: The batch used; default the one the noise scale recorded.
    """
    frame, ranking = rows_to_report(source, step)
    return build_report(frame, source=source_name(source), step=step, batch_size=batch_size,
                        ranking=ranking).advice


def report(source, path=None, *, step: Optional[int] = None, batch_size: Optional[int] = None,
           fmt: str = "text", thresholds=None) -> str:
    """The report of a run in one call: a per-layer table of one step and findings.

    ``format_report(build_report(to_frame(source)))`` (the text of
    ``cockpit-gradnoise report``).

    Args:
        source: A log's path, a :class:`~cockpit_gradnoise.Tracker`, a
            ``Cockpit``, its output dict or a frame of
            :func:`~cockpit_gradnoise.to_frame`.
        path: Where to write the text too (parent folders are created).
        step: The step to report (default: the last tracked step).
        batch_size: The batch size, compared with the noise scale; default
            the one GradientNoiseScale recorded.
        fmt: ``"text"``, ``"csv"`` or ``"json"``.
        thresholds: A :class:`~cockpit_gradnoise.views.common.Thresholds`
            (default: ``THRESHOLDS``).

    Returns:
        The report's text.
    """
    frame, ranking = rows_to_report(source, step)
    kwargs = {} if thresholds is None else {"thresholds": thresholds}
    built = build_report(frame, source=source_name(source), step=step, batch_size=batch_size,
                         ranking=ranking, **kwargs)
    text = format_report(built, fmt)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text
