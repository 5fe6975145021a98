"""The adaptive batch schedule (issue 34 part 3): the rule on synthetic noise-scale series, the
learning rate by hand, bounds, state (real loops: ``test_schedule_real_loops.py``)."""

import io
import math
import warnings

from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.schedule.batch_schedule import BatchSchedule
from cockpit_gradnoise.schedule.rule import (
    AT_BOUND,
    GROW,
    HOLD,
    KEEP,
    NO_ESTIMATE,
    SHRINK,
    UNRESOLVED,
    WAIT,
    bounds_of,
    decide,
    in_run_rule,
)

import pytest
import torch

# A tracker and optimizers for the rule alone: the schedule reads only their names and numbers.


class FakeTracker:
    """What the schedule reads of a tracker: its quantities' names, ``latest``, ``record``."""

    def __init__(self, source=schema.NOISE_SCALE):
        quantity = type(source, (), {})()
        self.cockpit = type("Cockpit", (), {"quantities": [quantity]})()
        self.source, self.latest, self.recorded = source, {}, []

    def estimate(self, step, b_simple, smoothed=None):
        self.latest[self.source] = (step, {schema.B_SIMPLE: b_simple,
                                           schema.B_SIMPLE_SMOOTHED: b_simple if smoothed is None else smoothed})

    def record(self, step, quantity, statistics):
        self.recorded.append((step, quantity, dict(statistics)))


class SGD:
    def __init__(self, *lrs):
        self.param_groups = [{"lr": lr} for lr in lrs]


class AdamW(SGD):
    pass


def run(series, schedule, tracker=None, optimizer=None, start=0):
    """Feed ``(b_simple, smoothed)`` (or one number for both) one per step; the batches after each."""
    tracker = tracker or FakeTracker()
    optimizer = optimizer if optimizer is not None else SGD(0.1)
    batches = []
    for step, value in enumerate(series, start):
        b_simple, smoothed = value if isinstance(value, tuple) else (value, value)
        tracker.estimate(step, b_simple, smoothed)
        schedule.update(step, tracker, optimizer)
        batches.append(schedule.batch)
    return batches


# The rule ----------------------------------------------------------------------------


def test_bounds_from_batches_and_accumulation():
    assert bounds_of(8, 16, 100, 64) == bounds_of(8, 9, 103, 12)  # K in [2, 12]
    found = bounds_of(8, 16, 100, 64)
    assert (found.low, found.high) == (2, 12)
    assert bounds_of(8, None, 512, 16).high == 16
    with pytest.raises(ValueError, match="widen the bounds"):
        bounds_of(8, 64, 32)
    with pytest.raises(ValueError, match="give max_batch or max_accumulation"):
        bounds_of(8)
    with pytest.raises(ValueError, match="micro_batch must be a positive int"):
        bounds_of(0, max_batch=8)


def test_decide_grows_by_at_most_the_factor_and_waits_for_patience():
    bounds = bounds_of(8, max_batch=1024)
    # B_noise 64, batch 8: below the target band 2 x [32, 128] = [64, 256]: grow, by at most x2.
    assert decide(1, bounds, 64.0, [64.0] * 10) .accumulation == 2
    # Up to the band's near end 64 = 1 x B_noise; at multiple 0.5 the range's near end 32.
    assert decide(1, bounds, 64.0, [64.0] * 10, max_change=16).accumulation == 8
    assert decide(1, bounds, 64.0, [64.0] * 10, max_change=16, multiple=0.5).accumulation == 4
    assert decide(1, bounds, 64.0, [64.0] * 10, since_change=3, patience=4).why == WAIT
    assert decide(8, bounds, 64.0, [64.0] * 10).why == KEEP  # 64 is inside [64, 256]
    assert decide(1, bounds, math.nan, [64.0]).why == NO_ESTIMATE
    assert decide(1, bounds_of(8, max_batch=8), 64.0, [64.0]).why == AT_BOUND


