"""FSDP2 over tensor parallelism (a 2 x 2 ``("dp", "tp")`` mesh): exact global-batch statistics.

Four processes (gloo on loopback, a free port, float64,
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``) run every job in one
launch (``process_groups.run_once_per_world``). The model is test_tensor_parallel's:
``fc1`` split by ``ColwiseParallel`` and ``fc2`` by ``RowwiseParallel`` on ``tp`` (its bias
replicated), a plain layer, a frozen one and an unused one; then ``fully_shard`` on ``dp``
(the split parameters become DTensors placed ``(Shard(0) on dp, Shard(k) on tp)``).
The two processes of a ``tp`` group see the same examples, the two ``dp`` groups distinct
ones (test_fsdp2's local batches of 2 processes). Each job is compared with one process
holding the whole model and the global batch (both ``dp`` groups' examples, all
micro-batches; ``ParamGradRatio`` and ``UpdateSize`` with FSDP2's ``param.grad``, the mean
over ``dp`` of the local gradients: test_fsdp2's reference), with the DDP tests' tolerance.
The jobs run the recipe of docs/distributed.md's "FSDP2 over tensor parallelism" section
(prepare_model, parallelize_module on ``tp``, fully_shard on ``dp``, a Cockpit).

Jobs (test_fsdp2's): ``fully_shard`` on every Linear and the root with
``reshard_after_forward=True`` (mean loss, unequal local batches), on the root only with
``False`` (sum loss), two micro-batches accumulated, each tracked by the five quantities
exact there (GradientVarianceQuantiles: a split layer's sums reduce-scattered over ``dp``
in the backward pass, kept with their ``tp`` shard: each process holds its ``torch.chunk``
rows after it, of every parameter); PreconditionedNoiseScale with Adam (test_fsdp2_variance's job: its
state DTensors placed as the parameters on ``(dp, tp)``); TwoBatchNoiseScale (the
accumulation job: each ``dp`` group's micro-batches the small batches); ``cgn.track`` on the model built, split, then
sharded (the "adaptive" and "norms" presets); test_tensor_parallel's Sequence model with its
norms under SequenceParallel on ``tp``, sharded on ``dp`` (the five quantities), and under
``loss_parallel()`` (its head split along the classes); GradientNoiseScale's local gradient
reduce-scattered over ``dp`` in the backward pass (``dp`` x ``tp`` and HSDP x TP), never
gathered over ``tp``; refused by name: a cockpit over the layer sharded on ``dp`` alone.

HSDP over tensor parallelism (``fully_shard`` on ``("replicate", "shard")`` of a 3-D mesh of
the same 4 processes, ``tp`` innermost), in the same launch: replicas (2 x 1 x 2) and shards
(1 x 2 x 2), test_fsdp2's jobs with the five per-example quantities (each data-parallel group
its own examples, counted once per ``tp`` group; GradientVarianceQuantiles' sums added over
both data-parallel dimensions, each element held by its shard's first replica), ``cgn.track``
with the "adaptive", "all" and "norms" presets over accumulated micro-batches (the batch size
every group's examples of every micro-batch), and PreconditionedNoiseScale with Adam. HSDP
alone on the launch's 2 x 2 mesh: every quantity (TwoBatchNoiseScale too) over two
micro-batches, and PreconditionedNoiseScale with Adam.
"""

import functools
import math
import warnings

import cockpit_gradnoise  # noqa: F401  first, also in spawned processes: makes `import cockpit` work

import pytest
import torch

from tests import test_fsdp2, test_fsdp2_gradient_in_backward, test_fsdp2_variance, test_tensor_parallel
from tests.fsdp2_tp_jobs import (
    DP,
    HSDP_QUANTITIES,
    HSDP_TP,
    HSDP_TRACKED,
    NOT_SPLIT,
    SPLIT,
    TP,
    TP_SHARDS,
    WORLD,
    adam,
    every_quantity,
    hsdp_adam,
    hsdp_adam_alone,
    hsdp_every_quantity,
    hsdp_in_backward,
    hsdp_job,
    hsdp_track,
    job_table,
    make_model,
    per_example,
    refusals,
    sequence,
    sharded_model,
    split_gradient,
    two_batch,
)
from tests.process_groups import (
    agreed_table,
    assert_identical,
    assert_tables_match,
    results_of,
    run_jobs,
    run_once_per_world,
)

