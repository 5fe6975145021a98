"""DistributedDataParallel: exact global-batch statistics, identical on every process.

2 and 3 processes (gloo on loopback, a free port, float64) run the checks in one
group per world size (``tests/process_groups.py``): a module fixture runs every job of
a group (``tests/ddp_jobs.py``) and saves each process's results, the tests below
compare them with one process on the concatenated batch.

References (one process, in this process):

- GradientVarianceQuantiles, PerExampleGradNorm, GradientNoiseScale: the
  concatenated batch of all processes with the same loss reduction;
- ParamGradRatio, UpdateSize: read ``param.grad``, which DDP averages over
  processes, i.e. the gradient of ``mean_r loss_r`` (``loss_r`` the loss of
  process ``r``'s batch); for a mean loss with equal local batches that is
  the concatenated batch's gradient.
"""

import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn  # first: makes `import cockpit` work
from cockpit_gradnoise import _ranks, cli, distributed

import pandas
import pytest
import torch
from cockpit.utils.schedules import linear
from torch import nn

from tests import test_two_batch
from tests.cases import MODELS, ModelCase, build
from tests.ddp_jobs import (
    CASES,
    CONFIGS,
    FROM_GRAD,
    LOSS_FAILURE,
    LR,
    MINIBATCHES,
    NO_SYNC_SIZES,
    PER_EXAMPLE,
    all_quantities,
    info_of,
    make_batches,
    make_model,
    table,
    worker,
)
from tests.helpers import RTOL
from tests.process_groups import agreed_table, assert_identical, assert_tables_match, results_of, run_once_per_world

# The groups ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "world", worker)


# References: one process ----------------------------------------------------------


def reference_steps(config, steps=2):
    """Tables of the per-example quantities on the concatenated batch and of ParamGradRatio and
    UpdateSize with DDP's gradient, over the same two optimizer steps."""
    problem = build(CASES[config.model], sum(config.sizes), config.reduction)
    names, params = problem.names, problem.params
    per_example = cgn.Cockpit(params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in PER_EXAMPLE
    ])
    from_grad = cgn.Cockpit(params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in FROM_GRAD
    ])
    optimizer = torch.optim.SGD(params, lr=LR)
    for step in range(steps):
        problem.model.zero_grad()
        outputs = problem.model(problem.inputs)
        loss = problem.loss_fn(outputs, problem.targets)
        with per_example(step, info=info_of(problem, outputs, problem.targets, loss)):
            loss.backward()
        problem.model.zero_grad()
        ddp_loss = ddp_mean_loss(problem, config.sizes)
        with from_grad(step, info={"loss": ddp_loss}):
            ddp_loss.backward()
        optimizer.step()
    return {**table(per_example), **table(from_grad)}


def ddp_mean_loss(problem, sizes):
    """``mean_r loss_r``: the loss whose gradient DDP leaves in ``param.grad``."""
    losses, start = [], 0
    for size in sizes:
        part = slice(start, start + size)
        start += size
        losses.append(problem.loss_fn(problem.model(problem.inputs[part]), problem.targets[part]))
    return torch.stack(losses).mean()



# Tests ------------------------------------------------------------------------------

MATRIX = [(world, config) for world, configs_ in CONFIGS.items() for config in configs_]


@pytest.mark.parametrize("world, config", MATRIX, ids=[f"W{w}-{c.id}" for w, c in MATRIX])
def test_every_statistic_equals_one_process_on_the_concatenated_batch(groups, world, config):
    got = agreed_table(results_of(groups, world, config.id))
    expected = reference_steps(config)
    assert {key[1] for key in expected} == set(PER_EXAMPLE + FROM_GRAD)
    assert_tables_match(got, expected)


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_one_header_and_one_all_reduce_per_dtype_per_tracked_step(groups, world):
    """Three reducing quantities over every parameter: a header and one call for float64
    sums; a float32 model adds one for its float32 sums."""
    for config in CONFIGS[world]:
        for result in results_of(groups, world, config.id):
            assert result["all_reduce_calls"] == 2, config.id
    assert results_of(groups, world, "float32") == [3] * world