def test_decide_shrinks_only_where_the_whole_range_lies_below_the_batch():
    bounds = bounds_of(8, max_batch=1024)
    # Batch 512, B_noise 64, quartiles of recent within [32, 128]: the band [64, 256] lies below:
    # shrink by at most 2, to 256 (batch 256 lies at the band's upper end: kept).
    found = decide(64, bounds, 64.0, [50, 60, 64, 70, 80])
    assert (found.why, found.accumulation) == (SHRINK, 32)
    assert decide(32, bounds, 64.0, [50, 60, 64, 70, 80]).why == KEEP
    # The upper quartile of the recent values, 400, puts the band's end at 800: not resolved.
    spread = [20, 64, 300, 400, 500]
    assert decide(64, bounds, 64.0, spread).why == KEEP
    assert decide(64, bounds_of(8, min_batch=512, max_batch=1024), 64.0, [64.0] * 5).why == AT_BOUND


# The schedule on synthetic series ----------------------------------------------------


def test_constant_noise_scale_grows_to_within_its_range_then_keeps():
    schedule = BatchSchedule(8, max_batch=1024, patience=3)
    batches = run([64.0] * 20, schedule)
    # patience 3: changes after the 3rd estimate and 3 after each change; x2 each up to the band's
    # lower end 64 = B_noise (the rule `resolved`, at multiple 0.5: kept at 32).
    assert batches == [8, 8, 16, 16, 16, 32, 32, 32, 64] + [64] * 11
    assert [c["why"] for c in schedule.changes] == [GROW, GROW, GROW]
    assert [c["step"] for c in schedule.changes] == [2, 5, 8]


def test_growing_noise_scale_is_followed_within_bounds():
    schedule = BatchSchedule(4, min_batch=8, max_batch=200, patience=2)
    series = [10.0 * 1.15 ** step for step in range(60)]  # 10 to 37000
    optimizer = SGD(0.1)
    batches = run(series, schedule, optimizer=optimizer)
    # McCandlish's factor from 8 to 200 at B_noise 37000 is ~25; the default bound sqrt(200 / 8) = 5.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5, rel=1e-15)
    assert batches[0] == 8 and max(batches) == 200 and batches[-1] == 200  # K at most 50
    assert all(b1 >= b0 for b0, b1 in zip(batches, batches[1:]))
    for change in schedule.changes:
        assert change["new_batch"] <= 2 * change["batch"]
    steps = [c["step"] for c in schedule.changes]
    assert all(later - earlier >= 2 for earlier, later in zip(steps, steps[1:]))


def test_noisy_estimates_do_not_shrink_the_batch_but_a_range_wholly_below_does():
    generator = torch.Generator().manual_seed(0)
    noisy = (64.0 * torch.exp(2.0 * torch.randn(40, generator=generator))).tolist()
    schedule = BatchSchedule(8, max_batch=1024, accumulation=16, patience=3)  # batch 128
    batches = run([(value, 64.0) for value in noisy], schedule)
    assert SHRINK not in [c["why"] for c in schedule.changes]
    assert min(batches) == 128
    # Every recent value well below the batch: shrink, by at most 2 per change, to the band's
    # near end: 2 x [10, 40] = [20, 80]; 128 -> max(64, 80) = 80, then kept (multiple 0.5: 64, 40).
    schedule = BatchSchedule(8, max_batch=1024, accumulation=16, patience=3)
    batches = run([20.0] * 12, schedule)
    assert batches == [128, 128] + [80] * 10
    schedule = BatchSchedule(8, max_batch=1024, accumulation=16, patience=3, multiple=0.5)
    assert run([20.0] * 12, schedule) == [128, 128, 64, 64, 64, 40, 40, 40, 40, 40, 40, 40]


def test_nan_or_missing_estimates_keep_the_batch_and_warn_once():
    schedule = BatchSchedule(8, max_batch=1024, patience=1)
    with pytest.warns(UserWarning, match="NaN") as caught:
        batches = run([math.nan] * 5, schedule)
    assert batches == [8] * 5 and len(caught) == 1
    tracker = FakeTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert schedule.update(5, tracker, SGD(0.1)) is None  # no estimate at all: kept
    untracked, schedule = FakeTracker(), BatchSchedule(8, max_batch=1024, patience=1)
    untracked.cockpit.quantities = []
    with pytest.warns(UserWarning, match="tracks no noise scale") as caught:
        for step in range(3):
            schedule.update(step, untracked, SGD(0.1))
    assert len(caught) == 1 and schedule.batch == 8


