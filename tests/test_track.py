"""The front door: ``cgn.track``, the ``with tracker(step, losses)`` line, ``cgn.report``.

The front door and quantities built by hand (the explicit API) run the very
same computation on the same model and batches (the same forward, the same
``losses.mean()``, the same BackPACK extensions), so their numbers are
compared for equality. The front-door snippets of ``README.md`` and
``docs/getting-started.md`` run as they are written.
"""

import contextlib
import copy
import io
import subprocess
import sys
import types
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import cockpit_gradnoise as cgn  # noqa: E402
from cockpit_gradnoise.quantities.presets import ALL, PRESETS  # noqa: E402
from cockpit_gradnoise.views.report import build_report, format_report  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402

from tests.helpers import without_quantities  # noqa: E402
from tests.test_docs import README, code_blocks  # noqa: E402
from tests.tracking_runs import STEPS, assert_same_numbers, batches, by_hand, classes_of, front_door, tiny_model  # noqa: E402

GETTING_STARTED = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"


def front_door_block(path):
    (block,) = [b for b in code_blocks(path) if b.language == "python" and "cgn.track(" in b.code]
    return block


@pytest.mark.parametrize("path", [README, GETTING_STARTED], ids=lambda p: p.name)
def test_the_documented_front_door_runs_as_written_and_tracks_what_the_explicit_api_does(
    path, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    data = batches()
    namespace = {"make_model": tiny_model, "loader": data}
    block = front_door_block(path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        exec(compile("\n" * (block.line - 1) + block.code, str(path), "exec"), namespace)
    tracker = namespace["tracker"]
    assert_same_numbers(tracker, by_hand(tiny_model(), data, linear(1), classes_of(ALL)))
    assert cgn.to_frame("runs/demo.json").equals(tracker.frame())
    assert set(tracker.frame().quantity) == {*ALL, "Optimizer"}
    if "cgn.report(" in block.code:
        assert printed.getvalue() == cgn.report("runs/demo.json", batch_size=32) + "\n"


@pytest.mark.parametrize("every", [1, 2, "function"])
@pytest.mark.parametrize("preset", ["all", "cheap", "list"])
def test_every_preset_and_schedule_give_the_numbers_of_quantities_built_by_hand(every, preset):
    schedule = (lambda step: step in (0, 3)) if every == "function" else linear(every)
    names = ["ParamGradRatio", "GradientNoiseScale"] if preset == "list" else PRESETS[preset]
    quantities = names if preset == "list" else preset
    tracker = front_door(tiny_model(), batches(), every=schedule if every == "function" else every,
                         quantities=quantities)
    assert_same_numbers(tracker, by_hand(tiny_model(), batches(), schedule, classes_of(names)))
    frame = tracker.frame()
    assert set(frame.quantity) == {*names, "Optimizer"}  # the tracker logs its optimizer too
    expected_steps = {0, 3} if every == "function" else set(range(0, STEPS, every))
    assert set(frame[frame.quantity != "UpdateSize"].step) == expected_steps


def test_the_presets():
    assert PRESETS["all"] == ALL == ("GradientVarianceQuantiles", "PerExampleGradNorm",
                                     "ParamGradRatio", "UpdateSize", "GradientNoiseScale")
    assert PRESETS["cheap"] == ALL[1:]
    built = cgn.configuration("cheap", 3, tiny_model())
    assert [type(q).__name__ for q in built] == list(ALL[1:])
    assert all(q.should_compute(3) and not q.should_compute(2) for q in built[:2])


def test_quantiles_and_options_reach_their_quantities():
    quantiles = (0.1, 0.5, 0.9)
    tracker = front_door(tiny_model(), batches(), quantiles=quantiles,
                         options={"GradientNoiseScale": {"smoothing": 0.5}})
    by_name = {type(q).__name__: q for q in tracker.cockpit.quantities}
    assert by_name["GradientNoiseScale"].smoothing == 0.5
    assert_same_numbers(
        front_door(tiny_model(), batches(), quantities=[ALL[0]], quantiles=quantiles),
        by_hand(tiny_model(), batches(), linear(1), classes_of(ALL[:1]), quantiles=quantiles),
    )
    statistics = set(tracker.frame().query("quantity == 'GradientVarianceQuantiles'").statistic)
    assert {"q0.1", "q0.5", "q0.9"} <= statistics and "q0.25" not in statistics


def test_a_sum_reduced_loss_gives_the_numbers_of_the_explicit_api():
    assert_same_numbers(
        front_door(tiny_model(), batches(), reduction="sum"),
        by_hand(tiny_model(), batches(), linear(1), classes_of(ALL), reduction="sum"),
    )


def test_a_loss_given_is_used_when_it_is_the_mean_or_the_sum():
    model, tracker = cgn.track(tiny_model(), every=1)
    explicit = by_hand(tiny_model(), batches(steps=2), linear(1), classes_of(ALL))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(batches(steps=2)):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        mean = F.cross_entropy(model(x), y)  # a second forward: another tensor, the same value
        with tracker(step, losses.detach(), loss=mean, optimizer=opt, batch_size=len(x)) as loss:
            assert loss is mean
            loss.backward()
        opt.step()
    got, expected = without_quantities(tracker.frame()), cgn.to_frame(explicit)
    # Another loss kernel: the same rows, values to rounding.
    assert got[["step", "quantity", "param", "statistic"]].equals(
        expected[["step", "quantity", "param", "statistic"]])
    assert got.value.to_numpy() == pytest.approx(expected.value.to_numpy(), rel=1e-4, nan_ok=True)


def tracker_and_losses(every=1):
    model, tracker = cgn.track(tiny_model(), every=every)
    x, y = batches(steps=1)[0]
    return model, tracker, F.cross_entropy(model(x), y, reduction="none")


def test_a_loss_that_is_neither_the_mean_nor_the_sum_is_refused_naming_the_fix():
    _, tracker, losses = tracker_and_losses()
    with pytest.raises(ValueError, match=r"neither the mean .* nor the sum .* leave loss= out"):
        tracker(0, losses, loss=2 * losses.mean())
    with pytest.raises(ValueError, match="scalar tensor"):
        tracker(0, losses, loss=losses)
    with pytest.raises(ValueError, match="not both"):
        tracker(0, losses, loss=losses.mean(), reduction="mean")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        tracker(0, losses, reduction="max")


@pytest.mark.parametrize("bad, error, match", [
    (lambda losses: losses.reshape(2, -1), ValueError, r"shape \[N\].*losses.mean\(dim=1\)"),
    (lambda losses: losses.mean(), ValueError, r"shape \[N\]"),
    (lambda losses: losses[:0], ValueError, r"N >= 1"),
    (lambda losses: losses.tolist(), TypeError, "losses must be a tensor, got list: .*reduction='none'"),
    (lambda losses: losses.detach(), ValueError, "does not require gradients"),
])
def test_losses_that_are_not_one_per_example_are_refused_naming_the_fix(bad, error, match):
    _, tracker, losses = tracker_and_losses()
    with pytest.raises(error, match=match):
        tracker(0, bad(losses))


def test_a_batch_size_or_info_that_disagrees_is_refused():
    _, tracker, losses = tracker_and_losses()
    with pytest.raises(ValueError, match=r"batch_size=7 but losses holds 8 .* leave batch_size out"):
        tracker(0, losses, batch_size=7)
    with pytest.raises(ValueError, match=r"info= must not hold \['loss'\]"):
        tracker(0, losses, info={"loss": losses.mean()})


def test_the_info_handed_to_cockpit_has_every_key_at_every_step():
    _, tracker, losses = tracker_and_losses(every=2)
    opt = object()
    for step in (0, 1):
        info = tracker(step, losses, optimizer=opt, info={"extra": 1}).info
        assert set(info) == {"batch_size", "individual_losses", "loss", "optimizer", "extra"}
        assert info["batch_size"] == len(losses) and info["individual_losses"] is losses
        assert info["optimizer"] is opt and info["loss"].item() == losses.mean().item()
    assert "optimizer" not in tracker(0, losses).info


def test_a_step_without_backward_or_with_an_error_records_nothing_and_says_why():
    model, tracker = cgn.track(tiny_model(), every=1)
    x, y = batches(steps=1)[0]

    def losses():
        model.zero_grad()
        return F.cross_entropy(model(x), y, reduction="none")

    with pytest.raises(RuntimeError, match=r"step 0: call loss.backward\(\) inside"):
        with tracker(0, losses()):
            pass
    with pytest.raises(ZeroDivisionError):  # the body's own error, not a tracking one
        with tracker(1, losses()) as loss:
            loss.backward()
            1 / 0
    assert tracker.frame().empty
    with tracker(2, losses()) as loss:  # the tracker still works
        loss.backward()
    assert set(tracker.frame().step) == {2}


def test_a_multiple_of_the_loss_differentiated_is_refused_naming_the_factor():
    """Accelerate's ``accelerator.backward(loss)`` under accumulation differentiates ``loss / K``:
    every statistic would be off by the factor. A GradScaler's scale, given, is no such factor."""
    model, tracker = cgn.track(tiny_model(), every=1, quantities=["GradientNoiseScale"])
    x, y = batches(steps=1)[0]

    def losses():
        model.zero_grad()
        return F.cross_entropy(model(x), y, reduction="none")

    for k, (factor, shown) in enumerate([(0.5, "0.5"), (1 + 1e-6, "1.00000095"), (3.0, "3")]):  # float32
        with pytest.raises(RuntimeError, match=f"step {k}: the backward pass differentiated {shown} times"):
            with tracker(k, losses()) as loss:
                (loss * factor).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with pytest.raises(RuntimeError, match="step 3: the backward pass differentiated 0.5 times"):
        with tracker(3, losses(), scaler=scaler) as loss:
            scaler.scale(loss / 2).backward()
    assert tracker.frame().empty
    with tracker(4, losses(), scaler=scaler) as loss:
        scaler.scale(loss).backward()
    with tracker(5, losses()) as loss:
        loss.backward()
    assert {4, 5} <= set(tracker.frame().step)


def test_parameters_replaced_after_track_are_refused_before_the_step():
    """``load_state_dict(assign=True)`` after ``cgn.track`` (as FSDP2's ``fully_shard`` does to
    every parameter): the tracker would read the old ones, which never change."""
    model, tracker = cgn.track(tiny_model(), every=2)
    x, y = batches(steps=1)[0]
    model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)
    with tracker(1, F.cross_entropy(model(x), y, reduction="none")) as loss:  # untracked: not checked
        loss.backward()
    with pytest.raises(RuntimeError, match=r"step 2: parameters \[.*\] of the model are not those cgn.track found"):
        tracker(2, F.cross_entropy(model(x), y, reduction="none"))
    assert tracker.frame().empty


def test_parameters_replaced_are_refused_at_the_first_micro_batch_of_an_accumulated_step():
    """Under accumulation the check runs at each tracked step's first micro-batch (once per
    optimizer step, not at each of its micro-batches)."""
    model, tracker = cgn.track(tiny_model(), every=1)
    x, y = batches(steps=1)[0]
    model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"step 0: parameters \[.*\] of the model are not those"):
        tracker(0, F.cross_entropy(model(x), y, reduction="none"), micro_batch=0, micro_batches=2)