def test_micro_batches_under_no_sync_are_each_the_global_micro_batch(groups):
    """Per-example quantities: each tracked micro-batch, all processes' examples of it.
    ParamGradRatio, tracked at the synchronizing micro-batch: the accumulated DDP gradient."""
    results = results_of(groups, 2, "no_sync")
    assert_identical([result["table"] for result in results])
    for grad_0, grad_1 in zip(*(result["grads"] for result in results)):
        assert torch.equal(grad_0, grad_1)
    problem = build(CASES["mlp"], sum(map(sum, NO_SYNC_SIZES)), "mean")
    names = problem.names
    per_example = cgn.Cockpit(problem.params, quantities=[
        q for q in all_quantities(names) if type(q).__name__ in PER_EXAMPLE
    ])
    inputs, targets, start = problem.inputs, problem.targets, 0
    accumulated = []
    for step, sizes in enumerate(NO_SYNC_SIZES):
        batch = slice(start, start + sum(sizes))
        start += sum(sizes)
        problem.model.zero_grad()
        outputs = problem.model(inputs[batch])
        loss = problem.loss_fn(outputs, targets[batch])
        with per_example(step, info=info_of(problem, outputs, targets[batch], loss)):
            loss.backward()
        micro = dataclasses.replace(problem, inputs=inputs[batch], targets=targets[batch])
        accumulated.append(ddp_mean_loss(micro, sizes))
    problem.model.zero_grad()
    ratio = cgn.Cockpit(problem.params, quantities=[cgn.ParamGradRatio(linear(1), param_names=names)])
    total = torch.stack(accumulated).sum()
    with ratio(1, info={"loss": total}):
        total.backward()
    assert_tables_match(results[0]["table"], {**table(per_example), **table(ratio)})


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_minibatch_functions_take_shares_and_equal_one_process(groups, world):
    results = results_of(groups, world, "minibatch")
    case = CASES["cnn"]
    batches = make_batches(case, MINIBATCHES, 4)
    stats, sds = cgn.minibatch_gradient_stats(
        make_model(case), batches, nn.CrossEntropyLoss(), return_sd=True
    )
    gradient = cgn.dataset_gradient(make_model(case), batches, nn.CrossEntropyLoss())
    for result in results:
        for name, row in stats.items():
            assert result["stats"][name] == pytest.approx(row, rel=RTOL), name
        for name in sds:
            torch.testing.assert_close(result["sds"][name], sds[name], rtol=RTOL, atol=0)
            torch.testing.assert_close(result["gradient"][name], gradient[name], rtol=RTOL, atol=0)


def test_a_mixed_loss_reduction_or_one_failing_process_raises_on_every_process(groups):
    messages = results_of(groups, 2, "errors")
    for rank in (0, 1):
        assert "a mean on some processes and a sum on others" in messages[rank]["mixed_reductions"]
    assert messages[1]["one_process_fails"].startswith("KeyError: \"GradientVarianceQuantiles needs")
    assert messages[0]["one_process_fails"].startswith(
        "RuntimeError: cockpit_gradnoise: process(es) [1] failed"
    )
    for rank in (0, 1):
        assert "extra.weight" in messages[rank]["partly_used"], messages[rank]["partly_used"]
        assert "on some processes only" in messages[rank]["partly_used"]


def test_a_process_that_skipped_a_tracked_call_makes_every_process_raise_naming_both_steps(groups):
    results = results_of(groups, 2, "skipped_call")
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"process {rank} paired steps 2 and 3 without an error"
        assert "process 0 at step 2, process 1 at step 3" in result["error"]
        assert "skip a tracked call" in result["error"]
        assert result["steps"] == [0, 1]  # nothing recorded from mixed steps


def test_two_batch_noise_scale_under_no_sync_equals_the_formula_on_all_micro_batches(groups):
    test_two_batch.check_two_processes(results_of(groups, 2, "two_batch"))


def test_fsdp_fails_clearly(groups):
    messages = results_of(groups, 2, "fsdp")
    for message in messages:
        assert message is not None and "FullyShardedDataParallel" in message
        assert "Supported: one process, or torch.nn.parallel.DistributedDataParallel" in message


