"""Memory and size of a long run's log: streaming it, and reading it back.

Four measurements (``benchmarks/README.md`` lists results):

1. **Streamed, synthetic**: ``--steps`` training steps of a model with
   ``--tensors`` parameter tensors, tracked every ``--every`` steps by all five
   quantities. Their outputs are made directly, in the structure the
   quantities store (``{param: {statistic: number}}`` with the package's
   statistic names, ``UpdateSize`` as a list of items, some NaN and inf),
   into a cockpit-like object, and a :class:`cockpit_gradnoise.LogStream`
   appends and drops them after each tracked step, as a streaming tracker
   does. RSS growth is measured from the end of the first tenth of the run
   (tables and allocator warmed up) to its end.
2. **In memory, synthetic**: the same outputs kept, as Cockpit keeps them,
   for ``--in-memory-steps`` tracked steps: RSS growth per tracked step.
3. **Streamed, real**: ``cgn.track(model, every=1, log=...)`` on an MLP of
   ``--tensors`` parameter tensors for ``--real-steps`` steps, all five
   quantities: RSS growth after the first tenth, and the steps the quantities
   hold in memory (0 after every tracked call).
4. **Reading**: ``cgn.to_frame`` of the streamed log in this process, and
   ``cockpit-gradnoise report`` and ``plot`` on it, ``--repeats`` times each
   in a fresh subprocess: its CPU time (``os.wait4``; the fewest of the runs,
   since a loaded machine only adds), wall time, and peak RSS (``VmHWM``);
   and the CPU time of a fresh interpreter importing only what each command
   imports first (pandas; matplotlib). And ``plot``'s phases, each in CPU
   time, the fewest of as many fresh processes (:func:`plot_phases`):
   importing NumPy, matplotlib with the dashboard, reading the rows drawn,
   creating the artists, saving the PNG; matplotlib's part (its import, the
   artists and the PNG) is what ``plot`` would take if reading cost nothing.

Never a timed assertion: ``tests/test_benchmark_log.py`` runs ``--quick``
and checks what is written, not how fast.

    python benchmarks/benchmark_log.py                 # 10,000 steps every 10, 200 tensors
    python benchmarks/benchmark_log.py --target        # 10,000 tracked steps: issue 22's target
    python benchmarks/benchmark_log.py --quick         # smoke test: seconds
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

if not __package__:
    # Run as `python benchmarks/benchmark_log.py`: the repository holds `benchmarks`.
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from cockpit_gradnoise.logs import schema  # noqa: E402
from cockpit_gradnoise.logs.frame import LoggedUpdate, to_frame  # noqa: E402
from cockpit_gradnoise.logs.stream import LogStream  # noqa: E402

import numpy  # noqa: E402

MB = 1e6
#: The quantities' statistic names, as ``cgn.track(model)`` stores them.
STATISTICS = {
    schema.GRADIENT_VARIANCE: schema.sd_statistic_names((0.05, 0.25, 0.5, 0.75, 0.95)),
    schema.PER_EXAMPLE_NORM: schema.norm_statistic_names((0.05, 0.5, 0.95)),
    schema.PARAM_GRAD_RATIO: [*schema.RATIO_STATISTICS, schema.ZERO_GRAD_FRACTION,
                              schema.NORM_RATIO],
    schema.NOISE_SCALE: [schema.GRAD_SQ, schema.TRACE_COV, schema.B_SIMPLE, schema.BATCH_SIZE,
                         schema.B_SIMPLE_SMOOTHED],
}


def rss_bytes() -> float:
    """This process's resident set size now (Linux ``/proc``; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return math.nan


