"""UpdateSize: against brute force, on irregular schedules, in Cockpit's own plots."""

import gc
import math
import random

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.quantities.update_size import LayerUpdate

import json_tricks
import matplotlib
import pytest
import torch
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear

from tests.cases import MODELS, build, run_step
from tests.helpers import assert_statistics_match, rows


def snapshot(names, params):
    return {name: p.detach().clone() for name, p in zip(names, params)}


def test_matches_reference(model_case, reduction, batch_size, recwarn):
    problem = build(model_case, batch_size, reduction)
    quantity = cgn.UpdateSize(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    optimizer = torch.optim.SGD(problem.params, lr=0.3, momentum=0.9, weight_decay=0.1)
    snapshots = []
    for step in range(3):
        run_step(problem, None, step, cockpit, optimizer)
        snapshots.append(snapshot(problem.names, problem.params))
        optimizer.step()
    for step in (0, 1):
        expected = references.update_size(snapshots[step], snapshots[step + 1])
        assert_statistics_match(rows(cockpit, "UpdateSize", step), expected)
    assert sorted(cockpit.get_output()) == [0, 1]  # step 2 has no end yet


def simulate(calls, schedule, perturb):
    """Run UpdateSize on a tiny parameter list; return its output and brute force.

    ``calls`` are the steps at which the cockpit is called, in order; between
    calls the parameters change by ``perturb``. Brute force: store step ``s``
    iff ``schedule(s)``, the call after ``s`` is ``s + 1`` and ``s`` is after
    every step stored before (a record is never overwritten).
    """
    torch.manual_seed(0)
    params = [torch.randn(3, 2, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)]
    names = ["weight", "bias"]
    quantity = cgn.UpdateSize(schedule, param_names=names)
    states, expected = {}, {}
    for index, step in enumerate(calls):
        states[index] = snapshot(names, params)
        quantity.track(step, params, None)
        if (index > 0 and calls[index - 1] == step - 1 and schedule(step - 1)
                and all(step - 1 > stored for stored in expected)):
            expected[step - 1] = references.update_size(states[index - 1], states[index])
        assert quantity.cached_bytes() <= sum(p.numel() * p.element_size() for p in params)
        for p in params:
            p.add_(perturb(p))
    got = {
        step: LayerUpdate.statistics_of_list(value) for step, value in quantity.get_output().items()
    }
    return got, expected


@pytest.mark.parametrize(
    "calls, schedule",
    [
        (list(range(12)), lambda s: s in (0, 3, 4, 9, 11)),  # skips steps; 11 has no end
        (list(range(0, 20, 2)), linear(1)),  # every other step: never an end
        ([0, 1, 2, 5, 6, 7, 7, 8, 3, 4], linear(1)),  # gaps, a repeated step, a restart (no 3)
        ([0, 2, 3, 4, 10, 11], lambda s: s in (1, 2, 4, 10)),  # start 1 never called
    ],
    ids=["skipping-schedule", "every-other-call", "gaps-and-repeats", "untracked-start"],
)
def test_irregular_schedules_store_exactly_the_one_step_updates(calls, schedule):
    got, expected = simulate(calls, schedule, lambda p: 0.1 * torch.ones_like(p))
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert_statistics_match(got[step], expected[step])


def test_random_schedule_and_calls_match_brute_force():
    generator = random.Random(0)
    calls = sorted(generator.sample(range(600), 300))
    chosen = set(generator.sample(range(600), 200))
    got, expected = simulate(calls, lambda s: s in chosen, lambda p: 0.01 * torch.randn_like(p))
    assert len(expected) > 30
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert_statistics_match(got[step], expected[step])


def test_relative_is_inf_for_all_zero_start_never_nan():
    got, _ = simulate([0, 1], linear(1), lambda p: torch.zeros_like(p))
    assert got[0]["bias"] == {"norm": 0.0, "relative": math.inf}  # 0 / 0
    got, _ = simulate([0, 1], linear(1), lambda p: torch.ones_like(p))
    assert got[0]["bias"] == {"norm": 2.0, "relative": math.inf}
    assert math.isfinite(got[0]["all"]["relative"])


def test_cache_holds_one_reused_copy_over_10000_steps():
    """Memory does not grow: one copy, the same buffers, no other tensors kept."""
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    one_copy = sum(p.numel() * p.element_size() for p in params)
    generator = random.Random(1)
    chosen = {s for s in range(10_000) if generator.random() < 0.7}
    quantity = cgn.UpdateSize(lambda s: s in chosen, param_names=["w", "b"])
    tensors_before, reused = [], 0
    with torch.no_grad():
        for step in range(10_000):
            if generator.random() < 0.1:
                continue  # the training loop skips the cockpit now and then
            before = [t.data_ptr() for t in quantity.cached_tensors()]
            quantity.track(step, params, None)
            assert quantity.cached_bytes() in (0, one_copy)
            if before and step in chosen:  # a start right after a cached step
                assert [t.data_ptr() for t in quantity.cached_tensors()] == before
                reused += 1
            for p in params:
                p.add_(0.001)
            if step == 100:
                # Held: no tensor of another test freed meanwhile lends its id to a new one.
                tensors_before = live_tensors()
    known = {id(t) for t in tensors_before} | {id(t) for t in quantity.cached_tensors()}
    assert [t for t in live_tensors() if id(t) not in known] == []
    assert reused > 4000
    value = next(iter(quantity.get_output().values()))
    assert all(isinstance(v, LayerUpdate) and type(v.norm) is float for v in value)


def live_tensors():
    """Every tensor alive (after a collection): new ones are the test's concern, not the
    count, which other tests' objects freed meanwhile would lower."""
    gc.collect()
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


@pytest.mark.parametrize("cache_on_cpu", [False, True])
def test_cache_has_no_autograd_history_and_lives_on_the_chosen_device(cache_on_cpu):
    problem = build(MODELS[0], 7, "mean")
    quantity = cgn.UpdateSize(linear(1), param_names=problem.names, cache_on_cpu=cache_on_cpu)
    run_step(problem, [quantity])
    assert len(quantity.cached_tensors()) == len(problem.params)  # zip below compares them all
    for buffer, param in zip(quantity.cached_tensors(), problem.params):
        assert not buffer.requires_grad and buffer.grad_fn is None
        assert buffer.device == (torch.device("cpu") if cache_on_cpu else param.device)
        assert torch.equal(buffer, param.detach()) and buffer.data_ptr() != param.data_ptr()


def test_log_round_trip_through_cockpit_write_and_write_log(tmp_path):
    problem = build(MODELS[2], 7, "mean")
    quantity = cgn.UpdateSize(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    for step in range(4):
        run_step(problem, None, step, cockpit, optimizer)
        optimizer.step()
    with torch.no_grad():  # a zero parameter: relative is inf, which Cockpit.write must survive
        problem.model[0].bias.zero_()
    run_step(problem, None, 4, cockpit, optimizer)
    run_step(problem, None, 5, cockpit, optimizer)
    cockpit.write(str(tmp_path / "cockpit"))
    cgn.write_log(cockpit, tmp_path / "ours")
    live = cgn.to_frame(cockpit)
    assert math.isinf(live[(live.step == 4) & (live.param == "0.bias")].value.max())
    for path in (tmp_path / "cockpit.json", tmp_path / "ours.json"):
        assert cgn.to_frame(path).equals(live)
        loaded = json_tricks.loads(path.read_text())
        assert [type(v) for v in loaded["0"]["UpdateSize"]] == [LayerUpdate] * 4
    assert set(live.statistic) == {"norm", "relative"}
    assert set(live.param) == set(problem.names) | {"all"}


def test_cockpit_plotter_distance_panel_shows_network_update_norm(tmp_path):
    """Cockpit's full configuration with our UpdateSize in place of its own,
    plus our other quantities, in float32 (Cockpit's HessMaxEV needs it)."""
    # Cockpit's second-order quantities need BackPACK's converter and its hooks.
    problem = build(MODELS[2], 16, "mean", dtype=torch.float32, converter=True)
    schedule, names = linear(1), problem.names
    ours = [
        cgn.GradientVarianceQuantiles(schedule, param_names=names),
        cgn.PerExampleGradNorm(schedule, param_names=names),
        cgn.ParamGradRatio(schedule, param_names=names),
        cgn.UpdateSize(schedule, param_names=names),
        cgn.GradientNoiseScale(schedule, param_names=names),
    ]
    theirs = [q for q in configuration("full", schedule) if type(q).__name__ != "UpdateSize"]
    cockpit = cgn.Cockpit(problem.params, quantities=ours + theirs)
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    for step in range(3):
        run_step(problem, None, step, cockpit, optimizer)
        optimizer.step()
    frame = cgn.to_frame(cockpit)
    assert set(frame.quantity) == {type(q).__name__ for q in ours}
    network = frame[(frame.quantity == "UpdateSize") & (frame.param == "all")]
    network = network[network.statistic == "norm"].set_index("step").value
    assert list(network.index) == [0, 1]

    cockpit.write(str(tmp_path / "log"))
    for source in (cockpit, str(tmp_path / "log")):
        assert_distance_panel_shows(source, network, tmp_path)


def assert_distance_panel_shows(source, network, tmp_path):
    """Cockpit's plotter renders ``source``; its Distance panel plots ``network``."""
    plotter = cgn.CockpitPlotter()
    with matplotlib.rc_context():
        plotter.plot(source, show_plot=False, save_plot=True, savedir=str(tmp_path))
    matplotlib.pyplot.close(plotter.fig)
    matplotlib.pyplot.ioff()
    image = tmp_path / "cockpit__primary.png"
    assert image.stat().st_size > 0
    image.unlink()
    data = plotter.tracking_data.set_index("iteration").UpdateSize_all.dropna()
    assert data.to_dict() == pytest.approx(network.to_dict(), rel=1e-12)
    (distance,) = [ax for ax in plotter.fig.axes if ax.get_title() == "Distance"]
    (twin,) = [
        ax for ax in plotter.fig.axes
        if ax is not distance and ax.get_shared_x_axes().joined(ax, distance)
    ]
    plotted = twin.collections[0].get_offsets()
    assert list(plotted[:, 1]) == pytest.approx(list(network.values), rel=1e-6)
    assert not twin.yaxis_inverted()
