"""Smoke test of benchmarks/benchmark_log.py: it runs, streams, and the command line reads its log.

Never a timed or memory-threshold assertion: those depend on the machine.
"""

import json

from cockpit_gradnoise import to_frame
from cockpit_gradnoise.logs import schema

from benchmarks import benchmark_log


def test_quick_run_streams_the_log_and_the_report_reads_it(tmp_path, capsys):
    results = benchmark_log.main(["--quick", "--no-plot", "--dir", str(tmp_path),
                                  "--json", str(tmp_path / "results.json")])
    out = capsys.readouterr().out
    assert "QUICK MODE" in out and "| cockpit-gradnoise report (1 runs) | " in out
    assert results["streamed"]["steps_held"] == results["real"]["steps_held"] == 0
    assert results["report"]["returncode"] == 0, results["report"]["error"]
    statistics = sum(map(len, benchmark_log.STATISTICS.values())) + 2  # UpdateSize: norm, relative
    frame = to_frame(tmp_path / "synthetic.jsonl")
    assert results["to_frame"]["rows"] == len(frame) == 100 * 11 * statistics
    assert sorted(frame.quantity.unique()) == sorted(schema.QUANTITIES)
    assert frame.value.isna().any() and (frame.value == float("inf")).any()
    real = to_frame(tmp_path / "real.jsonl")
    assert sorted(set(real.step)) == list(range(20))
    assert json.loads((tmp_path / "results.json").read_text())["real"]["tensors"] == 10


def test_quick_run_measures_plot_and_its_phases_on_the_same_picture(tmp_path, capsys):
    """The phases draw the dashboard the command draws (the same PNG, byte for byte), and
    matplotlib's part is the sum of its three phases."""
    results = benchmark_log.main(["--quick", "--no-to-frame", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert results["plot"]["returncode"] == 0, results["plot"]["error"]
    assert (tmp_path / "phases.png").read_bytes() == (tmp_path / "dashboard.png").read_bytes()
    phases = results["plot_phases"]
    assert all(phases[name] > 0 for name in benchmark_log.PHASES)
    assert phases[benchmark_log.MATPLOTLIB_PART] == (
        phases["matplotlib and the dashboard"] + phases["creating the artists"]
        + phases["saving the PNG"])
    assert "its phases (CPU, fewest of 1)" in out
