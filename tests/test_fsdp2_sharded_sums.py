"""FSDP2: per-element sums reduce-scattered inside the backward pass, each process keeping its rows.

2 and 3 processes (gloo on loopback, float64, one launch per world size). Jobs:

- ``rows``: :func:`cockpit_gradnoise.extensions.sharded.reduced_rows` against the plain sum
  over processes cut by :func:`torch.chunk` (odd sizes, a shard dimension other than 0,
  empty shards, 2 and 3 rows of sums, pieces of 3 elements and of the default size);
- ``in_backward``: GradientVarianceQuantiles and PreconditionedNoiseScale (with
  GradientNoiseScale, whose sums are reduced after the backward pass) on test_fsdp2's
  model (a layer of 7 rows, a frozen and an unused one): every trainable used parameter's
  sums are reduce-scattered inside the backward pass to this process's rows, once (shared
  by the two quantities), and the tables equal those of the same quantities
  whose sums are reduced whole after the backward pass (to float64 rounding);
- ``non_finite``: a non-finite value in process 0's rows of one layer's sums only: every
  process reports that layer (and the network) NaN, the other layers as without it, and
  the tables are identical (no process left waiting in the distributed selection).
"""

import functools
import math

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.process_groups import agreed_table, assert_identical, results_of, run_jobs, run_once_per_world
from tests.test_fsdp2 import info, local_batches, make_model, table, trainable

ROWS_CASES = [((7, 5), 0), ((1, 4), 0), ((2,), 0), ((5, 3, 2), 1), ((3, 7), 1), ((10,), 0)]


def rows_job(world, rank, mesh):
    """The largest difference, relative, from the plain sum's rows (shapes checked)."""
    from cockpit_gradnoise.extensions import sharded

    worst = 0.0
    default = sharded.PIECE
    try:
        for piece in (3, default):
            sharded.PIECE = piece
            for shape, dim in ROWS_CASES:
                for k in (2, 3):
                    generator = torch.Generator().manual_seed(len(shape) + k)
                    values = [torch.randn(k, *shape, generator=generator, dtype=torch.float64)
                              for _ in range(world)]
                    units = [[0.5 + r] + [(0.5 + r) ** 2] * (k - 1) for r in range(world)]
                    view = (-1,) + (1,) * len(shape)
                    got = sharded.reduced_rows(values[rank], units[rank], dim, mesh)
                    total = sum(v / torch.tensor(u, dtype=torch.float64).view(view)
                                for v, u in zip(values, units))
                    chunks = total.chunk(world, dim + 1)
                    want = chunks[rank] if rank < len(chunks) else total.narrow(dim + 1, 0, 0)
                    want = want * torch.tensor(units[rank], dtype=torch.float64).view(view)
                    assert got.shape == want.shape, (shape, dim, k, got.shape, want.shape)
                    if want.numel():
                        worst = max(worst, float(((got - want).abs() / want.abs()).max()))
    finally:
        sharded.PIECE = default
    return worst


def sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for module in (model.fc1, model.fc2, model.frozen, model.unused):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tracked_steps(mesh, world, rank, at_end=False, poison=None):
    """Two steps of GradientVarianceQuantiles, GradientNoiseScale and PreconditionedNoiseScale (Adam); the
    shapes reduced inside the backward pass, per step. ``at_end``: the sums reduced after
    it instead. ``poison``: a parameter name whose rows on process 0 get an infinity."""
    from cockpit_gradnoise.extensions import sharded

    model = sharded_model(mesh)
    named = trainable(model)
    # GradientNoiseScale between them: a quantity whose sums are reduced after the backward
    # pass, joining the call after the first has armed the hooks, leaves them armed.
    quantities = [cgn.GradientVarianceQuantiles(linear(1), quantiles=(0.0, 0.5, 1.0), param_names=dict(named)),
                  cgn.GradientNoiseScale(linear(1), param_names=dict(named)),
                  cgn.PreconditionedNoiseScale(linear(1), param_names=dict(named))]
    # GradientNoiseScale's local gradient is reduce-scattered in the backward pass too
    # (tests/test_fsdp2_gradient_in_backward.py); here after it, the quantity in between.
    for quantity in quantities if at_end else quantities[1:2]:
        quantity.sums_sharded_in_backward = None
    cockpit = cgn.Cockpit([p for _, p in named], quantities=quantities)
    optimizer = torch.optim.Adam([p for _, p in named], lr=0.01)
    loss_fn = extend(nn.CrossEntropyLoss())
    reduced, original = [], sharded.reduced_rows
    shapes = {tuple(p.shape): n for n, p in named}

    def recording(value, units, dim, mesh, *dims):
        rows = original(value, units, dim, mesh, *dims)
        name = shapes[tuple(value.shape[1:])]
        reduced.append((name, tuple(rows.shape), stage[0]))
        if name == poison and rank == 0 and rows.numel():
            rows[1].view(-1)[0] = math.inf
        return rows

    stage = ["in the backward pass"]
    sharded.reduced_rows = recording
    try:
        for step, ((x, y),) in enumerate(local_batches("root_only", world, rank)):
            optimizer.zero_grad()
            outputs = model(x)
            loss = loss_fn(outputs, y)
            with cockpit(step, info=info(outputs, y, loss, optimizer=optimizer)):
                loss.backward()
                stage[0] = "after it"  # the quantities compute when the block ends
            stage[0] = "in the backward pass"
            optimizer.step()
    finally:
        sharded.reduced_rows = original
    return {"table": table(cockpit), "reduced": reduced}


def worker(rank, world, port, out):
    jobs = {"rows": functools.partial(rows_job, world, rank),
            "in_backward": functools.partial(tracked_steps, world=world, rank=rank),
            "at_end": functools.partial(tracked_steps, world=world, rank=rank, at_end=True),
            "non_finite": functools.partial(tracked_steps, world=world, rank=rank, poison="fc2.weight")}
    run_jobs(rank, world, port, out, jobs)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_sharded_sums_", worker)


@pytest.mark.parametrize("world", [2, 3])
def test_reduced_rows_are_the_sum_cut_as_torch_chunk_cuts(groups, world):
    for worst in results_of(groups, world, "rows"):
        assert worst <= 1e-14  # a sum of `world` float64 terms, divided and multiplied back


def chunk_shape(shape, world, rank):
    rows = -(-shape[0] // world)
    start = min(rank * rows, shape[0])
    return (min(start + rows, shape[0]) - start,) + shape[1:]


@pytest.mark.parametrize("world", [2, 3])
def test_sums_are_reduce_scattered_in_the_backward_pass_to_each_process_rows(groups, world):
    results = results_of(groups, world, "in_backward")
    shapes = {"fc1.weight": (7, 5), "fc1.bias": (7,), "fc2.weight": (3, 7), "fc2.bias": (3,)}
    for rank, result in enumerate(results):
        # Once per step (two steps) and trainable used parameter, with this process's rows of
        # the two sums, inside the backward pass; never the frozen or unused layer.
        expected = sorted((name, (2,) + chunk_shape(shape, world, rank), "in the backward pass")
                          for name, shape in shapes.items()) * 2
        assert sorted(result["reduced"]) == sorted(expected), rank
    at_end = agreed_table(results_of(groups, world, "at_end"))
    inside = agreed_table(results)
    assert inside.keys() == at_end.keys()
    for key, value in at_end.items():
        assert math.isclose(inside[key], value, rel_tol=1e-12, abs_tol=1e-300) or (
            math.isnan(value) and math.isnan(inside[key])), key


@pytest.mark.parametrize("world", [2, 3])
def test_a_non_finite_value_in_one_process_rows_is_nan_on_every_process(groups, world):
    results = results_of(groups, world, "non_finite")
    assert_identical([result["table"] for result in results])
    poisoned, clean = results[0]["table"], agreed_table(results_of(groups, world, "in_backward"))
    variance = {key: value for key, value in poisoned.items() if key[1] == "GradientVarianceQuantiles"}
    assert variance
    for key, value in variance.items():
        if key[3] in ("params_covered", "params_total"):
            assert value == clean[key], key
        elif key[2] in ("fc2.weight", "all"):
            assert math.isnan(value), key
        else:
            assert value == clean[key], key
