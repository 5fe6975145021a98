"""The ``"norms"`` preset's cadence: with ``every=1`` the noise scale at every step,
ParamGradRatio and UpdateSize at every 10th (``PRESET_OPTIONS``), each record exact there
(float64 by hand, ``math.fsum``), a quantity's own ``"every"`` option, and the report that
names each quantity's step."""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities import presets

import pytest
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 13
K = 2  # micro-batches per step: TwoBatchNoiseScale needs two small batches


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def run(every=1, options=None, steps=STEPS):
    """Train ``steps`` steps of AdamW under ``"norms"``; the tracker and the parameters (float64
    copies) and gradients at each step, before its optimizer step."""
    model, tracker = cgn.track(mlp(), every=every, quantities="norms", options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        for k in range(K):
            x = torch.randn(4, 3, generator=generator, dtype=torch.float64)
            y = torch.randint(0, 2, (4,), generator=generator)
            losses = F.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=optimizer, micro_batch=k, micro_batches=K) as loss:
                loss.backward()
        seen.append({name: (p.detach().double().clone(), p.grad.double().clone())
                     for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return tracker, seen


def steps_of(tracker):
    frame = tracker.frame()
    return {q: sorted(int(s) for s in set(frame[frame.quantity == q].step))
            for q in ("TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize")}


def fsum_sq(tensor):
    return math.fsum(v * v for v in tensor.reshape(-1).tolist())


def test_every_step_the_noise_scale_every_tenth_the_weights_quantities_exact_there():
    tracker, seen = run()
    assert steps_of(tracker) == {"TwoBatchNoiseScale": list(range(STEPS)),
                                 "ParamGradRatio": [0, 10], "UpdateSize": [0, 10]}
    for step in (0, 10):
        ratio = tracker.cockpit.quantities[1].output[step]
        update = {u.name: u for u in tracker.cockpit.quantities[2].output[step]}
        for name, (theta, grad) in seen[step].items():
            # ||theta|| / ||grad|| and ||theta(s+1) - theta(s)||: float64 sums of at most 8
            # terms and one subtraction per element, 1e-12 relative bounds their rounding.
            expected = math.sqrt(fsum_sq(theta)) / math.sqrt(fsum_sq(grad))
            assert ratio[name][schema.NORM_RATIO] == pytest.approx(expected, rel=1e-12)
            moved = seen[step + 1][name][0] - theta
            assert update[name].norm == pytest.approx(math.sqrt(fsum_sq(moved)), rel=1e-12)
            assert update[name].start_norm == pytest.approx(math.sqrt(fsum_sq(theta)), rel=1e-12)


def test_a_quantitys_own_every_overrides_the_presets_and_a_sparser_tracker_keeps_its_steps():
    tracker, _ = run(options={"ParamGradRatio": {"every": 1}, "UpdateSize": {"every": 4}})
    assert steps_of(tracker) == {"TwoBatchNoiseScale": list(range(STEPS)),
                                 "ParamGradRatio": list(range(STEPS)), "UpdateSize": [0, 4, 8]}  # 12's: no 13
    # With every=3 the preset is as the others: every quantity at the tracker's steps.
    tracker, _ = run(every=3, steps=8)
    assert steps_of(tracker) == dict.fromkeys(("TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"),
                                              [0, 3, 6])  # UpdateSize's step 6 ends at step 7
    # A quantity's "every" runs it at the steps both schedules track.
    tracker, _ = run(every=2, options={"ParamGradRatio": {"every": 3}}, steps=8)
    assert steps_of(tracker)["ParamGradRatio"] == [0, 6]


def test_configuration_gives_the_same_schedules_and_a_bad_every_is_refused_before_building():
    built = {type(q).__name__: q for q in cgn.configuration("norms", every=1, model=mlp())}
    tracked = {name: [s for s in range(25) if q._track_schedule(s)] for name, q in built.items()}
    assert tracked == {"TwoBatchNoiseScale": list(range(25)), "ParamGradRatio": [0, 10, 20],
                       "UpdateSize": [0, 10, 20]}
    assert presets.PRESET_OPTIONS["norms"]["ParamGradRatio"]["every"] == presets.NORMS_DETAIL_EVERY
    model = mlp()
    with pytest.raises(ValueError, match="every must be a positive int"):
        cgn.track(model, every=1, quantities="norms", options={"UpdateSize": {"every": 0}})
    assert not hasattr(model, "_cgn_switch")  # refused before the model was prepared


def test_the_report_names_the_step_each_quantity_is_read_at():
    tracker, _ = run()
    report = tracker.report()
    assert "step 12 (ParamGradRatio from step 10, UpdateSize from step 10)" in report