def test_the_median_estimate_reads_the_per_step_values_not_the_smoothed_ratio():
    # Every step resolves B_noise 40; the smoothed ratio is infinite (its grad_sq average <= 0).
    series = [(40.0, math.inf)] * 12
    smoothed = BatchSchedule(8, max_batch=1024, patience=3)
    assert run(series, smoothed) == [8] * 12  # unresolved: kept (the rule before doubled blind)
    assert smoothed.decisions == {UNRESOLVED: 12}
    median = BatchSchedule(8, max_batch=1024, patience=3, estimate="median")
    # Median 40, range [min(40, 40/2), max(40, 2 * 40)] = [20, 80], band 2 x that = [40, 160]:
    # 8 -> 16 -> 32 -> min(64, 40) = 40 (multiple 0.5: 16, then held: 24 would pass 20).
    assert run(series, median) == [8, 8, 16, 16, 16, 32, 32, 32, 40, 40, 40, 40]
    assert [(c["noise_scale"], c["new_batch"]) for c in median.changes] == [
        (40.0, 16), (40.0, 32), (40.0, 40)]
    with pytest.raises(ValueError, match="estimate must be one of"):
        BatchSchedule(8, max_batch=1024, estimate="mean")


def test_the_same_estimate_counts_once():
    schedule = BatchSchedule(8, max_batch=1024, patience=3)
    tracker = FakeTracker()
    tracker.estimate(0, 64.0)
    for step in range(10):  # untracked steps after one tracked: one estimate
        schedule.update(step, tracker, SGD(0.1))
    assert schedule.changes == [] and schedule.batch == 8


# The near end of the range (hysteresis) on series by hand -----------------------------
# With recent=1 the range is [v / 2, 2 v] (v the estimate); micro-batches of 4 from batch 8,
# patience 2. At multiple=0.5 the band is that range itself (scale 0.5 x factor 2 = 1): these
# test the band's mechanics at unit scale. Each comment gives the rule before (toward
# round(B_noise)), which these fail. Its default multiple 1 (the band 2 x the range): below.


def near_end(**kwargs):
    return BatchSchedule(4, min_batch=8, max_batch=256, patience=2, recent=1,
                         **{"multiple": 0.5, **kwargs})


def test_a_constant_estimate_is_approached_to_the_near_end_of_its_range():
    # v = 40, range [20, 80]: 8 -> min(16, 20) = 16 -> min(32, 20) = 20, then kept (the rule
    # before: 8 -> 16 -> 32 = round(40) capped at x2, then kept).
    assert run([40.0] * 8, near_end()) == [8, 16, 16, 20, 20, 20, 20, 20]
    half = {"multiple": 0.5}
    assert decide(2, bounds_of(4, max_batch=256), 40.0, [40.0], **half).why == GROW
    assert decide(5, bounds_of(4, max_batch=256), 40.0, [40.0], **half).why == KEEP  # near end 20
    # 8 micro-batches of 8 at range [20, 80]: 16 -> 24 would pass 20: held, not grown.
    assert decide(2, bounds_of(8, max_batch=256), 40.0, [40.0], **half).why == HOLD


def test_a_growing_estimate_is_followed_at_the_lower_end_of_its_range():
    series = [40.0, 40.0, 60.0, 60.0, 90.0, 90.0, 135.0, 135.0, 200.0, 200.0]  # x1.5 every 2
    schedule = near_end()
    # Changes at steps 1, 3, 5, 7, 9 to min(2B, v / 2) in whole micro-batches: 16, floor(30 / 4) * 4
    # = 28, floor(45 / 4) * 4 = 44, floor(67.5 / 4) * 4 = 64, 100 (before: 16, 32, 64, 128, 128).
    assert run(series, schedule) == [8, 16, 16, 28, 28, 44, 44, 64, 64, 100]
    assert all(c["new_batch"] <= c["noise_scale"] / 2 for c in schedule.changes)
    assert [c["why"] for c in schedule.changes] == [GROW] * 5


