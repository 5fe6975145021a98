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

from tests.test_integrations import _lightning_module, batches, mlp

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
            (2, "PerExampleGradNorm"), (1, "UpdateSize")}

