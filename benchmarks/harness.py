"""The timing and memory harness: steps timed side by side in one process, and the run's conditions.

A model's steps are warmed up, then each round times a plain step and a
method's step, for every method in turn (plain, A, plain, B, ...), so that slow
drifts of the machine hit both alike; medians over the rounds are compared.
Peak extra memory of a step is measured separately (:func:`peak_extra_bytes`).
"""

import functools
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import tracemalloc

import cockpit_gradnoise as cgn  # first: makes `import cockpit` work

import torch

from benchmarks.methods import METHODS, NotSupported, frozen_label, plain_step, unavailable
from benchmarks.models import MODELS, model_and_batch


def cpu_timed(function, totals: dict, key):
    """``function``, adding the CPU time (``time.process_time``) of each of its calls to
    ``totals[key]`` (a phase of a step: benchmark_t5's parts, profile_phases' phases)."""
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.process_time() - start

    return timed


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, x, y, device):
    synchronize(device)
    start = time.perf_counter()
    step(x, y)
    synchronize(device)
    return time.perf_counter() - start


def times_in_shuffled_rounds(steps, x, y, rounds, order, after=None, clock=time.process_time):
    """``{name: [seconds per round]}``: every step once per round, in an order drawn
    afresh each round from ``order`` (a seeded ``random.Random``), timed by ``clock``
    (by default ``time.process_time``, CPU time, meant with one thread; on a GPU a wall
    clock read after synchronizing); ``after(name, seconds)`` after each."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        names = list(steps)
        order.shuffle(names)
        for name in names:
            start = clock()
            steps[name](x, y)
            times[name].append(clock() - start)
            if after is not None:
                after(name, times[name][-1])
    return times


def _drop_step_state(step):
    """Free what a step left on its model (gradients, BackPACK results, inputs)."""
    for module in step.model.modules():
        for param in module.parameters(recurse=False):
            param.grad = None
            for field in [k for k in vars(param) if not k.startswith("_")]:
                delattr(param, field)
        for field in ("input0", "output"):
            if hasattr(module, field):
                delattr(module, field)


def peak_extra_bytes(step, x, y, device):
    """Peak memory two consecutive steps allocate above a clean start, in bytes.

    Starts from no gradients and no BackPACK results, then runs two steps, so
    that the second shows the steady state (what one step leaves behind is
    still alive while the next one computes).

    On CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated at
    the start. On CPU: torch's profiler records every allocation and free made
    through torch's allocator, with its size; the running sum of those in time
    order is torch's memory in use above the start, and its maximum is torch's
    peak. Allocations outside torch (NumPy arrays, Python objects) are invisible
    to it; ``tracemalloc`` sees those, and its peak is added. The sum is an
    upper bound of the joint peak (the two peaks may not coincide). Both count
    bytes requested from the allocator, not resident memory (glibc may keep
    freed memory mapped, or return it).
    """
    _drop_step_state(step)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step(x, y)
        step(x, y)
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile

    tracemalloc.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(x, y)
            step(x, y)
        _, outside_torch = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    in_use = torch_peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        in_use += event.nbytes()
        torch_peak = max(torch_peak, in_use)
    return torch_peak + outside_torch


def build_steps(builders, model, loss, x, y, warmup):
    """``{name: step}`` of the builders that run on this model, and ``{name: note}`` of the others.

    A builder's failure is shown in the table (the others still run):
    ``NotSupported`` by its message, anything else as an error.
    """
    steps, notes = {}, {}
    for name, build in builders.items():
        notes[name] = unavailable(name)
        if notes[name] is not None:
            continue
        try:
            step = build(model, loss)
            for _ in range(warmup):
                step(x, y)
                if hasattr(step, "plain"):
                    step.plain(x, y)
            steps[name] = step
        except NotSupported as error:
            notes[name] = str(error)
        except Exception as error:
            notes[name] = f"error: {type(error).__name__}: {error}"
    return steps, notes


def benchmark_model(label, spec, method_names, args, device, batch_size=None, memory=True):
    """Rows of the table for one model (``memory=False``: times only).

    Each round times, for every method, a plain step and then the method's
    step. A method with its own plain step (``step.plain``: the same model
    frozen alike) is timed against that one, and that plain step gets a row
    of its own, relative to the model's plain step.
    """
    model, x, y = model_and_batch(spec, batch_size or args.batch_size or spec.batch_size, device)
    plain = plain_step(model, spec.loss)
    steps, notes = build_steps(
        {name: METHODS[name] for name in method_names}, model, spec.loss, x, y, args.warmup
    )
    for _ in range(args.warmup):
        plain(x, y)

    times = {name: [] for name in steps}
    own_plain_times = {name: [] for name in steps if hasattr(steps[name], "plain")}
    plain_times = []
    print(f"{label}: timing {len(steps)} methods, {args.rounds} rounds", file=sys.stderr)
    for _ in range(args.rounds):
        for name, step in steps.items():
            plain_times.append(timed(plain, x, y, device))
            if name in own_plain_times:
                own_plain_times[name].append(timed(step.plain, x, y, device))
            times[name].append(timed(step, x, y, device))
    if not steps:  # only the plain step was asked for
        plain_times = [timed(plain, x, y, device) for _ in range(args.rounds)]

    def measured(step):
        if not memory:
            return None
        bytes_ = peak_extra_bytes(step, x, y, device)
        _drop_step_state(step)
        return bytes_

    if memory:
        print(f"{label}: measuring memory", file=sys.stderr)

    def row(method, step_times, step_memory, reference):
        median = statistics.median(step_times)
        result = {"model": label, "method": method, "median_ms": 1e3 * median, "note": None}
        result["ratio"] = median / reference[0]
        if memory:
            result["peak_extra_mib"] = step_memory / 2**20
            result["memory_ratio"] = step_memory / reference[1]
        return result

    plain_reference = (statistics.median(plain_times), measured(plain))
    table = [row("plain step", plain_times, plain_reference[1], plain_reference)]
    for name in method_names:
        if name not in steps:
            table.append({"model": label, "method": name, "note": notes[name]})
            continue
        reference = plain_reference
        if name in own_plain_times:
            reference = (statistics.median(own_plain_times[name]), measured(steps[name].plain))
            own_plain = row(f"plain step {frozen_label(name)}", own_plain_times[name], reference[1],
                            plain_reference)
            table.append(own_plain)
        table.append(row(name, times[name], measured(steps[name]), reference))
    return table


def allocator():
    """Which memory allocator the process uses, as far as the environment tells."""
    preload = os.environ.get("LD_PRELOAD", "")
    tuned = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    libc = " ".join(platform.libc_ver()) or "unknown libc"
    if preload:
        return f"LD_PRELOAD={preload} (NOT the default allocator)"
    settings = f"; tuned by {', '.join(tuned)}" if tuned else ", untuned"
    return f"default glibc malloc ({libc}, no LD_PRELOAD{settings}), as users get it"


def environment(args, device):
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "torch": torch.__version__,
        "backpack-for-pytorch": version("backpack-for-pytorch"),
        "cockpit-for-pytorch": version("cockpit-for-pytorch"),
        "cockpit-gradnoise": version("cockpit-gradnoise"),
        # Which checkout is measured: the installed one unless PYTHONPATH says otherwise.
        "cockpit-gradnoise location": os.path.dirname(os.path.dirname(cgn.__file__)),
        "opt_einsum": version("opt_einsum"),
        "opacus": version("opacus"),
        "python": platform.python_version(),
        "device": str(device)
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1min_at_start": round(os.getloadavg()[0], 2),
        "memory_allocator": allocator(),
        "batch_size": args.batch_size,  # None: each model's own (batch_sizes)
        "batch_sizes": {m: args.batch_size or MODELS[m].batch_size for m in args.models},
        "rounds": args.rounds,
        "dtype": "float32",
    }
