"""The architecture sweep: every model of ``experiments/sweep_models.py`` through ``cgn.check_model``.

Each architecture (tiny configuration, random weights, float64, evaluation
mode, batch 4) is checked as a user would check it: ``cgn.check_model``
computes each example's contribution by one backward pass per example on an
un-extended copy and compares the package's rows on a prepared copy. Each is
classified:

- ``exact``: every trainable element that gets a gradient has rows, all
  within ``TOLERANCE`` (relative, float64) of the reference;
- ``exact, left out``: the rows there are exact; some parameters have none,
  named with the reason the package gives;
- ``exact to float32``: as ``exact`` (or left out), but some parameters'
  own modules, or the blocks run on each example that compute their rows
  (a mixture-of-experts router's ``router_logits.float()``), compute in
  float32 inside the float64 model (an RMSNorm's
  ``x.float()``), and their errors are within ``FLOAT32_TOLERANCE`` (every
  other parameter's within ``TOLERANCE``); every parameter of a model whose
  own code cannot run in float64, or whose float64 check would not fit in a few
  GB, built in float32 (``sweep_models.FLOAT32_ONLY``, ``TORCHVISION_FLOAT32``);
- ``error``: the checker raised (a user's tracked step would be lost);
- ``inexact``: some rows are off (silently wrong: should be none);
- ``skipped``: the model cannot be built or trained plainly from the generic
  tiny configuration (the reason), or ran past the time limit (``timeout``).

Models run one after the other in a worker process (spawned once, killed and
started again when a model runs past ``--timeout`` or crashes), so one bad
model does not stop the sweep. The worker is also started again after
``--restart-every`` models or once its resident memory passes
``--restart-above`` GiB after a model: memory an allocator keeps from earlier
models (a worker grew to 11-14 GB over a run of full-width timm models, and the
kernel killed one for memory) cannot pile up over a long run. The time limit counts the worker's CPU time
(where ``/proc`` tells it), not the clock's: on a machine shared with other
work a model's check runs many times slower by the clock, and a wall-clock
limit would time out models that finish in seconds alone (the last full run's
timeouts). A model also stops after ``WALL_FACTOR`` times the limit by the
clock (one that waits without computing). Results go to a JSON file (written after each
model; ``--resume`` skips those done) and to a generated section of
``docs/supported-models.md``, between ``BEGIN`` and ``END``.

Run (long: about an hour on one thread)::

    PYTHONPATH=. nice python -m experiments.architecture_sweep
    PYTHONPATH=. python -m experiments.architecture_sweep --quick  # a minute
"""

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
import traceback
import warnings
from typing import Dict, List, Optional

from experiments.sweep_page import BEGIN, END, PAGE, STATUSES, counts, write_page  # noqa: F401 (the page's names, used by tests)

TOLERANCE = 1e-10
# float32 arithmetic inside a float64 model: relative rounding of a float32 sum of at most
# a few hundred terms (tiny widths and lengths), eps32 = 1.2e-7 times 10^3.
FLOAT32_TOLERANCE = 1e-4
# A parameter whose reference is below sqrt(eps64) times the network's largest contribution
# can be rounding noise of a cancelling sum (Funnel's k_head.bias: 3e-10 to 2e-9 of it), and
# is compared against the network's scale.
ZERO_SCALE = 1.5e-8
WALL_FACTOR = 10  # the clock's limit, in CPU-time limits (a worker starved by other processes)
STARTUP = 900  # seconds for the worker's imports, not counted in a model's time limit
# A fresh worker after this many models, or once its resident memory passes this many GiB
# after one (a fresh one holds about 1 GiB: torch, transformers, timm imported); starting one
# costs its imports, about 10 s of CPU.
RESTART_EVERY = 25
RESTART_ABOVE_GIB = 4.0
RESULTS = os.path.join("experiments", "results", "architecture_sweep.json")


