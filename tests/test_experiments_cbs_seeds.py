"""experiments/cbs_seeds.py: the seed-averaged grid and its fit against hand-computed answers
(``critical_batch_size --seeds`` end to end: tests/test_experiments_cbs.py, on its --quick run)."""

import json
import math
import warnings
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from experiments import adaptive_batch as ab  # noqa: E402
from experiments import cbs_seeds  # noqa: E402
from experiments import critical_batch_size as cbs  # noqa: E402

BATCHES = (8, 16, 32, 64, 128, 256, 512)
S_MIN, E_MIN = 40.0, 2000.0  # B_crit = 50
LRS = (0.004, 0.008, 0.016)
#: Per seed, the factor on the hyperbola's steps of the best learning rate: they average to 1
#: exactly (in binary too: 0.75, 1.25, 1), so the averaged grid lies on the hyperbola.
SEED_FACTORS = {0: 0.75, 1: 1.25, 2: 1.0}
FIT_RTOL = 1e-8  # as tests/test_experiments_cbs.py: exact data, the optimizer's tolerance


def run(b, lr, steps, pruned=False, diverged=False):
    return cbs.Run(b, lr, steps=steps, pruned=pruned, diverged=diverged)


def synthetic_grids():
    """``{seed: {B: [Run]}}``: at every batch 0.008 is best on average, on the hyperbola; seed 0
    has a lucky 0.004 faster than its 0.008 at every batch, which its mean over seeds is not."""
    grids = {}
    for seed, factor in SEED_FACTORS.items():
        grids[seed] = {}
        for b in BATCHES:
            s = float(cbs.predicted_steps(b, S_MIN, E_MIN))
            other = 0.7 * s if seed == 0 else 1.6 * s  # mean 1.3 s: worse than 0.008's s
            grids[seed][b] = [run(b, 0.004, other), run(b, 0.008, factor * s),
                              run(b, 0.016, math.inf, diverged=True)]
    return grids


def test_averaged_fit_recovers_the_hyperbola_of_the_seed_means():
    grids = synthetic_grids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        averaged = cbs_seeds.averaged_grid(grids)
        fitted = cbs_seeds.averaged_fit(grids)
    assert {b: lr for b, (lr, _, _) in averaged.items()} == {b: 0.008 for b in BATCHES}
    for b, (_, steps, seeds) in averaged.items():
        assert seeds == 3
        assert steps == pytest.approx(float(cbs.predicted_steps(b, S_MIN, E_MIN)), rel=1e-15)
    np.testing.assert_allclose(fitted, (S_MIN, E_MIN), rtol=FIT_RTOL)
    # Seed 0 alone sits at 0.7 of the hyperbola (its lucky rate): biased low by 30%.
    seed0 = [min(r.steps for r in grids[0][b]) for b in BATCHES]
    np.testing.assert_allclose(cbs.fit_steps_examples(BATCHES, seed0),
                               (0.7 * S_MIN, 0.7 * E_MIN), rtol=FIT_RTOL)


def test_the_best_rate_is_chosen_on_the_means_not_per_seed():
    """Seed 0 prefers 0.004 (70 < 75), seed 1 0.008 (100 < 160): the means 115 and 87.5."""
    runs = {0: [run(8, 0.004, 70.0), run(8, 0.008, 75.0)],
            1: [run(8, 0.004, 160.0), run(8, 0.008, 100.0)]}
    assert cbs_seeds.averaged_best(runs) == (0.008, 87.5, 2)
    # The average of the per-seed minima would be (70 + 100) / 2 = 85: lower, and no one rate's.


