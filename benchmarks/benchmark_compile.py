"""torch.compile and the tracker: graph breaks, compile time, and the cost of a tracked step.

For each model of ``benchmarks/models.py`` named on the command line, four
training steps (forward, mean loss, backward) are timed in turn, round after
round, each reported as its median over the rounds with the ratio to the
plain eager step:

- ``plain``: the model as it is;
- ``plain compiled``: ``torch.compile(model)``;
- ``tracked``: ``cgn.track(model, every=1)``, all five quantities at every step;
- ``tracked compiled``: ``cgn.track(torch.compile(model), every=1)``.

The graphs and breaks of one forward of each compiled model
(``torch._dynamo.explain``) and the seconds of its first step (the compile)
are printed first. The tracker puts a hook on every module with parameters of
its own, and each such hook ends a graph, so the tracked compiled model runs
as many small graphs::

    python benchmarks/benchmark_compile.py --models mlp gpt --rounds 10
    python benchmarks/benchmark_compile.py --backend eager --rounds 3   # dynamo only, fast
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.models import MODELS, model_and_batch  # noqa: E402


def plain_step(model, loss_fn, x, y):
    def step(index):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    return step


def tracked_step(model, tracker, per_example_loss, x, y):
    def step(index):
        model.zero_grad(set_to_none=True)
        with tracker(index, per_example_loss(model(x), y)) as loss:
            loss.backward()

    return step


def graphs_and_breaks(compiled, x):
    import torch._dynamo

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(compiled._orig_mod)(x)
    return explanation.graph_count, explanation.graph_break_count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, backend {args.backend!r}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, median seconds per step")
    for label in args.models:
        spec = MODELS[label]
        model, x, y = model_and_batch(spec, spec.batch_size, "cpu")
        mean_loss, per_example = spec.loss("mean"), spec.loss("none")
        models = {name: copy.deepcopy(model) for name in ("plain", "plain compiled", "tracked",
                                                           "tracked compiled")}
        steps = {"plain": plain_step(models["plain"], mean_loss, x, y)}
        compiled = torch.compile(models["plain compiled"], backend=args.backend)
        steps["plain compiled"] = plain_step(compiled, mean_loss, x, y)
        tracked, tracker = cgn.track(models["tracked"], every=1)
        steps["tracked"] = tracked_step(tracked, tracker, per_example, x, y)
        tracked_compiled, tracker_c = cgn.track(
            torch.compile(models["tracked compiled"], backend=args.backend), every=1)
        steps["tracked compiled"] = tracked_step(tracked_compiled, tracker_c, per_example, x, y)
        for name, module in (("plain compiled", compiled), ("tracked compiled", tracked_compiled)):
            graphs, breaks = graphs_and_breaks(module, x)
            print(f"{label} {name}: {graphs} graphs, {breaks} breaks")
        first = {}
        for name, step in steps.items():  # the first step compiles
            start = time.perf_counter()
            step(0)
            first[name] = time.perf_counter() - start
        print(f"{label} first step (compile) s: " + ", ".join(f"{n} {s:.1f}" for n, s in first.items()))
        times = {name: [] for name in steps}
        for index in range(1, args.rounds + 1):
            for name, step in steps.items():
                start = time.perf_counter()
                step(index)
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["plain"])
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{label:8s} {name:17s} {median * 1e3:9.1f} ms  {median / base:5.2f}x plain")
        print(f"{label:8s} tracked compiled / tracked: "
              f"{statistics.median(times['tracked compiled']) / statistics.median(times['tracked']):.2f}")


if __name__ == "__main__":
    main()
