"""What a tracked step costs at a size users train (issue 32): GPT-2 small and a Llama of its size.

Tiny configurations (``benchmark.py``'s models) measure the package's overhead per
module more than the cost users pay. Here, with random weights (nothing downloaded),
float32, sequence 256, batch 8:

- ``gpt2``: Hugging Face's ``GPT2LMHeadModel`` from the default ``GPT2Config``
  (12 layers, width 768, 12 heads, vocabulary 50257, tied head: 124M parameters);
- ``llama``: ``LlamaForCausalLM`` from a ``LlamaConfig`` of similar size (12
  layers, width 768, MLP 2048, 12 heads, vocabulary 32000, untied head: 134M);

each step (forward, per-token cross-entropy, backward) timed as a plain step, with
all five quantities (``benchmarks.methods.package_all``) and with
PerExampleGradNorm + GradientNoiseScale alone (one BackPACK extension, the
per-example squared norms). Both also through the front door (``two-track``,
``five-track``: ``cgn.track``, each example's loss computed once; the explicit API's steps
compute the cross-entropy twice, as the README's explicit loop does). Then the same
architectures at a tiny size (2 layers, width 32, vocabulary 128, sequence 16, batch 2), where compute is negligible:
``(tracked - plain) / tracked modules``, the overhead per module in microseconds
(what dominates a tracked step on a GPU). Targets (issue 32): all five <= 2x,
PerExampleGradNorm + GradientNoiseScale <= 1.15x.

CPU time of the process (``time.process_time``; meant with one thread), the
methods interleaved in each round in a shuffled order, the fastest round of each
reported (on a shared machine noise only adds time) and the median. A GPT-2 small
step takes about 26 s of one thread here: ``--quick`` runs the realistic models at
2 layers, sequence 64, batch 2, one round (a smoke test, not a measurement).

``--device cuda``: the models and batches on the GPU, and each step's wall-clock time
(``time.perf_counter`` after ``torch.cuda.synchronize``, before and after the step, so
the host's Python and the device's kernels both count, as a training loop waits for
them), the same interleaved rounds after the warm-up steps; then each method's peak
CUDA memory over two steps above a clean start (``harness.peak_extra_bytes``); the
tiny size's per-module overhead in wall-clock microseconds on the GPU. ::

    python -m benchmarks.benchmark_realistic --rounds 3
    python -m benchmarks.benchmark_realistic --quick
    python -m benchmarks.benchmark_realistic --size small --rounds 5   # 2 layers, sequence 128, batch 4
    python -m benchmarks.benchmark_realistic --models gpt2 --methods two --rounds 3   # one tracked copy
    python -m benchmarks.benchmark_realistic --methods two,two-track --rounds 3   # explicit API and front door
    python -m benchmarks.benchmark_realistic --device cuda --rounds 10 --warmup 2 --json runs/gpu.json
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn

import torch

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.harness import peak_extra_bytes, synchronize, times_in_shuffled_rounds  # noqa: E402
from benchmarks.methods import cockpit_step, front_door_step, package_all, plain_step  # noqa: E402
from benchmarks.models import token_loss  # noqa: E402

METHODS = {
    "all five": package_all,
    "PerExampleGradNorm+GradientNoiseScale": lambda model, loss: cockpit_step(
        model, loss, lambda names, schedule: [cgn.PerExampleGradNorm(schedule, param_names=names),
                                              cgn.GradientNoiseScale(schedule, param_names=names)]),
    # The same through the front door: each example's loss computed once (the explicit API's
    # step above computes the cross-entropy twice, as the README's explicit loop does).
    "all five, cgn.track": lambda model, loss: front_door_step(model, loss, "all"),
    "PerExampleGradNorm+GradientNoiseScale, cgn.track": lambda model, loss: front_door_step(
        model, loss, ["PerExampleGradNorm", "GradientNoiseScale"]),
}
TARGETS = {"all five": 2.0, "PerExampleGradNorm+GradientNoiseScale": 1.15,
           "all five, cgn.track": 2.0, "PerExampleGradNorm+GradientNoiseScale, cgn.track": 1.15}
#: ``--methods``' short names.
SHORT = {"five": "all five", "two": "PerExampleGradNorm+GradientNoiseScale",
         "five-track": "all five, cgn.track",
         "two-track": "PerExampleGradNorm+GradientNoiseScale, cgn.track"}


def make_gpt2(layers=12, width=768, heads=12, vocabulary=50257, context=1024):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocabulary,
                        n_positions=context)
    return LanguageModel(GPT2LMHeadModel(config).eval())  # eval: no dropout, as benchmark.py's models


def make_llama(layers=12, width=768, heads=12, vocabulary=32000, context=1024, mlp=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                         num_key_value_heads=heads, intermediate_size=mlp, vocab_size=vocabulary,
                         max_position_embeddings=context, tie_word_embeddings=False)
    return LanguageModel(LlamaForCausalLM(config).eval())


class LanguageModel(torch.nn.Module):
    """The logits of a Hugging Face causal language model, from the token ids alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


