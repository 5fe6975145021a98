"""Streamed logs: round trip, kill -9, flat memory, old logs, stale temporary files."""

import math
import os
import signal
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import cockpit_gradnoise as cgn
from cockpit_gradnoise import cli
from cockpit_gradnoise.logs import stream as log
from cockpit_gradnoise.logs.frame import STALE_SECONDS, LoggedUpdate, remove_stale_temporaries
from cockpit_gradnoise.logs.table import COLUMNS
from cockpit_gradnoise.quantities.presets import ALL

import numpy
import pandas
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "logs"
SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308, 0.1]


def cockpit_like(*names):
    """An object with a Cockpit's ``output`` and ``quantities`` (named ``names``), no torch."""
    quantities = [type(name, (), {})() for name in names]
    for quantity in quantities:
        quantity.output = defaultdict(dict)
    return SimpleNamespace(quantities=quantities, output=defaultdict(dict))


def special_outputs(step):
    """Outputs as the quantities store them, every awkward float included (encoded as they are)."""
    row = {f"s{i}": cgn.schema.encode_float(x * (step + 1)) for i, x in enumerate(SPECIAL)}
    return {
        "GradientNoiseScale": {"w": row, "b": dict(reversed(row.items())), cgn.NETWORK: row},
        "UpdateSize": [LoggedUpdate("w", 0.5 * step, 2.0), LoggedUpdate("b", 1.0, 0.0)],
        "GradNorm": [1.0, float("nan"), numpy.float32(2.5)],  # Cockpit's own: not per parameter
    }


def bits(frame):
    return frame.value.to_numpy().view(numpy.int64)


def test_streamed_frame_equals_the_in_memory_frame_bit_for_bit(tmp_path):
    cockpit = cockpit_like("GradientNoiseScale", "UpdateSize", "GradNorm")
    kept = {}
    with cgn.LogStream(tmp_path / "run") as stream:
        for step in [0, 3, 4, 10]:
            for quantity in cockpit.quantities:
                value = special_outputs(step)[type(quantity).__name__]
                quantity.output[step] = value
                kept.setdefault(step, {})[type(quantity).__name__] = value
            cockpit.output[step]["train_loss"] = 1.5  # Cockpit.log's
            kept[step]["train_loss"] = 1.5
            assert stream.append(cockpit) == 4
            assert not any(q.output for q in cockpit.quantities) and not cockpit.output
    assert stream.path == tmp_path / "run.jsonl"
    expected = cgn.to_frame(kept)
    streamed = cgn.to_frame(tmp_path / "run")  # the suffix found
    assert streamed.equals(expected) and (bits(streamed) == bits(expected)).all()
    assert streamed.value.isna().sum() == 12 and numpy.signbit(streamed.value).any()
    logged = cgn.read_log(stream.path)
    assert list(logged) == [0, 3, 4, 10]
    assert logged[3]["train_loss"] == 1.5 and logged[3]["GradNorm"] == [1.0, "nan", 2.5]
    assert logged[4]["UpdateSize"]["w"] == {"norm": 2.0, "relative": 1.0}


