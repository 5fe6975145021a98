"""The views agree: layer order, one ranking, zeros on log scales, a partial network row.

Frames and logs are built by hand, so each case holds exactly the numbers it
is about.
"""

import json

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise import cli
from cockpit_gradnoise.logs.schema import (  # noqa: E402
    GRADIENT_VARIANCE,
    NETWORK,
    NOISE_SCALE,
    PARAM_GRAD_RATIO,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    PER_EXAMPLE_NORM,
    UPDATE_SIZE,
)
from cockpit_gradnoise.logs.table import COLUMNS  # noqa: E402
from cockpit_gradnoise.views import common as _views  # noqa: E402
from cockpit_gradnoise.views import panels
from cockpit_gradnoise.views.common import Coverage, coverage_note, network_coverage  # noqa: E402
from cockpit_gradnoise.views.findings import COLUMNS as REPORT_COLUMNS  # noqa: E402
from cockpit_gradnoise.views.report import build_report, format_report  # noqa: E402

import numpy  # noqa: E402
import pandas  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from tests.figures import labelled, panel_axes  # noqa: E402

#: Model order; by name it would be head, layer1, stem.
MODEL_ORDER = ["stem.weight", "layer1.weight", "head.weight"]


def frame_of(values):
    """A tidy frame from ``{(quantity, param, statistic): [value at step 0, 1, ...]}``."""
    rows = [(step, quantity, param, statistic, float(value))
            for (quantity, param, statistic), series in values.items()
            for step, value in enumerate(series)]
    return pandas.DataFrame(rows, columns=COLUMNS).sort_values(
        ["step", "quantity"], kind="stable", ignore_index=True)


def every_quantity(params, steps=3):
    """Plausible numbers of every quantity for ``params`` and the network."""
    values = {}
    for i, param in enumerate([*params, NETWORK]):
        scale = 1.0 + i
        values[(GRADIENT_VARIANCE, param, "q0.5")] = [0.1 * scale] * steps
        values[(GRADIENT_VARIANCE, param, "snr_q0.5")] = [1.0 / scale] * steps
        values[(PER_EXAMPLE_NORM, param, "q0.5")] = [2.0 * scale] * steps
        values[(PARAM_GRAD_RATIO, param, "norm_ratio")] = [30.0 * scale] * steps
        values[(UPDATE_SIZE, param, "relative")] = [1e-3 * scale] * steps
    values[(NOISE_SCALE, NETWORK, "b_simple")] = [40.0] * steps
    values[(NOISE_SCALE, NETWORK, "b_simple_smoothed")] = [41.0] * steps
    return values


def dashboard(frame, **kwargs):
    return panel_axes(cgn.plot(frame, fig=Figure(layout="constrained"), **kwargs))


# Layer order -------------------------------------------------------------------------


def test_report_and_dashboard_list_layers_in_model_order_never_by_name():
    frame = frame_of(every_quantity(MODEL_ORDER))
    assert list(build_report(frame).table.index) == MODEL_ORDER + [NETWORK]
    found = dashboard(frame, top_k=3, heatmap="sd")
    for quantity in (GRADIENT_VARIANCE, PER_EXAMPLE_NORM, PARAM_GRAD_RATIO, UPDATE_SIZE):
        assert list(labelled(found[quantity])) == MODEL_ORDER + [NETWORK]
    assert [t.get_text() for t in found["heatmap"].get_yticklabels()] == MODEL_ORDER
    with pytest.raises(ValueError, match="choose from stem.weight, layer1.weight, head.weight"):
        cgn.plot(frame, layers=["nope"], fig=Figure())


# One ranking -------------------------------------------------------------------------


def ranking_frame():
    """Layer a is the noisiest on average, b at the last step only."""
    values = every_quantity(["a", "b", "c"], steps=2)
    values[(GRADIENT_VARIANCE, "a", "snr_q0.5")] = [0.1, 1.5]  # mean 0.8, last 1.5
    values[(GRADIENT_VARIANCE, "b", "snr_q0.5")] = [1.0, 1.0]  # mean 1.0, last 1.0
    values[(GRADIENT_VARIANCE, "c", "snr_q0.5")] = [2.0, 2.0]
    return frame_of(values)


