"""Sharded and split models are refused before anything changes, naming what was found.

Real FSDP, FSDP2 and tensor parallelism from torch, in a child process with a
one-process gloo group on loopback (a free port) and an explicit CPU device
mesh: the detection is by class name and does not depend on the number of
processes, and the child keeps the test process free of a process group.
"""

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import os, socket, sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    import cockpit_gradnoise as cgn

    warnings.simplefilter("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1,))

    def mlp():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def fsdp2_root():
        from torch.distributed.fsdp import fully_shard
        model = mlp()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def fsdp2_inner():
        from torch.distributed.fsdp import fully_shard
        model = mlp()
        fully_shard(model[0], mesh=mesh)  # the root stays a plain Sequential
        return model

    def fsdp1():
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(mlp(), use_orig_params=True, device_id=torch.device("cpu"))

    def tensor_parallel():
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        return parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def explicit(wrap, quantity):
        """prepare_model first, then wrap: the tracked step refuses the DTensors."""
        model = wrap(cgn.prepare_model(mlp()))
        params = [p for p in model.parameters()]
        from cockpit import Cockpit
        cockpit = Cockpit(params, quantities=[quantity(track_schedule=lambda step: True)])
        x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()
        with cockpit(0, info={"batch_size": 6, "individual_losses": losses, "loss": loss}):
            loss.backward(create_graph=cockpit.create_graph(0))

    def fully_sharded(model):
        from torch.distributed.fsdp import fully_shard
        return fully_shard(model, mesh=mesh)

    def tensor_parallel_of(model):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    EXPLICIT = {
        # GradientNoiseScale and GradientVarianceQuantiles are exact under FSDP2 on two processes
        # or more (tests/test_fsdp2.py, tests/test_fsdp2_variance.py).
        "explicit_after_fsdp2": (fully_sharded, cgn.GradientNoiseScale),
        "explicit_fsdp2_variance": (fully_sharded, cgn.GradientVarianceQuantiles),
        "explicit_tensor_parallel": (tensor_parallel_of, cgn.GradientNoiseScale),
    }

    def attempt(case):
        if case in EXPLICIT:
            explicit(*EXPLICIT[case])
            return "NOT REFUSED"
        model = globals()[case]()
        before = [type(m).__name__ for m in model.modules()]
        try:
            cgn.track(model, every=1)
        finally:
            # Refused before anything changed: no module converted or added.
            assert [type(m).__name__ for m in model.modules()] == before
        return "NOT REFUSED"

    try:
        for case in sys.argv[1:]:
            try:
                print(case, attempt(case))
            except TypeError as error:
                print(case, "REFUSED", str(error).replace("\\n", " "))
    finally:
        dist.destroy_process_group()
''')


CASES = {
    "fsdp2_root": "FSDP2 on one process, from FSDP2 (fully_shard)",  # on 2 or more: tests/test_fsdp2_track.py
    "fsdp2_inner": "FSDP2 on one process, from FSDP2 (fully_shard)",  # on 2 or more: tests/test_fsdp2_track.py
    "fsdp1": "the class FullyShardedDataParallel, from FSDP (FullyShardedDataParallel)",
    # cgn.track takes a split model (on two processes or more: tests/test_tensor_parallel.py)
    "tensor_parallel": "a parameter split by tensor parallelism on one process, from tensor parallelism",
    "explicit_after_fsdp2": "FSDP2 on one process, from FSDP2 (fully_shard)",
    "explicit_fsdp2_variance": "FSDP2 on one process, from FSDP2 (fully_shard)",
    "explicit_tensor_parallel": "a parameter split by tensor parallelism on one process, from tensor parallelism",
}


@pytest.fixture(scope="module")
def outcomes():
    """Each case's line from one child process (one start of torch and a process group for all)."""
    done = subprocess.run([sys.executable, "-c", CHILD, *CASES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in CASES]
    return dict(lines)


@pytest.mark.parametrize("case", CASES)
def test_sharded_model_is_refused_naming_what_was_found_and_what_is_supported(outcomes, case):
    out = outcomes[case]
    assert out.startswith("REFUSED"), out
    assert f"found {CASES[case]}, which is not supported" in out
    assert "torch.nn.parallel.DistributedDataParallel" in out and "docs/distributed.md" in out


def test_a_class_named_pipe_outside_torch_pipelining_is_not_taken_for_pipeline_parallelism():
    from cockpit_gradnoise import distributed

    from torch import nn

    class Pipe(nn.Sequential):  # a user's own module that happens to share the name
        pass

    class DeepSpeedEngine(nn.Module):
        pass

    model = Pipe(nn.Linear(2, 2))
    distributed.check_not_sharded(model.parameters(), model)
    engine = DeepSpeedEngine()
    engine.module = model
    with pytest.raises(TypeError, match="the class DeepSpeedEngine, from DeepSpeed"):
        distributed.check_not_sharded(engine.parameters(), engine)
