"""Speed and memory of one tracked training step against a plain step.

For each model and method, one training step (forward, loss, backward) is
timed against a plain step on a model with the same architecture and weights,
interleaved in one process (plain, method A, plain, method B, ... per round),
and the median over the rounds is reported as a ratio to the plain step's
median. Peak extra memory of a step is measured separately (see
``harness.peak_extra_bytes``) and reported as a ratio to the plain step's.

Run ``python benchmarks/benchmark.py --help``; ``benchmarks/README.md`` explains
what is measured and lists results. This file is the command line; beside it:
``models``, ``methods`` (one training step per method), ``harness`` (timing and
memory), ``readme_tables``, and the other measurements ``scaling``,
``support_cost``, ``preconditioned_cost`` and ``profile_floor``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

# Hide kineto's "gpuGetDeviceCount failed" line when the profiler measures CPU memory.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
if not __package__:
    # Run as `python benchmarks/benchmark.py`, Python puts benchmarks/ on the path,
    # not the repository that holds the packages `benchmarks` and `experiments` (the
    # GPT). The repository's `benchmarks` is imported first, ahead of site-packages
    # (Opacus' wheel installs a top-level package of that name, which would shadow
    # it); then the repository goes last, so that an installed cockpit_gradnoise, or
    # PYTHONPATH, still comes first.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

import torch  # noqa: E402

from benchmarks.harness import benchmark_model, environment  # noqa: E402
from benchmarks.methods import METHODS  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402
from benchmarks.preconditioned_cost import (  # noqa: E402
    preconditioned_cost_markdown,
    preconditioned_cost_rows,
)
from benchmarks.profile_floor import profile_floor  # noqa: E402
from benchmarks.readme_tables import report_markdown  # noqa: E402
from benchmarks.scaling import scaling_columns, scaling_page, schedule_rows  # noqa: E402
from benchmarks.support_cost import support_cost_markdown_cpu, support_cost_rows  # noqa: E402


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,cnn,resnet18,gpt", help="comma-separated: " + ",".join(MODELS)
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated method names (default: all): " + ", ".join(METHODS),
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="for every model (default: each model's own: "
        + ", ".join(f"{name} {spec.batch_size}" for name, spec in MODELS.items())
        + ")",
    )
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (>= 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--no-memory", dest="memory", action="store_false", help="time only (faster)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also save here")
    parser.add_argument(
        "--markdown", default=None, metavar="PATH",
        help="also write the README's tables (results, targets, support cost) here",
    )
    parser.add_argument(
        "--from-json", default=None, metavar="PATH",
        help="print (and --markdown) the tables of a saved --json run; measure nothing",
    )
    parser.add_argument(
        "--scaling", default=None, metavar="PATH",
        help="measure the MLP against batch size and width and a linear(10) schedule "
        "instead; write the docs page here (e.g. docs/scaling.md)",
    )
    parser.add_argument("--scaling-batch-sizes", default="16,64,256")
    parser.add_argument("--scaling-widths", default="256,1024,4096")
    parser.add_argument(
        "--every", type=int, default=10, help="--scaling's schedule: linear(EVERY)"
    )
    parser.add_argument(
        "--support-cost", default=None, metavar="PATH",
        help="instead: issue 9's support cost on the GPT in CPU time of one thread "
        "(min over interleaved rounds, with a control family); write its table here",
    )
    parser.add_argument(
        "--preconditioned-cost", default=None, metavar="PATH",
        help="instead: issue 34's cost of PreconditionedNoiseScale over GradientNoiseScale on "
        "--models in CPU time of one thread (interleaved rounds); write its table here",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="instead: where an empty Cockpit's time goes on the MLP (cProfile)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 3 rounds, 1 warmup step, batch size 8 (not a measurement)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.batch_size = 3, 1, 8
    elif args.rounds < 15:
        parser.error("--rounds must be at least 15 for a measurement (or use --quick)")
    args.scaling_batch_sizes = [int(n) for n in args.scaling_batch_sizes.split(",")]
    args.scaling_widths = [int(n) for n in args.scaling_widths.split(",")]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.methods is None:
        args.methods = list(METHODS)
    else:
        args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in args.methods if m not in METHODS]
        if unknown:
            parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as file:
            table = json.load(file)["rows"]
        return write_report(table, args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    if args.support_cost or args.preconditioned_cost:
        args.threads = 1  # CPU time of one thread (support_cost_rows, preconditioned_cost_rows)
    torch.set_num_threads(args.threads)
    env = environment(args, device)
    for key, value in env.items():
        print(f"{key}: {value}")
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    print()
    if args.profile:
        print(profile_floor(args, device))
        return None
    if args.support_cost:
        rows, best = support_cost_rows(args)
        page = support_cost_markdown_cpu(rows, best)
        with open(args.support_cost, "w") as file:
            file.write(page + "\n")
        print(page)
        return rows
    if args.preconditioned_cost:
        rows = preconditioned_cost_rows(args)
        page = preconditioned_cost_markdown(rows)
        page += f"\n\nload average (1 min) at the end: {os.getloadavg()[0]:.2f}"
        with open(args.preconditioned_cost, "w") as file:
            file.write(page + "\n")
        print(page)
        return rows
    if args.scaling:
        columns = scaling_columns(args, device)
        schedule = schedule_rows(args, device, args.every)
        env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        page = scaling_page(columns, schedule, env, args.every)
        with open(args.scaling, "w") as file:
            file.write(page)
        print(page)
        return columns
    table = []
    for model_name in args.models:
        spec = MODELS[model_name]
        table += benchmark_model(model_name, spec, args.methods, args, device, memory=args.memory)
        env["load_average_1min_at_end"] = round(os.getloadavg()[0], 2)
        if args.json:  # after every model: a long run stopped early keeps what it measured
            with open(args.json, "w") as file:
                json.dump({"environment": env, "rows": table}, file, indent=1)
    write_report(table, args)
    print(f"\nload average (1 min) at end: {env['load_average_1min_at_end']}")
    return table


def write_report(table, args):
    """Print the tables, and write them to ``--markdown`` if given."""
    report = report_markdown(table)
    print(report)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(report + "\n")
    return table


if __name__ == "__main__":
    main()
