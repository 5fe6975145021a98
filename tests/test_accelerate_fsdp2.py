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
- ``llama``: transformers' ``LlamaForCausalLM`` (tiny config, random weights) with the
  plugin's default ``transformer_based_wrap`` (the model's ``_no_split_modules``: each
  decoder layer), which Accelerate completes with a unit of its own for the input
  embedding and one for the final norm and the head together (``fully_shard([norm,
  lm_head])``), then the root; per-sequence losses of
  ``integrations.huggingface.per_example_cross_entropy``.
- ``adam``: as ``prepared``, with AdamW: GradientNoiseScale and PreconditionedNoiseScale
  (Adam's state read through the ``AcceleratedOptimizer``, whose parameters ``prepare``
  swapped for the sharded ones).
- ``divided_again``: ``accelerator.backward(loss)`` under accumulation divides the tracker's
  loss by ``gradient_accumulation_steps`` once more: refused, naming the fix.
- ``tracked_before``: ``cgn.track`` before ``prepare`` (whose ``fully_shard`` replaces the
  parameters): refused at the first tracked step, naming the order.
"""

import contextlib
import math
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work
from cockpit_gradnoise.integrations.huggingface import per_example_cross_entropy

import accelerate
import pytest
import torch
import torch.nn.functional as F

from tests import library_models
from tests.cases import HEADS, VOCABULARY, WIDTH
from tests.process_groups import agreed_table, assert_tables_match, results_of, run_jobs, run_once_per_world
from tests.test_fsdp2 import LR
from tests.test_fsdp2_track import net, table

WORLD, STEPS = 2, 2
# job: (wrapped by the plugin: module class names, or None for the root only, or "default"
# for the model's own; reshard_after_forward, micro-batches, local batch)
JOBS = {"prepared": (["Linear"], True, 1, 3), "accumulated": (None, False, 2, 2),
        "llama": ("default", True, 1, 2), "adam": (["Linear"], True, 1, 3)}
FIVE = ["GradientVarianceQuantiles", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize", "GradientNoiseScale"]
# The quantities of each job: the default preset (the five), or with AdamW (whose state the
# preconditioner reads through the AcceleratedOptimizer) the noise scales.
QUANTITIES = {"adam": ["GradientNoiseScale", "PreconditionedNoiseScale"]}
LLAMA_LENGTH = 5


def model_of(job):
    if job != "llama":
        return net()
    torch.manual_seed(0)
    return library_models.llama(VOCABULARY, WIDTH, HEADS).model.double()  # no Logits wrapper:
    # Accelerate finds the embedding and the head on the model it prepares


def losses_of(job, model, x, y):
    """The per-example losses: cross-entropy, or per sequence (next token, ``x`` the ids)."""
    if job != "llama":
        return F.cross_entropy(model(x), y, reduction="none")
    return per_example_cross_entropy(model(input_ids=x, use_cache=False).logits, x)


def micro_batches(job, step):
    """Every micro-batch of one step, process by process: ``[rank][k] = (x, y)``."""
    _, _, count, size = JOBS[job]
    generator = torch.Generator().manual_seed(200 + step)
    if job == "llama":
        return [[(torch.randint(0, VOCABULARY, (size, LLAMA_LENGTH), generator=generator), None)
                 for _ in range(count)] for _ in range(WORLD)]
    return [[(torch.randn(size, 5, dtype=torch.float64, generator=generator),
              torch.randint(0, 3, (size,), generator=generator)) for _ in range(count)]
            for _ in range(WORLD)]


def optimizer_of(job, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LR) if job == "adam" else torch.optim.SGD(params, lr=LR)


def tracked(job, model):
    """``cgn.track`` with the job's quantities."""
    return cgn.track(model, every=1, quantities=QUANTITIES.get(job, "all"))


def fsdp2_accelerator(job):
    """An ``Accelerator`` with the FSDP2 plugin of ``job``, on CPUs (see the module's docstring)."""
    from accelerate.utils import DistributedType

    wrapped, reshard, count, _ = JOBS[job]
    wrap = {} if wrapped is None else {"auto_wrap_policy": "transformer_based_wrap"}
    if isinstance(wrapped, list):
        wrap["transformer_cls_names_to_wrap"] = wrapped
    plugin = accelerate.FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=reshard, **wrap)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=count)
    if accelerator.distributed_type != DistributedType.FSDP:
        # Accelerate's own assignment, which it makes on accelerator devices only.
        accelerator.state.distributed_type = DistributedType.FSDP
    # The state is shared by every Accelerator of the process: this job's plugin and count.
    accelerator.state.fsdp_plugin = plugin
    accelerator.gradient_accumulation_steps, accelerator.step = count, 0
    return accelerator


