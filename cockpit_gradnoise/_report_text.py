"""``cgn.report``: the report of a run in one call.

Apart from :mod:`cockpit_gradnoise.track` so that reporting a log imports
neither torch nor matplotlib.
"""

import os
from pathlib import Path
from typing import Optional

from cockpit_gradnoise.frame import to_frame
from cockpit_gradnoise.report import build_report, format_report

import pandas


def report(source, path=None, *, step: Optional[int] = None, batch_size: Optional[int] = None,
           fmt: str = "text", thresholds=None) -> str:
    """The report of a run in one call: a per-layer table of one step and findings.

    ``format_report(build_report(to_frame(source)))`` of
    :mod:`cockpit_gradnoise.report` (the text of ``cockpit-gradnoise report``).

    Args:
        source: A log's path, a :class:`~cockpit_gradnoise.Tracker`, a
            ``Cockpit``, its output dict or a frame of
            :func:`~cockpit_gradnoise.to_frame`.
        path: Where to write the text too (parent folders are created).
        step: The step to report (default: the last tracked step).
        batch_size: The batch size, compared with the noise scale; default
            the one GradientNoiseScale recorded.
        fmt: ``"text"``, ``"csv"`` or ``"json"``.
        thresholds: A ``Thresholds`` of :mod:`cockpit_gradnoise.report`
            (default: its ``THRESHOLDS``).

    Returns:
        The report's text.
    """
    # The header names the log, else what was reported ("Tracker", "DataFrame").
    tracked = getattr(source, "cockpit", None)  # a Tracker's Cockpit
    if isinstance(source, (str, os.PathLike)):
        name = str(source)
    elif tracked is not None:
        name, source = str(source.log or "Tracker"), tracked
    else:
        name = type(source).__name__
    frame = source if isinstance(source, pandas.DataFrame) else to_frame(source)
    kwargs = {} if thresholds is None else {"thresholds": thresholds}
    built = build_report(frame, source=name, step=step, batch_size=batch_size, **kwargs)
    text = format_report(built, fmt)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text
