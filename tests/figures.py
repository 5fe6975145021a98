"""Helpers shared by the figure and command-line tests: the main job's log, axes lookups."""

import atexit
import contextlib
import functools
import io
import shutil
import tempfile
from pathlib import Path

from cockpit_gradnoise.views import panels

import torch

#: The main job's options for the test run: 23 steps, 12 of them tracked.
DIGITS_ARGS = ["--epochs", "1", "--batch-size", "64", "--track-every", "2"]
DIGITS_BATCH_SIZE = 64


@functools.lru_cache(maxsize=None)
def digits_run() -> Path:
    """Run the main job once per process; return its output folder."""
    from experiments import train_digits

    out = Path(tempfile.mkdtemp(prefix="cgn-digits-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two small processes per core run faster single-threaded
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train_digits.main(["--out", str(out), *DIGITS_ARGS])
    finally:
        torch.set_num_threads(threads)
    return out


def series(frame, quantity, param, statistic):
    rows = frame[(frame.quantity == quantity) & (frame.param == param)
                 & (frame.statistic == statistic)].sort_values("step")
    return rows.step.to_numpy(), rows.value.to_numpy()


def labelled(ax):
    """``{label: line}`` of the lines with a legend label, but the zero marks' entry."""
    return {line.get_label(): line for line in ax.lines
            if not line.get_label().startswith("_") and line.get_label() != panels.ZERO_LABEL}


#: A distinctive part of each panel's title.
TITLES = {
    "GradientVarianceQuantiles": "sd of grad elements",
    "PerExampleGradNorm": "per-example gradient norms",
    "GradientNoiseScale": "gradient noise scale",
    "ParamGradRatio": "||theta|| / ||grad||",
    "UpdateSize": "relative update size",
}
HEATMAP_TITLE = "per layer (GradientVarianceQuantiles"


def panel_axes(fig):
    """``{quantity or "heatmap": axes}`` found by title."""
    found = {}
    for ax in fig.axes:
        for quantity, title in {**TITLES, "heatmap": HEATMAP_TITLE}.items():
            if title in ax.get_title():
                found[quantity] = ax
    return found
