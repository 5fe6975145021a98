"""The front door on a model already sharded by FSDP2: ``fully_shard``, then ``cgn.track``.

2 and 3 processes (gloo on loopback, a free port, float64, ``init_device_mesh("cpu",
(W,))``), one launch per world size running every job (``process_groups.run_group``).
The model (``test_fsdp2.Net``: width 7, uneven shards; a frozen and an unused layer) is
built, sharded, then tracked, as a user writes it (the loop of docs/distributed.md's FSDP2
section, and its Lightning example). Every job is compared with one process
holding the whole model and the whole global batch in float64, tracked by ``cgn.track``
with the same quantities, with the DDP tests' tolerance; every process's table is the same
bit for bit, and only rank 0 writes the log (``tracker.write``).

- ``per_block``: ``fully_shard`` on every Linear and the root (``reshard_after_forward=True``),
  the four per-example and gradient quantities exact under FSDP2, equal local batches (FSDP2's
  ``param.grad``, the mean of the processes' means, is then the global batch's mean gradient).
- ``norms`` / ``norms_accumulated``: the cheap preset (TwoBatchNoiseScale, ParamGradRatio,
  UpdateSize), root only with ``reshard_after_forward=False``, one micro-batch per process
  (small batch = a process's batch, big batch = the global one) and two micro-batches
  accumulated. One process sees the processes' micro-batches as its own micro-batches of the
  same size: the same small batches and the same big one. ``norms_no_sync``: the two
  micro-batches with FSDP2's ``set_requires_gradient_sync(False)`` but for the last. Step 0's TwoBatchNoiseScale is
  also checked against ``test_two_batch.reference`` (each small batch's own gradient by
  autograd on an un-hooked copy).
- ``hook_order``: the hooks of every module are in the same order whether the model was
  prepared before ``fully_shard`` or tracked after it.
- ``refusals``: a quantity not marked exact under FSDP2 (``supports_fsdp2``),
  an ``nn.MultiheadAttention`` and BackPACK's converter, each by a ``TypeError`` naming the fix.
"""

import math
import os
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests import test_two_batch
from tests.process_groups import (
    agreed_table,
    assert_tables_match,
    results_of,
    run_jobs,
    run_once_per_world,
)
from tests.test_fsdp2 import LR, Net, NotMarked

STEPS = 2
PER_EXAMPLE = ["GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize"]
# job: (quantities, fully_shard every Linear, reshard_after_forward, micro-batches, local batch)
JOBS = {
    "per_block": ("all", True, True, 1, 3),  # the default preset: every quantity exact under FSDP2
    "norms": ("norms", False, False, 1, 4),
    "norms_accumulated": ("norms", True, True, 2, 2),
    "norms_no_sync": ("norms", True, False, 2, 2),  # set_requires_gradient_sync(False) but the last
    "lightning": ("norms", True, True, 1, 3),  # 2 processes: the test of lightning below
}


def net():
    torch.manual_seed(0)
    return Net().double()


def micro_batches(job, world, step):
    """Every micro-batch of one step, rank by rank: ``[rank][k] = (x, y)``."""
    _, _, _, count, size = JOBS[job]
    generator = torch.Generator().manual_seed(100 + step)
    return [[(torch.randn(size, 5, dtype=torch.float64, generator=generator),
              torch.randint(0, 3, (size,), generator=generator)) for _ in range(count)]
            for _ in range(world)]