def tracked_run(log_path=None, steps=6):
    """A short tracked run of all five quantities and Cockpit's GradNorm; its tracker."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model, tracker = cgn.track(model, every=2, quantities=[*ALL, "GradNorm"],
                               log=log_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    held = []
    for step in range(steps):
        x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker(step, losses, optimizer=optimizer) as loss:
                loss.backward()
        optimizer.step()
        held.append(sum(len(q.output) for q in tracker.cockpit.quantities))
    return tracker, held


def test_a_streaming_tracker_holds_no_step_and_logs_what_memory_would(tmp_path):
    in_memory, held_in_memory = tracked_run()
    streamed, held = tracked_run(tmp_path / "run.jsonl")
    assert held == [log.STEPS_IN_MEMORY] * len(held)
    assert held_in_memory[-1] > 0  # the check above can fail
    assert streamed.log == tmp_path / "run.jsonl"
    assert streamed.frame().equals(in_memory.frame())
    assert streamed.get_output()[4]["GradNorm"] == in_memory.get_output()[4]["GradNorm"]
    assert cgn.to_frame(streamed.write(tmp_path / "whole")).equals(in_memory.frame())
    with pytest.raises(ValueError, match="is the streamed log"):
        tracked_run(tmp_path / "run.json", steps=1)[0].write(tmp_path / "run")
    assert streamed.report().startswith(f"cockpit-gradnoise report: {tmp_path / 'run.jsonl'}")
    # The one-call function reads the streamed log too, not the emptied cockpit.
    body = streamed.report().split("\n", 1)[1]  # the first line names the last log written
    assert cgn.report(streamed).split("\n", 1)[1] == body


def test_explicit_cockpit_streams_and_an_existing_file_is_kept_aside_on_request(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("old content\n")
    cockpit = cockpit_like("GradientNoiseScale")
    with pytest.raises(ValueError, match="not a cockpit-gradnoise streamed log"):
        cgn.LogStream(path)  # resumed by default: this file is not a streamed log
    stream = cgn.LogStream(path, resume=False)
    assert stream.kept.read_text() == "old content\n"
    cockpit.quantities[0].output[7] = special_outputs(7)["GradientNoiseScale"]
    stream.append(cockpit)
    stream.close()
    assert stream.append(cockpit) == 0 and list(cgn.read_log(path)) == [7]


def test_a_non_integer_step_is_refused_naming_it(tmp_path):
    cockpit = cockpit_like("GradientNoiseScale")
    cockpit.quantities[0].output[2.5] = special_outputs(0)["GradientNoiseScale"]
    with cgn.LogStream(tmp_path / "run") as stream, pytest.raises(ValueError, match="2.5"):
        stream.append(cockpit)


# A writer that appends step after step until it is killed; prints each step appended.
WRITER = """
import sys
from collections import defaultdict
from types import SimpleNamespace
from cockpit_gradnoise.logs.stream import LogStream

quantity = type("GradientNoiseScale", (), {})()
quantity.output = defaultdict(dict)
cockpit = SimpleNamespace(quantities=[quantity], output=defaultdict(dict))
stream = LogStream(sys.argv[1])
step = 0
while True:
    quantity.output[step] = {f"p{i}": {"a": float(step), "b": i + 0.5} for i in range(3000)}
    stream.append(cockpit)
    print(step, flush=True)
    step += 1
