"""The dashboard: panels of the quantities present, live redraws, many layers, Cockpit."""

import re
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise.views import dashboard, panels  # noqa: E402
from cockpit_gradnoise.views.common import DEFAULT_TOP_K, default_layers  # noqa: E402
from cockpit_gradnoise.views.report import build_report, format_report  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import nn  # noqa: E402

from experiments.train_digits import make_quantities  # noqa: E402
from tests.cases import ModelCase, build, run_step  # noqa: E402
from tests.figures import (  # noqa: E402
    DIGITS_BATCH_SIZE,
    TITLES,
    digits_run,
    labelled,
    panel_axes,
    series,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "dashboard.md"

def constrained():
    return Figure(layout="constrained")


@pytest.fixture(scope="module")
def log():
    return digits_run() / "digits.json"


@pytest.fixture(scope="module")
def frame(log):
    return cgn.to_frame(log)


def deep_mlp():
    """30 Linear layers: 60 parameters."""
    layers = [module for _ in range(29) for module in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(8, 3))


@pytest.fixture(scope="module")
def deep_cockpit():
    """A live Cockpit after 4 tracked steps of a 60-parameter model, batch 16."""
    problem = build(ModelCase("deep", deep_mlp, lambda n: torch.randn(n, 8)), 16, "mean",
                    dtype=torch.float32)
    names = problem.names
    assert len(names) == 60
    cockpit = cgn.Cockpit(problem.params, quantities=make_quantities(names, track_every=1))
    optimizer = torch.optim.SGD(problem.params, lr=0.5)
    for step in range(4):
        run_step(problem, None, step, cockpit, optimizer)
        optimizer.step()
    return cockpit


def test_dashboard_of_a_real_log_has_every_panel_one_legend_and_saves_png(log, frame, tmp_path):
    path = tmp_path / "sub" / "dashboard.png"
    fig = cgn.plot(log, savefig=path, batch_size=DIGITS_BATCH_SIZE, fig=constrained())
    assert path.read_bytes()[:4] == b"\x89PNG"
    found = panel_axes(fig)
    assert set(found) == set(TITLES) | {"heatmap"}  # 8 layers > 6 lines: heatmap
    layers = default_layers(frame)
    for quantity in TITLES:
        if quantity != "GradientNoiseScale":
            assert list(labelled(found[quantity])) == layers + [cgn.NETWORK]
            assert found[quantity].get_legend() is None  # one shared legend instead
    network = labelled(found["GradientVarianceQuantiles"])[cgn.NETWORK]
    numpy.testing.assert_allclose(
        network.get_ydata(), series(frame, "GradientVarianceQuantiles", cgn.NETWORK, "q0.5")[1]
    )
    assert f"batch size {DIGITS_BATCH_SIZE}" in labelled(found["GradientNoiseScale"])
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts() if t.get_text() != panels.ZERO_LABEL]
    assert texts == layers + [cgn.NETWORK, "usual 0.001"]
    assert "6 noisiest of 8 layers" in fig.get_suptitle()


def test_the_main_job_writes_the_dashboard_and_the_report(frame):
    out = digits_run()
    assert (out / "digits.png").read_bytes()[:4] == b"\x89PNG"
    expected = format_report(build_report(
        frame, source=str(out / "digits.json"), batch_size=DIGITS_BATCH_SIZE))
    assert (out / "digits_report.txt").read_text() == expected
    assert "findings:" in expected and f"batch size {DIGITS_BATCH_SIZE}" in expected


def test_a_live_cockpit_and_its_log_give_the_same_dashboard(deep_cockpit, tmp_path):
    live = cgn.plot(deep_cockpit, batch_size=16, fig=constrained())
    saved = cgn.plot(cgn.write_log(deep_cockpit, tmp_path / "deep"), batch_size=16,
                     fig=constrained())
    for a, b in zip(live.axes, saved.axes):
        assert a.get_title() == b.get_title()
        assert [line.get_label() for line in a.lines] == [line.get_label() for line in b.lines]
        for x, y in zip(a.lines, b.lines):
            numpy.testing.assert_array_equal(x.get_ydata(), y.get_ydata())


