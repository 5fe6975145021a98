"""The dashboard of a streamed log drawn from its rows as NumPy arrays (`_views.Rows`).

`view_rows.plot_rows` gives the rows `dashboard.plot` reads without building
a pandas frame; the command line draws from them without importing pandas.
The picture must be that of the full frame (`to_frame`), also where the log
has NaN and inf, diverged, has no summary line, or was cut short.
"""

import subprocess
import sys

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs.table import Column, Rows
from cockpit_gradnoise.views import reads as view_rows
from cockpit_gradnoise.views import sources
from cockpit_gradnoise.views.common import stable_order

import matplotlib
import matplotlib.pyplot as plt
import numpy
import pandas
import pytest

from tests.test_log_summary import without_summary
from tests.test_view_rows import LOGS, STEPS, drawn, few_points, write_log  # noqa: F401

matplotlib.use("Agg")


def picture(source, **options):
    fig = plt.figure()
    sources.plot(source, fig=fig, **options)
    shown = drawn(fig)
    plt.close(fig)
    return shown


@pytest.fixture(scope="module", params=[*LOGS, "no summary"])
def log(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("logs")
    if request.param == "no summary":  # as a killed writer leaves it
        return without_summary(write_log(folder / "run.jsonl", STEPS), folder / "old.jsonl")
    return write_log(folder / "run.jsonl", STEPS, **LOGS[request.param])


@pytest.mark.parametrize("options", [{}, {"layers": ["layer3.weight"], "heatmap": "snr"},
                                     {"top_k": 2}])
def test_the_rows_draw_the_full_frames_dashboard(log, options):
    rows, layers = view_rows.plot_rows(log, **options)
    assert isinstance(rows, Rows)
    expected = picture(cgn.to_frame(log), **options)
    assert picture(rows, **{**options, "layers": layers}) == expected
    assert picture(rows.frame(), **{**options, "layers": layers}) == expected


def test_a_log_cut_inside_a_record_is_drawn_from_the_full_reader(tmp_path):
    path = write_log(tmp_path / "run.jsonl", range(0, 40, 2))
    data = path.read_bytes()
    path.write_bytes(data[:data.rindex(b'{"step"') + 100])  # a killed writer's last line
    assert sources.streamed_rows(path, view_rows.plot_rows) is None
    with pytest.warns(UserWarning, match="cut short"):
        expected = picture(cgn.to_frame(path))
    with pytest.warns(UserWarning, match="cut short"):
        assert picture(path) == expected


_IMPORTS = """
import sys
from cockpit_gradnoise.cli import main
assert main(["plot", sys.argv[1], "-o", sys.argv[2]]) == 0
print("pandas" in sys.modules)
"""


def test_the_command_line_draws_a_streamed_log_without_pandas(tmp_path):
    path = write_log(tmp_path / "run.jsonl", range(0, 40, 2))
    for log, imported in ((path, "False"), (without_summary(path, tmp_path / "old.jsonl"),
                                            "True")):  # without a summary pandas ranks
        found = subprocess.run([sys.executable, "-c", _IMPORTS, str(log), str(tmp_path / "a.png")],
                               capture_output=True, text=True, check=True)
        assert found.stdout.split()[-1] == imported


def test_a_column_factorizes_and_selects_as_a_categorical_series():
    rng = numpy.random.default_rng(0)
    categories = ["a", "b", "c", "d", "e"]
    codes = rng.integers(-1, 4, size=200).astype(numpy.int8)  # "e" absent, some missing
    column = Column(codes, categories)
    series = pandas.Series(pandas.Categorical.from_codes(codes, categories=categories))
    got, expected = column.factorize(), series.factorize()
    assert got[0].tolist() == expected[0].tolist()
    assert got[1] == list(expected[1])
    assert column.unique() == [name for name in series.unique() if isinstance(name, str)]
    assert column.isin(["b", "e", "z"]).tolist() == series.isin(["b", "e", "z"]).tolist()
    assert column[codes > 1].unique() == list(series[codes > 1].unique())


@pytest.mark.parametrize("ascending", [True, False])
def test_stable_order_is_pandas_stable_sort(ascending):
    values = numpy.array([2.0, numpy.nan, 1.0, 2.0, -numpy.inf, 1.0, numpy.inf, 2.0, numpy.nan])
    expected = pandas.Series(values).sort_values(ascending=ascending, kind="stable").index
    assert stable_order(values, ascending).tolist() == expected.tolist()


_DOCS = """
import matplotlib.artist
from cockpit_gradnoise import cli
kwdoc = matplotlib.artist.kwdoc
with cli._no_artist_docs():
    assert matplotlib.artist.kwdoc is kwdoc  # matplotlib already imported: nothing changes
print(matplotlib.artist.kwdoc is kwdoc)
"""

_FRESH = """
import sys
from cockpit_gradnoise import cli
with cli._no_artist_docs():
    import matplotlib.lines
import matplotlib.artist
print("solid_capstyle" in matplotlib.artist.kwdoc(matplotlib.lines.Line2D),
      "solid_capstyle" in matplotlib.lines.Line2D.set.__doc__)
"""


def test_the_command_line_imports_matplotlib_without_artist_docs_and_restores_them():
    def run(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()

    assert run(_FRESH) == ["True", "False"]  # restored after; the classes made meanwhile lack them
    assert run(_DOCS) == ["True"]
