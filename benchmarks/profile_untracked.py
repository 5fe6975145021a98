"""What the tracker's Python costs on an untracked step, with caches cold (issue 21).

In a loop the tracker's call and its ``with`` take tens of microseconds; in a
training step they run after the layers' work has emptied the caches, and
cost several times that. Each piece here runs after a 16 MB copy (which
evicts the L2 caches and most of a shared L3), in a shuffled order, on the
MLP of the benchmark tracked every 10th step, at its untracked step 13::

    PYTHONPATH=. python -m benchmarks.profile_untracked --repeats 300

It prints, per piece, the minimum and the median in microseconds over the
repeats, less those of doing nothing after the copy. ``losses.mean()`` is
part of the call, and the plain step computes it too.
"""

import argparse
import os
import random
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

from benchmarks.models import make_mlp  # noqa: E402


def _with_block(tracker, step, losses, optimizer):
    """The tracker's call and its ``with`` around a backward pass that reached the loss."""
    block = tracker(step, losses, optimizer=optimizer)
    block.__enter__()
    block._arrived.append(None)  # as the loss's gradient hook does in a backward pass
    block.__exit__(None, None, None)


def pieces(tracker, optimizer, losses, step):
    return {
        "nothing": lambda: None,
        "losses.mean()": losses.mean,
        "tracker's schedule (_tracks)": lambda: tracker._tracks(step),
        "arming at the call": lambda: tracker.arming.at_call(step, optimizer, False),
        "tracker call": lambda: tracker(step, losses, optimizer=optimizer),
        "call and with": lambda: _with_block(tracker, step, losses, optimizer),
        "optimizer's step hook": tracker.arming.stepped,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tracker = cgn.track(make_mlp(), every=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="none")
    for step in range(13):  # a tracked step, UpdateSize's end, untracked steps
        optimizer.zero_grad()
        with tracker(step, loss_fn(model(x), y), optimizer=optimizer) as loss:
            loss.backward()
        optimizer.step()
    losses = loss_fn(model(x), y)
    source = torch.randn(4_000_000)
    target = torch.empty_like(source)
    timed = pieces(tracker, optimizer, losses, 13)
    times = {name: [] for name in timed}
    order = random.Random(0)
    for _ in range(args.repeats):
        names = list(timed)
        order.shuffle(names)
        for name in names:
            target.copy_(source)  # 16 MB read and written: the caches are cold
            start = time.perf_counter_ns()
            timed[name]()
            times[name].append((time.perf_counter_ns() - start) / 1e3)
    print(f"load average {os.getloadavg()[0]:.2f}, {args.repeats} repeats, microseconds less nothing's")
    low, mid = min(times["nothing"]), statistics.median(times["nothing"])
    for name, values in times.items():
        print(f"{name:30s} min {min(values) - low:7.1f}   median {statistics.median(values) - mid:7.1f}")


if __name__ == "__main__":
    main()
