"""Tensor parallelism (``parallelize_module``): exact global-batch statistics, identical on every process.

Two processes (gloo on loopback, a free port, float64, ``init_device_mesh("cpu", (2,))``)
run every job in one launch (``process_groups.run_group``). The models split their
Linear layers with ``ColwiseParallel`` (the output rows) and ``RowwiseParallel`` (the
input columns; its bias replicated), and keep a plain layer (the same on both
processes), a frozen one and an unused one (uneven splits are not tested: torch's
RowwiseParallel after ColwiseParallel does not run them). Both processes see the same
examples; each job is compared with one process holding the whole model and the same
batch, tracked by the same quantities (GradientVarianceQuantiles too: its split parameters'
sums stay with their shard, the quantiles a distributed selection), with the DDP tests'
tolerance. The jobs run the recipe of docs/distributed.md's
"Tensor parallelism" section (prepare_model, parallelize_module, a Cockpit over the
parameters).

Jobs: an MLP with a mean loss, with a sum loss, two micro-batches accumulated, an
attention block on sequences (q, k, v Colwise by heads, the output projection
Rowwise); PreconditionedNoiseScale with Adam (its state DTensors placed as the split
parameters); TwoBatchNoiseScale over the accumulated micro-batches; FSDP2 over tensor
parallelism on a 1 x 2 ``("dp", "tp")`` mesh (the mean job; 2 x 2:
test_fsdp2_tensor_parallel); HSDP (test_fsdp2's jobs on 2 x 1 and 1 x 2 replicate x
shard meshes, each process its own examples; cgn.track takes every preset, and refuses by
name a quantity not marked exact under HSDP); SequenceParallel (the Sequence model split by
sequence_plan, torchtitan's layout: a LayerNorm and an RMSNorm on each process's positions,
their contributions added over the mesh) with every quantity, a mean loss and a sum loss
over two micro-batches, TwoBatchNoiseScale, PreconditionedNoiseScale with Adam, cgn.track's
presets and FSDP2 over it on a 1 x 2 mesh; the same with transformers' LlamaRMSNorm and
LlamaMLP (a tiny Llama block); GradientNoiseScale's local gradient of a split parameter kept
as its shard, never gathered; left out by name: a Linear under SequenceParallel
(its input split along positions), a LayerNorm whose input is split along the examples.
"""

import functools
import math
import warnings

import cockpit_gradnoise as cgn  # first, also in spawned processes: makes `import cockpit` work
from cockpit_gradnoise import distributed

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests import test_fsdp2, test_fsdp2_track, test_fsdp2_variance
from tests.process_groups import (
    agreed_table,
    assert_identical,
    assert_tables_match,
    results_of,
    run_jobs,
    run_once_per_world,
)
from tests.tensor_parallel_models import Attention, LlamaBlock, Net, Sequence, sequence_plan

WORLD = 2
QUANTILES = (0.0, 0.25, 0.5, 1.0)
LR = 0.1


def plan(job):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if job == "attention":
        return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                "o": RowwiseParallel()}
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def make_model(job):
    torch.manual_seed(0)
    classes = {"attention": Attention, "sequence": Sequence, "sequence_llama": LlamaBlock}
    return cgn.prepare_model(classes.get(job, classes.get(job.split("_")[0], Net))().double())


def make_batch(job, n, seed):
    generator = torch.Generator().manual_seed(seed)
    shape = {"attention": (n, 3, 8), "sequence": (n, 4, 6)}.get(job.split("_")[0], (n, 5))
    return (torch.randn(*shape, dtype=torch.float64, generator=generator),
            torch.randint(0, 4 if job.startswith("sequence") else 3, (n,), generator=generator))


def per_example(names):
    return [cgn.GradientNoiseScale(linear(1), param_names=names),
            cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names)]


def two_batch(names):
    """The two-batch noise scale (the "norms" preset's), from each micro-batch's gradient norms."""
    return [cgn.TwoBatchNoiseScale(track_schedule=linear(1), param_names=names)]


def quantities(names):
    return [cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names),
            cgn.GradientNoiseScale(linear(1), param_names=names),
            cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names),
            cgn.ParamGradRatio(linear(1), param_names=names), cgn.UpdateSize(linear(1), param_names=names)]


