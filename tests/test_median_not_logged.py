"""A log whose quantiles leave out 0.5: the report and the dashboard work and say so.

``GradientVarianceQuantiles(quantiles=(0.1, 0.9))`` logs no median sd, and
``PerExampleGradNorm`` with the same levels no median norm: the views look
for the 0.5 quantile among the statistics logged, never assume it.
"""

from cockpit_gradnoise import cli
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.views import sources

import matplotlib
import matplotlib.pyplot as plt
import pytest

from benchmarks import benchmark_log
from tests.test_view_rows import drawn, write_log

matplotlib.use("Agg")

LEVELS = (0.1, 0.9)
SD_NOTE = "median sd not logged (quantiles asked: 0.1, 0.9)"
NORM_NOTE = "median per-example gradient norm not logged (quantiles asked: 0.1, 0.9)"


@pytest.fixture
def log(tmp_path, monkeypatch):
    """A streamed log of the five quantities, quantiles at 0.1 and 0.9 only."""
    monkeypatch.setitem(benchmark_log.STATISTICS, schema.GRADIENT_VARIANCE,
                        schema.sd_statistic_names(LEVELS))
    monkeypatch.setitem(benchmark_log.STATISTICS, schema.PER_EXAMPLE_NORM,
                        schema.norm_statistic_names(LEVELS))
    return write_log(tmp_path / "run.jsonl", range(0, 40, 2))


def test_the_median_name_is_found_among_the_logged_statistics_by_its_level():
    assert schema.median_name(schema.sd_statistic_names((0.25, 0.5, 0.75))) == schema.SD_MEDIAN
    assert schema.median_name(schema.sd_statistic_names(LEVELS)) is None
    assert schema.median_name(["snr_q0.5"]) is None
    assert schema.median_name(["snr_q0.5"], prefix=schema.SNR_PREFIX) == schema.SNR_MEDIAN


def test_the_report_says_which_medians_are_not_logged(log, monkeypatch):
    text = sources.report(log)
    assert SD_NOTE in text.splitlines() and NORM_NOTE in text.splitlines()
    assert "sd_median" not in text  # no column of numbers that are not there
    monkeypatch.setattr(sources, "streamed_rows", lambda *args: None)  # read whole
    assert sources.report(log) == text
    assert sources.report(sources.frame_of(log)).splitlines()[1:] == text.splitlines()[1:]


def test_the_command_line_reports_it_too(log, capsys):
    assert cli.main(["report", str(log)]) == 0
    assert SD_NOTE in capsys.readouterr().out


def test_the_dashboard_draws_the_quantiles_logged_and_says_the_median_is_not(log, monkeypatch):
    fig = sources.plot(log, fig=plt.figure(), heatmap="sd")
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert "sd: q0.1 (no median), band q0.1 to q0.9" in labels
    assert "||g_i||: q0.1 (no median), band q0.1 to q0.9" in labels
    texts = [text.get_text() for ax in fig.axes for text in ax.texts]
    assert f"no data:\n{SD_NOTE}" in texts  # the heatmap of the median sd
    fast = drawn(fig)
    monkeypatch.setattr(sources, "streamed_rows", lambda *args: None)  # read whole
    assert drawn(sources.plot(log, fig=plt.figure(), heatmap="sd")) == fast
    plt.close("all")
