"""How far rounding noise and genuine gradients lie from the structural-zero threshold.

The test of :func:`cockpit_gradnoise.extensions.sums.structural_zeros` takes
a contribution ``x_i = sum_l t_il`` (a bias's output gradients summed over
``L`` positions) for rounding noise where
``|x_i| <= (L + TERM_ROUNDING) eps A_i``, ``A_i = sum_l |t_il|``. On
nanoGPT-style models (``tests.models.NanoGPT``, random weights, bias in
every layer), per fused ``c_attn`` bias, this prints in units of ``eps A_i``:

- the key third (exactly zero gradient): quantiles and maximum over all
  contributions, and the fraction above the old allowance ``L`` and above
  the threshold (those escape the test);
- the query and value thirds: the floor, the smallest over elements of the
  largest contribution over examples (an element is taken for noise only if
  every contribution is below the threshold), and its ratio to the threshold.

::

    python -m benchmarks.structural_zero_margins
"""

import sys
from pathlib import Path

from cockpit_gradnoise.extensions.sums import TERM_ROUNDING

import numpy
import torch
import torch.nn.functional as F

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from tests.models import NanoGPT  # noqa: E402


def ratios(length, examples, dtype, seed, width, heads, vocabulary=50):
    """``|x_i| / (eps A_i)`` of the key contributions (flat) and the query/value floor."""
    torch.manual_seed(seed)
    model = NanoGPT(vocabulary, length, width, heads, layers=2, bias=True).to(dtype)
    grads = []
    for name, module in model.named_modules():
        if name.endswith("c_attn"):
            module.register_full_backward_hook(lambda m, gi, go: grads.append(go[0].detach()))
    idx = torch.randint(0, vocabulary, (examples, length))
    targets = torch.randint(0, vocabulary, (examples, length))
    F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
    eps = torch.finfo(dtype).eps
    keys, floors = [], []
    for g in grads:  # [N, L, 3 width]
        r = g.sum(1).abs() / (eps * g.abs().sum(1))
        keys.append(r[:, width : 2 * width].flatten())
        others = torch.cat([r[:, :width], r[:, 2 * width :]], 1)
        floors.append(others.max(0).values.min())
    return torch.cat(keys).numpy(), min(floors).item()


def report(dtype, length, examples, seeds, width, heads):
    results = [ratios(length, examples, dtype, s, width, heads) for s in range(seeds)]
    keys = numpy.concatenate([k for k, _ in results])
    floor = min(f for _, f in results)
    threshold = length + TERM_ROUNDING
    print(
        f"{str(dtype):14} L={length:5} width={width:3}: key n={keys.size:6} "
        f"q0.999 {numpy.quantile(keys, 0.999):8.3g} max {keys.max():8.3g} "
        f"above L {(keys > length).mean():7.2%} above threshold {(keys > threshold).mean():7.2%} | "
        f"query/value floor {floor:9.3g} = {floor / threshold:9.3g} x threshold",
        flush=True,
    )


def main():
    torch.set_num_threads(1)
    for dtype in (torch.float64, torch.float32):
        for length in (2, 3, 4, 8):  # the tiny models of the tests: many contributions
            report(dtype, length, 64, 20, width=8, heads=2)
        for length, examples in ((4, 16), (64, 8), (256, 4), (1024, 2)):
            report(dtype, length, examples, 3, width=32, heads=4)


if __name__ == "__main__":
    main()