def test_sixty_parameters_stay_readable(deep_cockpit, tmp_path):
    fig = cgn.plot(deep_cockpit, batch_size=16, fig=constrained())
    fig.set_size_inches(13, 20)
    fig.savefig(tmp_path / "deep.png", dpi=72)
    found = panel_axes(fig)
    for quantity in ("GradientVarianceQuantiles", "PerExampleGradNorm", "ParamGradRatio",
                     "UpdateSize"):
        assert len(labelled(found[quantity])) == DEFAULT_TOP_K + 1
    assert len(fig.legends[0].get_texts()) <= DEFAULT_TOP_K + 2
    assert "6 noisiest of 60 layers" in fig.get_suptitle()
    heatmap = found["heatmap"]
    labels = [t for t in heatmap.get_yticklabels() if t.get_text()]
    assert len(labels) == 60
    assert labels[0].get_text() == "0.weight" and labels[-1].get_text() == "58.bias"
    row_points = heatmap.get_window_extent().height / fig.dpi * 72 / 60
    assert labels[0].get_fontsize() >= 5 and row_points >= labels[0].get_fontsize()


def test_the_default_size_leaves_each_heatmap_row_room_for_its_label(deep_cockpit, tmp_path):
    plt.close(dashboard.FIGURE_LABEL)
    fig = cgn.plot(deep_cockpit, batch_size=16, savefig=tmp_path / "deep.png")
    heatmap = panel_axes(fig)["heatmap"]
    label = heatmap.get_yticklabels()[0]
    assert heatmap.get_window_extent().height / fig.dpi * 72 / 60 >= label.get_fontsize()
    plt.close(fig)


def test_chosen_layers_are_drawn_and_unknown_ones_named(deep_cockpit):
    fig = cgn.plot(deep_cockpit, layers=["0.weight", "58.bias"], fig=constrained())
    found = panel_axes(fig)
    assert list(labelled(found["ParamGradRatio"])) == ["0.weight", "58.bias", cgn.NETWORK]
    assert len(found["heatmap"].get_yticklabels()) == 60
    assert "2 chosen of 60 layers" in fig.get_suptitle()
    with pytest.raises(ValueError, match=r"unknown layers \['nope'\]: choose from 0.weight, 0.b"):
        cgn.plot(deep_cockpit, layers=["nope"], fig=constrained())


def test_heatmap_modes(frame):
    assert "heatmap" not in panel_axes(cgn.plot(frame, heatmap="off", fig=constrained()))
    snr = panel_axes(cgn.plot(frame, heatmap="snr", fig=constrained()))["heatmap"]
    assert "median SNR" in snr.get_title()
    all_lines = cgn.plot(frame, top_k=8, fig=constrained())
    assert "heatmap" not in panel_axes(all_lines)  # auto: every layer is a line already
    with pytest.raises(ValueError, match="heatmap must be"):
        cgn.plot(frame, heatmap="median", fig=constrained())


def test_only_the_quantities_present_get_panels_and_nothing_tracked_says_so(frame):
    two = frame[frame.quantity.isin(["ParamGradRatio", "UpdateSize"])]
    assert set(panel_axes(cgn.plot(two, fig=constrained()))) == {"ParamGradRatio", "UpdateSize"}
    empty = cgn.plot({}, fig=constrained())
    (ax,) = empty.axes
    assert "no cockpit-gradnoise quantities tracked yet" in ax.texts[0].get_text()


def test_a_quantity_with_one_step_keeps_its_panel_and_says_so(frame):
    first = frame.step.min()
    early = frame[(frame.step == first) | (frame.quantity != "GradientNoiseScale")]
    ax = panel_axes(cgn.plot(early, fig=constrained()))["GradientNoiseScale"]
    assert "1 tracked step" in ax.texts[0].get_text()


