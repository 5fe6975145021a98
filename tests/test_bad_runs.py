"""The report's findings about a whole run, on the logs of experiments/bad_runs.py.

``tests/data/bad_runs/`` holds the report's statistics of the three runs of
seed 0 (``PYTHONPATH=. python -m experiments.bad_runs --test-data
tests/data/bad_runs`` writes them): a healthy run, a learning rate ten times
too large and a batch of 4. Both bad runs end with every ReLU dead; the
findings must name what killed each, and say nothing of the kind about the
healthy run.
"""

import math
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise.views.findings import run_findings, run_history
from cockpit_gradnoise.views.report import build_report

import pandas
import pytest

DATA = Path(__file__).resolve().parent / "data" / "bad_runs"

STOPPED = "training has stopped"
LR_TOO_LARGE = "the learning rate is too large"
BATCH_TOO_SMALL = "is too small for the learning rate"
NOISE_SCALE_LINE = "the estimated noise scale"


def findings(name):
    frame = pandas.read_csv(DATA / f"{name}.csv.gz")
    return build_report(frame, source=name).findings


def said(lines, phrase):
    return [line for line in lines if phrase in line]


def test_the_healthy_run_raises_no_run_finding():
    lines = findings("healthy")
    for phrase in (STOPPED, LR_TOO_LARGE, BATCH_TOO_SMALL):
        assert said(lines, phrase) == []
    assert len(said(lines, NOISE_SCALE_LINE)) == 1  # the ordinary line is still there


def test_a_learning_rate_ten_times_too_large_is_named():
    lines = findings("lr-10x")
    (stopped,) = said(lines, STOPPED)
    assert "from step 30 on, 99.9% of the network's gradient elements" in stopped
    (large,) = said(lines, LR_TOO_LARGE)
    assert "the step after step 25 moved the network by 84% of its norm" in large
    assert lines[:2] == [stopped, large]  # the diagnosis comes first
    # Not blamed on the batch; and no noise scale measured on a dead network.
    assert said(lines, BATCH_TOO_SMALL) == [] and said(lines, NOISE_SCALE_LINE) == []


def test_a_batch_of_4_is_named():
    lines = findings("batch-4")
    (stopped,) = said(lines, STOPPED)
    assert "from step 235 on" in stopped
    (small,) = said(lines, "the batch 4 is too small for the learning rate")
    assert "at most 5% of its norm" in small and "median noise scale was 13.8" in small
    assert said(lines, LR_TOO_LARGE) == [] and said(lines, NOISE_SCALE_LINE) == []


def network_frame(**series):
    """A frame of network rows: ``statistic=(quantity, {step: value})``."""
    rows = [(step, quantity, cgn.NETWORK, statistic, value)
            for statistic, (quantity, values) in series.items()
            for step, value in values.items()]
    return pandas.DataFrame(rows, columns=["step", "quantity", "param", "statistic", "value"])


def test_the_stop_is_the_last_stretch_of_dead_steps_and_only_steps_before_it_count():
    frame = network_frame(
        zero_grad_fraction=("ParamGradRatio", {0: 0.4, 1: 0.97, 2: 0.5, 3: 0.96, 4: 0.99}),
        relative=("UpdateSize", {0: 0.01, 1: 0.05, 2: 0.02, 3: 0.9}),
        b_simple=("GradientNoiseScale", {0: 3.0, 1: math.inf, 2: 5.0, 3: 1e6, 4: 1e6}),
    )
    history = run_history(frame)
    assert history.stopped_at == 3 and history.zero_grad_fraction == 0.99
    assert history.largest_update == (1, 0.05)  # step 3's 0.9 is after the stop
    assert history.noise_scale == (5.0, 0, 2)  # inf counts as the largest: median of 3, inf, 5
    (stopped, small) = run_findings(history, batch_size=4)
    assert stopped.startswith(f"{STOPPED}: from step 3 on, 99.0%")
    assert "median noise scale was 5, so the noise of a step outweighed its signal (1.2x" in small
    assert run_findings(history, batch_size=8)[1:] == []  # 5 < 8: not the batch


@pytest.mark.parametrize("last", [0.5, math.nan])
def test_a_run_that_revived_or_has_no_ratio_has_not_stopped(last):
    frame = network_frame(
        zero_grad_fraction=("ParamGradRatio", {0: 0.99, 1: last}),
        relative=("UpdateSize", {0: 0.3}),
    )
    history = run_history(frame)
    assert history.stopped_at is None
    # A large step is a finding whether or not the run stopped.
    (large,) = run_findings(history, batch_size=32)
    assert large.startswith(LR_TOO_LARGE) and "30% of its norm, 300x the usual 1e-3" in large