def test_batch_size_one_is_defined_and_warned_about():
    model, tracker = cgn.track(tiny_model(), every=1)
    x, y = batches(n=1, steps=1)[0]
    with pytest.warns(UserWarning, match="batch size 1 defines no gradient"):
        with tracker(0, F.cross_entropy(model(x), y, reduction="none")) as loss:
            loss.backward()
    frame = tracker.frame()
    assert {"PerExampleGradNorm", "ParamGradRatio"} <= set(frame.quantity)
    assert not {"GradientVarianceQuantiles", "GradientNoiseScale"} & set(frame.quantity)


def test_frozen_parameters_are_left_out_in_the_cockpits_order():
    frozen = ("0.weight",)
    tracker = front_door(tiny_model(frozen=frozen), batches())
    assert tracker.param_names == ["0.bias", "2.weight", "2.bias"]
    assert_same_numbers(tracker, by_hand(tiny_model(frozen=frozen), batches(), linear(1),
                                         classes_of(ALL)))
    assert set(tracker.frame().param) == {*tracker.param_names, cgn.NETWORK}


def test_the_cockpits_parameters_are_the_named_ones_by_identity():
    model, tracker = cgn.track(tiny_model(frozen=("2.bias",)))
    named = dict(model.named_parameters())
    assert [id(p) for p in tracker.cockpit.params] == [id(named[n]) for n in tracker.param_names]