def test_report_and_dashboard_name_the_same_noisiest_layers():
    frame = ranking_frame()
    built = build_report(frame)
    at_last_step = built.table.snr_median.drop(NETWORK)
    assert at_last_step.idxmin() == "b"  # what ranking at the last step would say
    (line,) = [f for f in built.findings if f.startswith("noisiest layer")]
    assert line.startswith("noisiest layer: a, lowest median signal-to-noise |grad_j|/sd_j: "
                           "0.8 on average over 2 finite steps (network")
    assert list(built.ranking.scores.index) == ["a", "b", "c"]
    for k, expected in ((1, ["a"]), (2, ["a", "b"])):
        found = dashboard(frame, top_k=k)
        assert list(labelled(found[GRADIENT_VARIANCE])) == expected + [NETWORK]


def test_the_report_at_a_step_ranks_over_the_steps_up_to_it():
    frame = ranking_frame()
    (line,) = [f for f in build_report(frame, step=0).findings
               if f.startswith("noisiest layer")]
    assert line.startswith("noisiest layer: a, lowest median signal-to-noise |grad_j|/sd_j: "
                           "0.1 on average over 1 finite step (network")


# Zeros on log scales -----------------------------------------------------------------


def zero_marks(ax):
    """``[(steps, heights)]`` of the zero marks: triangles at the bottom edge of ``ax``."""
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines
            if line.get_marker() == "v" and len(line.get_xdata())]


def test_zeros_on_log_scales_are_marked_on_the_figure():
    values = every_quantity(MODEL_ORDER)
    values[(GRADIENT_VARIANCE, NETWORK, "q0.5")] = [0.2, 0.0, 0.3]
    values[(GRADIENT_VARIANCE, "layer1.weight", "q0.5")] = [0.0, 0.1, 0.1]
    values[(UPDATE_SIZE, "head.weight", "relative")] = [1e-3, 1e-3, 0.0]
    values[(NOISE_SCALE, NETWORK, "b_simple_smoothed")] = [41.0, 0.0, 41.0]
    found = dashboard(frame_of(values), top_k=3, heatmap="sd")

    variance = found[GRADIENT_VARIANCE]
    assert sorted(zero_marks(variance)) == [([0], [0.03]), ([1], [0.03])]
    network = labelled(variance)[NETWORK]
    assert numpy.isnan(network.get_ydata()[1])  # a gap, not a line dropping off the axis
    mark = next(line for line in variance.lines if list(line.get_xdata()) == [1])
    assert mark.get_color() == network.get_color()
    assert mark.get_transform() == variance.get_xaxis_transform()
    assert panels.ZERO_LABEL in [t.get_text() for t in variance.figure.legends[0].get_texts()]
    assert zero_marks(found[UPDATE_SIZE]) == [([2], [0.03])]
    noise = found[NOISE_SCALE]
    assert zero_marks(noise) == [([1], [0.03])]
    assert panels.ZERO_LABEL in [t.get_text() for t in noise.get_legend().get_texts()]
    assert zero_marks(found[PARAM_GRAD_RATIO]) == []

    heatmap = found["heatmap"]
    (crosses,) = [line for line in heatmap.lines if line.get_label() == panels.ZERO_LABEL]
    assert (list(crosses.get_xdata()), list(crosses.get_ydata())) == ([0], [1])  # layer1, step 0
    assert heatmap.get_title().endswith("x: 0")


def test_without_zeros_there_are_no_marks():
    found = dashboard(frame_of(every_quantity(MODEL_ORDER)), top_k=3, heatmap="sd")
    for ax in found.values():
        assert zero_marks(ax) == [] and "x: 0" not in ax.get_title()


# A network row that covers only some parameters --------------------------------------


