"""Layer-wise trust ratios: ParamGradRatio's ||theta|| / ||grad|| over training.

Two models, each trained briefly with its usual optimizer while
``ParamGradRatio`` is tracked: a GPT-style character model
(``experiments.models.GPT``) on the source files of Python's standard library
(real text that ships with Python), and torchvision's resnet18 (extended with
``cockpit_gradnoise.prepare_model``) on scikit-learn's digits upsampled to
3x32x32. The spread of the per-layer ratio is compared with the one LARS and
LAMB (You et al. 2017, 2019) were designed for. Writes ``trust-ratios.png``
and ``.md``.

    PYTHONPATH=. python -m experiments.trust_ratios
    PYTHONPATH=. python -m experiments.trust_ratios --quick --out /tmp/tr
"""

import json
import sysconfig
import time
from pathlib import Path

import cockpit_gradnoise as cgn

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402

from experiments import pages, train_digits  # noqa: E402
from experiments.models import GPT, TokenCrossEntropy  # noqa: E402

SLUG = "trust-ratios"
SEED = 0
#: Standard-library files the character model reads, in this order.
TEXT_FILES = ("argparse.py", "collections/__init__.py", "json/decoder.py", "textwrap.py",
              "dataclasses.py", "functools.py")
#: The LARS paper's range of ||w|| / ||grad w|| across AlexNet's layers (You et al. 2017).
LARS_RANGE = (5.0, 1300.0)
#: (GPT steps, resnet18 steps, track every k steps)
FULL = (300, 60, 10)
QUICK = (6, 4, 2)

GPT_SHAPE = {"context": 64, "width": 64, "heads": 4, "layers": 2}
GPT_BATCH, RESNET_BATCH = 16, 32