def test_train_ddp_quick_writes_log_dashboard_and_report_on_rank_0_only(groups):
    logs = results_of(groups, 2, "train_ddp")
    _, _, folder = groups(2)
    out = folder / "train_ddp"
    assert logs == [out / "digits_ddp.json", None]
    assert sorted(p.name for p in out.iterdir()) == [
        "digits_ddp.json", "digits_ddp.png", "digits_ddp_report.txt"
    ]
    frame = cgn.to_frame(logs[0])
    assert set(frame.quantity) == set(PER_EXAMPLE + FROM_GRAD)
    assert set(frame[frame.quantity == "GradientNoiseScale"].query("statistic == 'batch_size'").value) == {32.0}
    assert cli.main(["report", str(logs[0])]) == 0


def test_only_the_writer_rank_writes_logs_and_figures(tmp_path, monkeypatch):
    """On another rank write_log and plot write nothing (unless told every rank writes)."""
    problem = build(CASES["mlp"], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=all_quantities(problem.names))
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    with cockpit(0, info=info_of(problem, outputs, problem.targets, loss)):
        loss.backward()
    monkeypatch.setattr(_ranks, "rank", lambda: 1)  # is_writer asks _ranks.rank
    assert cgn.write_log(cockpit, tmp_path / "log") is None
    cgn.plot(cockpit, savefig=tmp_path / "dash.png")
    assert list(tmp_path.iterdir()) == []
    assert cgn.write_log(cockpit, tmp_path / "log", writer_rank=1) == tmp_path / "log.json"
    cgn.plot(cockpit, savefig=tmp_path / "dash.png", writer_rank=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dash.png", "log.json"]


def test_a_ddp_run_restarted_from_its_checkpoint_logs_what_a_run_never_stopped_logs(groups):
    """Only rank 0 touches the log; the restarted run's log equals the whole run's exactly
    (the loop of docs/training-setups.md, "Resuming a run", run by ``ddp_jobs.resumed_ddp_run``)."""
    ranks = results_of(groups, 2, "resume")
    out = groups(2)[2] / "resume"
    assert [r["writer"] for r in ranks] == [True, False]
    assert not [path for path in ranks[1]["opened"] if "run.jsonl" in path]
    assert any(path.endswith("run.jsonl") for path in ranks[0]["opened"])
    expected = cgn.to_frame(out / "whole.jsonl")
    assert sorted(set(expected.step)) == list(range(6))
    pandas.testing.assert_frame_equal(cgn.to_frame(out / "run.jsonl"), expected, check_exact=True)
    superseded = cgn.read_log(out / "run.jsonl").superseded_records()
    assert {(step, q) for step, q, _ in superseded if q == "UpdateSize"} == {(2, "UpdateSize"),
                                                                           (3, "UpdateSize")}


def test_an_exception_in_one_process_ends_the_group_with_its_error(groups):
    _, error, _ = groups(2)
    assert error is not None and LOSS_FAILURE in error, error
    assert "hung" not in error


# Without a process group (in this process) -------------------------------------------


def pretend_two_processes(monkeypatch):
    """A world size of 2 without any process group: any collective would raise."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *args: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)


def test_param_grad_ratio_and_update_size_do_not_communicate(monkeypatch):
    """They read parameters and param.grad, the same on every process under DDP."""
    problem = build(CASES["mlp"], 4, "mean")
    names = problem.names
    quantities = [cgn.ParamGradRatio(linear(1), param_names=names),
                  cgn.UpdateSize(linear(1), param_names=names)]
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    pretend_two_processes(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning about rank-local statistics
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for step in range(2):
            outputs = problem.model(problem.inputs)
            loss = problem.loss_fn(outputs, problem.targets)
            with cockpit(step, info={"loss": loss}):
                loss.backward()
    assert set(cgn.to_frame(cockpit).quantity) == set(FROM_GRAD)


class SignAgreement(cgn.ParameterQuantity):
    """Reads BackPACK's per-example gradients without declaring sums: rank-local under DDP."""

    from backpack.extensions import BatchGrad

    extension_classes = (BatchGrad,)

    def parameter_value(self, param, context):
        return (param.grad_batch * param.grad > 0).double().mean().item()

    def network_value(self, values):
        return sum(values) / len(values)

    def statistics(self, value):
        return {"agreement": value}

    def statistic_names(self):
        return ["agreement"]


def test_a_quantity_without_declared_sums_warns_that_it_is_rank_local(monkeypatch):
    problem = build(CASES["mlp"], 4, "mean")
    cockpit = cgn.Cockpit(problem.params, quantities=[SignAgreement(linear(1))])
    pretend_two_processes(monkeypatch)
    outputs = problem.model(problem.inputs)
    loss = problem.loss_fn(outputs, problem.targets)
    with pytest.warns(UserWarning, match="statistics are those of the local batch"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_sharded_parameters_and_models_are_refused_by_class_name():
    class FlatParameter(nn.Parameter):
        pass

    class FullyShardedDataParallel(nn.Module):
        pass

    with pytest.raises(TypeError, match="the class FlatParameter, from FSDP"):
        distributed.check_not_sharded([FlatParameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="the class FullyShardedDataParallel, from FSDP"):
        distributed.check_not_sharded([], FullyShardedDataParallel())
    flattened = nn.Parameter(torch.zeros(2))
    flattened._fsdp_flattened = True
    with pytest.raises(TypeError, match="flattened by FSDP"):
        distributed.check_not_sharded([flattened])
    distributed.check_not_sharded(nn.Linear(2, 2).parameters(), nn.Linear(2, 2))


def test_importing_the_package_loads_no_more_of_torch_distributed_than_torch():
    code = (
        "import sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "import cockpit_gradnoise as cgn\n"
        "cgn.GradientVarianceQuantiles, cgn.write_log, cgn.minibatch_gradient_stats\n"
        "from cockpit_gradnoise import distributed\n"
        "after = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "print(sorted(after - before))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.stdout.strip() == "[]"


def test_outside_distributed_training_every_helper_is_a_no_op():
    assert distributed.world_size() == 1 and distributed.rank() == 0
    assert distributed.is_writer() and distributed.is_writer(None)
    assert list(distributed.share(range(3))) == [0, 1, 2]
    assert distributed.gather_objects("x") == ["x"]
    tensor = torch.ones(2)
    distributed.all_reduce_([tensor])
    assert torch.equal(tensor, torch.ones(2))


def padded_cnn(padding, padding_mode):
    return nn.Sequential(
        nn.Conv2d(2, 3, (4, 3), padding=padding, padding_mode=padding_mode, dilation=(1, 2)),
        nn.Flatten(),
        nn.LazyLinear(3),
    )


PADDED = [
    ModelCase(f"conv-{padding}-{mode}", lambda p=padding, m=mode: padded_cnn(p, m),
              lambda n: torch.randn(n, 2, 6, 7))
    for padding, mode in (("same", "zeros"), ("valid", "zeros"), (2, "reflect"), ("same", "circular"))
]


@pytest.mark.parametrize("case", MODELS + PADDED, ids=lambda case: case.name)
def test_local_gradient_extension_is_the_gradient_of_the_backward_pass(case):
    """What distributed training reads instead of param.grad (which DDP averages)."""
    from cockpit_gradnoise.extensions import LOCAL_GRADIENT_SAVEFIELD, LocalGradient

    from backpack import backpack

    problem = build(case, 5, "mean")
    problem.model(problem.inputs)  # materialize lazy layers
    loss = problem.loss_fn(problem.model(problem.inputs), problem.targets)
    with backpack(LocalGradient()):
        loss.backward()
    compared = []
    for name, param in zip(problem.names, problem.params):
        if param.grad is not None and name != "unused.weight":
            local = getattr(param, LOCAL_GRADIENT_SAVEFIELD)
            torch.testing.assert_close(local, param.grad, rtol=1e-12, atol=1e-14)
            compared.append(name)
    assert compared, "no parameter had a gradient to compare"