#: Each trainable parameter's ``tp`` shard's shape (whole where not split).
TP_SHARD_SHAPES = {"fc1.weight": (4, 5), "fc1.bias": (4,), "fc2.weight": (4, 4), "fc2.bias": (4,),
                   "head.weight": (3, 4), "head.bias": (3,)}


def worker(rank, world, port, out):
    jobs = {job: functools.partial(job_table, job) for job in test_fsdp2.JOBS}
    jobs.update({f"{layout}_gradient_{'at_end' if at_end else 'in_backward'}":
                 functools.partial(split_gradient, layout, at_end)
                 for layout, at_end in (("dp_tp", False), ("dp_tp", True), ("replicas", False))})
    jobs["hsdp_in_backward"] = functools.partial(hsdp_in_backward, rank)
    jobs.update({f"hsdp_{layout}_{job}": functools.partial(hsdp_job, layout, job)
                 for layout, (_, names) in HSDP_TP.items() for job in names})
    jobs.update({f"hsdp_{layout}_track_{preset}": functools.partial(hsdp_track, layout, preset, rank)
                 for layout, presets in HSDP_TRACKED.items() for preset in presets})
    jobs["hsdp_shards_adam"] = functools.partial(hsdp_adam, "shards", rank)  # replicas: hsdp_adam, 2 x 2
    jobs["hsdp_every_quantity"] = functools.partial(hsdp_every_quantity, rank)
    jobs["hsdp_adam"] = functools.partial(hsdp_adam_alone, rank)
    jobs["sequence"] = sequence
    jobs["loss_parallel"] = functools.partial(sequence, loss_parallel=True)
    jobs["adam"] = adam
    jobs["two_batch"] = two_batch
    jobs.update({f"track_{preset}": functools.partial(
        test_tensor_parallel.front_door, quantities=preset, rank=rank // TP,
        split=lambda model, mesh: sharded_model(mesh, model=model)) for preset in test_tensor_parallel.PRESETS})
    jobs["refused"] = refusals
    run_jobs(rank, world, port, out, jobs, mesh_shape=(DP, TP), mesh_dim_names=("dp", "tp"))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "fsdp2_tensor_parallel_", worker)