def stdlib_text():
    """The characters of :data:`TEXT_FILES`, and the files' paths."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [root / name for name in TEXT_FILES]
    return "\n".join(path.read_text(encoding="utf-8") for path in paths), paths


def char_batches(text, steps, generator):
    """``steps`` batches of random windows of the text: (inputs, next characters)."""
    vocabulary = sorted(set(text))
    data = torch.tensor([vocabulary.index(c) for c in text])
    length = GPT_SHAPE["context"]
    for _ in range(steps):
        starts = torch.randint(0, len(data) - length - 1, (GPT_BATCH,), generator=generator)
        window = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]
    return vocabulary


def digit_images(generator):
    """Digits as 3x32x32 images (bilinear upsampling, grey to three channels), labels."""
    loader, _ = train_digits.digits_loaders(RESNET_BATCH, SEED)
    x, y = loader.dataset.tensors
    x = nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return x.expand(-1, 3, -1, -1).contiguous(), y


def tracked_training(model, optimizer, batches, loss_fn, track_every):
    """Train on ``batches`` with a Cockpit that tracks ParamGradRatio; return its frame."""
    names = [n for n, _ in model.named_parameters()]
    quantity = cgn.ParamGradRatio(linear(track_every), param_names=names)
    cockpit = cgn.Cockpit(model.parameters(), quantities=[quantity])
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with cockpit(step, info={"loss": loss, "batch_size": len(x)}):
            loss.backward()
        optimizer.step()
    return cgn.to_frame(cockpit), loss.item(), {n: p.dim() for n, p in model.named_parameters()}


def train_gpt(steps, track_every):
    torch.manual_seed(SEED)
    text, paths = stdlib_text()
    vocabulary = sorted(set(text))
    model = GPT(len(vocabulary), **GPT_SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    batches = char_batches(text, steps, torch.Generator().manual_seed(SEED))
    frame, loss, dims = tracked_training(model, optimizer, batches, TokenCrossEntropy(),
                                         track_every)
    about = (f"{len(text):,} characters of {len(paths)} standard-library files "
             f"({', '.join(TEXT_FILES)}), a vocabulary of {len(vocabulary)} characters")
    return frame, loss, dims, about


def train_resnet(steps, track_every):
    torch.manual_seed(SEED)
    model = cgn.prepare_model(torchvision.models.resnet18(num_classes=10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    generator = torch.Generator().manual_seed(SEED)
    x, y = digit_images(generator)
    picks = [torch.randint(0, len(y), (RESNET_BATCH,), generator=generator) for _ in range(steps)]
    frame, loss, dims = tracked_training(model, optimizer, ((x[p], y[p]) for p in picks),
                                         nn.CrossEntropyLoss(), track_every)
    return frame, loss, dims, "1,797 digits, 3x32x32, batches of 32 drawn with replacement"


def ratios(frame) -> "dict":
    """``{param: Series(step -> norm_ratio)}`` of the layers (not the network)."""
    rows = frame[(frame.statistic == "norm_ratio") & (frame.param != cgn.NETWORK)]
    return {param: group.set_index("step").value.sort_index()
            for param, group in rows.groupby("param", sort=False)}


def spread(series, dims, step, weights_only):
    """(smallest, its layer, largest, its layer) of the finite positive ratios at ``step``."""
    values = {p: s.get(step, np.nan) for p, s in series.items()
              if not weights_only or dims[p] >= 2}
    values = {p: v for p, v in values.items() if np.isfinite(v) and v > 0}
    low, high = min(values, key=values.get), max(values, key=values.get)
    return values[low], low, values[high], high


def figure(models, path):
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2),
                             layout="constrained", squeeze=False)
    for ax, (title, (frame, _, dims, _)) in zip(axes.flat, models.items()):
        for param, series in ratios(frame).items():
            weight = dims[param] >= 2
            ax.plot(series.index, series.to_numpy(), lw=0.9 if weight else 0.6,
                    color="C0" if weight else "0.6", alpha=0.8 if weight else 0.6)
        ax.axhspan(*LARS_RANGE, color="C1", alpha=0.12, zorder=0)
        ax.set_yscale("log")
        ax.set_title(f"{title}: ||theta|| / ||grad|| per parameter", fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("norm_ratio (ParamGradRatio)")
    handles = [plt.Line2D([], [], color="C0", label="weights (dim >= 2)"),
               plt.Line2D([], [], color="0.6", label="biases, norm scales, 1-d"),
               plt.Rectangle((0, 0), 1, 1, color="C1", alpha=0.25,
                             label="LARS paper: AlexNet's layers, ~5 to ~1300")]
    axes.flat[-1].legend(handles=handles, fontsize="small", loc="best")
    pages.save_figure(fig, path, dpi=80)
    plt.close(fig)


def summary(models):
    """Rows of the table, and ``{(model, which, "first"|"last"): (low, name, high, name)}``."""
    rows, found = [], {}
    for title, (frame, _, dims, _) in models.items():
        series = ratios(frame)
        steps = sorted(frame.step.unique())
        for step in sorted({steps[0], steps[len(steps) // 2], steps[-1]}):
            for which, weights_only in (("weights", True), ("all", False)):
                low, low_name, high, high_name = spread(series, dims, step, weights_only)
                rows.append([title, step, which, f"{low:.3g} ({low_name})",
                             f"{high:.3g} ({high_name})", f"{high / low:.0f}x"])
                if step == steps[0]:
                    found[(title, which, "first")] = (low, low_name, high, high_name)
                if step == steps[-1]:
                    found[(title, which, "last")] = (low, low_name, high, high_name)
    return rows, found


def sentences(found) -> str:
    """The page's two sentences, from the numbers."""
    lars = LARS_RANGE[1] / LARS_RANGE[0]

    def span(model, which="weights", when="last"):
        low, low_name, high, high_name = found[(model, which, when)]
        return high / low, f"{low_name} {low:.3g} to {high_name} {high:.3g}"

    (gpt, gpt_range), (resnet, resnet_range) = span("GPT"), span("resnet18")
    first = (
        f"Over the weights (every parameter with two or more dimensions) `||theta|| / ||grad||` "
        f"spans {gpt:.0f}x in the GPT at its last tracked step ({gpt_range}; "
        f"{span('GPT', when='first')[0]:.0f}x at initialization, {span('GPT', 'all')[0]:.0f}x "
        f"with biases and LayerNorm parameters) and {resnet:.0f}x in resnet18 ({resnet_range}; "
        f"{span('resnet18', when='first')[0]:.0f}x at initialization, "
        f"{span('resnet18', 'all')[0]:.0f}x with biases and BatchNorm parameters), against the "
        f"roughly {lars:.0f}x (about 5 to 1300) that You et al. (2017) report across AlexNet's "
        f"layers."
    )
    second = (
        f"The GPT's spread is {gpt / lars:.2g} times and resnet18's {resnet / lars:.2g} times "
        f"AlexNet's: one global learning rate moves their layers at relative speeds that "
        f"differ by these factors, which is what LARS and LAMB even out by scaling each "
        f"layer's step by its trust ratio."
    )
    return f"{first} {second}"