def computed_in_float32(case) -> set:
    """Names of the modules that compute in float32 in the float64 model (an RMSNorm's
    ``x.float()``, a router's ``router_logits.float()``): the operations run while that
    module is the innermost."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    stack, found = [], set()

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if stack and isinstance(out, torch.Tensor) and out.dtype in (
                    torch.float32, torch.float16, torch.bfloat16):
                found.add(stack[-1])
            return out

    def enter(module, args):
        stack.append(id(module))

    def leave(module, args, output):
        stack.pop()

    handles = []
    for module in case.model.modules():
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.no_grad(), Dtypes():
            case.model(*case.inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {name for name, module in case.model.named_modules() if id(module) in found}


def float32_parameters(model, frame, modules: set) -> set:
    """Names of the parameters whose rows are computed in float32 (:func:`computed_in_float32`'s
    ``modules``): those of such a module, and every parameter whose rows come from its block
    run on each example (``check_model``'s ``how``) where a module inside that block computes
    in float32: one example alone rounds there otherwise than the batch (a float32 product of
    7 rows against one of 28), and every contribution of the block follows that rounding."""
    prefix = "per example (its block "
    block_of = {r.param: r.how[len(prefix):].split(" ", 1)[0] for r in frame.itertuples()
                if r.how.startswith(prefix)}
    # A layer the fallback does not run whose parameters its parent uses (Mamba's conv1d):
    # computed by the parent's replay, in the parent's precision.
    by_parent = {r.param for r in frame.itertuples() if "its parameters used by its parent" in r.how}
    found = set()
    for name, _ in model.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if name in by_parent:
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        if owner in modules:
            found.add(name)
        elif name in block_of:
            parts = owner.split(".") if owner else []
            block = next((".".join(parts[:k]) for k in range(len(parts), -1, -1)
                          if type(model.get_submodule(".".join(parts[:k]))).__name__ == block_of[name]),
                         None)
            if block is not None and any(_inside(module, block) for module in modules):
                found.add(name)
    return found


def float32_model(model) -> set:
    """Every parameter's name where the whole model is float32 (a model whose own code cannot
    run in float64, ``sweep_models.FLOAT32_ONLY``, or too large for a float64 check,
    ``TORCHVISION_FLOAT32``), none otherwise."""
    import torch

    dtypes = {param.dtype for param in model.parameters() if param.is_floating_point()}
    return {name for name, _ in model.named_parameters()} if dtypes == {torch.float32} else set()


def _inside(module: str, block: str) -> bool:
    """Whether the module named ``module`` is ``block`` or inside it (by their names)."""
    return not block or module == block or module.startswith(f"{block}.")


def _short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def classify(frame, float32: set) -> dict:
    """The status and its details from ``check_model``'s table; ``float32``: the names of
    the parameters whose module computes in float32 (:func:`computed_in_float32`)."""
    import math

    unused = frame.note.str.startswith("no gradient")
    used = frame[~unused]
    left_out = used[~used.rows]
    with_rows = used[used.rows]
    unverified = with_rows[with_rows.max_rel_error.isna()]
    # A gradient that is zero by structure (an attention key's bias) is rounding noise in the
    # reference, so its relative error is about 1 whatever the rows: measured against the
    # network's largest contribution instead (an error of the rows is not hidden: a row of
    # 1e-3 against a reference of 1e-17 gives 1e14 times the noise's scale).
    network = used.reference_scale.max()
    zero = with_rows.reference_scale <= ZERO_SCALE * network
    errors = with_rows.max_rel_error.where(
        ~zero, with_rows.max_rel_error * with_rows.reference_scale / network).fillna(0.0)
    worst = float(errors.max()) if len(errors) else 0.0
    worst_param = _short(with_rows.param[errors.idxmax()]) if len(errors) else ""
    in_float32 = with_rows.param.isin(float32)
    elements = int(used.elements.sum())
    if len(unverified) or worst > FLOAT32_TOLERANCE or (errors[~in_float32] > TOLERANCE).any():
        status = "inexact"
    elif worst > TOLERANCE:
        status = "exact to float32"
    else:
        status = "exact, left out" if len(left_out) else "exact"
    return {
        "status": status,
        "coverage": float(with_rows.elements.sum() / elements) if elements else 1.0,
        "parameters": len(used), "elements": elements,
        "worst_rel_error": None if math.isnan(worst) else worst, "worst_param": worst_param,
        "left_out": [{"param": _short(r.param), "elements": int(r.elements), "reason": r.note}
                     for r in left_out.itertuples()],
        "unused": [_short(p) for p in frame.param[unused]],
        "unverified": [_short(p) for p in unverified.param],
        "zero_by_structure": [_short(p) for p in with_rows.param[zero]],
        "how": sorted(set(with_rows.how)),
    }


def check_one(library: str, name: str) -> dict:
    """Build, check and classify one architecture (in the worker process); with the
    seconds by the clock and of CPU time it took."""
    start, cpu = time.perf_counter(), time.process_time()
    record = {"library": library, "name": name}
    record.update(_checked(library, name, start))
    record["cpu_seconds"] = time.process_time() - cpu
    return record


def _checked(library: str, name: str, start: float) -> dict:
    import cockpit_gradnoise as cgn

    import torch

    from experiments import sweep_models

    record = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = sweep_models.build(library, name)
    except sweep_models.Unavailable as reason:
        return {"status": "skipped", "message": str(reason), "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - a builder's bug is a skip with its message
        return {"status": "skipped", "message": f"build: {type(error).__name__}: {error}"[:400],
                "seconds": time.perf_counter() - start}
    record["detail"] = case.detail
    try:
        float32 = computed_in_float32(case)
        torch.manual_seed(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            whole = float32_model(case.model)  # its copies float32 too: its code fails in float64
            frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False,
                                    dtype=torch.float32 if whole else torch.float64)
        record.update(classify(frame, float32_parameters(case.model, frame, float32) | whole))
        record["warnings"] = sorted({str(w.message)[:300] for w in caught
                                     if "cockpit_gradnoise" in (w.filename or "")})
    except Exception as error:  # noqa: BLE001 - the class "error": the step a user would lose
        where = traceback.extract_tb(error.__traceback__)[-1]
        record.update(status="error", message=f"{type(error).__name__}: {str(error)[:400]}",
                      where=f"{os.path.relpath(where.filename)}:{where.lineno}")
    record["seconds"] = time.perf_counter() - start
    return record


def _worker(connection):
    import cockpit_gradnoise  # noqa: F401

    import timm  # noqa: F401 - imported before the first model's time limit starts
    import torch
    import torchvision  # noqa: F401
    import transformers  # noqa: F401

    from experiments import sweep_behaviour, sweep_models  # noqa: F401

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    connection.send("ready")
    while True:
        job = connection.recv()
        if job is None:
            return
        library, name, kind = job
        connection.send(sweep_behaviour.behaviour_record(library, name) if kind == "behaviour"
                        else check_one(library, name))


class Worker:
    """A spawned process checking models one at a time; started again after a timeout or
    crash, and (:meth:`worn`) after ``max_models`` models or above ``max_rss_gib`` of memory."""

    def __init__(self, max_models: Optional[int] = RESTART_EVERY,
                 max_rss_gib: Optional[float] = RESTART_ABOVE_GIB):
        self.process = None
        self.max_models, self.max_rss_gib = max_models, max_rss_gib
        self.models = 0  # run by this process

    def start(self):
        self.models = 0
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child,), daemon=True)
        self.process.start()
        if not self.connection.poll(STARTUP) or self.connection.recv() != "ready":
            raise RuntimeError(f"the sweep's worker did not start within {STARTUP} s")

    def cpu_seconds(self) -> Optional[float]:
        """The worker's CPU time so far (user and system), ``None`` without ``/proc``."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def rss_gib(self) -> Optional[float]:
        """The worker's resident memory in GiB, ``None`` without ``/proc``."""
        try:
            with open(f"/proc/{self.process.pid}/statm") as handle:
                pages = int(handle.read().split()[1])
        except OSError:
            return None
        return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 30

    def worn(self) -> str:
        """Why the worker should be started afresh before the next model (``""``: it need not)."""
        if self.process is None:
            return ""
        if self.max_models is not None and self.models >= self.max_models:
            return f"{self.models} models run"
        rss = self.rss_gib() if self.max_rss_gib is not None else None
        if rss is not None and rss > self.max_rss_gib:
            return f"{rss:.1f} GiB resident"
        return ""

    def run(self, library: str, name: str, timeout: float, kind: str = "check") -> dict:
        """Check one model (``kind="behaviour"``: the second pass); a timeout after
        ``timeout`` s of the worker's CPU time (of the clock's where it cannot be read), or
        ``WALL_FACTOR`` times it by the clock."""
        if self.process is None or not self.process.is_alive():
            self.start()
        start, cpu = time.perf_counter(), self.cpu_seconds()
        self.connection.send((library, name, kind))
        try:
            while True:
                if self.connection.poll(min(1.0, timeout)):
                    self.models += 1
                    return self.connection.recv()
                wall = time.perf_counter() - start
                used = wall if cpu is None else (self.cpu_seconds() or cpu) - cpu
                if used > timeout or wall > WALL_FACTOR * timeout:
                    break
            status = "timeout"
            message = (f"ran past {timeout:.0f} s" + ("" if cpu is None else " of CPU time")
                       + (f" ({wall:.0f} s by the clock)" if wall > timeout else ""))
        except EOFError:
            status, message = "error", f"the worker process died (exit code {self.process.exitcode})"
        self.stop()
        if kind == "behaviour":
            return {"library": library, "name": name, "behaviour": {
                "died" if status == "error" else "timeout": message,
                "verdict": f"{status}: {message}", "seconds": time.perf_counter() - start}}
        return {"library": library, "name": name, "status": status, "message": message,
                "seconds": time.perf_counter() - start}

    def stop(self):
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process = None