def test_a_model_without_trainable_parameters_is_refused_naming_the_fix():
    model = tiny_model(frozen=("0.weight", "0.bias", "2.weight", "2.bias"))
    with pytest.raises(ValueError, match=r"no parameter that requires gradients: unfreeze"):
        cgn.track(model)


@pytest.mark.parametrize("every", [0, -1, True, 1.5, "10"])
def test_a_bad_schedule_is_refused(every):
    with pytest.raises(ValueError, match="every must be a positive int"):
        cgn.track(tiny_model(), every=every)


@pytest.mark.parametrize("quantities, options, match", [
    ("full", None, r"unknown preset 'full'"),
    (["GradientVariance"], None, r"unknown quantity 'GradientVariance'"),
    (["PerExampleGradNorm", "PerExampleGradNorm"], None, "two quantities of class"),
    ("cheap", {"GradientVarianceQuantiles": {"quantiles": (0.5,)}}, "not built here"),
])
def test_a_bad_configuration_is_refused_naming_the_fix(quantities, options, match):
    with pytest.raises(ValueError, match=match):
        cgn.configuration(quantities, 1, tiny_model(), options=options)
    with pytest.raises(ValueError, match="model= or param_names=, not both"):
        cgn.configuration("all", 1, tiny_model(), param_names=["a"])


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("bad", [{"every": 0}, {"quantities": "full"},
                                 {"quantities": "cheap", "quantiles": (0.5,)}])
