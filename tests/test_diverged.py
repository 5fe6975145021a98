"""A run that went NaN or inf, and a log of only a custom quantity: what report and dashboard say.

The real run: a small MLP tracked at steps 0-5, whose first weight gets a
NaN gradient at step 3 (a hook on it): from step 3 its statistics and the
network's are NaN, and after the optimizer step every layer's. The other
cases are frames built by hand, holding exactly the numbers they are about.
"""

import json
import math
import subprocess
import warnings

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise import cli  # noqa: E402
from cockpit_gradnoise.logs.schema import (  # noqa: E402
    GRADIENT_VARIANCE,
    NETWORK,
    NOISE_SCALE,
    PARAM_GRAD_RATIO,
    PER_EXAMPLE_NORM,
    UPDATE_SIZE,
)
from cockpit_gradnoise.views import panels
from cockpit_gradnoise.views.common import non_finite, non_finite_summary  # noqa: E402
from cockpit_gradnoise.views.report import build_report, format_report  # noqa: E402

import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from experiments.train_digits import make_quantities  # noqa: E402
from tests.cases import MODELS, build, run_step  # noqa: E402
from tests.figures import labelled, panel_axes  # noqa: E402
from tests.test_views import every_quantity, frame_of  # noqa: E402

NAN_STEP = 3
LINE_PANELS = (GRADIENT_VARIANCE, PER_EXAMPLE_NORM, PARAM_GRAD_RATIO, UPDATE_SIZE)


