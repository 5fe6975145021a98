"""The main job with DistributedDataParallel: the digits CNN on several processes.

Started by torchrun, one process per device (gloo on CPUs, nccl on GPUs):

    torchrun --standalone --nproc_per_node 2 experiments/train_ddp.py --out runs

Each process trains on its share of every batch (``--batch-size`` is the
global batch, split evenly), and the quantities report the statistics of the
global batch, identical on every process. Only rank 0 writes the Cockpit log
(``<out>/digits_ddp.json``), the dashboard (``<out>/digits_ddp.png``) and the
report (``<out>/digits_ddp_report.txt``), the same files as
``experiments/train_digits.py``. ``--quick`` runs a few steps (the test suite
runs it).
"""

import os
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script (torchrun experiments/train_ddp.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # no display on training nodes

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise import distributed  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from backpack import extend  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from experiments.train_digits import (  # noqa: E402
    argument_parser,
    digits_cnn,
    digits_loaders,
    make_quantities,
    tracked_step,
    write_outputs,
)

QUICK_STEPS = 8


def setup():
    """Join torchrun's process group (unless one exists); return the device and whether we did."""
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device, started_here


def train(out_dir, device, epochs=3, batch_size=32, lr=0.05, track_every=5, seed=0, steps=None):
    """Train with DDP and track; rank 0 writes the log. Returns the cockpit and the log path."""
    world = dist.get_world_size()
    if batch_size % world:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of the {world} processes")
    torch.manual_seed(seed)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    train_set, test_set = (loader.dataset for loader in digits_loaders(batch_size, seed))
    sampler = torch.utils.data.DistributedSampler(train_set, shuffle=True, seed=seed, drop_last=True)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=batch_size // world, sampler=sampler, drop_last=True
    )
    model = extend(digits_cnn()).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    loss_fn = extend(nn.CrossEntropyLoss())
    per_example_loss = nn.CrossEntropyLoss(reduction="none")
    # Names of the module inside DDP: the same as in the single-process job.
    names = [n for n, _ in model.named_parameters()]
    cockpit = cgn.Cockpit(model.parameters(), quantities=make_quantities(names, track_every))
    opt = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=0.9)
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            # As on one process, with this process's batch in info.
            x, y = x.to(device), y.to(device)
            loss = tracked_step(cockpit, step, ddp_model, x, y, (loss_fn, per_example_loss), opt)
            step += 1
            if steps is not None and step >= steps:
                break
        if distributed.is_writer():
            print(f"epoch {epoch + 1}: loss {loss.item():.3f}, test accuracy "
                  f"{accuracy(model, test_set, device):.3f}")
    log = cgn.write_log(cockpit, Path(out_dir) / "digits_ddp")  # None except on rank 0
    return cockpit, log


def accuracy(model, dataset, device) -> float:
    """Accuracy of ``model`` on ``dataset`` on this process (no communication)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=512)
    with torch.no_grad():
        correct = sum((model(x.to(device)).argmax(1) == y.to(device)).sum().item() for x, y in loader)
    return correct / len(dataset)


def main(argv=None):
    """Run the job; return the log's path on the process that wrote it, else ``None``."""
    parser = argument_parser(__doc__.splitlines()[0], batch_size_help="global batch size")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_STEPS} steps, tracked every 2 (a smoke test)"
    )
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    device, started_here = setup()
    try:
        start = time.perf_counter()
        epochs, track_every, steps = args.epochs, args.track_every, None
        if args.quick:
            epochs, track_every, steps = 1, 2, QUICK_STEPS
        _, log = train(args.out, device, epochs, args.batch_size, args.lr, track_every, steps=steps)
        if log is not None:
            print("\n" + write_outputs(log, args.batch_size))
            print(f"log: {log}, dashboard: {log.with_suffix('.png')}, report: "
                  f"{log.with_name(log.stem + '_report.txt')}  "
                  f"({time.perf_counter() - start:.1f} s, {dist.get_world_size()} processes)")
    finally:
        if started_here:
            dist.destroy_process_group()
    return log


if __name__ == "__main__":
    main()