def run_tracked(model, tracker, batches, no_sync=False):
    """``batches[step]``: the micro-batches of the step, each ``(x, y)``; with ``no_sync``,
    FSDP2 reduce-scatters after the last micro-batch only."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step, micro in enumerate(batches):
        optimizer.zero_grad()
        for k, (x, y) in enumerate(micro):
            if no_sync:
                model.set_requires_gradient_sync(k == len(micro) - 1)
            losses = F.cross_entropy(model(x), y, reduction="none")
            extra = {"micro_batch": k, "micro_batches": len(micro)} if len(micro) > 1 else {}
            with tracker(step, losses, optimizer=optimizer, **extra) as loss:
                loss.backward()
        optimizer.step()


def table(tracker):
    frame = cgn.to_frame(tracker)
    return dict(zip(zip(frame.step, frame.quantity, frame.param, frame.statistic), frame.value))


def shard(model, mesh, per_linear, reshard):
    from torch.distributed.fsdp import fully_shard

    if per_linear:
        for module in (model.fc1, model.fc2, model.frozen, model.unused):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def tracked_job(job, world, rank, mesh, out):
    quantities, per_linear, reshard, _, _ = JOBS[job]
    model = shard(net(), mesh, per_linear, reshard)
    model, tracker = cgn.track(model, every=1, quantities=quantities)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_tracked(model, tracker, [micro_batches(job, world, step)[rank] for step in range(STEPS)],
                    no_sync=job.endswith("no_sync"))
    written = tracker.write(out / f"{job}_written")
    return {"table": table(tracker), "warnings": [str(w.message) for w in caught],
            "written": None if written is None else str(written),
            "files": sorted(path.name for path in out.iterdir() if path.name.startswith(job))}


def reference(job, world):
    """One process: the whole model, each step's micro-batches of every process as its own."""
    quantities = JOBS[job][0]
    model, tracker = cgn.track(net(), every=1, quantities=quantities)
    batches = [[batch for rank in micro_batches(job, world, step) for batch in rank] for step in range(STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_tracked(model, tracker, batches)
    return table(tracker)


# A GradScaler over two accumulated micro-batches per process, three steps; at step 1 the
# last micro-batch of process 0 has an infinite loss: every shard's gradient is then not
# finite (FSDP2 adds the processes' gradients), and the scaler skips the step.
SCALED = "norms_accumulated"
POISONED = (1, 0, 1)  # (step, process, micro-batch)


def scaled_run(rank=None, world=2, scaler=True, mesh=None):
    """``cgn.track`` with the five quantities exact under FSDP2 and a ``torch.amp.GradScaler``
    (scale 2**10, doubled after each finite step): sharded (this ``rank``'s micro-batches), or
    on one process with every process's micro-batches as its own (without ``scaler``: none,
    and no step poisoned). The table, the warnings and the scaler's scale after each step."""
    model = net()
    if rank is not None:
        model = shard(model, mesh, True, True)
    model, tracker = cgn.track(model, every=1, quantities=PER_EXAMPLE + ["GradientVarianceQuantiles"])
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1, enabled=scaler)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            optimizer.zero_grad()
            per_rank = micro_batches(SCALED, world, step)
            micro = [(r, k, batch) for r, batches in enumerate(per_rank) for k, batch in enumerate(batches)
                     if rank in (None, r)]
            for index, (r, k, (x, y)) in enumerate(micro):
                losses = F.cross_entropy(model(x), y, reduction="none")
                if scaler and (step, r, k) == POISONED:
                    losses = losses * math.inf
                with tracker(step, losses, optimizer=optimizer, scaler=grad_scaler, micro_batch=index,
                             micro_batches=len(micro)) as loss:
                    grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            scales.append(float(grad_scaler.get_scale()))
    return {"table": table(tracker), "scales": scales, "warnings": [str(w.message) for w in caught]}


def inf_in_one_shard(mesh):
    """One element of one process's shard of a gradient made infinite: whether the package
    (the tracker's skip test) and the scaler (its ``found_inf``) each see a step to skip."""
    from cockpit_gradnoise import amp

    model = shard(net(), mesh, True, True)
    x, y = micro_batches(SCALED, mesh.size(), 0)[mesh.get_local_rank()][0]
    F.cross_entropy(model(x), y).backward()
    if mesh.get_local_rank() == 0:
        model.fc1.weight.grad.to_local()[0, 0] = math.inf
    scaler, optimizer = torch.amp.GradScaler("cpu"), torch.optim.SGD(model.parameters(), lr=LR)
    scaler.scale(torch.zeros((), dtype=torch.float64))  # the scaler's state, as after a step
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    return {"package": amp.ScaledStep(scaler).skipped(params),
            "scaler": sum(float(v) for v in scaler._found_inf_per_device(optimizer).values()) > 0}


def hook_order(mesh):
    """The names of each module's forward hooks and pre-hooks: prepared first, tracked after."""
    def names(model):
        return [[getattr(getattr(hook, "__func__", hook), "__qualname__", type(hook).__name__)
                 for table in (module._forward_pre_hooks, module._forward_hooks) for hook in table.values()]
                for module in model.modules()]

    first = shard(cgn.prepare_model(net()), mesh, True, True)
    after, _ = cgn.track(shard(net(), mesh, True, True), quantities=PER_EXAMPLE)
    return names(first), names(after)


def refusals(mesh):
    """The messages of what cgn.track refuses on a sharded model."""
    messages = {}

    class WithAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.head = nn.MultiheadAttention(4, 2), nn.Linear(4, 2)

    cases = {"unmarked": lambda: cgn.track(shard(net(), mesh, True, True), quantities=[NotMarked]),
             "attention": lambda: cgn.track(shard(WithAttention().double(), mesh, False, True),
                                            quantities="norms"),
             "converter": lambda: cgn.track(shard(net(), mesh, False, True), quantities="norms",
                                            use_converter=True)}
    for key, case in cases.items():
        try:
            case()
            messages[key] = None
        except TypeError as error:
            messages[key] = str(error)
    return messages


def lightning_job(world, rank, port, out):
    """Lightning's ModelParallelStrategy (FSDP2 in ``configure_model``) with TrackingCallback."""
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            shard(self.net, mesh, True, True)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.per_example_losses = F.cross_entropy(self.net(x), y, reduction="none")
            return self.per_example_losses.mean()

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR)

    # The group exists: Lightning joins it (processes started outside, as by torchrun).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    loader = torch.utils.data.DataLoader(  # this process's batch of each step, as they are
        [micro_batches("lightning", world, step)[rank][0] for step in range(STEPS)], batch_size=None)
    callback = TrackingCallback(every=1, quantities=JOBS["lightning"][0], log=out / "lightning",
                                tensorboard=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="32-true", max_steps=STEPS,
                         strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Lit(), loader)
    assert all(type(p).__name__ == "DTensor" for p in trainer.lightning_module.parameters())
    return {"table": {(step, quantity, name.removeprefix("net."), statistic): value for
                      (step, quantity, name, statistic), value in table(callback.tracker).items()},
            "files": sorted(path.name for path in out.iterdir() if path.name.startswith("lightning"))}