def prepared(job, rank):
    """``(model, optimizer, accelerator)``: the job's network and SGD through ``prepare``."""
    accelerator = fsdp2_accelerator(job)
    model = model_of(job)
    model, optimizer = accelerator.prepare(model, optimizer_of(job, model))
    return model, optimizer, accelerator


def train(model, tracker, optimizer, job, batches, backward, accumulate=contextlib.nullcontext):
    """Accelerate's loop: ``batches[step]`` are the micro-batches of the step, each ``(x, y)``;
    ``backward(loss)``; ``accumulate``: ``accelerator.accumulate`` (the optimizer then steps
    and zeroes after the last micro-batch only, as an ``AcceleratedOptimizer`` does)."""
    for step, micro in enumerate(batches):
        for k, (x, y) in enumerate(micro):
            with accumulate(model):
                losses = losses_of(job, model, x, y)
                extra = {"micro_batch": k, "micro_batches": len(micro)} if len(micro) > 1 else {}
                with tracker(step, losses, optimizer=optimizer, **extra) as loss:
                    backward(loss)
                if accumulate is not contextlib.nullcontext or k == len(micro) - 1:
                    optimizer.step()
                    optimizer.zero_grad()


def train_prepared(model, tracker, optimizer, accelerator, job, rank, accelerate_backward):
    """This process's micro-batches, through the Accelerator."""
    train(model, tracker, optimizer, job, [micro_batches(job, step)[rank] for step in range(STEPS)],
          accelerator.backward if accelerate_backward else torch.Tensor.backward, accelerator.accumulate)


def tracked_job(job, rank, out):
    model, optimizer, accelerator = prepared(job, rank)
    model, tracker = tracked(job, model)
    params = list(model.parameters())
    mesh = params[0].device_mesh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_prepared(model, tracker, optimizer, accelerator, job, rank, accelerate_backward=job != "accumulated")
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
        model, tracker = tracked(job, model_of(job))
        model, optimizer = accelerator.prepare(model, optimizer_of(job, model))
    else:
        model, optimizer, accelerator = prepared(job, rank)
        model, tracker = tracked(job, model)
    try:
        train_prepared(model, tracker, optimizer, accelerator, job, rank, accelerate_backward=True)
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
    model, tracker = tracked(job, model_of(job))
    optimizer = optimizer_of(job, model)
    batches = [[batch for rank in micro_batches(job, step) for batch in rank] for step in range(STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(model, tracker, optimizer, job, batches, torch.Tensor.backward)
    return table(tracker)


# The modules Accelerate shards (their classes become FSDP<class>), per job.
SHARDED = {"prepared": ["", "fc1", "fc2", "frozen", "unused"], "accumulated": [""],
           "adam": ["", "fc1", "fc2", "frozen", "unused"],
           "llama": ["", "lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]}


def model_names(job):
    """The names of the trainable parameters with rows (the Net's unused layer: only its update size)."""
    update_size = "UpdateSize" in QUANTITIES.get(job, FIVE)
    return [name for name, param in model_of(job).named_parameters()
            if param.requires_grad and (update_size or not name.startswith("unused."))]


@pytest.mark.parametrize("job", list(JOBS))
def test_accelerate_fsdp2_prepared_then_tracked_equals_one_process(groups, job):
    results = results_of(groups, WORLD, job)
    got = agreed_table(results)
    expected = reference(job)
    assert_tables_match(got, expected)
    assert set(QUANTITIES.get(job, FIVE)) <= {key[1] for key in expected}
    assert not any(math.isnan(value) for value in got.values())
    assert {"all"} | set(model_names(job)) == {key[2] for key in expected}  # every trained parameter
    for result in results:  # Accelerate's FSDP2 on a 1-D CPU mesh over both processes
        assert result["params"] == {"DTensor"} and result["optimizer"] == "AcceleratedOptimizer"
        assert result["mesh"] == ("cpu", 1, WORLD)
        assert result["sharded"] == SHARDED[job]
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
