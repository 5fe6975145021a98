"""FSDP2: GradientNoiseScale's local gradient reduce-scattered inside the backward pass.

2 and 3 processes (gloo on loopback, float64, one launch per world size), test_fsdp2's
model (a layer of 7 rows: shards of 4 + 3 and 3 + 3 + 1 rows; a frozen and an unused
layer, never reduced). Each job runs two tracked steps of GradientNoiseScale alone, with
its local gradient reduce-scattered in the backward pass (``in_backward``) or reduced
whole after it (``at_end``, ``sums_sharded_in_backward = None``, the path of before):

- ``per_linear``: one batch per process and step (unequal local batches, a mean loss);
- ``accumulation``: two micro-batches per step;
- ``zero_rank0``: process 0's inputs all 0, so its examples' contributions to
  ``fc1.weight`` are exactly 0 (the exact-zero rule's case): the rule is this process's,
  applied before the sum over processes, never to its rows of the sum.

Checked: every trainable used parameter's local gradient is reduced once per backward
pass, inside it, to this process's ``torch.chunk`` rows; the tables equal the ``at_end``
ones within a bound derived below, and one process holding the whole model and batch
(test_fsdp2's reference, the DDP tests' tolerance); the per-micro-batch squared norms
(:attr:`GradientNoiseScale.micro_batch_gradients`, this process's) are those of the
``at_end`` path, bit for bit.
"""

import functools
import math

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.process_groups import agreed_table, assert_tables_match, results_of, run_jobs, run_once_per_world
from tests.test_fsdp2 import SIZES, info, local_batches, make_model, reference, table, trainable

SHAPES = {"fc1.weight": (7, 5), "fc1.bias": (7,), "fc2.weight": (3, 7), "fc2.bias": (3,)}
JOBS = {"per_linear": "per_linear", "accumulation": "accumulation", "zero_rank0": "per_linear"}
U = 2.0**-53  # float64's unit roundoff


def batches_of(job, world, rank):
    """This process's micro-batches per step (``zero_rank0``: process 0's inputs all 0)."""
    batches = local_batches(JOBS[job], world, rank)
    if job == "zero_rank0" and rank == 0:
        batches = [[(torch.zeros_like(x), y) for x, y in micro] for micro in batches]
    return batches


