"""What a tracked step costs on Hugging Face's T5, against a plain step.

A tiny ``T5ForConditionalGeneration`` (random weights; ``--width``, 2 layers per
stack, 2 heads, 8 relative position buckets), one encoder sequence of the batch
padded, SDPA attention:

- ``plain``: forward and backward of the model as built (no package);
- ``tracked``: the same model prepared by ``cgn.prepare_model``, a step with all
  five quantities (``cgn.configuration("all")``);
- the parts of the tracked step spent where the relative position bias meets the
  batch (the walk over the graph after the forward pass, and the per-example
  gradients at the meetings, ``extensions/meetings.py``) and in the ``torch.func``
  fallback (none in T5 since ``T5LayerNorm`` has a native rule), timed around
  those functions.

CPU time of one thread (``time.process_time``), the steps interleaved over rounds,
the fastest round of each (on a shared machine noise only adds time)::

    python -m benchmarks.benchmark_t5 [--batch-size 8] [--dtype float32] [--rounds 7]
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import batchless
from cockpit_gradnoise.extensions.fallback import running

import torch
from backpack import extend
from torch import nn

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.harness import cpu_timed  # noqa: E402
from benchmarks.methods import tracked_token_step  # noqa: E402
from tests import matrix_models  # noqa: E402


def _timed_parts(parts):
    """Wrap the functions whose time is reported as parts; ``parts[name]`` adds up seconds."""
    def wrap(owner, attribute, name):
        setattr(owner, attribute, cpu_timed(getattr(owner, attribute), parts, name))

    wrap(batchless, "find_broadcasts", "meetings")
    wrap(batchless.Broadcast, "keep", "meetings")
    wrap(running, "compute", "fallback")


def steps(args):
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = matrix_models.t5(args.vocabulary, args.decoder_length)
    model.model = type(model.model)(matrix_models.t5_config(args.vocabulary, width=args.width))
    model = model.eval().to(dtype)
    prepared = cgn.prepare_model(copy.deepcopy(model))
    batch = matrix_models.t5_batch(args.batch_size, args.vocabulary, args.length,
                                   args.decoder_length)
    targets = torch.randint(0, args.vocabulary, (args.batch_size, args.decoder_length))
    loss_fn = extend(nn.CrossEntropyLoss())
    params = [p for p in prepared.parameters() if p.requires_grad]
    cockpit = cgn.Cockpit(params, quantities=cgn.configuration("all", every=1, model=prepared))
    counter = iter(range(10**9))

    def plain():
        model.zero_grad()
        nn.functional.cross_entropy(model(batch).flatten(0, 1), targets.flatten()).backward()

    def tracked():
        tracked_token_step(prepared, cockpit, loss_fn, next(counter), batch, targets)

    return {"plain": plain, "tracked": tracked}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--decoder-length", type=int, default=12)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--vocabulary", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    parts = {"meetings": 0.0, "fallback": 0.0}
    _timed_parts(parts)
    named = steps(args)
    for step in named.values():  # warm up
        step()
    times = {name: [] for name in named}
    shares = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, step in named.items():
            for part in parts:
                parts[part] = 0.0
            start = time.process_time()
            step()
            times[name].append(time.process_time() - start)
            if name == "tracked":
                for part in parts:
                    shares[part].append(parts[part])
    plain, tracked = min(times["plain"]), min(times["tracked"])
    print(f"T5 width {args.width}, batch {args.batch_size}, encoder {args.length} and decoder "
          f"{args.decoder_length} positions, {args.dtype}, one thread, fastest of {args.rounds}:")
    print(f"  plain step    {1e3 * plain:8.2f} ms")
    print(f"  tracked step  {1e3 * tracked:8.2f} ms  ({tracked / plain:.2f}x the plain step)")
    for part, values in shares.items():
        print(f"    of which {part:9s} {1e3 * min(values):6.2f} ms (fastest round)")


if __name__ == "__main__":
    main()
