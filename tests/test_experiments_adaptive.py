"""experiments/adaptive_batch.py: its formulas against hand-computed answers, and its --quick run."""

import json
import math
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from experiments import adaptive_batch as ab  # noqa: E402
from experiments import critical_batch_size as cbs  # noqa: E402

#: The arms of the quick run: all but the ablation, which is adaptive-per-example's code again.
ARMS = [arm for arm in ab.ARMS if arm != ab.ABLATION]
BATCHES = np.array([4, 8, 16, 32, 64, 128, 256, 512, 4096], dtype=float)


def test_a_fixed_batch_on_the_fitted_frontier_has_value_one():
    s_min, e_min = 100.0, 2000.0
    steps = cbs.predicted_steps(BATCHES, s_min, e_min)
    values = ab.frontier_value(steps, BATCHES * steps, s_min, e_min)
    np.testing.assert_allclose(values, 1.0, rtol=1e-13)
    # B_crit = 20: twice the fewest steps and twice the fewest examples.
    assert ab.frontier_value(200.0, 4000.0, s_min, e_min) == 1.0
    assert ab.frontier_value(150.0, 3000.0, s_min, e_min) == 0.25


def test_beats_frontier_is_below_the_hyperbola():
    s_min, e_min = 100.0, 2000.0
    for b in BATCHES:
        s = float(cbs.predicted_steps(b, s_min, e_min))
        assert ab.beats_frontier(s * 0.999, b * s, s_min, e_min)
        assert not ab.beats_frontier(s * 1.001, b * s, s_min, e_min)
        assert not ab.beats_frontier(s, b * s * 1.001, s_min, e_min)
    # No fixed batch reaches the loss in S_min steps or E_min examples.
    assert ab.beats_frontier(100.0, 1e6, s_min, e_min)
    assert ab.beats_frontier(1e6, 2000.0, s_min, e_min)
    # Inside both: a frontier value above 1, yet it beats every fixed batch.
    assert ab.frontier_value(50.0, 1000.0, s_min, e_min) == 0.25
    assert ab.beats_frontier(50.0, 1000.0, s_min, e_min)


def test_examples_at_a_fractional_step_counts_that_steps_batch_in_proportion():
    batches = [8, 8, 16, 32]
    assert ab.examples_at(0, batches) == 0.0
    assert ab.examples_at(2, batches) == 16.0
    assert ab.examples_at(2.5, batches) == 24.0
    assert ab.examples_at(3.25, batches) == 40.0
    assert ab.examples_at(4, batches) == 64.0
    assert ab.examples_at(math.inf, batches) == math.inf
    with pytest.raises(ValueError, match="past"):
        ab.examples_at(4.5, batches)


def test_warmup_doubles_at_the_fractions_of_its_budget():
    budget = 800.0  # doublings at 100, 200, 400 examples
    assert [ab.warmup_batch(seen, 8, budget) for seen in (0, 99, 100, 199, 200, 399, 400, 1e9)] \
        == [8, 8, 16, 16, 32, 32, 64, 64]


def test_table_schedule_changes_batch_and_learning_rate_together():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    schedule = ab.TableSchedule(lambda seen: 8 if seen < 16 else 32, {8: 0.1, 32: 0.4})
    batches = []
    for step in range(4):
        batches.append(schedule.batch)
        schedule.update(step, None, opt)
    assert batches == [8, 8, 32, 32]
    assert opt.param_groups[0]["lr"] == 0.4
    assert [(c["step"], c["batch"], c["new_batch"], c["lr_factor"]) for c in schedule.changes] \
        == [(1, 8, 32, 4.0)]


