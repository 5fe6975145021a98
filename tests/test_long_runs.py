"""Long runs: the dashboard draws a bounded number of points, the report reads any storage.

Frames come from ``benchmarks/benchmark_report.py``'s generator (the columns
and statistics :func:`cockpit_gradnoise.to_frame` gives), a few thousand
steps of two layers: large enough to be thinned, small enough to be fast.
"""

import math

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise.logs.schema import GRADIENT_VARIANCE, NETWORK, SD_MEDIAN  # noqa: E402
from cockpit_gradnoise.views import axes, panels  # noqa: E402
from cockpit_gradnoise.views.common import equals, layer_order, select  # noqa: E402
from cockpit_gradnoise.views.report import build_report, format_report  # noqa: E402

import numpy  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from benchmarks.benchmark_report import synthetic_frame  # noqa: E402
from tests.figures import labelled, panel_axes  # noqa: E402

STEPS = 3000


@pytest.fixture(scope="module")
def long_frame():
    return synthetic_frame(steps=STEPS, layers=2, every=5)


def test_thinning_keeps_extremes_gaps_marks_and_both_ends():
    n = 10_000
    values = numpy.random.default_rng(0).lognormal(size=n)
    values[4321], values[1234] = 1e6, 1e-9  # a spike up and one down
    values[777], values[9000], values[5000:5005] = math.nan, math.inf, 0.0
    steps = numpy.arange(n) * 3
    kept = axes.thin(steps, values)
    assert len(kept) <= axes.MAX_POINTS + 8  # two per bin, and the marks' bins
    assert numpy.all(numpy.diff(kept) > 0) and kept[0] == 0 and kept[-1] == n - 1
    assert {4321, 1234, 777, 9000} <= set(kept.tolist())
    assert set(range(5000, 5005)) & set(kept.tolist())
    assert list(axes.thin(steps[:axes.MAX_POINTS], values[:axes.MAX_POINTS])) == list(
        range(axes.MAX_POINTS))


def thinned(steps, values, limit):
    """:func:`panels.thin`'s points, one bin and kind at a time: per kind of value (finite
    positive; 0; +inf; anything else) the first of its smallest and the last of its largest,
    NaN counting as the largest."""
    bins = (limit - 2) // 2
    kept = {0, len(steps) - 1}
    for value in values:
        where = {}
        for i, (step, v) in enumerate(zip(steps, value)):
            position = min(int((step - steps[0]) * bins / max(steps[-1] - steps[0], 1.0)),
                           bins - 1)
            kind = 0 if math.isfinite(v) and v > 0 else 1 if v == 0 else 2 if v == math.inf else 3
            where.setdefault((position, kind), []).append(i)
        for members in where.values():
            key = [math.inf if math.isnan(value[i]) else value[i] for i in members]
            kept.add(members[key.index(min(key))])
            kept.add(members[len(key) - 1 - key[::-1].index(max(key))])
    return sorted(kept)


@pytest.mark.parametrize("seed", range(6))
def test_thinning_keeps_what_each_bin_and_kind_would_keep(seed):
    rng = numpy.random.default_rng(seed)
    n = int(rng.integers(300, 1500))
    steps = numpy.sort(rng.integers(0, 4000, n)) if seed % 2 else numpy.arange(n) * 3
    choices = [0.0, -0.0, 0.5, 1.0, 2.0, 2.0, math.inf, -math.inf, math.nan, -1.0]
    values = [rng.choice(choices, n), rng.lognormal(size=n).round(1)][: 1 + seed % 2]
    limit = int(rng.integers(6, 120))
    assert axes.thin(steps, *values, limit=limit).tolist() == thinned(steps, values, limit)


def test_long_lines_are_thinned_to_an_envelope(long_frame):
    fig = cgn.plot(long_frame, fig=Figure(layout="constrained"))
    found = panel_axes(fig)
    rows = select(long_frame, GRADIENT_VARIANCE, NETWORK, SD_MEDIAN)
    network = labelled(found[GRADIENT_VARIANCE])[NETWORK]
    x, y = network.get_xdata(), network.get_ydata()
    assert len(x) <= axes.MAX_POINTS and (x[0], x[-1]) == (0, (STEPS - 1) * 5)
    assert y.max() == rows.value.max() and y.min() == rows.value.min()
    for quantity in found:
        for line in found[quantity].lines:
            assert len(line.get_xdata()) <= axes.MAX_POINTS, quantity


def test_the_heatmap_shows_at_most_max_columns_evenly_spaced_steps(long_frame):
    ax = Figure().add_subplot()
    mesh = panels.noise_heatmap_panel(ax, long_frame, colorbar=False)
    rows, columns = mesh.get_array().shape
    assert rows == 2 and columns <= panels.MAX_COLUMNS
    centres = mesh.get_coordinates()[0, :, 0]
    assert centres[0] < 5 and centres[-1] > (STEPS - 1) * 5 - 5  # first and last step
    widths = numpy.diff(centres)
    assert widths.max() <= 2 * widths.min() + 5  # evenly spaced


def test_non_finite_steps_become_a_bounded_number_of_bands(long_frame):
    frame = long_frame.copy()
    frame.loc[frame.step % 10 == 0, "value"] = math.nan  # every other tracked step
    ax = Figure().add_subplot()
    marked = panels.non_finite_bands(ax, frame, GRADIENT_VARIANCE)
    assert len(marked) == STEPS // 2
    assert 1 <= len(ax.patches) <= panels.MAX_BANDS
    assert ax.patches[0].get_x() < 0 and ax.patches[-1].get_x() + ax.patches[-1].get_width() \
        > (STEPS - 2) * 5


@pytest.mark.parametrize("storage", ["object", "category"])
def test_the_report_reads_any_text_storage_alike(long_frame, storage):
    text_columns = {"quantity": storage, "param": storage, "statistic": storage}
    diverged = synthetic_frame(steps=40, layers=3, diverge_at=0.5)
    for frame in (long_frame, diverged):
        stored = frame.astype(text_columns)
        assert format_report(build_report(stored)) == format_report(build_report(frame))
        assert layer_order(stored) == layer_order(frame)
        assert (equals(stored.param, NETWORK) == (frame.param == NETWORK).to_numpy()).all()
    assert not equals(long_frame.astype(text_columns).param, "no such layer").any()
