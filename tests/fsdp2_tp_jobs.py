"""The jobs of tests/test_fsdp2_tensor_parallel.py (FSDP2, HSDP and their tensor-parallel layouts
on 4 processes) and the models and meshes they share with its tests: run in the spawned
processes of that file's one launch, each compared there with one process on the global batch."""

import contextlib
import functools
import warnings

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

from cockpit.utils.schedules import linear

from tests import test_fsdp2, test_fsdp2_gradient_in_backward, test_fsdp2_variance, test_tensor_parallel

DP, TP = 2, 2
WORLD = DP * TP
SPLIT = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def make_model():
    return test_tensor_parallel.make_model("mean")


def per_example(names):
    """test_fsdp2's per-example quantities and the quantiles of the gradient's sd."""
    return test_fsdp2.per_example(names) + [
        cgn.GradientVarianceQuantiles(linear(1), quantiles=test_fsdp2.QUANTILES, param_names=names)]


def dp_mesh(mesh):
    """The data-parallel part of ``mesh``: ``dp``, or HSDP's ``("replicate", "shard")``."""
    names = tuple(name for name in mesh.mesh_dim_names if name != "tp")
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def dp_rank(mesh):
    """This process's rank among the data-parallel groups (``tp`` is the innermost dimension)."""
    return mesh.get_rank() // mesh["tp"].size()


def sharded_model(mesh, per_linear=True, reshard=True, model=None):
    """The model (by default prepared) split on ``tp``, then sharded on ``dp`` (the order
    torchtitan uses; HSDP: on ``("replicate", "shard")``)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_model() if model is None else model
    parallelize_module(model, mesh["tp"], test_tensor_parallel.plan("mean"))
    if per_linear:
        for module in (model.fc1, model.fc2, model.head, model.frozen, model.unused):
            fully_shard(module, mesh=dp_mesh(mesh), reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh(mesh), reshard_after_forward=reshard)
    return model


def job_table(job, mesh, quantities=per_example):
    """The table, warnings and placements of test_fsdp2's ``job`` on this process's batches."""
    per_linear, reshard, reduction = test_fsdp2.JOBS[job]
    model = sharded_model(mesh, per_linear, reshard)
    named = test_fsdp2.trainable(model)
    names = dict(named)
    cockpit = cgn.Cockpit([p for _, p in named],
                          quantities=quantities(names) + test_fsdp2.from_grad(names))
    micro = len(test_fsdp2.SIZES[job][DP]) if job == "accumulation" else 1
    batches = test_fsdp2.local_batches(job, DP, dp_rank(mesh))
    held = {}
    with warnings.catch_warnings(record=True) as caught, sums_held(named, held):
        warnings.simplefilter("always")
        test_fsdp2.run_steps(model, cockpit, batches, reduction, micro)
    return {"table": test_fsdp2.table(cockpit), "warnings": [str(w.message) for w in caught],
            "placements": {name: str(p.placements) for name, p in named}, "held": held}


@contextlib.contextmanager
def sums_held(named, held):
    """Record in ``held`` (``{name: {shape}}``) the shapes of the per-element sums
    (``SUMS_SAVEFIELD``, ``[k, *rows]``) each parameter of ``named`` holds after each backward
    pass: where the quantities' first step (``sharded.collect``) finds them, on FSDP2's
    sharded or unsharded parameter."""
    from cockpit_gradnoise.extensions import sharded
    from cockpit_gradnoise.extensions.savefields import SUMS_SAVEFIELD

    original, managed = sharded.collect, sharded.fsdp2_parameters()

    def collecting(params):
        for name, param in named:
            for holder in (param, getattr(managed.get(id(param)), "_unsharded_param", None)):
                value = getattr(holder, "__dict__", {}).get(SUMS_SAVEFIELD)
                if value is not None:
                    held.setdefault(name, set()).add(tuple(value.shape))
        original(params)

    sharded.collect = collecting
    try:
        yield
    finally:
        sharded.collect = original


def refusals(mesh):
    """What an exact quantity says over the plain layer alone (sharded on ``dp`` only: nothing
    tells the ``tp`` groups, whose processes hold the same examples)."""
    messages = {}
    model = sharded_model(mesh)
    named = [(n, p) for n, p in test_fsdp2.trainable(model) if n.startswith("head")]
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[
        cgn.GradientNoiseScale(linear(1), param_names=dict(named))])
    batches = test_fsdp2.local_batches("per_linear", DP, mesh["dp"].get_local_rank(), steps=1)
    try:
        test_fsdp2.run_steps(model, cockpit, batches, "mean")
        messages["plain_only"] = None
    except TypeError as error:
        messages["plain_only"] = str(error)
    return messages


def adam(mesh):
    """PreconditionedNoiseScale with Adam (test_fsdp2_variance's job: equal local batches of a
    mean loss, so that FSDP2's gradient, which sets P, is the global batch's): the table, and
    each parameter's ``exp_avg_sq`` placements (placed as the parameter)."""
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the jobs' test
        table = test_fsdp2_variance.adam_steps(sharded_model(mesh), DP, rank=mesh["dp"].get_local_rank(),
                                               state=state)
    return {"table": table, "state": state}


