"""FSDP2 (``fully_shard``): exact global-batch statistics, identical on every process.

2 and 3 processes (gloo on loopback, a free port, float64, ``init_device_mesh("cpu",
(W,))``) run every job of a group in one launch (``process_groups.run_group``: a
join timeout, collectives time out). The model has a layer of width 7 (uneven
shards over 2 and 3 processes: 4 + 3 and 3 + 3 + 1 rows), a frozen layer and an unused
one (2 rows: an empty shard on the third process). Each job is compared with one process
holding the whole model and the whole global batch (all processes' examples, all
micro-batches), tracked by the same quantities, with the DDP tests' tolerance. The jobs
run the loop of docs/distributed.md's FSDP2 section (prepare_model, fully_shard, a
Cockpit over the sharded parameters).

Jobs: ``fully_shard`` on every Linear and the root with ``reshard_after_forward=True``
(mean loss, unequal local batches), on the root only with ``False`` (sum loss), two
micro-batches accumulated, and a quantity not marked exact under FSDP2 refused by name.
ParamGradRatio and UpdateSize are compared with one process whose ``param.grad`` is
FSDP2's, the gradient of the mean over processes of their local losses.
"""

import functools
import math
import warnings

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.process_groups import (
    agreed_table,
    assert_tables_match,
    results_of,
    run_jobs,
    run_once_per_world,
)

QUANTILES = (0.0, 0.25, 0.5, 1.0)
LR = 0.1
# Local batch sizes, per job and world size (per micro-batch for "accumulation").
SIZES = {  # 4 processes: HSDP's 2 x 2 mesh (test_fsdp2_tensor_parallel)
    "per_linear": {2: (3, 5), 3: (2, 4, 1)},
    "root_only": {2: (4, 4), 3: (3, 3, 3)},
    "accumulation": {2: ((2, 3), (4, 1)), 3: ((1, 2, 2), (3, 1, 2)), 4: ((1, 2, 1, 2), (2, 1, 3, 1))},
}


class Net(nn.Module):
    """Two trained layers (width 7: uneven shards), a frozen one and an unused one."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.frozen = nn.Linear(5, 3).requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) + self.frozen(x)


def make_model():
    torch.manual_seed(0)
    return cgn.prepare_model(Net().double())


def make_batch(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 5, dtype=torch.float64, generator=generator),
            torch.randint(0, 3, (n,), generator=generator))


def per_example(names):
    return [cgn.GradientNoiseScale(linear(1), param_names=names),
            cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names)]


def from_grad(names):
    """The quantities of ``param.grad`` and the parameters (FSDP2's: the mean over processes)."""
    return [cgn.ParamGradRatio(linear(1), param_names=names), cgn.UpdateSize(linear(1), param_names=names)]


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def table(cockpit):
    frame = cgn.to_frame(cockpit)
    return dict(zip(zip(frame.step, frame.quantity, frame.param, frame.statistic), frame.value))


def info(outputs, targets, loss, **extra):
    return {"batch_size": len(targets), "loss": loss, **extra,
            "individual_losses": F.cross_entropy(outputs, targets, reduction="none")}


def run_steps(model, cockpit, batches, reduction, micro_batches=1, optimizer_info=False):
    """Tracked steps: ``batches[step][k]`` the ``(x, y)`` of micro-batch ``k`` (this process's);
    with ``optimizer_info``, the SGD optimizer in ``info`` (PreconditionedNoiseScale: P = I)."""
    named = trainable(model)
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    loss_fn = extend(nn.CrossEntropyLoss(reduction=reduction))
    for step, micro in enumerate(batches):
        optimizer.zero_grad()
        for k, (x, y) in enumerate(micro):
            outputs = model(x)
            loss = loss_fn(outputs, y) / (micro_batches if reduction == "mean" else 1)
            extra = {"micro_batch": k, "micro_batches": micro_batches} if micro_batches > 1 else {}
            extra.update({"optimizer": optimizer} if optimizer_info else {})
            with cockpit(step, info=info(outputs, y, loss, **extra)):
                loss.backward()
        optimizer.step()


def local_batches(job, world, rank, steps=2):
    """This process's micro-batches of each step; the global ones are all processes' in rank order."""
    sizes = SIZES[job][world]
    sizes = sizes if isinstance(sizes[0], tuple) else (sizes,)
    batches = []
    for step in range(steps):
        micro = []
        for k, local in enumerate(sizes):
            x, y = make_batch(sum(local), seed=100 * step + k)
            start = sum(local[:rank])
            micro.append((x[start : start + local[rank]], y[start : start + local[rank]]))
        batches.append(micro)
    return batches


def global_batches(job, world, steps=2):
    """One batch per step: every micro-batch of every process."""
    sizes = SIZES[job][world]
    sizes = sizes if isinstance(sizes[0], tuple) else (sizes,)
    out = []
    for step in range(steps):
        parts = [make_batch(sum(local), seed=100 * step + k) for k, local in enumerate(sizes)]
        out.append([(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))])
    return out