def synthetic_cockpit(n_tensors: int) -> SimpleNamespace:
    """A cockpit-like object: ``quantities`` named as the five, each with Cockpit's ``output``."""
    classes = [type(name, (), {}) for name in schema.QUANTITIES]
    quantities = []
    for cls in classes:
        quantity = cls()
        quantity.output = defaultdict(dict)
        quantities.append(quantity)
    names = [f"layer{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(n_tensors)]
    return SimpleNamespace(quantities=quantities, output=defaultdict(dict), names=names)


def fill(cockpit: SimpleNamespace, step: int, rng: numpy.random.Generator):
    """Store one tracked step's outputs as the quantities store them (some NaN and inf)."""
    rows = [*cockpit.names, schema.NETWORK]
    for quantity in cockpit.quantities:
        name = type(quantity).__name__
        if name == schema.UPDATE_SIZE:
            norms = rng.random((len(cockpit.names), 2))
            quantity.output[step] = [LoggedUpdate(n, float(a), float(b))
                                     for n, (a, b) in zip(cockpit.names, norms)]
            continue
        statistics = STATISTICS[name]
        numbers = rng.random((len(rows), len(statistics)))
        if schema.BATCH_SIZE in statistics:
            numbers[:, statistics.index(schema.BATCH_SIZE)] = 32.0
        numbers[0, 0] = math.nan if step % 7 == 0 else numbers[0, 0]
        numbers[-1, -1] = math.inf if step % 5 == 0 else numbers[-1, -1]
        quantity.output[step] = {
            row: schema.encode_statistics(dict(zip(statistics, values.tolist())))
            for row, values in zip(rows, numbers)
        }


def stream_synthetic(path: Path, steps: int, every: int, n_tensors: int, seed: int = 0) -> dict:
    """Measurement 1: stream ``steps // every`` tracked steps; RSS growth after the first tenth."""
    cockpit, rng = synthetic_cockpit(n_tensors), numpy.random.default_rng(seed)
    tracked = list(range(0, steps, every))
    path.unlink(missing_ok=True)  # a fresh log (LogStream continues one)
    warm, seconds = max(1, len(tracked) // 10), 0.0
    with LogStream(path) as stream:
        for i, step in enumerate(tracked):
            fill(cockpit, step, rng)
            start = time.perf_counter()
            stream.append(cockpit)
            seconds += time.perf_counter() - start  # the append alone, not the made-up outputs
            if i + 1 == warm:
                rss_warm = rss_bytes()
    held = sum(len(q.output) for q in cockpit.quantities)
    return {"tracked_steps": len(tracked), "rss_growth_mb": (rss_bytes() - rss_warm) / MB,
            "ms_per_tracked_step": 1e3 * seconds / len(tracked),
            "log_mb": path.stat().st_size / MB, "steps_held": held}


def in_memory_synthetic(steps: int, n_tensors: int, seed: int = 0) -> dict:
    """Measurement 2: the same outputs kept in memory: RSS growth per tracked step."""
    cockpit, rng = synthetic_cockpit(n_tensors), numpy.random.default_rng(seed)
    fill(cockpit, 0, rng)  # warm up (allocator, names)
    before = rss_bytes()
    for step in range(1, steps + 1):
        fill(cockpit, step, rng)
    grown = rss_bytes() - before
    return {"tracked_steps": steps, "kb_per_tracked_step": grown / steps / 1e3}


def stream_real(path: Path, steps: int, n_tensors: int) -> dict:
    """Measurement 3: a real tracked run streaming its log; RSS growth after the first tenth."""
    import cockpit_gradnoise as cgn

    import torch
    from torch import nn

    path.unlink(missing_ok=True)  # a fresh log (LogStream continues one)
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(max(1, n_tensors // 2))]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
    model, tracker = cgn.track(model, every=1, log=path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    warm, held, start = max(1, steps // 10), 0, time.perf_counter()
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 8, (16,))
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=optimizer) as loss:
            loss.backward()
        optimizer.step()
        held = max(held, sum(len(q.output) for q in tracker.cockpit.quantities))
        if step + 1 == warm:
            rss_warm = rss_bytes()
    seconds = time.perf_counter() - start
    tracker.close()
    return {"tracked_steps": steps, "tensors": sum(1 for _ in model.parameters()),
            "rss_growth_mb": (rss_bytes() - rss_warm) / MB,
            "ms_per_tracked_step": 1e3 * seconds / steps, "steps_held": held,
            "log_mb": path.stat().st_size / MB}


def read_in_process(path: Path) -> dict:
    """``to_frame`` of the log: seconds and the frame's size."""
    start, cpu = time.perf_counter(), time.process_time()
    frame = to_frame(path)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "rows": len(frame),
            "frame_mb": frame.memory_usage(deep=True).sum() / MB}


# Runs the command line, then writes its own peak RSS (VmHWM, kB) to argv[1]. Measured
# in the child: a forked child's rusage peak starts at its parent's (Linux keeps
# ru_maxrss across exec), so os.wait4's would count this benchmark's own memory.
_CHILD = """
import sys
from cockpit_gradnoise.cli import main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status, open(sys.argv[1], "w") as out:
        out.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
sys.exit(code)
"""


def _wait(process, deadline):
    """Reap ``process`` (killed at ``deadline``, a ``perf_counter`` time): its status and rusage."""
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.perf_counter() > deadline:
            process.kill()
        time.sleep(0.05)


def _child_env() -> dict:
    """This environment, with the package measured here first on the path of a child
    process (also where another one is installed)."""
    import cockpit_gradnoise

    home = str(Path(cockpit_gradnoise.__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([home, os.environ.get("PYTHONPATH", "")])}


def run_cli(arguments, timeout: float = 900.0) -> dict:
    """``cockpit-gradnoise ARGUMENTS`` in a fresh process: wall and CPU seconds, peak RSS.

    Killed after ``timeout`` seconds (exit code -9, said in the table).
    """
    env = _child_env()
    with tempfile.TemporaryDirectory() as scratch:
        peak_file = Path(scratch) / "peak"
        command = [sys.executable, "-c", _CHILD, str(peak_file), *map(str, arguments)]
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   env=env)
        status, usage = _wait(process, start + timeout)
        seconds = time.perf_counter() - start
        error = process.stderr.read().decode(errors="replace").strip().splitlines()
        process.returncode = os.waitstatus_to_exitcode(status)
        process.stderr.close()
        peak = int(peak_file.read_text()) * 1024 if peak_file.exists() else math.nan
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_mb": peak / MB, "returncode": process.returncode,
            "error": error[-1] if error else ""}


def run_cli_repeated(arguments, repeats: int) -> dict:
    """:func:`run_cli` ``repeats`` times: the fewest CPU seconds (noise only adds), the median
    wall time, the largest peak RSS, and each run."""
    runs = [run_cli(arguments) for _ in range(repeats)]
    failed = [run for run in runs if run["returncode"] != 0]
    if failed:
        return failed[0]
    return {"seconds": statistics.median(run["seconds"] for run in runs),
            "cpu_seconds": min(run["cpu_seconds"] for run in runs),
            "peak_mb": max(run["peak_mb"] for run in runs), "returncode": 0, "error": "",
            "repeats": repeats, "runs": runs}


#: What each command imports before it reads the log (the rest of its modules are light).
_IMPORTS = {"report": "import pandas",
            "plot": "import matplotlib.figure, matplotlib.backends.backend_agg"}  # no pandas


def import_seconds(repeats: int) -> dict:
    """CPU seconds of a fresh interpreter that only imports what ``report`` / ``plot`` need
    (the fewest of ``repeats``), and of one that imports nothing."""
    found = {}
    for name, code in {"python": "pass", **_IMPORTS}.items():
        times = []
        for _ in range(repeats):
            process = subprocess.Popen([sys.executable, "-c", code])
            _, _, usage = os.wait4(process.pid, 0)
            times.append(usage.ru_utime + usage.ru_stime)
        found[name] = min(times)
    return found


#: ``plot``'s phases in a fresh process, as the command line goes through them: CPU seconds
#: of importing NumPy; matplotlib and the dashboard; reading the rows drawn; creating the
#: figure's artists; saving the PNG (rendering and encoding).
_PHASES = """
import json, sys, time
marks = [time.process_time()]
import numpy
marks.append(time.process_time())
from cockpit_gradnoise import cli
with cli._no_artist_docs():
    from cockpit_gradnoise.views import dashboard
marks.append(time.process_time())
from cockpit_gradnoise.views.reads import plot_rows
from cockpit_gradnoise.views.sources import streamed_rows
rows, layers = streamed_rows(sys.argv[1], plot_rows)
marks.append(time.process_time())
figure = dashboard.figure(rows, layers=layers, fig=dashboard.OwnFigure())
marks.append(time.process_time())
figure.savefig(sys.argv[2], dpi=100, pil_kwargs={"compress_level": 3})
marks.append(time.process_time())
print(json.dumps([b - a for a, b in zip(marks, marks[1:])]))
"""
PHASES = ("NumPy", "matplotlib and the dashboard", "reading the rows", "creating the artists",
          "saving the PNG")
MATPLOTLIB_PART = "matplotlib's part"


def plot_phases(log: Path, image: Path, repeats: int) -> dict:
    """CPU seconds of each of ``plot``'s phases (:data:`PHASES`), the fewest of ``repeats``
    fresh processes each, and what matplotlib's own phases (its import with the dashboard's,
    the artists, the PNG) add up to: ``plot``'s time if reading and NumPy cost nothing."""
    env = _child_env()
    runs = [json.loads(subprocess.run([sys.executable, "-c", _PHASES, str(log), str(image)],
                                      check=True, capture_output=True, text=True, env=env).stdout)
            for _ in range(repeats)]
    fewest = dict(zip(PHASES, (min(times) for times in zip(*runs))))
    fewest[MATPLOTLIB_PART] = sum(fewest[name] for name in PHASES[1:2] + PHASES[3:])
    return fewest


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="training steps (default 10000)")
    parser.add_argument("--every", type=int, default=10, help="track every k-th (default 10)")
    parser.add_argument("--tensors", type=int, default=200, help="parameter tensors (default 200)")
    parser.add_argument("--in-memory-steps", type=int, default=300,
                        help="tracked steps kept in memory for the comparison (default 300)")
    parser.add_argument("--real-steps", type=int, default=100,
                        help="steps of the real tracked run (default 100)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder for the logs (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-plot", action="store_true", help="leave out the plot command")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of report and plot each (default 3): fewest CPU seconds, "
                        "median wall time, largest peak RSS")
    parser.add_argument("--no-to-frame", action="store_true",
                        help="leave out to_frame of the whole log in this process (a minute "
                        "and 1 GB at 10,000 tracked steps)")
    parser.add_argument("--target", action="store_true",
                        help="issue 22's target: 10,000 tracked steps (--every 1), 200 tensors, "
                        "20 real steps, 100 in-memory steps, no to_frame")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 200 steps every 2, 10 tensors, 20 real steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.tensors = 200, 2, 10
        args.in_memory_steps, args.real_steps, args.repeats = 20, 20, 1
    if args.target:
        args.steps, args.every, args.tensors = 10_000, 1, 200
        args.in_memory_steps, args.real_steps, args.no_to_frame = 100, 20, True
    return args