def test_train_scheduled_counts_steps_and_examples_of_a_growing_batch():
    """Batch 8 then 16 from 32 examples on: S and E from the evaluations and the batches."""
    task = cbs.make_tasks(True, 0)["digits"]
    schedule = ab.TableSchedule(lambda seen: 8 if seen < 32 else 16, {8: 0.2, 16: 0.2})
    run = ab.train_scheduled(task, schedule, 0.2, 0, arm="warmup", max_steps=task.max_steps)
    assert run.batches[:6] == [8, 8, 8, 8, 16, 16]
    assert math.isfinite(run.steps)
    assert run.examples == pytest.approx(ab.examples_at(run.steps, run.batches))
    # Evaluations every 64 examples: 4 steps of 8 and 2 of 16, then 4 steps of 16.
    assert run.eval_steps[:3] == [0, 6, 10]
    assert len(run.batches) == run.eval_steps[-1]
    assert [c["new_batch"] for c in run.changes] == [16]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``--quick`` run once, one seed: its stored numbers and its output folder."""
    out = tmp_path_factory.mktemp("adaptive")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stored, page = ab.main(["--quick", "--seeds", "1", "--arms", ",".join(ARMS),
                                "--out", str(out)])
    return stored, page, out


def test_quick_run_writes_page_figures_and_json(quick):
    stored, page, out = quick
    text = page.read_text()
    assert [entry["task"] for entry in stored] == ["digits", "gpt"]
    for entry in stored:
        path = out / ab.RESULTS.format(task=entry["task"])
        assert json.loads(path.read_text()) == entry
        figure = out / f"adaptive-batch-{entry['task']}.png"
        assert 0 < figure.stat().st_size < 200_000
        assert f"({figure.name})" in text
        assert sorted(r["arm"] for r in entry["runs"]) == sorted(ARMS)
        for run in entry["runs"]:
            assert f"| {run['arm']} | 0 |" in text
            assert math.isfinite(run["steps"])  # the quick targets are easy
    assert "python -m experiments.adaptive_batch --quick --seeds 1 --arms" in text


def test_quick_adaptive_runs_grow_through_accumulation(quick):
    stored, _, _ = quick
    for entry in stored:
        for run in entry["runs"]:
            if run["arm"].startswith("adaptive"):
                assert run["batches"][0] == ab.START_BATCH
                assert all(ab.START_BATCH <= b <= ab.MAX_BATCH for b in run["batches"])
                # Each change recorded is one the run's batches show.
                for change in run["changes"]:
                    assert run["batches"][change["step"] + 1] == change["new_batch"]


def test_quick_fixed_avg_runs_its_stored_batch_and_rate(quick):
    """--quick has no seed-averaged grid: fixed-avg takes its one-seed grid's B_crit rounded
    and that grid's best rate at the nearest batch, stored, and its runs keep both."""
    stored, page, _ = quick
    for entry in stored:
        baseline = ab.baseline_from_json(entry["baseline"])
        settings = entry[ab.FIXED_AVG]
        assert settings["batch"] == ab.fixed_batch(baseline)
        assert settings["lr"] == baseline.best_lr[settings["lr_of_batch"]]
        run = next(r for r in entry["runs"] if r["arm"] == ab.FIXED_AVG)
        assert set(run["batches"]) == {settings["batch"]}
        assert set(run["lrs"]) == {settings["lr"]}
    assert "- fixed-avg (the sanity check on the grid" in page.read_text()


def test_replot_rewrites_the_same_page(quick):
    _, page, out = quick
    text = page.read_text()
    page.unlink()
    (out / "adaptive-batch-gpt.png").unlink()
    _, replotted = ab.main(["--replot", "--out", str(out)])
    assert replotted.read_text() == text
    assert (out / "adaptive-batch-gpt.png").stat().st_size > 0


