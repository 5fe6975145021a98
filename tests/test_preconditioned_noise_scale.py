"""PreconditionedNoiseScale: exact against per-example gradients times the optimizer's own ``P``.

The reference ``P`` is read from the optimizer's state *after* ``optimizer.step()``
(the moment the update divided by), with torch's own formula for the
denominator: independent of the package's reading of the state before the step.
"""

import math
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import cost_model
from cockpit_gradnoise.extensions import linear as linear_rules
from cockpit_gradnoise.functional import preconditioner as preconditioner_formulas
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.tracking import Tracker

import numpy
import pytest
import torch
from cockpit import Cockpit
from cockpit.utils.schedules import linear

from tests.cases import build, case_named, reference_gradients, run_step
from tests.helpers import rounding_bounds, rows, without_coverage

QUANTITY = "PreconditionedNoiseScale"
STATISTICS = {"grad_sq", "trace_cov", "b_simple", "b_simple_smoothed", "batch_size"}
#: Relative rounding of ``p_j^2`` in float64, on either side (the package's and the
#: reference's): ``v`` (2 operations), its root, the division by ``sqrt(1 - beta2^t)``,
#: ``+ eps``, the reciprocal and the square, each at most one rounding (``EPS64``).
WEIGHT_ROUNDINGS = 2 * 7
EPS64 = numpy.finfo(numpy.float64).eps


def adam_denominator(state, group, moment="exp_avg_sq"):
    """Torch's ``sqrt(v_t) / sqrt(1 - beta2^t) + eps`` from the state after the step."""
    beta2, t = group["betas"][1], float(state["step"])
    return state[moment].sqrt() / math.sqrt(1 - beta2**t) + group["eps"]


def reference_preconditioner(optimizer, param):
    """``P``'s diagonal that ``optimizer.step()`` (just taken) divided by, from its state after it."""
    state = optimizer.state[param]
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    if isinstance(optimizer, torch.optim.Adam):  # AdamW too
        moment = "max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"
        return 1 / adam_denominator(state, group, moment)
    if isinstance(optimizer, torch.optim.RMSprop):
        square = state["square_avg"]
        if group["centered"]:
            square = square - state["grad_avg"] ** 2
        return 1 / (square.sqrt() + group["eps"])
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1 / (state["sum"].sqrt() + group["eps"])
    return torch.ones_like(param)  # SGD