def partial_values():
    values = every_quantity(MODEL_ORDER)
    values[(GRADIENT_VARIANCE, NETWORK, PARAMS_COVERED)] = [7, 7, 7]
    values[(GRADIENT_VARIANCE, NETWORK, PARAMS_TOTAL)] = [15, 15, 15]
    values[(PER_EXAMPLE_NORM, NETWORK, PARAMS_COVERED)] = [15, 15, 15]
    values[(PER_EXAMPLE_NORM, NETWORK, PARAMS_TOTAL)] = [15, 15, 15]
    return values


def test_the_dashboard_says_when_the_network_row_covers_some_parameters():
    found = dashboard(frame_of(partial_values()), top_k=3)
    assert found[GRADIENT_VARIANCE].get_title().endswith("(all: 7 of 15 parameters)")
    for quantity in (PER_EXAMPLE_NORM, PARAM_GRAD_RATIO, UPDATE_SIZE, NOISE_SCALE):
        assert "parameters)" not in found[quantity].get_title()
    for ax in found.values():  # the counts are never drawn
        for line in ax.lines:
            assert "params" not in line.get_label()
            assert not numpy.isin(line.get_ydata(), [7.0, 15.0]).any()


def test_the_report_says_when_the_network_row_covers_some_parameters():
    built = build_report(frame_of(partial_values()))
    assert list(built.table.columns) == list(REPORT_COLUMNS)
    text = format_report(built)
    header = text.split("\n\n")[0].splitlines()
    assert header[2] == ("all: 7 of 15 parameters in GradientVarianceQuantiles (the all row "
                         "leaves the other parameters out)")
    assert PARAMS_COVERED not in text and PARAMS_TOTAL not in text
    data = json.loads(format_report(built, "json"))
    assert data["network_coverage"] == {
        GRADIENT_VARIANCE: {PARAMS_COVERED: 7, PARAMS_TOTAL: 15}}
    assert PARAMS_COVERED not in format_report(built, "csv")


def test_frames_without_the_counts_cover_every_parameter():
    frame = frame_of(every_quantity(MODEL_ORDER))
    built = build_report(frame)
    assert built.coverage == {}
    assert "parameters in" not in format_report(built)
    assert json.loads(format_report(built, "json"))["network_coverage"] == {}
    assert network_coverage(frame, GRADIENT_VARIANCE) is None


def test_coverage_that_varies_over_steps_is_given_as_a_range():
    values = every_quantity(MODEL_ORDER)
    values[(UPDATE_SIZE, NETWORK, PARAMS_COVERED)] = [15, 7, 14]
    values[(UPDATE_SIZE, NETWORK, PARAMS_TOTAL)] = [15, 15, 15]
    frame = frame_of(values)
    coverage = network_coverage(frame, UPDATE_SIZE)
    assert coverage == Coverage(7, 15, 15)
    assert coverage_note(coverage) == "all: 7 to 15 of 15 parameters"
    # The report reads each quantity at its step: 14 of 15 at the last.
    assert build_report(frame).coverage == {UPDATE_SIZE: Coverage(14, 14, 15)}
    assert build_report(frame, step=0).coverage == {}


def test_the_command_line_reports_a_partial_network_row_of_a_log(tmp_path, capsys):
    log = {}
    for (quantity, param, statistic), series in partial_values().items():
        for step, value in enumerate(series):
            log.setdefault(str(step), {}).setdefault(quantity, {}).setdefault(param, {})[
                statistic] = value
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(log))
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "all: 7 of 15 parameters in GradientVarianceQuantiles" in out
    assert out.index("stem.weight") < out.index("layer1.weight") < out.index("head.weight")


@pytest.mark.parametrize("values", [[], [3], [1, 1, 2, 5, 5, 5, 9], [4, 2, 2, 7, 1], [2, 2, 2],
                                    numpy.repeat(numpy.arange(0, 2000, 3), 7)])
def test_distinct_is_numpy_unique_in_order_or_not(values):
    values = numpy.asarray(values, dtype=numpy.int64)
    found = _views.distinct(values)
    assert found.dtype == numpy.unique(values).dtype
    assert found.tolist() == numpy.unique(values).tolist()
