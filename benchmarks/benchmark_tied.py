"""What tied parameters and broadcast position embeddings cost in a tracked step.

The nanoGPT-style model of the tests (``tests.models.NanoGPT``: head tied to
``wte``, ``wpe(torch.arange(T))``), against the same model with its head
untied (its own copy of the matrix), each prepared by ``cgn.prepare_model``:

- a plain step (forward, backward, no cockpit), and a tracked step with all
  five quantities; the tied model's extra work is combining the head's and
  the embedding's results (the cross terms on the tokens' rows);
- a forward pass of the prepared model against one extended by
  ``backpack.extend`` alone: the walk over the autograd graph that finds where
  ``wpe``'s output is added.

CPU time of one thread (``time.process_time``), steps interleaved over rounds,
the fastest round of each (on a shared machine noise only adds time)::

    python -m benchmarks.benchmark_tied [--device cuda] [--rounds 10]
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn

import torch
from backpack import extend
from torch import nn

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from tests.models import NanoGPT  # noqa: E402


def build(tied: bool, args, device):
    torch.manual_seed(0)
    model = NanoGPT(args.vocabulary, args.context, args.width, args.heads, args.layers,
                    bias=False, norm="torch")
    if not tied:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model.to(device)


def steps(model, args, device):
    """``{name: step()}``: the plain step and the tracked step of ``model`` (prepared)."""
    prepared = cgn.prepare_model(model)
    loss_fn = extend(nn.CrossEntropyLoss())
    params = [p for p in prepared.parameters() if p.requires_grad]
    quantities = cgn.configuration("all", every=1, model=prepared)
    cockpit = cgn.Cockpit(params, quantities=quantities)
    idx = torch.randint(0, args.vocabulary, (args.batch_size, args.context), device=device)
    counter = iter(range(10**9))

    def losses():
        logits = prepared(idx)
        tokens = nn.functional.cross_entropy(logits.transpose(1, 2), idx, reduction="none")
        return loss_fn(logits.flatten(0, 1), idx.flatten()), tokens.mean(1)

    def plain():
        prepared.zero_grad()
        losses()[0].backward()

    def tracked():
        prepared.zero_grad()
        loss, individual = losses()
        info = {"batch_size": args.batch_size, "individual_losses": individual, "loss": loss}
        with cockpit(next(counter), info=info):
            loss.backward()

    return {"plain": plain, "tracked": tracked}, prepared, idx


def timed(named_steps, rounds, device):
    times = {name: [] for name in named_steps}
    for step in named_steps.values():
        step()
    for _ in range(rounds):
        for name, step in named_steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
            else:
                start = time.process_time()
                step()
                times[name].append(time.process_time() - start)
    return {name: 1e3 * min(values) for name, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--vocabulary", type=int, default=4096)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    named = {}
    forwards = {}
    for tied in (True, False):
        label = "tied" if tied else "untied"
        model = build(tied, args, device)
        plain_extended = extend(copy.deepcopy(model))
        model_steps, prepared, idx = steps(model, args, device)
        named.update({f"{label} {name}": step for name, step in model_steps.items()})
        if tied:
            forwards = {"forward, prepared": lambda: prepared(idx),
                        "forward, backpack.extend alone": lambda: plain_extended(idx)}
    best = timed({**named, **forwards}, args.rounds, device)
    print(f"nanoGPT-style, vocabulary {args.vocabulary}, width {args.width}, context "
          f"{args.context}, {args.layers} layers, batch {args.batch_size}, {device}, "
          f"fastest of {args.rounds} rounds (ms)")
    for name, ms in best.items():
        print(f"  {name:34s} {ms:9.2f}")
    for label in ("tied", "untied"):
        print(f"  {label}: tracked / plain = {best[f'{label} tracked'] / best[f'{label} plain']:.2f}")
    print(f"  tied tracked / untied tracked = {best['tied tracked'] / best['untied tracked']:.3f}")
    return best


if __name__ == "__main__":
    main()
