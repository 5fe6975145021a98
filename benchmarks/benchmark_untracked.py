"""What tracking costs on the steps it does not track, and over a whole run (issue 21).

For each model, three copies with the same weights train side by side in one
process, each with ``torch.optim.SGD`` (``lr=0``: every step sees the same
numbers):

- **plain**: the model as written, not prepared;
- **run**: ``cgn.track(model, every=10)`` (the front door's default: all five
  quantities, every 10th step), stepped 0, 1, 2, ...;
- **before**: the model prepared (``cgn.prepare_model``) inside the explicit
  API's ``with cockpit(step, info=...)``, whose hooks record every forward pass
  (what every untracked step cost before the hooks could idle); timed at the
  run's untracked steps only.

A step is ``zero_grad``, forward, the per-example losses, backward (inside
the tracker's ``with`` where there is one) and ``optimizer.step()``; the plain
step differentiates ``losses.mean()`` as the tracker does. Each round is ten
consecutive steps of the run; at each, the plain copy and the run (and at
untracked steps "before" and a second plain copy, **A/A**) take that step once
each, in an order drawn afresh (seeded), so that drifts of the machine hit all
alike and no copy profits from caches another left warm: timed in a fixed
order with the plain copy stepping twice in a row (once for the run, once for
"before"), an A/A pair in the run's place read 1.04 on the MLP.

- **untracked / plain**: at steps where no quantity computes (10r+2 ... 10r+9:
  10r+1 is UpdateSize's end step), the median over all such pairs of the run's
  step over its plain step; the same for "before" and the A/A copy (the noise
  floor: a plain copy of its own, with weights elsewhere in memory);
- **whole run / plain**: per round, the ten run steps' total over the ten plain
  steps' total; the median over rounds;
- **tracked step / plain**: at the tracked steps 10r (all five quantities), the
  median of the run's step over its plain step.

Clock: on CPU, the process's CPU time (``time.process_time``, ``--clock cpu``,
the default: on a shared machine a descheduled step waits without counting),
meant with ``--threads 1``; ``--clock wall`` for ``time.perf_counter``; on
CUDA each step is synchronized and timed on the wall clock. ::

    python -m benchmarks.benchmark_untracked --rounds 15 --threads 1
    python -m benchmarks.benchmark_untracked --models mlp,nanogpt --rounds 5
"""

import argparse
import copy
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

from benchmarks.models import GPT_CONTEXT, MODELS, ModelSpec, classes, images, model_and_batch  # noqa: E402

EVERY = 10


def make_torchvision(name):
    def make():
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10)

    return make


def make_nanogpt():
    """The nanoGPT-style model of the tests with nanoGPT's own patterns (head tied to
    ``wte``, ``wpe(torch.arange(T))``, its LayerNorm class through the fallback, biases):
    vocabulary 512, T=64, width 128, 4 heads, 2 layers, 470,528 parameters."""
    from tests.models import NanoGPT

    return NanoGPT(NANO_VOCABULARY, GPT_CONTEXT, 128, 4, 2, bias=True, norm="nanogpt")


NANO_VOCABULARY = 512


def make_nanogpt_gpt_size():
    """:func:`make_nanogpt` at the benchmark's GPT size (``benchmarks.models.make_gpt``):
    vocabulary 96, T=64, width 128, 4 heads, 4 layers."""
    from benchmarks.models import GPT_VOCABULARY
    from tests.models import NanoGPT

    return NanoGPT(GPT_VOCABULARY, GPT_CONTEXT, 128, 4, 4, bias=True, norm="nanogpt")


def make_hf_gpt2():
    """Hugging Face's ``GPT2LMHeadModel`` (tied head, ``Conv1D``, positions ``(1, T)``) at
    the benchmark's GPT size, no dropout."""
    from benchmarks.models import GPT_VOCABULARY
    from tests.models import hf_gpt2

    return hf_gpt2(GPT_VOCABULARY, GPT_CONTEXT, 128, 4, 4)


def nano_tokens(n, device):
    return torch.randint(0, NANO_VOCABULARY, (n, GPT_CONTEXT), device=device)


