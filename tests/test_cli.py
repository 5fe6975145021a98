"""The command line, run as the installed ``cockpit-gradnoise`` script.

The subprocess cases (both commands and three kinds of bad log) run
concurrently in one fixture; the other cases call the same ``cli.main``
in-process. Subprocesses import the package from this checkout
(``PYTHONPATH``), which an editable install of another checkout would
otherwise shadow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise import cli  # noqa: E402
from cockpit_gradnoise.views.findings import (  # noqa: E402
    COLUMNS,
    THRESHOLDS,
    noise_scale_finding,
    norm_ratio_findings,
    outlier_findings,
    snr_findings,
    update_size_findings,
    zero_grad_findings,
)
from cockpit_gradnoise.views.report import build_report

import pytest  # noqa: E402

from tests.figures import DIGITS_BATCH_SIZE, digits_run  # noqa: E402

SCRIPT = Path(sys.executable).parent / "cockpit-gradnoise"
ROOT = Path(__file__).resolve().parent.parent
#: The environment of the subprocesses: this checkout's package, no display.
ENV = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


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


#: Modules that make start-up slow; the report and --help import none of them
#: (importlib.metadata: 60 ms, for the package's version).
HEAVY = ("torch", "cockpit", "backpack", "matplotlib", "seaborn", "importlib.metadata")
#: Runs the command line in-process, then prints the heavy modules it imported.
IMPORTS = (
    "import sys\n"
    "from cockpit_gradnoise.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as exit_:\n"
    "    code = exit_.code\n"
    "print('exit', code, 'imported', sorted(m for m in {modules!r} if m in sys.modules))\n"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, log, bad_logs):
    """Every subprocess case, started at once; ``{case: CompletedProcess-like}``."""
    out = tmp_path_factory.mktemp("cli")
    assert SCRIPT.exists(), f"{SCRIPT} missing: run `.venv/bin/pip install -e .`"
    script = [str(SCRIPT)]
    cases = {
        "plot": [*script, "plot", str(log), "-o", str(out / "sub" / "dashboard.png"),
                 "--batch-size", str(DIGITS_BATCH_SIZE)],
        "report": [*script, "report", str(log), "--batch-size", str(DIGITS_BATCH_SIZE)],
        "missing": [*script, "report", str(out / "missing.json")],
        "truncated": [*script, "plot", str(bad_logs / "truncated.json"), "-o",
                      str(out / "t.png")],
        "cockpit-only": [*script, "report", str(bad_logs / "cockpit-only.json")],
        "report-imports": [sys.executable, "-c", IMPORTS.format(modules=HEAVY), "report",
                           str(log)],
        "help-imports": [sys.executable, "-c", IMPORTS.format(modules=(*HEAVY, "pandas")),
                         "--help"],
    }
    processes = {
        case: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV)
        for case, argv in cases.items()
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


def test_plot_writes_the_dashboard_creating_its_folder_and_saying_so(runs):
    result = runs["plot"]
    assert result.returncode == 0, result.stderr
    image = runs["out"] / "sub" / "dashboard.png"
    assert image.read_bytes()[:4] == b"\x89PNG" and image.stat().st_size > 50_000
    assert str(image) in result.stdout
    assert result.stderr == f"cockpit-gradnoise plot: created folder {image.parent}\n"


@pytest.mark.parametrize("case", ["report-imports", "help-imports"])
def test_report_and_help_import_neither_torch_nor_cockpit_nor_matplotlib(runs, case):
    """Start-up time: --help imports not even pandas, a report no plotting library."""
    result = runs[case]
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "exit 0 imported []"
    assert ("findings:" in result.stdout) == (case == "report-imports")


def test_report_prints_what_the_main_job_wrote(runs, log):
    result = runs["report"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == (log.parent / "digits_report.txt").read_text()
    table, findings = result.stdout.split("findings:\n")
    for column in COLUMNS:
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
        str(log), "unknown layers ['fc9.weight']: choose from 0.weight, 0.bias",
    )
    assert_one_line_error(run_main(capsys, "report", log, "--step", -1), str(log),
                          "no tracked step at or before step -1: the first is 0 (")
    assert_one_line_error(run_main(capsys, "plot", log, "-o", tmp_path / "x.xyz"), "x.xyz",
                          "unknown image format 'xyz'")


def test_a_step_after_the_last_is_refused_naming_the_last(capsys, log):
    steps = sorted(cgn.to_frame(log).step.unique())
    result = run_main(capsys, "report", log, "--step", steps[-1] + 1)
    assert_one_line_error(
        result, str(log), f"no tracked step {steps[-1] + 1}: the log ends at step {steps[-1]} "
        f"({len(steps)} tracked steps: {steps[0]}, {steps[1]}, {steps[2]}, ..., "
        f"{steps[-2]}, {steps[-1]})")
    assert run_main(capsys, "report", log, "--step", steps[-1]).returncode == 0


def test_plot_into_an_existing_folder_says_nothing_on_stderr(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({str(step): {"ParamGradRatio": {
        "w": {"norm_ratio": 3.0 + step}, cgn.NETWORK: {"norm_ratio": 2.0}}} for step in (0, 1)}))
    result = run_main(capsys, "plot", path, "-o", tmp_path / "x.png")
    assert result.returncode == 0 and result.stderr == ""
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_csv_is_the_table_at_the_chosen_step(capsys, log):
    from io import StringIO

    import pandas

    result = run_main(capsys, "report", log, "--format", "csv", "--step", 5)
    assert result.returncode == 0
    table = pandas.read_csv(StringIO(result.stdout), index_col="param")
    frame = cgn.to_frame(log)
    at_4 = frame[(frame.step == 4) & (frame.quantity == "GradientVarianceQuantiles")
                 & (frame.statistic == "q0.5")].set_index("param").value
    assert list(table.columns) == ["step", *COLUMNS]
    assert (table.step == 4).all()  # the latest tracked step at or before 5
    pandas.testing.assert_series_equal(table.sd_median, at_4.reindex(table.index),
                                       check_names=False)
    assert "findings" not in result.stdout


def test_json_is_the_table_with_encoded_non_finite_numbers(capsys, log):
    result = run_main(capsys, "report", log, "--format", "json")
    data = json.loads(result.stdout)
    assert data["step"] == cgn.to_frame(log).step.max() and data["batch_size"] == DIGITS_BATCH_SIZE
    assert [row["param"] for row in data["layers"]][-1] == cgn.NETWORK
    assert set(data["layers"][0]) == {"param", *COLUMNS}
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


# The report's findings, from tables built by hand ------------------------------------


def table(**columns):
    """A report table: ``columns`` maps a column to ``{param: value}``; NaN elsewhere."""
    import pandas

    params = list(dict.fromkeys(p for values in columns.values() for p in values
                                if p != cgn.NETWORK)) + [cgn.NETWORK]
    frame = pandas.DataFrame(index=pandas.Index(params, name="param"),
                             columns=list(COLUMNS), dtype=float)
    for column, values in columns.items():
        for param, value in values.items():
            frame.loc[param, column] = value
    return frame


def noise(batch_size, smoothed, raw=float("nan")):
    return noise_scale_finding(
        table(b_simple_smoothed={cgn.NETWORK: smoothed}, b_simple={cgn.NETWORK: raw}),
        batch_size,
    )


def test_batch_below_above_and_close_to_the_noise_scale():
    # steps ~ 1 + B_noise / B: doubling 32 -> 64 at B_noise 410 saves
    # 1 - (1 + 410/64) / (1 + 410/32) = 46.4%.
    (line,) = noise(32, 410.0)
    assert line.startswith("batch 32 is below the estimated noise scale 410: larger batches "
                           "would cut steps almost linearly (doubling it to 64 takes 46% fewer")
    assert line.endswith("(b_simple_smoothed of all)")
    (line,) = noise(512, 60.0)  # 1 - (1 + 60/1024) / (1 + 60/512) = 5.2%
    assert "batch 512 is above the estimated noise scale 60" in line and "5% fewer" in line
    assert "is close to" in noise(32, 40.0)[0]
    assert "is below" in noise(32, 64.0)[0] and "is above" in noise(64, 32.0)[0]  # factor 2
    assert "is close to" in noise(32, 63.9)[0] and "is close to" in noise(63, 32.0)[0]


def test_noise_scale_without_a_batch_size_infinite_or_only_raw():
    assert "pass the batch size (--batch-size)" in noise(None, 410.0)[0]
    assert "the noise scale estimate is infinite" in noise(32, float("inf"))[0]
    (line,) = noise(32, float("nan"), raw=410.0)
    assert "below the estimated noise scale 410" in line and line.endswith("(b_simple of all)")
    assert noise(32, float("nan")) == []


def test_relative_updates_far_from_the_usual_size_farthest_first():
    lines = update_size_findings(table(relative_update={
        "a": 0.03, "b": 5e-6, "c": 1e-3, "d": 0.0, "e": 0.0101, "f": 9.9e-3, cgn.NETWORK: 0.5,
    }))
    assert lines == [
        "layer d updates 0 of its norm per step, it does not move (relative_update)",
        "layer b updates 5e-6 of its norm per step, 1/200 of the usual 1e-3: it barely moves "
        "(relative_update)",
        "layer a updates 3e-2 of its norm per step, 30x the usual 1e-3 (relative_update)",
        "layer e updates 1e-2 of its norm per step, 10x the usual 1e-3 (relative_update)",
    ]


def test_many_findings_of_one_kind_are_counted_after_five():
    lines = update_size_findings(
        table(relative_update={f"layer{i}": 0.05 + i * 0.01 for i in range(8)}))
    assert len(lines) == 6 and lines[-1] == "... and 3 more layers outside [1e-4, 1e-2]"


def test_snr_zero_gradients_norm_ratio_spread_and_outliers():
    (line,) = snr_findings(table(snr_median={"a": 0.3, "b": 2.0, "c": 0.9,
                                                    cgn.NETWORK: 1.2}))
    assert line.startswith("median signal-to-noise below 1 in 2 of 3 layers (a 0.3, c 0.9)")
    assert zero_grad_findings(table(zero_grad_fraction={"a": 0.8, "b": 0.49})) == [
        "layer a: 80% of its gradient elements are exactly zero (dead units or unused "
        "inputs?) (zero_grad_fraction)"
    ]
    (spread,) = norm_ratio_findings(table(norm_ratio={"a": 2.0, "b": 300.0, "c": 50.0}))
    assert spread.startswith("||theta||/||grad|| spans 150x across layers (a 2 to b 300)")
    assert norm_ratio_findings(table(norm_ratio={"a": 2.0, "b": 199.0})) == []
    (outlier,) = outlier_findings(table(norm_max={cgn.NETWORK: 12.0},
                                               norm_median={cgn.NETWORK: 1.0}))
    assert "12 is 12x the median 1" in outlier
    assert outlier_findings(table(norm_max={cgn.NETWORK: 9.9},
                                         norm_median={cgn.NETWORK: 1.0})) == []


def test_thresholds_are_one_object_that_findings_and_the_docs_follow():
    from dataclasses import asdict, replace

    quiet = table(snr_median={"a": 0.6, cgn.NETWORK: 0.6})
    assert len(snr_findings(quiet)) == 1
    assert snr_findings(quiet, replace(THRESHOLDS, low_snr=0.5)) == []
    docs = (Path(__file__).resolve().parent.parent / "docs" / "dashboard.md").read_text()
    for name, value in asdict(THRESHOLDS).items():
        assert f"| `{name}` | {value:g} |" in docs


def test_every_finding_names_the_columns_it_comes_from(log):
    built = build_report(cgn.to_frame(log), batch_size=DIGITS_BATCH_SIZE)
    assert built.findings
    for line in built.findings:
        if not line.startswith("... and"):
            assert any(f"({column}" in line or f", {column}" in line for column in COLUMNS)


# Edges: encodings, image sizes -----------------------------------------------


def test_a_file_that_is_not_utf8_is_named(capsys, tmp_path):
    (tmp_path / "binary.json").write_bytes(b'{"0": \xff\xfe}')
    for command in (["report"], ["plot", "-o", tmp_path / "x.png"]):
        result = run_main(capsys, command[0], tmp_path / "binary.json", *command[1:])
        assert_one_line_error(result, f"{tmp_path / 'binary.json'}: not a text file (invalid "
                              "start byte at byte 6)")


def test_a_dpi_or_image_too_large_is_one_line(capsys, log, tmp_path):
    image = tmp_path / "x.png"
    assert_one_line_error(run_main(capsys, "plot", log, "-o", image, "--dpi", "100000"),
                          "--dpi 100000: use 1 to 1200")
    # Allowed, but the dashboard at 1100 dpi would be over 100 megapixels.
    result = run_main(capsys, "plot", log, "-o", image, "--dpi", "1100")
    assert_one_line_error(result, "--dpi 1100: the image would be 14300 x ", "megapixels",
                          "use a lower dpi (at most ")
    assert not image.exists()