JOBS = {  # job: (wrap every Linear, reshard_after_forward, reduction)
    "per_linear": (True, True, "mean"),
    "root_only": (False, False, "sum"),
    "accumulation": (True, True, "mean"),
}


def fsdp2_job(job, world, rank, mesh):
    from torch.distributed.fsdp import fully_shard

    per_linear, reshard, reduction = JOBS[job]
    model = make_model()
    if per_linear:
        for module in (model.fc1, model.fc2, model.frozen, model.unused):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    named = trainable(model)
    assert all(type(p).__name__ == "DTensor" for _, p in named)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=per_example(dict(named)) + from_grad(dict(named)))
    micro = len(SIZES[job][world]) if job == "accumulation" else 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(model, cockpit, local_batches(job, world, rank), reduction, micro)
    return {"table": table(cockpit), "warnings": [str(w.message) for w in caught]}


class NotMarked(cgn.GradientNoiseScale):
    """A quantity not marked exact under FSDP2 (``supports_fsdp2``)."""

    supports_fsdp2 = False


def refused_job(mesh):
    """The error of a quantity not exact under FSDP2, at its tracked step."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model, mesh=mesh)
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[NotMarked(linear(1), param_names=dict(named))])
    x, y = make_batch(4, seed=0)
    try:
        run_steps(model, cockpit, [[(x, y)]], "mean")
    except TypeError as error:
        return str(error)
    return None


class Twice(nn.Module):
    """One layer run twice in a forward pass."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def twice_tables(world, rank=None, mesh=None):
    """GradientNoiseScale and PerExampleGradNorm of a layer run twice: under FSDP2 (this
    process's batch) or on one process (the global batch); the table and the warnings."""
    torch.manual_seed(0)
    model = cgn.prepare_model(Twice().double())
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for module in (model.fc, model.head, model):
            fully_shard(module, mesh=mesh)
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=per_example(dict(named)))
    batches = local_batches("root_only", world, rank) if mesh is not None else global_batches("root_only", world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run_steps(model, cockpit, batches[:1], "mean")
        except ValueError as error:  # recorded: compared with one process's
            return {"error": str(error)}
    return {"table": table(cockpit), "warnings": [str(w.message) for w in caught]}


def worker(rank, world, port, out):
    jobs = {job: functools.partial(fsdp2_job, job, world, rank) for job in JOBS}
    jobs["refused"] = refused_job
    jobs["twice"] = functools.partial(twice_tables, world, rank)
    run_jobs(rank, world, port, out, jobs)


def reference(job, world, quantities=per_example, make=make_model, optimizer_info=False):
    """One process, the whole model (``make()``) and every step's whole global batch, tracked
    by ``quantities(names)``; the optimizer steps with FSDP2's gradient, the mean over
    processes of the local ones (``optimizer_info``: as :func:`run_steps`)."""
    _, _, reduction = JOBS[job]
    model = make()
    named = trainable(model)
    params = [p for _, p in named]
    cockpit = cgn.Cockpit(params, quantities=quantities(dict(named)))
    gradient_cockpit = cgn.Cockpit(params, quantities=from_grad(dict(named)))
    optimizer = torch.optim.SGD(params, lr=LR)
    loss_fn = extend(nn.CrossEntropyLoss(reduction=reduction))
    per_rank = [local_batches(job, world, rank) for rank in range(world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, [(x, y)] in enumerate(global_batches(job, world)):
            optimizer.zero_grad()
            outputs = model(x)
            loss = loss_fn(outputs, y)
            with cockpit(step, info=info(outputs, y, loss, **({"optimizer": optimizer} if optimizer_info else {}))):
                loss.backward()
            optimizer.zero_grad()
            micro = per_rank[0][step]
            scale = len(micro) if reduction == "mean" else 1
            fsdp_loss = sum(loss_fn(model(xr), yr) for batches in per_rank
                            for xr, yr in batches[step]) / (world * scale)
            with gradient_cockpit(step, info={"loss": fsdp_loss}):
                fsdp_loss.backward()
            optimizer.step()
    return {**table(cockpit), **table(gradient_cockpit)}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_", worker)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", list(JOBS))
def test_equals_one_process_on_the_global_batch(groups, world, job):
    results = results_of(groups, world, job)
    table = agreed_table(results)
    expected = reference(job, world)
    assert_tables_match(table, expected)
    rows = {(key[1], key[2]) for key in expected}
    # Every trained layer has rows, and the network's row leaves out the unused layer
    # (UpdateSize reads the parameters alone: the unused layer's update is 0).
    trained = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "all")
    for quantity in ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize"):
        assert {(quantity, name) for name in trained} <= rows, quantity
        assert any(name.startswith("unused") for q, name in rows if q == quantity) == (quantity == "UpdateSize")
    assert any(key[2] == "all" and key[3] == "params_covered" for key in expected)
    assert any("unused.weight" in message for message in results[0]["warnings"])
    assert not any(math.isnan(value) for value in table.values())


@pytest.mark.parametrize("world", [2, 3])
def test_quantities_not_exact_under_fsdp2_are_refused(groups, world):
    for message in results_of(groups, world, "refused"):
        assert message is not None and "FSDP2" in message and "GradientNoiseScale" in message


def test_layouts_not_made_exact_are_named():
    """A 2-D mesh not HSDP's, a mesh over some processes only, TP inside FSDP2 and a float16 policy (no
    processes: FSDP2's parameter as the check reads it); a bfloat16 policy passes."""
    from types import SimpleNamespace

    from cockpit_gradnoise.extensions import sharded

    class HSDPMeshInfo(SimpleNamespace):  # FSDP2's, as the check knows it: by name
        pass

    def fsdp_param(ndim=1, size=2, param_dtype=None, tensor_parallel=None, hsdp=False):
        mesh = SimpleNamespace(ndim=ndim, size=lambda: size)
        return SimpleNamespace(mesh_info=(HSDPMeshInfo if hsdp else SimpleNamespace)(mesh=mesh),
                               param_dtype=param_dtype, orig_dtype=torch.float32,
                               _unsharded_dtensor_spec=tensor_parallel)

    world = SimpleNamespace(get_world_size=lambda: 2)
    original = sharded.dist_world_size
    sharded.dist_world_size = world.get_world_size
    try:
        assert sharded.unsupported_layout(fsdp_param()) is None
        assert sharded.unsupported_layout(fsdp_param(param_dtype=torch.float32)) is None
        assert "other than HSDP's" in sharded.unsupported_layout(fsdp_param(ndim=2))  # not HSDP's mesh_info
        assert "span every process" in sharded.unsupported_layout(fsdp_param(size=1))
        assert sharded.unsupported_layout(fsdp_param(param_dtype=torch.bfloat16)) is None  # tests/test_fsdp2_bf16.py
        assert "MixedPrecisionPolicy" in sharded.unsupported_layout(fsdp_param(param_dtype=torch.float16))
        assert sharded.unsupported_layout(fsdp_param(ndim=2, hsdp=True)) is None
        assert "HSDP or tensor" in sharded.unsupported_layout(fsdp_param(ndim=2, hsdp=True, param_dtype=torch.bfloat16))
        assert "tensor parallelism" in sharded.unsupported_layout(fsdp_param(tensor_parallel=object()))
    finally:
        sharded.dist_world_size = original


@pytest.mark.parametrize("world", [2, 3])
def test_a_layer_run_twice_is_as_on_one_process_or_left_out_by_name(groups, world):
    """As on one process (today a ValueError for a layer run twice), or rows equal to one
    process's, a parameter whose uses' results split between FSDP2's copies left out by name."""
    results, expected = results_of(groups, world, "twice"), twice_tables(world)
    if "error" in expected:
        assert all(result.get("error") == expected["error"] for result in results)
        return
    got = agreed_table(results)
    for name in ("fc.weight", "fc.bias", "head.weight", "head.bias"):
        rows = {key: value for key, value in expected["table"].items() if key[2] == name}
        if any(key[2] == name for key in got):
            assert_tables_match({key: got[key] for key in got if key[2] == name}, rows)
        else:
            assert any(name in message and "several times" in message for message in results[0]["warnings"])


def test_results_split_between_the_copies_are_refused_not_half_counted(monkeypatch):
    """collect: a result on the unsharded copy moves to the sharded one; results on both
    (a layer's uses split between them) leave neither and refuse the parameter by name."""
    from types import SimpleNamespace

    from cockpit_gradnoise.extensions import facts, sharded

    moved, split = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    copies = {id(p): SimpleNamespace(_unsharded_param=nn.Parameter(torch.zeros(2))) for p in (moved, split)}
    monkeypatch.setattr(sharded, "fsdp2_parameters", lambda: copies)
    recording = facts.begin()
    for param in (moved, split):
        setattr(copies[id(param)]._unsharded_param, sharded.BATCH_L2_SAVEFIELD, torch.ones(3))
    setattr(split, sharded.BATCH_L2_SAVEFIELD, torch.ones(3))
    sharded.collect([moved, split])
    assert torch.equal(getattr(moved, sharded.BATCH_L2_SAVEFIELD), torch.ones(3))
    assert id(moved) not in recording.refusals
    assert not hasattr(split, sharded.BATCH_L2_SAVEFIELD) and "several times" in recording.refusals[id(split)]
    assert all(sharded.BATCH_L2_SAVEFIELD not in c._unsharded_param.__dict__ for c in copies.values())


def test_fsdp2_class_is_seen_through_one_way():
    """fully_shard's class for a module (``FSDP<name>`` of ``(FSDPModule, class)``, as torch's
    ``_apply_to_module`` builds it, no processes): the module's own class behind it, for the
    sequence-parallel norms' exact-class test and for telling a model sharded."""
    from cockpit_gradnoise import fsdp2
    from cockpit_gradnoise.extensions import sharded, tensor_parallel

    from torch.distributed.fsdp import FSDPModule

    norm = nn.LayerNorm(3)
    norm.__class__ = type("FSDPLayerNorm", (FSDPModule, nn.LayerNorm), {})
    assert sharded.class_before_sharding(norm) is nn.LayerNorm and sharded.sharded_by_fsdp2(norm)
    assert tensor_parallel.sequence_norm(norm) and fsdp2.fully_sharded(nn.Sequential(nn.Linear(3, 3), norm))

    class Norm(nn.LayerNorm):  # a subclass: not the exact class, sharded or not
        pass

    assert not tensor_parallel.sequence_norm(Norm(3)) and not fsdp2.fully_sharded(nn.Sequential(Norm(3)))
    assert sharded.class_before_sharding(Norm(3)) is Norm and not sharded.sharded_by_fsdp2(Norm(3))
