"""experiments/critical_batch_size.py: its formulas against known answers, and its --quick run."""

import json
import math
import re
import shutil
import warnings

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from experiments import cbs_seeds  # noqa: E402
from experiments import critical_batch_size as cbs  # noqa: E402

BATCHES = np.array([8, 16, 32, 64, 128, 256, 512], dtype=float)
# The fit's data below are exact; what is left is where the optimizer stops
# (xtol = ftol = 1e-14 on parameters of order 1 after scaling).
FIT_RTOL = 1e-8


def test_steps_to_target_interpolates_the_first_crossing():
    assert cbs.steps_to_target([0, 10, 20], [3.0, 2.0, 1.0], 1.5) == 15.0
    assert cbs.steps_to_target([0, 10, 20], [3.0, 2.0, 1.0], 2.0) == 10.0
    # The first crossing counts, not a later one after the loss rose again.
    assert cbs.steps_to_target([0, 10, 20, 30], [3.0, 1.0, 2.5, 0.5], 1.5) == 7.5
    assert cbs.steps_to_target([5, 10], [1.0, 0.5], 2.0) == 5.0
    assert cbs.steps_to_target([0, 10], [3.0, 2.0], 1.0) == math.inf


def test_steps_to_target_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one length"):
        cbs.steps_to_target([0, 10], [3.0], 1.0)


def test_predicted_steps_lie_on_the_papers_hyperbola():
    s_min, e_min = 70.0, 2100.0
    s = cbs.predicted_steps(BATCHES, s_min, e_min)
    e = BATCHES * s
    np.testing.assert_allclose((s / s_min - 1) * (e / e_min - 1), 1.0, rtol=1e-14)


@pytest.mark.parametrize("s_min, e_min", [(100.0, 3200.0), (20.0, 1e5), (500.0, 50.0)])
def test_fit_recovers_known_parameters(s_min, e_min):
    """Exact steps from known S_min, E_min, including B_crit outside the batches (5000, 0.1)."""
    steps = cbs.predicted_steps(BATCHES, s_min, e_min)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fitted = cbs.fit_steps_examples(BATCHES, steps)
    np.testing.assert_allclose(fitted, (s_min, e_min), rtol=FIT_RTOL)
    assert cbs.critical_batch(*fitted) == pytest.approx(e_min / s_min, rel=2 * FIT_RTOL)


def test_fit_scales_with_the_steps_and_keeps_b_crit():
    """Noisy steps: multiplying every S by c multiplies S_min and E_min by c."""
    noise = np.exp(np.random.default_rng(0).normal(0, 0.2, len(BATCHES)))
    steps = cbs.predicted_steps(BATCHES, 100.0, 3200.0) * noise
    s_min, e_min = cbs.fit_steps_examples(BATCHES, steps)
    scaled = cbs.fit_steps_examples(BATCHES, 3 * steps)
    np.testing.assert_allclose(scaled, (3 * s_min, 3 * e_min), rtol=1e-6)
    # It is the least-squares fit in log space: moving either parameter costs.
    def cost(p):
        return np.sum((np.log(steps) - np.log(cbs.predicted_steps(BATCHES, *p))) ** 2)
    for move in ((1.001, 1.0), (0.999, 1.0), (1.0, 1.001), (1.0, 0.999)):
        assert cost((s_min * move[0], e_min * move[1])) > cost((s_min, e_min))


def test_fit_leaves_out_batches_that_never_reached_the_target():
    steps = cbs.predicted_steps(BATCHES, 100.0, 3200.0)
    steps[0] = math.inf
    np.testing.assert_allclose(cbs.fit_steps_examples(BATCHES, steps), (100.0, 3200.0),
                               rtol=FIT_RTOL)


def test_fit_with_fewer_than_two_points_is_nan_with_a_warning():
    with pytest.warns(UserWarning, match="two batch sizes"):
        fitted = cbs.fit_steps_examples([8, 16], [100.0, math.inf])
    assert all(math.isnan(v) for v in fitted)
    assert math.isnan(cbs.critical_batch(*fitted))


def test_fit_at_a_bound_warns():
    """Steps that do not fall with B: E_min = 0; steps falling as 1/B: S_min = 0."""
    with pytest.warns(UserWarning, match="bound"):
        s_min, e_min = cbs.fit_steps_examples(BATCHES, np.full(len(BATCHES), 50.0))
    assert (s_min, e_min) == (pytest.approx(50.0, rel=1e-14), 0.0)
    assert cbs.critical_batch(s_min, e_min) == 0.0
    with pytest.warns(UserWarning, match="bound"):
        s_min, e_min = cbs.fit_steps_examples(BATCHES, 4096.0 / BATCHES)
    assert (s_min, e_min) == (0.0, pytest.approx(4096.0, rel=1e-14))
    assert cbs.critical_batch(s_min, e_min) == math.inf


def test_value_range_over_a_window_of_steps():
    steps, values = [0, 1, 2, 3, 4], [5.0, math.inf, 1.0, 9.0, 2.0]
    assert cbs.value_range(steps, values, 1, 3) == (1.0, 9.0)
    assert all(math.isnan(v) for v in cbs.value_range(steps, values, 10, 20))


def test_critical_batch_and_agreement_factor():
    assert cbs.critical_batch(100.0, 3200.0) == 32.0
    assert cbs.critical_batch(0.0, 10.0) == math.inf
    assert math.isnan(cbs.critical_batch(0.0, 0.0))
    assert cbs.agreement_factor(10.0, 1000.0) == 100.0
    assert cbs.agreement_factor(10.0, 5.0) == 2.0
    assert math.isnan(cbs.agreement_factor(math.inf, 5.0))
    assert math.isnan(cbs.agreement_factor(10.0, math.nan))