#: The benchmark's four models, and the real models of issue 21 (float32, batch 32, 3x32x32).
ALL_MODELS = {
    **MODELS,
    "tv-resnet18": ModelSpec(make_torchvision("resnet18"), images(3, 32, 32), 32, classes),
    "convnext_tiny": ModelSpec(make_torchvision("convnext_tiny"), images(3, 32, 32), 32, classes),
    "nanogpt": ModelSpec(make_nanogpt, nano_tokens, 32, targets=nano_tokens,
                         loss=MODELS["gpt"].loss),
    # The real-models issue's speed figures: nanoGPT's patterns and GPT-2 at the GPT size.
    "nanogpt-4x128": ModelSpec(make_nanogpt_gpt_size, MODELS["gpt"].inputs, 32,
                               targets=MODELS["gpt"].targets, loss=MODELS["gpt"].loss),
    "hf-gpt2-4x128": ModelSpec(make_hf_gpt2, MODELS["gpt"].inputs, 32,
                               targets=MODELS["gpt"].targets, loss=MODELS["gpt"].loss),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One copy of the model and its optimizer; ``step(k)`` does training step ``k``."""

    def __init__(self, model, spec, x, y, kind):
        self.x, self.y, self.kind = x, y, kind
        self.individual = spec.loss("none")
        if kind == "run":
            self.model, self.tracker = cgn.track(model, every=EVERY)
        else:
            self.model = model if kind == "plain" else cgn.prepare_model(model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if kind == "before":
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            self.cockpit = cgn.Cockpit(params, quantities=cgn.configuration(
                "all", EVERY, param_names=names))
        self.optimizer = torch.optim.SGD(params, lr=0.0)

    def tracks(self, k) -> bool:
        return self.tracker._tracks(k)

    def step(self, k):
        self.optimizer.zero_grad(set_to_none=True)
        losses = self.individual(self.model(self.x), self.y)
        if self.kind == "plain":
            losses.mean().backward()
        elif self.kind == "run":
            with self.tracker(k, losses, optimizer=self.optimizer) as loss:
                loss.backward()
        else:
            loss = losses.mean()
            info = {"batch_size": len(losses), "individual_losses": losses, "loss": loss,
                    "optimizer": self.optimizer}
            with self.cockpit(k, info=info):
                loss.backward()
        self.optimizer.step()

    def timed(self, k, device, clock) -> float:
        _sync(device)
        start = clock()
        self.step(k)
        _sync(device)
        return clock() - start


def measure(name, args, device):
    """``{"untracked", "before", "A/A", "whole run", "plain ms", ...}`` for one model."""
    spec = ALL_MODELS[name]
    clock = time.process_time if args.clock == "cpu" and device.type == "cpu" else time.perf_counter
    model, x, y = model_and_batch(spec, spec.batch_size, device)
    if name in ("tv-resnet18", "convnext_tiny", "nanogpt"):
        model.train()
    runners = {kind: Runner(copy.deepcopy(model), spec, x, y, "plain" if kind == "A/A" else kind)
               for kind in ("plain", "run", "before", "A/A")}
    run = runners["run"]
    order = random.Random(0)
    ratios = {"untracked": [], "before": [], "A/A": []}
    whole, plain_times, tracked_steps = [], [], []
    for r in range(args.rounds + 1):  # round 0 warms up
        totals = [0.0, 0.0]
        for k in range(EVERY * r, EVERY * (r + 1)):
            idle = not run.tracks(k)
            kinds = ["plain", "run", "before", "A/A"] if idle else ["plain", "run"]
            order.shuffle(kinds)
            times = {kind: runners[kind].timed(k, device, clock) for kind in kinds}
            totals[0] += times["plain"]
            totals[1] += times["run"]
            if r and k % EVERY == 0:  # all five compute (UpdateSize starts)
                tracked_steps.append(times["run"] / times["plain"])
            if idle and r:
                plain_times.append(times["plain"])
                ratios["untracked"].append(times["run"] / times["plain"])
                ratios["before"].append(times["before"] / times["plain"])
                ratios["A/A"].append(times["A/A"] / times["plain"])
        if r:
            whole.append(totals[1] / totals[0])
    untracked = ratios["untracked"]
    return {
        "untracked": statistics.median(untracked),
        "untracked quartiles": statistics.quantiles(untracked, n=4)[::2],
        "before": statistics.median(ratios["before"]),
        "A/A": statistics.median(ratios["A/A"]),
        "whole run": statistics.median(whole),
        "whole run quartiles": statistics.quantiles(whole, n=4)[::2] if len(whole) > 1 else whole * 2,
        "tracked": statistics.median(tracked_steps),
        "plain ms": 1e3 * statistics.median(plain_times),
        "pairs": len(untracked),
    }


def table(results) -> str:
    lines = [
        "| model | plain step, ms | untracked / plain (quartiles) | before: hooks recording, "
        "Cockpit's context | A/A: plain copy / plain | whole run, every 10 / plain (quartiles) "
        "| tracked step / plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        uq, wq = r["untracked quartiles"], r["whole run quartiles"]
        lines.append(
            f"| {name} (B{ALL_MODELS[name].batch_size}) | {r['plain ms']:.2f} | "
            f"**{r['untracked']:.3f}** ({uq[0]:.3f}-{uq[1]:.3f}) | {r['before']:.3f} | {r['A/A']:.3f} | "
            f"**{r['whole run']:.3f}** ({wq[0]:.3f}-{wq[1]:.3f}) | {r['tracked']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ALL_MODELS))
    parser.add_argument("--rounds", type=int, default=15, help="rounds of ten steps each")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
          f"{args.rounds} rounds of {EVERY} steps, load average {os.getloadavg()[0]:.2f} at the start")
    results = {}
    for name in args.models.split(","):
        results[name] = measure(name, args, device)
        print(f"{name}: {results[name]}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
