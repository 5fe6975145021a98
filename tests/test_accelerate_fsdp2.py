"""Accelerate's FSDP2 plugin (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``)
with ``cgn.track`` on the model ``accelerator.prepare`` returns (issue 33): the loop of
docs/distributed.md's Accelerate section and of docs/training-setups.md's.

One launch of 2 processes (gloo on loopback, a free port, float64,
``process_groups.run_group``), every job in it, each compared with one process holding the
whole model and the whole global batch in float64, tracked by ``cgn.track`` with the same
quantities (the default preset: the five), with the DDP tests' tolerance, every row
including the network's ``"all"``; every process's table the same bit for bit, and only
rank 0 writes the log.

On CPUs Accelerate 1.16 keeps ``DistributedType.MULTI_CPU`` whatever the plugin:
``AcceleratorState.__init__`` (accelerate/state.py) sets ``DistributedType.FSDP`` and
``fsdp_plugin`` only in its branch ``elif self.distributed_type in [MULTI_GPU, MULTI_MLU,
..., MULTI_NEURON]``, which lacks ``MULTI_CPU``, so ``prepare`` wraps the model in
DistributedDataParallel and the plugin goes unused. :func:`fsdp2_accelerator` makes those
two assignments (the first only where Accelerate has not): everything after it is Accelerate's own
code (``Accelerator._prepare_fsdp2``: its auto-wrap policy, ``fully_shard`` on the root, the
optimizer's parameters swapped for the sharded ones, ``AcceleratedOptimizer``,
``accumulate`` through FSDP2's ``set_requires_gradient_sync``). The mesh is the one
``fully_shard`` builds when Accelerate passes none (without a ``ParallelismConfig``, as on
GPUs): ``init_device_mesh("cpu", (2,))``, checked below.

- ``prepared``: ``transformer_based_wrap`` on every ``Linear`` and the root
  (``reshard_after_forward=True``), ``accelerator.backward(loss)``.
- ``accumulated``: root only (``reshard_after_forward=False``), two micro-batches per
  process under ``accelerator.accumulate(model)`` (FSDP2 reduce-scatters after the last),
  ``loss.backward()`` on the tracker's loss (already divided by the micro-batches).
- ``divided_again``: ``accelerator.backward(loss)`` under accumulation divides the tracker's
  loss by ``gradient_accumulation_steps`` once more: refused, naming the fix.
- ``tracked_before``: ``cgn.track`` before ``prepare`` (whose ``fully_shard`` replaces the
  parameters): refused at the first tracked step, naming the order.
"""

import math
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import accelerate
import pytest
import torch
import torch.nn.functional as F

from tests.process_groups import agreed_table, assert_tables_match, results_of, run_jobs, run_once_per_world
from tests.test_fsdp2 import LR
from tests.test_fsdp2_track import net, run_tracked, table

WORLD, STEPS = 2, 2
# job: (fully_shard every Linear, reshard_after_forward, micro-batches, local batch)
JOBS = {"prepared": (True, True, 1, 3), "accumulated": (False, False, 2, 2)}


def micro_batches(job, step):
    """Every micro-batch of one step, process by process: ``[rank][k] = (x, y)``."""
    _, _, count, size = JOBS[job]
    generator = torch.Generator().manual_seed(200 + step)
    return [[(torch.randn(size, 5, dtype=torch.float64, generator=generator),
              torch.randint(0, 3, (size,), generator=generator)) for _ in range(count)]
            for _ in range(WORLD)]


def fsdp2_accelerator(job):
    """An ``Accelerator`` with the FSDP2 plugin of ``job``, on CPUs (see the module's docstring)."""
    from accelerate.utils import DistributedType

    per_linear, reshard, count, _ = JOBS[job]
    wrap = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["Linear"]}
    plugin = accelerate.FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=reshard, **(wrap if per_linear else {}))
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=count)
    if accelerator.distributed_type != DistributedType.FSDP:
        # Accelerate's own assignment, which it makes on accelerator devices only.
        accelerator.state.distributed_type = DistributedType.FSDP
    # The state is shared by every Accelerator of the process: this job's plugin and count.
    accelerator.state.fsdp_plugin = plugin
    accelerator.gradient_accumulation_steps, accelerator.step = count, 0
    return accelerator


def prepared(job, rank):
    """``(model, optimizer, accelerator)``: the test's network and SGD through ``prepare``."""
    accelerator = fsdp2_accelerator(job)
    model = net()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, accelerator