def train_before(problem, optimizer, steps, seed=1):
    """``steps`` untracked optimizer steps on other batches: the optimizer's state."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, len(problem.inputs), (len(problem.inputs),), generator=generator)
        optimizer.zero_grad()
        problem.loss_fn(problem.model(problem.inputs[index]), problem.targets[index]).backward()
        optimizer.step()


def tracked_and_expected(case_name, n, reduction, make_optimizer, steps_before,
                         others=lambda names: []):
    """The quantity's rows at one tracked step, and the brute force's.

    Brute force: per-example gradients (a loop over examples), multiplied by the ``P``
    the optimizer's step after the tracked backward pass divided by.
    """
    case = case_named(case_name)
    problem = build(case, n, reduction)
    optimizer = make_optimizer(problem.params)
    train_before(problem, optimizer, steps_before)
    quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=problem.names)
    quantities = [*others(problem.names), quantity]
    cockpit = run_step(problem, quantities, step=steps_before, optimizer=optimizer)
    got = without_coverage(rows(cockpit, QUANTITY, step=steps_before))
    gradients = reference_gradients(case, problem)
    optimizer.step()
    return (got, *brute_force(problem, optimizer, gradients), cockpit)


def brute_force(problem, optimizer, gradients):
    """GradientNoiseScale's reference of ``P g_i``, ``P`` read after ``optimizer.step()``;
    and the number of elements per name."""
    by_name = dict(zip(problem.names, problem.params))
    preconditioned = {
        name: g * reference_preconditioner(optimizer, by_name[name]) for name, g in gradients.items()
    }
    expected = references.gradient_noise_scale(None, None, problem.inputs, None,
                                               gradients=preconditioned)
    elements = {name: by_name[name].numel() for name in gradients}
    elements["all"] = sum(elements.values())
    return expected, elements


def assert_matches(got, expected, elements, n):
    """Equal to the brute force within rounding: that of GradientNoiseScale's sums over
    ``N`` examples and the elements, plus that of the weights ``p_j^2``."""
    assert set(got) == set(expected)
    for name, stats in expected.items():
        assert set(got[name]) == STATISTICS
        assert got[name]["batch_size"] == n
        grad_sq, trace_cov = stats["grad_sq"], stats["trace_cov"]
        atol_g, atol_t = rounding_bounds(n, elements[name] + WEIGHT_ROUNDINGS, grad_sq, trace_cov)
        assert got[name]["grad_sq"] == pytest.approx(grad_sq, rel=0, abs=atol_g), name
        assert got[name]["trace_cov"] == pytest.approx(trace_cov, rel=0, abs=atol_t), name
        if grad_sq > atol_g:
            rtol = atol_g / grad_sq + atol_t / trace_cov
            assert got[name]["b_simple"] == pytest.approx(stats["b_simple"], rel=rtol, abs=0)
        elif grad_sq < -atol_g:
            assert got[name]["b_simple"] == math.inf
        # First tracked step: (trace_cov / M) / (grad_sq / M), three roundings of b_simple's.
        assert got[name]["b_simple_smoothed"] == pytest.approx(
            got[name]["b_simple"], rel=3 * EPS64, abs=0)


def adam(params):
    return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.9), eps=1e-3)


@pytest.mark.parametrize("case_name", ["mlp", "cnn"])
@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("steps_before", [0, 1, 5], ids=["step1", "step2", "step6"])
def test_adam_matches_brute_force_at_the_first_steps_and_later(case_name, n, reduction, steps_before):
    got, expected, elements, _ = tracked_and_expected(case_name, n, reduction, adam, steps_before)
    assert_matches(got, expected, elements, n)


def test_adam_on_sequences_formed_in_chunks_on_the_host_matches_brute_force(monkeypatch):
    """The GPT case's sequence Linear layers form ``x_i`` one example per chunk on the host
    (``cost_model.HOST_FORMATION_BYTES``): the sums are those of every example, once."""
    formed, forming = [], linear_rules.formed_contributions

    def recording(g, a):
        for x in forming(g, a):
            formed.append(len(x))
            yield x

    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    monkeypatch.setattr(cost_model, "HOST_FORMATION_BYTES", 1)
    monkeypatch.setattr(linear_rules, "formed_contributions", recording)
    got, expected, elements, _ = tracked_and_expected("gpt", 3, "mean", adam, 2)
    assert formed and set(formed) == {1}
    assert_matches(got, expected, elements, 3)


OPTIMIZERS = {
    "adam-coupled-decay": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.3, eps=1e-4),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.3, eps=1e-4),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.5, 0.6), amsgrad=True, eps=1e-4),
    "adam-maximize-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, maximize=True, foreach=True),
    "adam-groups": lambda p: torch.optim.Adam(
        [{"params": p[:1], "betas": (0.9, 0.5), "eps": 1e-2}, {"params": p[1:]}], lr=0.05
    ),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.7, eps=1e-4),
    "rmsprop-centered-momentum": lambda p: torch.optim.RMSprop(
        p, lr=0.01, alpha=0.7, eps=1e-4, centered=True, momentum=0.9, weight_decay=0.1
    ),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1, eps=1e-4),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_optimizer_matches_brute_force(name, reduction):
    got, expected, elements, _ = tracked_and_expected("mlp", 7, reduction, OPTIMIZERS[name], 3)
    assert_matches(got, expected, elements, 7)


def recorded_layouts(monkeypatch):
    """Whether each call's sums of the weighted sums were contiguous, appended to the list returned."""
    layouts, weighted = [], preconditioner_formulas._weighted_sums

    def recorded(weights, squares, gradients):
        layouts.append(squares.is_contiguous())
        return weighted(weights, squares, gradients)

    monkeypatch.setattr(preconditioner_formulas, "_weighted_sums", recorded)
    return layouts


