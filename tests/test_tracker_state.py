"""A tracker's state in a checkpoint: a run killed and resumed logs what a run that never stopped logs.

`tracker.state_dict()` / `tracker.load_state_dict()` (issue 35): every
quantity's running state, the last step, the log's position. The main test
kills a real training process (`tests/resume_training.py`) with SIGKILL after
step 7 (checkpoints after steps 2 and 5), restarts it from its checkpoint and
compares its log, number for number, with the same run never stopped. The loop that
docs/training-setups.md ("Resuming a run") shows is that script's.
"""

import io
import os
import signal
import subprocess
import sys
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs.selective import index_log
from cockpit_gradnoise.logs.stream import read_stream
from cockpit_gradnoise.quantities.presets import ALL

import pandas
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.resume_training import batch, main, network
from tests.test_log import ROOT

SCRIPT = str(ROOT / "tests" / "resume_training.py")
STEPS, KILLED_AFTER, CHECKPOINTED_AT = 12, 7, 6


def _script(*arguments, **options):
    # Intel MKL (torch's BLAS on x86) picks kernels by the operands' memory alignment, so
    # the same product may round otherwise in another process: seen here as one statistic
    # one unit in the last place apart at the resumed run's first step. Its conditional
    # numerical reproducibility mode makes both processes compute alike (docs/training-setups.md).
    return subprocess.Popen([sys.executable, SCRIPT, *map(str, arguments)],
                            env={**os.environ, "PYTHONPATH": str(ROOT), "MKL_CBWR": "AUTO,STRICT"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)


def _finished(process):
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out


def test_a_run_killed_and_resumed_from_its_checkpoint_logs_what_a_run_never_stopped_logs(tmp_path):
    whole = _script(tmp_path / "whole", STEPS)  # the same run, alongside
    first = _script(tmp_path / "run", STEPS, "--checkpoint", tmp_path / "ckpt.pt",
                    "--hold-after", KILLED_AFTER)
    try:
        for line in first.stdout:  # the first process waits after step KILLED_AFTER
            if int(line) == KILLED_AFTER:
                break
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    killed = (tmp_path / "run.jsonl").read_bytes()
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == CHECKPOINTED_AT
    _finished(_script(tmp_path / "run", STEPS, "--checkpoint", tmp_path / "ckpt.pt", "--resume"))
    _finished(whole)

    path = tmp_path / "run.jsonl"
    final = cgn.to_frame(path)
    expected = cgn.to_frame(tmp_path / "whole.jsonl")
    pandas.testing.assert_frame_equal(final, expected, check_exact=True)
    assert sorted(set(final.step)) == list(range(STEPS))
    # Every line the first process wrote is still in the file, where it wrote it.
    assert path.read_bytes().startswith(killed)
    log = read_stream(path)
    superseded = {(step, quantity) for step, quantity, _ in log.superseded_records()}
    # What it wrote after its checkpoint (steps 6-7, with the tracker's Optimizer rows;
    # UpdateSize's 5-6, ended at 6-7) ...
    after = {(step, q) for step in (6, 7) for q in (*ALL, "Optimizer") if q != "UpdateSize"}
    assert superseded == after | {(5, "UpdateSize"), (6, "UpdateSize")}
    # ... set apart, readable on request, and the very numbers the resumed run wrote again.
    every = cgn.to_frame(path, superseded=True)
    old = every[every.superseded].drop(columns="superseded").reset_index(drop=True)
    again = final.merge(old[["step", "quantity"]].drop_duplicates())
    pandas.testing.assert_frame_equal(old, again, check_exact=True)
    assert len(every) == len(final) + len(old)
    # The summary the resumed run wrote sums the records in effect: the views' fast reads.
    sums, whole_sums = (index_log(p).sums("GradientVarianceQuantiles", "q0.5")
                        for p in (path, tmp_path / "whole.jsonl"))
    assert sums is not None and sums.params == whole_sums.params and sums.steps == STEPS
    assert (sums.sums == whole_sums.sums).all() and (sums.finite == whole_sums.finite).all()


def test_a_restart_without_a_checkpoint_keeps_the_earlier_log(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(tmp_path / "run", 4)
        main(tmp_path / "run", 4)  # the same path, step 0 again
    log = read_stream(tmp_path / "run.jsonl")
    assert len(log.superseded_records()) == len(log.current())  # the first run's, every record
    every = cgn.to_frame(tmp_path / "run.jsonl", superseded=True)
    first, second = every[every.superseded], every[~every.superseded]
    pandas.testing.assert_frame_equal(first.reset_index(drop=True),
                                      second.reset_index(drop=True).assign(superseded=True))


# ------------------------------------------------------------- the state of each quantity

MICRO = {"all": 1, "norms": 2}


def _steps(model, tracker, opt, steps, micro):
    for step in steps:
        opt.zero_grad()
        x, y = batch(step)
        for k, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            extra = {} if micro == 1 else {"micro_batch": k, "micro_batches": micro}
            with tracker(step, F.cross_entropy(model(xs), ys, reduction="none"), optimizer=opt,
                         **extra) as loss:
                loss.backward()
        opt.step()


def _run(quantities, steps, state=None, load=True):
    """A tracker over ``steps``, from a checkpoint's ``state`` (bytes of torch.save) if given."""
    model, tracker = cgn.track(network(), every=1, quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if state is not None:
        saved = torch.load(io.BytesIO(state), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        if load:
            tracker.load_state_dict(saved["tracker"])
    _steps(model, tracker, opt, steps, MICRO[quantities])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "tracker": tracker.state_dict()}, buffer)
    return tracker, buffer.getvalue()


@pytest.mark.parametrize("quantities", ["all", "norms"])
def test_a_state_through_torch_save_gives_the_next_steps_numbers_of_a_run_never_stopped(
        quantities):
    """GradientNoiseScale's moving averages, UpdateSize's parameters cached at step 2 (its end,
    step 3, after the resume), TwoBatchNoiseScale's averages ("norms": two micro-batches)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _run(quantities, range(6))[0].frame()
        _, state = _run(quantities, range(3))
        resumed = _run(quantities, range(3, 6), state)[0].frame()
        forgetful = _run(quantities, range(3, 6), state, load=False)[0].frame()
    pandas.testing.assert_frame_equal(resumed, expected, check_exact=True)
    smoothed = expected[(expected.statistic == "b_simple_smoothed") & (expected.step >= 3)]
    assert len(smoothed) and len(set(expected.quantity) & {"UpdateSize"}) == 1
    # Without the state: the averages start again and step 2's update is lost.
    lost = forgetful.merge(smoothed, on=["step", "quantity", "param", "statistic"])
    assert (lost.value_x != lost.value_y).any()
    assert 2 not in set(forgetful[forgetful.quantity == "UpdateSize"].step)


@pytest.mark.parametrize("build, message", [
    (lambda: cgn.track(nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)).double(),
                       every=1), r"parameter shapes differ: 0.weight \[6, 4\] there, \[7, 4\] here"),
    (lambda: cgn.track(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Tanh(),
                                     nn.Linear(3, 3)).double(), every=1),
     r"parameters: the state's model has \[\] that this one lacks, this one has \['4.bias'"),
    (lambda: cgn.track(network(), every=1, quantities="cheap"), "quantities: the state's are"),
    (lambda: cgn.track(network(), every=1, options={"GradientNoiseScale": {"smoothing": 0.5}}),
     r"GradientNoiseScale: options \{'smoothing': 0.9\} in the state, \{'smoothing': 0.5\} here"),
    (lambda: cgn.track(network(), every=2), r"UpdateSize: another schedule \(every=\): steps \[1, 3"),
])
def test_a_state_that_does_not_fit_names_what_differs_and_loads_nothing(build, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _run("all", range(2))[0].state_dict()
    _, tracker = build()
    with pytest.raises(ValueError, match=message) as raised:
        tracker.load_state_dict(state)
    assert "Build the tracker as the run that saved it did" in str(raised.value)
    assert tracker.last_step is None and not any(q.output for q in tracker.cockpit.quantities)
    with pytest.raises(ValueError, match="not a tracker's state"):
        tracker.load_state_dict({"model": {}})


def _tensorboard_run(log_dir, steps, state=None, stop=None):
    """An in-memory tracker logging to a SummaryWriter on ``log_dir``; its state taken after
    step ``stop`` (the checkpoint) while the run goes on; from ``state`` if given."""
    from torch.utils.tensorboard import SummaryWriter

    model, tracker = cgn.track(network(), every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    writer = SummaryWriter(str(log_dir))
    tracker.log_to(writer)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["tracker"])
    saved = None
    for step in steps:
        _steps(model, tracker, opt, [step], 1)
        if step == stop:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "tracker": tracker.state_dict()}, buffer)
            saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    writer.close()  # on disk, as a run that died after flushing would leave it
    return saved


def _scalars(log_dir):
    """``{tag: [(step, value), ...]}`` as TensorBoard reads the directory (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_after_a_resume_shows_each_step_once_with_the_numbers_of_a_run_never_stopped(
        tmp_path):
    """The run that died logged steps 3-4 (UpdateSize's 2-3) after its checkpoint at step 2.
    The resumed run purges from step 2 (UpdateSize's step 2 ends after the checkpoint), gives
    step 2's other numbers again, and logs steps 3-5 (UpdateSize's 2-4)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _tensorboard_run(tmp_path / "whole", range(6))
        state = _tensorboard_run(tmp_path / "run", range(5), stop=2)
        _tensorboard_run(tmp_path / "run", range(3, 6), state=state)
    expected, got = _scalars(tmp_path / "whole"), _scalars(tmp_path / "run")
    assert set(expected["UpdateSize/all/norm"][i][0] for i in range(5)) == set(range(5))
    assert got == expected
