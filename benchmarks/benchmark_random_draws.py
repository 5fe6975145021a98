"""What replaying the batch's random draws costs (issue 32, ``extensions/fallback/draws.py``).

In training mode with dropout or drop path, the modules the package runs again per example
(timm BEiT's top module for ``cls_token``; XLNet's block, the whole model) are run once more on
the batch to record its draws, then on each example alone in a loop (not ``vmap``). This times,
side by side in one process, in CPU time of one thread (``time.process_time``), the median of
``--rounds`` rounds in a shuffled order after one warm-up each:

- ``plain``: a training step without the package (forward, loss, backward);
- ``tracked``: the same step in ``with tracker(...)`` (``cgn.track``, PerExampleGradNorm);

for each model with its dropout and drop path on (``draws``: replayed) and off (``none``:
``vmap`` for BEiT's top module, the batched block for XLNet), so the ratio of the two
``tracked / plain`` says what the replay adds. Before issue 32 the ``draws`` rows had no
per-example rows for those parameters at all (left out by name).

Run: ``PYTHONPATH=. python benchmarks/benchmark_random_draws.py [--rounds 5] [--batch 8]``.
"""

import argparse
import random
import statistics
import warnings

import cockpit_gradnoise as cgn

import torch
from torch import nn

from benchmarks.harness import times_in_shuffled_rounds


def beit(rate: float) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("beit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=48, num_heads=2, num_classes=5, drop_path_rate=2 * rate,
                             drop_rate=rate, init_values=0.1).train()


class XLNetLogits(nn.Module):
    def __init__(self, rate: float):
        super().__init__()
        from transformers import XLNetConfig, XLNetLMHeadModel

        torch.manual_seed(0)
        config = XLNetConfig(vocab_size=50, d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=64,
                             dropout=rate)
        self.model = XLNetLMHeadModel(config).train()
        for name, param in self.model.named_parameters():  # what a plain LM step never reaches
            param.requires_grad_(not name.endswith(("mask_emb", "seg_embed", "r_s_bias")))

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def steps(make, x, y, losses):
    """``{"plain": step, "tracked": step}`` on two copies of one model."""
    plain = make()
    model, tracker = cgn.track(make(), every=1, quantities=["PerExampleGradNorm"])

    def plain_step(x, y):
        plain.zero_grad(set_to_none=True)
        losses(plain(x), y).mean().backward()

    count = iter(range(10**9))

    def tracked_step(x, y):
        model.zero_grad(set_to_none=True)
        with tracker(next(count), losses(model(x), y)) as loss:
            loss.backward()

    return {"plain": plain_step, "tracked": tracked_step}, model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.batch
    images, labels = torch.randn(n, 3, 32, 32), torch.arange(n) % 5
    ids = torch.randint(0, 50, (n, 16))

    def token_losses(logits, targets):
        return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    cases = {
        "BEiT (timm, 2 blocks, width 48)": (beit, images, labels, lambda o, t: nn.functional.cross_entropy(
            o, t, reduction="none")),
        "XLNet (2 layers, width 32, T=16)": (XLNetLogits, ids, ids, token_losses),
    }
    print(f"batch {n}, one thread, CPU ms (median of {args.rounds} rounds)")
    print("| model | draws | plain ms | tracked ms | tracked / plain | parameters with rows |")
    print("|---|---|---|---|---|---|")
    for label, (make, x, y, losses) in cases.items():
        for rate, drawn in ((0.1, "draws"), (0.0, "none")):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                found, model = steps(lambda: make(rate), x, y, losses)
                for step in found.values():
                    step(x, y)  # warm-up
                times = times_in_shuffled_rounds(found, x, y, args.rounds, random.Random(0))
            medians = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            left_out = any("no exact per-example" in str(w.message) for w in caught)
            rows = "not all (left out)" if left_out else "all"
            print(f"| {label} | {drawn} | {medians['plain']:.1f} | {medians['tracked']:.1f} | "
                  f"{medians['tracked'] / medians['plain']:.2f} | {rows} |", flush=True)


if __name__ == "__main__":
    main()
