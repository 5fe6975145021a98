"""The command line, run as the installed ``cockpit-gradnoise`` script.

Starting Python with torch and Cockpit takes seconds of CPU, so the
subprocess cases (both commands and three kinds of bad log) run concurrently
in one fixture; the other cases call the same ``cli.main`` in-process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise import cli, report  # noqa: E402
from tests.test_panels import DIGITS_BATCH_SIZE, digits_run  # noqa: E402

SCRIPT = Path(sys.executable).parent / "cockpit-gradnoise"


@pytest.fixture(scope="module")
def log():
    return digits_run() / "digits.json"


@pytest.fixture(scope="module")
def bad_logs(tmp_path_factory, log):
    folder = tmp_path_factory.mktemp("bad")
    text = log.read_text()
    files = {
        "truncated": text[: len(text) // 2],
        "empty": "",
        "not-a-log": "[1, 2, 3]",
        "cockpit-only": json.dumps({"0": {"Loss": 2.3, "GradNorm": [0.5, 0.1]},
                                    "1": {"Loss": 2.1, "GradNorm": [0.4, 0.1]}}),
        "corrupt-values": json.dumps({"0": {"GradientNoiseScale": {"all": {"b_simple": "big"}}}}),
    }
    for name, content in files.items():
        (folder / f"{name}.json").write_text(content)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, log, bad_logs):
    """Every subprocess case, started at once; ``{case: CompletedProcess-like}``."""
    out = tmp_path_factory.mktemp("cli")
    assert SCRIPT.exists(), f"{SCRIPT} missing: run `.venv/bin/pip install -e .`"
    cases = {
        "plot": ["plot", str(log), "-o", str(out / "sub" / "dashboard.png"),
                 "--batch-size", str(DIGITS_BATCH_SIZE)],
        "report": ["report", str(log), "--batch-size", str(DIGITS_BATCH_SIZE)],
        "missing": ["report", str(out / "missing.json")],
        "truncated": ["plot", str(bad_logs / "truncated.json"), "-o", str(out / "t.png")],
        "cockpit-only": ["report", str(bad_logs / "cockpit-only.json")],
    }
    processes = {
        case: subprocess.Popen([str(SCRIPT), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"})
        for case, args in cases.items()
    }
    results = {}
    for case, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        results[case] = subprocess.CompletedProcess(cases[case], process.returncode, stdout,
                                                    stderr)
    results["out"] = out
    return results


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_names_both_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: cockpit-gradnoise")
    assert "plot" in text and "report" in text


def test_plot_writes_the_dashboard(runs):
    result = runs["plot"]
    assert result.returncode == 0, result.stderr
    image = runs["out"] / "sub" / "dashboard.png"
    assert image.read_bytes()[:4] == b"\x89PNG" and image.stat().st_size > 50_000
    assert str(image) in result.stdout


def test_report_prints_what_the_main_job_wrote(runs, log):
    result = runs["report"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == (log.parent / "digits_report.txt").read_text()
    table, findings = result.stdout.split("findings:\n")
    for column in report.COLUMNS:
        assert column in table
    assert findings.startswith(f"- batch {DIGITS_BATCH_SIZE} ")


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("missing", ["missing.json", "no such log file"]),
        ("truncated", ["truncated.json", "not valid JSON"]),
        ("cockpit-only", ["cockpit-only.json", "none of cockpit-gradnoise's quantities",
                          "found: GradNorm, Loss"]),
    ],
)
def test_bad_logs_end_in_one_line_and_exit_code_2(runs, case, fragments):
    assert_one_line_error(runs[case], *fragments)


# In-process: the same main() the script calls ---------------------------------------


def run_main(capsys, *args):
    code = cli.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("empty", "the log file is empty"),
        ("not-a-log", "not a Cockpit log"),
        ("corrupt-values", "not a cockpit-gradnoise log (not an encoded number: 'big')"),
    ],
)
def test_other_bad_files(capsys, bad_logs, name, fragment):
    for command in (["report"], ["plot", "-o", bad_logs / "x.png"]):
        result = run_main(capsys, command[0], bad_logs / f"{name}.json", *command[1:])
        assert_one_line_error(result, f"{name}.json", fragment)


def test_a_folder_instead_of_a_file(capsys, tmp_path):
    (tmp_path / "run.json").mkdir()
    assert_one_line_error(run_main(capsys, "report", tmp_path / "run.json"), "run.json",
                          "cannot read")


def test_unknown_layers_steps_and_image_formats(capsys, log, tmp_path):
    assert_one_line_error(
        run_main(capsys, "plot", log, "-o", tmp_path / "x.png", "--layers", "fc9.weight"),
        str(log), "unknown layers ['fc9.weight']: choose from 0.bias",
    )
    assert_one_line_error(run_main(capsys, "report", log, "--step", -1), str(log),
                          "no tracked step at or before step -1")
    assert_one_line_error(run_main(capsys, "plot", log, "-o", tmp_path / "x.xyz"), "x.xyz",
                          "unknown image format 'xyz'")


def test_csv_is_the_table_at_the_chosen_step(capsys, log):
    import pandas
    from io import StringIO

    result = run_main(capsys, "report", log, "--format", "csv", "--step", 5)
    assert result.returncode == 0
    table = pandas.read_csv(StringIO(result.stdout), index_col="param")
    frame = cgn.to_frame(log)
    at_4 = frame[(frame.step == 4) & (frame.quantity == "GradientVarianceQuantiles")
                 & (frame.statistic == "q0.5")].set_index("param").value
    assert list(table.columns) == ["step", *report.COLUMNS]
    assert (table.step == 4).all()  # the latest tracked step at or before 5
    pandas.testing.assert_series_equal(table.sd_median, at_4.reindex(table.index),
                                       check_names=False)
    assert "findings" not in result.stdout


def test_json_is_the_table_with_encoded_non_finite_numbers(capsys, log):
    result = run_main(capsys, "report", log, "--format", "json")
    data = json.loads(result.stdout)
    assert data["step"] == cgn.to_frame(log).step.max() and data["batch_size"] is None
    assert [row["param"] for row in data["layers"]][-1] == cgn.NETWORK
    assert set(data["layers"][0]) == {"param", *report.COLUMNS}
    values = [v for row in data["layers"] for k, v in row.items() if k != "param"]
    assert all(isinstance(v, float) or v in ("nan", "inf", "-inf") for v in values)
    assert "findings" not in result.stdout


def test_every_option_is_described_in_the_help():
    main_parser = cli.parser()
    commands = next(a for a in main_parser._actions if a.dest == "command").choices
    assert set(commands) == {"plot", "report"}
    for name, sub in commands.items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            for option in action.option_strings:
                assert option in text
    assert "--batch-size" in commands["report"].format_help()