def sweep(jobs: List[tuple], timeout: float, results: Optional[Dict[str, dict]] = None,
          path: Optional[str] = None, log=print, worker=None) -> Dict[str, dict]:
    """``{"library/name": record}`` for each ``(library, name)`` of ``jobs`` not in ``results``
    (``worker``: see :func:`_each_in_worker`)."""
    def told(record):
        cpu = f", {record['cpu_seconds']:.1f} s CPU" if "cpu_seconds" in record else ""
        return (f"{record['status']} ({record['seconds']:.1f} s{cpu})"
                + (f" {record.get('message', '')[:150]}" if "message" in record else ""))

    return _each_in_worker(jobs, timeout, dict(results or {}), path, "check", told, log, worker)


def _each_in_worker(jobs, timeout, results, path, kind, told, log, worker=None) -> Dict[str, dict]:
    """``results`` with a record for each ``(library, name)`` of ``jobs`` not in it, each run by
    one worker process (``kind``: the check or the second pass; ``worker``: a :class:`Worker`
    with its restart limits, the defaults' otherwise), logged (``told(record)``) and written to
    ``path`` as it comes."""
    worker = worker or Worker()
    try:
        for library, name in jobs:
            key = f"{library}/{name}"
            if key in results:
                continue
            record = worker.run(library, name, timeout, kind=kind)
            results[key] = record
            log(f"{key}: {told(record)}")
            if path:
                write_results(results, path)
            worn = worker.worn()
            if worn:  # the next model in a fresh process: no memory kept from this one's
                log(f"(a fresh worker: {worn})")
                worker.stop()
    finally:
        worker.stop()
    return results