MODELS = {"gpt2": make_gpt2, "llama": make_llama}
#: (model options, sequence, batch): the realistic size, --quick's, and the tiny one.
SIZES = {
    "realistic": ({}, 256, 8),
    "quick": ({"layers": 2}, 64, 2),
    "small": ({"layers": 2}, 128, 4),  # --size small: the vocabulary's work at a fifth of the step
    "tiny": ({"layers": 2, "width": 32, "heads": 2, "vocabulary": 128, "mlp": 64}, 16, 2),
}


def tracked_modules(model) -> int:
    """Modules that hold a trainable parameter themselves (what the package tracks by module)."""
    return sum(1 for module in model.modules()
               if any(p.requires_grad for p in module.parameters(recurse=False)))


def clock(device):
    """The timer of ``device``: CPU time of the process on a CPU; on a GPU, wall-clock
    seconds read once the device has finished what was queued (the step's kernels count)."""
    if device.type != "cuda":
        return time.process_time

    def wall_clock_after_the_device():
        synchronize(device)
        return time.perf_counter()

    return wall_clock_after_the_device


def measure(name, size, rounds, seed=0, warmup=1, device=torch.device("cpu"), memory=False, methods=None):
    """``{method: [seconds per round]}`` (``"plain"`` too), the number of tracked modules, and
    ``{method: peak extra bytes}`` (empty unless ``memory``).

    Seconds of CPU time on a CPU, of wall-clock time on a GPU (:func:`clock`). ``methods``: the
    names of :data:`METHODS` to time beside the plain step (default all).
    """
    options, sequence, batch = SIZES[size]
    if name == "gpt2":
        options = {k: v for k, v in options.items() if k != "mlp"}
    torch.manual_seed(seed)
    model = MODELS[name](**options).to(device)
    vocabulary = model.model.config.vocab_size
    x = torch.randint(0, vocabulary, (batch, sequence), device=device)
    y = torch.randint(0, vocabulary, (batch, sequence), device=device)
    steps = {"plain": plain_step(model, token_loss)}
    steps.update({method: build(model, token_loss) for method, build in METHODS.items()
                  if methods is None or method in methods})
    for _ in range(warmup):  # untimed: first-call costs (BackPACK's checks, the fallback's plans)
        for step in steps.values():
            step(x, y)

    def report(method, seconds):
        if size != "tiny":  # a long run stopped early keeps what it measured
            print(f"  {name} {method}: {seconds:.3f} s", flush=True)

    times = times_in_shuffled_rounds(steps, x, y, rounds, random.Random(seed), report, clock(device))
    peaks = {method: peak_extra_bytes(step, x, y, device) for method, step in steps.items()} if memory else {}
    return times, tracked_modules(model), peaks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--rounds", type=int, default=3, help="rounds at the realistic size")
    parser.add_argument("--tiny-rounds", type=int, default=30, help="rounds at the tiny size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each method first")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (CPU time) or cuda (wall-clock, synchronized)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                        help="peak memory of each method's step (default: on cuda only)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also save the results here")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, sequence 64, batch 2, one round: a smoke test")
    parser.add_argument("--methods", default="five,two",
                        help="five (all five), two (PerExampleGradNorm+GradientNoiseScale), or both: one "
                             "at a time holds one tracked copy of the model (GPT-2 small: about 10 GB for both)")
    parser.add_argument("--size", default="realistic", choices=["realistic", "small"],
                        help="small: 2 layers, sequence 128, batch 4 (the full vocabulary), to iterate fast")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    memory = device.type == "cuda" if args.memory is None else args.memory
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    size, rounds = ("quick", 1) if args.quick else (args.size, args.rounds)
    tiny_rounds = 3 if args.quick else args.tiny_rounds
    options, sequence, batch = SIZES[size]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {timer_name(device)}, {size}: "
          f"{options or 'full size'}, sequence {sequence}, batch {batch}, {rounds} round(s); "
          f"load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    if args.quick:
        print("QUICK MODE: a smoke test, not a measurement")
    results = {"environment": environment(device, size, rounds, tiny_rounds, args)}
    for name in args.models.split(","):
        methods = [SHORT[short] for short in args.methods.split(",")]
        times, _, peaks = measure(name, size, rounds, warmup=args.warmup, device=device, memory=memory,
                                  methods=methods)
        tiny, modules, _ = measure(name, "tiny", tiny_rounds, device=device, methods=methods)
        results[name] = report(name, times, tiny, modules, peaks)
        if args.json:  # after every model: a run stopped early keeps what it measured
            with open(args.json, "w") as file:
                json.dump(results, file, indent=1)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return results


