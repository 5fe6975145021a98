"""Instructions the backward pass executes per tracked module, counted by valgrind (issue 32).

CPU time on a shared, loaded machine moves by a third from run to run (``benchmark_hook_work``'s
rounds); an instruction count does not. Each model and method runs in its own process under
``valgrind --tool=callgrind``, instrumented only after two warm-up steps, counting only inside
``loss.backward()`` (the layers' hooks run there), for ``--steps`` steps; a small C helper
(compiled with ``cc`` on first use, from valgrind's ``callgrind.h``) toggles the count. Reported:
``(tracked - plain) / steps / tracked modules``, in all and in CPython's own library
(``libpython``: the interpreter running the package's Python, from ``callgrind_annotate``); the
rest is torch's ops and their allocations. The same models as ``benchmark_op_count``, the paths
of other devices by default. Needs valgrind (with its headers) and a C compiler; under valgrind a
step runs ~50 times slower (GPT-2 tiny: ~1 minute of CPU per process). ::

    python -m benchmarks.callgrind_backward --models gpt2-tiny --steps 3
"""

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

_HELPER = """#include <valgrind/callgrind.h>
void cg_instr(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""
_METHOD = "PerExampleGradNorm+GradientNoiseScale"


def _helper(directory: Path) -> ctypes.CDLL:
    library = directory / "libcg.so"
    if not library.exists():
        source = directory / "cg.c"
        source.write_text(_HELPER)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


def child(name: str, method: str, steps: int, host_paths: bool, directory: Path) -> None:
    """Under valgrind: two warm-up steps, then ``steps`` steps counted inside ``loss.backward()``."""
    from cockpit_gradnoise import _device

    import torch

    from benchmarks.benchmark_op_count import MODELS
    from benchmarks.benchmark_realistic import METHODS
    from benchmarks.methods import plain_step

    helper = _helper(directory)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if not host_paths:
        _device.on_host = lambda tensor: False
    model, x, y, loss = MODELS[name]()
    step = plain_step(model, loss) if method == "plain" else METHODS[method](model, loss)
    for _ in range(2):
        step(x, y)
    original = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        helper.cg_toggle()
        try:
            return original(tensor, *args, **kwargs)
        finally:
            helper.cg_toggle()

    torch.Tensor.backward = backward
    helper.cg_instr()
    for _ in range(steps):
        step(x, y)
    helper.cg_dump()


def count(name: str, method: str, steps: int, host_paths: bool, directory: Path):
    """``(all instructions, CPython's)`` counted in a child process under callgrind."""
    out = directory / f"{name}.{method}.out".replace("+", "_")
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--child", name, method,
               str(steps), str(directory)] + (["--host-paths"] if host_paths else [])
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    dump = Path(f"{out}.1")
    total = int(re.search(r"^totals: (\d+)", dump.read_text(), re.M).group(1))
    annotated = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)],
                               capture_output=True, text=True, check=True).stdout
    python = sum(int(line.split()[0].replace(",", "")) for line in annotated.splitlines()
                 if "libpython" in line and re.match(r"\s*[\d,]+ \(", line))
    return total, python


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-tiny,resnet18")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--host-paths", action="store_true")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, method, steps, directory = args.child
        return child(name, method, int(steps), args.host_paths, Path(directory))
    import cockpit_gradnoise as cgn

    from benchmarks.benchmark_op_count import MODELS
    from benchmarks.benchmark_realistic import tracked_modules

    print(f"cockpit_gradnoise {Path(cgn.__file__).parent}, {'CPU' if args.host_paths else 'device'} "
          f"paths, {args.steps} steps counted inside loss.backward(), {_METHOD}")
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name in args.models.split(","):
            modules = tracked_modules(MODELS[name]()[0])
            plain = count(name, "plain", args.steps, args.host_paths, Path(directory))
            tracked = count(name, _METHOD, args.steps, args.host_paths, Path(directory))
            per_module = [(t - p) / args.steps / modules for t, p in zip(tracked, plain)]
            results[name] = {"instructions per module": per_module[0], "CPython's": per_module[1]}
            print(f"{name}: {modules} tracked modules; backward pass per step: plain {plain[0] / args.steps:,.0f} "
                  f"instructions, tracked {tracked[0] / args.steps:,.0f}; per tracked module "
                  f"{per_module[0]:,.0f} more, of which CPython's {per_module[1]:,.0f} "
                  f"({per_module[1] / per_module[0]:.0%})")
    return results


if __name__ == "__main__":
    main()
