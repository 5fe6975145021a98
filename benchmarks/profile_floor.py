"""Where an empty Cockpit's extra time goes, on the MLP (``--profile``)."""

import statistics
import time

import torch

from benchmarks.harness import build_steps
from benchmarks.methods import empty_cockpit, extended_no_cockpit, plain_step
from benchmarks.models import MODELS, model_and_batch


def profile_floor(args, device, steps=50):
    """Where an empty Cockpit's extra time goes, on the MLP (one thread, CPU time).

    Times plain, extended (no Cockpit) and empty-Cockpit steps with
    ``time.process_time`` (interleaved, median of rounds), then profiles the
    empty-Cockpit step with cProfile and sums the functions' own time by
    where they live.
    """
    import cProfile
    import pstats

    spec = MODELS["mlp"]
    model, x, y = model_and_batch(spec, spec.batch_size, device)
    builders = {
        "plain step": plain_step,
        "extended model (no Cockpit)": extended_no_cockpit,
        "empty Cockpit": empty_cockpit,
    }
    steps_, _ = build_steps(builders, model, spec.loss, x, y, args.warmup)
    cpu = {name: [] for name in steps_}
    for _ in range(args.rounds):
        for name, step in steps_.items():
            start = time.process_time()
            for _ in range(10):
                step(x, y)
            cpu[name].append((time.process_time() - start) / 10)
    threads = torch.get_num_threads()
    lines = [f"CPU time per step (median of {args.rounds} rounds of 10 steps, {threads} threads):"]
    lines += [f"  {name}: {1e3 * statistics.median(t):.2f} ms" for name, t in cpu.items()]
    profiler = cProfile.Profile(time.process_time)  # CPU time: robust to other processes
    profiler.enable()
    for _ in range(steps):
        steps_["empty Cockpit"](x, y)
    profiler.disable()
    groups = {}
    for (path, _, function), stat in pstats.Stats(profiler).stats.items():
        group = _profile_group(path, function)
        groups[group] = groups.get(group, 0) + stat[2]  # the function's own time
    lines.append(
        f"empty Cockpit under cProfile (CPU time, slower when profiled): own time by place, "
        f"ms per step ({steps} steps):"
    )
    for group, seconds in sorted(groups.items(), key=lambda item: -item[1]):
        lines.append(f"  {1e3 * seconds / steps:7.3f}  {group}")
    return "\n".join(lines)


def _profile_group(path, function):
    """Where a profiled function lives, for :func:`profile_floor`."""
    for marker, group in [
        ("cockpit_gradnoise", "cockpit_gradnoise (ours)"),
        ("/cockpit/", "Cockpit (context, track, bookkeeping)"),
        ("/backpack/", "BackPACK (its hooks' Python)"),
        ("torch/utils/hooks.py", "torch's module-hook machinery (BackPACK's hooks)"),
        ("torch/autograd/function.py", "torch's module-hook machinery (BackPACK's hooks)"),
        ("torch/nn/modules/module.py", "torch.nn.Module call machinery"),
    ]:
        if marker in path:
            return group
    if function.startswith("<built-in method apply") or "BackwardHook" in function:
        return "torch's module-hook machinery (BackPACK's hooks)"
    if "run_backward" in function or "torch._C._nn" in function or "built-in method torch" in function:
        return "torch kernels and autograd engine"
    return "other (benchmark loop, Python, torch tensor methods)"
