"""Mixed precision in training loops: a GradScaler (the loop by hand, with gradient
accumulation) and Lightning's ``precision="bf16-mixed"`` and ``"16-mixed"``.

The recipes of ``docs/training-setups.md`` ("Mixed precision"); the statistics of the
low-precision computation itself are checked in ``tests/test_mixed_precision.py``.
"""

import math
import warnings

import cockpit_gradnoise as cgn

import numpy
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers import F32_UNIT, unit_roundoff
from tests.test_integrations import _lightning_module

# GradScaler ------------------------------------------------------------------------


def scaler_run(scale, overflow_at=None, steps=3):
    """Three SGD steps of an MLP, tracked at each, the loss scaled by a GradScaler of
    ``init_scale=scale`` (``None``: no scaler); at ``overflow_at`` a gradient is made inf
    after the backward pass, as an overflow of the scaled loss would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model, tracker = cgn.track(model, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # growth_interval: the scale stays put over the run (no growth), backoff after a skip.
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=opt, scaler=scaler) as loss:
            (loss if scaler is None else scaler.scale(loss)).backward()
            if step == overflow_at:
                next(model.parameters()).grad[0, 0] = math.inf
        optimizer_step(opt, scaler)
    return tracker.frame(), tracker


def test_grad_scaler_gives_the_statistics_of_the_unscaled_loss():
    """``scaler.scale(loss).backward()`` with ``scaler=``: the same statistics as the unscaled run.

    A power-of-two scale changes no rounding (barring overflow and underflow, absent here),
    and dividing by it is exact: the numbers agree to float32's unit roundoff (the one
    rounding a division by another scale would add), relative, where they are not 0."""
    unscaled, _ = scaler_run(None)
    scaled, _ = scaler_run(1024.0)
    assert set(scaled.quantity) - set(unscaled.quantity) == {"GradScaler"}
    rows = scaled[scaled.quantity == "GradScaler"]
    assert list(rows.value[rows.statistic == "scale"]) == [1024.0] * 3
    assert list(rows.value[rows.statistic == "skipped"]) == [0.0] * 3
    key = ["step", "quantity", "param", "statistic"]
    merged = unscaled.merge(scaled[scaled.quantity != "GradScaler"], on=key, suffixes=("", "_scaled"))
    assert len(merged) == len(unscaled) > 0
    finite = numpy.isfinite(merged.value)
    assert (numpy.isfinite(merged.value_scaled) == finite).all()
    # inf (a B_simple of a negative |G|^2 estimate) and NaN where the unscaled run has them.
    same = merged.value[~finite] == merged.value_scaled[~finite]
    assert (same | (merged.value[~finite].isna() & merged.value_scaled[~finite].isna())).all()
    difference = (merged.value_scaled[finite] - merged.value[finite]).abs()
    assert (difference <= F32_UNIT * merged.value[finite].abs()).all()


def test_a_step_the_scaler_skips_is_recorded_as_skipped():
    """A step with an inf gradient: no rows of the quantities (no NaN), ``GradScaler``
    ``skipped = 1`` with its scale; the scaler skipped the optimizer's step."""
    frame, tracker = scaler_run(1024.0, overflow_at=1)
    quantities = frame[frame.quantity != "GradScaler"]
    assert set(quantities.step) == {0, 2}
    assert quantities.value.notna().all()
    rows = frame[frame.quantity == "GradScaler"].pivot(index="step", columns="statistic", values="value")
    assert list(rows.skipped) == [0.0, 1.0, 0.0]
    assert list(rows.scale) == [1024.0, 1024.0, 512.0]  # backed off after the skip
    report = tracker.report()
    assert "the GradScaler skipped 1 of 3 tracked steps (inf/NaN scaled gradients; no rows there): steps 1" in report


def test_a_scaler_with_an_unscaled_backward_is_refused():
    model, tracker = cgn.track(nn.Sequential(nn.Linear(4, 3)), every=1)
    losses = F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,)), reduction="none")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(RuntimeError, match=r"scaler.scale\(loss\).backward\(\)"):
        with tracker(0, losses, scaler=scaler) as loss:
            loss.backward()


# Lightning -------------------------------------------------------------------------


def lightning_data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(4)]


def mlp32():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def by_hand_under_autocast(dtype, scaler=None):
    """The tracker's frame of an SGD loop whose forward pass and losses run under
    ``torch.autocast("cpu", dtype)`` (``None``: without), as Lightning's mixed precision runs them."""
    holder = nn.Module()  # the LightningModule's names: net.0.weight, ...
    holder.net = mlp32()
    holder.forward = holder.net.forward
    model, tracker = cgn.track(holder, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(lightning_data()):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            losses = F.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=opt, scaler=scaler) as loss:
            (loss if scaler is None else scaler.scale(loss)).backward()
        optimizer_step(opt, scaler)
    return tracker.frame()