def test_a_rerun_keeps_the_replaced_runs_and_the_page_compares_the_rules(quick, tmp_path):
    stored, _, out = quick
    for entry in stored:
        runs = {r["arm"]: r for r in entry["runs"]}
        assert runs["adaptive-norms"]["rule"] == ab.RULE and runs["warmup"]["rule"] == ""
        before = dict(runs["adaptive-norms"], steps=2 * runs["adaptive-norms"]["steps"])
        del before["rule"]  # as stored before rules were: read as the first
        assert ab.run_from_json(before).rule == ab.RULES[0]
        (tmp_path / ab.RESULTS.format(task=entry["task"])).write_text(
            json.dumps(dict(entry, replaced=[before])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, page = ab.main(["--quick", "--seeds", "1", "--tasks", "digits", "--arms", "warmup",
                           "--resume", "--rerun", "--out", str(tmp_path)])
    digits = json.loads((tmp_path / ab.RESULTS.format(task="digits")).read_text())
    old_warmup = next(r for r in stored[0]["runs"] if r["arm"] == "warmup")
    assert [r["arm"] for r in digits["replaced"]] == ["adaptive-norms", "warmup"]
    assert digits["replaced"][1] == old_warmup  # kept as it was stored
    text = page.read_text()
    for entry in stored:
        baseline = ab.baseline_from_json(entry["baseline"])
        new = next(ab.run_from_json(r) for r in entry["runs"] if r["arm"] == "adaptive-norms")
        old = ab.frontier_value(2 * new.steps, new.examples, baseline.s_min, baseline.e_min)
        value = new.frontier(baseline.s_min, baseline.e_min)
        assert (f"| {entry['task']} | adaptive-norms | 1 | {old:.3g} -> {value:.3g} | "
                f"{2 * new.steps:.1f} -> {new.steps:.1f} |") in text


def test_a_rerun_of_fixed_avg_sets_it_again_from_the_grid_and_keeps_the_old(quick, tmp_path):
    """The grid may grow after fixed-avg ran: --rerun sets its batch and rate again (here from
    --quick's grid) and keeps the settings the replaced runs ran with."""
    stored, _, _ = quick
    digits = next(e for e in stored if e["task"] == "digits")
    old = dict(digits[ab.FIXED_AVG], batch=999, lr=9.0)  # as if set from a smaller grid
    path = tmp_path / ab.RESULTS.format(task="digits")
    path.write_text(json.dumps({**digits, ab.FIXED_AVG: old}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ab.main(["--quick", "--seeds", "1", "--tasks", "digits", "--arms", ab.FIXED_AVG,
                 "--resume", "--rerun", "--out", str(tmp_path)])
    again = json.loads(path.read_text())
    assert again[ab.REPLACED_SETTINGS] == [old]
    assert again[ab.FIXED_AVG] == digits[ab.FIXED_AVG]  # the same grid gives the same arm
    run = next(r for r in again["runs"] if r["arm"] == ab.FIXED_AVG)
    assert set(run["batches"]) == {digits[ab.FIXED_AVG]["batch"]}
    assert [r["arm"] for r in again["replaced"]] == [ab.FIXED_AVG]


def test_the_page_states_every_arm_against_the_seed_averaged_frontier_too(quick, tmp_path):
    """A seed-averaged baseline (here a made-up one) gives a second row of values, a column
    per run and the fixed batch's sanity check, each the frontier value against it."""
    from experiments import adaptive_batch_page

    stored, _, _ = quick
    fair = {entry["task"]: ab.Baseline(entry["task"], entry["baseline"]["target"], 5.0, 100.0,
                                       20.0, [[8, 17.5], [32, 8.125]], {8: 0.2, 32: 0.2},
                                       "made up", [0, 1]) for entry in stored}
    tasks = cbs.make_tasks(True, 0)
    text = adaptive_batch_page.write_page(stored, tasks, tmp_path, fair).read_text()
    for entry in stored:
        runs = [ab.run_from_json(r) for r in entry["runs"]]
        values = {arm: np.mean([ab.frontier_value(r.steps, r.examples, 5.0, 100.0)
                                for r in runs if r.arm == arm]) for arm in ARMS}
        row = next(line for line in text.splitlines()
                   if line.startswith(f"| {entry['task']}, seed-averaged frontier |"))
        assert row.split(" | ")[1:3] == [f"{values[a]:.3g} (1 of 1)" for a in ARMS[:2]]
        warmup = next(r for r in runs if r.arm == "warmup")
        assert (f"| {warmup.steps:.1f} | {warmup.examples:,.0f} | "
                f"{warmup.frontier(entry['baseline']['s_min'], entry['baseline']['e_min']):.3g}"
                f" | {warmup.seconds:.0f} | "
                f"{ab.frontier_value(warmup.steps, warmup.examples, 5.0, 100.0):.3g} |") in text
        # On the fit: 17.5 steps at batch 8 is S_min + E_min / 8.
        assert "(batch: value): 8: 1, 32: 1;" in text
        assert f"the fixed batch (1 seeds) comes to {values['fixed']:.3g}" in text
    adaptive_batch_page.plot_task(ab.baseline_from_json(stored[0]["baseline"]), runs, "x",
                                  tmp_path / "f.png", fair=fair[stored[0]["task"]])
    assert (tmp_path / "f.png").stat().st_size > 0


def test_a_folder_without_the_fixed_arm_gets_its_page_without_the_readings(quick, tmp_path):
    """Runs of some arms only (held-out seeds in a folder of their own): the page is written
    without the fixed arm's line, and the hand-written readings, which are of the runs in
    docs/experiments, only where asked for."""
    from experiments import adaptive_batch_page
    from experiments.adaptive_batch_reading import WHY

    stored, _, _ = quick
    some = [dict(entry, fixed=None, runs=[r for r in entry["runs"] if r["arm"] == "warmup"])
            for entry in stored]
    tasks = cbs.make_tasks(True, 0)
    text = adaptive_batch_page.write_page(some, tasks, tmp_path, readings=False).read_text()
    assert "- fixed: batch" not in text and "| warmup | 1 | 1 |" in text
    assert WHY[0] not in text and "this page has the generated parts only" in text
    text = adaptive_batch_page.write_page(stored, tasks, tmp_path).read_text()
    assert WHY[0] in text and "- fixed: batch" in text