@pytest.mark.parametrize("case_name, name", [
    *(("mlp", name) for name in OPTIMIZERS if not name.startswith("sgd")), ("cnn", "adam-coupled-decay")])
def test_p_formed_in_pieces_with_the_weighted_sums_matches_brute_force(monkeypatch, case_name, name):
    """On the CPU ``P`` is formed piece by piece with the weighted sums
    (``OptimizerPreconditioner.pieces``): pieces of 7 elements, across rows and between
    the state's moments, the gradient and the parameter (coupled decay), each a slice
    of the same elements; a convolution's weight sums (laid out channels last) in
    pieces of whole rows, read in their memory order."""
    from cockpit_gradnoise import _device
    from cockpit_gradnoise.quantities import preconditioners

    monkeypatch.setattr(_device, "CHUNK", 7)
    pieces, layouts = [], recorded_layouts(monkeypatch)
    recording = preconditioners.OptimizerPreconditioner.pieces

    def recorded(reader, param, size):
        pieces.append(size)
        return recording(reader, param, size)

    monkeypatch.setattr(preconditioners.OptimizerPreconditioner, "pieces", recorded)
    got, expected, elements, _ = tracked_and_expected(case_name, 7, "mean", OPTIMIZERS[name], 3)
    assert pieces and (set(pieces) == {7} if case_name == "mlp" else max(pieces) > 7)
    assert case_name == "mlp" or not all(layouts)  # the convolutions' sums: channels last
    assert_matches(got, expected, elements, 7)


def test_pieces_that_do_not_cover_the_sums_are_refused():
    from cockpit_gradnoise.functional import preconditioned_noise_sums

    squares, gradients = torch.ones(10), torch.ones(10)
    with pytest.raises(ValueError, match="cover 9 elements of 10"):
        preconditioned_noise_sums(iter([torch.ones(5), torch.ones(4)]), squares, gradients, 2)
    assert preconditioned_noise_sums(iter([torch.ones(5), torch.ones(5)]), squares, gradients, 2) == (5.0, 2.5)


def test_a_frozen_and_an_unused_parameter_have_no_rows():
    got, expected, elements, _ = tracked_and_expected("unused-frozen", 5, "mean", adam, 2)
    assert_matches(got, expected, elements, 5)
    assert not any("frozen" in name or "unused" in name for name in got)


def test_sgd_gives_gradient_noise_scale_within_their_rounding(reduction):
    """``P = I``: the plain noise scale, from the same examples in another order."""
    n = 7
    got, _, elements, cockpit = tracked_and_expected(
        "cnn", n, reduction, OPTIMIZERS["sgd-momentum"], 2,
        lambda names: [cgn.GradientNoiseScale(linear(1), param_names=names)],
    )
    plain = without_coverage(rows(cockpit, "GradientNoiseScale", step=2))
    assert set(plain) == set(got)
    for name, stats in plain.items():
        atol_g, atol_t = rounding_bounds(n, elements[name], stats["grad_sq"], stats["trace_cov"])
        # Each within its bound of the truth: within twice it of each other.
        assert got[name]["grad_sq"] == pytest.approx(stats["grad_sq"], rel=0, abs=2 * atol_g)
        assert got[name]["trace_cov"] == pytest.approx(stats["trace_cov"], rel=0, abs=2 * atol_t)
        assert got[name]["batch_size"] == stats["batch_size"]