def optimizer_step(opt, scaler):
    """``opt.step()``, or through ``scaler`` (which may skip it) and its update."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def lightning_fit(tmp_path, **trainer_options):
    from cockpit_gradnoise.integrations.lightning import TrackingCallback

    import lightning.pytorch as pl

    data = lightning_data()
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    callback = TrackingCallback(every=1, tensorboard=False)
    trainer = pl.Trainer(max_steps=len(data), callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         **trainer_options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        trainer.fit(_lightning_module(mlp32()), torch.utils.data.DataLoader(dataset, batch_size=8))
    return callback.tracker.frame()


def assert_frames_close(got, expected, rtol):
    """Same rows; every number within ``rtol`` relative (inf and NaN where the other has them)."""
    key = ["step", "quantity", "param", "statistic"]
    merged = expected.merge(got, on=key, how="outer", suffixes=("", "_got"), indicator=True)
    assert set(merged["_merge"]) == {"both"}
    finite = numpy.isfinite(merged.value)
    assert (numpy.isfinite(merged.value_got) == finite).all()
    difference = (merged.value_got[finite] - merged.value[finite]).abs()
    return bool((difference <= rtol * merged.value[finite].abs()).all())


def test_lightning_bf16_mixed_tracks_the_numbers_of_the_same_loop_under_autocast(tmp_path):
    """``Trainer(precision="bf16-mixed")``: Lightning runs ``training_step`` under bfloat16
    autocast and the backward pass outside it, as the loop by hand does: the same
    computation, so the numbers agree to one unit roundoff of bfloat16 (``2**-8``, relative;
    a reordering of the low-precision arithmetic would show at that scale). The float32 loop
    differs by more: the comparison sees whether autocast was on."""
    got = lightning_fit(tmp_path, precision="bf16-mixed")
    unit = unit_roundoff(torch.bfloat16)
    assert assert_frames_close(got, by_hand_under_autocast(torch.bfloat16), unit)
    assert not assert_frames_close(got, by_hand_under_autocast(None), unit)
    assert set(got.step) == {0, 1, 2, 3}


def test_lightning_16_mixed_with_its_grad_scaler(tmp_path):
    """float16 autocast with Lightning's GradScaler (its MixedPrecision plugin, here on the
    CPU): the scale is divided out, as in the loop by hand with the same scaler."""
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    got = lightning_fit(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    expected = by_hand_under_autocast(
        torch.float16, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000))
    assert assert_frames_close(got, expected, unit_roundoff(torch.float16))
    rows = got[(got.quantity == "GradScaler") & (got.statistic == "scale")]
    assert list(rows.value) == [1024.0] * 4


def test_a_gradient_left_from_an_earlier_step_is_told_under_a_scaler():
    """The scaler's ``param.grad`` is put back after the quantities computed, and they
    still see a gradient no backward pass changed since the last tracked step as stale."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 3), "b": nn.Linear(4, 3)})
    model, tracker = cgn.track(model, every=1, quantities=["ParamGradRatio"])
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    for step in range(2):
        model["a"].zero_grad()  # "b" is used and zeroed at step 0 only
        out = model["a"](x) + (model["b"](x) if step == 0 else 0)
        grad_b = model["b"].weight.grad
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracker(step, F.cross_entropy(out, y, reduction="none"), scaler=scaler) as loss:
                scaler.scale(loss).backward()
        if step == 1:
            assert model["b"].weight.grad is grad_b  # the tensor itself, as it was
        stale = [w for w in caught if "got no gradient from the backward pass" in str(w.message)]
        assert len(stale) == step  # told at step 1, about b's parameters
    assert "'b.weight'" in str(stale[0].message)


def accumulated_scaler_run(scale, steps=2, sizes=(3, 5)):
    """:func:`scaler_run` with gradient accumulation: micro-batches of ``sizes`` per step,
    the tracker around each, every micro-batch's loss scaled by the same GradScaler."""
    torch.manual_seed(0)
    model, tracker = cgn.track(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    generator = torch.Generator().manual_seed(2)
    for step in range(steps):
        opt.zero_grad()
        for k, n in enumerate(sizes):
            x, y = torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)
            losses = F.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=opt, scaler=scaler, micro_batch=k,
                         micro_batches=len(sizes)) as loss:
                (loss if scaler is None else scaler.scale(loss)).backward()
        optimizer_step(opt, scaler)
    return tracker.frame()


def test_grad_scaler_under_gradient_accumulation_gives_the_unscaled_statistics():
    """Each micro-batch's scaled backward pass unscaled: the accumulated step's numbers equal
    the unscaled run's to float32's unit roundoff, as without accumulation."""
    unscaled, scaled = accumulated_scaler_run(None), accumulated_scaler_run(1024.0)
    key = ["step", "quantity", "param", "statistic"]
    merged = unscaled.merge(scaled[scaled.quantity != "GradScaler"], on=key, suffixes=("", "_scaled"))
    assert len(merged) == len(unscaled) > 0
    assert set(merged.step) == {0, 1}
    finite = numpy.isfinite(merged.value)
    assert (numpy.isfinite(merged.value_scaled) == finite).all()
    difference = (merged.value_scaled[finite] - merged.value[finite]).abs()
    assert (difference <= F32_UNIT * merged.value[finite].abs()).all()