"""


@pytest.mark.parametrize("delay", [0.3, 0.7])
def test_kill_9_while_streaming_leaves_a_readable_log_missing_at_most_the_last_step(tmp_path, delay):
    path = tmp_path / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "0"  # started: one step appended
        time.sleep(delay)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    reported = [int(line) for line in writer.stdout.read().split()]
    last = reported[-1] if reported else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cut last line, when the kill lands mid-write
        logged = cgn.read_log(path)
    assert list(logged) in (list(range(last + 1)), list(range(last + 2)))
    frame = cgn.to_frame(path)
    assert (frame[frame.statistic == "a"].value.to_numpy() == frame[frame.statistic == "a"].step).all()


def cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def test_a_cut_last_line_is_left_out_with_a_warning_other_damage_raises(tmp_path):
    cockpit = cockpit_like("GradientNoiseScale")
    path = tmp_path / "run.jsonl"
    with cgn.LogStream(path) as stream:
        for step in range(3):
            cockpit.quantities[0].output[step] = special_outputs(step)["GradientNoiseScale"]
            stream.append(cockpit)
    whole = path.read_bytes()
    whole = whole[:whole.rindex(b'{"layout": [], "summary"')]  # a killed writer's: no summary
    cut(path, len(whole) - 20)
    with pytest.warns(UserWarning, match="last line .* cut short"):
        assert list(cgn.read_log(path)) == [0, 1]
    lines = whole.split(b"\n")
    lines[-3] = lines[-3][:-20]  # the second record damaged, the third whole
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=f"{path}: line {len(lines) - 2}: not valid JSON"):
        cgn.read_log(path)


@pytest.mark.parametrize("damage", [
    b'{"step": 0, "quantity": 5, "layout": 0, "values": ""}\n',      # undeclared quantity
    b'{"step": 0, "quantity": 0, "layout": 0, "values": "AAAA"}\n',  # wrong count
    b'{"step": 0, "quantity": 0, "layout": 9, "values": ""}\n',      # undeclared layout
    b'{"something": 1}\n',
    b'[1, 2]\n',
])
def test_a_damaged_line_gives_the_cli_one_line_error(tmp_path, capsys, damage):
    cockpit = cockpit_like("GradientNoiseScale")
    path = tmp_path / "run.jsonl"
    with cgn.LogStream(path) as stream:
        cockpit.quantities[0].output[0] = special_outputs(0)["GradientNoiseScale"]
        stream.append(cockpit)
    damaged = len(path.read_bytes().splitlines()) + 1  # the line number of the damage
    path.write_bytes(path.read_bytes() + damage + b'{"names": {}}\n')
    assert cli.main(["report", str(path)]) == cli.EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and str(path) in error and f"line {damaged}:" in error


def expected_frame(name):
    """The frame the tracker held when the old logs in tests/data/logs were written."""
    expected = pandas.read_csv(DATA / name)
    return expected.astype({"step": "int64", "value": "float64"})


def same_rows(frame, expected):
    assert list(frame.columns) == COLUMNS and len(frame) == len(expected) > 0
    for column in COLUMNS[:4]:
        assert frame[column].astype(object).tolist() == expected[column].tolist()
    assert numpy.array_equal(frame.value, expected.value, equal_nan=True)


def test_old_json_logs_still_load():
    expected = expected_frame("frame.csv")
    same_rows(cgn.to_frame(DATA / "write_log.json"), expected)
    by_name = expected.sort_values(COLUMNS[:4], ignore_index=True)
    from_cockpit = cgn.to_frame(DATA / "cockpit_write").sort_values(COLUMNS[:4], ignore_index=True)
    same_rows(from_cockpit, by_name)


def test_frame_names_are_categorical_sorted_like_strings(tmp_path):
    frame = cgn.to_frame(DATA / "write_log.json")
    for column in COLUMNS[1:4]:
        categories = list(frame[column].cat.categories)
        assert categories == sorted(set(frame[column].astype(str)))


def dead_pid():
    """The id of a process that has ended (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def test_stale_temporary_files_are_removed_by_the_next_write(tmp_path):
    cockpit = cockpit_like("GradientNoiseScale")
    cockpit.quantities[0].output[0] = special_outputs(0)["GradientNoiseScale"]
    hex32 = "0123456789abcdef" * 2
    files = {
        "dead": tmp_path / f".run.json.{dead_pid()}.{hex32}.tmp",
        "old": tmp_path / f".run.json.{hex32}.tmp",   # an older version's name: by age
        "live": tmp_path / f".run.json.{os.getpid()}.{hex32}.tmp",
        "recent": tmp_path / f".run.json.{'f' * 32}.tmp",
        "other log": tmp_path / f".run.json.x.json.{dead_pid()}.{hex32}.tmp",
    }
    for file in files.values():
        file.write_text("partial")
    old = time.time() - STALE_SECONDS - 60
    os.utime(files["old"], (old, old))
    cgn.write_log(SimpleNamespace(get_output=lambda: {0: {"X": 1.0}}), tmp_path / "run")
    remaining = {name for name, file in files.items() if file.exists()}
    assert remaining == {"live", "recent", "other log"}
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["run.json"]
    assert remove_stale_temporaries(tmp_path / "run.json") == []


# Writes a log, but blocks inside the atomic-write window (after the temporary
# file is written, before it replaces the log).
BLOCKED_WRITER = """
import os, sys, time
from types import SimpleNamespace
import cockpit_gradnoise as cgn

def blocked(*args):
    print("in the window", flush=True)
    time.sleep(600)

os.replace = blocked
cgn.write_log(SimpleNamespace(get_output=lambda: {0: {"X": 1.0}}), sys.argv[1])
"""


def test_kill_9_inside_the_write_window_leaves_a_file_the_next_write_removes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writer = subprocess.Popen([sys.executable, "-c", BLOCKED_WRITER, str(tmp_path / "run")],
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "in the window"
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    left = list(tmp_path.glob(".run.json.*.tmp"))
    assert len(left) == 1 and not (tmp_path / "run.json").exists()
    cgn.write_log(SimpleNamespace(get_output=lambda: {1: {"X": 2.0}}), tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_read_errors_name_the_file_also_without_suffix_or_for_binary(tmp_path):
    (tmp_path / "RUN.JSON").write_bytes((DATA / "write_log.json").read_bytes())
    assert list(cgn.read_log(tmp_path / "RUN.JSON")) == [0, 2, 4]  # as given, not RUN.JSON.json
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=f"{tmp_path / 'binary.json'}: not a text file"):
        cgn.read_log(tmp_path / "binary")
