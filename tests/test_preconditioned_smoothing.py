"""PreconditionedNoiseScale's ``b_simple_smoothed``: moving averages of scale-free values.

Each step's ``grad_sq`` and ``trace_cov`` are divided by that step's ``S = grad_sq +
trace_cov`` (the mean per-example squared norm) before they are averaged, so a step whose
preconditioner ``P`` makes its numbers 1e5 larger weighs as much as any other.
Checked against a brute force: the explicit weighted sums of the moving averages.
"""

import math
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.functional import scale_free_smoothed_noise_scale
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities.gradient_noise_scale import smoothed_noise_scale

import numpy
import pytest
import torch

EPS64 = numpy.finfo(numpy.float64).eps
SMOOTHING = 0.9
QUANTITY = "PreconditionedNoiseScale"

#: (grad_sq, trace_cov, N) of five steps. Step 0 is in units 1e5 larger (Adam's first
#: steps: P = 1/(|g| + eps) before v fills), with a negative grad_sq, as measured on the
#: experiment's GPT (-2.8e9 at step 0, 2.3e4 at step 5); every later step resolves a signal.
SERIES = [(-2.8e9, 4.0e11, 8), (2.3e4, 3.1e5, 8), (1.9e4, 4.4e5, 8), (2.6e4, 2.9e5, 16),
          (2.1e4, 5.0e5, 16)]


def brute_force(series, smoothing=SMOOTHING):
    """``sum_k w_k tc_k / S_k`` over ``sum_k w_k gs_k / S_k`` with the explicit weights
    ``w_k = smoothing^(t - k)`` of the bias-corrected moving average (normalized or not:
    the ratio is the same) over the kept steps, ``S_k = gs_k + tc_k``."""
    kept = [(g, c, n) for g, c, n in series
            if math.isfinite(g) and math.isfinite(c) and g + c > 0]
    t = len(kept) - 1
    weights = [smoothing**(t - k) for k in range(t + 1)]
    numerator = sum(w * c / (g + c) for w, (g, c, _) in zip(weights, kept))
    denominator = sum(w * g / (g + c) for w, (g, c, _) in zip(weights, kept))
    return numerator / denominator if denominator > 0 else math.inf


def smoothed_series(series, smoothing=SMOOTHING):
    averages, values = None, []
    for grad_sq, trace_cov, _ in series:
        averages, value = scale_free_smoothed_noise_scale(averages, grad_sq, trace_cov,
                                                          smoothing)
        values.append(value)
    return values


#: Relative rounding of a smoothed value of t steps: per step two divisions by S (and S's
#: addition, which does not cancel in the weighting), per average step two roundings,
#: the final ratio one; on both sides. Every term is >= 0 in the numerator; the
#: denominator's terms of mixed sign are why its bound is relative to the sum of |terms|.
def tolerance(series):
    return 2 * (6 * len(series) + 1) * EPS64


def test_each_step_weighs_the_same_whatever_its_units():
    got = smoothed_series(SERIES)
    for t in range(len(SERIES)):
        assert got[t] == pytest.approx(brute_force(SERIES[:t + 1]), rel=tolerance(SERIES[:t + 1]))
    # Step 0 alone resolves no signal (inf); its share of the signal, grad_sq / S =
    # -2.8e9 / 3.97e11 ~ -0.007, then counts as one step's against step 1's 0.07, not as
    # 1e5 steps' (the per-step b_simple are 13.5, 23.2, 11.2, 23.8 from step 1).
    assert got[0] == math.inf
    assert all(math.isfinite(value) and 10 < value < 40 for value in got[1:])


def test_the_raw_moving_averages_stay_infinite_for_the_same_series():
    """Why the change: the raw averages keep step 0's -2.8e9 against ~2e4 a step."""
    averages, raw = {}, []
    for grad_sq, trace_cov, _ in SERIES:
        raw.append(smoothed_noise_scale(averages, "all", trace_cov, grad_sq, SMOOTHING))
    assert raw == [math.inf] * len(SERIES)
    assert smoothed_series(SERIES)[-1] != pytest.approx(raw[-1])


def test_a_constant_factor_on_one_step_changes_nothing():
    for step, factor in [(0, 1e-5), (2, 1e5), (4, 3.0)]:
        scaled = [(g * factor, c * factor, n) if k == step else (g, c, n)
                  for k, (g, c, n) in enumerate(SERIES)]
        assert smoothed_series(scaled) == pytest.approx(smoothed_series(SERIES),
                                                        rel=2 * tolerance(SERIES))


