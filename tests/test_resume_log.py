"""A streamed log that a restarted run continues: never replaced silently (issue 35).

`LogStream(path)` where a streamed log exists continues it; `resume=False`
keeps the old file under a free name. A restart from an earlier step
supersedes the lines after it: kept in the file, out of the frame unless
asked for. `tests/data/logs/streamed_v1.jsonl` was written by the code before
this change (format version 1, steps 0-4 of `resumed`'s outputs). The calls
that docs/training-setups.md ("Resuming a run") shows are made by
`test_a_restart_from_an_earlier_step_supersedes_the_lines_after_it`.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs.selective import index_log
from cockpit_gradnoise.views import reads as view_rows
from cockpit_gradnoise.views import sources

import pytest

from tests.test_log import ROOT, cockpit_like, special_outputs
from tests.test_plot_rows import _IMPORTS, picture
from tests.test_view_rows import STEPS, few_points, write_log  # noqa: F401

V1 = ROOT / "tests" / "data" / "logs" / "streamed_v1.jsonl"


def resumed(path, steps, **options):
    """A LogStream on ``path`` appending ``steps`` of three quantities; the stream (closed)."""
    cockpit = cockpit_like("GradientNoiseScale", "UpdateSize", "GradNorm")
    with cgn.LogStream(path, **options) as stream:
        for step in steps:
            for quantity in cockpit.quantities:
                quantity.output[step] = special_outputs(step)[type(quantity).__name__]
            stream.append(cockpit)
    return stream


def test_a_resumed_log_is_the_log_of_a_run_that_never_stopped(tmp_path):
    resumed(tmp_path / "whole.jsonl", range(8))
    resumed(tmp_path / "run.jsonl", range(5))
    resumed(tmp_path / "run.jsonl", range(5, 8))
    assert list(cgn.read_log(tmp_path / "run.jsonl")) == list(range(8))
    assert cgn.to_frame(tmp_path / "run.jsonl").equals(cgn.to_frame(tmp_path / "whole.jsonl"))
    # Tables, layouts and summary read back: the very bytes of the uninterrupted run's log.
    assert (tmp_path / "run.jsonl").read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


def test_a_restart_from_an_earlier_step_supersedes_the_lines_after_it(tmp_path):
    path = tmp_path / "run.jsonl"
    resumed(path, range(5))
    cockpit = cockpit_like("GradientNoiseScale")
    with cgn.LogStream(path) as stream:
        for step in range(3, 6):
            cockpit.quantities[0].output[step] = special_outputs(step + 100)["GradientNoiseScale"]
            stream.append(cockpit)
    assert path.read_text().count('{"superseded": 3}\n') == 1
    logged = cgn.read_log(path)
    assert list(logged) == list(range(6))
    assert set(logged[3]) == {"GradientNoiseScale"}  # the dead run's UpdateSize at 3 is gone too
    frame = cgn.to_frame(path)
    assert sorted(frame.step.unique()) == list(range(6))
    new = cgn.to_frame({s: {"GradientNoiseScale": special_outputs(s + 100)["GradientNoiseScale"]}
                        for s in (3, 4)})
    got = frame[frame.step.isin([3, 4])].reset_index(drop=True)
    assert got.value.tolist() == pytest.approx(new.value.tolist(), nan_ok=True)
    # The old lines on request: as rows with a column, and as records.
    every = cgn.to_frame(path, superseded=True)
    assert every[~every.superseded].drop(columns="superseded").reset_index(drop=True).equals(frame)
    old = every[every.superseded]
    assert sorted(old.step.unique()) == [3, 4]
    written = cgn.to_frame({s: special_outputs(s) for s in (3, 4)})
    assert old.value.tolist() == pytest.approx(written.value.tolist(), nan_ok=True)
    records = logged.superseded_records()
    assert [(step, name) for step, name, _ in records] == [
        (s, q) for s in (3, 4) for q in ("GradientNoiseScale", "UpdateSize", "GradNorm")]
    # The fast reader leaves them out as the full one does.
    index = index_log(path)
    assert index is not None and sorted(set(index.step.tolist())) == list(range(6))
    assert len(index) == len(frame.groupby(["step", "quantity"], observed=True))


def test_a_fresh_start_keeps_the_old_file_under_a_new_name(tmp_path):
    path = tmp_path / "run.jsonl"
    resumed(path, range(3))
    before = path.read_bytes()
    stream = resumed(path, range(2), resume=False)
    assert stream.kept == tmp_path / "run.1.jsonl" and stream.kept.read_bytes() == before
    second = path.read_bytes()
    assert resumed(path, [0], resume=False).kept == tmp_path / "run.2.jsonl"
    assert (tmp_path / "run.2.jsonl").read_bytes() == second
    assert (tmp_path / "run.1.jsonl").read_bytes() == before


def test_a_file_that_is_not_a_streamed_log_is_not_resumed_nor_touched(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("old content\n")
    with pytest.raises(ValueError, match="not a cockpit-gradnoise streamed log.*resume=False"):
        cgn.LogStream(path)
    assert path.read_text() == "old content\n"
    assert cgn.LogStream(path, resume=False).kept.read_text() == "old content\n"


def test_a_cut_last_line_is_moved_aside_with_a_warning_and_the_log_continues(tmp_path):
    path = tmp_path / "run.jsonl"
    resumed(path, range(3))
    data = path.read_bytes()
    data = data[:data.rindex(b'{"layout": [], "summary"')]  # a killed writer's: no summary
    path.write_bytes(data[:-20])
    with pytest.warns(UserWarning, match="cut short.*run.jsonl.cut1"):
        resumed(path, range(2, 4))
    assert (tmp_path / "run.jsonl.cut1").read_bytes() == data[data.rindex(b"\n", 0, -21) + 1:-20]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(cgn.read_log(path)) == [0, 1, 2, 3]


def test_a_log_of_format_version_1_is_resumed(tmp_path):
    path = tmp_path / "run.jsonl"
    shutil.copyfile(V1, path)
    assert path.read_text().startswith('{"format": "cockpit-gradnoise-log", "version": 1}\n')
    resumed(path, range(5, 8))
    resumed(tmp_path / "whole.jsonl", range(8))
    assert cgn.to_frame(path).equals(cgn.to_frame(tmp_path / "whole.jsonl"))
    resumed(path, range(6, 8))  # a restart from 6: a superseded line in a version-1 log
    assert list(cgn.read_log(path)) == list(range(8))
    assert index_log(path) is not None


# Appends steps from argv[2] on (to argv[3], else until killed); prints each step appended.
WRITER = """
import sys
from collections import defaultdict
from types import SimpleNamespace
from cockpit_gradnoise.logs.stream import LogStream