JOBS = {  # job: (reduction, micro-batch sizes)
    "mean": ("mean", (6,)),
    "sum": ("sum", (5,)),
    "accumulation": ("mean", (3, 4)),
    "attention": ("mean", (4,)),
}
# SequenceParallel: the Sequence model split by sequence_plan.
SEQUENCE_JOBS = {"sequence": ("mean", (4,)), "sequence_accumulation": ("sum", (3, 2))}
LLAMA = {"sequence_llama": ("mean", (3, 2))}  # transformers' LlamaRMSNorm and LlamaMLP


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def table(cockpit):
    frame = cgn.to_frame(cockpit)
    return dict(zip(zip(frame.step, frame.quantity, frame.param, frame.statistic), frame.value))


def run_steps(job, model, cockpit, steps):
    """Tracked steps of ``job``: the same batches on every process and on one process."""
    reduction, sizes = {**JOBS, **SEQUENCE_JOBS, **LLAMA}[job]
    named = trainable(model)
    optimizer = torch.optim.SGD([p for _, p in named], lr=LR)
    loss_fn = extend(nn.CrossEntropyLoss(reduction=reduction))
    for step in range(steps):
        optimizer.zero_grad()
        for k, size in enumerate(sizes):
            x, y = make_batch(job, size, seed=100 * step + k)
            outputs = model(x)
            loss = loss_fn(outputs, y) / (len(sizes) if reduction == "mean" else 1)
            info = {"batch_size": size, "loss": loss,
                    "individual_losses": F.cross_entropy(outputs, y, reduction="none")}
            if len(sizes) > 1:
                info.update(micro_batch=k, micro_batches=len(sizes))
            with cockpit(step, info=info):
                loss.backward()
        optimizer.step()