@pytest.fixture(scope="module")
def diverged_log(tmp_path_factory):
    """The log of the MLP whose first weight's gradient is NaN at step 3."""
    case = next(c for c in MODELS if c.name == "mlp")
    problem = build(case, 8, "mean", dtype=torch.float32)
    cockpit = cgn.Cockpit(problem.params, quantities=make_quantities(problem.names, 1))
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    first = problem.params[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the quantities' non-finite warnings
        for step in range(6):
            hook = first.register_hook(lambda g: g * math.nan) if step == NAN_STEP else None
            run_step(problem, None, step, cockpit, optimizer)
            if hook is not None:
                hook.remove()
            optimizer.step()
    path = tmp_path_factory.mktemp("diverged") / "run.json"
    cgn.write_log(cockpit, path)
    return path


@pytest.fixture(scope="module")
def diverged(diverged_log):
    return cgn.to_frame(diverged_log)


def test_the_report_of_a_diverged_run_says_so_first_and_shows_the_last_finite_step(diverged):
    text = format_report(build_report(diverged, source="run"))
    lines = text.splitlines()
    assert lines[1].startswith(
        "NON-FINITE: the run diverged: its statistics are NaN or inf from step 3 to the last "
        "tracked step 5 (3 of 6 tracked steps); first at step 3, in 0.weight (")
    assert lines[2].startswith("step 2 (the last tracked step without NaN or inf")
    blocks = text.split("\n\n")  # the header, the advice, the table, the findings
    assert blocks[1].startswith("advice:")
    assert "Empty DataFrame" not in text and blocks[2].splitlines()[2].startswith("0.weight")
    (noisiest,) = [line for line in lines if "noisiest layer" in line]
    assert "on average over 3 finite steps (network" in noisiest
    assert text.count("the run diverged") == 1  # not repeated among the findings


def test_at_a_non_finite_step_the_table_says_so_and_averages_count_finite_steps(diverged):
    built = build_report(diverged, step=5)
    text = format_report(built)
    assert "Empty DataFrame" not in text
    assert "(no finite number at step 5)" in text
    (noisiest,) = [f for f in built.findings if f.startswith("noisiest layer")]
    # 2.bias is finite at steps 0-3, NaN at 4 and 5.
    assert "on average over 4 finite steps (of 6 tracked)" in noisiest


def test_the_json_report_holds_where_the_run_went_non_finite(diverged):
    found = json.loads(format_report(build_report(diverged), "json"))["non_finite"]
    assert found["first_step"] == NAN_STEP and found["params"] == ["0.weight", NETWORK]
    assert found["steps"] == [3, 4, 5] and found["diverged_from"] == 3
    assert found["last_finite_step"] == 2 and found["tracked_steps"] == 6


def test_the_dashboard_marks_non_finite_steps_and_draws_the_finite_part(diverged):
    fig = cgn.plot(diverged, fig=Figure(layout="constrained"))
    assert "NaN or inf at 3 steps from step 3 (red)" in fig.get_suptitle()
    found = panel_axes(fig)
    for quantity in LINE_PANELS:
        ax = found[quantity]
        bands = [p for p in ax.patches if p.get_label() == panels.NON_FINITE_LABEL]
        assert len(bands) == 1, quantity
        left, right = bands[0].get_x(), bands[0].get_x() + bands[0].get_width()
        last = diverged[diverged.quantity == quantity].step.max()  # UpdateSize: 4
        assert 2 < left < NAN_STEP - 0.4 and right > last + 0.4, quantity
        network = labelled(ax)[NETWORK]
        assert numpy.isfinite(network.get_ydata()[:NAN_STEP]).all(), quantity
        assert ax.get_xlim()[1] >= last
    assert panels.NON_FINITE_LABEL in [t.get_text() for t in fig.legends[0].get_texts()]


def test_the_command_line_report_of_a_diverged_run(capsys, diverged_log):
    assert cli.main(["report", str(diverged_log)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("NON-FINITE: the run diverged")


# Frames built by hand ------------------------------------------------------------------


def test_the_first_layers_are_those_non_finite_at_the_first_such_step():
    values = every_quantity(["a", "b", "c"], steps=5)
    for (quantity, param, statistic), series in values.items():
        if param in ("b", "c") and quantity == PER_EXAMPLE_NORM:
            series[2] = math.inf if param == "b" else -math.inf
        if param == "c" and quantity == GRADIENT_VARIANCE:
            series[2] = math.nan
        series[3] = math.nan  # everything: then finite again at step 4
    summary = non_finite_summary(frame_of(values))
    assert (summary.first, summary.params, summary.steps) == (2, ["b", "c"], [2, 3])
    assert summary.quantities == [GRADIENT_VARIANCE, PER_EXAMPLE_NORM]
    assert summary.since is None and summary.last_finite == 4
    built = build_report(frame_of(values))
    assert built.step == 4 and not built.finite_step  # the last step is finite: reported
    assert built.findings[0].startswith(
        "statistics are NaN or inf at 2 of 5 tracked steps (2, 3); the last tracked step is "
        "finite; first at step 2, in b, c (GradientVarianceQuantiles, PerExampleGradNorm)")


def test_infinities_a_healthy_run_has_are_no_divergence():
    """+inf noise scales, trust ratios and relative updates, NaN SNR: defined values."""
    values = every_quantity(["a", "b"], steps=3)
    values[(NOISE_SCALE, "a", "b_simple")] = [math.inf] * 3
    values[(NOISE_SCALE, NETWORK, "b_simple_smoothed")] = [math.inf] * 3
    values[(PARAM_GRAD_RATIO, "b", "norm_ratio")] = [math.inf] * 3
    values[(PARAM_GRAD_RATIO, "b", "max")] = [math.inf] * 3
    values[(UPDATE_SIZE, "a", "relative")] = [math.inf] * 3
    values[(GRADIENT_VARIANCE, "b", "snr_q0.5")] = [math.nan] * 3
    frame = frame_of(values)
    assert not non_finite(frame).any() and non_finite_summary(frame) is None
    assert "NON-FINITE" not in format_report(build_report(frame))
    # The same values where they are not defined are a divergence.
    values[(GRADIENT_VARIANCE, "b", "q0.5")] = [1.0, math.inf, 1.0]
    values[(NOISE_SCALE, "a", "b_simple")] = [1.0, 1.0, math.nan]
    frame = frame_of(values)
    assert list(frame[non_finite(frame)].step) == [1, 2]


CUSTOM = {"0": {"GradientDiversity": {"w": {"diversity": 1.0}, "all": {"diversity": 2.0}},
                "Loss": 1.0},
          "5": {"GradientDiversity": {"w": {"diversity": 1.5}, "all": {"diversity": 2.5}}}}
HOLDS = "GradientDiversity (2 tracked steps: 0, 5)"


def test_a_log_of_only_a_custom_quantity_says_what_it_holds(capsys, tmp_path):
    path = tmp_path / "custom.json"
    path.write_text(json.dumps(CUSTOM))
    with pytest.raises(ValueError, match=r"none of cockpit-gradnoise's quantities .*, only "
                       + HOLDS.replace("(", r"\(").replace(")", r"\)")):
        cgn.report(path)
    for command in (["report"], ["plot", "-o", tmp_path / "x.png"]):
        code = cli.main([command[0], str(path), *map(str, command[1:])])
        captured = capsys.readouterr()
        result = subprocess.CompletedProcess(command, code, captured.out, captured.err)
        assert code == 2 and captured.out == "" and len(captured.err.splitlines()) == 1
        assert f"custom.json: holds none of cockpit-gradnoise's quantities (found: {HOLDS})" \
            in result.stderr
    (ax,) = cgn.plot(cgn.to_frame(CUSTOM), fig=Figure()).axes
    assert f"it holds {HOLDS}" in ax.texts[0].get_text()