def test_in_constant_units_it_is_the_ratio_of_the_raw_weighted_sums():
    """With the same S every step, dividing by it changes no weight (P = I's case)."""
    equal = [(4.0, 36.0, 8), (2.5, 37.5, 8), (3.0, 37.0, 8)]  # S = 40 each
    for t in range(len(equal)):
        weights = [SMOOTHING**(t - k) for k in range(t + 1)]
        raw = (sum(w * c for w, (_, c, _) in zip(weights, equal)) /
               sum(w * g for w, (g, _, _) in zip(weights, equal)))
        assert smoothed_series(equal)[t] == pytest.approx(raw, rel=tolerance(equal[:t + 1]))


@pytest.mark.parametrize("bad", [(math.nan, 1.0, 8), (1.0, math.inf, 8), (0.0, 0.0, 8),
                                 (-2e-18, 1e-18, 4)])  # the last: S = -1e-18, rounding below 0
def test_a_non_finite_step_or_one_with_a_zero_batch_gradient_is_skipped(bad):
    series = SERIES[:2] + [bad] + SERIES[2:]
    got = smoothed_series(series)
    assert math.isnan(got[2])
    expected = smoothed_series(SERIES)
    assert got[:2] + got[3:] == expected  # the same arithmetic: exactly equal
    averages, value = scale_free_smoothed_noise_scale(None, *bad[:2], SMOOTHING)
    assert averages is None and math.isnan(value)


def test_no_signal_resolved_on_average_is_infinite():
    series = [(2.0, 10.0, 8), (-6.0, 48.0, 8), (-6.0, 48.0, 8)]  # grad_sq / S: 1/6, -1/7, -1/7
    got = smoothed_series(series, smoothing=0.5)
    assert math.isfinite(got[0]) and got[1:] == [math.inf, math.inf]
    assert got == [pytest.approx(brute_force(series[:t + 1], 0.5)) for t in range(3)]


# Through the quantity -------------------------------------------------------------------


def run(steps=4, quantities=(QUANTITY,)):
    """A tiny MLP under Adam whose first layer sees only zeros: its weight's gradient,
    preconditioned, is 0 (S = 0) at every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    inputs, targets = torch.zeros(6, 3), torch.tensor([0, 0, 0, 0, 0, 1])  # a signal
    model, tracker = cgn.track(model, every=1, quantities=list(quantities))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.9), eps=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            optimizer.zero_grad()
            losses = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
            with tracker(step, losses, optimizer=optimizer) as loss:
                loss.backward()
            optimizer.step()
    return tracker, [str(w.message) for w in caught]


def test_the_quantity_logs_the_function_s_value_and_warns_once_for_a_zero_gradient():
    tracker, messages = run()
    frame = cgn.to_frame(tracker.cockpit)
    frame = frame[frame.quantity == QUANTITY]
    for param, rows in frame.groupby("param"):
        table = rows.pivot(index="step", columns="statistic", values="value").sort_index()
        series = list(zip(table[schema.GRAD_SQ], table[schema.TRACE_COV],
                          table[schema.BATCH_SIZE]))
        for t, got in enumerate(table[schema.B_SIMPLE_SMOOTHED]):
            expected = brute_force(series[:t + 1]) if any(
                g + c > 0 for g, c, _ in series[:t + 1]) else math.nan
            assert got == pytest.approx(expected, rel=tolerance(series), nan_ok=True), param
    zero = frame[(frame.param == "0.weight") & (frame.statistic == schema.B_SIMPLE_SMOOTHED)]
    assert len(zero) == 4 and zero.value.isna().all()
    assert frame[(frame.param == schema.NETWORK) &
                 (frame.statistic == schema.B_SIMPLE_SMOOTHED)].value.notna().all()
    warned = [m for m in messages if "preconditioned gradient of '0.weight' is 0" in m]
    assert len(warned) == 1


def test_the_advice_reads_the_newest_smoothed_value():
    tracker, _ = run(quantities=("GradientNoiseScale", QUANTITY))  # advice needs one of the 5
    frame = cgn.to_frame(tracker.cockpit)
    smoothed = frame[(frame.quantity == QUANTITY) & (frame.param == schema.NETWORK) &
                     (frame.statistic == schema.B_SIMPLE_SMOOTHED)].sort_values("step")
    advice = tracker.advice()
    assert advice.source == QUANTITY and advice.step == smoothed.step.iloc[-1]
    assert advice.recommendation.noise_scale == smoothed.value.iloc[-1]