def test_a_noisy_estimate_that_flips_by_its_range_never_shrinks_the_batch():
    series = ([72.0] * 4 + [18.0] * 4) * 2  # by a factor 4, the range's width [v / 2, 2 v]
    schedule = near_end()
    # 8 -> 16 -> 32 at 72 ([36, 144]), kept at 18 ([9, 36]), -> 36 at 72, kept at 18. The rule
    # before grew to 64 at the second 72 and shrank to 32 at the second 18.
    assert run(series, schedule) == [8, 16, 16, 32, 32, 32, 32, 32, 36, 36, 36, 36, 36, 36, 36, 36]
    assert SHRINK not in [c["why"] for c in schedule.changes]


def test_a_falling_estimate_shrinks_to_the_near_end_and_a_reversal_needs_the_range_width():
    series = [40.0] * 3 + [12.0] * 3 + [6.0] * 3 + [40.0] * 3
    schedule = near_end(accumulation=16)  # batch 64
    # v 12 ([6, 24]): 64 -> max(32, 24) = 32 -> 24; v 6 ([3, 12]): -> max(12, 12) = 12; v 40
    # ([20, 80]): 12 -> min(24, 20) = 20 (before: 32, 16, 8, then 16 and 32).
    assert run(series, schedule) == [64, 64, 64, 32, 32, 24, 24, 12, 12, 20, 20, 20]
    # Batch 20 at the near end of v = 40: a fall to v = 10 ([5, 20]) keeps it, to 9.9 holds it
    # (16 would pass the near end 19.8), to 8 ([4, 16]) shrinks it to 16: the estimate fell by
    # the range's width. The rule before, at the centre 40, shrank at any v below 20.
    bounds, half = bounds_of(4, max_batch=256), {"multiple": 0.5}
    assert decide(5, bounds, 10.0, [10.0], **half).why == KEEP
    assert decide(5, bounds, 9.9, [9.9], **half).why == HOLD
    assert decide(5, bounds, 8.0, [8.0], **half).accumulation == 4


def test_nan_estimates_keep_the_batch_and_count_toward_patience():
    schedule = near_end()
    with pytest.warns(UserWarning, match="NaN"):
        batches = run([math.nan, math.nan, 40.0, math.nan, 40.0, 40.0], schedule)
    # Step 2: 8 -> 16 (three estimates since the start); step 4: 16 -> min(32, 20) = 20
    # (before: 32); the NaN at step 3 keeps the batch and counts as an estimate.
    assert batches == [8, 8, 16, 16, 20, 20]
    assert [c["step"] for c in schedule.changes] == [2, 4]


# No growth on an unresolved estimate, by hand ----------------------------------------
# The rule before (near-end alone) grew on each of these: an infinite B_noise doubled the batch,
# an infinite upper quartile of recent b_simple left the range's lower end to decide.


def test_an_estimate_with_no_upper_end_keeps_the_batch():
    bounds = bounds_of(4, max_batch=256)
    # An infinite B_noise (the smoothed |G|^2 <= 0): kept (before: 8 -> 16).
    assert decide(2, bounds, math.inf, [math.inf] * 4).why == UNRESOLVED
    assert decide(2, bounds, math.inf, [40.0] * 10).why == UNRESOLVED
    # B_noise 64, 2 of 10 recent steps unresolved: sorted 64 x 8, inf x 2; the upper quartile
    # (position 6.75) is 64, the range [min(32, 64), max(128, 64)] = [32, 128]: 8 -> 16.
    two = [64.0] * 8 + [math.inf] * 2
    assert (decide(2, bounds, 64.0, two).why, decide(2, bounds, 64.0, two).accumulation) == (GROW, 4)
    # 3 of 10: the upper quartile sits at an infinite value, the range is [32, inf]: kept (before:
    # 8 -> 16 toward 32, as with 2 of 10).
    three = [64.0] * 7 + [math.inf] * 3
    found = decide(2, bounds, 64.0, three)
    assert (found.why, found.accumulation, found.recommendation.high) == (UNRESOLVED, 2, math.inf)
    # Unresolved is no reason to shrink: a batch above a range [32, inf] is kept.
    assert decide(64, bounds, 64.0, three).why == KEEP
    # Patience does not hide it: within patience an unresolved estimate says so.
    assert decide(2, bounds, 64.0, three, since_change=0).why == UNRESOLVED