def test_a_pruned_run_counts_as_its_seeds_best_a_lower_bound():
    # Seed 1 pruned 0.004 once past its best (100): 0.004's mean is at least (70 + 100) / 2 =
    # 85 < 87.5, so 0.008 is not known to be the best: the batch is left out, with a warning.
    runs = {0: [run(8, 0.004, 70.0), run(8, 0.008, 75.0)],
            1: [run(8, 0.004, math.inf, pruned=True), run(8, 0.008, 100.0)]}
    assert cbs_seeds.steps_bounds(runs[1]) == {0.004: (100.0, False), 0.008: (100.0, True)}
    with pytest.warns(UserWarning, match=r"batch 8: learning rate\(s\) 0.004 pruned"):
        assert cbs_seeds.averaged_best(runs) is None
    # With seed 0's 0.004 at 80 its bound is (80 + 100) / 2 = 90 >= 87.5: 0.008 is the best.
    runs[0][0] = run(8, 0.004, 80.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cbs_seeds.averaged_best(runs) == (0.008, 87.5, 2)


def test_no_rate_reached_on_every_seed_leaves_the_batch_out():
    runs = {0: [run(8, 0.004, 70.0), run(8, 0.008, math.inf, diverged=True)],
            1: [run(8, 0.004, math.inf), run(8, 0.008, 100.0)]}
    with pytest.warns(UserWarning, match="batch 8: no learning rate reached the target on all 2"):
        assert cbs_seeds.averaged_best(runs) is None


def test_a_batch_is_averaged_over_the_seeds_that_ran_it():
    grids = {0: {8: [run(8, 0.004, 70.0)], 16: [run(16, 0.004, 40.0)]},
             1: {8: [run(8, 0.004, 90.0)]}}  # seed 1 stopped before batch 16
    assert cbs_seeds.averaged_grid(grids) == {8: (0.004, 80.0, 2), 16: (0.004, 40.0, 1)}


def write_grid_files(folder, grids, data_seed=0, quick=False, target=2.3):
    """The two JSON files of critical_batch_size: ``grids[data_seed]`` in the results, the
    others in the seeds file."""
    summary = {seed: {str(b): [cbs.run_summary(r) for r in runs] for b, runs in grid.items()}
               for seed, grid in grids.items()}
    (folder / cbs.RESULTS).write_text(json.dumps({
        "seed": data_seed, "quick": quick,
        "results": [{"task": "gpt", "target": target, "runs": summary[data_seed]}]}))
    (folder / cbs_seeds.SEED_RESULTS).write_text(json.dumps({
        "data_seed": data_seed, "quick": quick, "commands": [], "grids": {"gpt": {
            str(s): {"target": target, "runs": r, "seconds": 0.0, "complete": True}
            for s, r in summary.items() if s != data_seed}}}))


def test_adaptive_batch_reads_the_averaged_baseline_from_the_stored_grids(tmp_path):
    grids = synthetic_grids()
    write_grid_files(tmp_path, grids)
    task = SimpleNamespace(name="gpt", target=2.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fair = ab.averaged_baseline(tmp_path / cbs.RESULTS, task)
    np.testing.assert_allclose((fair.s_min, fair.e_min), (S_MIN, E_MIN), rtol=FIT_RTOL)
    assert fair.b_crit == pytest.approx(E_MIN / S_MIN, rel=2 * FIT_RTOL)
    assert fair.best_lr == {b: 0.008 for b in BATCHES}
    assert "seeds 0, 1, 2 averaged" in fair.source
    # A fixed batch on the averaged hyperbola has frontier value 1 against it.
    s = float(cbs.predicted_steps(64, S_MIN, E_MIN))
    assert ab.frontier_value(s, 64 * s, fair.s_min, fair.e_min) == pytest.approx(1.0, rel=1e-7)
    # One seed: no averaged baseline; another data split or target: refused.
    write_grid_files(tmp_path, {0: grids[0]})
    (tmp_path / cbs_seeds.SEED_RESULTS).unlink()
    assert ab.averaged_baseline(tmp_path / cbs.RESULTS, task) is None
    write_grid_files(tmp_path, grids, quick=False)
    seeds = json.loads((tmp_path / cbs_seeds.SEED_RESULTS).read_text())
    seeds["data_seed"] = 1
    (tmp_path / cbs_seeds.SEED_RESULTS).write_text(json.dumps(seeds))
    with pytest.raises(ValueError, match="not one grid"):
        ab.averaged_baseline(tmp_path / cbs.RESULTS, task)


def test_complete_runs_the_undecided_pruned_runs_in_full(monkeypatch, tmp_path):
    """The pruned example above: seed 1's 0.004 run in full takes 120 steps, its mean 95 >
    87.5: 0.008 is then the best, exactly; a run that cannot change the best is not rerun."""
    grids = {0: {8: [run(8, 0.004, 70.0), run(8, 0.008, 75.0)],
                 16: [run(16, 0.004, 50.0), run(16, 0.008, math.inf, pruned=True)]},
             1: {8: [run(8, 0.004, math.inf, pruned=True), run(8, 0.008, 100.0)],
                 16: [run(16, 0.004, 60.0), run(16, 0.008, 45.0)]}}
    # At 16, seed 0's 0.008 is bounded below by 50: mean >= (50 + 45) / 2 = 47.5 < 55.
    assert cbs_seeds.undecided({s: g[16] for s, g in grids.items()}) == [(0, 0.008)]
    # Seed 1's 0.004 at 8 can make 0.004 the best only below 2 * 87.5 - 70 = 105 steps;
    # seed 0's 0.008 at 16 below 2 * 55 - 45 = 65.
    assert cbs_seeds.decisive_steps({s: g[8] for s, g in grids.items()}, 1, 0.004) == 105.0
    assert cbs_seeds.decisive_steps({s: g[16] for s, g in grids.items()}, 0, 0.008) == 65.0
    full = {(8, 0.004, 1): 120.0, (16, 0.008, 0): 70.0}
    trained = []

    def train(task, b, lr, seed, *, max_steps, stop_after):
        assert max_steps == 1500  # the task's budget
        trained.append((b, lr, seed, stop_after))
        if full[(b, lr, seed)] > stop_after:  # pruned at the first evaluation past it
            return cbs.Run(b, lr, pruned=True, stopped_at=stop_after + 2)
        return run(b, lr, full[(b, lr, seed)])

    monkeypatch.setattr(cbs, "train", train)
    stored = []
    cbs_seeds.complete(SimpleNamespace(name="gpt", max_steps=1500), grids, log=lambda m: None,
                       on_run=lambda seed, r: stored.append((seed, r.batch_size, r.steps)))
    assert trained == [(8, 0.004, 1, 105.0), (16, 0.008, 0, 65.0)]
    # Both stopped past the decisive steps: their bounds (107 and 67) settle the best.
    assert stored == [(1, 8, math.inf), (0, 16, math.inf)]
    assert cbs_seeds.steps_bounds(grids[1][8])[0.004] == (107.0, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cbs_seeds.averaged_grid(grids) == {8: (0.008, 87.5, 2), 16: (0.004, 55.0, 2)}
    # Run in full where the decisive steps are infinite (no rate exact on every seed).
    trained.clear()
    lone = {0: {8: [run(8, 0.004, 70.0), run(8, 0.008, math.inf, pruned=True)]},
            1: {8: [run(8, 0.004, math.inf, diverged=True), run(8, 0.008, 100.0)]}}
    full[(8, 0.008, 0)] = 90.0
    cbs_seeds.complete(SimpleNamespace(name="gpt", max_steps=1500), lone, log=lambda m: None)
    assert trained == [(8, 0.008, 0, math.inf)]
    assert cbs_seeds.averaged_grid(lone) == {8: (0.008, 95.0, 2)}
    # Stored under "completed", the full runs replace the pruned ones when the grids are read.
    write_grid_files(tmp_path, {0: {8: grids[0][8]}, 1: {8: [run(8, 0.004, math.inf, pruned=True),
                                                              run(8, 0.008, 100.0)]}})
    seeds = json.loads((tmp_path / cbs_seeds.SEED_RESULTS).read_text())
    seeds["completed"] = {"gpt": {"1": {"8": [cbs.run_summary(run(8, 0.004, 120.0))]}}}
    (tmp_path / cbs_seeds.SEED_RESULTS).write_text(json.dumps(seeds))
    loaded = cbs_seeds.load_grids(tmp_path, "gpt")
    assert [(r.lr, r.steps, r.pruned) for r in loaded[1][8]] == [(0.004, 120.0, False),
                                                                 (0.008, 100.0, False)]


def test_complete_first_runs_the_rate_pruned_on_the_fewest_seeds(monkeypatch):
    """No rate exact at batch 8: 0.004 pruned on seeds 0 and 1, 0.008 on seed 2 only. Seed 2's
    0.008 in full (62 steps) makes 0.008 exact at (60 + 55 + 62) / 3 = 59; seed 0's 0.004 can
    then beat it only below 3 * 59 - (55 + 50) = 72 steps, and its bound 74 settles seed 1's
    run unrun. In seed order both 0.004 runs would have run to their end (no exact best)."""
    grids = {0: {8: [run(8, 0.004, math.inf, pruned=True), run(8, 0.008, 60.0)]},
             1: {8: [run(8, 0.004, math.inf, pruned=True), run(8, 0.008, 55.0)]},
             2: {8: [run(8, 0.004, 50.0), run(8, 0.008, math.inf, pruned=True)]}}
    assert cbs_seeds.undecided({s: g[8] for s, g in grids.items()}) == [
        (0, 0.004), (1, 0.004), (2, 0.008)]
    full = {(0.004, 0): 80.0, (0.004, 1): 58.0, (0.008, 2): 62.0}
    trained = []

    def train(task, b, lr, seed, *, max_steps, stop_after):
        trained.append((lr, seed, stop_after))
        if full[(lr, seed)] > stop_after:  # pruned at the first evaluation past it
            return cbs.Run(b, lr, pruned=True, stopped_at=stop_after + 2)
        return run(b, lr, full[(lr, seed)])

    monkeypatch.setattr(cbs, "train", train)
    cbs_seeds.complete(SimpleNamespace(name="gpt", max_steps=1500), grids, log=lambda m: None)
    assert trained == [(0.008, 2, math.inf), (0.004, 0, 72.0)]
    assert cbs_seeds.averaged_grid(grids) == {8: (0.008, 59.0, 3)}


def test_a_pruned_run_records_the_step_it_stopped_at():
    """Evaluations every 64 // 8 = 8 steps, a loss never at the target: pruned at the first
    evaluation past 3, step 8."""
    import torch

    task = cbs.Task(
        name="toy", title="toy", unit="rows", make_model=lambda: torch.nn.Linear(2, 2),
        losses=lambda: (torch.nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss(reduction="none")),
        sample=lambda b, g: (torch.randn(b, 2, generator=g), torch.randint(2, (b,), generator=g)),
        validation_loss=lambda model: 10.0, optimizer="sgd", learning_rates=(0.1,), target=0.0,
        max_steps=100, eval_examples=64, gns_batch=8)
    pruned = cbs.train(task, 8, 0.1, 0, max_steps=task.max_steps, stop_after=3)
    assert pruned.pruned and pruned.eval_steps == [0, 8] and pruned.stopped_at == 8.0
    unpruned = cbs.train(task, 8, 0.1, 0, max_steps=4)  # to the budget: no bound recorded
    assert not unpruned.pruned and unpruned.eval_steps == [0, 4]
    assert math.isnan(unpruned.stopped_at)
