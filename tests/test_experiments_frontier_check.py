"""experiments/frontier_check.py: the sanity check's decomposition and the fixed-avg arm's
settings, on synthetic runs and grids with hand-computed answers (the arm end to end: the
--quick run of tests/test_experiments_adaptive.py)."""

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from experiments import adaptive_batch as ab  # noqa: E402
from experiments import critical_batch_size as cbs  # noqa: E402
from experiments import frontier_check as fc  # noqa: E402

S_MIN, E_MIN = 40.0, 2000.0  # B_crit = 50
BATCHES = (8, 16, 32, 64, 128, 256, 512)


def on_hyperbola(b):
    return float(cbs.predicted_steps(b, S_MIN, E_MIN))


def test_two_fixed_runs_around_the_hyperbola_average_above_one_by_the_spread_term():
    """Batch 50 (B_crit): the hyperbola's 80 steps, and runs at 72 and 88 steps: values
    0.8 * 0.8 = 0.64 and 1.2 * 1.2 = 1.44, mean 1.04 = 1 + 50 * 8^2 / (40 * 2000)."""
    steps = [72.0, 88.0]
    examples = [50 * s for s in steps]
    row = fc.check_row(steps, examples, S_MIN, E_MIN)
    assert row["n"] == 2
    assert row["mean"] == pytest.approx(1.04, rel=1e-14)
    assert row["mean_run"] == pytest.approx(1.0, rel=1e-14)
    assert row["spread"] == pytest.approx(0.04, rel=1e-14)
    assert row["se"] == pytest.approx(0.4, rel=1e-14)  # std (0.64, 1.44) = 0.4 sqrt(2)


def test_the_mean_value_is_the_mean_runs_value_plus_the_spread_term_exactly():
    """f is bilinear in (S, E): the decomposition holds for any runs, not only to second order
    (a sample covariance with ddof=1 would break it)."""
    rng = np.random.default_rng(0)
    steps = rng.uniform(50.0, 150.0, size=7)
    examples = steps * rng.uniform(10.0, 80.0, size=7)
    values = ab.frontier_value(steps, examples, S_MIN, E_MIN)
    assert fc.mean_run_value(steps, examples, S_MIN, E_MIN) + fc.spread_term(
        steps, examples, S_MIN, E_MIN) == pytest.approx(float(np.mean(values)), rel=1e-12)
    # Steps and examples that vary against each other lower the mean below the mean run's.
    assert fc.spread_term([60.0, 100.0], [4000.0, 2000.0], S_MIN, E_MIN) == pytest.approx(
        -20.0 * 1000.0 / (S_MIN * E_MIN))


def test_a_paired_difference_is_over_the_seeds_both_ran():
    """Seeds 0-2 in both (differences -0.5, -0.25, -0.75); seed 3 only in the arm, 4 only in
    the reference: left out. Mean -0.5, standard error 0.25 / sqrt(3)."""
    arm = {0: 0.5, 1: 1.0, 2: 0.25, 3: 9.0}
    reference = {0: 1.0, 1: 1.25, 2: 1.0, 4: 9.0}
    paired = fc.paired_difference(arm, reference)
    assert paired["n"] == 3
    assert paired["mean"] == pytest.approx(-0.5, rel=1e-15)
    assert paired["se"] == pytest.approx(0.25 / math.sqrt(3), rel=1e-14)
    assert fc.paired_difference({0: 1.0}, {1: 1.0})["n"] == 0


def test_the_batches_around_b_crit_and_the_nearest_in_log_scale():
    assert fc.bracketing_batches(BATCHES, 50.75) == [32, 64]
    assert fc.bracketing_batches(BATCHES, 64.0) == [64]
    assert fc.bracketing_batches(BATCHES, 4.0) == [8]
    assert fc.bracketing_batches(BATCHES, 1000.0) == [512]
    # log(64 / 51) = 0.227 < log(51 / 32) = 0.466; log(45 / 32) = 0.341 < log(64 / 45) = 0.353.
    assert fc.nearest_batch(BATCHES, 51) == 64
    assert fc.nearest_batch(BATCHES, 45) == 32


def test_the_fixed_avg_arm_takes_the_rounded_b_crit_and_the_nearest_batchs_best_rate():
    fair = ab.Baseline("gpt", 2.3, 35.0, 35.0 * 50.75, 50.75, [[32, 90.0], [64, 65.0]],
                       {32: 0.016, 64: 0.008}, "made up", [0, 1, 2])
    settings = fc.fixed_at_average(fair)
    assert (settings["batch"], settings["lr"], settings["lr_of_batch"]) == (51, 0.008, 64)
    assert settings["grid_seeds"] == [0, 1, 2] and settings["b_crit"] == 50.75
    assert "learning rate 0.008, that grid's best at its measured batch nearest it in log " \
           "scale (64;" in fc.fixed_avg_bullet(settings)[0]
    assert fc.fixed_avg_bullet(None) == []