def test_a_transiently_high_unresolved_estimate_waits_until_resolved():
    # Half the steps unresolved around B_noise 400, then a resolved 40: the digits CNN's first
    # 50 steps in docs/experiments/adaptive-batch.md, by hand (patience 3, recent 10).
    series = [(400.0 if step % 2 == 0 else math.inf, 400.0) for step in range(10)] + [40.0] * 12
    schedule = BatchSchedule(4, min_batch=8, max_batch=256, patience=3, multiple=0.5)
    batches = run(series, schedule)
    # multiple 0.5: the band is the estimate's range. Step 0: one value, range [200, 800]:
    # waits (patience). Steps 1-14: the upper quartile of the recent values is infinite (1
    # of 2, 1 of 3, 2 of 4, ..., then 5, 5, 4, 4, 3, 3 of the last 10): kept. Step 15: steps
    # 6-15 hold 400 x 2, inf x 2, 40 x 6: quartiles 40 and 400, range [min(20, 40), max(80,
    # 400)] = [20, 400]: 8 -> min(16, 20) = 16. Step 18 (patience): steps 9-18, one inf:
    # range [20, 80]: 16 -> 20, the near end; kept.
    assert batches == [8] * 15 + [16] * 3 + [20] * 4
    assert [(c["step"], c["new_batch"]) for c in schedule.changes] == [(15, 16), (18, 20)]
    assert schedule.decisions == {WAIT: 3, UNRESOLVED: 14, GROW: 2, KEEP: 3}
    # The rule before grew at step 2 (range [200, inf]) and doubled every 3 steps to 128.
    assert max(batches) == 20


# The target multiple (a rising estimate followed at multiple x B_noise), by hand -----
# The rule before it (`resolved`, the band the estimate's range itself: multiple 0.5) gives
# what each comment says, which these fail. recent=1: the band is 2 x [v / 2, 2 v] = [v, 4 v].


def test_a_batch_within_the_range_but_below_the_estimate_grows_to_it():
    bounds = bounds_of(4, max_batch=256)
    # Batch 8, B_noise 12: the band [12, 48]; 8 -> min(16, 12) = 12 (before: 8 lies in [6, 24]).
    found = decide(2, bounds, 12.0, [12.0] * 10)
    assert (found.why, found.accumulation) == (GROW, 3)
    assert found.recommendation.noise_scale == 12.0 and found.recommendation.batch == 12
    assert (found.recommendation.low, found.recommendation.high) == (12.0, 48.0)
    assert decide(2, bounds, 12.0, [12.0] * 10, multiple=0.5).why == KEEP
    # multiple 2: the band [24, 96]: 8 -> 16, at most x2.
    assert decide(2, bounds, 12.0, [12.0] * 10, multiple=2).accumulation == 4


def test_a_growing_estimate_is_followed_at_the_estimate():
    series = [40.0, 40.0, 60.0, 60.0, 90.0, 90.0, 135.0, 135.0, 200.0, 200.0]
    schedule = BatchSchedule(4, min_batch=8, max_batch=256, patience=2, recent=1)
    # Changes at steps 1, 3, 5, 7, 9 to min(2B, v): 16, 32, 64, 128, 200 (before: 16, 28, 44, 64,
    # 100, at v / 2).
    assert run(series, schedule) == [8, 16, 16, 32, 32, 64, 64, 128, 128, 200]
    assert [c["noise_scale"] for c in schedule.changes] == [40.0, 60.0, 90.0, 135.0, 200.0]
    assert all(c["new_batch"] <= c["noise_scale"] for c in schedule.changes)
    assert "target band (200-800) of B_noise = 200" in schedule.changes[-1]["reason"]


def test_a_falling_estimate_shrinks_only_past_the_band_width():
    bounds = bounds_of(4, max_batch=256)
    # At batch 40 (followed to v = 40): the band [v, 4 v] keeps it down to v = 10 (before: a v
    # of 15, [v / 2, 2 v], shrank it); at 9.9 it holds (39.6 rounds up to 40 micro-batches of 4:
    # no move); at 8 the band [8, 32] lies below it: to max(20, 32) = 32. The estimate fell by
    # the band's width, 4, as under the rule before.
    assert decide(10, bounds, 10.0, [10.0]).why == KEEP
    assert decide(10, bounds, 9.9, [9.9]).why == HOLD
    assert (decide(10, bounds, 8.0, [8.0]).why, decide(10, bounds, 8.0, [8.0]).accumulation) == (
        SHRINK, 8)
    assert decide(10, bounds, 15.0, [15.0], multiple=0.5).why == SHRINK  # [7.5, 30] below 40