@pytest.mark.parametrize("job", list(test_fsdp2.JOBS))
def test_equals_one_process_on_the_global_batch(group, job):
    results = results_of(group, WORLD, job)
    table = agreed_table(results)
    expected = test_fsdp2.reference(job, DP, quantities=per_example, make=make_model)
    assert_tables_match(table, expected)
    placements = results[0]["placements"]
    # FSDP2's Shard(0) on dp (strided where tp splits dim 0 too) before tp's Colwise / Rowwise.
    assert placements["fc1.weight"].endswith("Shard(dim=0))") and "Shard" in placements["fc1.weight"][:20]
    assert placements["fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["fc2.bias"] == "(Shard(dim=0), Replicate())"
    rows = {(key[1], key[2]) for key in expected}
    for quantity in ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
                     "GradientVarianceQuantiles"):
        assert {(quantity, name) for name in SPLIT + ("head.weight", "head.bias", "all")} <= rows
        assert not any(name.startswith("frozen") for q, name in rows if q == quantity)
    assert any("unused.weight" in message for message in results[0]["warnings"])
    assert not any(math.isnan(value) for value in table.values())
    # The per-element sums reduce-scattered over dp in the backward pass: after it each
    # process holds the torch.chunk rows of its tp shard (a layer not split: of the whole),
    # never the shard whole over dp.
    for rank, result in enumerate(results):
        held = {name: {shape[1:] for shape in shapes} for name, shapes in result["held"].items()}
        rows = test_fsdp2_gradient_in_backward.chunk_shape
        assert held == {name: {rows(shape, DP, rank // TP)} for name, shape in TP_SHARD_SHAPES.items()}, rank


def test_preconditioned_noise_scale_with_adam_equals_one_process(group):
    """Each process applies the P of its elements (Adam's exp_avg_sq, placed as the parameter
    on (dp, tp)) to its rows of its tp shard's sums; the replicated bias's on the first tp
    process only."""
    results = results_of(group, WORLD, "adam")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = test_fsdp2_variance.adam_steps(make_model(), DP)
    assert_tables_match(agreed_table(results), expected)
    state = results[0]["state"]
    assert state["fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert state["fc2.bias"] == "(Shard(dim=0), Replicate())" and state["head.weight"] == "(Shard(dim=0),)"
    assert {key[2] for key in expected} == {*SPLIT, "head.weight", "head.bias", "all"}


def test_two_batch_noise_scale_equals_one_process(group):
    tables = results_of(group, WORLD, "two_batch")
    assert_identical(tables)
    expected = two_batch()
    assert_tables_match(tables[0], expected)
    assert {key[2] for key in expected} >= {*SPLIT, "head.weight", "head.bias", "all"}
    sizes = test_fsdp2.SIZES["accumulation"][DP]
    assert {value for key, value in expected.items() if key[3] == "batch_size"} == {sum(map(sum, sizes))}


@pytest.mark.parametrize("preset", test_tensor_parallel.PRESETS)
def test_cgn_track_after_splitting_and_sharding_equals_one_process(group, preset):
    """The front door on the model split on ``tp`` and sharded on ``dp``, as users write it:
    each ``dp`` group's micro-batches of test_fsdp2_track, one process all of them."""
    tables = results_of(group, WORLD, f"track_{preset}")
    assert_identical(tables)
    assert_tables_match(tables[0], test_tensor_parallel.front_door(quantities=preset))


def test_sequence_parallel_norms_under_fsdp2_equal_one_process(group):
    """Norms under SequenceParallel inside FSDP2: their contributions added over ``tp`` (each
    process's positions), the ``dp`` groups' examples added as under FSDP2."""
    tables = results_of(group, WORLD, "sequence")
    assert_identical(tables)
    expected = sequence()
    assert_tables_match(tables[0], expected)
    assert {"block.norm.weight", "block.norm.bias", "norm.weight", "all"} <= {key[2] for key in expected}
    assert {key[1] for key in expected} == {"GradientVarianceQuantiles", "GradientNoiseScale",
                                            "PerExampleGradNorm", "ParamGradRatio", "UpdateSize"}


def test_layers_sharded_on_dp_alone_are_refused_by_name(group):
    for messages in results_of(group, WORLD, "refused"):
        assert messages["plain_only"].startswith("GradientNoiseScale is refused")
        assert "a device mesh of 2 of the 4 processes" in messages["plain_only"]


def test_layouts_inside_fsdp2_not_made_exact_are_named(monkeypatch):
    """A 2-D dp mesh not HSDP's or dp_mesh_dims over tensor parallelism, a dp x tp mesh over
    some processes, a placement other than Shard or Replicate, a layer on a dp mesh no split
    layer shares (no processes: FSDP2's parameter as the check reads it); HSDP's passes."""
    from types import SimpleNamespace

    from cockpit_gradnoise.extensions import sharded

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    def mesh(ndim=1, size=2):
        return SimpleNamespace(ndim=ndim, size=lambda: size)

    dp = mesh()

    class HSDPMeshInfo(SimpleNamespace):  # FSDP2's, as the check knows it: by name
        pass

    def fsdp_param(dp_mesh=dp, tp_size=2, placements=(Shard(0),), spmd=False, inside=True, hsdp=False):
        spec = SimpleNamespace(mesh=mesh(size=tp_size), placements=placements) if inside else None
        info = (HSDPMeshInfo if hsdp else SimpleNamespace)(mesh=dp_mesh, is_spmd_mesh=spmd)
        return SimpleNamespace(mesh_info=info, param_dtype=None,
                               orig_dtype=torch.float64, _unsharded_dtensor_spec=spec, is_dtensor=inside)

    monkeypatch.setattr(sharded, "dist_world_size", lambda: 4)
    assert "tensor parallelism inside FSDP2" in sharded.unsupported_layout(fsdp_param())
    assert sharded.unsupported_layout(fsdp_param(), tensor_parallel=True) is None
    assert sharded.unsupported_layout(fsdp_param(placements=(Replicate(),)), tensor_parallel=True) is None
    assert "1-D dp mesh or HSDP's" in sharded.unsupported_layout(fsdp_param(dp_mesh=mesh(ndim=2)),
                                                                 tensor_parallel=True)
    assert sharded.unsupported_layout(fsdp_param(dp_mesh=mesh(ndim=2), hsdp=True), tensor_parallel=True) is None
    assert "1-D dp mesh or HSDP's" in sharded.unsupported_layout(fsdp_param(dp_mesh=mesh(ndim=3), hsdp=True),
                                                                 tensor_parallel=True)
    assert "dp_mesh_dims" in sharded.unsupported_layout(fsdp_param(spmd=True), tensor_parallel=True)
    assert "of the 4 processes" in sharded.unsupported_layout(fsdp_param(tp_size=4), tensor_parallel=True)
    assert "only Shard and Replicate" in sharded.unsupported_layout(
        fsdp_param(placements=(Partial(),)), tensor_parallel=True)
    plain = fsdp_param(inside=False)  # a layer not split, sharded on the dp mesh
    assert "2 of the 4 processes" in sharded.unsupported_layout(plain, tensor_parallel=True)
    assert sharded.unsupported_layout(plain, tensor_parallel=True, over_tp=[dp]) is None


@pytest.mark.parametrize("layout, job", [(layout, job) for layout, (_, jobs) in HSDP_TP.items() for job in jobs])
def test_hsdp_over_tensor_parallelism_equals_one_process(group, layout, job):
    """Examples counted over the data-parallel dimensions (replicate x shard), once per ``tp``
    group; every row, the network's included, as one process on the global batch."""
    results = results_of(group, WORLD, f"hsdp_{layout}_{job}")
    table = agreed_table(results)
    expected = test_fsdp2.reference(job, DP, quantities=per_example, make=make_model)
    assert_tables_match(table, expected)
    assert {key[1] for key in expected} == HSDP_QUANTITIES
    assert {*SPLIT, "head.weight", "head.bias", "all"} <= {key[2] for key in expected}
    sizes = test_fsdp2.SIZES[job][DP]
    assert {value for key, value in expected.items() if key[3] == "batch_size"} == {
        sum(map(sum, sizes)) if job == "accumulation" else sum(sizes)}
    placements = results[0]["placements"]
    assert placements["fc2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    assert placements["fc2.bias"] == "(Replicate(), Shard(dim=0), Replicate())"
    assert placements["head.weight"] == "(Replicate(), Shard(dim=0))"
    assert any("unused.weight" in message for message in results[0]["warnings"])
    assert not any(math.isnan(value) for value in table.values())


@pytest.mark.parametrize("layout, preset", [(layout, preset) for layout, presets in HSDP_TRACKED.items()
                                             for preset in presets])
def test_cgn_track_under_hsdp_over_tensor_parallelism_equals_one_process(group, layout, preset):
    """The front door with accumulated micro-batches, every preset once: the batch size is
    every dp group's examples of every micro-batch."""
    tables = results_of(group, WORLD, f"hsdp_{layout}_track_{preset}")
    assert_identical(tables)
    expected = test_tensor_parallel.front_door(quantities=preset)
    assert_tables_match(tables[0], expected)
    assert {key[1] for key in expected} == {
        "adaptive": HSDP_QUANTITIES | {"PreconditionedNoiseScale", "Optimizer"},
        "all": HSDP_QUANTITIES | {"Optimizer"},
        "norms": {"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize", "Optimizer"}}[preset]
    assert {*SPLIT, "head.weight", "all"} <= {key[2] for key in expected}
    assert {value for key, value in expected.items() if key[3] == "batch_size"} == {8.0}


def test_preconditioned_noise_scale_with_adam_under_hsdp_over_tensor_parallelism(group):
    """Each process's P (Adam's exp_avg_sq, placed as the parameter on (replicate, shard, tp))
    applied to its rows of its tp shard's sums; as one process on the global batch (the
    replicas' count with Adam: the 2 x 2 test below; with tensor parallelism: cgn.track's
    "adaptive" preset on 2 x 1 x 2, P = I)."""
    results = results_of(group, WORLD, "hsdp_shards_adam")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = test_fsdp2_variance.adam_steps(make_model(), DP)
    assert_tables_match(agreed_table(results), expected)
    assert results[0]["state"]["fc2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    assert results[0]["state"]["head.weight"] == "(Replicate(), Shard(dim=0))"


def test_every_quantity_under_hsdp_equals_one_process(group):
    """HSDP on 2 x 2, two micro-batches: the per-element sums of GradientVarianceQuantiles and
    PreconditionedNoiseScale added over both dimensions, each shard's elements counted by its
    first replica; TwoBatchNoiseScale's small batches every process's micro-batches, its big
    batch FSDP2's gradient with each shard counted once; every row as one process."""
    table = agreed_table(results_of(group, WORLD, "hsdp_every_quantity"))
    expected = test_fsdp2.reference("accumulation", WORLD, quantities=every_quantity, optimizer_info=True)
    expected.update(two_batch(dp=WORLD, make=test_fsdp2.make_model))
    assert_tables_match(table, expected)
    assert {key[1] for key in expected} == HSDP_QUANTITIES | {"PreconditionedNoiseScale", "TwoBatchNoiseScale"}
    assert {"fc1.weight", "fc2.bias", "all"} <= {key[2] for key in expected}
    sizes = sum(map(sum, test_fsdp2.SIZES["accumulation"][WORLD]))
    assert {value for key, value in expected.items() if key[3] == "batch_size"} == {sizes}


def test_preconditioned_noise_scale_with_adam_under_hsdp_equals_one_process(group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = test_fsdp2_variance.adam_steps(test_fsdp2.make_model(), WORLD)
    assert_tables_match(agreed_table(results_of(group, WORLD, "hsdp_adam")), expected)
    assert {key[2] for key in expected} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "all"}


def test_hsdp_local_gradient_is_reduced_in_the_backward_pass_and_equals_one_process(group):
    """HSDP on 2 x 2 (replicas of shards): each process keeps its shard's rows of the global
    batch gradient, once per backward pass and parameter; each row's ``M`` counted by the
    first replica only; GradientNoiseScale as one process on the global batch."""
    results = results_of(group, WORLD, "hsdp_in_backward")
    expected = {key: value for key, value in test_fsdp2.reference("accumulation", WORLD).items()
                if key[1] == "GradientNoiseScale"}
    assert_tables_match(agreed_table(results), expected)
    for rank, result in enumerate(results):
        shard = rank % 2  # the mesh (replicate, shard): shard innermost
        want = [(name, (1,) + test_fsdp2_gradient_in_backward.chunk_shape(shape, 2, shard), "in the backward pass")
                for name, shape in test_fsdp2_gradient_in_backward.SHAPES.items()] * 4  # 2 steps x 2 micro-batches
        assert sorted(result["reduced"]) == sorted(want), rank


@pytest.mark.parametrize("layout", ["dp_tp", "replicas"])
def test_split_local_gradient_is_reduced_in_the_backward_pass_never_gathered(group, layout):
    """GradientNoiseScale's local gradient of a parameter split on ``tp`` (fc1, fc2's weight):
    each process's ``tp`` shard reduce-scattered over the data-parallel mesh in the backward
    pass, once per backward pass, to the shard's ``torch.chunk`` rows (HSDP's replicas: one
    shard, added over ``replicate``), never gathered whole; a parameter not split likewise
    (whole, on every process of a ``tp`` group); as one process on the global batch."""
    results = results_of(group, WORLD, f"{layout}_gradient_in_backward")
    expected = {key: value for key, value in test_fsdp2.reference("accumulation", DP, make=make_model).items()
                if key[1] == "GradientNoiseScale"}
    assert_tables_match(agreed_table(results), expected)
    shards = 1 if layout == "replicas" else DP
    rank_rows = test_fsdp2_gradient_in_backward.chunk_shape
    for rank, result in enumerate(results):
        named = [*TP_SHARDS.items(), ((4,), "fc1.bias or fc2.bias"), *NOT_SPLIT.items()]  # fc1.bias, fc2.bias
        want = [(name, (1,) + rank_rows(shape, shards, (rank // TP) % shards), "in the backward pass")
                for shape, name in named] * 4  # 2 steps x 2 micro-batches
        assert sorted(result["reduced"]) == sorted(want), rank
        assert result["gathered"] == [], rank


def test_split_local_gradient_gathered_at_the_end_before_and_micro_batch_norms_agree(group):
    """The path of before (``sums_sharded_in_backward = None``) gathers each split local
    gradient whole; the micro-batch norms (each process's dp group's gradient) agree."""
    inside = results_of(group, WORLD, "dp_tp_gradient_in_backward")
    at_end = results_of(group, WORLD, "dp_tp_gradient_at_end")
    assert_tables_match(agreed_table(inside), agreed_table(at_end))
    for got, want in zip(inside, at_end):
        assert set(want["gathered"]) == {"fc1.weight", "fc1.bias", "fc2.weight"} and want["reduced"] == []
        assert got["micro"].keys() == want["micro"].keys() == {0, 1}
        for step, norms in want["micro"].items():
            assert len(norms) == 2
            for a, b in zip(got["micro"][step], norms):
                assert a.keys() == b.keys() and all(a[n] == pytest.approx(b[n], rel=1e-12) for n in b)


def test_loss_parallel_equals_one_process(group):
    """``loss_parallel()`` on the sequence block, its head's output split along the classes
    (``Shard(-1)``) on ``tp``: the per-example losses, a replicated DTensor, taken whole; the
    head's rule on each process's classes; every quantity and row as one process."""
    tables = results_of(group, WORLD, "loss_parallel")
    assert_identical(tables)
    expected = sequence()
    assert_tables_match(tables[0], expected)
    assert {"head.weight", "head.bias", "norm.weight", "all"} <= {key[2] for key in expected}


def test_losses_not_whole_on_every_process_are_refused_with_the_fix():
    """A DTensor of losses split or partial (no process holds them whole): refused, naming
    loss_parallel's reduction='none' and the head gathered whole (no processes: the check
    reads the class name and placements)."""
    from cockpit_gradnoise.step_checks import check_individual_losses, whole_loss

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial

    class DTensor(torch.Tensor):  # as the check knows it: by name
        pass

    for placements in ((Shard(0),), (Partial(),)):
        losses = torch.ones(3).as_subclass(DTensor)
        losses.placements = placements
        with pytest.raises(TypeError, match=r"reduction='none'.*output_layouts=Replicate\(\)"):
            check_individual_losses(losses, "losses")
    replicated = torch.ones(3).as_subclass(DTensor)
    replicated.placements, replicated.to_local = (Replicate(),), lambda: torch.full((3,), 2.0)
    assert torch.equal(whole_loss(replicated), torch.full((3,), 2.0))