def synthetic_grids():
    """Two seeds at 0.9 and 1.1 times the hyperbola's steps at 0.008 (their mean on it); a
    pruned 0.004 on seed 1 and a diverged 0.016, which are not runs' steps."""
    grids = {}
    for seed, factor in ((0, 0.9), (1, 1.1)):
        grids[seed] = {b: [cbs.Run(b, 0.004, steps=math.inf, pruned=seed == 1)
                           if seed == 1 else cbs.Run(b, 0.004, steps=2 * on_hyperbola(b)),
                           cbs.Run(b, 0.008, steps=factor * on_hyperbola(b)),
                           cbs.Run(b, 0.016, steps=math.inf, diverged=True)] for b in BATCHES}
    return grids


def test_grid_steps_are_each_seeds_exact_run_of_the_batch_and_rate():
    grids = synthetic_grids()
    assert fc.grid_steps(grids, 32, 0.008) == pytest.approx([92.25, 112.75])  # 0.9, 1.1 * 102.5
    assert fc.grid_steps(grids, 32, 0.004) == [205.0]  # seed 1's pruned bound left out
    assert fc.grid_steps(grids, 32, 0.016) == []
    assert fc.grid_steps(grids, 24, 0.008) == []


def test_the_check_table_states_the_grids_runs_at_b_crit_and_each_arm():
    """The grid's mean runs lie on the hyperbola (value 1); at batch 32 its runs spread by
    +-10% of 102.5 steps: spread term 32 * 10.25^2 / (40 * 2000) = 0.042025."""
    fair = ab.Baseline("gpt", 2.3, S_MIN, E_MIN, 50.0, [[b, on_hyperbola(b)] for b in BATCHES],
                       {b: 0.008 for b in BATCHES}, "made up", [0, 1])
    runs = [ab.ScheduledRun("fixed-avg", seed, 0.008, steps=s, examples=50 * s)
            for seed, s in ((0, 72.0), (1, 88.0))]
    # The fixed batch on the hyperbola on both seeds: value 1, minus (0.64, 1.44) per seed.
    runs += [ab.ScheduledRun("fixed", seed, 0.008, steps=80.0, examples=4000.0) for seed in (0, 1)]
    runs.append(ab.ScheduledRun("warmup", 0, 0.008))  # did not reach: not counted
    text = "\n".join(fc.check_table(fair, synthetic_grids(), runs))
    spread = 32 * 10.25 ** 2 / (S_MIN * E_MIN)
    assert f"| grid, batch 32, lr 0.008 | 2 | {1 + spread:.3g} ± " in text
    assert f"| 1 | {spread:.2g} |" in text
    assert "| grid, batch 64, lr 0.008 (nearest B_crit) | 2 |" in text
    assert "| fixed-avg | 2 | 1.04 ± 0.4 | 1 | 0.04 | the reference |" in text
    assert "| fixed | 2 | 1 ± 0 | 1 | 0 | -0.04 ± 0.4 (2) |" in text
    assert "warmup" not in text.split("|---|")[-1]
    assert fc.check_table(None, synthetic_grids(), runs) == []


# ----------------------------------------------------------------------------
# The tests over seeds: known answers
# ----------------------------------------------------------------------------

#: Student's t quantile t_{0.975} at 3 degrees of freedom (tables: 3.182446305284263).
T_975_DF3 = 3.182446305284263


def test_the_one_sided_t_test_at_the_tabulated_quantile_gives_p_0025():
    """Four values of sample sd s = 0.2 (deviations -a, -a, a, a, a = sqrt(3)/2 s: ddof-1
    variance 4a^2/3 = s^2), mean 1 - t_{0.975,3} s / 2: t = -t_{0.975,3}, p = 0.025 exactly."""
    s = 0.2
    a = math.sqrt(3.0) / 2.0 * s
    mean = 1.0 - T_975_DF3 * s / 2.0
    values = [mean - a, mean - a, mean + a, mean + a]
    test = fc.one_sided_t(values, null=1.0)
    assert test["t"] == pytest.approx(-T_975_DF3, rel=1e-12)
    assert test["p"] == pytest.approx(0.025, rel=1e-9)
    assert math.isnan(fc.one_sided_t([0.5], null=1.0)["p"])  # one seed: no test
    assert fc.one_sided_t([0.5, 0.5], null=1.0)["p"] == 0.0  # no spread: certainly below