def tracked(job, mesh=None, make_quantities=quantities, layout=None, steps=2):
    """The table and warnings of ``job``, split over ``mesh`` (else on one process)."""
    model = make_model(job)
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        if job.startswith("sequence"):
            sequence_plan(model, mesh)
        else:
            parallelize_module(model, mesh, plan(job) if layout is None else layout)
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=make_quantities(dict(named)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(job, model, cockpit, steps)
    return {"table": table(cockpit), "warnings": [str(w.message) for w in caught],
            "split": sorted(n for n, p in named if type(p).__name__ == "DTensor")}


def adam(mesh=None):
    """PreconditionedNoiseScale with Adam on the mean job's model and test_fsdp2_variance's
    batches (the same on every process): the table, and the placements of each parameter's
    ``exp_avg_sq`` (a DTensor placed as the split parameter from the second step on)."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_model("mean")
    if mesh is not None:
        parallelize_module(model, mesh, plan("mean"))
    state = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the mean job's test
        return {"table": test_fsdp2_variance.adam_steps(model, WORLD, state=state), "state": state}


def front_door(mesh=None, quantities="adaptive", split=None, rank=None, quantiles=QUANTILES):
    """``cgn.track`` on the mean job's model as users write it (built, split by ``split(model,
    mesh)``, then tracked; on one process not split) over test_fsdp2_track's accumulated
    micro-batches of 2 processes, all of them (or ``rank``'s): the table (``"adaptive"``: the
    six quantities; ``"norms"``: the preset)."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = Net().double()
    if mesh is not None:
        model = split(model, mesh) if split else parallelize_module(model, mesh, plan("mean"))
    model, tracker = cgn.track(model, every=1, quantities=quantities,
                               quantiles=None if quantities == "norms" else quantiles)
    batches = [[batch for r, micro in enumerate(test_fsdp2_track.micro_batches("norms_accumulated", 2, step))
                if rank in (None, r) for batch in micro] for step in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the mean job's test
        test_fsdp2_track.run_tracked(model, tracker, batches)
    return test_fsdp2_track.table(tracker)


def sequence_adam(mesh=None):
    """PreconditionedNoiseScale with Adam on the Sequence model, two steps: the norms' ``P``
    from their ``Partial`` gradients (torch completes the sum in Adam's update)."""
    model = make_model("sequence")
    if mesh is not None:
        sequence_plan(model, mesh)
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[
        cgn.PreconditionedNoiseScale(linear(1), param_names=dict(named))])
    optimizer = torch.optim.Adam([p for _, p in named], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the sequence job's test
        for step in range(2):
            x, y = make_batch("sequence", 4, seed=7 + step)
            optimizer.zero_grad()
            outputs = model(x)
            loss = F.cross_entropy(outputs, y)
            with cockpit(step, info=test_fsdp2.info(outputs, y, loss, optimizer=optimizer)):
                loss.backward()
            optimizer.step()
    return table(cockpit)


def sequence_front_door(mesh=None, quantities="adaptive"):
    """``cgn.track`` on the Sequence model built, split by sequence_plan, then tracked (on one
    process not split), two micro-batches of 3 and 2 sequences per step: the table."""
    torch.manual_seed(0)
    model = Sequence().double()
    if mesh is not None:
        sequence_plan(model, mesh)
    model, tracker = cgn.track(model, every=1, quantities=quantities,
                               quantiles=None if quantities == "norms" else QUANTILES)
    batches = [[make_batch("sequence", size, seed=10 * step + k) for k, size in enumerate((3, 2))]
               for step in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the sequence job's test
        test_fsdp2_track.run_tracked(model, tracker, batches)
    return test_fsdp2_track.table(tracker)


class NotMarked(cgn.GradientNoiseScale):
    """A quantity not marked exact under tensor parallelism (``supports_tensor_parallel``)."""

    supports_tensor_parallel = False


def track_refused(mesh):
    """What cgn.track says to a quantity not marked exact under tensor parallelism."""
    from torch.distributed.tensor.parallel import parallelize_module

    try:
        cgn.track(parallelize_module(Net().double(), mesh, plan("mean")), quantities=[NotMarked])
    except TypeError as error:
        return str(error)
    return None


def sequence_split(mesh):
    """``q`` under SequenceParallel (its weight replicated, its input split along positions):
    left out by name; the other layers' rows as on one process (one step: q's gradient, the
    sum over processes of their positions', is not one process's)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return tracked("attention", mesh, per_example, {"q": SequenceParallel(use_local_output=True)},
                   steps=1)


def norm_split_along_examples(mesh):
    """A LayerNorm under ``SequenceParallel(sequence_dim=0)`` (each process's input taken as a
    part of the examples), then a plain head, on the sequence batch: the warnings and the
    parameters with rows (the norm's must be left out by name: its examples are not this
    process's alone)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    model = cgn.prepare_model(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 4)).double())
    parallelize_module(model, mesh, {"0": SequenceParallel(sequence_dim=0, use_local_output=True)})
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=per_example(dict(named)))
    x, y = make_batch("sequence", 4, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = model(x).mean(1)
        loss = F.cross_entropy(outputs, y)
        with cockpit(0, info={"batch_size": 4, "loss": loss,
                              "individual_losses": F.cross_entropy(outputs, y, reduction="none")}):
            loss.backward()
    return {"warnings": [str(w.message) for w in caught], "rows": sorted({key[2] for key in table(cockpit)})}


def fsdp2_inside(world, job="mean"):
    """FSDP2 on ``dp`` of a 1 x 2 ``("dp", "tp")`` mesh over tensor parallelism on ``tp``: the
    table of ``job`` (every process the same examples)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = make_model(job)
    if job.startswith("sequence"):
        sequence_plan(model, mesh["tp"])
    else:
        parallelize_module(model, mesh["tp"], plan(job))
    fully_shard(model, mesh=mesh["dp"])
    named = trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=quantities(dict(named)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the single-mesh tests
        run_steps(job, model, cockpit, steps=2)
    return table(cockpit)


class NotMarkedHSDP(cgn.GradientNoiseScale):
    """A quantity exact under FSDP2 but not marked exact under HSDP (``supports_hsdp``)."""

    supports_hsdp = False


def hsdp_refused(world):
    """What cgn.track says on an HSDP model to each preset (none refused: every quantity
    counts a shard once, not once per replica) and to a quantity not marked exact under
    HSDP, and what the explicit API says to it at its tracked step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    messages = {}
    for key in ("all", "adaptive", "norms", "not_marked"):
        torch.manual_seed(0)
        model = fully_shard(test_fsdp2.Net().double(), mesh=mesh)
        try:
            cgn.track(model, quantities=[NotMarkedHSDP] if key == "not_marked" else key)
            messages[key] = None
        except TypeError as error:
            messages[key] = str(error)
    model = fully_shard(test_fsdp2.make_model(), mesh=mesh)
    named = test_fsdp2.trainable(model)
    cockpit = cgn.Cockpit([p for _, p in named], quantities=[NotMarkedHSDP(linear(1), param_names=dict(named))])
    try:
        test_fsdp2.run_steps(model, cockpit, [[test_fsdp2.make_batch(4, seed=0)]], "mean")
        messages["explicit"] = None
    except TypeError as error:
        messages["explicit"] = str(error)
    return messages


def split_gradient(at_end, mesh=None):
    """GradientNoiseScale alone on the accumulation job's MLP split over ``mesh`` (else one
    process), its local gradient kept in the backward pass or (``at_end``) gathered whole."""
    from tests.test_fsdp2_gradient_in_backward import tracked_gradient

    model = make_model("accumulation")
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh, plan("accumulation"))
    sizes = JOBS["accumulation"][1]
    batches = [[make_batch("accumulation", n, seed=100 * step + k) for k, n in enumerate(sizes)] for step in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unused layer, named in the jobs above
        return tracked_gradient(model, batches, at_end)


def worker(rank, world, port, out):
    from torch.distributed.device_mesh import init_device_mesh

    def hsdp(job, shape):  # an HSDP mesh of its own
        return lambda mesh: test_fsdp2.fsdp2_job(
            job, world, rank, init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))

    jobs = {job: functools.partial(tracked, job) for job in {**JOBS, **SEQUENCE_JOBS, **LLAMA}}
    jobs["sequence_two_batch"] = functools.partial(tracked, "sequence_accumulation", make_quantities=two_batch)
    jobs["sequence_adam"] = sequence_adam
    jobs.update({f"sequence_track_{preset}": functools.partial(sequence_front_door, quantities=preset)
                 for preset in PRESETS})
    jobs.update({f"hsdp_{job}": hsdp(job, shape) for job, shape in HSDP.items()})
    jobs["adam"] = adam
    jobs["two_batch"] = functools.partial(tracked, "accumulation", make_quantities=two_batch)
    jobs.update({f"track_{preset}": functools.partial(front_door, quantities=preset) for preset in PRESETS})
    jobs["hsdp_refused"] = lambda mesh: hsdp_refused(world)
    jobs["fsdp2_inside"] = lambda mesh: fsdp2_inside(world)
    jobs["sequence_fsdp2_inside"] = lambda mesh: fsdp2_inside(world, "sequence_accumulation")
    jobs["sequence_split"] = sequence_split
    jobs["norm_split_along_examples"] = norm_split_along_examples
    jobs["track_refused"] = track_refused
    jobs.update({f"gradient_{path}": functools.partial(split_gradient, path == "at_end")
                 for path in ("kept", "at_end")})
    run_jobs(rank, world, port, out, jobs, mesh_dim_names=("tp",))


# HSDP (fully_shard on a replicate x shard mesh): test_fsdp2's jobs, each process its own examples.
HSDP = {"per_linear": (2, 1), "root_only": (1, 2)}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    return run_once_per_world(tmp_path_factory, "tensor_parallel_", worker)


@pytest.mark.parametrize("job", list(JOBS))
def test_equals_one_process_on_the_same_batch(group, job):
    results = results_of(group, WORLD, job)
    table = agreed_table(results)
    expected = tracked(job)["table"]
    assert_tables_match(table, expected)
    split = results[0]["split"]
    # RowwiseParallel's bias is a replicated DTensor.
    assert split == (["k.weight", "o.bias", "o.weight", "q.bias", "q.weight", "v.bias",
                      "v.weight"] if job == "attention" else ["fc1.bias", "fc1.weight", "fc2.bias",
                                                               "fc2.weight"])
    rows = {(key[1], key[2]) for key in expected}
    for quantity in ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
                     "GradientVarianceQuantiles"):
        assert {(quantity, name) for name in split + ["all"]} <= rows, quantity
    if job != "attention":
        assert any("unused.weight" in message for message in results[0]["warnings"])
    assert not any(math.isnan(value) for value in table.values())


def test_preconditioned_noise_scale_with_adam_equals_one_process(group):
    """P from Adam's exp_avg_sq of each split parameter, a DTensor placed as it: its local
    values are P's on the shard's elements, applied to the sums that stay with the shard."""
    results = results_of(group, WORLD, "adam")
    expected = adam()["table"]
    assert_tables_match(agreed_table(results), expected)
    assert results[0]["state"] == {"fc1.weight": "(Shard(dim=0),)", "fc1.bias": "(Shard(dim=0),)",
                                   "fc2.weight": "(Shard(dim=1),)", "fc2.bias": "(Replicate(),)",
                                   "head.weight": "None", "head.bias": "None",
                                   "unused.weight": "None", "unused.bias": "None"}  # no step, no state
    assert {key[2] for key in expected} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                            "head.weight", "head.bias", "all"}
    assert {key[0] for key in expected} == {0, 1}


