"""Panels: each draws the right data, labels and scales from a real training log.

The log comes from the main job itself (``experiments.train_digits.main``, one
short epoch), run once per test process by :func:`tests.figures.digits_run`.
"""

import math

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise.logs.schema import QUANTITIES, quantile_levels  # noqa: E402
from cockpit_gradnoise.views import panels  # noqa: E402
from cockpit_gradnoise.views.common import (  # noqa: E402
    THRESHOLDS,
    default_layers,
    layer_order,
    noisiest_layers,
)

import matplotlib.pyplot as plt  # noqa: E402
import numpy  # noqa: E402
import pandas  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tests.figures import DIGITS_BATCH_SIZE, digits_run, labelled, series  # noqa: E402


@pytest.fixture(scope="module")
def frame():
    return cgn.to_frame(digits_run() / "digits.json")


def render(draw, tmp_path, **kwargs):
    """Draw one panel into a fresh, pyplot-free figure, save it as PNG; return the axes."""
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.add_subplot()
    result = draw(ax, **kwargs)
    path = tmp_path / "panel.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return ax, result


def on_log_scale(values):
    """What a line on a log scale draws: zeros and non-finite values are gaps."""
    return numpy.where(numpy.isfinite(values) & (values != 0), values, numpy.nan)


def test_the_real_run_holds_every_quantity_of_the_package(frame):
    assert sorted(frame.quantity.unique()) == sorted([*QUANTITIES, "Optimizer"])  # and its optimizer
    assert frame.step.nunique() >= 10


@pytest.mark.parametrize(
    "draw, quantity, statistic",
    [
        (panels.gradient_variance_panel, "GradientVarianceQuantiles", "q0.5"),
        (panels.per_example_norm_panel, "PerExampleGradNorm", "q0.5"),
        (panels.param_grad_ratio_panel, "ParamGradRatio", "norm_ratio"),
        (panels.update_size_panel, "UpdateSize", "relative"),
    ],
)
def test_line_panels_draw_each_layer_and_the_network_bold_on_log_scale(
    draw, quantity, statistic, frame, tmp_path
):
    layers = default_layers(frame)
    ax, _ = render(draw, tmp_path, frame=frame)
    lines = labelled(ax)
    assert list(lines) == layers + [cgn.NETWORK]
    for name in lines:
        steps, values = series(frame, quantity, name, statistic)
        numpy.testing.assert_array_equal(lines[name].get_xdata(), steps)
        numpy.testing.assert_allclose(lines[name].get_ydata(), on_log_scale(values))
    colors = panels.layer_colors(layers)
    assert [lines[name].get_color() for name in layers] == [colors[name] for name in layers]
    assert len(set(colors[name] for name in layers)) == len(layers)
    assert lines[cgn.NETWORK].get_color() == "black"
    assert lines[cgn.NETWORK].get_linewidth() > 1.5 * lines[layers[0]].get_linewidth()
    assert ax.get_yscale() == "log"
    assert ax.get_xlabel() == "step" and ax.get_ylabel() and ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [label for label in legend if label in lines] == layers + [cgn.NETWORK]


def test_variance_bands_span_the_lowest_to_the_highest_quantile(frame, tmp_path):
    layers = default_layers(frame)
    ax, _ = render(panels.gradient_variance_panel, tmp_path, frame=frame, layers=layers)
    assert len(ax.collections) == len(layers)
    assert "q0.1 to q0.9" in ax.get_ylabel()
    banded = 0
    for band, name in zip(ax.collections, layers):
        _, low = series(frame, "GradientVarianceQuantiles", name, "q0.1")
        _, high = series(frame, "GradientVarianceQuantiles", name, "q0.9")
        positive = (low > 0) & (high > 0)  # a zero edge has no place on a log scale
        y = [path.vertices[:, 1] for path in band.get_paths()]
        assert bool(y) == positive.any()
        if y:
            banded += 1
            assert numpy.concatenate(y).min() == pytest.approx(low[positive].min())
            assert numpy.concatenate(y).max() == pytest.approx(high[positive].max())
    assert banded >= 2


def test_per_example_norms_show_the_max_dotted(frame, tmp_path):
    layers = default_layers(frame)
    ax, _ = render(panels.per_example_norm_panel, tmp_path, frame=frame)
    dotted = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(dotted) == len(layers) + 1
    _, largest = series(frame, "PerExampleGradNorm", cgn.NETWORK, "max")
    assert any(numpy.allclose(line.get_ydata(), on_log_scale(largest), equal_nan=True)
               for line in dotted)
    assert "max" in ax.get_title()