def gradient_job(job, at_end, world, rank, mesh):
    """Two tracked steps of GradientNoiseScale under FSDP2 (every Linear and the root
    sharded); the table, the reductions made (name, rows' shape, when), the micro-batch norms."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for module in (model.fc1, model.fc2, model.frozen, model.unused):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return tracked_gradient(model, batches_of(job, world, rank), at_end)


def tracked_gradient(model, batches, at_end, reduction="mean", shapes=None):
    """GradientNoiseScale alone on ``model`` over ``batches[step][k]`` (this process's), its
    local gradient reduced in the backward pass or, ``at_end``, after it (the path of before):
    the table, the reductions made (name, rows' shape, when), the local gradients gathered
    whole over a tensor-parallel mesh (names), and the micro-batch norms. A reduction is
    named by its value's shape: ``shapes`` (``{shape: name}``), else the parameters'."""
    from cockpit_gradnoise.extensions import sharded, tensor_parallel

    named = trainable(model)
    quantity = cgn.GradientNoiseScale(linear(1), param_names=dict(named))
    if at_end:
        quantity.sums_sharded_in_backward = None
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[quantity])
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    loss_fn = extend(nn.CrossEntropyLoss(reduction=reduction))
    reduced, gathered, stage = [], [], ["in the backward pass"]
    original, gather = sharded.reduced_rows, tensor_parallel._gathered
    shapes = {tuple(p.shape): n for n, p in named} if shapes is None else shapes

    def recording(value, units, dim, mesh, *dims):
        rows = original(value, units, dim, mesh, *dims)
        reduced.append((shapes[tuple(value.shape[1:])], tuple(rows.shape), stage[0]))
        return rows

    def gathering(local_result, param, *args):
        gathered.append(dict((id(p), n) for n, p in named)[id(param)])
        return gather(local_result, param, *args)

    sharded.reduced_rows, tensor_parallel._gathered = recording, gathering
    micro_norms = {}
    try:
        for step, micro in enumerate(batches):
            optimizer.zero_grad()
            for k, (x, y) in enumerate(micro):
                outputs = model(x)
                loss = loss_fn(outputs, y) / (len(micro) if reduction == "mean" else 1)
                extra = {"micro_batch": k, "micro_batches": len(micro)} if len(micro) > 1 else {}
                with cockpit(step, info=info(outputs, y, loss, **extra)):
                    loss.backward()
                    stage[0] = "after it"  # the quantities compute when the block ends
                stage[0] = "in the backward pass"
            optimizer.step()
            for kept in quantity.micro_batch_gradients.get(step, []):
                micro_norms.setdefault(step, []).append({n: float(v) for n, v in kept.squared_norms.items()})
    finally:
        sharded.reduced_rows, tensor_parallel._gathered = original, gather
    return {"table": table(cockpit), "reduced": reduced, "gathered": gathered, "micro": micro_norms}


def worker(rank, world, port, out):
    jobs = {f"{job}:{path}": functools.partial(gradient_job, job, path == "at_end", world, rank)
            for job in JOBS for path in ("in_backward", "at_end")}
    run_jobs(rank, world, port, out, jobs)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_gradient_", worker)


def chunk_shape(shape, world, rank):
    rows = -(-shape[0] // world)
    start = min(rank * rows, shape[0])
    return (min(start + rows, shape[0]) - start,) + shape[1:]


def sizes(job, world):
    """``(N, pieces T, examples of the largest piece, elements)`` of a step: ``T`` local
    gradients (one per process and micro-batch) summed into the batch gradient."""
    per = SIZES[JOBS[job]][world]
    per = per if isinstance(per[0], tuple) else (per,)
    pieces = [n for micro in per for n in micro]
    return sum(pieces), len(pieces), max(pieces)


def bounds(row, job, world, elements):
    """How far the two paths' statistics of one row may differ.

    Both paths add the same ``T`` pieces ``a_t`` (each process's local gradient of each
    micro-batch, divided by its loss scale) in float64: in some order, all at once or
    micro-batches first, processes first or rows cut in between, and the rows multiplied
    by ``c`` and divided by it again (two roundings). Each element ``v_j`` of the sum is
    then off by at most ``gamma sum_t |a_tj|``, ``gamma = (T + 4) u``, so
    ``|Delta ||v||^2| <= 2.02 gamma sum_j |v_j| sum_t |a_tj|
    <= 2.02 gamma ||v|| sqrt(T n_max N s)`` (Cauchy-Schwarz twice; ``||a_t||^2 <= n_t sum_{i in t}
    ||g_i||^2``; ``s`` the mean squared norm), and each path's float64 squared norm is off
    by ``(p + 1) u ||v||^2`` for ``p`` elements. With ``m = ||v||^2 / N^2`` (the squared norm
    of the mean): ``|Delta m| <= 2.02 gamma sqrt(T n_max s m / N) + 2 (p + 1) u m``. ``s`` is the
    same in both paths (one all-reduce of the same numbers); ``grad_sq`` and ``trace_cov``
    are ``N / (N - 1)`` times ``m`` off that, plus their own formula's rounding in each path.
    """
    n, pieces, largest = sizes(job, world)
    grad_sq, trace_cov = row["grad_sq"], row["trace_cov"]
    m = grad_sq + trace_cov / n  # (N m - s) / (N - 1) + (s - m) / (N - 1)
    s = m + trace_cov * (n - 1) / n
    gamma = (pieces + 4) * U
    delta_m = 2.02 * gamma * math.sqrt(pieces * largest * abs(s * m) / n) + 2 * (elements + 1) * U * abs(m)
    formula = 8 * U * (n * abs(m) + abs(s)) / (n - 1)
    delta_grad_sq = n / (n - 1) * delta_m + formula
    delta_trace_cov = n / (n - 1) * delta_m + formula
    return {"grad_sq": delta_grad_sq, "trace_cov": delta_trace_cov,
            "b_simple": abs(row["b_simple"]) * (1.01 * (delta_grad_sq / abs(grad_sq)
                                                        + delta_trace_cov / abs(trace_cov)) + 2 * U)}


def rows_of(table):
    """``{(step, param): {statistic: value}}``."""
    rows = {}
    for (step, _, param, statistic), value in table.items():
        rows.setdefault((step, param), {})[statistic] = value
    return rows


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", list(JOBS))
def test_each_local_gradient_is_reduce_scattered_once_in_the_backward_pass(groups, world, job):
    micro = len(batches_of(job, world, 0)[0])
    for rank, result in enumerate(results_of(groups, world, f"{job}:in_backward")):
        # Once per backward pass (two steps, each of `micro` micro-batches) and trainable
        # used parameter, to this process's rows; never the frozen or unused layer.
        expected = [(name, (1,) + chunk_shape(shape, world, rank), "in the backward pass")
                    for name, shape in SHAPES.items()] * (2 * micro)
        assert sorted(result["reduced"]) == sorted(expected), rank
    for result in results_of(groups, world, f"{job}:at_end"):
        assert result["reduced"] == []


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", list(JOBS))
def test_equals_the_gradient_reduced_after_the_backward_pass_within_the_rounding_bound(groups, world, job):
    inside = agreed_table(results_of(groups, world, f"{job}:in_backward"))
    at_end = agreed_table(results_of(groups, world, f"{job}:at_end"))
    assert inside.keys() == at_end.keys()
    got, want = rows_of(inside), rows_of(at_end)
    elements = {name: math.prod(shape) for name, shape in SHAPES.items()}
    elements["all"] = sum(elements.values())
    checked = 0
    for key, row in want.items():
        limits = bounds(row, job, world, elements[key[1]])
        for statistic, value in row.items():
            if statistic == "b_simple" and abs(row["grad_sq"]) <= limits["grad_sq"]:
                checked += 1  # grad_sq's sign within its bound: +inf or any ratio
            elif statistic == "b_simple" and math.isinf(value):  # grad_sq < 0 in both
                assert got[key][statistic] == value, key
                checked += 1
            elif statistic in limits:
                assert abs(got[key][statistic] - value) <= limits[statistic], (key, statistic)
                checked += 1
            elif statistic != "b_simple_smoothed":  # batch_size, params_covered, ...
                assert got[key][statistic] == value, (key, statistic)
        if key[0] == 0:  # the first step's moving averages are its own values
            assert got[key]["b_simple_smoothed"] == pytest.approx(got[key]["b_simple"], rel=4 * U)
    assert checked == 3 * len(want)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job", ["per_linear", "accumulation"])
def test_equals_one_process_on_the_global_batch(groups, world, job):
    got = agreed_table(results_of(groups, world, f"{job}:in_backward"))
    expected = {key: value for key, value in reference(job, world).items() if key[1] == "GradientNoiseScale"}
    assert_tables_match(got, expected)


@pytest.mark.parametrize("world", [2, 3])
def test_micro_batch_norms_are_this_process_local_gradient(groups, world):
    inside = results_of(groups, world, "accumulation:in_backward")
    at_end = results_of(groups, world, "accumulation:at_end")
    for rank, (got, want) in enumerate(zip(inside, at_end)):
        assert len(want["micro"]) == 2 and all(len(kept) == 2 for kept in want["micro"].values())
        assert got["micro"] == want["micro"], rank  # the same float64 norm of the same tensor


def test_what_is_sent_has_this_process_exact_zero_rule_applied_and_its_norm_noted():
    """No processes: what the hook sends of a layer's local gradient (``sent_in_backward``)."""
    from types import SimpleNamespace

    from cockpit_gradnoise.extensions import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD

    quantity = cgn.GradientNoiseScale(linear(1))
    noise = torch.tensor([[1e-20, -3e-21], [0.0, 2e-22]], dtype=torch.float64)  # autograd's rounding

    def sent(total, micro, scale=0.5, fields=(BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)):
        values = {BATCH_L2_SAVEFIELD: torch.full((3,), total / 3, dtype=torch.float64),
                  LOCAL_GRADIENT_SAVEFIELD: noise}
        holder = SimpleNamespace(**{field: values[field] for field in fields})
        step = SimpleNamespace(micro_batch=lambda: micro)
        return quantity.sent_in_backward(step, lambda: scale)(holder)

    value, units, note = sent(0.0, None)  # every contribution exactly 0: so is the gradient sent
    assert torch.equal(value, torch.zeros(1, 2, 2, dtype=torch.float64)) and units == [0.5] and note is None
    value, units, note = sent(0.0, object())  # under accumulation, its squared norm noted
    assert not value.any() and note[0] == 0.0
    value, units, note = sent(3.0, object())
    assert torch.equal(value[0], noise) and note[0] == float((noise / 0.5).square().sum())
    # Read after the backward pass: as noted, or divided by s**2 where a GradScaler's s was
    # divided out of the savefields since (the per-example norms beside it tell how much).
    param = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    step = SimpleNamespace(presharded={LOCAL_GRADIENT_SAVEFIELD: {id(param): note}})
    for divided in (1.0, 8.0):
        setattr(param, BATCH_L2_SAVEFIELD, torch.full((3,), 1.0 / divided**2, dtype=torch.float64))
        assert quantity.noted_squared_norms(step, [param]) == {"param0": note[0] / divided**2}
    assert sent(math.nan, None)[0].equal(noise.unsqueeze(0))  # a NaN keeps the gradient
    assert sent(3.0, None, scale=None) is None  # not wanted in this call: left alone
    assert sent(3.0, None, fields=(LOCAL_GRADIENT_SAVEFIELD,)) is None  # no norms beside it
