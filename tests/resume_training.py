"""A small training run that checkpoints its model, optimizer and tracker (tests/test_tracker_state.py).

Run as a script: ``python tests/resume_training.py LOG STEPS [--checkpoint PATH] [--resume]
[--hold-after K]``. Fixed seeds; each step's batch is drawn from a generator seeded by the
step, so a run resumed at step ``s`` sees the batches of a run that never stopped. After
every third step it saves ``{"model", "optimizer", "tracker", "step"}`` (written aside,
then renamed: a kill never leaves half a checkpoint). It prints each step done; with
``--hold-after K`` it waits after step ``K`` (to be killed there).
"""

import argparse
import os
import time

import cockpit_gradnoise as cgn

import torch
import torch.nn.functional as F
from torch import nn

CHECKPOINT_EVERY = 3


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(8, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=generator))


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def main(log, steps, checkpoint=None, resume=False, hold_after=None):
    model, tracker = cgn.track(network(), every=1, log=log)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = 0
    if resume:
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["tracker"])
        start = state["step"]
    for step in range(start, steps):
        x, y = batch(step)
        opt.zero_grad()
        with tracker(step, F.cross_entropy(model(x), y, reduction="none"), optimizer=opt) as loss:
            loss.backward()
        opt.step()
        if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "tracker": tracker.state_dict(), "step": step + 1}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        print(step, flush=True)
        if step == hold_after:
            time.sleep(600)  # killed here
    tracker.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("steps", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hold-after", type=int)
    arguments = parser.parse_args()
    main(arguments.log, arguments.steps, arguments.checkpoint, arguments.resume,
         arguments.hold_after)