def test_multiple_is_checked_and_kept_in_the_state():
    for wrong in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="multiple must be a finite number > 0"):
            BatchSchedule(8, max_batch=64, multiple=wrong)
        with pytest.raises(ValueError, match="multiple must be a finite number > 0"):
            decide(1, bounds_of(8, max_batch=64), 16.0, [16.0], multiple=wrong)
    state = BatchSchedule(8, max_batch=64, multiple=2).state_dict()
    assert state["multiple"] == 2.0
    BatchSchedule(8, max_batch=64, multiple=2).load_state_dict(state)
    with pytest.raises(ValueError, match="multiple=2.0"):
        BatchSchedule(8, max_batch=64).load_state_dict(state)
    del state["multiple"]  # a state saved before multiple: the rule at 0.5
    BatchSchedule(8, max_batch=64, multiple=0.5).load_state_dict(state)
    with pytest.raises(ValueError, match="the rule before it"):
        BatchSchedule(8, max_batch=64, multiple=2).load_state_dict(state)


# The learning rate -------------------------------------------------------------------


def test_sgd_learning_rate_follows_mccandlish_from_the_start_batch_by_hand():
    optimizer = SGD(0.1, 0.02)
    schedule = BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=100)
    run([64.0, 256.0], schedule, optimizer=optimizer)  # 8 -> 16 -> 32
    # 8 -> 16 at B_noise 64: (1 + 64/8) / (1 + 64/16) = 9 / 5.
    first, second = schedule.changes
    assert first["lr_factor"] == pytest.approx(1.8, rel=1e-15)
    assert (first["lr"], first["new_lr"]) == pytest.approx((0.1, 0.18), rel=1e-15)
    # 16 -> 32 at B_noise 256, from the start batch 8: (1 + 256/8) / (1 + 256/32) = 33 / 9, not
    # the product over changes 9/5 * (1 + 256/16) / (1 + 256/32) = 3.4.
    assert schedule.lr_factor == pytest.approx(33 / 9, rel=1e-15)
    assert second["lr_factor"] == pytest.approx(33 / 9 / 1.8, rel=1e-15)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1 * 33 / 9, 0.02 * 33 / 9],
                                                                      rel=1e-15)
    assert second["lr_why"] == "rule" and second["lr_rule_factor"] == pytest.approx(33 / 9, rel=1e-15)


def test_sgd_learning_rate_is_kept_without_a_finite_noise_scale():
    optimizer = SGD(0.1)
    schedule = BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=100)
    # The "norms" bootstrap to two micro-batches has no estimate: kept (not x2); then 16 -> 32
    # at B_noise 256 ([128, 512]), from the start batch 8: (1 + 32) / (1 + 8) = 33 / 9.
    run([256.0, 256.0], schedule, tracker=FakeTracker(schema.TWO_BATCH_NOISE_SCALE),
        optimizer=optimizer)
    assert [c["new_batch"] for c in schedule.changes] == [16, 32]
    assert [c["lr_why"] for c in schedule.changes] == ["kept", "rule"]
    assert schedule.changes[0]["lr_factor"] == 1.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 33 / 9, rel=1e-15)
    assert "no finite B_noise" in schedule.changes[0]["reason"]


