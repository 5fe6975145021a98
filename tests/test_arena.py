"""The sums of one backward pass in one buffer (``extensions.arena``), sd and SNR formed over it."""

import weakref

import cockpit_gradnoise as cgn
from cockpit_gradnoise import Cockpit, functional, references
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, arena

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear

from tests.cases import build, case_named, reference_gradients, run_step
from tests.helpers import assert_statistics_match, sd_rtol, snr_atol

#: The case matrix's models whose sums are all written by ``sums.stacked``: Linear
#: layers on examples without positions, biases, embeddings, RMSNorm, unused and frozen layers.
TILING = ["mlp", "mlp-nobias", "embedding", "unused-frozen", "rmsnorm-mlp", "embedding-padding"]
QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


def test_union_of_only_where_the_layers_tile_one_buffer():
    buffer = torch.arange(20.0).reshape(2, 10)
    a, b = buffer[:, :4].view(2, 2, 2), buffer[:, 4:].view(2, 6)
    squares, total = arena.union_of([(b[1], b[0]), (a[1], a[0])])  # any order of the pieces
    assert torch.equal(squares, buffer[1]) and torch.equal(total, buffer[0])
    assert squares.data_ptr() == buffer[1].data_ptr() and total.data_ptr() == buffer[0].data_ptr()
    other = torch.zeros(2, 6)
    not_tiling = {
        "a gap": [(a[1], a[0])],
        "an overlap": [(a[1], a[0]), (a[1], a[0]), (buffer[1, 8:], buffer[0, 8:])],
        "S not beside its T": [(a[1], a[0]), (b[0], b[1])],
        "another tensor": [(a[1], a[0]), (other[1], other[0])],
        "R of expanded sums": [(a[1], a[0], a[1]), (b[1], b[0])],
        "not contiguous": [(a[1].transpose(0, 1), a[0].transpose(0, 1)), (b[1], b[0])],
    }
    for name, layers in not_tiling.items():
        assert arena.union_of(layers) is None, name
    assert arena.union_of([]) is None


def _quantity(problem):
    return cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=problem.names)


def _unions(monkeypatch):
    """The unions the quantity forms sd and SNR over (None: into new buffers), call by call;
    no plans from earlier tests."""
    monkeypatch.setattr(arena, "_PLANS", weakref.WeakKeyDictionary())
    found, union_of = [], arena.union_of

    def spy(layers):
        found.append(union_of(layers))
        return found[-1]

    monkeypatch.setattr(arena, "union_of", spy)
    return found


