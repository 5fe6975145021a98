"""The fast path: the rows of a streamed log the report and the dashboard read.

`view_rows.report_frame` / `plot_rows` decode only some of a log's numbers
(`selective`); the report and the dashboard drawn from them must be those of
the full frame (`to_frame`), and their rows the full frame's rows.
"""

import math
import re

import cockpit_gradnoise as cgn
from cockpit_gradnoise import cli
from cockpit_gradnoise.logs import selective
from cockpit_gradnoise.logs.frame import LoggedUpdate
from cockpit_gradnoise.views import axes, panels, sources
from cockpit_gradnoise.views import reads as view_rows
from cockpit_gradnoise.views.report import build_report, format_report

import matplotlib
import matplotlib.pyplot as plt
import numpy
import pytest

from benchmarks import benchmark_log

matplotlib.use("Agg")


def write_log(path, steps, *, diverge_at=None, frozen_at=None, custom=False, repeat=None,
              tensors=20, old=False):
    """A streamed log of the five quantities (as `cgn.track` stores them) at ``steps``.

    ``diverge_at``: every number NaN from that step on; ``frozen_at``: the
    second tensor leaves every quantity from then on (a second layout);
    ``custom``: a quantity of another name and Cockpit's own list; ``repeat``:
    that step written twice (the second replaces the first); ``old``: without
    the records' ``nonfinite`` field, as logs written before it.
    """
    cockpit, rng = benchmark_log.synthetic_cockpit(tensors), numpy.random.default_rng(1)
    names = list(cockpit.names)
    with cgn.LogStream(path) as stream:
        for step in steps:
            for _ in range(2 if step == repeat else 1):
                cockpit.names = [n for i, n in enumerate(names)
                                 if frozen_at is None or step < frozen_at or i != 1]
                benchmark_log.fill(cockpit, step, rng)
                if diverge_at is not None and step >= diverge_at:
                    _all_nan(cockpit, step)
                if custom:
                    cockpit.output[step]["GradNorm"] = [1.0, 2.0]
                    cockpit.output[step]["Custom"] = {"head.weight": {"spread": float(step)}}
                stream.append(cockpit)
    if old:
        text, count = re.subn(r'"nonfinite": \{[^}]*\}, ', "", path.read_text())
        assert count
        path.write_text(text)
    return path


def _all_nan(cockpit, step):
    for quantity in cockpit.quantities:
        value = quantity.output[step]
        if isinstance(value, list):
            quantity.output[step] = [LoggedUpdate(u.name, math.nan, u.start_norm) for u in value]
        else:
            quantity.output[step] = {p: {s: "nan" for s in stats} for p, stats in value.items()}


LOGS = {
    "non-finite here and there": {},
    "diverged": {"diverge_at": 200},
    "frozen, custom, repeated": {"frozen_at": 80, "custom": True, "repeat": 120},
    "older log": {"old": True, "diverge_at": 250},
}
STEPS = range(0, 300, 2)  # over the MAX_POINTS and MAX_COLUMNS below


@pytest.fixture(autouse=True)
def few_points(monkeypatch):
    """Lines thinned and heatmaps cut to fewer steps than the logs have, as on long runs."""
    monkeypatch.setattr(axes, "MAX_POINTS", 60)
    monkeypatch.setattr(panels, "MAX_COLUMNS", 25)


@pytest.fixture(scope="module", params=list(LOGS))
def streamed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("logs") / "run.jsonl"
    return write_log(path, STEPS, **LOGS[request.param])


def assert_rows_of(part, full):
    """``part`` holds rows of ``full``, in its order, with its categories and values."""
    keys = list(zip(*(full[c].astype(object) for c in ("step", "quantity", "param", "statistic"))))
    where = {key: i for i, key in enumerate(keys)}
    assert len(where) == len(keys)
    found = [where[key] for key in zip(*(part[c].astype(object)
                                        for c in ("step", "quantity", "param", "statistic")))]
    assert len(part) and found == sorted(found)
    for column in ("quantity", "param", "statistic"):
        assert part[column].dtype == full[column].dtype
    taken = full.iloc[found]
    assert numpy.array_equal(part.step.to_numpy(), taken.step.to_numpy())
    assert numpy.array_equal(part.value.to_numpy().view(numpy.int64),
                             taken.value.to_numpy().view(numpy.int64))


@pytest.mark.parametrize("step", [None, 0, 151, 200, 298])
def test_the_report_of_the_rows_read_is_the_full_report(streamed, step):
    full = cgn.to_frame(streamed)
    part, ranking = view_rows.report_frame(streamed, step)
    assert_rows_of(part, full)
    assert len(part) < len(full) / 3 + (~numpy.isfinite(full.value)).sum()  # NaN: all kept
    expected = build_report(full, source="run", step=step)
    got = build_report(part, source="run", step=step, ranking=ranking)
    for fmt in ("text", "csv", "json"):
        assert format_report(got, fmt) == format_report(expected, fmt)


def test_a_step_outside_the_log_is_refused_alike(streamed):
    (part, _), full = view_rows.report_frame(streamed, 5000), cgn.to_frame(streamed)
    with pytest.raises(ValueError) as expected:
        build_report(full, step=5000)
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        build_report(part, step=5000)


