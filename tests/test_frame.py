"""to_frame, logs and their round trip, including NaN and inf."""

import json
import math
import subprocess
import sys

import pandas
import pytest
from cockpit.utils.schedules import linear

import cockpit_gradnoise as cgn
from cockpit_gradnoise.frame import decode_float, encode_float
from tests.cases import MODELS, build, run_step


@pytest.fixture
def tracked():
    problem = build(MODELS[2], 7, "mean")
    quantities = [
        cgn.GradientVarianceQuantiles(linear(2), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(2), param_names=problem.names),
    ]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    for step in range(5):
        run_step(problem, quantities, step=step, cockpit=cockpit)
    return cockpit


def test_frame_columns_and_names(tracked):
    frame = cgn.to_frame(tracked)
    assert list(frame.columns) == ["step", "quantity", "param", "statistic", "value"]
    assert frame.step.dtype == "int64" and frame.value.dtype == "float64"
    assert sorted(set(frame.step)) == [0, 2, 4]
    assert {"q0.05", "q0.5", "q0.95", "mean", "snr_q0.5", "snr_mean"} <= set(
        frame[frame.quantity == "GradientVarianceQuantiles"].statistic
    )
    per_step = frame.groupby(["step", "quantity", "param", "statistic"]).size()
    assert (per_step == 1).all()


@pytest.mark.parametrize("suffix", ["", ".json"])
def test_live_and_logged_frames_are_identical(tracked, tmp_path, suffix):
    live = cgn.to_frame(tracked)
    tracked.write(str(tmp_path / "cockpit"))
    cgn.write_log(tracked, tmp_path / "ours")
    assert cgn.to_frame(str(tmp_path / "cockpit") + suffix).equals(live)
    assert cgn.to_frame(str(tmp_path / "ours") + suffix).equals(live)


@pytest.mark.parametrize("value", [1.5, 0.0, -2.0, math.inf, -math.inf])
def test_encode_decode_round_trip(value):
    assert decode_float(encode_float(value)) == value
    assert math.isnan(decode_float(encode_float(math.nan)))
    json.dumps(encode_float(value), allow_nan=False)


def test_write_log_leaves_previous_log_intact_on_failure(tracked, tmp_path):
    path = cgn.write_log(tracked, tmp_path / "run")
    before = path.read_text()
    tracked.quantities[0].output[99] = {"p": {"s": object()}}  # not serializable
    with pytest.raises(Exception):
        cgn.write_log(tracked, tmp_path / "run")
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_write_log_encodes_non_finite_values_anywhere(tracked, tmp_path):
    tracked.quantities[1].output[99] = {"all": {"max": math.inf}, "x": {"mean": math.nan}}
    path = cgn.write_log(tracked, tmp_path / "run")
    json.loads(path.read_text())  # strict JSON, no bare NaN
    frame = cgn.to_frame(path)
    row = frame[(frame.step == 99)]
    assert row[row.param == "all"].value.item() == math.inf
    assert math.isnan(row[row.param == "x"].value.item())


def test_read_log_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        cgn.read_log(tmp_path / "missing")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="empty.json: the log file is empty"):
        cgn.read_log(tmp_path / "empty.json")
    (tmp_path / "cut.json").write_text('{"0": {"PerExampleGradNorm": {"all": {"max": 1.')
    with pytest.raises(ValueError, match="cut.json: not valid JSON"):
        cgn.read_log(tmp_path / "cut.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json: not a Cockpit log"):
        cgn.read_log(tmp_path / "list.json")


def test_cockpit_own_quantities_are_left_out():
    output = {0: {"Loss": 1.0, "GradNorm": [1.0, 2.0], "PerExampleGradNorm": {"all": {"max": 2.0}}}}
    frame = cgn.to_frame(output)
    assert frame.to_dict("records") == [
        {"step": 0, "quantity": "PerExampleGradNorm", "param": "all", "statistic": "max", "value": 2.0}
    ]
    assert isinstance(cgn.to_frame({}), pandas.DataFrame)


def test_import_works_without_pkg_resources():
    """setuptools >= 82 has no pkg_resources; Cockpit 1.0.2 imports it."""
    missing = subprocess.run([sys.executable, "-c", "import pkg_resources"], capture_output=True)
    assert missing.returncode != 0, "this environment must have setuptools >= 82"
    code = (
        "import sys, cockpit_gradnoise as cgn, cockpit;"
        "from cockpit_gradnoise import Cockpit;"
        "assert Cockpit is cockpit.Cockpit;"
        "assert 'pkg_resources' not in sys.modules;"
        "print(cockpit.__version__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.0.2"
