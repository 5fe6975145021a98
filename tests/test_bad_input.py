"""Bad input: a clear error naming the fix, or a defined result and one warning."""

import math
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references

import pytest
import torch
from backpack import extend
from backpack.extensions import BatchL2Grad
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, Problem, build, run_step

QUANTITIES = [cgn.GradientVarianceQuantiles, cgn.PerExampleGradNorm]


def ours(problem, **kwargs):
    return [cls(linear(1), param_names=problem.names, **kwargs) for cls in QUANTITIES]


def our_warnings(records):
    return [str(r.message) for r in records if "Full backward hook" not in str(r.message)]


def track_recording_warnings(problem):
    """Track 3 steps with :func:`ours`; return the Cockpit and our warnings."""
    quantities = ours(problem)
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for step in range(3):
            run_step(problem, quantities, step=step, cockpit=cockpit)
    return cockpit, our_warnings(records)


@pytest.mark.parametrize("quantity_class", QUANTITIES)
def test_model_not_extended_names_backpack_extend(quantity_class):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    problem = Problem(
        model, nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none"),
        torch.randn(5, 4), torch.randint(0, 3, (5,)), "mean",
    )
    quantity = quantity_class(linear(1), param_names=problem.names)
    with pytest.raises(RuntimeError, match=r"backpack\.extend\(model\)"):
        run_step(problem, [quantity])


class ChannelScale(nn.Module):
    """A custom module that uses its parameters directly: no per-example rule exists."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        return x * self.weight + self.bias


def custom_module_problem(n=6):
    torch.manual_seed(0)
    model = extend(
        nn.Sequential(nn.Linear(4, 5), ChannelScale(5), nn.ReLU(), nn.Linear(5, 3)).double()
    )
    return Problem(
        model, extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none"),
        torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,)), "mean",
    )


def test_unsupported_layer_is_left_out_with_one_warning():
    """A custom module's parameters get no rows; every other parameter is exact."""
    problem = custom_module_problem()
    cockpit, messages = track_recording_warnings(problem)
    assert len(messages) == 1, messages  # one for all quantities, not per quantity or per step
    assert all("2 parameters" in m and "class ChannelScale have no per-example rule" in m
               and "'1.weight', '1.bias'" in m for m in messages)
    frame = cgn.to_frame(cockpit)
    assert set(frame.param) == {"0.weight", "0.bias", "3.weight", "3.bias", "all"}
    assert set(frame.step) == {0, 1, 2}
    expected = references.per_example_grad_norm(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    got = cockpit.get_output()[2]["PerExampleGradNorm"]
    for name in ("0.weight", "3.bias"):
        for statistic, value in expected[name].items():
            assert got[name][statistic] == pytest.approx(value, rel=1e-10)


@pytest.mark.parametrize("quantity_class", QUANTITIES)
@pytest.mark.parametrize("quantiles", [(), (0.5, 1.2), (-0.01,)])
def test_bad_quantiles_fail_at_construction(quantity_class, quantiles):
    with pytest.raises(ValueError, match="quantile"):
        quantity_class(linear(1), quantiles=quantiles)


def test_param_names_must_match_parameters():
    problem = build(MODELS[0], 3, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=["only-one"])
    with pytest.raises(ValueError, match="got 1 param_names for 4 parameters"):
        run_step(problem, [quantity])


def _info_without(problem, keys):
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    info = {"batch_size": len(problem.inputs), "loss": loss,
            "individual_losses": problem.per_example_loss(outputs, problem.targets)}
    return loss, {k: v for k, v in info.items() if k not in keys}


@pytest.mark.parametrize("key", ["individual_losses"])  # Cockpit itself names a missing "loss"
def test_missing_info_key_is_named(key):
    problem = build(MODELS[0], 3, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=ours(problem))
    loss, info = _info_without(problem, {key})
    with pytest.raises(KeyError, match=f"needs info\\['{key}'\\]"):
        with cockpit(0, info=info):
            loss.backward()


def test_batch_size_is_not_needed_beside_individual_losses():
    """One rule for the batch: its size is len(individual_losses); batch_size only cross-checks."""
    problem = build(MODELS[0], 3, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=ours(problem))
    loss, info = _info_without(problem, {"batch_size"})
    with cockpit(0, info=info):
        loss.backward()
    assert set(cgn.to_frame(cockpit).quantity) == {q.__name__ for q in QUANTITIES}


def test_gradient_variance_needs_individual_losses_or_batch_size():
    problem = build(MODELS[0], 3, "mean")
    quantity = cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names)
    cockpit = cgn.Cockpit(problem.params, quantities=[quantity])
    loss, info = _info_without(problem, {"individual_losses"})
    with cockpit(0, info=info):  # batch_size alone is enough for it
        loss.backward()
    assert len(cgn.to_frame(cockpit)) > 0
    problem.model.zero_grad()
    loss, info = _info_without(problem, {"individual_losses", "batch_size"})
    with pytest.raises(KeyError, match=r"needs info\['individual_losses'\] .* or info\['batch_size'\]"):
        with cockpit(1, info=info):
            loss.backward()