def worker(rank, world, port, out):
    folder = Path(out) / f"rank{rank}_files"
    folder.mkdir(exist_ok=True)
    jobs = {job: lambda mesh, job=job: tracked_job(job, world, rank, mesh, folder)
            for job in JOBS if job != "lightning"}
    jobs["hook_order"] = hook_order
    jobs["refusals"] = refusals
    if world == 2:
        jobs["lightning"] = lambda mesh: lightning_job(world, rank, port, folder)
        jobs["scaler"] = lambda mesh: scaled_run(rank, world, mesh=mesh)
        jobs["inf_in_one_shard"] = inf_in_one_shard
    run_jobs(rank, world, port, out, jobs)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_track_", worker)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", [job for job in JOBS if job != "lightning"])
def test_track_after_fully_shard_equals_one_process_on_the_global_batch(groups, world, job):
    results = results_of(groups, world, job)
    table = agreed_table(results)
    expected = reference(job, world)
    assert_tables_match(table, expected)
    quantities = {key[1] for key in expected}
    assert quantities >= ({"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"} if job.startswith("norms")
                          else set(PER_EXAMPLE) | {"GradientVarianceQuantiles"})
    assert {"fc1.weight", "fc2.bias", "all"} <= {key[2] for key in expected}
    assert not any(math.isnan(value) for value in table.values())
    # Only rank 0 writes: the streamed log and the written one.
    assert results[0]["written"] is not None and all(r["written"] is None for r in results[1:])
    assert results[0]["files"]
    assert all(result["files"] == [] for result in results[1:])