def test_two_batch_noise_scale_equals_one_process(group):
    """The accumulation job's micro-batches the small batches (the processes hold the same
    ones: counted once), the step's gradient the big one; a split parameter's squared norms
    added over the processes' shards."""
    results = results_of(group, WORLD, "two_batch")
    expected = tracked("accumulation", make_quantities=two_batch)["table"]
    assert_tables_match(agreed_table(results), expected)
    assert {key[2] for key in expected} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                            "head.weight", "head.bias", "unused.weight", "unused.bias", "all"}
    assert {value for key, value in expected.items() if key[3] == "batch_size"} == {7.0}


PRESETS = ("adaptive", "norms")


@pytest.mark.parametrize("preset", PRESETS)
def test_cgn_track_after_splitting_equals_one_process(group, preset):
    """The front door on a split model: prepared after parallelize_module (tensor parallelism's
    hooks moved after the package's, as if prepared first), every quantity of the preset."""
    tables = results_of(group, WORLD, f"track_{preset}")
    assert_identical(tables)
    expected = front_door(quantities=preset)
    assert_tables_match(tables[0], expected)
    assert {key[1] for key in expected} >= ({"TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"}
                                            if preset == "norms" else set(distributed.FSDP2_QUANTITIES))
    assert {"fc1.weight", "fc2.bias", "all"} <= {key[2] for key in expected}


