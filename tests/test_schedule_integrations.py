"""A batch schedule driving Lightning's and Hugging Face's Trainers (issue 34, part 3).

A scripted schedule (:class:`Scripted`, the interface of ``cgn.BatchSchedule``)
changes the accumulation at fixed steps, so that each change's place in the
epoch is known: over 8 batches an epoch, ``1 -> 2`` decided after step 0 (one
batch done: held back a step), ``2 -> 4`` after step 3 (six done: held back
to the epoch's end), ``4 -> 1`` after step 6 (a divisor: at once). Each run's
micro-batches per optimizer step and learning rates are compared with those
the rule gives, and its tracker's numbers with a loop by hand over the same
groups of batches; a run resumed from its checkpoint continues the same
schedule. The real ``cgn.BatchSchedule`` changes the accumulation of a real
fit too (its bootstrap under ``quantities="norms"``). These runs are those of
docs/training-setups.md's section on a schedule in the Trainers.
"""

import copy
import warnings
from collections import defaultdict

import cockpit_gradnoise as cgn
from cockpit_gradnoise.integrations.scheduling import ScheduleDriver
from cockpit_gradnoise.schedule.batch_schedule import inner_optimizer

import pandas
import pytest
import torch
import torch.nn.functional as F

from tests.test_integrations import _holder, _lightning_module, _llama, mlp

BATCH, BATCHES, LR = 6, 8, 0.1
SCRIPT = {0: 2, 3: 4, 6: 1}  # step whose update decides -> the new accumulation
#: Micro-batches of optimizer steps 0-7 under SCRIPT, and the learning rate's factor.
EXPECTED_K = [1, 1, 2, 2, 2, 4, 4, 1]
EXPECTED_FACTOR = [1, 1, 2, 2, 2, 4, 4, 1]
STEPS = len(EXPECTED_K)


class Scripted:
    """Sets the accumulation to ``script[step]`` after ``step`` and scales the learning
    rate by the ratio of the batches (the "sgd" rule far below the noise scale)."""

    rule = "sgd"

    def __init__(self, script=SCRIPT):
        self.script, self.accumulation, self.changes, self.lr_factor = dict(script), 1, [], 1.0

    def update(self, step, tracker, optimizer):
        new = self.script.get(step, self.accumulation)
        if new == self.accumulation:
            return None
        factor = new / self.accumulation
        for group in inner_optimizer(optimizer).param_groups:
            if isinstance(group["lr"], torch.Tensor):  # in place, as cgn.BatchSchedule
                group["lr"].mul_(factor)
            else:
                group["lr"] = group["lr"] * factor
        change = {"step": step, "accumulation": self.accumulation, "new_accumulation": new,
                  "lr_factor": factor}
        self.accumulation, self.lr_factor = new, self.lr_factor * factor
        self.changes.append(change)
        return change

    def state_dict(self):
        return {"accumulation": self.accumulation, "changes": copy.deepcopy(self.changes),
                "lr_factor": self.lr_factor}

    def load_state_dict(self, state):
        self.accumulation, self.lr_factor = state["accumulation"], state["lr_factor"]
        self.changes = copy.deepcopy(state["changes"])


def decay(step):
    """The learning-rate scheduler's own factor (a LambdaLR, as transformers' schedules)."""
    return 1.0 / (1 + step)


def data():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH * BATCHES, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH * BATCHES,), generator=generator))


def by_hand(holder, accumulations, lrs):
    """The tracker's frame of SGD over the batches in order (epoch after epoch), step ``s``
    accumulating ``accumulations[s]`` of them at learning rate ``lrs[s]``."""
    model, tracker = cgn.track(holder, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = data()
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)] * 3
    for step, (count, lr) in enumerate(zip(accumulations, lrs)):
        opt.zero_grad()
        opt.param_groups[0]["lr"] = lr
        for k in range(count):
            xb, yb = batches.pop(0)
            micro = {"micro_batch": k, "micro_batches": count} if count > 1 else {}
            with tracker(step, F.cross_entropy(model(xb), yb, reduction="none"),
                         optimizer=opt, **micro) as loss:
                loss.backward()
        opt.step()
    return tracker.frame()


# ---------------------------------------------------------------- Lightning


def _recorder():
    """A callback that records each optimizer step's micro-batches and learning rate."""
    import lightning.pytorch as pl

    class Recorder(pl.Callback):
        def __init__(self):
            self.micro, self.lr = defaultdict(int), {}

        def on_before_backward(self, trainer, pl_module, loss):
            self.micro[trainer.global_step] += 1

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lr[trainer.global_step] = optimizer.param_groups[0]["lr"]

    return Recorder()


