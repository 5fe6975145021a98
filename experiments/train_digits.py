"""The main job: train a small CNN on scikit-learn's digits with a Cockpit.

Nothing downloads: the 1,797 8x8 digit images ship with scikit-learn. The run
tracks this package's quantities every ``--track-every`` steps, writes the
Cockpit log (``<out>/digits.json``), the dashboard (``<out>/digits.png``) and
the report (``<out>/digits_report.txt``: a per-layer table of the last tracked
step and findings), and prints the report.

    python -m experiments.train_digits --out runs --epochs 3
"""

import argparse
import time
import warnings
from pathlib import Path

import cockpit_gradnoise as cgn

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

#: The quantile levels of GradientVarianceQuantiles in the main job.
QUANTILES = (0.1, 0.5, 0.9)


def digits_loaders(batch_size, seed=0):
    """Train and test loaders over scikit-learn's digits, pixels scaled to [0, 1]."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    train, test = order[:1500], order[1500:]
    train_set = torch.utils.data.TensorDataset(images[train], labels[train])
    test_set = torch.utils.data.TensorDataset(images[test], labels[test])
    return (
        torch.utils.data.DataLoader(
            train_set, batch_size=batch_size, shuffle=True, drop_last=True, generator=generator
        ),
        torch.utils.data.DataLoader(test_set, batch_size=512),
    )


def digits_cnn():
    """A small CNN for 1x8x8 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def make_quantities(names, track_every):
    """The five quantities of :func:`train`, named ``names``, for a Cockpit built by hand."""
    return cgn.configuration("all", track_every, param_names=names, quantiles=QUANTILES)


def tracked_step(cockpit, step, model, x, y, losses, opt):
    """One optimizer step on ``(x, y)`` tracked by a Cockpit built by hand; returns the loss.

    The explicit API, which ``experiments/train_ddp.py`` uses around its DDP model.

    ``losses`` is ``(loss_fn, per_example_loss)``: the extended mean loss and
    the same loss with ``reduction="none"``.
    """
    loss_fn, per_example_loss = losses
    opt.zero_grad()
    out = model(x)
    loss = loss_fn(out, y)
    info = {
        "batch_size": len(x),
        "individual_losses": per_example_loss(out, y),
        "loss": loss,
        "optimizer": opt,
    }
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    opt.step()
    return loss


def train(out_dir, epochs=3, batch_size=32, lr=0.05, track_every=5, seed=0):
    """Train, track, write the log; return the tracker and the log path."""
    torch.manual_seed(seed)
    train_loader, test_loader = digits_loaders(batch_size, seed)
    model, tracker = cgn.track(digits_cnn(), every=track_every, quantiles=QUANTILES)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = 0
    for epoch in range(epochs):
        for x, y in train_loader:
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=opt) as loss:
                loss.backward()
            opt.step()
            step += 1
        with torch.no_grad():
            correct = sum((model(x).argmax(1) == y).sum().item() for x, y in test_loader)
        print(f"epoch {epoch + 1}: loss {loss.item():.3f}, test accuracy {correct / 297:.3f}")
    log = tracker.write(Path(out_dir) / "digits")
    return tracker, log


def write_outputs(log, batch_size) -> str:
    """Write the dashboard and the report beside the log; return the report's text."""
    frame = cgn.to_frame(log)
    figure = cgn.plot(frame, savefig=log.with_suffix(".png"), batch_size=batch_size)
    plt.close(figure)
    # The same text as `cockpit-gradnoise report <log> --batch-size <B>`.
    return cgn.report(log, log.with_name(f"{log.stem}_report.txt"), batch_size=batch_size)


def argument_parser(description, batch_size_help="batch size") -> argparse.ArgumentParser:
    """The job's options: --out, --epochs, --batch-size, --lr, --track-every."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="runs", help="output folder (default: runs)")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default: 3)")
    parser.add_argument(
        "--batch-size", type=int, default=32, help=f"{batch_size_help} (default: 32)"
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument(
        "--track-every", type=int, default=5, help="track every k steps (default: 5)"
    )
    return parser


def main(argv=None):
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    # torch warns on every step that BackPACK's hooks see no input gradient at the
    # first layer; that is expected here.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    start = time.perf_counter()
    _, log = train(args.out, args.epochs, args.batch_size, args.lr, args.track_every)
    text = write_outputs(log, args.batch_size)
    print("\n" + text)
    print(f"log: {log}, dashboard: {log.with_suffix('.png')}, report: "
          f"{log.with_name(log.stem + '_report.txt')}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
