"""Lightning's and Hugging Face's Trainers resumed from their own checkpoints (issue 35).

Each run is stopped after some optimizer steps (``max_steps``), its checkpoint
taken by the Trainer, and a new Trainer resumes from it to the end; its log
equals, number for number, that of the same run never stopped. Both stop at
the end of an epoch: the batches after the resume are then those of a run that
never stopped (unshuffled). The set-ups are those of tests/test_integrations.py,
with gradient accumulation (2 micro-batches per step). The calls that
docs/training-setups.md ("Resuming a run") shows are made here.
"""

import warnings

import cockpit_gradnoise as cgn

import pandas
import pytest
import torch

from tests.test_integrations import _lightning_module, _llama, batches, mlp

ACCUMULATE, LIGHTNING_STEPS = 2, 4  # 4 batches an epoch: 2 optimizer steps an epoch


def _lightning(callback, tmp_path, max_steps, ckpt_path=None):
    """Fit over 4 batches an epoch, unshuffled; a checkpoint every 2 optimizer steps."""
    import lightning.pytorch as pl

    data = batches()
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]),
                                             torch.cat([y for _, y in data]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=len(data[0][0]))  # in order
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}",
                                               every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        max_steps=max_steps, accumulate_grad_batches=ACCUMULATE,
        callbacks=[callback, checkpoints], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        trainer.fit(_lightning_module(mlp()), loader, ckpt_path=ckpt_path)


@pytest.mark.parametrize("log", ["cgn", "cgn.jsonl"])
def test_lightning_resumed_from_its_checkpoint_logs_what_a_run_never_stopped_logs(tmp_path, log):
    """Stopped after 3 optimizer steps, resumed from the checkpoint after step 2 (whose
    step 1 UpdateSize ends after the resume). A JSON log is written at the end of each fit,
    the steps before the checkpoint from the tracker's state; a streamed one is continued,
    the steps the first fit logged after the checkpoint superseded."""
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    whole = TrackingCallback(every=1, log=tmp_path / "whole" / log)
    _lightning(whole, tmp_path / "whole", LIGHTNING_STEPS)
    first = TrackingCallback(every=1, log=tmp_path / "run" / log)
    _lightning(first, tmp_path / "run", LIGHTNING_STEPS - 1)
    assert set(first.tracker.frame().step) == {0, 1, 2}
    resumed = TrackingCallback(every=1, log=tmp_path / "run" / log)
    _lightning(resumed, tmp_path / "run", LIGHTNING_STEPS,
               ckpt_path=tmp_path / "run" / "checkpoints" / "step=2.ckpt")

    expected = whole.tracker.frame()
    assert set(expected.step) == set(range(LIGHTNING_STEPS))
    assert 1 in set(expected[expected.quantity == "UpdateSize"].step)
    pandas.testing.assert_frame_equal(resumed.tracker.frame(), expected, check_exact=True)
    pandas.testing.assert_frame_equal(cgn.to_frame(tmp_path / "run" / log),
                                      cgn.to_frame(tmp_path / "whole" / log), check_exact=True)
    if log.endswith(".jsonl"):
        superseded = cgn.read_log(tmp_path / "run" / log).superseded_records()
        assert {(step, q) for step, q, _ in superseded} == {
            (2, "GradientNoiseScale"), (2, "GradientVarianceQuantiles"), (2, "ParamGradRatio"),
            (2, "PerExampleGradNorm"), (2, "Optimizer"), (1, "UpdateSize")}


HF_STEPS = 4  # 16 sequences, 4 a micro-batch, 2 micro-batches a step: 2 steps an epoch


def _hugging_face(tmp_path, max_steps, resume=None):
    """A TrackingTrainer over 16 sequences (shuffled by the Trainer's seed); a checkpoint
    every 2 optimizer steps. Returns the tracker."""
    from cockpit_gradnoise.integrations.huggingface import TrackingTrainer

    import transformers

    transformers.logging.set_verbosity_error()
    generator = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 19, (16, 6), generator=generator)
    labels[0, 3:] = -100  # padding: ignored tokens
    data = [{"input_ids": torch.randint(0, 19, (6,), generator=generator), "labels": row}
            for row in labels]
    model, tracker = cgn.track(_llama(), every=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATE, report_to=[], use_cpu=True,
        save_strategy="steps", save_steps=2, logging_strategy="no", disable_tqdm=True,
        lr_scheduler_type="constant")  # a run stopped early (max_steps) trains as the whole
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers without rules are warned about
        trainer = TrackingTrainer(tracker=tracker, model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
    return tracker


def test_hugging_face_trainer_resumed_from_its_checkpoint_logs_what_a_run_never_stopped_logs(
        tmp_path):
    """Stopped after 3 optimizer steps, resumed from checkpoint-2: the tracker's state came
    in the checkpoint folder, the Trainer skips the batches seen."""
    expected = _hugging_face(tmp_path / "whole", HF_STEPS).frame()
    _hugging_face(tmp_path / "run", HF_STEPS - 1)
    resumed = _hugging_face(tmp_path / "run", HF_STEPS,
                            resume=str(tmp_path / "run" / "checkpoint-2")).frame()
    assert set(expected.step) == set(range(HF_STEPS))
    assert 1 in set(expected[expected.quantity == "UpdateSize"].step)
    pandas.testing.assert_frame_equal(resumed, expected, check_exact=True)
