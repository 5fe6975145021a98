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
import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from backpack import extend  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402

from tests.helpers import without_quantities  # noqa: E402
from tests.test_docs import README, code_blocks  # noqa: E402

GETTING_STARTED = Path(__file__).resolve().parent.parent / "docs" / "getting-started.md"
STEPS = 4
BATCH = 8


def tiny_model(seed=0, frozen=()):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return model


def batches(n=BATCH, steps=STEPS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator))
            for _ in range(steps)]


def front_door(model, data, every=1, quantities="all", reduction=None, **kwargs):
    """Train ``model`` on ``data`` through the front door; return the tracker."""
    model, tracker = cgn.track(model, every=every, quantities=quantities, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with tracker(step, losses, optimizer=opt, reduction=reduction) as loss:
            loss.backward()
        opt.step()
    return tracker


def by_hand(model, data, schedule, classes, reduction="mean", quantiles=None):
    """The same training with quantities built by hand (the explicit API); return the Cockpit."""
    model = extend(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    quantities = [
        cls(schedule, param_names=names,
            **({"quantiles": quantiles} if quantiles and cls.__name__ == ALL[0] else {}))
        for cls in classes
    ]
    cockpit = cgn.Cockpit([p for p in model.parameters() if p.requires_grad], quantities=quantities)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"batch_size": len(x), "individual_losses": losses, "loss": loss, "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    return cockpit


def classes_of(names):
    return [getattr(cgn, name) for name in names]


def assert_same_numbers(tracker, cockpit):
    got, expected = tracker.frame(), cgn.to_frame(cockpit)
    assert len(got) > 0
    assert set(got.quantity) - set(expected.quantity) <= {"Optimizer"}
    assert without_quantities(got).equals(expected)


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


def test_a_compiled_model_is_tracked_through_the_module_it_wraps():
    """The recipe of docs/training-setups.md."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    twin = copy.deepcopy(plain)
    # The eager backend: dynamo's graphs and breaks, without compiling kernels.
    compiled = torch.compile(plain, backend="eager")
    model, tracker = cgn.track(compiled, every=1, quantities=["PerExampleGradNorm"])
    assert model is compiled
    assert tracker.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _, by_hand = cgn.track(twin, every=1, quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for tracked, net in ((tracker, model), (by_hand, twin)):
        with tracked(0, F.cross_entropy(net(x), y, reduction="none")) as loss:
            loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert list(got["param"].astype(str)) == list(expected["param"].astype(str))
    # The eager backend runs the same operations: equal up to float64 rounding of
    # norms of at most 25 products (2 N eps relative bounds it).
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=2 * 25 * 2.0**-52, atol=0)


@pytest.mark.parametrize("order", ["compiled untracked copy first", "tracked, then compiled"])
def test_a_graph_compiled_without_the_hooks_is_never_reused_for_the_tracked_model(order):
    """TorchDynamo does not guard on module hooks by default: a graph compiled for
    another instance of the class (an untracked copy, an EMA model) would run the
    tracked one without its hooks; ``prepare_model`` makes it guard on them."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    twin, untracked = copy.deepcopy(plain), copy.deepcopy(plain)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    other = torch.compile(untracked, backend="eager")
    if order == "compiled untracked copy first":
        F.cross_entropy(other(x), y).backward()
        model, tracker = cgn.track(torch.compile(plain, backend="eager"), every=1,
                                   quantities=["PerExampleGradNorm"])
    else:
        model, tracker = cgn.track(plain, every=1, quantities=["PerExampleGradNorm"])
        F.cross_entropy(other(x), y).backward()
        model = torch.compile(model, backend="eager")
    _, by_hand = cgn.track(twin, every=1, quantities=["PerExampleGradNorm"])
    for step in range(2):
        for tracked, net in ((tracker, model), (by_hand, twin)):
            net.zero_grad()
            with tracked(step, F.cross_entropy(net(x), y, reduction="none")) as loss:
                loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=2 * 25 * 2.0**-52, atol=0)


def _compiled_gpt_step(model, tracker, tokens, targets):
    from experiments.models import TokenCrossEntropy

    model.zero_grad()
    with tracker(0, TokenCrossEntropy("none")(model(tokens), targets)) as loss:
        loss.backward()


def test_a_compiled_gpt_with_expanded_positions_has_the_numbers_of_the_uncompiled_one():
    """``aot_eager``: TorchDynamo's graphs with AOT autograd's backward (its
    ``CompiledFunctionBackward`` hides each graph's additions from the autograd walk),
    no kernels compiled. Positions ``arange(T).expand(B, T)`` are per example by their
    stride-0 batch dimension. The package's hooks run eagerly (no recompilation per module).

    AOT autograd decomposes operations (layer_norm, softmax) into others: float64
    results may differ by the rounding of the O(100) operations on a path, a few
    hundred ulps; 1e-10 relative is far above that and far below any real error."""
    from experiments.models import GPT

    torch.manual_seed(0)
    plain = GPT(11, 4, width=8, heads=2, layers=1).double()
    twin = copy.deepcopy(plain)
    tokens, targets = torch.randint(0, 11, (4, 4)), torch.randint(0, 11, (4, 4))  # B = T
    model, tracker = cgn.track(torch.compile(plain, backend="aot_eager"), every=1)
    _compiled_gpt_step(model, tracker, tokens, targets)
    _, by_hand = cgn.track(twin, every=1)
    _compiled_gpt_step(twin, by_hand, tokens, targets)
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=1e-10, atol=0)