def test_batch_size_one_records_norms_but_no_variance():
    problem = build(MODELS[0], 1, "mean")
    cockpit, messages = track_recording_warnings(problem)
    assert len(messages) == 1 and "batch size 1" in messages[0]
    frame = cgn.to_frame(cockpit)
    assert set(frame.quantity) == {"PerExampleGradNorm"}
    assert set(frame.step) == {0, 1, 2}
    assert not frame.value.isna().any()


@pytest.mark.parametrize("case", [MODELS[0], MODELS[2], MODELS[4]], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_identical_examples_give_zero_sd_and_the_largest_resolvable_snr(case, dtype):
    problem = build(case, 64, "mean", dtype=dtype)
    problem.inputs = problem.inputs[:1].repeat(64, *[1] * (problem.inputs.dim() - 1))
    problem.targets = problem.targets[:1].repeat(64)
    cockpit = run_step(problem, ours(problem))
    frame = cgn.to_frame(cockpit)
    sd = frame[frame.quantity == "GradientVarianceQuantiles"]
    assert len(sd) > 0
    snr = sd[sd.statistic.str.startswith("snr_")]
    sd = sd[~sd.statistic.str.startswith("snr_")]
    assert set(sd.statistic) == {"q0.05", "q0.25", "q0.5", "q0.75", "q0.95", "mean"}
    assert (sd.value == 0).all()
    # Examples that agree are the most consistent, not undefined (0 / 0 aside).
    limit = torch.tensor(cgn.functional.resolvable_snr(64, dtype), dtype=dtype).item()
    assert len(snr) > 0 and (snr[snr.statistic == "snr_q0.5"].value == limit).all()
    # The mean adds the copies of the limit in float64.
    assert snr.value.tolist() == pytest.approx([limit] * len(snr), rel=1e-10, abs=0)
    norms = frame[(frame.quantity == "PerExampleGradNorm") & (frame.param == "all")]
    assert (norms.value > 0).all()


def test_nan_gradient_gives_nan_statistics_one_warning_and_training_continues(tmp_path, paths):
    problem = build(MODELS[0], 7, "mean")
    poisoned = problem.model[2].bias
    handle = poisoned.register_hook(lambda grad: grad * math.nan)
    quantities = ours(problem)
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for step in range(2):
            run_step(problem, quantities, step=step, cockpit=cockpit)
        handle.remove()
        run_step(problem, quantities, step=2, cockpit=cockpit)
    messages = our_warnings(records)
    # One warning for the step and every quantity, not one per quantity or per step.
    assert len(messages) == 1 and "NaN or Inf in ['2.bias'] at step 0" in messages[0]
    frame = cgn.to_frame(cockpit)
    bad = frame[(frame.step < 2) & frame.param.isin(["2.bias", "all"])]
    good = frame[(frame.step < 2) & ~frame.param.isin(["2.bias", "all"])]
    assert bad.value.isna().all() and len(bad) > 0
    assert good.value.notna().all() and len(good) > 0
    assert frame[frame.step == 2].value.notna().all()
    cockpit.write(str(tmp_path / "log"))  # Cockpit's own writer refuses raw NaN
    by_name = ["step", "quantity", "param", "statistic"]  # Cockpit.write sorts keys
    assert cgn.to_frame(tmp_path / "log.json").sort_values(by_name, ignore_index=True).equals(
        frame.sort_values(by_name, ignore_index=True))


def test_backpack_batch_l2_is_wrong_for_grouped_convolutions_ours_is_exact():
    """Shows the case matrix's grouped-conv case can fail: BackPACK 1.7.1's own
    BatchL2Grad is off there, ours matches the per-example loop."""
    problem = build(MODELS[4], 5, "sum")
    outputs = problem.model(problem.inputs)
    from backpack import backpack

    with backpack(BatchL2Grad()):
        problem.loss_fn(outputs, problem.targets).backward()
    conv = problem.model[0].weight
    grads = references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    exact = grads["0.weight"].flatten(1).pow(2).sum(1)
    assert not torch.allclose(conv.batch_l2, exact, rtol=0.05)
    problem.model.zero_grad()
    cockpit = run_step(problem, [cgn.PerExampleGradNorm(linear(1), quantiles=(1.0,), param_names=problem.names)])
    got = cockpit.get_output()[0]["PerExampleGradNorm"]["0.weight"]["max"]
    assert got == pytest.approx(exact.sqrt().max().item(), rel=1e-10)


def test_nan_loss_gives_nan_rows_in_every_quantity_without_crash(paths):
    """A NaN input makes the loss and every gradient NaN: each quantity records
    NaN rows with a warning, and the next finite step is recorded normally."""
    problem = build(MODELS[2], 7, "mean")
    names = problem.names
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), param_names=names),
        cgn.PerExampleGradNorm(linear(1), param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names),
        cgn.ParamGradRatio(linear(1), param_names=names),
    ]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    clean = problem.inputs.clone()
    problem.inputs[0, 0, 0, 0] = math.nan
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        run_step(problem, quantities, step=0, cockpit=cockpit)
        problem.inputs = clean
        run_step(problem, quantities, step=1, cockpit=cockpit)
    assert len([m for m in our_warnings(records) if "NaN or Inf" in m]) == 1
    frame = cgn.to_frame(cockpit)
    assert set(frame[frame.step == 0].quantity) == {q.__class__.__name__ for q in quantities}
    assert frame[frame.step == 0].value.isna().all()
    assert frame[frame.step == 1].value.notna().all()


