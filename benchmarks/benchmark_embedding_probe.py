"""What deciding that an ``nn.Embedding`` subclass is a scaled lookup costs, once per module.

``extensions/scaled_embedding.py`` runs the module's ``forward`` with other weights at every
row of its table (chunks of a million outputs, float64) before giving it the ``Embedding``
rule: a forward that writes a parameter into the rows of one token (T5Gemma2's
``eoi_embedding``) is a scaled lookup at every other row. This times that decision
(``is_scaled_embedding`` on a fresh module, CPU time of one thread, ``time.process_time``) for
a scaled embedding of Llama-2's and of Gemma's table size; the module's own weight is an
expanded row (no memory), which the probe never reads. Reports the fastest and the median of
``--rounds`` rounds. It is paid once per module, at its first tracked step.

Run: ``PYTHONPATH=. python benchmarks/benchmark_embedding_probe.py [--rounds 3]``.
"""

import argparse
import statistics
import time

from cockpit_gradnoise.extensions import scaled_embedding

import torch
from torch import nn

SIZES = ((32000, 4096), (256000, 2048))


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the lookup times a constant."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


def seconds(rows: int, width: int) -> float:
    """CPU seconds of one decision on a fresh module of ``rows x width``."""
    module = ScaledEmbedding(rows, width, _weight=torch.zeros(1, width).expand(rows, width))
    start = time.process_time()
    assert scaled_embedding.is_scaled_embedding(module)
    return time.process_time() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for rows, width in SIZES:
        times = [seconds(rows, width) for _ in range(args.rounds)]
        print(f"{rows} x {width}: fastest {min(times):.2f} s, median {statistics.median(times):.2f} s "
              f"of CPU ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