def test_a_compiled_nanogpt_has_the_numbers_of_the_uncompiled_one():
    """nanoGPT's ``wpe(arange(T))`` (no batch dimension) under ``aot_eager``: the addition
    to the batch is found in the autograd graph as without compile; bound as above."""
    from tests.cases import nanogpt

    torch.manual_seed(0)
    plain = nanogpt().double()
    twin = copy.deepcopy(plain)
    model, tracker = cgn.track(torch.compile(plain, backend="aot_eager"), every=1)
    _, by_hand = cgn.track(twin, every=1)
    tokens = torch.randint(0, 11, (3, 4))
    for net, tracked in ((model, tracker), (twin, by_hand)):
        with tracked(0, F.cross_entropy(net(tokens).transpose(1, 2), tokens,
                                        reduction="none").mean(1)) as loss:
            loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=1e-10, atol=0)


def test_torch_compile_leaves_the_package_s_hooks_to_python():
    """TorchDynamo would compile a hook's frame once per module (its name and module are
    constants there) until its cache limit; the hooks' frames get no compiled entry."""
    from cockpit_gradnoise.extensions import hooks

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model, tracker = cgn.track(torch.compile(net, backend="eager"), every=1,
                               quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with tracker(0, F.cross_entropy(model(x), y, reduction="none")) as loss:
        loss.backward()
    assert len(tracker.frame()) > 0
    for code in (hooks._store_call.__code__, hooks.eager_under_compile._call.__code__):
        assert _debug_get_cache_entry_list(code) == []


# The reduction is declared, not inferred (issue 36) --------------------------------------


def counting(monkeypatch, module, name, calls):
    """Replace ``module.name`` by a wrapper that appends ``name`` to ``calls``."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def inference_counted(monkeypatch):
    """The calls of the two functions that infer the loss's scale from the values."""
    from cockpit_gradnoise import accumulation, functional

    calls = []
    counting(monkeypatch, functional, "loss_scale", calls)
    counting(monkeypatch, accumulation, "micro_batch_loss_scale", calls)
    return calls


@pytest.mark.parametrize("reduction", [None, "sum"])
def test_the_front_door_declares_the_batch_and_infers_nothing(reduction, monkeypatch):
    calls = inference_counted(monkeypatch)
    tracker = front_door(tiny_model(), batches(), reduction=reduction)
    assert calls == []
    explicit_calls = inference_counted(monkeypatch)
    cockpit = by_hand(tiny_model(), batches(), linear(1), classes_of(ALL), reduction=reduction or "mean")
    assert explicit_calls == ["loss_scale"] * STEPS  # the explicit API infers, once per step
    assert_same_numbers(tracker, cockpit)


def accumulated(front, data, reduction="mean"):
    """Two steps of two micro-batches each, through the front door or the explicit API."""
    model = tiny_model()
    if front:
        model, tracker = cgn.track(model, every=1)
    else:
        model = extend(model)
        names = [n for n, _ in model.named_parameters()]
        tracker = cgn.Cockpit(list(model.parameters()),
                              quantities=[cls(linear(1), param_names=names) for cls in classes_of(ALL)])
    for step in range(2):
        model.zero_grad()
        for k in range(2):
            x, y = data[2 * step + k]
            losses = F.cross_entropy(model(x), y, reduction="none")
            if front:
                block = tracker(step, losses, micro_batch=k, micro_batches=2,
                                reduction=None if reduction == "mean" else reduction)
            else:
                loss = losses.mean() / 2 if reduction == "mean" else losses.sum()
                block = tracker(step, info={"individual_losses": losses, "loss": loss,
                                            "micro_batch": k, "micro_batches": 2})
            with block:
                (loss if not front else block.info["loss"]).backward()
    return tracker.frame() if front else cgn.to_frame(tracker)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_under_accumulation_the_front_door_declares_each_micro_batch(reduction, monkeypatch):
    data = batches(steps=4)
    calls = inference_counted(monkeypatch)
    got = accumulated(True, data, reduction)
    assert calls == []
    expected = accumulated(False, data, reduction)
    assert calls == ["micro_batch_loss_scale"] * 4  # the explicit API infers each micro-batch's
    assert len(got) > 0 and got.equals(expected)


def test_a_loss_given_is_checked_once_and_its_scale_declared(monkeypatch):
    model, tracker = cgn.track(tiny_model(), every=1)
    x, y = batches(steps=1)[0]
    calls = inference_counted(monkeypatch)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with tracker(0, losses, loss=losses.sum()) as loss:
        loss.backward()
    assert calls == ["loss_scale"]  # the tracker's check, not the quantities' inference
    assert set(tracker.frame().quantity) == set(ALL) - {"UpdateSize"}


def test_the_losses_are_checked_once_per_tracked_step(monkeypatch):
    from cockpit_gradnoise import step as step_module
    from cockpit_gradnoise import tracking

    calls = []
    counting(monkeypatch, step_module, "check_individual_losses", calls)
    counting(monkeypatch, tracking, "check_individual_losses", calls)
    front_door(tiny_model(), batches())
    assert calls == ["check_individual_losses"] * STEPS
    calls.clear()
    by_hand(tiny_model(), batches(), linear(1), classes_of(ALL))
    assert len(calls) > STEPS  # the explicit API checks info as each quantity reads it


def minus_inf_logit(model, x, y):
    """Per-example losses with example 0's loss +inf (its label's logit -inf), gradients finite."""
    outputs = model(x)
    mask = torch.zeros_like(outputs, dtype=torch.bool)
    mask[0, y[0]] = True
    return F.cross_entropy(outputs.masked_fill(mask, -float("inf")), y, reduction="none")


@pytest.mark.parametrize("forced", [False, True], ids=["cpu", "other-devices-paths"])
def test_losses_that_are_not_finite_give_what_the_explicit_api_gives(forced, monkeypatch):
    """The declared scale is NaN where the losses are not finite, as the inferred one is;
    on other devices that is read with the step's values, and the scale-free statistics
    are formed with the declared scale: the same to rounding."""
    from cockpit_gradnoise import _device

    if forced:
        monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    frames, told = [], []
    for front in (True, False):
        model = tiny_model()
        x, y = batches(steps=1)[0]
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            if front:
                model, tracker = cgn.track(model, every=1)
                with tracker(0, minus_inf_logit(model, x, y)) as loss:
                    loss.backward()
                frames.append(tracker.frame())
            else:
                model = extend(model)
                names = [n for n, _ in model.named_parameters()]
                cockpit = cgn.Cockpit(list(model.parameters()),
                                      quantities=[cls(linear(1), param_names=names)
                                                  for cls in classes_of(ALL)])
                losses = minus_inf_logit(model, x, y)
                with cockpit(0, info={"individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward()
                frames.append(cgn.to_frame(cockpit))
        told.append([str(r.message) for r in records if "not finite at step 0" in str(r.message)])
    got, expected = frames
    assert got[["quantity", "param", "statistic"]].equals(expected[["quantity", "param", "statistic"]])
    assert got.value.isna().equals(expected.value.isna()) and got.value.isna().any()
    finite = expected.value.notna()
    assert got.value[finite].to_numpy() == pytest.approx(
        expected.value[finite].to_numpy(), rel=0 if not forced else 1e-12)
    assert len(told[0]) == len(told[1]) == 1
