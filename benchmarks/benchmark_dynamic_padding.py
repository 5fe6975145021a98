"""What a tracked step costs when every batch has a new sequence length (dynamic padding).

Before the first recorded forward pass of each new shape of the inputs, the package
surveys the model (``extensions/fallback/regroup.py``): a pass on the batch with
gradients and one backward pass to the layers' outputs (the check that the examples do
not mix, ``extensions/fallback/mixing.py``), and a pass on the batch one example larger.
Under dynamic padding each step has a new length. A new length of inputs of a structure
surveyed before runs one pass without gradients instead, and the full survey only where
that pass's signature differs. Four steps, each on its own copy of the model, the steps
interleaved over rounds, CPU time of one thread (``time.process_time``), the fastest
round of each (on a shared machine noise only adds time), with the spread of the rounds:

- ``plain``: forward and backward of the model as built (no package), a new length each round;
- ``tracked, one length``: all five quantities (``cgn.configuration("all")``), the same
  length every step (no survey after the first);
- ``tracked, new lengths``: the same, a new length every step (the survey amortised);
- ``tracked, new lengths, full survey``: the same, the structures' signatures forgotten
  before each step (what every step cost before).

Hugging Face's GPT-2 (``--model gpt2``) or OPT (``--model opt``: ``fc1``/``fc2`` on the
flattened tokens, a block recomputed per example), random weights::

    python -m benchmarks.benchmark_dynamic_padding [--model gpt2] [--batch-size 8] [--rounds 7]
"""

import argparse
import copy
import itertools
import statistics
import sys
import time
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions.fallback import regroup

import torch
from backpack import extend
from torch import nn

if not __package__:  # run as a file: the repository's packages on the path (see benchmark.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import benchmarks  # noqa: F401
    sys.path.append(sys.path.pop(0))

from benchmarks.methods import tracked_token_step  # noqa: E402
from tests.library_models import Logits  # noqa: E402


def build(name: str, width: int, vocabulary: int) -> nn.Module:
    """A tiny causal LM of ``transformers`` (2 layers, 2 heads, eager attention), random weights."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocabulary, n_embd=width, n_layer=2, n_head=2,
                                         n_positions=256)
    else:
        config = transformers.OPTConfig(vocab_size=vocabulary, hidden_size=width, num_hidden_layers=2,
                                        num_attention_heads=2, ffn_dim=4 * width,
                                        word_embed_proj_dim=width, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Logits(transformers.AutoModelForCausalLM.from_config(config)).eval()


def steps(args):
    model = build(args.model, args.width, args.vocabulary)
    loss_fn = extend(nn.CrossEntropyLoss())
    generator = torch.Generator().manual_seed(1)

    def batch(length):
        ids = torch.randint(0, args.vocabulary, (args.batch_size, length + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    def plain(length):
        ids, targets = batch(length)
        model.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()

    def tracked(forget: bool):
        prepared = cgn.prepare_model(copy.deepcopy(model))
        params = [p for p in prepared.parameters() if p.requires_grad]
        cockpit = cgn.Cockpit(params, quantities=cgn.configuration("all", every=1, model=prepared))
        counter = itertools.count()

        def step(length):
            if forget:
                prepared.__dict__.get(regroup.SIGNATURES, {}).clear()
            tracked_token_step(prepared, cockpit, loss_fn, next(counter), *batch(length))
        return step

    return {"plain": (plain, True), "tracked, one length": (tracked(False), False),
            "tracked, new lengths": (tracked(False), True),
            "tracked, new lengths, full survey": (tracked(True), True)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "opt"), default="gpt2")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="the one length; new ones around it")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocabulary", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    named = steps(args)
    lengths = itertools.cycle(range(args.length - args.rounds - 1, args.length + args.rounds + 2))
    for step, _ in named.values():  # warm up: the first survey of each
        step(args.length)
    times = {name: [] for name in named}
    for _ in range(args.rounds):
        length = next(lengths)  # new to each model: not its warm-up length, not an earlier one
        length = length if length != args.length else next(lengths)
        for name, (step, varies) in named.items():
            start = time.process_time()
            step(length if varies else args.length)
            times[name].append(time.process_time() - start)
    plain = min(times["plain"])
    print(f"{args.model} width {args.width}, 2 layers, batch {args.batch_size}, lengths "
          f"{args.length} +- {args.rounds + 1}, float32, one thread, fastest of {args.rounds} "
          "(median in brackets):")
    for name, values in times.items():
        fastest, median = min(values), statistics.median(values)
        print(f"  {name:36s} {1e3 * fastest:8.2f} ms ({1e3 * median:8.2f})  "
              f"{fastest / plain:5.2f}x the plain step")


if __name__ == "__main__":
    main()