def test_under_accumulation_it_is_that_of_one_batch_of_all_micro_batches(reduction):
    """Two micro-batches (3 and 4 examples), Adam at its third step: the sums of both,
    ``P`` of the accumulated gradient, which the optimizer's step then uses."""
    sizes, case = (3, 4), case_named("mlp")
    problem = build(case, sum(sizes), reduction)
    optimizer = adam(problem.params)
    train_before(problem, optimizer, 2)
    quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=problem.names)
    tracker = Tracker(cgn.Cockpit(problem.params, quantities=[quantity]), problem.names)
    gradients = reference_gradients(case, problem)  # at the step's weights
    optimizer.zero_grad()
    start = 0
    for k, size in enumerate(sizes):
        part = slice(start, start + size)
        start += size
        losses = problem.per_example_loss(problem.model(problem.inputs[part]), problem.targets[part])
        with tracker(2, losses, optimizer=optimizer, reduction=reduction, micro_batch=k,
                     micro_batches=len(sizes)) as loss:
            loss.backward()
    optimizer.step()
    got = without_coverage(rows(tracker.cockpit, QUANTITY, step=2))
    expected, elements = brute_force(problem, optimizer, gradients)
    assert_matches(got, expected, elements, sum(sizes))


def test_beside_gradient_variance_both_read_the_same_sums_unaltered():
    """GradientVarianceQuantiles forms sd over the sums in place where it reads them
    alone (from the second step of an MLP); before this quantity reads them too, it
    must not: both right at every step, in either order."""
    for order in (0, 1):
        case = case_named("mlp")
        problem = build(case, 6, "mean")
        optimizer = adam(problem.params)
        names = problem.names
        variance = cgn.GradientVarianceQuantiles(linear(1), param_names=names)
        quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=names)
        alone = cgn.GradientVarianceQuantiles(linear(1), param_names=names)
        both = Cockpit(problem.params, quantities=[variance, quantity][:: 1 - 2 * order])
        single = Cockpit(problem.params, quantities=[alone])
        for step in range(3):
            gradients = reference_gradients(case, problem)
            run_step(problem, None, step=step, cockpit=single)
            run_step(problem, None, step=step, cockpit=both, optimizer=optimizer)
            optimizer.step()
            variance_rows = rows(both, "GradientVarianceQuantiles", step)
            assert variance_rows == rows(single, "GradientVarianceQuantiles", step)
            expected, elements = brute_force(problem, optimizer, gradients)
            got = without_coverage(rows(both, QUANTITY, step))
            for row in got.values():  # smoothed over steps: not the brute force's
                row["b_simple_smoothed"] = row["b_simple"]
            assert_matches(got, expected, elements, 6)


class MyAdam(torch.optim.Adam):
    """A user's class: its step may do anything."""


@pytest.mark.parametrize("make", [
    lambda p: MyAdam(p), lambda p: torch.optim.NAdam(p), lambda p: torch.optim.Adamax(p),
], ids=["subclass", "nadam", "adamax"])
def test_an_optimizer_not_read_exactly_is_refused_with_a_warning_naming_it(make):
    problem = build(case_named("mlp"), 4, "mean")
    optimizer = make(problem.params)
    quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=problem.names)
    with pytest.warns(UserWarning, match=type(optimizer).__name__ + ".*nothing is recorded"):
        cockpit = run_step(problem, [quantity], optimizer=optimizer)
    assert QUANTITY not in cockpit.get_output()[0] or not cockpit.get_output()[0][QUANTITY]


def test_a_tracked_parameter_not_in_the_optimizer_records_nothing_with_a_warning():
    problem = build(case_named("mlp"), 4, "mean")
    optimizer = adam(problem.params[:2])
    quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=problem.names)
    with pytest.warns(UserWarning, match=r"\['2.weight', '2.bias'\] are not in the optimizer"):
        cockpit = run_step(problem, [quantity], optimizer=optimizer)
    assert not cockpit.get_output()[0].get(QUANTITY)


def test_without_an_optimizer_it_raises_naming_the_fix():
    problem = build(case_named("mlp"), 4, "mean")
    quantity = cgn.PreconditionedNoiseScale(linear(1), param_names=problem.names)
    with pytest.raises(KeyError, match="optimizer=opt"):
        run_step(problem, [quantity])


