"""FSDP2: GradientVarianceQuantiles and PreconditionedNoiseScale on sharded sums, exact.

2 and 3 processes (gloo on loopback, float64, ``init_device_mesh("cpu", (W,))``), one
launch per world size for every job (``process_groups.run_group``). The model is
test_fsdp2's (a layer of width 7: shards of 4 + 3 and 3 + 3 + 1 rows; a frozen and an
unused layer of 3 and 2 rows: an empty shard on the third process). Each process keeps
only its rows of the reduced per-element sums; the quantiles over elements on different
processes come from a distributed selection
(:func:`cockpit_gradnoise.order_statistics.quantile_summaries_across`). Compared with one
process holding the whole model and the whole global batch, in float64, with the DDP
tests' tolerance, and every process's table identical to rank 0's bit for bit.

Jobs: the selection alone on adversarial values (signs, ``-0.0``, infinities, ties, an
empty shard) against ``numpy.quantile``; GradientVarianceQuantiles with ``fully_shard``
on every Linear (mean loss, unequal local batches), on the root only (sum loss,
``reshard_after_forward=False``) and over two micro-batches; PreconditionedNoiseScale
with Adam (its ``exp_avg_sq`` a sharded DTensor; ``fully_shard`` on every Linear) and SGD
(``P = I``; the root only), equal local batches of a mean loss so that FSDP2's gradient,
which sets Adam's ``P``, is the global batch's.
"""

import functools
import math
import warnings

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import numpy
import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.process_groups import (
    agreed_table,
    assert_identical,
    assert_tables_match,
    results_of,
    run_jobs,
    run_once_per_world,
)
from tests.test_fsdp2 import (
    JOBS,
    SIZES,
    info,
    local_batches,
    make_batch,
    make_model,
    reference,
    run_steps,
    table,
    trainable,
)

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.9, 1.0)
ADAM_SIZES = {2: (3, 3), 3: (2, 2, 2), 4: (2, 2, 2, 2)}  # 4: HSDP 2 x 2 (test_fsdp2_tensor_parallel)


def variance(names):
    return [cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names)]


def sharded_model(mesh, per_linear, reshard):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if per_linear:
        for module in (model.fc1, model.fc2, model.frozen, model.unused):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def variance_job(job, world, rank, mesh):
    per_linear, reshard, reduction = JOBS[job]
    model = sharded_model(mesh, per_linear, reshard)
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=variance(dict(named)))
    micro = len(SIZES[job][world]) if job == "accumulation" else 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(model, cockpit, local_batches(job, world, rank), reduction, micro)
    return {"table": table(cockpit), "warnings": [str(w.message) for w in caught]}


def variance_reference(job, world):
    """test_fsdp2's one process on the global batch, GradientVarianceQuantiles' rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = reference(job, world, quantities=variance)
    return {key: value for key, value in rows.items() if key[1] == "GradientVarianceQuantiles"}


def adam_steps(model, world, rank=None, steps=2, optimizer_class=torch.optim.Adam, state=None):
    """Adam (or SGD: P = I), PreconditionedNoiseScale every step; this process's batch (or
    the global one). Adam's state is a DTensor from the second step on (``state``, if given,
    gets each parameter's ``exp_avg_sq`` placements after the last step)."""
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[
        cgn.PreconditionedNoiseScale(linear(1), param_names=dict(named))])
    optimizer = optimizer_class([p for _, p in named], lr=0.01)
    loss_fn = extend(nn.CrossEntropyLoss())
    sizes = ADAM_SIZES[world]
    for step in range(steps):
        x, y = make_batch(sum(sizes), seed=7 + step)
        if rank is not None:
            start = sum(sizes[:rank])
            x, y = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
        optimizer.zero_grad()
        outputs = model(x)
        loss = loss_fn(outputs, y)
        with cockpit(step, info=info(outputs, y, loss, optimizer=optimizer)):
            loss.backward()
        optimizer.step()
    if state is not None:
        state.update({name: str(getattr(optimizer.state[p].get("exp_avg_sq"), "placements", None))
                      for name, p in named})
    return table(cockpit)


