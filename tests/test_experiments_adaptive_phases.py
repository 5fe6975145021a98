"""experiments.adaptive_batch_phases: the split of paired runs by loss phase, on hand-made runs."""

import math
from types import SimpleNamespace

import pytest

from experiments import adaptive_batch_phases as phases


def _run(eval_steps, eval_losses, batches, lrs):
    return {"eval_steps": eval_steps, "eval_losses": eval_losses, "batches": batches, "lrs": lrs}


def test_phase_bounds_interpolate_each_level():
    # 2 -> 1 between steps 0 and 10: level 1.5 at step 5; level 0.5 at step 20 exactly.
    assert phases.phase_bounds([0, 10, 20], [2.0, 1.0, 0.5], (1.5, 0.5)) == [0.0, 5.0, 20.0]
    assert phases.phase_bounds([0, 10], [2.0, 1.0], (0.5,))[1] == math.inf


def test_phase_means_take_the_steps_within_the_phase():
    # Phase 2.5 .. 4.5 holds steps 2, 3 and 4.
    assert phases.phase_means([1, 2, 3, 4, 5, 6], 2.5, 4.5) == pytest.approx(4.0)


def test_predicted_ratio_is_mccandlish():
    # (1 + 16/16) / (1 + 16/64) = 2 / 1.25.
    assert phases.predicted_ratio(16.0, 16.0, 64.0) == pytest.approx(1.6)
    assert phases.predicted_ratio(0.0, 8.0, 64.0) == pytest.approx(1.0)


def test_phase_rows_pair_the_seeds():
    # Arm a reaches loss 1 at step 10 and 0.5 at 30 (seed 0), 12 and 36 (seed 1); arm w at
    # 10 and 20 on both. Batches and rates change at step 10 in a, at 10 in w.
    a = {0: _run([0, 10, 30], [2.0, 1.0, 0.5], [8] * 10 + [16] * 20, [0.1] * 10 + [0.2] * 20),
         1: _run([0, 12, 36], [2.0, 1.0, 0.5], [8] * 12 + [32] * 24, [0.1] * 36)}
    w = {s: _run([0, 10, 20], [2.0, 1.0, 0.5], [8] * 10 + [64] * 10, [0.1] * 10 + [0.4] * 10)
         for s in (0, 1, 7)}  # seed 7: the reference alone, left out
    first, second = phases.phase_rows(a, w, (1.0, 0.5))
    assert first["a_steps"] == pytest.approx(11.0) and first["w_steps"] == pytest.approx(10.0)
    assert first["a_batches"] == pytest.approx(8.0) and first["w_lrs"] == pytest.approx(0.1)
    assert first["diff"] == pytest.approx(1.0) and first["diff_se"] == pytest.approx(1.0)
    assert second["a_steps"] == pytest.approx(22.0) and second["w_steps"] == pytest.approx(10.0)
    assert second["a_batches"] == pytest.approx((16 + 32) / 2)
    assert second["a_lrs"] == pytest.approx((0.2 + 0.1) / 2)
    assert second["w_batches"] == pytest.approx(64.0) and second["w_lrs"] == pytest.approx(0.4)
    # Differences 20 - 10 and 24 - 10: mean 12, standard error |14 - 10| / 2.
    assert second["diff"] == pytest.approx(12.0) and second["diff_se"] == pytest.approx(2.0)
    assert "noise_scale" not in first


def test_phase_rows_with_noise_scales_predict_the_ratio():
    a = {0: _run([0, 20], [2.0, 0.5], [16] * 20, [0.1] * 20)}
    w = {0: _run([0, 10], [2.0, 0.5], [64] * 10, [0.1] * 10)}
    # Estimates 16 over the phase (one infinite, one NaN: left out of the median).
    scales = {0: [16.0] * 18 + [math.inf, math.nan]}
    (row,) = phases.phase_rows(a, w, (0.5,), scales)
    assert row["noise_scale"] == pytest.approx(16.0)
    assert row["predicted_ratio"] == pytest.approx(1.6)
    assert math.isnan(row["diff_se"])  # one seed: no standard error


def test_decision_shares_count_within_the_phase():
    decisions = {0: [{"batch": 8, "noise_scale": math.inf, "why": "unresolved"},
                     {"batch": 8, "noise_scale": 4.0, "why": "grow"},
                     {"batch": 16, "noise_scale": 8.0, "why": "keep"},
                     {"batch": 16, "noise_scale": 32.0, "why": "keep"}]}
    shares = phases.decision_shares(decisions, {0: [0.0, 2.0, 4.0]}, 1)
    assert shares == {"keep": 1.0, "batch_over_noise": pytest.approx(1.25)}  # median of 2, 0.5
    first = phases.decision_shares(decisions, {0: [0.0, 2.0, 4.0]}, 0)
    assert first["unresolved"] == pytest.approx(0.5) and first["grow"] == pytest.approx(0.5)
    assert first["batch_over_noise"] == pytest.approx(2.0)


def test_replay_sets_the_next_steps_batch_and_rate():
    replay = phases.Replay([8, 16, 32], [0.1, 0.2, 0.4])
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.1}, {"lr": 0.1}])
    assert replay.batch == 8 and replay.accumulation == 1
    replay.update(0, None, optimizer)
    assert replay.batch == 16 and [g["lr"] for g in optimizer.param_groups] == [0.2, 0.2]
    replay.update(5, None, optimizer)  # past the trace: its last entry
    assert replay.batch == 32 and optimizer.param_groups[0]["lr"] == 0.4
