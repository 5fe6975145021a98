"""Groups of processes on loopback for the distributed tests, and comparing their results.

A test module starts ``W`` processes (gloo on loopback, a free port) that run a worker of
its own, once per world size, because starting a process costs seconds: a module fixture
(:func:`run_once_per_world`) runs every job of a group and saves each process's results,
the tests compare them (:func:`results_of`, :func:`agreed_table`). A group that hangs is
killed after ``JOIN_TIMEOUT`` seconds and fails its tests; collectives time out after
``GLOO_TIMEOUT``.

Processes start by ``forkserver`` where there is one (else ``spawn``): a
fresh interpreter, spawned once, imports torch, BackPACK, Cockpit and the worker's
module, and forks every process of the groups from that clean,
single-threaded state (nothing of pytest's process is inherited), instead of
each process importing them again (about 10 s each on a busy 2-core machine).
"""

import datetime
import math
import socket
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Imported here, so that the forkserver, which preloads the module of the worker whose group
# starts it (each imports this one), holds them: spawned processes skip their import (half their CPU).
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from tests.helpers import RTOL

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
JOIN_TIMEOUT = 300  # seconds for a whole group: generous for a loaded 2-core machine
GLOO_TIMEOUT = 60  # seconds for one collective


# The processes ---------------------------------------------------------------------


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(world, out, target):
    """Spawn ``world`` processes running ``target(rank, world, port, out)`` (a test module's
    worker); their results, error and folder."""
    if START_METHOD == "forkserver":  # before the server starts; it then imports once
        mp.get_context("forkserver").set_forkserver_preload([target.__module__])
    context = mp.start_processes(
        target, args=(world, free_port(), str(out)), nprocs=world, join=False,
        start_method=START_METHOD,
    )
    deadline, error = time.monotonic() + JOIN_TIMEOUT, None
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                error = f"the group of {world} processes hung for {JOIN_TIMEOUT} s"
                break
    except ProcessException as exception:  # a process raised: join ended the others
        # torch names the first process to exit; a worker that raised may have written its
        # own error first (rank<r>.error), before its exit cut the others off
        error = "\n".join([str(exception)] + [path.read_text() for path in sorted(out.glob("rank*.error"))])
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)
               if (out / f"rank{r}.pt").exists()]
    return results, error, out


def join_group(rank, world, port):
    """This process's place in the gloo group on loopback: one thread, collectives that time
    out, BackPACK's hook warning off."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT),
    )


def run_jobs(rank, world, port, out, jobs, mesh_shape=None, mesh_dim_names=None):
    """A worker's body: join the group, run ``jobs`` (``{name: job(mesh)}``; the mesh of
    ``mesh_shape`` and ``mesh_dim_names``, by default 1-D over every process) in order,
    saving this process's results after each, and leave the group."""
    join_group(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape or (world,), mesh_dim_names=mesh_dim_names)
    results = {}
    try:
        for name, job in jobs.items():
            results[name] = job(mesh)
            torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# The groups ----------------------------------------------------------------------


def run_once_per_world(tmp_path_factory, prefix, target):
    """``world -> (per-process results, error, folder)``: ``run_group(world, ..., target)`` run
    once per world size, when first needed (a module fixture's, in a folder ``prefix<world>``)."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_group(world, tmp_path_factory.mktemp(f"{prefix}{world}"), target)
        return cache[world]

    return get


def results_of(groups, world, key):
    results, error, _ = groups(world)
    missing = [r for r in range(world) if r >= len(results) or key not in results[r]]
    assert not missing, f"processes {missing} have no results for {key!r}: {error}"
    return [result[key] for result in results]


# Comparing results ----------------------------------------------------------------


def assert_tables_match(got, expected, rtol=RTOL):
    """Same keys (coverage statistics aside), values equal to ``rtol`` (``inf == inf``)."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rtol, abs=0), key


def agreed_table(results) -> dict:
    """Rank 0's ``"table"`` of ``results`` (one per process), checked equal on every process."""
    tables = [result["table"] for result in results]
    assert_identical(tables)
    return tables[0]


def assert_identical(tables):
    """Every process's table equal to rank 0's, bit for bit (NaN equal to NaN)."""
    for rank, other in enumerate(tables[1:], start=1):
        assert other.keys() == tables[0].keys(), rank
        different = [
            key for key, value in tables[0].items()
            if not (other[key] == value or math.isnan(value) and math.isnan(other[key]))
        ]
        assert not different, (rank, different[:5])


