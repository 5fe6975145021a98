"""The training tools: Lightning's Trainer, Hugging Face's Trainer, TensorBoard.

The recipes of ``docs/training-setups.md``, run here in full.

Each runs the very same computation as a hand-written loop over the tracker
(the same model, batches, forward, mean and backward), so their numbers are
compared for equality with that loop, whose numbers the rest of the suite
checks against the float64 references.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs.loggers import logger_for, scalars

import pandas
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import without_quantities

BATCH, STEPS, EVERY = 6, 4, 2


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=generator, dtype=torch.float64),
             torch.randint(0, 3, (BATCH,), generator=generator)) for _ in range(STEPS)]


def train(model, tracker, data, lr=0.1):
    """A plain SGD loop over ``data``, every step inside the tracker's ``with``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        with tracker(step, F.cross_entropy(model(x), y, reduction="none"), optimizer=opt) as loss:
            loss.backward()
        opt.step()


def by_hand(model, data):
    """The tracker's frame of :func:`train` over ``data``."""
    model, tracker = cgn.track(model, every=EVERY)
    train(model, tracker, data)
    return tracker.frame()


def train_accumulated(model, tracker, data, count, lr=0.1):
    """SGD over groups of ``count`` batches, every batch of a group tracked as one of its
    micro-batches; a shorter last group untracked, its losses divided by ``count`` (Lightning's
    rule)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    groups = [data[start : start + count] for start in range(0, len(data), count)]
    for step, group in enumerate(groups):
        opt.zero_grad()
        for k, (x, y) in enumerate(group):
            losses = F.cross_entropy(model(x), y, reduction="none")
            if len(group) < count:
                (losses.mean() / count).backward()
                continue
            with tracker(step, losses, optimizer=opt, micro_batch=k, micro_batches=count) as loss:
                loss.backward()
        opt.step()


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_gets_every_number_of_every_tracked_step_under_stable_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model, tracker = cgn.track(mlp(), every=EVERY)
    writer = SummaryWriter(tmp_path)
    tracker.log_to(writer)
    train(model, tracker, batches())
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    logged = pandas.DataFrame(
        [(event.step, tag, event.value) for tag in events.Tags()["scalars"]
         for event in events.Scalars(tag)], columns=["step", "tag", "logged"])
    frame = tracker.frame()
    frame["tag"] = (frame["quantity"].astype(str) + "/" + frame["param"].astype(str) + "/"
                    + frame["statistic"].astype(str))
    both = frame.merge(logged, on=["step", "tag"], how="outer", indicator=True)
    assert set(both["_merge"]) == {"both"}  # every number, nothing else
    assert set(frame["step"]) == {0, 2}
    assert "GradientNoiseScale/all/b_simple" in set(logged["tag"])
    # TensorBoard stores float32.
    assert equal_in_float32(both["logged"], both["value"].astype("float32"))


def equal_in_float32(a, b):
    import numpy

    return numpy.array_equal(numpy.asarray(a, dtype="float32"), numpy.asarray(b, dtype="float32"),
                             equal_nan=True)


def test_a_function_gets_each_step_once_and_a_bad_target_is_refused():
    model, tracker = cgn.track(mlp(), every=EVERY)
    seen = []
    tracker.log_to(lambda step, output: seen.append((step, sorted(output))))
    train(model, tracker, batches())
    given = pandas.DataFrame([(s, q) for s, names in seen for q in names], columns=["s", "q"])
    assert not given.duplicated().any()
    stored = {(s, q) for s, quantities in tracker.get_output().items() for q in quantities}
    assert set(map(tuple, given.to_numpy())) == stored
    with pytest.raises(TypeError, match="SummaryWriter"):
        logger_for(3)


def test_scalars_leave_out_what_is_not_stored_per_parameter():
    output = {"GradNorm": [1.0, 2.0], "ParamGradRatio": {"w": {"ratio": float("inf")}}}
    assert list(scalars(5, output)) == [("ParamGradRatio/w/ratio", float("inf"))]


# ---------------------------------------------------------------- Lightning


def _lightning_module(net):
    import lightning.pytorch as pl

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = F.cross_entropy(self(x), y, reduction="none")
            self.per_example_losses = losses
            return losses.mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier()


def _holder(net):
    """A module whose parameters are named as the LightningModule's (net.0.weight, ...)."""
    holder = nn.Module()
    holder.net = copy.deepcopy(net)
    holder.forward = holder.net.forward
    return holder


