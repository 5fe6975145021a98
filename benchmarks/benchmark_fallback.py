"""What the torch.func fallback costs per module, against native rules and against the bound.

The bound (issue 19): the fallback must not cost more than recomputing that
module's forward and backward once more. Per module, at the benchmark's GPT
size (batch 32, 64 positions, width 128) unless said otherwise, this times
in CPU time of one thread (``time.process_time``, the fastest of
``--repeats`` interleaved rounds: on a shared machine noise only adds time):

- ``plain``: the extended module's forward and backward (input and
  parameter gradients) without extensions: the bound;
- ``rows``: the same with the package's three extensions
  (``PerExampleSquaredNorms``, ``SumsOfContributions``, ``LocalGradient``),
  by the module's native rule or by the fallback;
- ``added / plain``: what the rows add, in units of the bound;
- ``fallback ms``: of ``rows``, the time spent in the fallback itself
  (:func:`cockpit_gradnoise.extensions.fallback.running.run`, called by each
  extension on each module, and the computations it leaves to the end of the
  backward pass, all modules that have it), and ``fallback / plain``: that
  time in units of the bound. For
  the ViT, whose top module holds ``cls_token`` and ``pos_embed``, the bound
  is the whole network's forward and backward, and the fallback's time is
  that of its six modules together (the top module, four timm LayerNorms
  and two layer scales per block).

Run: ``PYTHONPATH=. python benchmarks/benchmark_fallback.py [--repeats 15]``.
"""

import argparse
import os
import time

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import (
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
    fallback,
)
from cockpit_gradnoise.extensions.fallback import running

import torch
from backpack import backpack
from torch import nn
from torch.nn import functional as F

N, T, WIDTH = 32, 64, 128


class NanoLayerNorm(nn.Module):
    """nanoGPT's ``LayerNorm``: weight and optional bias used directly in ``F.layer_norm``."""

    def __init__(self, ndim, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class LayerScale(nn.Module):
    """timm's ``LayerScale``: ``x * gamma``."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        return x * self.gamma


def _hf_modules():
    """HF ``Conv1D`` and ``LlamaRMSNorm`` (native rules), and subclasses of them
    under other names, which no rule matches: the fallback."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.pytorch_utils import Conv1D

    class Conv1DByFallback(Conv1D):
        pass

    class RMSNormByFallback(LlamaRMSNorm):
        pass

    return {
        "HF Conv1D (native)": Conv1D(3 * WIDTH, WIDTH),
        "HF Conv1D (fallback)": Conv1DByFallback(3 * WIDTH, WIDTH),
        "HF LlamaRMSNorm (native)": LlamaRMSNorm(WIDTH),
        "HF LlamaRMSNorm (fallback)": RMSNormByFallback(WIDTH),
    }


def _by_vmap(module):
    """``module`` prepared, its look-alike closed form switched off: the vmap computes."""
    module = cgn.prepare_model(module)
    getattr(module, fallback.ATTRIBUTE).closed_form = None
    return module


def cases():
    """``{label: (module, input)}``."""
    sequence = torch.randn(N, T, WIDTH, requires_grad=True)
    found = {
        "nn.LayerNorm (native)": nn.LayerNorm(WIDTH),
        "nanoGPT LayerNorm (look-alike: closed form)": NanoLayerNorm(WIDTH),
        "nanoGPT LayerNorm (vmap)": _by_vmap(NanoLayerNorm(WIDTH)),
        "layer-scale gamma (look-alike: closed form)": LayerScale(WIDTH),
        "layer-scale gamma (vmap)": _by_vmap(LayerScale(WIDTH)),
        **_hf_modules(),
    }
    result = {label: (module, sequence) for label, module in found.items()}
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10)
    result["timm vit_tiny, img 32 (whole network: cls_token, pos_embed)"] = (
        vit.eval(), torch.randn(N, 3, 32, 32))
    return result


def _step(module, inputs, grad, extensions):
    module.zero_grad(set_to_none=True)
    output = module(inputs)
    if extensions:
        with backpack(*extensions):
            output.backward(grad)
    else:
        output.backward(grad)


class _FallbackClock:
    """Adds up the CPU time spent in the fallback's backward-pass entry points while
    installed: ``running.run`` and ``running._compute_after_backward`` (neither calls
    the other)."""

    ENTRY_POINTS = ("run", "_compute_after_backward")

    def __init__(self):
        self.seconds = 0.0
        self._originals = {name: getattr(running, name) for name in self.ENTRY_POINTS}

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        return timed

    def __enter__(self):
        for name, function in self._originals.items():
            setattr(running, name, self._timed(function))
        return self

    def __exit__(self, *exc):
        for name, function in self._originals.items():
            setattr(running, name, function)


def measure(module, inputs, repeats):
    """``(plain, rows, fallback)``: fastest CPU times of a step without and with the
    extensions, and of the fallback's part of the latter."""
    module = cgn.prepare_model(module)
    grad = torch.randn_like(module(inputs))
    extensions = (PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient())
    times = {"plain": [], "rows": [], "fallback": []}
    for _ in range(repeats + 1):  # the first round warms up
        for key, exts in (("plain", ()), ("rows", extensions)):
            if inputs.grad is not None:
                inputs.grad = None
            with _FallbackClock() as clock:
                start = time.process_time()
                _step(module, inputs, grad, exts)
                times[key].append(time.process_time() - start)
            if exts:
                times["fallback"].append(clock.seconds)
    return tuple(min(times[key][1:]) for key in ("plain", "rows", "fallback"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="the rows whose label contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, one thread, CPU clock, fastest of {args.repeats} rounds, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"| module (batch {N}) | plain ms | with rows ms | added / plain | fallback ms "
          "| fallback / plain |")
    print("|---|---|---|---|---|---|")
    for label, (module, inputs) in cases().items():
        if args.only not in label:
            continue
        plain, rows, by_fallback = measure(module, inputs, args.repeats)
        print(f"| {label} | {1e3 * plain:.2f} | {1e3 * rows:.2f} | {(rows - plain) / plain:.2f} "
              f"| {1e3 * by_fallback:.2f} | {by_fallback / plain:.2f} |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