def test_the_one_sided_t_test_with_two_degrees_of_freedom_has_a_closed_form():
    """Values 0.25, 0.5, 0.75 against 1: t = -0.5 / (0.25 / sqrt(3)) = -2 sqrt(3); Student's
    t with 2 degrees of freedom has CDF 1/2 + t / (2 sqrt(2 + t^2)): p = 1/2 - sqrt(12/14)/2."""
    test = fc.one_sided_t([0.25, 0.5, 0.75], null=1.0)
    assert test["t"] == pytest.approx(-2.0 * math.sqrt(3.0), rel=1e-12)
    assert test["p"] == pytest.approx(0.5 - 0.5 * math.sqrt(12.0 / 14.0), rel=1e-12)


def test_the_sign_test_counts_below_and_drops_ties():
    """7 of 8 below (the value at the null dropped): P(Bin(8, 1/2) >= 7) = (8 + 1) / 256."""
    test = fc.sign_test([0.5] * 7 + [1.5, 1.0], null=1.0)
    assert (test["n"], test["below"]) == (8, 7)
    assert test["p"] == pytest.approx(9.0 / 256.0, rel=1e-12)
    assert fc.sign_test([2.0, 3.0], null=1.0)["p"] == pytest.approx(1.0)  # none below


def test_the_bootstrap_resamples_n_seeds_with_replacement():
    """Values (0, 0, 0, 1): a resampled mean is k/4, k ~ Bin(4, 1/4), so the share of means
    >= 0.5 is P(k >= 2) = 1 - 81/256 - 108/256 = 67/256; values (0, 1): means 0, 1/2, 1 with
    probabilities 1/4, 1/2, 1/4, the share >= 1 is 1/4 and the 95% interval is [0, 1].
    Tolerance: 4 Monte Carlo standard errors of a share over 10,000 resamples (< 0.018)."""
    share = fc.bootstrap_mean([0.0, 0.0, 0.0, 1.0], null=0.5)["share_at_or_above"]
    assert share == pytest.approx(67.0 / 256.0, abs=4 * math.sqrt(0.262 * 0.738 / 10_000))
    boot = fc.bootstrap_mean([0.0, 1.0], null=1.0)
    assert boot["share_at_or_above"] == pytest.approx(0.25, abs=4 * math.sqrt(3 / 16 / 10_000))
    assert (boot["low"], boot["high"]) == (0.0, 1.0)
    assert fc.bootstrap_mean([0.0, 1.0], null=1.0) == boot  # seeded: the page is reproducible


def test_seeds_needed_is_the_squared_ratio_rounded_up():
    assert fc.seeds_needed(0.25, 0.0625) == 64  # (2 * 0.25 / 0.0625)^2
    assert fc.seeds_needed(0.25, 0.3) == 3  # (5/3)^2 = 2.78
    assert fc.seeds_needed(0.25, 0.125, standard_errors=1.0) == 4


def run_at(arm, seed, steps, value):
    """A run of ``steps`` with the examples that give frontier ``value`` (S_MIN 40, E_MIN 2000)."""
    examples = E_MIN * (1.0 + value / (steps / S_MIN - 1.0))
    return ab.ScheduledRun(arm, seed, 0.008, steps=steps, examples=examples)


def test_the_tests_table_states_each_arm_each_pair_and_the_warmup_target():
    """adaptive-norms at 0.25, 0.5, 0.75 (60 steps): against 1 the closed-form p 0.037 and
    3 of 3 below (p 1/8); minus fixed-avg's 1, 1, 1.5: -0.75, -0.5, -0.75, mean -2/3, s.e.
    (0.25 / sqrt 3) / sqrt 3 = 0.083; the warmup on seeds 0 and 1 only, 5 and 10 steps more than the
    arm's, 500 examples fewer and more."""
    fair = ab.Baseline("gpt", 2.3, S_MIN, E_MIN, 50.0, [], {8: 0.008}, "made up", [0, 1])
    runs = [run_at("adaptive-norms", seed, 60.0, v) for seed, v in enumerate((0.25, 0.5, 0.75))]
    norms = {r.seed: r.examples for r in runs}
    runs += [run_at("fixed-avg", seed, 60.0, v) for seed, v in enumerate((1.0, 1.0, 1.5))]
    runs += [ab.ScheduledRun("warmup", seed, 0.008, steps=60.0 + extra,
                             examples=norms[seed] + more)
             for seed, extra, more in ((0, 5.0, -500.0), (1, 10.0, 500.0))]
    text = "\n".join(fc.tests_table(fair, runs))
    p = 0.5 - 0.5 * math.sqrt(12.0 / 14.0)
    assert f"| adaptive-norms | 3 | 0.5 ± 0.14 | {p:.2g} | " in text
    assert "| 3 of 3 (0.12) |" in text
    assert "| adaptive-norms − fixed-avg | 3 | -0.667 ± 0.083 | " in text
    assert "| adaptive-norms − warmup | 2 | " in text
    assert "| adaptive-norms | 2 | -7.5 ± 2.5 (" in text
    assert "| +0 ± 500 (0.5) | 2 | 1 | 1 |" in text
    assert "With the frontier's own error too" not in text
    # One frontier: the seeds alone; all three -0.75 (p 8/27) or all -0.5 (p 1/27) are both
    # above 2.5%: the interval is the differences' range.
    text = "\n".join(fc.tests_table(fair, runs, np.array([[S_MIN, E_MIN]] * 100)))
    assert "| adaptive-norms − fixed-avg | 3 | -0.75 to -0.5 | 0 | " in text
    assert fc.tests_table(None, runs) == []