def test_the_learning_rate_never_leaves_its_bound_and_the_bound_is_logged():
    # Default under SGD: the square-root rule's factor, sqrt(16 / 8), below McCandlish's 1.8.
    optimizer, tracker = SGD(0.1), FakeTracker()
    schedule = BatchSchedule(8, max_batch=1024, patience=1)
    run([64.0], schedule, tracker=tracker, optimizer=optimizer)
    change = schedule.changes[0]
    assert (change["lr_why"], change["lr_rule_factor"]) == ("bound", pytest.approx(1.8, rel=1e-15))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 2 ** 0.5, rel=1e-15)
    assert "bounded at x 1.414" in change["reason"]
    logged = tracker.recorded[0][2]
    assert logged[schema.SCHEDULE_LR_WHY_PREFIX + "bound"] == 1.0
    assert logged[schema.SCHEDULE_LR_BOUND] == pytest.approx(2 ** 0.5, rel=1e-15)
    # A stated bound: 1.8 and 33/9 both stopped at 1.5; the second change keeps the rate.
    optimizer = SGD(0.1)
    schedule = BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=1.5)
    run([64.0, 256.0], schedule, optimizer=optimizer)
    assert [c["lr_factor"] for c in schedule.changes] == pytest.approx([1.5, 1.0], rel=1e-15)
    assert [c["lr_why"] for c in schedule.changes] == ["bound", "bound"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15, rel=1e-15)
    # The square-root rule under a bound: sqrt(2), then sqrt(4) = 2 stopped at 1.5.
    optimizer = AdamW(1e-3)
    run([64.0, 256.0], BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=1.5),
        optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.5e-3, rel=1e-15)
    with pytest.raises(ValueError, match="max_lr_factor must be a number >= 1"):
        BatchSchedule(8, max_batch=1024, max_lr_factor=0.5)


def test_adam_learning_rate_follows_the_square_root_rule_and_none_leaves_it():
    optimizer = AdamW(1e-3)
    schedule = BatchSchedule(8, max_batch=1024, patience=1)
    run([64.0, 64.0], schedule, optimizer=optimizer)  # 8 -> 16 -> 32
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2, rel=1e-15)  # sqrt(4)
    assert schedule.lr_factor == pytest.approx(2.0, rel=1e-15)
    optimizer = SGD(0.1)
    schedule = BatchSchedule(8, max_batch=1024, patience=1, rule=None)
    run([64.0], schedule, optimizer=optimizer)
    assert schedule.batch == 16 and optimizer.param_groups[0]["lr"] == 0.1
    # A tensor learning rate (capturable Adam) is scaled in place.
    optimizer = AdamW(torch.tensor(1e-3, dtype=torch.float64))
    lr = optimizer.param_groups[0]["lr"]
    run([64.0], BatchSchedule(8, max_batch=1024, patience=1), optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(1e-3 * 2 ** 0.5)


def test_adam_within_a_run_follows_mccandlish_rule_on_its_preconditioned_step():
    # Adam's kin ("sqrt" in the advice) -> McCandlish's rule in the schedule; others as they are.
    assert (in_run_rule("sqrt"), in_run_rule("sgd"), in_run_rule(None)) == ("sgd", "sgd", None)
    # B_noise 64, batch 8 -> 16 -> 32 within max_lr_factor 4: (1 + 64/8) / (1 + 64/16) = 9/5,
    # then (1 + 64/8) / (1 + 64/32) = 3 from the start: x 3 / 1.8 at the second change.
    optimizer = AdamW(1e-3)
    schedule = BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=4)
    run([64.0, 64.0], schedule, optimizer=optimizer)
    assert [c["new_batch"] for c in schedule.changes] == [16, 32]
    assert [c["lr_factor"] for c in schedule.changes] == pytest.approx([1.8, 3 / 1.8], rel=1e-15)
    assert [c["lr_why"] for c in schedule.changes] == ["rule", "rule"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3, rel=1e-15)
    assert "McCandlish et al. 2018" in schedule.changes[0]["reason"]
    # The same with rule="sqrt" (Malladi et al. 2022): sqrt(4) = 2 at batch 32.
    optimizer = AdamW(1e-3)
    run([64.0, 64.0], BatchSchedule(8, max_batch=1024, patience=1, max_lr_factor=4, rule="sqrt"),
        optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3, rel=1e-15)
    # The default bound sqrt(B/B0) stops 9/5 at sqrt(2) (B_noise**2 >= B0 B: the rule's factor
    # is at least the square-root rule's), logged as such.
    optimizer = AdamW(1e-3)
    schedule = BatchSchedule(8, max_batch=1024, patience=1)
    run([64.0], schedule, optimizer=optimizer)
    change = schedule.changes[0]
    assert (change["lr_why"], change["lr_rule_factor"]) == ("bound", pytest.approx(1.8, rel=1e-15))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 ** 0.5, rel=1e-15)
    # B_noise 12 from batch 8 by micro-batches of 4: to 12, (1 + 12/8) / (1 + 12/12) = 1.25,
    # above sqrt(12/8) = 1.2247, so stopped there; within max_lr_factor 4: 1.25.
    optimizer = AdamW(1e-3)
    run([12.0], BatchSchedule(4, min_batch=8, max_batch=64, patience=1, max_lr_factor=4),
        optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.25e-3, rel=1e-15)