def behaviour_sweep(jobs: List[tuple], timeout: float, done: Optional[Dict[str, dict]] = None,
                    path: Optional[str] = None, log=print, worker=None) -> Dict[str, dict]:
    """The second pass (``experiments/sweep_behaviour.py``) on each ``(library, name)`` of
    ``jobs`` without a ``behaviour`` in ``done``: ``{"library/name": {"library", "name",
    "behaviour"}}``, the fields to merge into the sweep's records (:func:`merged`)."""
    results = {key: {"library": r["library"], "name": r["name"], "behaviour": r["behaviour"]}
               for key, r in (done or {}).items() if "behaviour" in r}

    def told(record):
        behaviour = record["behaviour"]
        return (f"{behaviour.get('verdict', behaviour.get('skipped', ''))[:200]} "
                f"({behaviour['seconds']:.1f} s) {behaviour.get('time', '')}")

    return _each_in_worker(jobs, timeout, results, path, "behaviour", told, log, worker)


def merged(old: Optional[dict], new: dict) -> dict:
    """``new`` in place of ``old``; a record of the second pass alone (``library``, ``name``,
    ``behaviour``) adds its ``behaviour`` to ``old``'s fields instead."""
    if old is not None and set(new) <= {"library", "name", "behaviour"}:
        return {**old, "behaviour": new["behaviour"]}
    if old is not None and "behaviour" in old and "behaviour" not in new:
        return {**new, "behaviour": old["behaviour"]}  # a check run again keeps the second pass
    return new