def page(models, seconds, settings, argv, quick) -> str:
    rows, found = summary(models)
    table = pages.markdown_table(
        ["model", "step", "parameters", "smallest ratio", "largest ratio", "spread"], rows)
    gpt_about, resnet_about = models["GPT"][3], models["resnet18"][3]
    gpt_steps, resnet_steps, track_every = settings
    return f"""# Layer-wise trust ratios

{sentences(found)}

![norm_ratio per parameter over training, GPT and resnet18]({SLUG}.png)

`ParamGradRatio`'s `norm_ratio` is `||theta|| / ||grad||` per parameter
tensor, the ratio LARS (You et al. 2017, "Large Batch Training of
Convolutional Networks") multiplies each layer's learning rate by, and LAMB
(You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes") applies to Adam's update. The orange band is the range the
LARS paper reports for AlexNet, about 5 to about 1300 across layers. Blue:
parameters with two or more dimensions (weight matrices, convolution
kernels, embeddings), what LARS and LAMB adapt; grey: biases and the
LayerNorm and BatchNorm scales and shifts, usually excluded from the
adaptation. A parameter whose norm is 0 (a bias at initialization) has ratio
0 and is left off the log axis.

- **GPT** (`experiments.models.GPT`: {GPT_SHAPE["layers"]} pre-norm blocks,
  width {GPT_SHAPE["width"]}, {GPT_SHAPE["heads"]} heads, context
  {GPT_SHAPE["context"]}), character level on real text: {gpt_about}; AdamW,
  learning rate 1e-3, weight decay 0.1, batches of {GPT_BATCH} random
  windows, {gpt_steps} steps, last loss {models["GPT"][1]:.3f} nats per character
  ({seconds["GPT"]:.0f} s).
- **resnet18** (torchvision, 10 classes, `cgn.prepare_model`, training-mode
  BatchNorm) on {resnet_about}; SGD, learning rate 0.05, momentum 0.9,
  weight decay 5e-4, {resnet_steps} steps, last loss {models["resnet18"][1]:.3f}
  ({seconds["resnet18"]:.0f} s).

Tracked every {track_every} steps. Smallest and largest ratio at the first,
middle and last tracked step:

{table}
{pages.provenance("experiments.trust_ratios", argv, SEED, quick)}"""


def main(argv=None):
    argv = pages.argv_of(argv)
    args = pages.setup(pages.argument_parser(__doc__.splitlines()[0]), argv)
    settings = QUICK if args.quick else FULL
    gpt_steps, resnet_steps, track_every = settings
    models, seconds = {}, {}
    for title, train, steps in (("GPT", train_gpt, gpt_steps),
                                ("resnet18", train_resnet, resnet_steps)):
        start = time.perf_counter()
        models[title] = train(steps, track_every)
        seconds[title] = time.perf_counter() - start
    figure(models, args.out / f"{SLUG}.png")
    text = page(models, seconds, settings, argv, args.quick)
    (args.out / f"{SLUG}.md").write_text(text)
    print(text)
    print(json.dumps({title: round(s, 1) for title, s in seconds.items()}))


if __name__ == "__main__":
    main()