def two_batch_reference(model, batches, weights):
    """``test_two_batch.reference`` over the trainable parameters (an unused one: zero gradient)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    sums = [[torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(
        F.cross_entropy(model(x), y, reduction="sum"), params, allow_unused=True))] for x, y in batches]
    total = sum(w * len(y) for w, (_, y) in zip(weights, batches))
    effective = total**2 / sum(w * w * len(y) for w, (_, y) in zip(weights, batches))
    big = [sum(w * s[i] for w, s in zip(weights, sums)) / total for i in range(len(params))]
    small = [test_two_batch.squared_norms([g / len(y) for g in s]) for s, (_, y) in zip(sums, batches)]
    return {name: test_two_batch.from_the_model_of_the_paper(
        [(m[i], len(y)) for m, (_, y) in zip(small, batches)], test_two_batch.squared_norms(big)[i], effective)
        for i, name in enumerate([n for n, _ in named] + ["all"])}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", ["norms", "norms_accumulated", "norms_no_sync"])
def test_the_norms_preset_is_the_two_batch_estimator_of_each_process_batch(groups, world, job):
    """Step 0 against each small batch's own gradient (autograd, no hooks): the small batches
    are the processes' micro-batches, the big one all of them."""
    got = results_of(groups, world, job)[0]["table"]
    batches = [batch for rank in micro_batches(job, world, 0) for batch in rank]
    weights = [1 / (len(batches) * len(y)) for _, y in batches]
    expected = two_batch_reference(net(), batches, weights)
    for name, (grad_sq, trace_cov) in expected.items():
        assert got[(0, "TwoBatchNoiseScale", name, "grad_sq")] == pytest.approx(grad_sq, rel=1e-11)
        assert got[(0, "TwoBatchNoiseScale", name, "trace_cov")] == pytest.approx(trace_cov, rel=1e-11)
        assert got[(0, "TwoBatchNoiseScale", name, "batch_size")] == sum(len(y) for _, y in batches)


@pytest.mark.parametrize("world", [2, 3])
def test_hooks_run_in_the_order_of_preparing_before_sharding(groups, world):
    for first, after in results_of(groups, world, "hook_order"):
        assert first == after
        assert any("_post_forward" in name for hooks in after for name in hooks)


@pytest.mark.parametrize("world", [2, 3])
def test_what_cannot_be_exact_is_refused_naming_the_fix(groups, world):
    for messages in results_of(groups, world, "refusals"):
        assert "NotMarked" in messages["unmarked"] and "norms" in messages["unmarked"]
        assert "MultiheadAttention" in messages["attention"] and "prepare_model" in messages["attention"]
        assert "use_converter" in messages["converter"]


def test_lightning_model_parallel_strategy_with_the_callback_equals_one_process(groups):
    """FSDP2 applied in ``configure_model`` after the callback's ``setup``: the tracker is
    built at ``on_fit_start`` over the sharded parameters (at ``setup`` it would hold the
    parameters FSDP2 replaces, and record nothing or zeros)."""
    results = results_of(groups, 2, "lightning")
    table = agreed_table(results)
    assert_tables_match(table, reference("lightning", 2))
    assert {"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"} <= {key[1] for key in table}
    assert results[0]["files"] and results[1]["files"] == []


def test_grad_scaler_with_accumulation_equals_one_process(groups):
    """The scale divided out of every statistic (step 0 as one process without a scaler), the
    step whose gradients are not finite skipped as the scaler skips it (no rows but the
    scaler's, ``skipped = 1``), every process's table the same and one process's with the
    same scaler and the same micro-batches."""
    results = results_of(groups, 2, "scaler")
    got = agreed_table(results)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = scaled_run()
        unscaled = scaled_run(scaler=False)["table"]
    assert_tables_match(got, expected["table"])
    assert all(result["scales"] == expected["scales"] == [2.0**11, 2.0**10, 2.0**11] for result in results)
    assert {key: value for key, value in got.items() if key[1] == "GradScaler"} == {
        (0, "GradScaler", "all", "scale"): 2.0**10, (0, "GradScaler", "all", "skipped"): 0.0,
        (1, "GradScaler", "all", "scale"): 2.0**11, (1, "GradScaler", "all", "skipped"): 1.0,
        (2, "GradScaler", "all", "scale"): 2.0**10, (2, "GradScaler", "all", "skipped"): 0.0}
    assert {key[1] for key in got if key[0] == 1} == {"GradScaler"}
    first = {key: value for key, value in got.items() if key[0] == 0 and key[1] not in ("GradScaler", "UpdateSize")}
    assert {"GradientVarianceQuantiles", "GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio"} <= {
        key[1] for key in first}
    assert_tables_match(first, {key: value for key, value in unscaled.items() if key in first})
    assert set(first) <= set(unscaled)
    assert not any(math.isnan(value) for value in got.values())
    # Logged as skipped, not warned about as a step that ended early (one process, or each).
    assert not any("ended after" in message for result in [*results, expected] for message in result["warnings"])


def test_an_inf_in_one_shard_skips_the_step_on_every_process(groups):
    """The skip test reads the sharded gradients as DTensors (a reduction over the mesh): it
    agrees with the scaler on every process, also where one process's shard alone holds the inf."""
    assert results_of(groups, 2, "inf_in_one_shard") == [{"package": True, "scaler": True}] * 2