def _check_step(problem, cockpit, step, case, reduction, batch_size):
    """One tracked step's statistics against the float64 reference (test_core_quantities')."""
    run_step(problem, [], step=step, cockpit=cockpit)
    got = cockpit.get_output()[step]["GradientVarianceQuantiles"]
    grads = reference_gradients(case, problem)
    expected = references.gradient_variance_quantiles(
        problem.model, None, problem.inputs, problem.targets, reduction=reduction,
        quantiles=QUANTILES, gradients=grads,
    )
    sd = {name: sd_rtol(grads, batch_size, name, case.inner_terms) for name in expected}
    snr = {name: snr_atol(grads, batch_size, name, case.inner_terms) for name in expected}
    assert_statistics_match(
        got, expected, rtol_of=lambda name, _: sd[name],
        atol_of=lambda name, statistic: snr[name] if statistic.startswith("snr") else 0.0,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch_size", [2, 5])
@pytest.mark.parametrize("name", TILING)
def test_from_the_second_tracked_step_sd_is_formed_over_the_sums_and_matches_the_reference(
    name, batch_size, reduction, monkeypatch
):
    """The first tracked step plans the buffer; from the second the layers' sums lie in
    it, sd and SNR are formed over them, and every statistic matches the reference."""
    case = case_named(name)
    problem = build(case, batch_size, reduction)
    cockpit = Cockpit(problem.params, quantities=[_quantity(problem)])
    unions = _unions(monkeypatch)
    for step in range(3):
        _check_step(problem, cockpit, step, case, reduction, batch_size)
    assert [union is not None for union in unions] == [False, True, True]
    # The buffer holds exactly the sums of the parameters with rows.
    assert unions[-1][0].numel() == sum(p.numel() for p in problem.params if p.requires_grad
                                        and p.grad is not None)


def test_a_changed_model_falls_back_for_one_step_and_plans_again(monkeypatch):
    """Freezing a layer leaves a slot of the plan unused: that step forms sd into new
    buffers (the same numbers), and the next one plans the smaller buffer."""
    case = case_named("mlp")
    problem = build(case, 3, "mean")
    cockpit = Cockpit(problem.params, quantities=[_quantity(problem)])
    unions = _unions(monkeypatch)
    for step in range(2):
        _check_step(problem, cockpit, step, case, "mean", 3)
    problem.model[0].bias.requires_grad_(False)
    problem.model[0].bias.grad = None
    for step in range(2, 4):
        _check_step(problem, cockpit, step, case, "mean", 3)
    assert [union is not None for union in unions] == [False, True, False, True]


def test_savefields_of_a_planned_backward_pass_share_one_buffer_and_models_keep_their_plans(
    monkeypatch
):
    """Two models tracked in turn each get their own plan; a model's savefields, after
    its second tracked backward pass, are slots of one buffer (read before any quantity)."""
    monkeypatch.setattr(arena, "_PLANS", weakref.WeakKeyDictionary())
    problems = [build(case_named("mlp"), 3, "mean"), build(case_named("embedding"), 3, "mean")]
    storages = []

    class Probe(cgn.GradientVarianceQuantiles):
        def step_context(self, step, params):
            storages.append({getattr(p, SUMS_SAVEFIELD).untyped_storage().data_ptr()
                             for p in params if hasattr(p, SUMS_SAVEFIELD)})
            return super().step_context(step, params)

    for problem in problems:
        problem.cockpit = Cockpit(problem.params, quantities=[Probe(linear(1), param_names=problem.names)])
    for step in range(3):
        for problem in problems:
            run_step(problem, [], step=step, cockpit=problem.cockpit)
    sizes = [len(storage) for storage in storages]
    parameters = [sum(p.requires_grad for p in problem.params) for problem in problems]
    assert sizes[:2] == parameters  # the first tracked steps: a tensor per parameter
    assert sizes[2:] == [1, 1, 1, 1]


def test_no_buffer_outside_a_served_rule_or_without_a_union():
    assert arena.place(torch.zeros(3), (4,)).shape == (2, 4)  # no backward pass served
    total = torch.zeros(6)
    sums = functional.sd_and_signal_to_noise([(total.abs() + 1, total)], 3, 1e3)
    assert sums[0].data_ptr() != total.data_ptr()  # without a union: new buffers


def test_no_buffer_on_other_devices(paths, monkeypatch):
    """On other devices (their paths run on CPU tensors) no sums are placed in a buffer,
    from the second tracked step on too; on the CPU they are. float64: its sums are not
    formed at a scale on other devices either, so they would be planned there."""
    monkeypatch.setattr(arena, "_PLANS", weakref.WeakKeyDictionary())
    in_buffer, place = [], arena.place

    def spy(like, shape):
        result = place(like, shape)
        in_buffer.append(result.untyped_storage().nbytes() > result.numel() * result.element_size())
        return result

    monkeypatch.setattr(arena, "place", spy)
    _mlp_run(extend(torch.nn.CrossEntropyLoss()), dtype=torch.float64)
    per_step = len(in_buffer) // 3  # the MLP's four parameters, at each of three steps
    expected = [False] * per_step + [paths == "cpu"] * 2 * per_step
    assert per_step == 4 and in_buffer == expected


def _mlp_run(loss_fn, steps=3, seed=0, dtype=torch.float32):
    """GradientVarianceQuantiles of a fresh seeded MLP over ``steps`` tracked steps (one batch)."""
    torch.manual_seed(seed)
    model = extend(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)))
    model = model.to(dtype)
    x, y = torch.randn(7, 6, dtype=dtype), torch.randint(0, 3, (7,))
    cockpit = Cockpit(list(model.parameters()), quantities=[cgn.GradientVarianceQuantiles(linear(1))])
    for step in range(steps):
        model.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        info = {"batch_size": 7, "loss": loss,
                "individual_losses": torch.nn.functional.cross_entropy(outputs, y, reduction="none")}
        with cockpit(step, info=info):
            loss.backward()
    return model, [cockpit.get_output()[step]["GradientVarianceQuantiles"] for step in range(steps)]


def test_two_runs_alike_compute_alike_and_models_sharing_a_loss_keep_their_own_plans(monkeypatch):
    """A new model starts without a plan, even one alike after another (so its numbers are
    those of the same run alone), and two models differentiated through one loss module
    (a GAN's) each plan from their own last layer."""
    unions = _unions(monkeypatch)
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    first, first_rows = _mlp_run(loss_fn)
    second, second_rows = _mlp_run(loss_fn)
    assert first_rows == second_rows
    assert [union is not None for union in unions] == [False, True, True] * 2
    assert set(arena._PLANS) == {first[2], second[2]}  # each model's last layer
    del first
    assert set(arena._PLANS) == {second[2]}  # the plan goes with its model