def test_seed_steps_keep_the_batches_every_seed_ran_exactly_at_the_chosen_rate():
    grids = synthetic_grids()
    steps = fc.seed_steps(grids, {b: 0.008 for b in BATCHES})
    assert list(steps) == list(BATCHES)
    assert steps[32] == pytest.approx([92.25, 112.75])
    assert fc.seed_steps(grids, {32: 0.004, 64: 0.008}) == {64: pytest.approx(
        [0.9 * on_hyperbola(64), 1.1 * on_hyperbola(64)])}  # 0.004 pruned on seed 1


def test_resampled_frontiers_refit_the_mean_of_the_drawn_seeds():
    """Seed 0 on the hyperbola (40, 2000), seed 1 on (60, 1000): a resample draws both seeds of
    one (probability 1/4 each), whose fit is that hyperbola, or one of each (1/2), whose mean
    steps lie exactly on (50, 1500). Tolerance of the share: 4 standard errors over 400."""
    other = lambda b: 60.0 + 1000.0 / b  # noqa: E731
    fronts = fc.resampled_frontiers({b: [on_hyperbola(b), other(b)] for b in BATCHES})
    assert fronts.shape == (400, 2)
    kinds = []
    for s_min, e_min in fronts:
        kind = [k for k, (s, e) in enumerate(((S_MIN, E_MIN), (60.0, 1000.0), (50.0, 1500.0)))
                if s_min == pytest.approx(s, rel=1e-6) and e_min == pytest.approx(e, rel=1e-6)]
        assert len(kind) == 1
        kinds += kind
    share = np.bincount(kinds, minlength=3) / len(kinds)
    assert share == pytest.approx([0.25, 0.25, 0.5], abs=4 * math.sqrt(0.25 / 400))
    assert fc.resampled_frontiers({32: [1.0, 2.0]}).shape == (0, 2)  # one batch: no fit


def test_the_two_level_bootstrap_adds_the_frontiers_spread_to_the_seeds():
    """A run of 80 steps and 4,000 examples on both seeds: value 1 against (40, 2000) and
    (80/50 - 1)(4000/2000 - 1) = 0.6 against (50, 2000), half the frontiers each: share >= 1
    exactly 1/2, interval [0.6, 1], the frontier's part the sd of (1, 0.6) repeated. Runs of
    value 0 (60 steps, E_min examples) and 1 on one frontier: the seeds alone, share 1/4."""
    fronts = [(S_MIN, E_MIN), (50.0, E_MIN)] * 200
    boot = fc.two_level_bootstrap([80.0, 80.0], [4000.0, 4000.0], fronts)
    assert boot["share_at_or_above"] == 0.5
    assert (boot["low"], boot["high"]) == pytest.approx((0.6, 1.0), rel=1e-12)
    assert boot["frontier_sd"] == pytest.approx(float(np.std([1.0, 0.6] * 200, ddof=1)))
    same = fc.two_level_bootstrap([80.0, 80.0], [4000.0, 4000.0], fronts, null=0.0,
                                  reference=([80.0, 80.0], [4000.0, 4000.0]))
    assert (same["low"], same["high"], same["share_at_or_above"]) == (0.0, 0.0, 1.0)
    seeds = fc.two_level_bootstrap([60.0, 80.0], [E_MIN, 4000.0], [(S_MIN, E_MIN)] * 10_000)
    assert seeds["share_at_or_above"] == pytest.approx(0.25, abs=4 * math.sqrt(3 / 16 / 10_000))
    assert math.isnan(fc.two_level_bootstrap([80.0], [4000.0], fronts)["low"])  # one seed


def test_seed_ranges_join_consecutive_seeds():
    from experiments.pages import seed_ranges

    assert seed_ranges([8, 7, 0, 1, 2, 5]) == "0-2, 5, 7-8"
    assert seed_ranges(range(12, 124)) == "12-123"
    assert seed_ranges([3]) == "3" and seed_ranges([]) == ""