def test_a_reused_figure_follows_the_data_as_it_arrives(frame):
    fig = constrained()
    steps = sorted(frame.step.unique())
    axes = {}
    for until in (steps[0], steps[1], steps[-1], steps[-1], steps[0]):
        cgn.plot(frame[frame.step <= until], fig=fig, batch_size=DIGITS_BATCH_SIZE)
        axes.setdefault(until, len(fig.axes))
        assert len(fig.axes) == axes[until]  # the heatmap's colour bar is replaced, not added
        ax = panel_axes(fig)["ParamGradRatio"]
        if until == steps[0]:
            assert "1 tracked step" in ax.texts[0].get_text() and not ax.lines
        else:
            assert not ax.texts and ax.get_yscale() == "log"
            assert max(ax.lines[-1].get_xdata()) == until
    assert len(fig.legends) <= 1


def test_a_thousand_live_redraws_reuse_one_figure_without_growing(frame):
    """The training-loop use: plot every k steps. Small data keeps it fast."""
    small = frame[(frame.quantity == "ParamGradRatio")
                  & (frame.step <= sorted(frame.step.unique())[2])]
    plt.close(dashboard.FIGURE_LABEL)
    figures = len(plt.get_fignums())

    def redraw():
        return cgn.plot(small, layers=["2.weight"], batch_size=DIGITS_BATCH_SIZE)

    fig = redraw()
    shape = [(len(ax.lines), len(ax.collections), len(ax.texts)) for ax in fig.axes]
    for _ in range(50):
        redraw()
    before = _resident_bytes()
    for _ in range(1000):
        assert redraw() is fig
    grown = _resident_bytes() - before
    assert len(plt.get_fignums()) == figures + 1
    assert [(len(ax.lines), len(ax.collections), len(ax.texts)) for ax in fig.axes] == shape
    assert len(fig.legends) == 1
    assert grown < 20e6, f"resident memory grew by {grown / 1e6:.1f} MB over 1,000 redraws"
    plt.close(fig)


def _resident_bytes():
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def test_plot_changes_no_global_state(frame, tmp_path):
    before = dict(matplotlib.rcParams)  # holds "interactive" too: other tests may set it
    fig = cgn.plot(frame, savefig=tmp_path / "x.png")
    assert dict(matplotlib.rcParams) == before
    plt.close(fig)


def test_the_cockpit_example_of_the_docs_renders_both_dashboards(tmp_path, monkeypatch):
    code = re.search(r"```python\n(# docs/dashboard.md example.*?)```", DOCS.read_text(),
                     re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    # Start non-interactive (another test's CockpitPlotter may have called plt.ion()),
    # so that the example's rc_context is seen to undo Cockpit's plt.ion() and style.
    with matplotlib.rc_context({"interactive": False}), warnings.catch_warnings():
        before = dict(matplotlib.rcParams)
        warnings.simplefilter("ignore")  # Cockpit's plotter warns through seaborn
        exec(compile(code, str(DOCS), "exec"), namespace)
        assert dict(matplotlib.rcParams) == before
    for name in ("cockpit_beside.png", "cockpit_inside.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    titles = lambda figure: {ax.get_title() for ax in figure.axes}  # noqa: E731
    assert {"STEP SIZE", "GRADIENTS", "Distance"} <= titles(namespace["left"])
    assert set(panel_axes(namespace["right"])) == set(TITLES)
    inside = namespace["inside"]
    assert {"STEP SIZE", "GRADIENT NOISE", "Distance"} <= titles(inside)
    assert {"GradientNoiseScale", "GradientVarianceQuantiles", "UpdateSize"} <= set(
        panel_axes(inside))
    distance = next(ax for ax in inside.axes if ax.get_title() == "Distance")
    assert distance.collections  # Cockpit's Distance panel drew our UpdateSize


def test_the_batch_size_recorded_by_gradient_noise_scale_is_used_when_none_is_given(frame):
    recorded = frame[frame.statistic == "batch_size"]
    assert set(recorded.value) == {64.0}  # the fixture's run trains with batch 64
    ax = panel_axes(cgn.plot(frame, fig=constrained()))["GradientNoiseScale"]
    assert "batch size 64" in labelled(ax)
    assert "batch size 32" in labelled(panel_axes(
        cgn.plot(frame, batch_size=32, fig=constrained()))["GradientNoiseScale"])
    text = format_report(build_report(frame))
    assert ", batch size 64\n" in text and "- batch 64 " in text