def _fit(net, callback, tmp_path, max_steps, ckpt_path=None, scheduler=True):
    import lightning.pytorch as pl

    module = _lightning_module(net)
    if scheduler:
        def configure_optimizers():
            opt = torch.optim.SGD(module.parameters(), lr=LR)
            lambdas = torch.optim.lr_scheduler.LambdaLR(opt, decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": lambdas, "interval": "step"}}
        module.configure_optimizers = configure_optimizers
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()),
                                         batch_size=BATCH)  # in order
    recorder = _recorder()
    checkpoints = pl.callbacks.ModelCheckpoint(  # step 4 ends the first epoch
        dirpath=tmp_path / "checkpoints", filename="{step}", every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback, recorder, checkpoints],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return recorder


def expected_lrs(scheduler=True):
    return [LR * factor * (decay(step) if scheduler else 1.0)
            for step, factor in enumerate(EXPECTED_FACTOR)]


@pytest.mark.parametrize("scheduler", [False, True])
def test_lightning_accumulates_what_the_schedule_says_where_the_epoch_allows(tmp_path, scheduler):
    """The micro-batches of each step follow the schedule, a change held back until the
    batches done in the epoch are a multiple of the new number, the learning rate with it
    (and kept through a LambdaLR); the numbers are those of the same steps by hand."""
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    net = mlp()
    holder = _holder(net)  # a copy before training
    callback = TrackingCallback(every=1, schedule=Scripted())
    recorder = _fit(net, callback, tmp_path, STEPS, scheduler=scheduler)
    assert [recorder.micro[s] for s in range(STEPS)] == EXPECTED_K
    lrs = [recorder.lr[s] for s in range(STEPS)]
    torch.testing.assert_close(lrs, expected_lrs(scheduler), rtol=4 * 2.0**-52, atol=0)
    assert [(a["step"], a["accumulation"], a["decided"]) for a in callback.driver.applied] == [
        (2, 2, 0), (5, 4, 3), (7, 1, 6)]
    pandas.testing.assert_frame_equal(callback.tracker.frame(), by_hand(holder, EXPECTED_K, lrs),
                                  check_exact=True)


def test_lightning_resumed_from_its_checkpoint_continues_the_same_schedule(tmp_path):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    whole = TrackingCallback(every=1, schedule=Scripted())
    expected = _fit(mlp(), whole, tmp_path / "whole", STEPS)
    first = TrackingCallback(every=1, schedule=Scripted())
    _fit(mlp(), first, tmp_path / "run", 6)
    resumed = TrackingCallback(every=1, schedule=Scripted())
    recorder = _fit(mlp(), resumed, tmp_path / "run", STEPS,
                    ckpt_path=tmp_path / "run" / "checkpoints" / "step=5.ckpt")
    assert dict(recorder.micro) == {s: expected.micro[s] for s in range(5, STEPS)}
    assert recorder.lr == {s: expected.lr[s] for s in range(5, STEPS)}
    assert resumed.driver.schedule.changes == whole.driver.schedule.changes
    assert resumed.driver.applied == whole.driver.applied
    pandas.testing.assert_frame_equal(resumed.tracker.frame(), whole.tracker.frame())


def test_lightning_refuses_a_scheduler_that_would_undo_the_learning_rate(tmp_path):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    module = _lightning_module(mlp())

    def configure_optimizers():
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    import lightning.pytorch as pl

    trainer = pl.Trainer(max_steps=STEPS, callbacks=[TrackingCallback(every=1, schedule=Scripted())],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="OneCycleLR would not keep"):
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)


def test_a_schedule_is_the_interface_of_batch_schedule():
    with pytest.raises(TypeError, match="cgn.BatchSchedule"):
        ScheduleDriver(4)


def test_the_driver_holds_a_change_back_and_keeps_a_tensor_learning_rate_in_place():
    """A tensor learning rate (capturable Adam) is restored in place while the change waits
    and scaled in place when it takes effect, with the scheduler's base learning rates; a
    schedule that leaves the learning rate alone takes any scheduler."""
    parameter = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = torch.optim.Adam([parameter], lr=torch.tensor(0.5, dtype=torch.float64))
    lr = opt.param_groups[0]["lr"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    driver = ScheduleDriver(Scripted({0: 2}))
    assert driver.after_step(0, None, opt, [scheduler], position=1) == 1  # 1 % 2: held
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.5 and driver.applied == []
    assert driver.after_step(1, None, opt, [scheduler], position=2) == 2
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 1.0 and scheduler.base_lrs == [1.0]
    assert driver.applied == [{"step": 2, "accumulation": 2, "lr_factor": 2.0, "decided": 0}]
    unscaled = Scripted()
    unscaled.rule = None
    ScheduleDriver(unscaled).check([torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1.0, total_steps=4)], "here")