def drawn(fig):
    """Everything a figure shows: per axes its texts, scales, lines' data, patches, meshes."""
    shown = [fig.get_suptitle(), [t.get_text() for legend in fig.legends for t in legend.texts]]
    for ax in fig.axes:
        shown.append([ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale(),
                      [t.get_text() for t in ax.texts],
                      [t.get_text() for t in ax.get_yticklabels()]])
        for line in ax.lines:
            shown.append((line.get_label(), line.get_color(), line.get_linestyle(),
                          numpy.asarray(line.get_xdata(), float).tolist(),
                          numpy.asarray(line.get_ydata(), float).tolist()))
        for collection in ax.collections:
            paths = [path.vertices.tolist() for path in collection.get_paths()]
            array = collection.get_array()
            shown.append((type(collection).__name__, paths,
                          None if array is None else numpy.ma.filled(array, -1.0).tolist()))
        shown.append([patch.get_xy() if hasattr(patch, "get_xy") else None
                      for patch in ax.patches])
    return repr(shown)


@pytest.mark.parametrize("options", [{}, {"layers": ["layer1.weight"], "heatmap": "snr"},
                                     {"top_k": 2, "heatmap": "off"}])
def test_the_dashboard_of_the_rows_read_is_the_full_dashboard(streamed, options):
    full = cgn.to_frame(streamed)
    rows, layers = view_rows.plot_rows(streamed, **options)
    part = rows.frame()
    assert_rows_of(part, full)
    assert len(part) < len(full) / 2 + (~numpy.isfinite(full.value)).sum()
    pictures = []
    for frame, given in ((full, options), (part, {**options, "layers": layers})):
        fig = plt.figure()
        sources.plot(frame, fig=fig, **given)
        pictures.append(drawn(fig))
        plt.close(fig)
    assert "noisiest" in pictures[0] or "layers" in options
    assert pictures[0] == pictures[1]


def test_the_command_line_reads_only_the_rows_and_says_the_same(streamed, tmp_path, capsys,
                                                                 monkeypatch):
    assert cli.main(["report", str(streamed)]) == 0
    fast = capsys.readouterr().out
    monkeypatch.setattr(sources, "streamed_rows", lambda *args: None)  # read whole
    assert cli.main(["report", str(streamed)]) == 0
    assert capsys.readouterr().out == fast


def test_every_non_finite_number_is_found_with_and_without_the_nonfinite_field(tmp_path):
    for old in (False, True):
        path = write_log(tmp_path / f"run{old}.jsonl", range(0, 40, 2), old=old)
        index = selective.index_log(path)
        full = cgn.to_frame(path)
        found = index.frame([selective.non_finite_rows(index)])
        assert_rows_of(found, full)
        assert len(found) == (~numpy.isfinite(full.value)).sum() > 0


def test_damage_and_other_logs_are_left_to_the_full_reader(tmp_path):
    path = write_log(tmp_path / "run.jsonl", range(4))
    assert selective.index_log(path) is not None
    lines = path.read_bytes().split(b"\n")
    record = next(i for i, line in enumerate(lines) if line.startswith(b'{"step"'))
    lines[record] = lines[record][:-10] + lines[record][-8:]  # two characters fewer
    (tmp_path / "cut.jsonl").write_bytes(b"\n".join(lines))
    assert selective.index_log(tmp_path / "cut.jsonl") is None
    value = b'{"step": 9, "quantity": 0, "value": {"w": {"mean": 1.0}}}\n'
    (tmp_path / "value.jsonl").write_bytes(path.read_bytes() + value)
    assert selective.index_log(tmp_path / "value.jsonl") is None
    assert selective.index_log(tmp_path / "missing.jsonl") is None
    json_log = tmp_path / "run.json"
    json_log.write_text("{}")
    assert selective.index_log(json_log) is None


def test_a_cut_last_line_reads_as_the_full_reader_does(tmp_path, capsys):
    path = write_log(tmp_path / "run.jsonl", range(0, 30, 3))
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.warns(UserWarning, match="cut short"):
        assert cli.main(["report", str(path)]) == 0
    assert "step 27" in capsys.readouterr().out


def test_report_and_plot_of_a_path_read_only_the_rows(streamed, monkeypatch):
    fast_text, fast_figure = cgn.report(streamed, step=151), drawn(cgn.plot(streamed, fig=plt.figure()))
    monkeypatch.setattr(sources, "streamed_rows", lambda *args: None)  # read whole
    assert cgn.report(streamed, step=151) == fast_text
    assert drawn(cgn.plot(streamed, fig=plt.figure())) == fast_figure
    plt.close("all")


def test_a_record_with_many_runs_of_nan_is_indexed_past_its_first_bytes(tmp_path):
    cockpit, rng = benchmark_log.synthetic_cockpit(40), numpy.random.default_rng(2)
    path = tmp_path / "striped.jsonl"
    with cgn.LogStream(path) as stream:
        for step in range(6):
            benchmark_log.fill(cockpit, step, rng)
            for quantity in cockpit.quantities:
                value = quantity.output[step]
                if isinstance(value, dict):  # the first statistic of every row NaN: 41 runs
                    for statistics in value.values():
                        statistics[next(iter(statistics))] = "nan"
            stream.append(cockpit)
    assert max(len(line) - len(line.split(b'"values"')[-1]) for line in
               path.read_bytes().splitlines() if line.startswith(b'{"step"')) > 200
    index = selective.index_log(path)
    full = cgn.to_frame(path)
    assert_rows_of(index.frame([selective.non_finite_rows(index)]), full)
    part, ranking = view_rows.report_frame(path)
    assert format_report(build_report(part, ranking=ranking)) == format_report(build_report(full))