def test_no_rule_for_the_optimizer_warns_once_and_keeps_the_lr():
    Adagrad = type("Adagrad", (SGD,), {})
    optimizer = Adagrad(0.1)
    schedule = BatchSchedule(8, max_batch=1024, patience=1)
    with pytest.warns(UserWarning, match="no learning-rate rule is stated for Adagrad") as caught:
        run([64.0, 64.0], schedule, optimizer=optimizer)
    assert schedule.batch == 32 and optimizer.param_groups[0]["lr"] == 0.1 and len(caught) == 1


def test_norms_at_one_micro_batch_bootstraps_to_two():
    optimizer, tracker = SGD(0.1), FakeTracker(schema.TWO_BATCH_NOISE_SCALE)
    schedule = BatchSchedule(8, max_batch=64)
    change = schedule.update(0, tracker, optimizer)
    assert change["why"] == "bootstrap" and schedule.accumulation == 2
    assert optimizer.param_groups[0]["lr"] == 0.1  # no noise scale for McCandlish's rule yet
    assert math.isnan(change["noise_scale"])
    assert schema.SCHEDULE_NOISE_SCALE not in tracker.recorded[0][2]  # not logged as NaN
    adam = AdamW(1e-3)
    BatchSchedule(8, max_batch=64).update(0, FakeTracker(schema.TWO_BATCH_NOISE_SCALE), adam)
    assert adam.param_groups[0]["lr"] == 1e-3  # Adam: McCandlish's rule too (in_run_rule): kept
    # The per-example estimate needs no bootstrap.
    assert BatchSchedule(8, max_batch=64).update(0, FakeTracker(schema.NOISE_SCALE), SGD(0.1)) is None


def test_adaptive_optimizer_reads_the_preconditioned_noise_scale():
    tracker = FakeTracker(schema.NOISE_SCALE)
    tracker.cockpit.quantities.append(type(schema.PRECONDITIONED_NOISE_SCALE, (), {})())
    schedule = BatchSchedule(8, max_batch=64)
    schedule.update(0, tracker, AdamW(1e-3))
    assert schedule.source == schema.PRECONDITIONED_NOISE_SCALE
    schedule = BatchSchedule(8, max_batch=64)
    schedule.update(0, tracker, SGD(0.1))
    assert schedule.source == schema.NOISE_SCALE


# State -------------------------------------------------------------------------------


def test_state_restored_mid_run_gives_the_same_sequence():
    generator = torch.Generator().manual_seed(1)
    noise = torch.exp(0.3 * torch.randn(60, generator=generator))
    series = [(float(10 * 1.2 ** step * n), 10 * 1.2 ** step) for step, n in enumerate(noise)]
    whole = BatchSchedule(4, max_batch=4096, patience=3)
    optimizer = SGD(0.1)
    batches = run(series, whole, optimizer=optimizer)
    assert len(whole.changes) >= 4
    # Stopped one estimate after a change that the next follows as soon as patience allows.
    steps = [change["step"] for change in whole.changes]
    split = next(step for step, later in zip(steps, steps[1:]) if later - step == 3) + 2
    first = BatchSchedule(4, max_batch=4096, patience=3)
    resumed_optimizer = SGD(0.1)
    tracker = FakeTracker()
    head = run(series[:split], first, tracker=tracker, optimizer=resumed_optimizer)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = BatchSchedule(4, max_batch=4096, patience=3)
    second.load_state_dict(torch.load(buffer, weights_only=True))
    assert second.update(split - 1, tracker, resumed_optimizer) is None  # read before the stop
    tail = run(series[split:], second, optimizer=resumed_optimizer, start=split)
    assert head + tail == batches
    assert second.changes == whole.changes and second.decisions == whole.decisions
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="build it as before"):
        BatchSchedule(8, max_batch=512).load_state_dict(first.state_dict())