def versions() -> Dict[str, str]:
    import timm
    import torch
    import torchvision
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "timm": timm.__version__,
            "torchvision": torchvision.__version__}


def write_results(results: Dict[str, dict], path: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump({"versions": versions(), "tolerance": TOLERANCE,
                   "float32_tolerance": FLOAT32_TOLERANCE, "results": results}, handle, indent=1)
    os.replace(path + ".tmp", path)


def jobs_of(quick: bool, only: List[str]) -> List[tuple]:
    from experiments import sweep_models

    names = sweep_models.QUICK if quick else sweep_models.all_names()
    jobs = [(library, name) for library, listed in names.items() for name in listed]
    return [job for job in jobs if not only or job[0] in only or f"{job[0]}/{job[1]}" in only]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a handful of models per library")
    parser.add_argument("--only", nargs="*", default=[], help="libraries or library/name")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds of CPU time per model (10 times that by the clock)")
    parser.add_argument("--restart-every", type=int, default=RESTART_EVERY,
                        help="start the worker afresh after this many models (0: never)")
    parser.add_argument("--restart-above", type=float, default=RESTART_ABOVE_GIB,
                        help="... or once its resident memory passes this many GiB (0: never)")
    parser.add_argument("--results", default=None, help=f"JSON file (default {RESULTS})")
    parser.add_argument("--resume", action="store_true", help="skip models in the JSON file")
    parser.add_argument("--page", action="store_true", help=f"write the section of {PAGE}")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: write the JSON (and the page) from --merge's files")
    parser.add_argument("--reverse", action="store_true",
                        help="last model first (a second process from the other end)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="JSON files of earlier runs (run in parallel) to start from")
    parser.add_argument("--behaviour", action="store_true",
                        help="only the second pass (behaviour kept, step time) on the models that "
                        "built in --merge's records without a behaviour yet; --results gets its fields")
    args = parser.parse_args(argv)
    path = args.results or (None if args.quick else RESULTS)
    if args.behaviour and path == RESULTS and not args.results:
        parser.error("--behaviour writes its own --results file, merged with --merge later")
    previous = {}
    for earlier in args.merge + ([path] if args.resume and path and os.path.exists(path) else []):
        with open(earlier) as handle:
            for key, record in json.load(handle)["results"].items():
                previous[key] = merged(previous.get(key), record)
    jobs = jobs_of(args.quick, args.only)
    worker = Worker(args.restart_every or None, args.restart_above or None)
    if args.behaviour:
        built = [(lib, name) for lib, name in jobs
                 if previous.get(f"{lib}/{name}", {}).get("status", "skipped") != "skipped"]
        return behaviour_sweep(built[::-1] if args.reverse else built, args.timeout, previous, path,
                               worker=worker)
    if args.no_run:
        results = {key: previous[key] for key in (f"{lib}/{name}" for lib, name in jobs)
                   if "status" in previous.get(key, {})}
        if path:
            write_results(results, path)
    else:
        results = sweep(jobs[::-1] if args.reverse else jobs, args.timeout, previous, path, worker=worker)
    for library, row in counts(results).items():
        print(library, {s: n for s, n in row.items() if n})
    if args.page:
        not_reached = [f"{lib}/{name}" for lib, name in jobs if f"{lib}/{name}" not in results]
        write_page({"versions": versions(), "tolerance": TOLERANCE,
                    "float32_tolerance": FLOAT32_TOLERANCE, "results": results,
                    "not_reached": not_reached})
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