def test_two_instances_of_one_quantity_class_fail_clearly():
    """Cockpit keys results by class name, so a second instance would overwrite
    the first; the second finds the results consumed and says why."""
    problem = build(MODELS[0], 3, "mean")
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
        cgn.GradientVarianceQuantiles(linear(1), quantiles=(0.5,), param_names=problem.names),
    ]
    with pytest.raises(RuntimeError, match="two GradientVarianceQuantiles quantities in one Cockpit"):
        run_step(problem, quantities)


class _TableReader(nn.Module):
    """Reads ``table.weight`` in its own forward, never calling the table (as ProphetNet's
    decoder reads ``ngram_embeddings.weight``); ``mixing``: its output also depends on the
    batch's mean, so that no example alone gives its row of the batch's."""

    def __init__(self, table, mixing):
        super().__init__()
        self.table, self.linear, self.mixing = table, nn.Linear(4, 4), mixing

    def forward(self, x):
        h = self.linear(x)
        return (h - h.mean(0) if self.mixing else h) @ self.table.weight[:4].t()


class _ReadTable(nn.Module):
    def __init__(self, mixing):
        super().__init__()
        self.table = nn.Embedding(6, 4)
        self.reader, self.head = _TableReader(self.table, mixing), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.reader(x))


@pytest.mark.parametrize("mixing", [False, True])
def test_a_weight_read_directly_by_another_module_gets_rows_or_is_named_with_the_reason(mixing):
    """A layer's weight read directly by another module's forward (the layer never called: no
    hook sees it) gets its rows from that module run on each example alone (its block), exact;
    where that module mixes the examples, the weight is named with the reason and what the
    module does, never as a layer "of class unknown", and the other parameters keep their rows."""
    torch.manual_seed(0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    model = cgn.prepare_model(_ReadTable(mixing))
    names = [n for n, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(list(model.parameters()),
                          quantities=[cgn.PerExampleGradNorm(linear(1), param_names=names)])
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    rows = cockpit.get_output()[0]["PerExampleGradNorm"]
    assert "head.weight" in rows and "head.bias" in rows
    if not mixing:
        frame = cgn.check_model(_ReadTable(mixing), x, y, nn.functional.cross_entropy, verbose=False)
        table = frame[frame.param == "table.weight"].iloc[0]
        assert "table.weight" in rows and table.rows and table.max_rel_error < 1e-12, table
        return
    messages = [str(w.message) for w in caught if "table.weight" in str(w.message)]
    assert "table.weight" not in rows
    assert any("examples interact" in m and "unknown" not in m for m in messages), messages