def markdown(results: dict, args) -> str:
    streamed, kept, real = results["streamed"], results["in_memory"], results["real"]
    read, report, plot = results["to_frame"], results["report"], results["plot"]
    rows = [
        ("streamed log, synthetic: tracked steps", f"{streamed['tracked_steps']:,}"),
        ("  RSS growth after the first tenth", f"{streamed['rss_growth_mb']:.1f} MB"),
        ("  append time per tracked step", f"{streamed['ms_per_tracked_step']:.2f} ms"),
        ("  log size", f"{streamed['log_mb']:.0f} MB"),
        ("  steps held in memory after each append", f"{streamed['steps_held']}"),
        ("in memory (no stream), synthetic: RSS per tracked step",
         f"{kept['kb_per_tracked_step']:.0f} KB"),
        (f"streamed log, real MLP ({real['tensors']} tensors, {real['tracked_steps']} steps): "
         "RSS growth", f"{real['rss_growth_mb']:.1f} MB"),
        ("  most steps held by the quantities after a tracked call", f"{real['steps_held']}"),
        ("  time per tracked step", f"{real['ms_per_tracked_step']:.0f} ms"),
        (f"to_frame of the streamed log ({read['rows']:,} rows)",
         f"{read['seconds']:.2f} s ({read['cpu_seconds']:.2f} s CPU), frame "
         f"{read['frame_mb']:.0f} MB") if read else ("to_frame of the streamed log", "not run"),
        ("imports alone (CPU): python, report's (pandas), plot's (matplotlib)",
         " / ".join(f"{seconds:.2f} s" for seconds in results["imports"].values())),
        (f"cockpit-gradnoise report ({args.repeats} runs)", _cli_cell(report)),
        (f"cockpit-gradnoise plot ({args.repeats} runs)", _cli_cell(plot)),
    ]
    phases = results["plot_phases"]
    if phases:
        rows.append((f"  its phases (CPU, fewest of {args.repeats}): "
                     + ", ".join(PHASES) + "; matplotlib's part (without NumPy and reading)",
                     " / ".join(f"{phases[name]:.2f} s" for name in PHASES)
                     + f"; {phases[MATPLOTLIB_PART]:.2f} s"))
    load = results["load"]
    lines = [f"`{' '.join(results['command'])}`", "",
             f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, on "
             f"{os.cpu_count()} CPUs", "", "| measured | result |", "|---|---|"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in rows]) + "\n"