def test_update_size_band_is_the_range_the_report_does_not_flag(frame, tmp_path):
    ax, _ = render(panels.update_size_panel, tmp_path, frame=frame)
    (band,) = ax.patches
    y = band.get_path().transformed(band.get_patch_transform()).vertices[:, 1]
    assert (y.min(), y.max()) == pytest.approx(THRESHOLDS.relative_update_range())
    assert THRESHOLDS.relative_update_range() == pytest.approx((1e-4, 1e-2))


def test_noise_scale_panel_shows_raw_points_smoothed_line_and_batch_size(frame, tmp_path):
    ax, _ = render(panels.noise_scale_panel, tmp_path, frame=frame,
                   batch_size=DIGITS_BATCH_SIZE)
    lines = labelled(ax)
    raw = lines["b_simple (one batch)"]
    assert raw.get_linestyle() == "None" and raw.get_marker() == "o" and raw.get_alpha() < 0.5
    steps, values = series(frame, "GradientNoiseScale", cgn.NETWORK, "b_simple")
    shown = numpy.isfinite(values) & (values != 0)
    numpy.testing.assert_allclose(raw.get_ydata(), values[shown])
    steps, smoothed = series(frame, "GradientNoiseScale", cgn.NETWORK, "b_simple_smoothed")
    numpy.testing.assert_allclose(lines["b_simple_smoothed"].get_ydata(), on_log_scale(smoothed))
    assert list(lines[f"batch size {DIGITS_BATCH_SIZE}"].get_ydata()) == [DIGITS_BATCH_SIZE] * 2
    assert ax.get_yscale() == "log"


def test_noise_scale_panel_marks_infinite_estimates_and_an_unknown_batch_size(frame, tmp_path):
    frame = frame.copy()
    first = frame.step.min()
    infinite = ((frame.quantity == "GradientNoiseScale") & (frame.param == cgn.NETWORK)
                & (frame.statistic == "b_simple") & (frame.step == first))
    frame.loc[infinite, "value"] = math.inf
    steps, values = series(frame, "GradientNoiseScale", cgn.NETWORK, "b_simple")
    ax, _ = render(panels.noise_scale_panel, tmp_path, frame=frame)
    marks = labelled(ax)["infinite (|G|^2 est. <= 0)"]
    assert first in marks.get_xdata()
    assert list(marks.get_xdata()) == list(steps[numpy.isposinf(values)])
    assert not any(label.startswith("batch size ") for label in labelled(ax))
    assert any("batch size unknown" in text.get_text() for text in ax.texts)


def test_heatmap_has_one_row_per_layer_in_model_order(frame, tmp_path):
    ax, mesh = render(panels.noise_heatmap_panel, tmp_path, frame=frame)
    layers = layer_order(frame)
    assert layers[:2] == ["0.weight", "0.bias"]  # as model.named_parameters()
    steps = sorted(frame[frame.quantity == "GradientVarianceQuantiles"].step.unique())
    assert mesh.get_array().shape == (len(layers), len(steps))
    assert [t.get_text() for t in ax.get_yticklabels()] == layers
    _, values = series(frame, "GradientVarianceQuantiles", layers[0], "q0.5")
    expected = numpy.where(values > 0, values, 0)  # zeros are masked on the log scale
    numpy.testing.assert_allclose(mesh.get_array()[0].filled(0), expected)
    assert len(ax.get_figure().axes) == 2  # the colour bar
    assert "median sd" in ax.get_title()


def test_snr_heatmap(frame, tmp_path):
    ax, mesh = render(panels.noise_heatmap_panel, tmp_path, frame=frame, statistic="snr_q0.5")
    assert "median SNR" in ax.get_title() and mesh is not None


PANELS = [
    panels.gradient_variance_panel,
    panels.per_example_norm_panel,
    panels.param_grad_ratio_panel,
    panels.update_size_panel,
    panels.noise_scale_panel,
    panels.noise_heatmap_panel,
]