def test_cgn_track_refuses_a_quantity_not_exact_under_tensor_parallelism_by_name(group):
    for message in results_of(group, WORLD, "track_refused"):
        assert message.startswith("NotMarked is not exact under tensor parallelism"), message
        assert "PreconditionedNoiseScale" in message and "quantities=\"norms\"" in message


def test_fsdp2_over_tensor_parallelism_on_one_dp_process_equals_one_process(group):
    tables = results_of(group, WORLD, "fsdp2_inside")
    assert_identical(tables)
    assert_tables_match(tables[0], tracked("mean")["table"])


def test_a_layer_split_along_positions_is_left_out_by_name(group):
    results = results_of(group, WORLD, "sequence_split")
    got, expected = agreed_table(results), tracked("attention", make_quantities=per_example, steps=1)["table"]
    assert not any(key[2].startswith("q.") for key in got)
    assert any("q.weight" in message and "split along positions" in message
               for message in results[0]["warnings"])
    kept = {key for key in expected if not key[2].startswith("q.") and key[2] != "all"}
    assert kept and kept <= set(got)
    assert_tables_match({key: got[key] for key in kept}, {key: expected[key] for key in kept})


@pytest.mark.parametrize("job", list(HSDP))
def test_hsdp_equals_one_process_on_the_global_batch(group, job):
    """Replicas (2 x 1: UpdateSize counts a replicated shard once) and shards (1 x 2), every
    quantity exact under FSDP2, as test_fsdp2's 1-D mesh."""
    table = agreed_table(results_of(group, WORLD, f"hsdp_{job}"))
    expected = test_fsdp2.reference(job, WORLD)
    assert_tables_match(table, expected)
    quantities = {key[1] for key in expected}
    assert quantities == {"GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize"}


def test_hsdp_takes_every_preset_and_refuses_a_quantity_not_marked_by_name(group):
    """Every preset passes cgn.track on HSDP (test_fsdp2_tensor_parallel compares their numbers
    with one process); a quantity not marked ``supports_hsdp`` is refused by name at cgn.track
    and at the explicit API's tracked step, with the exact ones."""
    for messages in results_of(group, WORLD, "hsdp_refused"):
        assert messages["all"] is None and messages["adaptive"] is None and messages["norms"] is None
        for key in ("not_marked", "explicit"):
            assert messages[key].startswith("NotMarkedHSDP is not marked exact under HSDP"), messages[key]
            assert "GradientVarianceQuantiles" in messages[key] and "TwoBatchNoiseScale" in messages[key]


SEQUENCE_SPLIT = ["block.fc1.bias", "block.fc1.weight", "block.fc2.bias", "block.fc2.weight",
                  "block.norm.bias", "block.norm.weight", "head.bias", "head.weight", "norm.weight"]


@pytest.mark.parametrize("job", list(SEQUENCE_JOBS))
def test_sequence_parallel_norms_equal_one_process(group, job):
    """torchtitan's layout (Sequence, sequence_plan): each process's per-example contributions
    to a norm's parameters are sums over its positions, added over the mesh before any square;
    every quantity and row as on one process (mean loss; sum loss over two micro-batches)."""
    results = results_of(group, WORLD, job)
    expected = tracked(job)["table"]
    assert_tables_match(agreed_table(results), expected)
    assert results[0]["split"] == SEQUENCE_SPLIT
    rows = {(key[1], key[2]) for key in expected}
    for quantity in ("GradientNoiseScale", "PerExampleGradNorm", "ParamGradRatio", "UpdateSize",
                     "GradientVarianceQuantiles"):
        assert {(quantity, name) for name in SEQUENCE_SPLIT + ["embed.weight", "all"]} <= rows, quantity
    assert any("unused.weight" in message for message in results[0]["warnings"])
    assert not any("norm" in message for message in results[0]["warnings"])


