"""An Embedding's per-example work with both extensions: the first-use contributions formed once or twice.

Where GradientVarianceQuantiles runs beside PerExampleGradNorm or GradientNoiseScale, the
sums' and the norms' extensions both need :func:`~cockpit_gradnoise.extensions.embedding.first_use_contributions`
of each ``nn.Embedding`` (a stable sort of ``N P`` keys, an ``index_add_`` and a gather of
``N P d`` numbers); it is formed once and taken from the backward pass's layer cache by the
second. Timed here: one backward pass of a lone Embedding (GPT-2's token table by default,
``50257 x 768``, sequence 256, batch 8) with both extensions, formed once (the package) and
twice (the cache switched off, as before), alternated over rounds in one process, CPU time
of one thread (``time.process_time``), the fastest and the median round of each::

    PYTHONPATH=. python benchmarks/benchmark_embedding_rows.py [--rounds 15]
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from backpack import backpack, extend
from torch import nn

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from cockpit_gradnoise.extensions import (  # noqa: E402
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    embedding,
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = extend(nn.Embedding(args.rows, args.width))
    idx = torch.randint(0, args.rows, (args.batch_size, args.sequence))
    weights = torch.randn(args.batch_size, args.sequence, args.width)
    warnings.filterwarnings("ignore", "Full backward hook is firing")  # no input requires grad: as meant

    def backward() -> float:
        module.zero_grad()
        loss = (module(idx) * weights).sum()
        start = time.process_time()
        with backpack(SumsOfContributions(), PerExampleSquaredNorms()):
            loss.backward()
        elapsed = time.process_time() - start
        for name in (SUMS_SAVEFIELD, BATCH_L2_SAVEFIELD):
            module.weight.__dict__.pop(name, None)
        return elapsed

    shared = embedding.is_active
    times = {"formed once": [], "formed twice": []}
    for round_ in range(args.rounds + 1):  # the first round warms up, untimed
        for label in times:
            embedding.is_active = shared if label == "formed once" else (lambda savefield: False)
            elapsed = backward()
            if round_:
                times[label].append(elapsed)
    embedding.is_active = shared
    print(f"Embedding {args.rows} x {args.width}, sequence {args.sequence}, batch {args.batch_size}; "
          f"backward pass with the sums and the norms, CPU time of one thread, {args.rounds} rounds:")
    for label, values in times.items():
        print(f"  {label}: fastest {min(values) * 1e3:.1f} ms, median {statistics.median(values) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