def two_batch(mesh=None, dp=DP, make=make_model, quantities=None):
    """TwoBatchNoiseScale on test_fsdp2's accumulation job: each ``dp`` group's micro-batches
    the small batches (the two processes of a ``tp`` group hold the same: counted once), the
    step's FSDP2 gradient the big one. Without ``mesh``, one process (the model ``make()``)
    with every one of ``dp`` groups' micro-batches as its own, each loss weighted as FSDP2's
    mean over ``dp`` weights it."""
    micro = len(test_fsdp2.SIZES["accumulation"][dp])
    if mesh is None:
        model = make()
        per_rank = [test_fsdp2.local_batches("accumulation", dp, rank) for rank in range(dp)]
        batches = [[batch for batches in per_rank for batch in batches[step]] for step in range(2)]
        micro *= dp
    else:
        model = sharded_model(mesh)
        batches = test_fsdp2.local_batches("accumulation", DP, dp_rank(mesh))
    named = test_fsdp2.trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=test_tensor_parallel.two_batch(dict(named)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        test_fsdp2.run_steps(model, cockpit, batches, "mean", micro)
    return test_fsdp2.table(cockpit)


def sequence(mesh=None, loss_parallel=False):
    """test_tensor_parallel's Sequence model (torchtitan's layout: norms under SequenceParallel)
    split on ``tp`` by its sequence_plan, its norm and its split layers sharded on ``dp`` (and
    the root), tracked by the five quantities over two SGD steps of a mean loss: each ``dp``
    group 2 of the step's 4 sequences (equal shares: FSDP2's mean over ``dp`` is the global
    batch's gradient). Without ``mesh``, one process with all 4. With ``loss_parallel``, the
    head's output split along the classes and the loss computed under ``loss_parallel()``
    (its per-example losses a replicated DTensor)."""
    from torch.distributed.fsdp import fully_shard

    model = test_tensor_parallel.make_model("sequence")
    batches = [[test_tensor_parallel.make_batch("sequence", 4, seed=100 * step)] for step in range(2)]
    if mesh is not None:
        test_tensor_parallel.sequence_plan(model, mesh["tp"], loss_parallel)
        for name in ("norm", "fc1", "fc2"):
            fully_shard(model.block[name], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        part = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
        batches = [[(x[part], y[part]) for x, y in micro] for micro in batches]
    named = test_fsdp2.trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=test_tensor_parallel.quantities(dict(named)))
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    with warnings.catch_warnings(), parallel_loss() if loss_parallel else contextlib.nullcontext():
        warnings.simplefilter("ignore")  # the unused layer, named in test_tensor_parallel
        test_fsdp2.run_steps(model, cockpit, batches, "mean")
    return test_fsdp2.table(cockpit)


# HSDP over tensor parallelism: fully_shard on ("replicate", "shard") of a 3-D mesh of the 4
# processes, tp innermost; replicas (2 x 1 x 2: UpdateSize counts a replicated shard once)
# and shards (1 x 2 x 2), each with its jobs; every process of a dp group its own examples.
HSDP_TP = {"replicas": ((2, 1, 2), ("per_linear", "accumulation")),
           "shards": ((1, 2, 2), ("root_only", "accumulation"))}
HSDP_QUANTITIES = {"GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
                   "GradientVarianceQuantiles"}
# cgn.track's presets, each once ("norms" where replicas make its big batch count shards once).
HSDP_TRACKED = {"replicas": ("adaptive", "norms"), "shards": ("all",)}


@functools.lru_cache(maxsize=None)
def hsdp_mesh(layout):
    """The 3-D mesh of ``layout``, made once per process (each new mesh makes process groups:
    a rendezvous of every process)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", HSDP_TP[layout][0], mesh_dim_names=("replicate", "shard", "tp"))


def hsdp_job(layout, job, _):
    """test_fsdp2's ``job`` on the HSDP x TP mesh of ``layout``, the five per-example quantities
    and the two of ``param.grad``."""
    return job_table(job, hsdp_mesh(layout))


def hsdp_track(layout, preset, rank, _):
    """``cgn.track`` with ``preset`` on the model built, split on ``tp`` and sharded by HSDP,
    each dp group's accumulated micro-batches."""
    mesh = hsdp_mesh(layout)
    split = lambda model, _: sharded_model(mesh, model=model)  # noqa: E731
    return test_tensor_parallel.front_door(mesh, quantities=preset, rank=rank // TP, split=split)


def hsdp_adam(layout, rank, _):
    """PreconditionedNoiseScale with Adam on the HSDP x TP mesh of ``layout`` (each process
    the P of its elements: ``exp_avg_sq`` placed as the parameter on (replicate, shard, tp))."""
    mesh = hsdp_mesh(layout)
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the jobs' test
        table = test_fsdp2_variance.adam_steps(sharded_model(mesh), DP, rank=rank // TP, state=state)
    return {"table": table, "state": state}


def hsdp_model(mesh):
    """test_fsdp2's model, every Linear and the root sharded by HSDP on ``mesh`` (2-D: the
    launch's, its first dimension the replicate one)."""
    from torch.distributed.fsdp import fully_shard

    model = test_fsdp2.make_model()
    for module in (model.fc1, model.fc2, model.frozen, model.unused):
        fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def every_quantity(names):
    """The five per-example quantities, PreconditionedNoiseScale (SGD: P = I) and the two of
    ``param.grad``; TwoBatchNoiseScale is added on the processes (its reference: two_batch)."""
    return per_example(names) + [cgn.PreconditionedNoiseScale(linear(1), param_names=names)]


def hsdp_every_quantity(rank, mesh):
    """test_fsdp2's accumulation job of 4 processes on HSDP's 2 x 2 mesh (no tensor
    parallelism), tracked by every quantity in one cockpit."""
    model = hsdp_model(mesh)
    named = dict(test_fsdp2.trainable(model))
    cockpit = cgn.Cockpit(list(named.values()), quantities=every_quantity(named) + test_fsdp2.from_grad(named)
                          + test_tensor_parallel.two_batch(named))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in test_fsdp2
        test_fsdp2.run_steps(model, cockpit, test_fsdp2.local_batches("accumulation", WORLD, rank), "mean", 2,
                             optimizer_info=True)
    return {"table": test_fsdp2.table(cockpit)}


def hsdp_adam_alone(rank, mesh):
    """PreconditionedNoiseScale with Adam on HSDP's 2 x 2 mesh: equal local batches of a mean
    loss (FSDP2's gradient, which sets P, is the global batch's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"table": test_fsdp2_variance.adam_steps(hsdp_model(mesh), WORLD, rank=rank)}


def hsdp_in_backward(rank, mesh):
    """test_fsdp2_gradient_in_backward's accumulation job on HSDP's 2 x 2 mesh (no tensor
    parallelism): GradientNoiseScale's local gradient reduce-scattered over ``shard`` and
    added over ``replicate`` in the backward pass; the table and the reductions made.
    ``mesh`` is the launch's 2 x 2 one: ``fully_shard`` on a 2-D mesh is HSDP, its first
    dimension the replicate one, whatever their names (no new mesh: a new one makes process
    groups, a rendezvous of every process)."""
    return test_fsdp2_gradient_in_backward.gradient_job("accumulation", False, WORLD, rank, mesh)


#: The ``tp`` shards of the split parameters (FSDP2's unsharded parameter on each process),
#: and the parameters not split (whole: ``fc2.bias`` replicated on ``tp``, ``head`` on ``dp`` only).
TP_SHARDS = {(4, 5): "fc1.weight", (4, 4): "fc2.weight", (4,): "fc1.bias or fc2.bias"}
NOT_SPLIT = {(3, 4): "head.weight", (3,): "head.bias"}


def split_gradient(layout, at_end, mesh):
    """GradientNoiseScale alone on the model split on ``tp`` and sharded (every Linear and
    the root) on ``dp`` (``"dp_tp"``, the launch's mesh) or by HSDP (``"replicas"``), each
    data-parallel group's micro-batches of test_fsdp2's accumulation job: its local gradient
    kept in the backward pass or (``at_end``) gathered whole after it."""
    mesh = mesh if layout == "dp_tp" else hsdp_mesh(layout)
    return test_fsdp2_gradient_in_backward.tracked_gradient(
        sharded_model(mesh), test_fsdp2.local_batches("accumulation", DP, dp_rank(mesh)), at_end,
        shapes={**TP_SHARDS, **NOT_SPLIT})