# ---------------------------------------------------------------- Hugging Face


HF_SEQUENCES, HF_MICRO = 16, 2  # 8 micro-batches an epoch


def _lambdas(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, decay)


def _hugging_face(tmp_path, max_steps, resume=None, schedule=None, quantities="all",
                  scheduler=_lambdas, epochs=None):
    """A TrackingTrainer with SGD and ``scheduler(opt)`` (``None``: the Trainer's AdamW and linear decay)
    over 16 sequences (shuffled by the Trainer's seed), 2 a micro-batch; a checkpoint every
    4 optimizer steps. Returns the trainer and the micro-batches each optimizer step got."""
    from cockpit_gradnoise.integrations.huggingface import TrackingTrainer

    import transformers

    transformers.logging.set_verbosity_error()
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 19, (HF_SEQUENCES, 6), generator=generator)
    labels[0, 3:] = -100  # padding: ignored tokens
    sequences = [{"input_ids": torch.randint(0, 19, (6,), generator=generator), "labels": row}
                 for row in labels]
    model, tracker = cgn.track(_llama(), every=1, quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen = defaultdict(list)

    class Recording(TrackingTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen[self.state.global_step].append({k: v.clone() for k, v in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, num_train_epochs=epochs or 3,
        per_device_train_batch_size=HF_MICRO,
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=4, logging_strategy="no",
        disable_tqdm=True, max_grad_norm=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers without rules are warned about
        trainer = Recording(tracker=tracker, model=model, args=args, train_dataset=sequences,
                            optimizers=(opt, scheduler(opt)) if scheduler else (None, None),
                            schedule=schedule or Scripted())
        trainer.train(resume_from_checkpoint=resume)
    return trainer, seen


def test_hugging_face_trainer_accumulates_what_the_schedule_says_where_the_epoch_allows(tmp_path):
    """As Lightning's; the numbers are those of the same groups of sequences by hand."""
    from cockpit_gradnoise.integrations.huggingface import per_example_cross_entropy

    trainer, seen = _hugging_face(tmp_path, STEPS)
    assert [len(seen[s]) for s in range(STEPS)] == EXPECTED_K
    logged = trainer.tracker.frame()
    logged = logged[(logged.quantity == "Optimizer") & (logged.statistic == "lr")]
    torch.testing.assert_close(list(logged.sort_values("step").value), expected_lrs(),
                               rtol=4 * 2.0**-52, atol=0)
    assert trainer.args.gradient_accumulation_steps == 1

    model, tracker = cgn.track(_llama(), every=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, lr in enumerate(expected_lrs()):
        opt.zero_grad()
        opt.param_groups[0]["lr"] = lr
        for k, inputs in enumerate(seen[step]):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            losses = per_example_cross_entropy(model(**inputs)["logits"], labels)
            count = len(seen[step])
            micro = {"micro_batch": k, "micro_batches": count} if count > 1 else {}
            with tracker(step, losses, optimizer=opt, **micro) as loss:
                loss.backward()
        opt.step()
    pandas.testing.assert_frame_equal(trainer.tracker.frame(), tracker.frame(), check_exact=True)


def test_hugging_face_trainer_resumed_mid_epoch_continues_the_same_schedule(tmp_path):
    """Resumed from checkpoint-4: six sequences' batches into the epoch, the change to 4
    micro-batches held back (the Trainer alone would count 4 steps of 2 micro-batches done)."""
    whole, expected = _hugging_face(tmp_path / "whole", STEPS)
    _hugging_face(tmp_path / "run", 5)
    resumed, seen = _hugging_face(tmp_path / "run", STEPS,
                                  resume=str(tmp_path / "run" / "checkpoint-4"))
    assert sorted(seen) == list(range(4, STEPS))
    for step in range(4, STEPS):
        assert len(seen[step]) == len(expected[step])
        for got, want in zip(seen[step], expected[step]):
            assert all(torch.equal(got[key], want[key]) for key in want)
    assert resumed.driver.schedule.changes == whole.driver.schedule.changes
    assert resumed.driver.applied == whole.driver.applied
    pandas.testing.assert_frame_equal(resumed.tracker.frame(), whole.tracker.frame(),
                                      check_exact=True)


def test_lightning_with_a_real_batch_schedule_follows_its_changes(tmp_path):
    """cgn.BatchSchedule under quantities="norms" starts at one micro-batch and raises it to
    two after step 0 (its bootstrap: TwoBatchNoiseScale needs two): held back to step 2 (one
    batch done), then each step accumulates what the changes applied say, and the changes
    are in the tracker's log."""
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    schedule = cgn.BatchSchedule(micro_batch=BATCH, max_batch=4 * BATCH, rule="sgd", patience=1)
    callback = TrackingCallback(every=1, quantities="norms", schedule=schedule)
    recorder = _fit(mlp(), callback, tmp_path, STEPS, scheduler=False)
    first = schedule.changes[0]
    assert (first["step"], first["why"], first["new_accumulation"]) == (0, "bootstrap", 2)
    applied = callback.driver.applied
    assert (applied[0]["step"], applied[0]["accumulation"], applied[0]["decided"]) == (2, 2, 0)
    in_effect, lrs = [1] * STEPS, [LR] * STEPS
    for change in applied:
        in_effect[change["step"]:] = [change["accumulation"]] * (STEPS - change["step"])
        lrs[change["step"]:] = [lrs[change["step"]] * change["lr_factor"]] * (STEPS - change["step"])
    assert [recorder.micro[s] for s in range(STEPS)] == in_effect
    assert [recorder.lr[s] for s in range(STEPS)] == lrs
    assert [c["new_accumulation"] for c in schedule.changes] == [a["accumulation"] for a in applied]
    logged = callback.tracker.frame()
    assert set(logged[logged.quantity == "BatchSchedule"].step) == {c["step"] for c in schedule.changes}


def test_hugging_face_trainer_with_a_real_batch_schedule_follows_its_changes(tmp_path):
    """The Trainer's AdamW and linear decay, cgn.BatchSchedule under "norms" (the square-root
    rule, stated: its bootstrap scales the rate, which "auto"'s McCandlish rule keeps without
    an estimate): each step accumulates, and its learning rate is the decay's times the
    factors of, the changes applied so far."""
    schedule = cgn.BatchSchedule(micro_batch=HF_MICRO, max_batch=4 * HF_MICRO, patience=1,
                                 rule="sqrt")
    trainer, seen = _hugging_face(tmp_path, STEPS, schedule=schedule, quantities="norms",
                                  scheduler=None)
    applied = trainer.driver.applied
    assert schedule.changes[0]["why"] == "bootstrap" and applied[0]["step"] == 2
    in_effect, factors = [1] * STEPS, [1.0] * STEPS
    for change in applied:
        in_effect[change["step"]:] = [change["accumulation"]] * (STEPS - change["step"])
        factors[change["step"]:] = [factors[change["step"]] * change["lr_factor"]] * (
            STEPS - change["step"])
    assert [len(seen[s]) for s in range(STEPS)] == in_effect
    assert any(change["lr_factor"] != 1.0 for change in applied)
    logged = trainer.tracker.frame()
    logged = logged[(logged.quantity == "Optimizer") & (logged.statistic == "lr")]
    lr = trainer.args.learning_rate
    expected = [lr * (STEPS - step) / STEPS * factor for step, factor in enumerate(factors)]
    torch.testing.assert_close(list(logged.sort_values("step").value), expected,
                               rtol=8 * 2.0**-52, atol=0)


def test_hugging_face_trainer_refuses_what_would_undo_the_schedule(tmp_path):
    """A scheduler that would undo the learning rate's rescaling, and a resume from a
    checkpoint without the schedule's state (the place in the data unknown)."""
    with pytest.raises(ValueError, match="OneCycleLR would not keep"):
        _hugging_face(tmp_path, STEPS, scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=LR, total_steps=STEPS))
    (tmp_path / "checkpoint-4").mkdir()
    with pytest.raises(ValueError, match="holds no batch schedule state"):
        _hugging_face(tmp_path, STEPS, resume=str(tmp_path / "checkpoint-4"))


def test_hugging_face_trainer_with_epochs_ends_after_them_in_the_steps_they_take(tmp_path):
    """num_train_epochs=2 (16 micro-batches): the growing batch takes 7 optimizer steps, not
    the 16 the Trainer planned at one micro-batch a step."""
    trainer, seen = _hugging_face(tmp_path, -1, epochs=2)
    assert [len(seen[s]) for s in sorted(seen)] == EXPECTED_K[:7]
    assert trainer.state.global_step == 7 and trainer.state.max_steps == 2 * BATCHES