def test_through_the_front_door_with_accelerate_s_wrapper_shape():
    """``cgn.track(..., quantities=[...])`` and ``tracker(step, losses, optimizer=...)``;
    an optimizer inside a wrapper (as the Hugging Face Trainer's) is read through it."""

    class AcceleratedOptimizer:  # the attribute Accelerate's wrapper holds it in
        def __init__(self, optimizer):
            self.optimizer = optimizer

    problem = build(case_named("mlp"), 5, "mean")
    model, tracker = cgn.track(problem.model, every=1, quantities=[QUANTITY, "GradientNoiseScale"])
    optimizer = adam(list(model.parameters()))
    for step in range(2):
        optimizer.zero_grad()
        losses = problem.per_example_loss(model(problem.inputs), problem.targets)
        with tracker(step, losses, optimizer=AcceleratedOptimizer(optimizer)) as loss:
            loss.backward()
        optimizer.step()
    frame = cgn.to_frame(tracker.cockpit)
    network = frame[(frame.quantity == QUANTITY) & (frame.param == schema.NETWORK)]
    assert set(network.statistic) == STATISTICS and sorted(set(network.step)) == [0, 1]


def adam_run(quantity_names, steps=3, log=None):
    """A tiny MLP trained with Adam through the front door, tracking ``quantity_names``."""
    problem = build(case_named("mlp"), 6, "mean", dtype=torch.float32)
    model, tracker = cgn.track(problem.model, every=1, quantities=quantity_names, log=log)
    optimizer = adam(list(model.parameters()))
    for step in range(steps):
        optimizer.zero_grad()
        losses = problem.per_example_loss(model(problem.inputs), problem.targets)
        with tracker(step, losses, optimizer=optimizer) as loss:
            loss.backward()
        optimizer.step()
    return tracker


def noise_panel(fig):
    (ax,) = [ax for ax in fig.axes if "noise scale B_simple" in ax.get_title()]
    return ax