def selection_groups(world, rank):
    """This process's elements of three groups, and each group's union (numpy)."""
    generator = torch.Generator().manual_seed(5)
    spread = torch.randn(101, dtype=torch.float64, generator=generator) * 1e3
    ties = torch.tensor([1.0, 1.0, -0.0, 0.0, 0.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    extremes = torch.tensor([math.inf, -math.inf, 5e-324, -5e-324, 1e308, -1.0], dtype=torch.float64)
    unions = [spread, ties, extremes]
    # Process r holds elements r, r + W, ...; the last process none of the extremes.
    mine = [u[rank::world] if not (g == 2 and rank == world - 1) else u[:0] for g, u in enumerate(unions)]
    if world > 1 and rank == world - 1:
        unions[2] = torch.cat([unions[2][r::world] for r in range(world - 1)])
    return mine, unions


def selection_job(world, rank):
    from cockpit_gradnoise.order_statistics import quantile_summaries_across

    mine, unions = selection_groups(world, rank)
    levels = (0.0, 0.1, 0.5, 0.77, 1.0)
    groups = mine + [mine[:2], [mine[0][:0]]]  # the union of two groups, and a group empty everywhere
    found = quantile_summaries_across(groups, levels)
    nan_error = None
    try:
        quantile_summaries_across([mine[0] if rank else torch.tensor([math.nan])], levels)
    except ValueError as error:
        nan_error = str(error)
    return {"found": found, "levels": levels, "nan_error": nan_error, "keys": search_job(world, rank)}


def search_keys(world, rank):
    """Small integer keys (ties, gaps, negatives): the search's points often land on them."""
    union = torch.tensor([-7, -7, -3, 0, 0, 1, 2, 2, 2, 5, 64, 65, 66, 200, 4096, 4097], dtype=torch.int64)
    return union[rank::world], union


def search_job(world, rank):
    """Every rank of the keys' union, by the search with 64 points and with 2 (a bisection)."""
    from cockpit_gradnoise.order_statistics import distributed as selection

    mine, union = search_keys(world, rank)
    targets = [([0], k) for k in range(union.numel())]
    found = []
    for points in (64, 2):
        default = selection.POINTS
        selection.POINTS = points
        try:
            values = selection.select_across([mine], targets)
        finally:
            selection.POINTS = default
        found.append(selection.order_keys(torch.tensor(values, dtype=torch.float64)).tolist())
    return found


def worker(rank, world, port, out):
    jobs = {"selection": lambda mesh: selection_job(world, rank)}
    jobs.update({job: functools.partial(variance_job, job, world, rank) for job in JOBS})
    jobs["adam"] = lambda mesh: adam_steps(sharded_model(mesh, True, True), world, rank)
    jobs["sgd"] = lambda mesh: adam_steps(sharded_model(mesh, False, False), world, rank,
                                          optimizer_class=torch.optim.SGD)
    run_jobs(rank, world, port, out, jobs)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_variance_", worker)


def same(a, b):
    """Equal, element by element (in nested lists), NaN equal to NaN; None to None."""
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # numpy's inf - inf
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_selection_is_numpys_quantile_on_every_process(groups, world):
    results = results_of(groups, world, "selection")
    found = [r["found"] for r in results]
    assert all(same(f, found[0]) for f in found[1:])  # bit for bit
    _, unions = selection_groups(world, world - 1)
    unions = unions + [torch.cat(unions[:2])]
    levels = results[0]["levels"]
    for union, summary in zip(unions, found[0]):
        values = union.numpy()
        assert same(summary[:-1], numpy.quantile(values, levels).tolist()), (summary, values)
        assert summary[-1] == pytest.approx(float(values.sum()) / values.size, rel=1e-12, nan_ok=True)
    assert found[0][-1] is None
    for keys in (r["keys"] for r in results):  # an element's key, at every rank
        assert keys == [search_keys(world, 0)[1].tolist()] * 2
    assert all("NaN" in r["nan_error"] for r in results)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", list(JOBS))
def test_variance_quantiles_equal_one_process_on_the_global_batch(groups, world, job):
    results = results_of(groups, world, job)
    table = agreed_table(results)
    expected = variance_reference(job, world)
    assert_tables_match(table, expected)
    names = {key[2] for key in expected}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "all"} <= names
    assert not any(name.startswith(("unused", "frozen")) for name in names)
    assert any(key[3] == "snr_q0.5" for key in expected)
    assert not any(math.isnan(value) for value in table.values())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_preconditioned_noise_scale_equals_one_process(groups, world, optimizer):
    tables = results_of(groups, world, optimizer)
    assert_identical(tables)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = adam_steps(make_model(), world, optimizer_class=getattr(
            torch.optim, {"adam": "Adam", "sgd": "SGD"}[optimizer]))
    assert_tables_match(tables[0], expected)
    assert {key[2] for key in expected} >= {"fc1.weight", "fc2.bias", "all"}
    assert {key[0] for key in expected} == {0, 1}