def test_a_bad_call_leaves_the_model_as_it_was(bad):
    model = Attend()
    with pytest.raises(ValueError):
        cgn.track(model, **bad)
    assert isinstance(model.attn, nn.MultiheadAttention)
    assert not any(getattr(m, "_backpack_extend", False) for m in model.modules())


@pytest.mark.parametrize("make, x", [
    (Attend, torch.randn(6, 5, 4)),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 3)),
     torch.randn(6, 4)),
], ids=["attention", "in-place"])
def test_attention_is_converted_and_in_place_operations_are_prepared(make, x):
    torch.manual_seed(0)
    model, tracker = cgn.track(make(), every=1, quantities=["PerExampleGradNorm"])
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    with tracker(0, F.cross_entropy(model(x), torch.randint(0, 3, (6,)), reduction="none")) as loss:
        loss.backward()
    assert set(tracker.frame().param) == {*tracker.param_names, cgn.NETWORK}
    if make is Attend:
        assert tracker.param_names[:2] == ["attn.in_proj_weight", "attn.in_proj_bias"]


def test_cockpits_own_quantities_are_built_and_get_the_packages_layer_support():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    try:
        # MeanGSNR needs BackPACK's BatchGrad, which supports LayerNorm only when registered.
        model, tracker = cgn.track(model, every=1, quantities=["MeanGSNR", "ParamGradRatio"])
        x, y = batches(steps=1)[0]
        with tracker(0, F.cross_entropy(model(x), y, reduction="none")) as loss:
            loss.backward()
    finally:
        cgn.unregister_extensions()
    assert "MeanGSNR" in tracker.get_output()[0]
    assert set(tracker.frame().quantity) == {"ParamGradRatio"}


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_quantity_that_needs_the_graph_says_how_to_keep_it():
    try:
        model, tracker = cgn.track(tiny_model(), every=1, quantities=["HessMaxEV"])
        x, y = batches(steps=1)[0]
        with pytest.raises(RuntimeError, match=r"create_graph=tracker.create_graph\(step\)"):
            with tracker(0, F.cross_entropy(model(x), y, reduction="none")) as loss:
                loss.backward()
        model.zero_grad()
        with tracker(1, F.cross_entropy(model(x), y, reduction="none")) as loss:
            loss.backward(create_graph=tracker.create_graph(1))
    finally:
        cgn.unregister_extensions()
    assert list(tracker.get_output()) == [1]