def test_the_dashboard_draws_it_beside_the_plain_noise_scale_and_alone(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    both = adam_run(["GradientNoiseScale", QUANTITY], log=tmp_path / "run.jsonl")
    drawn = []
    for source in (both, tmp_path / "run.jsonl"):  # a live tracker, its streamed log
        ax = noise_panel(cgn.plot(source, fig=Figure()))
        lines = {line.get_label(): line for line in ax.lines}
        assert {"b_simple (one batch)", "b_simple_smoothed", "b_simple preconditioned (one batch)",
                "b_simple_smoothed preconditioned"} <= set(lines)
        assert "purple: preconditioned" in ax.get_title()
        drawn.append(lines["b_simple_smoothed preconditioned"].get_xydata())
    assert len(drawn[0]) == 3 and numpy.array_equal(drawn[0], drawn[1], equal_nan=True)
    alone = adam_run([QUANTITY])
    ax = noise_panel(cgn.plot(alone.cockpit, fig=Figure()))
    assert ax.get_title().startswith("preconditioned noise scale B_simple")
    assert {"b_simple (one batch)", "b_simple_smoothed", "batch size 6"} <= {
        line.get_label() for line in ax.lines}


# Distributed data parallel: 2 processes ------------------------------------------------------

DDP_CONFIGS = [("mean", (3, 3)), ("mean", (1, 4)), ("sum", (2, 3))]


def ddp_worker(rank, world, port, out):
    """Three tracked DDP steps with Adam per configuration; each process saves its table."""
    import datetime

    import torch.distributed as dist
    from torch import nn

    from tests.ddp_jobs import local_part, table

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for reduction, sizes in DDP_CONFIGS:
            problem = build(case_named("mlp"), sum(sizes), reduction)
            model = nn.parallel.DistributedDataParallel(problem.model)
            inputs = local_part(problem.inputs, sizes)
            targets = local_part(problem.targets, sizes)
            names = problem.names
            cockpit = cgn.Cockpit(problem.params, quantities=[
                cgn.PreconditionedNoiseScale(linear(1), param_names=names),
                cgn.GradientVarianceQuantiles(linear(1), param_names=names),
            ])
            optimizer = adam(problem.params)
            for step in range(3):
                optimizer.zero_grad()
                outputs = model(inputs)
                loss = problem.loss_fn(outputs, targets)
                info = {"individual_losses": problem.per_example_loss(outputs, targets),
                        "loss": loss, "optimizer": optimizer}
                with cockpit(step, info=info):
                    loss.backward()
                optimizer.step()
            results[(reduction, sizes)] = table(cockpit)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def ddp_reference(reduction, sizes):
    """One process: per-example gradients of the whole batch times the ``P`` of Adam
    stepped with DDP's gradient (the mean of the processes' losses' gradients)."""
    from tests.test_distributed import ddp_mean_loss

    case = case_named("mlp")
    problem = build(case, sum(sizes), reduction)
    optimizer = adam(problem.params)
    expected = []
    for _ in range(3):
        gradients = reference_gradients(case, problem)
        optimizer.zero_grad()
        ddp_mean_loss(problem, sizes).backward()
        optimizer.step()
        expected.append(brute_force(problem, optimizer, gradients))
    return expected


@pytest.fixture(scope="module")
def ddp_tables(tmp_path_factory):
    from tests.process_groups import run_group

    results, error, _ = run_group(2, tmp_path_factory.mktemp("ddp"), target=ddp_worker)
    assert len(results) == 2, error
    return results


@pytest.mark.parametrize("reduction, sizes", DDP_CONFIGS)
def test_under_ddp_it_is_that_of_the_global_batch_on_every_process(ddp_tables, reduction, sizes):
    tables = [result[(reduction, sizes)] for result in ddp_tables]
    assert tables[0] == tables[1]  # identical on both processes
    for step, (expected, elements) in enumerate(ddp_reference(reduction, sizes)):
        got = {}
        for (at, quantity, param, statistic), value in tables[0].items():
            if at == step and quantity == QUANTITY:
                got.setdefault(param, {})[statistic] = value
        for row in got.values():  # smoothed over steps: not the brute force's
            row["b_simple_smoothed"] = row["b_simple"]
        assert_matches(got, expected, elements, sum(sizes))


def test_the_adaptive_preset_is_the_five_and_this_one():
    from cockpit_gradnoise.quantities.presets import ALL, PRESETS

    assert PRESETS["adaptive"] == (*ALL, QUANTITY)
    problem = build(case_named("mlp"), 4, "mean")
    built = cgn.configuration("adaptive", 1, problem.model)
    assert [type(q).__name__ for q in built] == [*ALL, QUANTITY]


def test_under_a_grad_scaler_it_is_that_of_the_unscaled_loss():
    """The tracker unscales ``param.grad`` and the sums while the quantities compute:
    ``P`` is that of the gradient ``scaler.step`` gives the optimizer."""
    tables = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        problem = build(case_named("mlp"), 5, "mean")
        model, tracker = cgn.track(problem.model, every=1, quantities=[QUANTITY])
        optimizer = adam(list(model.parameters()))
        for step in range(3):
            optimizer.zero_grad()
            losses = problem.per_example_loss(model(problem.inputs), problem.targets)
            with tracker(step, losses, optimizer=optimizer, scaler=scaler) as loss:
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
        frame = tracker.frame()
        frame = frame[frame.quantity == QUANTITY]  # not the scaler's own rows
        tables.append(dict(zip(zip(frame.step, frame.param, frame.statistic), frame.value)))
    assert tables[0].keys() == tables[1].keys()
    for key, value in tables[0].items():  # powers of two: the division is exact
        assert tables[1][key] == pytest.approx(value, rel=1e-12, abs=0), key


@pytest.mark.parametrize("squares_dtype", [torch.float32, torch.float64])
def test_the_weighted_sums_are_float64_sums_of_exact_products_over_pieces(squares_dtype):
    """More elements than a piece (``_device.CHUNK``), float32 inputs: the products are exact
    in float64, so only the float64 sums round (``n 2**-53`` relative, all terms positive)."""
    from cockpit_gradnoise import _device
    from cockpit_gradnoise.functional import preconditioned_noise_sums

    generator = torch.Generator().manual_seed(0)
    size = 2 * _device.CHUNK + 5
    p = torch.rand(size, generator=generator) * 1e4
    squares = (torch.rand(size, generator=generator) * 1e-30).to(squares_dtype)
    gradients = torch.randn(size, generator=generator) * 1e-20  # T^2 underflows float32
    got = preconditioned_noise_sums(p, squares, gradients, 3)
    p64 = p.double().numpy()
    expected = (float((p64**2 * squares.double().numpy()).sum()) / 3,
                float(((p64 * gradients.double().numpy()) ** 2).sum()) / 9)
    assert got == pytest.approx(expected, rel=size * 2.0**-52, abs=0)
    assert preconditioned_noise_sums(p[:0], squares[:0], gradients[:0], 3) == (0.0, 0.0)


@pytest.mark.parametrize("pieces", [False, True], ids=["whole", "pieces"])
def test_the_weighted_sums_of_channels_last_sums_pair_each_p_with_its_element(pieces):
    """A convolution's sums laid out channels last, over several pieces of whole rows:
    read in their memory order, each ``p_j`` put in that order (a ``p`` paired with
    another element's sums would change both totals)."""
    from cockpit_gradnoise.functional import preconditioned_noise_sums
    from cockpit_gradnoise.functional.preconditioner import piece_size

    generator = torch.Generator().manual_seed(1)
    shape = (40, 64, 9, 9)  # 331,776 elements: 2.5 pieces of 2**17
    p = torch.rand(shape, generator=generator) * 1e3
    squares = torch.rand(shape, generator=generator).to(memory_format=torch.channels_last)
    gradients = torch.randn(shape, generator=generator).to(memory_format=torch.channels_last)
    assert not squares.is_contiguous()
    size = piece_size(squares, gradients)
    assert size % (64 * 81) == 0 and size < p.numel()
    weights = p.reshape(-1).split(size) if pieces else p
    got = preconditioned_noise_sums(iter(weights) if pieces else weights, squares, gradients, 3)
    p64 = p.double().numpy()
    expected = (float((p64**2 * squares.double().numpy()).sum()) / 3,
                float(((p64 * gradients.double().numpy()) ** 2).sum()) / 9)
    assert got == pytest.approx(expected, rel=p.numel() * 2.0**-52, abs=0)


def test_off_the_host_p_whole_and_the_channels_last_sums_match_brute_force(monkeypatch):
    """The path of other devices than the CPU (``_device.on_host`` False: ``P`` whole, pieces of
    ``DEVICE_CHUNK``, results left as tensors until read), on a convolution's channels-last sums."""
    from cockpit_gradnoise import _device

    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    layouts = recorded_layouts(monkeypatch)
    got, expected, elements, _ = tracked_and_expected("cnn", 7, "mean", OPTIMIZERS["adam-coupled-decay"], 3)
    assert not all(layouts)
    assert_matches(got, expected, elements, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_piece_of_p_put_in_the_sums_order_is_torchs_copy_bit_for_bit(dtype):
    """A piece of ``p`` put in a convolution's channels-last order (NumPy's ``copyto`` on the
    CPU for float32 and float64, torch's copy otherwise): the same float64 numbers as torch's."""
    from cockpit_gradnoise.functional.preconditioner import _copy_permuted

    rows = (torch.rand(6, 5, 3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 1e3).to(dtype)
    source = rows.permute(0, 2, 3, 1)
    got = torch.full((6, 3, 3, 5), math.nan, dtype=torch.float64)
    _copy_permuted(got, source)
    assert torch.equal(got, torch.empty_like(got).copy_(source))
