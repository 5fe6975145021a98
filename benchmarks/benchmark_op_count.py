"""How many aten ops a tracked step dispatches (issue 32): a device-independent cost.

On a GPU every small op is a kernel launch of roughly 10-40 us, whatever its size,
so a tracked step on a small or medium model is bound by the number of ops the
package dispatches, not by their arithmetic (an H200 ran 3201 launches for 3.9 ms
of work in one step of the tiny GPT-2 below). On a CPU small ops are cheap, which
is why CPU timings miss this; counting the ops measures it on any machine.

Each step (zero_grad, forward, loss, backward, the quantities' computation) runs
under a ``TorchDispatchMode`` that counts every aten op by name, and attributes it
to the innermost Python frame in the package (``cockpit_gradnoise/...:function``),
else in BackPACK or Cockpit, else to the model and torch (``model/torch``). Reported:
the plain step's count, each tracked step's count, the extra ops per tracked module,
the top ops and the package functions that issue them.

By default the paths of other devices run on the CPU (``_device.on_host`` set to
``lambda tensor: False``, as tests/test_device_sync.py does): those are the paths a
GPU takes. ``--host-paths`` counts the CPU paths instead. ::

    python -m benchmarks.benchmark_op_count
    python -m benchmarks.benchmark_op_count --models gpt2-tiny --top 25
    python -m benchmarks.benchmark_op_count --per-op   # and each layer class's ops per layer

``--per-op`` attributes each launching op of the backward pass to the layer whose backward
hook runs it (the innermost ``extensions/hooks.py:_dispatch`` frame's ``module``) and lists,
per layer class, the launches per layer by op name.
"""

import argparse
import collections
import sys
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.benchmark_realistic import METHODS, SIZES, make_gpt2, tracked_modules  # noqa: E402
from benchmarks.methods import plain_step  # noqa: E402
from benchmarks.models import classification_loss, make_resnet18, token_loss  # noqa: E402

#: Places a frame's file may belong to, innermost match wins, in this order of preference.
_PLACES = (("cockpit_gradnoise", "cockpit_gradnoise/"), ("backpack", "backpack/"), ("cockpit", "cockpit/"))


def _where(frame) -> str:
    """The innermost frame of the package (else BackPACK, else Cockpit) as ``path:function``."""
    found = {}
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        for label, marker in _PLACES:
            if label not in found and marker in path and "benchmarks/" not in path:
                found[label] = f"{path[path.rindex(marker):]}:{frame.f_code.co_name}"
        if "cockpit_gradnoise" in found:
            break
        frame = frame.f_back
    for label, _ in _PLACES:
        if label in found:
            return found[label]
    return "model/torch"


#: Ops that launch no kernel on a GPU (allocation, dtype arithmetic) besides views.
_NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "promote_types", "result_type",
              "lift_fresh", "detach", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: by op, and by (place, op); and ``launches``,
    those that are neither views nor in :data:`_NO_KERNEL` (each a kernel on a GPU); both
    also for the backward pass alone (``backward_ops``, ``backward_launches``: while
    autograd's engine runs, where the package's hooks do the per-module work)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.places = collections.Counter()
        self.launches = 0
        self.host_reads = 0  # .item(), float(t), bool(t): a sync on a GPU
        self.backward_ops = 0  # dispatched while autograd's engine runs: the backward pass and its hooks
        self.backward_launches = 0
        self.backward_places = collections.Counter()  # (place, op) of the launching ops in the backward pass
        # Launching ops of the backward pass by the layer whose hook runs them: (layer class, op), and
        # the layers of each class seen (``--per-op``).
        self.by_layer = collections.Counter()
        self.layers = collections.defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        launches = not (func.is_view or name in _NO_KERNEL)
        place = _where(sys._getframe(1))
        self.ops[name] += 1
        self.launches += launches
        self.host_reads += name == "_local_scalar_dense"
        self.places[(place, name)] += 1
        if torch._C._current_graph_task_id() != -1:  # inside loss.backward(): the layers' hooks run here
            self.backward_ops += 1
            self.backward_launches += launches
            self.backward_places[(place, name)] += launches
            if launches:
                layer = _layer_dispatched(sys._getframe(1))
                if layer is not None:
                    self.by_layer[(type(layer).__name__, name)] += 1
                    self.layers[type(layer).__name__].add(id(layer))
        return func(*args, **(kwargs or {}))


