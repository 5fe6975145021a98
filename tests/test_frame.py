"""to_frame, logs and their round trip, including NaN and inf."""

import json
import math
import os
import stat
import subprocess
import sys
import types
from collections import OrderedDict

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs.frame import decode_float, encode_float
from cockpit_gradnoise.logs.schema import UPDATE_SIZE
from cockpit_gradnoise.logs.table import COLUMNS
from cockpit_gradnoise.quantities.update_size import LayerUpdate

import pandas
import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, ModelCase, build, run_step


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


def by_name(frame):
    """``frame``'s rows sorted by every key: the order a ``Cockpit.write`` log gives."""
    return frame.sort_values(COLUMNS[:4], ignore_index=True)


@pytest.mark.parametrize("suffix", ["", ".json"])
def test_live_and_logged_frames_are_identical(tracked, tmp_path, suffix):
    live = cgn.to_frame(tracked)
    tracked.write(str(tmp_path / "cockpit"))
    cgn.write_log(tracked, tmp_path / "ours")
    assert cgn.to_frame(str(tmp_path / "ours") + suffix).equals(live)
    # Cockpit.write sorts keys: the same rows, parameters and statistics by name.
    assert by_name(cgn.to_frame(str(tmp_path / "cockpit") + suffix)).equals(by_name(live))


#: Model order differs from name order: stem, layer1, head (sorted: head, layer1, stem).
NAMED = ModelCase(
    "named",
    lambda: nn.Sequential(OrderedDict(stem=nn.Linear(4, 5), act=nn.Tanh(),
                                      layer1=nn.Linear(5, 5), head=nn.Linear(5, 3))),
    lambda n: torch.randn(n, 4),
)


@pytest.fixture
def named_cockpit():
    """Every quantity on a model whose parameter names sort differently from model order."""
    problem = build(NAMED, 6, "mean")
    assert problem.names != sorted(problem.names)
    quantities = [cls(linear(1), param_names=problem.names) for cls in (
        cgn.GradientVarianceQuantiles, cgn.PerExampleGradNorm, cgn.ParamGradRatio,
        cgn.UpdateSize, cgn.GradientNoiseScale)]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    for step in range(3):
        run_step(problem, None, step, cockpit, optimizer)
        optimizer.step()
    return problem.names, cockpit


def test_frames_keep_model_order_live_and_from_write_log(named_cockpit, tmp_path):
    names, cockpit = named_cockpit
    live = cgn.to_frame(cockpit)
    logged = cgn.to_frame(cgn.write_log(cockpit, tmp_path / "run"))
    assert logged.equals(live)
    for (step, quantity), rows in live.groupby(["step", "quantity"]):
        assert list(rows.param.unique()) == names + [cgn.NETWORK], (step, quantity)
    assert list(live.step) == sorted(live.step)
    text = (tmp_path / "run.json").read_text()
    assert text.index('"stem.weight"') < text.index('"layer1.weight"') < text.index('"head.weight"')
    # Cockpit.write sorts keys by name, as documented.
    cockpit.write(str(tmp_path / "cockpit"))
    from_cockpit = cgn.to_frame(tmp_path / "cockpit.json")
    variance = from_cockpit[from_cockpit.quantity == "GradientVarianceQuantiles"]
    assert list(variance.param.unique()) == sorted(names + [cgn.NETWORK])


def test_update_size_reads_from_a_log_without_torch_as_computed(named_cockpit, tmp_path):
    """The log's items come back as LoggedUpdate (no torch) with the live statistics."""
    _, cockpit = named_cockpit
    path = cgn.write_log(cockpit, tmp_path / "run")
    outputs = cockpit.get_output()
    logged = cgn.read_log(path)
    for step in (0, 1):
        expected = LayerUpdate.statistics_of_list(outputs[step][UPDATE_SIZE])
        assert [type(item) for item in logged[step][UPDATE_SIZE]] == [cgn.logs.frame.LoggedUpdate] * 6
        assert cgn.schema.update_statistics(logged[step][UPDATE_SIZE]) == expected
    zero_start = [LayerUpdate("w", 0.5, 0.0), LayerUpdate("b", 0.0, 0.0)]
    assert cgn.schema.update_statistics(zero_start)["w"]["relative"] == math.inf


def tiny_cockpit():
    """Anything with ``get_output()`` is written like a Cockpit."""
    return types.SimpleNamespace(get_output=lambda: {0: {"PerExampleGradNorm": {
        cgn.NETWORK: {"max": 1.0}}}})


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_write_log_gives_the_permissions_of_a_new_file_under_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        plain = tmp_path / "plain.json"
        plain.write_text("{}")  # what any new file gets
        path = cgn.write_log(tiny_cockpit(), tmp_path / "run")
        assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
        path.chmod(0o640)  # replacing a log: new-file permissions again, as documented
        cgn.write_log(tiny_cockpit(), path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json", "run.json"]


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