def test_value_at_step_takes_the_last_tracked_step_before():
    assert cbs.value_at_step([0, 1, 2, 3], [5.0, 6.0, 7.0, 8.0], 2.5) == 7.0
    assert cbs.value_at_step([0, 1, 2, 3], [5.0, 6.0, 7.0, 8.0], 3) == 8.0
    assert math.isnan(cbs.value_at_step([1, 2], [5.0, 6.0], 0.5))
    assert math.isnan(cbs.value_at_step([1, 2], [5.0, 6.0], math.inf))


def test_encode_text_maps_outside_characters_to_the_replacement():
    assert len(cbs.VOCABULARY) == 96
    codes = cbs.encode_text("a\tb\n\u00e9")
    assert "".join(cbs.VOCABULARY[i] for i in codes) == "a?b\n?"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``--quick`` run once: its results and its output folder."""
    out = tmp_path_factory.mktemp("cbs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results, page = cbs.main(["--quick", "--out", str(out)])
    return results, page, out


def test_quick_run_writes_the_page_and_figures(quick):
    results, page, out = quick
    assert page == out / cbs.PAGE
    text = page.read_text()
    for result in results:
        figure = out / f"critical-batch-size-{result.task.name}.png"
        assert 0 < figure.stat().st_size < 200_000
        assert f"({figure.name})" in text
        assert f"## {result.task.title}" in text
    assert [r.task.name for r in results] == ["digits", "gpt"]
    assert "python -m experiments.critical_batch_size --quick --out" in text
    for package in ("torch", "backpack-for-pytorch", "cockpit-for-pytorch", "python"):
        assert f"| {package} |" in text


def test_quick_run_numbers_are_sane(quick):
    results, _, _ = quick
    for result in results:
        assert list(result.runs) == [8, 32]
        batches, steps = result.measured()
        assert np.all(steps > 0) and np.all(np.isfinite(steps))
        if len(batches) >= 2:  # the fit is defined: finite, non-negative
            assert result.s_min >= 0 and result.e_min >= 0
            assert math.isfinite(result.s_min) and math.isfinite(result.e_min)
        if result.gns_run is not None:
            # The Cockpit does not change training: the same run reaches the target
            # at the same step as in the sweep.
            best = cbs.best_of(result.runs[result.task.gns_batch])
            assert result.gns_run.steps == best.steps
            tracked, values = result.series("b_simple_smoothed")
            assert len(tracked) >= result.gns_run.steps
            assert result.b_simple > 0


def test_replot_rewrites_the_same_page_from_the_stored_numbers(quick):
    _, page, out = quick
    text = page.read_text()
    page.unlink()
    (out / "critical-batch-size-gpt.png").unlink()
    results, replotted = cbs.main(["--replot", "--out", str(out)])
    note = re.compile(r" The figures and this page were last redrawn with `--replot` at "
                      r"commit [^.]+\.")
    assert len(note.findall(replotted.read_text())) == 1
    assert note.sub("", replotted.read_text()) == text
    assert (out / "critical-batch-size-gpt.png").stat().st_size > 0
    assert [r.task.name for r in results] == ["digits", "gpt"]


@pytest.fixture(scope="module")
def quick_seeds(quick, tmp_path_factory):
    """A copy of the ``--quick`` run's folder, then ``--seeds 1`` (training seed 1)."""
    out = tmp_path_factory.mktemp("cbs_seeds")
    shutil.copytree(quick[2], out, dirs_exist_ok=True)
    results = (out / cbs.RESULTS).read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cbs.main(["--quick", "--tasks", "gpt", "--seeds", "1", "--out", str(out)])
    return out, results


def test_seeds_run_the_grid_beside_the_results_without_touching_them(quick_seeds):
    out, results = quick_seeds
    assert (out / cbs.RESULTS).read_bytes() == results
    grids = cbs_seeds.load_grids(out, "gpt")
    assert sorted(grids) == [0, 1]
    steps = {seed: grid[8][0].steps for seed, grid in grids.items()}
    assert steps[0] != steps[1]  # the seed changes the runs
    # One learning rate, no pruning: the average is the plain mean over the seeds.
    averaged = cbs_seeds.averaged_grid(grids)
    assert averaged[8] == (0.01, pytest.approx((steps[0] + steps[1]) / 2, rel=1e-15), 2)
    stored = json.loads((out / cbs_seeds.SEED_RESULTS).read_text())
    assert stored["grids"]["gpt"]["1"]["complete"] and stored["data_seed"] == 0
    assert stored["commands"] == [
        f"python -m experiments.critical_batch_size --quick --tasks gpt --seeds 1 --out {out}"]
    with pytest.raises(SystemExit):
        cbs.main(["--quick", "--tasks", "gpt", "--seeds", "1", "--first-seed", "0",
                  "--out", str(out)])


def test_the_page_shows_the_grid_over_seeds(quick, quick_seeds):
    from experiments.critical_batch_size_page import more_seeds

    out, _ = quick_seeds
    text = "\n".join(more_seeds(quick[0], out))
    assert "## The grid on more seeds" in text
    assert "### gpt: the grid on training seeds 0, 1" in text
    assert "--seeds 1" in text
    assert "### digits" not in text  # one seed: no section
    assert more_seeds(quick[0], quick[2]) == []  # no seeds file: no section