def _layer_dispatched(frame):
    """The module whose backward hook (``extensions/hooks.py:_dispatch``) is on the stack, else None."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_dispatch" and code.co_filename.endswith("hooks.py"):
            return frame.f_locals.get("module")
        frame = frame.f_back
    return None


def _print_per_layer(counter):
    """Launching ops per layer of each class in the backward pass, by op name (``--per-op``)."""
    print("    per layer, launching ops of the backward pass (ops per layer of the class):")
    for kind, layers in sorted(counter.layers.items()):
        ops = {op: n for (k, op), n in counter.by_layer.items() if k == kind}
        total = sum(ops.values()) / len(layers)
        listed = ", ".join(f"{op} {n / len(layers):g}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))
        print(f"      {kind} ({len(layers)} layers): {total:g} per layer: {listed}")


def count(step, x, y):
    """The :class:`OpCounter` of one call of ``step(x, y)``."""
    with OpCounter() as counter:
        step(x, y)
    return counter


def gpt2_tiny():
    options, sequence, batch = SIZES["tiny"]
    options = {k: v for k, v in options.items() if k != "mlp"}
    torch.manual_seed(0)
    model = make_gpt2(**options)
    vocabulary = model.model.config.vocab_size
    return (model, torch.randint(0, vocabulary, (batch, sequence)),
            torch.randint(0, vocabulary, (batch, sequence)), token_loss)


def resnet18_small(batch=4):
    torch.manual_seed(0)
    return (make_resnet18(), torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)),
            classification_loss)


MODELS = {"gpt2-tiny": gpt2_tiny, "resnet18": resnet18_small}


def _print_by_function(places, top):
    """The ``top`` functions of ``{(place, op): count}`` with their most frequent ops."""
    by_place = collections.Counter()
    for (place, _), n in places.items():
        by_place[place] += n
    for place, n in by_place.most_common(top):
        if place == "model/torch":
            print(f"      {n:6d}  {place}")
            continue
        ops = collections.Counter({op: m for (p, op), m in places.items() if p == place and m})
        print(f"      {n:6d}  {place}  (" + ", ".join(f"{op} {m}" for op, m in ops.most_common(6)) + ")")


def measure(name, top, per_op=False):
    """Print and return the plain and tracked counts of model ``name``."""
    model, x, y, loss = MODELS[name]()
    modules = tracked_modules(model)
    steps = {"plain": plain_step(model, loss)}
    steps.update({method: build(model, loss) for method, build in METHODS.items()})
    for step in steps.values():  # warm-up: first-call work (plans, checks) is not per step
        step(x, y)
    counters = {method: count(step, x, y) for method, step in steps.items()}
    plain = sum(counters["plain"].ops.values())
    plain_launches = counters["plain"].launches
    plain_backward = counters["plain"].backward_launches
    print(f"\n{name}: {modules} tracked modules; plain step {plain} aten ops, {plain_launches} launching, "
          f"{plain_backward} of them in the backward pass")
    result = {"tracked modules": modules, "plain": plain, "plain launching": plain_launches,
              "plain backward launching": plain_backward}
    for method in METHODS:
        counter = counters[method]
        total = sum(counter.ops.values())
        extra = total - plain
        launches = counter.launches - plain_launches
        print(f"  {method}: {total} ops, {extra} more than plain, {extra / modules:.0f} per tracked module; "
              f"launching (not views): {counter.launches}, {launches} more, {launches / modules:.0f} per "
              f"tracked module; host reads (.item()) {counter.host_reads}")
        backward = counter.backward_launches - plain_backward
        print(f"    in the backward pass (the hooks): {counter.backward_ops} ops, launching "
              f"{counter.backward_launches}, {backward} more than plain, {backward / modules:.0f} per tracked "
              f"module; after it (the quantities): {launches - backward} more launching")
        print("    top ops (tracked minus plain): " + ", ".join(
            f"{op} {n - counters['plain'].ops[op]}"
            for op, n in (counter.ops - counters["plain"].ops).most_common(top)))
        print("    by function:")
        _print_by_function(counter.places, top)
        print("    by function, launching ops of the backward pass:")
        _print_by_function(counter.backward_places, top)
        if per_op:
            _print_per_layer(counter)
        result[method] = {"total": total, "per module": extra / modules, "launching": counter.launches,
                          "launching per module": launches / modules, "host reads": counter.host_reads,
                          "backward launching": counter.backward_launches,
                          "backward launching per module": backward / modules}
    return result


def add_path_options(parser):
    """``--models`` (of :data:`MODELS`) and ``--host-paths``."""
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--host-paths", action="store_true",
                        help="the CPU paths (default: the paths other devices take, run on the CPU)")


def take_paths(args):
    """One thread, and the paths ``args.host_paths`` chooses (:func:`add_path_options`)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    if not args.host_paths:
        _device.on_host = lambda tensor: False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_path_options(parser)
    parser.add_argument("--top", type=int, default=15, help="ops and functions listed")
    parser.add_argument("--per-op", action="store_true",
                        help="also list each layer class's launching ops in the backward pass, per layer")
    args = parser.parse_args(argv)
    take_paths(args)
    print(f"torch {torch.__version__}, cockpit_gradnoise {getattr(cgn, '__version__', '?')}, "
          f"{'CPU' if args.host_paths else 'device'} paths")
    return {name: measure(name, args.top, args.per_op) for name in args.models.split(",")}


if __name__ == "__main__":
    main()