@pytest.mark.parametrize("draw", PANELS, ids=lambda f: f.__name__)
def test_panels_say_so_when_their_quantity_is_absent_or_has_one_step(draw, frame, tmp_path):
    absent = frame[frame.quantity == "NoSuchQuantity"]
    ax, _ = render(draw, tmp_path, frame=absent)
    assert [t.get_text() for t in ax.texts] and "not in this log" in ax.texts[0].get_text()
    assert not ax.lines and not ax.collections and ax.get_title()
    one_step = frame[frame.step == frame.step.min()]
    ax, _ = render(draw, tmp_path, frame=one_step)
    assert "1 tracked step" in ax.texts[0].get_text() and not ax.lines


def test_default_layers_are_the_lowest_mean_snr_in_model_order(frame):
    snr = frame[(frame.quantity == "GradientVarianceQuantiles")
                & (frame.statistic == "snr_q0.5") & (frame.param != cgn.NETWORK)]
    lowest = snr.groupby("param").value.mean().nsmallest(3).index
    assert default_layers(frame, 3) == [n for n in layer_order(frame) if n in lowest]
    assert noisiest_layers(frame, 3) == list(lowest)


def test_noisiest_layers_fall_back_to_norms_without_gradient_variance(frame):
    norms = frame[frame.quantity == "PerExampleGradNorm"]
    median = norms[(norms.statistic == "q0.5") & (norms.param != cgn.NETWORK)]
    largest = median.groupby("param").value.mean().nlargest(2).index
    assert noisiest_layers(norms, 2) == list(largest)
    assert noisiest_layers(frame[frame.quantity == "UpdateSize"], 2) == ["0.weight", "0.bias"]


def test_layer_order_is_the_order_of_first_appearance_never_by_name():
    names = ["stem.weight", "layers.10.weight", "layers.2.bias", "head.weight"]
    rows = [(step, "ParamGradRatio", name, "norm_ratio", 1.0)
            for step in (0, 1) for name in [*names, cgn.NETWORK]]
    frame = pandas.DataFrame(rows, columns=["step", "quantity", "param", "statistic", "value"])
    assert layer_order(frame) == names


def test_quantile_levels_parse_only_quantiles():
    assert quantile_levels(["q0.95", "mean", "q0.05", "snr_q0.5", "q0.5", "max"]) == [
        0.05, 0.5, 0.95
    ]


def test_panels_change_no_global_state(frame, tmp_path):
    before = dict(matplotlib.rcParams)  # holds "interactive" too: other tests may set it
    figures = plt.get_fignums()
    for draw in PANELS:
        render(draw, tmp_path, frame=frame)
    assert dict(matplotlib.rcParams) == before
    assert plt.get_fignums() == figures


def test_clear_panel_lets_any_panel_draw_again(frame, tmp_path):
    fig = Figure()
    ax = fig.add_subplot()
    panels.noise_scale_panel(ax, frame[frame.quantity == "nothing"])
    panels.clear_panel(ax)
    panels.param_grad_ratio_panel(ax, frame)
    assert not ax.texts and len(labelled(ax)) == len(default_layers(frame)) + 1
    assert ax.get_yscale() == "log" and len(ax.get_xticks()) > 1
    fig.savefig(tmp_path / "again.png")


def test_synthetic_frames_in_the_documented_format_draw_too(tmp_path):
    """Panels need only the frame's documented columns, not a Cockpit."""
    rows = [
        (step, "GradientNoiseScale", cgn.NETWORK, statistic, value)
        for step in (0, 10, 20)
        for statistic, value in [("b_simple", 100.0 + step), ("b_simple_smoothed", 90.0)]
    ]
    frame = pandas.DataFrame(rows, columns=["step", "quantity", "param", "statistic", "value"])
    ax, _ = render(panels.noise_scale_panel, tmp_path, frame=frame, batch_size=32)
    assert list(labelled(ax)["b_simple (one batch)"].get_ydata()) == [100.0, 110.0, 120.0]


@pytest.mark.parametrize("ascending", [True, False])
def test_line_order_is_lexsort_by_line_then_step(ascending):
    rng = numpy.random.default_rng(0)
    steps = numpy.repeat(numpy.arange(300), 5)  # some steps twice in a line, below
    if not ascending:
        steps = rng.permutation(steps)
    for width in (7, 40_000):  # codes that fit in 16 bits, and some that do not
        key = rng.integers(0, width, len(steps)).astype(numpy.int64)
        assert panels.line_order(key, steps).tolist() == numpy.lexsort((steps, key)).tolist()