def _fit(module, callback, tmp_path, max_steps=STEPS, **trainer_options):
    import lightning.pytorch as pl

    data = batches()
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]),
                                             torch.cat([y for _, y in data]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)  # in order
    trainer = pl.Trainer(
        max_steps=max_steps, callbacks=[callback], logger=pl.loggers.TensorBoardLogger(tmp_path),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, **trainer_options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
        warnings.filterwarnings("always", message="TrackingCallback")  # but the callback's
        trainer.fit(module, loader)
    return trainer


def test_lightning_tracks_the_numbers_of_the_same_loop_by_hand_and_writes_the_log(tmp_path):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    net = mlp()
    expected = by_hand(_holder(net), batches())
    callback = TrackingCallback(every=EVERY, log=tmp_path / "cgn")
    trainer = _fit(_lightning_module(net), callback, tmp_path)
    pandas.testing.assert_frame_equal(callback.tracker.frame(), expected)
    # Parameter names are the LightningModule's.
    assert set(expected["param"]) == {"net.0.weight", "net.0.bias", "net.2.weight",
                                      "net.2.bias", "all"}
    pandas.testing.assert_frame_equal(cgn.to_frame(tmp_path / "cgn.json"), expected)
    assert trainer.logger.experiment.log_dir  # the TensorBoard logger got the scalars
    assert any(path.name.startswith("events") for path in tmp_path.rglob("*"))


@pytest.mark.parametrize("count, epochs", [(2, 2), (3, 1)])
def test_lightning_accumulate_grad_batches_tracks_the_accumulated_batch_as_by_hand(
        tmp_path, count, epochs):
    """4 batches an epoch: with 2 micro-batches two full steps per epoch; with 3 a full step and
    a last step of 1 batch, which Lightning divides by 3 all the same: not tracked, one warning."""
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    net = mlp()
    holder = _holder(net)
    model, tracker = cgn.track(holder, every=1)
    train_accumulated(model, tracker, batches() * epochs, count)
    expected = tracker.frame()
    callback = TrackingCallback(every=1)
    steps = epochs * -(-STEPS // count)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _fit(_lightning_module(net), callback, tmp_path, max_steps=steps,
             accumulate_grad_batches=count)
    short = [r for r in records if "fewer than accumulate_grad_batches" in str(r.message)]
    assert len(short) == (count == 3)
    pandas.testing.assert_frame_equal(callback.tracker.frame(), expected)
    tracked = set(range(steps)) if count == 2 else {0}
    assert set(expected["step"]) == tracked


@pytest.mark.parametrize("options, match", [
    ({"precision": "bf16-true"}, "precision='bf16-true' is not supported"),
])
def test_lightning_setups_not_supported_yet_are_refused_before_training(tmp_path, options, match):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    with pytest.raises(ValueError, match=match):
        _fit(_lightning_module(mlp()), TrackingCallback(every=EVERY), tmp_path, **options)


def test_lightning_without_per_example_losses_names_the_fix(tmp_path):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    module = _lightning_module(mlp())
    module.training_step = lambda batch, batch_idx: F.cross_entropy(module(batch[0]), batch[1])
    with pytest.raises(ValueError, match="self.per_example_losses = losses"):
        _fit(module, TrackingCallback(every=EVERY), tmp_path)


# ---------------------------------------------------------------- Hugging Face


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=19, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=8)
    return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("accumulation, scaled", [(1, False), (2, False), (2, True)])
def test_hugging_face_trainer_tracks_the_numbers_of_the_same_step_by_hand(tmp_path, accumulation, scaled):
    """One optimizer step of 8 sequences: one batch, or 2 micro-batches of 4 (then each
    micro-batch tracked with micro_batch=k, micro_batches=2). ``scaled``: Accelerate's
    GradScaler, as with fp16 on GPUs (its backward is ``scaler.scale(loss).backward()``),
    given to the Trainer's Accelerator on CPUs: divided out, logged under ``GradScaler``."""
    from cockpit_gradnoise.integrations.huggingface import (
        TrackingTrainer,
        per_example_cross_entropy,
    )

    import transformers

    transformers.logging.set_verbosity_error()
    model = _llama()
    initial = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 19, (8, 6), generator=generator)
    labels[0, 3:] = -100  # padding: ignored tokens
    data = [{"input_ids": torch.randint(0, 19, (6,), generator=generator), "labels": row}
            for row in labels]
    seen = []

    class Recording(TrackingTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            seen.append({key: value.clone() for key, value in inputs.items()})
            return super().compute_loss(model, inputs, *args, **kwargs)

    model, tracker = cgn.track(model, every=EVERY)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers without rules are warned about
        trainer = Recording(tracker=tracker, model=model, args=args, train_dataset=data)
        if scaled:  # before train(), whose prepare gives it to the AcceleratedOptimizer
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        trainer.train()

        initial, by_hand_tracker = cgn.track(initial, every=EVERY)
        for k, inputs in enumerate(seen):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            losses = per_example_cross_entropy(initial(**inputs)["logits"], labels)
            micro = {"micro_batch": k, "micro_batches": accumulation} if accumulation > 1 else {}
            with by_hand_tracker(0, losses, **micro) as loss:
                loss.backward()
    assert len(seen) == accumulation
    frame = tracker.frame()
    assert set(frame["step"]) == {0}
    expected = by_hand_tracker.frame()
    # The Trainer's AdamW (wrapped by Accelerate) is logged under its own name.
    logged = frame[frame["quantity"] == "Optimizer"]
    assert set(logged["statistic"]) == {"class:AdamW", "lr"}
    # UpdateSize needs the optimizer step the hand-written step did not take, which
    # was given no optimizer.
    if scaled:
        logged = frame[frame["quantity"] == "GradScaler"]
        assert dict(zip(logged["statistic"], logged["value"])) == {"scale": 2.0**10, "skipped": 0.0}
    pandas.testing.assert_frame_equal(without_quantities(frame, ("UpdateSize", "Optimizer", "GradScaler")),
                                      without_quantities(expected, ("UpdateSize",)))


def test_per_example_cross_entropy_of_a_padded_batch_has_the_trainers_loss_as_mean():
    from cockpit_gradnoise.integrations.huggingface import per_example_cross_entropy

    torch.manual_seed(3)
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5))
    labels[1, 2:] = -100
    got = per_example_cross_entropy(logits, labels)
    # The mean over all labelled tokens, each predicting the next.
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    bound = 2 * labels.numel() * 2.0**-52 * expected.item()
    assert abs(got.mean().item() - expected.item()) <= bound
    classification = per_example_cross_entropy(logits[:, 0], labels[:, 0].clamp(min=0))
    torch.testing.assert_close(
        classification, F.cross_entropy(logits[:, 0], labels[:, 0].clamp(min=0), reduction="none"))