def _cli_cell(result) -> str:
    if result is None:
        return "not run (--no-plot)"
    if result["returncode"] != 0:
        return f"exit {result['returncode']}: {result['error']}"
    return (f"{result['cpu_seconds']:.2f} s CPU (fewest), {result['seconds']:.2f} s wall "
            f"(median), peak RSS {result['peak_mb']:.0f} MB (largest)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.dir or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "synthetic.jsonl"
        results = {
            "command": ["python", "benchmarks/benchmark_log.py", *(argv or sys.argv[1:])],
            "streamed": stream_synthetic(log, args.steps, args.every, args.tensors),
            "in_memory": in_memory_synthetic(args.in_memory_steps, args.tensors),
            "real": stream_real(folder / "real.jsonl", args.real_steps, args.tensors),
            "to_frame": None if args.no_to_frame else read_in_process(log),
            "imports": import_seconds(args.repeats),
            "report": run_cli_repeated(["report", log], args.repeats),
            "plot": None if args.no_plot else run_cli_repeated(
                ["plot", log, "-o", folder / "dashboard.png"], args.repeats),
            "plot_phases": None if args.no_plot else plot_phases(
                log, folder / "phases.png", args.repeats),
        }
        results["load"] = (load, os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan)
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    print(markdown(results, args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