def train(model, tracker, optimizer, accelerator, job, rank, accelerate_backward):
    """Accelerate's loop over this process's micro-batches of each step."""
    for step in range(STEPS):
        micro = micro_batches(job, step)[rank]
        for k, (x, y) in enumerate(micro):
            with accelerator.accumulate(model):
                losses = F.cross_entropy(model(x), y, reduction="none")
                extra = {"micro_batch": k, "micro_batches": len(micro)} if len(micro) > 1 else {}
                with tracker(step, losses, optimizer=optimizer, **extra) as loss:
                    accelerator.backward(loss) if accelerate_backward else loss.backward()
                optimizer.step()  # AcceleratedOptimizer: only after the last micro-batch
                optimizer.zero_grad()


def tracked_job(job, rank, out):
    model, optimizer, accelerator = prepared(job, rank)
    model, tracker = cgn.track(model, every=1, quantities="all")
    params = list(model.parameters())
    mesh = params[0].device_mesh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, tracker, optimizer, accelerator, job, rank, accelerate_backward=job == "prepared")
    written = tracker.write(out / f"{job}_written")
    return {"table": table(tracker), "warnings": [str(w.message) for w in caught if "cockpit" in str(w.message)],
            "optimizer": type(optimizer).__name__, "params": {type(p).__name__ for p in params},
            "mesh": (mesh.device_type, mesh.ndim, mesh.size()),
            "sharded": sorted(name for name, module in model.named_modules()
                              if type(module).__name__.startswith("FSDP")),
            "written": None if written is None else str(written),
            "files": sorted(path.name for path in out.iterdir() if path.name.startswith(job))}


def refused(job, rank, before):
    """The error of ``cgn.track`` before ``prepare`` (``before``), or of ``accelerator.backward``
    under accumulation."""
    if before:
        accelerator = fsdp2_accelerator(job)
        model, tracker = cgn.track(net(), every=1, quantities="all")
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
    else:
        model, optimizer, accelerator = prepared(job, rank)
        model, tracker = cgn.track(model, every=1, quantities="all")
    try:
        train(model, tracker, optimizer, accelerator, job, rank, accelerate_backward=True)
    except RuntimeError as error:
        return str(error)
    return None


def worker(rank, world, port, out):
    folder = Path(out) / f"rank{rank}_files"
    folder.mkdir(exist_ok=True)
    warnings.filterwarnings("ignore", module="accelerate")
    jobs = {job: lambda mesh, job=job: tracked_job(job, rank, folder) for job in JOBS}
    jobs["divided_again"] = lambda mesh: refused("accumulated", rank, before=False)
    jobs["tracked_before"] = lambda mesh: refused("prepared", rank, before=True)
    run_jobs(rank, world, port, out, jobs)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "accelerate_fsdp2_", worker)


def reference(job):
    """One process: the whole model, each step's micro-batches of every process as its own."""
    model, tracker = cgn.track(net(), every=1, quantities="all")
    batches = [[batch for rank in micro_batches(job, step) for batch in rank] for step in range(STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_tracked(model, tracker, batches)
    return table(tracker)


@pytest.mark.parametrize("job", list(JOBS))
def test_accelerate_fsdp2_prepared_then_tracked_equals_one_process(groups, job):
    results = results_of(groups, WORLD, job)
    got = agreed_table(results)
    expected = reference(job)
    assert_tables_match(got, expected)
    assert {"GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
            "GradientVarianceQuantiles"} <= {key[1] for key in expected}
    assert {"fc1.weight", "fc2.bias", "all"} <= {key[2] for key in expected}
    assert not any(math.isnan(value) for value in got.values())
    for result in results:  # Accelerate's FSDP2 on a 1-D CPU mesh over both processes
        assert result["params"] == {"DTensor"} and result["optimizer"] == "AcceleratedOptimizer"
        assert result["mesh"] == ("cpu", 1, WORLD)
        assert result["sharded"] == (["", "fc1", "fc2", "frozen", "unused"] if JOBS[job][0] else [""])
        # The unused layer's warning only: nothing else is left out.
        assert all("unused" in message for message in result["warnings"]), result["warnings"]
    assert results[0]["written"] is not None and results[1]["written"] is None
    assert results[0]["files"] and results[1]["files"] == []


def test_accelerate_backward_dividing_the_loss_again_is_refused(groups):
    for message in results_of(groups, WORLD, "divided_again"):
        assert "0.5 times the loss" in message and "accelerator.accumulate" in message


def test_tracking_before_prepare_is_refused_naming_the_order(groups):
    for message in results_of(groups, WORLD, "tracked_before"):
        assert "after cgn.track" in message and "accelerator.prepare returns" in message