quantity = type("GradientNoiseScale", (), {})()
quantity.output = defaultdict(dict)
cockpit = SimpleNamespace(quantities=[quantity], output=defaultdict(dict))
step, stop = int(sys.argv[2]), int(sys.argv[3])
with LogStream(sys.argv[1]) as stream:
    while stop < 0 or step < stop:
        quantity.output[step] = {f"p{i}": {"a": float(step), "b": i + 0.5} for i in range(3000)}
        stream.append(cockpit)
        print(step, flush=True)
        step += 1
"""


def test_a_run_killed_and_restarted_keeps_every_line_it_wrote(tmp_path):
    path = tmp_path / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "0", "-1"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(4):  # steps 0-3 appended at least
            first.stdout.readline()
        time.sleep(0.2)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    last = int(([*"0123", *first.stdout.read().split()])[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cut last line, when the kill lands mid-write
        subprocess.run([sys.executable, "-c", WRITER, str(path), "2", "5"], env=env,
                       check=True, capture_output=True)
    logged = cgn.read_log(path)
    assert list(logged) == [0, 1, 2, 3, 4]
    old = {step for step, _, _ in logged.superseded_records()}
    assert set(range(2, last + 1)) <= old <= set(range(2, last + 2))
    every = cgn.to_frame(path, superseded=True)
    a = every[every.statistic == "a"]
    assert (a.value.to_numpy() == a.step.to_numpy()).all()
    assert set(every[every.superseded].step) == old


@pytest.fixture()
def resumed_logs(tmp_path):
    """A log written in two runs, and one restarted from an earlier step."""
    steps = list(STEPS)
    whole = write_log(tmp_path / "run.jsonl", steps[:60])
    write_log(whole, steps[60:])
    restarted = write_log(tmp_path / "restarted.jsonl", steps[:80])
    write_log(restarted, steps[60:])
    return whole, restarted


def test_report_and_plot_of_a_resumed_log_take_the_fast_path(resumed_logs, tmp_path):
    for path in resumed_logs:
        assert sources.streamed_rows(path, view_rows.plot_rows) is not None
        assert picture(path) == picture(cgn.to_frame(path))
        assert cgn.report(path) == cgn.report(cgn.to_frame(path)).replace(
            "cockpit-gradnoise report: DataFrame", f"cockpit-gradnoise report: {path}", 1)
    whole = resumed_logs[0]  # its summary read back and rewritten whole: no pandas
    found = subprocess.run([sys.executable, "-c", _IMPORTS, str(whole), str(tmp_path / "a.png")],
                           capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert found.stdout.split()[-1] == "False"
    assert index_log(whole).summary is not None


def test_the_tracker_continues_its_streamed_log(tmp_path):
    from tests.test_log import tracked_run

    tracked_run(tmp_path / "run.jsonl", steps=4)[0].close()
    tracker, _ = tracked_run(tmp_path / "run.jsonl", steps=6)  # a restart from step 0
    tracker.close()
    assert Path(tmp_path / "run.jsonl").read_text().count('{"superseded": 0}') == 1
    every = cgn.to_frame(tmp_path / "run.jsonl", superseded=True)
    assert every.superseded.any() and not cgn.to_frame(tmp_path / "run.jsonl").empty