def test_sequence_parallel_two_batch_and_adam_equal_one_process(group):
    """TwoBatchNoiseScale (the norms' gradients Partial: summed over the mesh before their
    squares) and PreconditionedNoiseScale with Adam on the Sequence model."""
    two_batch_table = agreed_table(results_of(group, WORLD, "sequence_two_batch"))
    expected = tracked("sequence_accumulation", make_quantities=two_batch)["table"]
    assert_tables_match(two_batch_table, expected)
    assert {"block.norm.weight", "norm.weight"} <= {key[2] for key in expected}
    tables = results_of(group, WORLD, "sequence_adam")
    assert_identical(tables)
    expected = sequence_adam()
    assert_tables_match(tables[0], expected)
    assert {"block.norm.weight", "norm.weight", "all"} <= {key[2] for key in expected}


@pytest.mark.parametrize("preset", PRESETS)
def test_cgn_track_under_sequence_parallel_equals_one_process(group, preset):
    tables = results_of(group, WORLD, f"sequence_track_{preset}")
    assert_identical(tables)
    expected = sequence_front_door(quantities=preset)
    assert_tables_match(tables[0], expected)
    assert {"block.norm.weight", "norm.weight", "all"} <= {key[2] for key in expected}


def test_fsdp2_over_sequence_parallel_on_one_dp_process_equals_one_process(group):
    tables = results_of(group, WORLD, "sequence_fsdp2_inside")
    assert_identical(tables)
    expected = tracked("sequence_accumulation")["table"]
    assert_tables_match(tables[0], expected)
    assert {"block.norm.weight", "norm.weight", "all"} <= {key[2] for key in expected}


def test_a_norm_split_along_examples_is_left_out_by_name(group):
    for result in results_of(group, WORLD, "norm_split_along_examples"):
        assert not any(name.startswith("0.") for name in result["rows"]), result["rows"]
        assert "1.weight" in result["rows"]
        assert any("0.weight" in message and "split along its examples" in message
                   for message in result["warnings"]), result["warnings"]


def test_split_local_gradient_is_kept_with_its_shard_never_gathered(group):
    """GradientNoiseScale's local gradient of a split parameter stays this process's shard
    (M adds the shards' squared norms), where the path of before gathered it whole; as one
    process, the micro-batch norms (the whole parameter's) too."""
    kept, at_end = (results_of(group, WORLD, f"gradient_{path}") for path in ("kept", "at_end"))
    one = split_gradient(False)
    assert_tables_match(agreed_table(kept), one["table"])
    assert_tables_match(agreed_table(at_end), one["table"])
    for got, before in zip(kept, at_end):
        assert got["gathered"] == [] and set(before["gathered"]) == {"fc1.weight", "fc1.bias", "fc2.weight"}
        assert got["micro"].keys() == one["micro"].keys() == {0, 1}
        for step, norms in one["micro"].items():
            for a, b in zip(got["micro"][step], norms, strict=True):
                assert a.keys() == b.keys() and all(a[n] == pytest.approx(b[n], rel=1e-12) for n in b)


def test_hugging_face_llama_rms_norm_under_sequence_parallel_equals_one_process(group):
    """transformers' LlamaRMSNorm under SequenceParallel (before a LlamaMLP split as torchtitan
    splits it, and as the final norm): its contributions added over the mesh as nn.RMSNorm's;
    every quantity and row as on one process (two micro-batches of a mean loss)."""
    results = results_of(group, WORLD, "sequence_llama")
    expected = tracked("sequence_llama")["table"]
    assert_tables_match(agreed_table(results), expected)
    norms = ["block.norm.weight", "norm.weight"]
    assert set(norms) <= set(results[0]["split"])
    for quantity in ("GradientNoiseScale", "PerExampleGradNorm", "GradientVarianceQuantiles"):
        assert {(quantity, name) for name in norms + ["block.mlp.down_proj.weight", "all"]} <= {
            (key[1], key[2]) for key in expected}, quantity
    assert not any("norm" in message for message in results[0]["warnings"])