def timer_name(device):
    return "wall-clock synchronized" if device.type == "cuda" else "CPU time"


def environment(device, size, rounds, tiny_rounds, args):
    """What the figures were measured on."""
    found = {"torch": torch.__version__, "device": str(device), "timer": timer_name(device),
             "threads": torch.get_num_threads(), "size": size, "rounds": rounds,
             "tiny_rounds": tiny_rounds, "warmup": args.warmup}
    if device.type == "cuda":
        found["device"] += f" ({torch.cuda.get_device_name(device)})"
        found["tf32 matmul"] = torch.backends.cuda.matmul.allow_tf32  # float32 is float32 unless asked
    return found


def report(name, times, tiny, modules, peaks=None):
    """Print and return one model's ratios, per-module overhead and peak memory (where measured)."""
    peaks = peaks or {}
    best, middle = min(times["plain"]), statistics.median(times["plain"])
    print(f"\n{name}: plain step {best:.3f} s (fastest), {middle:.3f} s (median)")
    result = {"plain s": best, "plain median s": middle}
    if "plain" in peaks:
        print(f"  plain: peak extra memory {peaks['plain'] / 2**20:.0f} MiB")
        result["plain peak MiB"] = peaks["plain"] / 2**20
    tiny_plain = statistics.median(tiny["plain"])
    for method in (method for method in METHODS if method in times):
        ratio = min(times[method]) / best
        per_module = (statistics.median(tiny[method]) - tiny_plain) / modules * 1e6
        verdict = "met" if ratio <= TARGETS[method] else "MISSED"
        print(f"  {method}: {ratio:.2f}x (fastest rounds; medians {statistics.median(times[method]) / middle:.2f}x)"
              f", target <= {TARGETS[method]}x {verdict}; tiny config: {per_module:.0f} us per tracked "
              f"module ({modules} modules, plain {tiny_plain * 1e3:.1f} ms)")
        result[method] = {"ratio": ratio, "median ratio": statistics.median(times[method]) / middle,
                          "per module us": per_module, "seconds": times[method]}
        if method in peaks:
            print(f"    peak extra memory {peaks[method] / 2**20:.0f} MiB "
                  f"({peaks[method] / peaks['plain']:.2f}x the plain step's)")
            result[method]["peak MiB"] = peaks[method] / 2**20
    result["plain seconds"] = times["plain"]
    result["tiny plain ms"], result["tracked modules"] = tiny_plain * 1e3, modules
    return result


if __name__ == "__main__":
    main()