def test_logs_of_the_explicit_api_and_of_the_front_door_read_the_same(tmp_path):
    explicit = cgn.write_log(by_hand(tiny_model(), batches(), linear(1), classes_of(ALL)),
                             tmp_path / "explicit")
    tracker = front_door(tiny_model(), batches())
    written = tracker.write(tmp_path / "front")
    assert written == tmp_path / "front.json" and tracker.log == written
    assert cgn.to_frame(explicit).equals(without_quantities(cgn.to_frame(written)))
    assert cgn.to_frame(tracker).equals(tracker.frame())  # a tracker passes for its Cockpit
    text = tracker.report()
    assert text.splitlines()[0] == f"cockpit-gradnoise report: {written}"
    # All but the advice, whose learning rate needs the optimizer the tracker logs.
    blocks, explicit_blocks = text.split("\n\n"), cgn.report(explicit).split("\n\n")
    assert blocks[1].startswith("advice:") and explicit_blocks[1].startswith("advice:")
    assert blocks[0].splitlines()[1:] == explicit_blocks[0].splitlines()[1:]
    assert blocks[2:] == explicit_blocks[2:]


def test_report_is_one_call_for_every_source(tmp_path):
    tracker = front_door(tiny_model(), batches())
    log = tracker.write(tmp_path / "run")
    frame = cgn.to_frame(log)
    expected = format_report(build_report(frame, source=str(log), batch_size=8))
    assert cgn.report(log, batch_size=8) == cgn.report(str(log), batch_size=8) == expected
    body = expected.splitlines()[1:]
    for source, name in [(frame, "DataFrame"), (tracker.cockpit, "Cockpit"), (tracker, str(log))]:
        lines = cgn.report(source, batch_size=8).splitlines()
        assert lines[0] == f"cockpit-gradnoise report: {name}" and lines[1:] == body
    out = tmp_path / "reports" / "run.csv"
    assert cgn.report(log, out, fmt="csv", step=2) == out.read_text()
    assert out.read_text() == format_report(build_report(frame, step=2), "csv")


def test_cgn_track_and_cgn_report_are_functions_whatever_is_imported():
    """No submodule shares their names, so importing every module leaves them functions."""
    import cockpit_gradnoise.tracking  # noqa: F401
    import cockpit_gradnoise.views.report  # noqa: F401  (imports views.findings too)

    for name in ("track", "report"):
        assert isinstance(getattr(cgn, name), types.FunctionType)
        assert f"cockpit_gradnoise.{name}" not in sys.modules


def test_the_dashboard_of_a_tracker(tmp_path):
    tracker = front_door(tiny_model(), batches())
    figure = tracker.plot(savefig=tmp_path / "run.png")
    try:
        assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        plt.close(figure)


def test_the_model_returned_is_the_model_given_when_no_conversion_is_needed():
    model = tiny_model()
    same, _ = cgn.track(model)
    assert same is model
    assert copy.deepcopy(same)(torch.randn(2, 5)).shape == (2, 3)


def test_reporting_a_log_imports_neither_torch_nor_matplotlib():
    code = ("import sys, cockpit_gradnoise as cgn; cgn.report; "
            "print(sorted({'torch', 'matplotlib', 'cockpit'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parent.parent)
    assert result.stdout.strip() == "[]"


def test_the_trackers_cockpit_frees_the_very_buffers_cockpits_own_frees():
    # The tracker's Cockpit looks only at the attributes a parameter holds; what it deletes and keeps
    # must be what Cockpit's _free_backpack_buffers deletes and keeps (protected fields, others).
    from cockpit_gradnoise import tracked_step

    from cockpit import Cockpit

    kept = {}
    for kind in (Cockpit, tracked_step.Cockpit):
        model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
        cockpit = kind(list(model.parameters()), quantities=cgn.configuration("cheap", every=1, model=model))
        savefields = sorted({ext.savefield for ext in cockpit._get_extensions(0)})
        assert savefields  # the "cheap" preset's extension at a tracked step
        first, *params = cockpit.params
        for field in savefields:
            setattr(first, field, torch.zeros(1))
        for param in params:
            param.grad_batch_transforms, param.kept_by_us = {}, 1.0
        cockpit._free_backpack_buffers(0, {"grad_batch_transforms"})
        kept[kind] = [sorted(vars(param)) for param in cockpit.params]
    assert kept[tracked_step.Cockpit] == kept[Cockpit]
    assert kept[Cockpit][0] == []  # the step's savefields go
    assert kept[Cockpit][1] == ["grad_batch_transforms", "kept_by_us"]  # protected, and not Cockpit's
