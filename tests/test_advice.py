"""The advice: batch size, trade-off and learning rate from a measured noise scale.

The formulas against numbers computed by hand (the arithmetic is written out
beside each literal), the rules' edge cases, hand-made logs for each branch
(the preconditioned noise scale, old logs without the optimizer), a real
tracked run whose report starts with the advice, and the command line's
report of a streamed log.
"""

import math
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import cli
from cockpit_gradnoise.logs.schema import optimizer_class, optimizer_statistics
from cockpit_gradnoise.views.advice import CAVEATS, NO_NOISE_SCALE, advice_of
from cockpit_gradnoise.views.batch_size import (
    SGD_RULE,
    SQRT_RULE,
    learning_rate_factor,
    learning_rate_for,
    noise_range,
    recommended_batch,
    rule_for,
    steps_and_examples_change,
)
from cockpit_gradnoise.views.report import build_report, format_report

import pytest
import torch
import torch.nn.functional as F

INF, NAN = math.inf, math.nan


# The formulas ---------------------------------------------------------------------


@pytest.mark.parametrize("noise_scale, steps, examples", [
    # (1 + 64/128) / (1 + 64/32) = 1.5 / 3 = 0.5;  (64 + 128) / (64 + 32) = 192 / 96 = 2
    (64.0, 0.5, 2.0),
    # (1 + 48/128) / (1 + 48/32) = 1.375 / 2.5 = 0.55;  (48 + 128) / (48 + 32) = 176 / 80 = 2.2
    (48.0, 0.55, 2.2),
    # (1 + 128/128) / (1 + 128/32) = 2 / 5 = 0.4;  (128 + 128) / (128 + 32) = 256 / 160 = 1.6
    (128.0, 0.4, 1.6),
    # B_noise -> inf: steps B0/B1 = 32/128, examples unchanged;  B_noise = 0: steps unchanged
    (INF, 0.25, 1.0),
    (0.0, 1.0, 4.0),
])
def test_steps_and_examples_from_32_to_128(noise_scale, steps, examples):
    got = steps_and_examples_change(noise_scale, 32, 128)
    assert got == pytest.approx((steps, examples), rel=1e-15)


def test_examples_are_steps_times_batch_so_the_issues_example_is_impossible():
    """E = S B: at 4x the batch, E1/E0 = 4 S1/S0 for every B_noise. "45% fewer steps"
    (S1/S0 = 0.55) comes with 120% more examples (B_noise 48), not 60%; "60% more
    examples" comes with 60% fewer steps (B_noise 128)."""
    for noise_scale in (0.5, 7.0, 48.0, 128.0, 1e6):
        steps, examples = steps_and_examples_change(noise_scale, 32, 128)
        assert examples == pytest.approx(4 * steps, rel=1e-14)


@pytest.mark.parametrize("rule, noise_scale, factor", [
    # SGD: (1 + 64/32) / (1 + 64/128) = 3 / 1.5 = 2
    (SGD_RULE, 64.0, 2.0),
    # SGD: (1 + 48/32) / (1 + 48/128) = 2.5 / 1.375 = 20/11
    (SGD_RULE, 48.0, 20 / 11),
    # SGD: (1 + 128/32) / (1 + 128/128) = 5 / 2
    (SGD_RULE, 128.0, 2.5),
    # SGD, B_noise -> inf: B1/B0 = 4 (linear scaling); B_noise = 0: unchanged
    (SGD_RULE, INF, 4.0),
    (SGD_RULE, 0.0, 1.0),
    # square root: sqrt(128/32) = 2, whatever the noise scale
    (SQRT_RULE, 64.0, 2.0),
    (SQRT_RULE, NAN, 2.0),
])
def test_learning_rate_from_32_to_128(rule, noise_scale, factor):
    assert learning_rate_factor(rule, 32, 128, noise_scale) == pytest.approx(factor, rel=1e-15)
    assert learning_rate_for(0.1, rule, 32, 128, noise_scale) == pytest.approx(0.1 * factor, rel=1e-15)


def test_the_sgd_rule_is_the_inverse_of_the_steps_ratio_and_sqrt_of_48_over_32():
    steps, _ = steps_and_examples_change(37.0, 24, 80)
    assert learning_rate_factor(SGD_RULE, 24, 80, 37.0) == pytest.approx(1 / steps, rel=1e-15)
    assert learning_rate_factor(SQRT_RULE, 32, 48) == pytest.approx(1.224744871391589, rel=1e-15)


def test_bad_formula_input_names_the_fix():
    assert all(math.isnan(x) for x in steps_and_examples_change(NAN, 32, 64))
    assert math.isnan(learning_rate_factor(SGD_RULE, 32, 64, NAN))
    with pytest.raises(ValueError, match="must be >= 0"):
        steps_and_examples_change(-1.0, 32, 64)
    with pytest.raises(ValueError, match="must be positive"):
        steps_and_examples_change(10.0, 0, 64)
    with pytest.raises(ValueError, match="unknown learning-rate rule 'lars'"):
        learning_rate_factor("lars", 32, 64, 10.0)


def test_rules_follow_the_optimizer_class():
    assert rule_for("SGD") == SGD_RULE
    assert rule_for("AdamW") == rule_for("Adam") == rule_for("RMSprop") == SQRT_RULE
    assert rule_for("LBFGS") is None and rule_for("Adagrad") is None and rule_for(None) is None


# The range and the recommendation ---------------------------------------------------


@pytest.mark.parametrize("values, quartiles, counts", [
    # positions 0.75, 1.5, 2.25 of [10, 20, 30, 40]: 17.5, 25, 32.5
    ([40, 10, 30, 20], (17.5, 25.0, 32.5), (4, 0, 0)),
    # grad_sq <= 0 at two steps: b_simple inf ranks last; the median lies between 20 and inf
    ([10, INF, 20, INF], (17.5, INF, INF), (4, 2, 0)),
    # a NaN step is left out: positions 0.5, 1, 1.5 of [10, 20, 30]
    ([NAN, 10, 20, 30], (15.0, 20.0, 25.0), (3, 0, 1)),
    # tr(Sigma) estimated below 0 counts as 0: [0, 10]
    ([-5, 10], (2.5, 5.0, 7.5), (2, 0, 0)),
    # one step: all three are it
    ([12], (12.0, 12.0, 12.0), (1, 0, 0)),
])
def test_noise_range_quartiles(values, quartiles, counts):
    got = noise_range(values)
    assert (got.low, got.median, got.high) == quartiles
    assert (got.used, got.infinite, got.left_out) == counts


def test_noise_range_of_nothing_usable_is_nan():
    got = noise_range([NAN, NAN])
    assert math.isnan(got.median) and (got.used, got.left_out) == (0, 2)


STEADY = [60, 62, 64, 66, 68]  # quartiles 62, 64, 66: narrower than [64/2, 64*2]


@pytest.mark.parametrize("batch, move", [
    (8, "grow"),      # below [32, 128]
    (32, "keep"),     # B_noise = 2B: the edge of "close to" (the report's finding says "below")
    (31, "grow"),
    (128, "keep"),
    (129, "shrink"),  # above [32, 128]: smaller batches use fewer examples for more steps
    (None, "unknown"),
])
def test_recommended_batch_moves_only_outside_the_range(batch, move):
    found = recommended_batch(64.0, STEADY, batch)
    assert (found.batch, found.move, found.low, found.high) == (64, move, 32.0, 128.0)


def test_wide_recent_quartiles_widen_the_range():
    # quartiles of [10, 20, 200, 400]: 17.5 and 250
    found = recommended_batch(64.0, [10, 20, 200, 400], 20)
    assert (found.move, found.low, found.high) == ("keep", 17.5, 250.0)


def test_infinite_nan_and_negative_noise_scales():
    assert recommended_batch(INF, [INF], 32).move == "grow"
    assert recommended_batch(INF, [INF], 32).batch is None
    assert recommended_batch(NAN, [NAN], 32).move == "unknown"
    # no noise resolved (tr(Sigma) estimate below 0): any batch is above it; batch 1 is advised
    found = recommended_batch(-3.0, [], 32)
    assert (found.noise_scale, found.batch, found.move) == (0.0, 1, "shrink")
    assert recommended_batch(0.3, [], 1).move == "keep"


# Advice of hand-made logs -------------------------------------------------------------


def log_of(noise=None, optimizer=None, steps=12, batch=32, preconditioned=None, smoothed_nan_last=False):
    """A Cockpit output with a GradientNoiseScale (and PreconditionedNoiseScale) network row
    of constant ``b_simple``, and an Optimizer row ``(class, lr)``."""
    output = {}
    for step in range(steps):
        last = step == steps - 1
        values = output.setdefault(step, {})
        for quantity, scale in (("GradientNoiseScale", noise),
                                ("PreconditionedNoiseScale", preconditioned)):
            if scale is not None:
                smoothed = NAN if (smoothed_nan_last and last) else scale
                values[quantity] = {"all": {"grad_sq": 1.0, "trace_cov": scale, "b_simple": scale,
                                            "b_simple_smoothed": smoothed, "batch_size": batch}}
        if optimizer is not None:
            values["Optimizer"] = {"all": optimizer_statistics(*optimizer)}
    return output


def advised(output, **kwargs):
    return advice_of(cgn.to_frame(output), **kwargs)


def test_sgd_from_32_to_128_sentences_with_their_numbers():
    got = advised(log_of(noise=128.0, optimizer=("SGD", 0.1)))
    assert (got.source, got.step, got.batch_size, got.new_batch) == ("GradientNoiseScale", 11, 32, 128)
    assert (got.steps_change, got.examples_change) == pytest.approx((0.4, 1.6), rel=1e-15)
    assert got.new_lr == pytest.approx(0.25, rel=1e-15)  # 0.1 * (1 + 128/32) / (1 + 128/128)
    text = str(got)
    assert text.startswith("advice:\n- noise scale B_noise = 128 at step 11 (b_simple_smoothed of all, "
                           "GradientNoiseScale); over the last 10 tracked steps (2-11) b_simple has "
                           "median 128, quartiles 128-128\n")
    assert "- use batch 128 instead of 32," in text
    assert "- batch 32 -> 128: about 60% fewer steps, 60% more examples to the same loss" in text
    assert "- learning rate 0.1 -> 0.25 = 0.1 x 2.5 (SGD: eps_opt(B) = eps_max / (1 + B_noise/B)" in text
    # 2.5 > sqrt(128 / 32) = 2: the linear regime's caveat, with the square-root rule's factor.
    assert ("trusted only if 0.25 stays below eps_max = |G|^2 / (G^T H G), which is not measured: "
            "the square-root rule's x 2 is the safer step") in text
    assert text.rstrip().endswith(CAVEATS)


def test_the_advice_from_batches_12_and_16_to_48():
    got = advised(log_of(noise=48.0, optimizer=("SGD", 0.1)), batch_size=12)
    assert got.new_batch == 48  # batch 12 is below [24, 96]
    # 12 -> 48: (1 + 48/48) / (1 + 48/12) = 2/5; (48 + 48) / (48 + 12) = 1.6
    assert "batch 12 -> 48: about 60% fewer steps, 60% more examples" in str(got)
    got = advised(log_of(noise=48.0, optimizer=("SGD", 0.1), batch=16))
    # 16 -> 48: (1 + 1) / (1 + 3) = 0.5; (48 + 48) / (48 + 16) = 1.5; lr 0.1 * 4 / 2 = 0.2
    assert "batch 16 -> 48: about 50% fewer steps, 50% more examples" in str(got)
    assert "learning rate 0.1 -> 0.2 = 0.1 x 2 (SGD" in str(got)
    assert "the square-root rule's x 1.73 is the safer step" in str(got)  # sqrt(48 / 16)


def test_adamw_uses_the_preconditioned_noise_scale_and_the_square_root_rule():
    got = advised(log_of(noise=128.0, preconditioned=256.0, optimizer=("AdamW", 1e-3)))
    assert (got.source, got.new_batch, got.rule) == ("PreconditionedNoiseScale", 256, SQRT_RULE)
    # 32 -> 256: (1 + 1) / (1 + 8) = 2/9 (78% fewer); (256 + 256) / (256 + 32) = 16/9 (78% more)
    assert (got.steps_change, got.examples_change) == pytest.approx((2 / 9, 16 / 9), rel=1e-15)
    assert got.new_lr == pytest.approx(1e-3 * math.sqrt(8), rel=1e-15)
    text = str(got)
    assert "(b_simple_smoothed of all, PreconditionedNoiseScale: the noise of the preconditioned " \
           "gradient P g, the one AdamW's steps follow)" in text
    assert "batch 32 -> 256: about 78% fewer steps, 78% more examples" in text
    assert "learning rate 0.001 -> 0.00283 = 0.001 x 2.83 (AdamW: the square-root rule of " \
           "Malladi et al. 2022, lr1 = lr0 sqrt(B1/B0); it also scales 1 - beta1 and 1 - beta2 " \
           "by B1/B0 = 8 and eps by sqrt(B0/B1)" in text
    assert "weak proxy" not in text


def test_sgd_reads_the_plain_noise_scale_and_adam_without_the_preconditioned_one_is_warned():
    got = advised(log_of(noise=128.0, preconditioned=256.0, optimizer=("SGD", 0.1)))
    assert (got.source, got.new_batch) == ("GradientNoiseScale", 128)
    got = advised(log_of(noise=128.0, optimizer=("Adam", 1e-3)))
    assert got.source == "GradientNoiseScale" and got.new_lr == pytest.approx(2e-3, rel=1e-15)
    assert "Adam is adaptive, but the log holds no PreconditionedNoiseScale" in str(got)


def test_an_old_log_without_the_optimizer_gets_no_learning_rate_and_says_why():
    got = advised(log_of(noise=128.0))
    assert got.optimizer is None and got.new_lr is None and got.new_batch == 128
    assert "- no learning rate: the log does not record the optimizer" in str(got)
    got = advised(log_of(noise=128.0, optimizer=("LBFGS", 1.0)))
    assert "- no learning rate: no rule is stated for LBFGS" in str(got)


def test_an_infinite_noise_scale_advises_doubling_with_linear_scaling():
    got = advised(log_of(noise=INF, optimizer=("SGD", 0.1)))
    assert (got.new_batch, got.steps_change, got.examples_change) == (64, 0.5, 1.0)
    assert got.new_lr == pytest.approx(0.2, rel=1e-15)
    text = str(got)
    assert "the noise scale is infinite (the smoothed |G|^2 estimate is <= 0" in text
    assert "(10 with grad_sq <= 0, no signal resolved, counted as infinite)" in text
    assert "batch 32 -> 64: about 50% fewer steps, about the same examples" in text


def test_a_batch_above_the_range_is_advised_to_shrink_with_the_trade_off():
    got = advised(log_of(noise=64.0, optimizer=("SGD", 0.8), batch=512))
    # 512 -> 64: (1 + 1) / (1 + 1/8) = 16/9 (78% more steps); (64 + 64)/(64 + 512) = 2/9;
    # lr 0.8 * 9/16 = 0.45
    assert got.new_batch == 64 and got.new_lr == pytest.approx(0.45, rel=1e-15)
    text = str(got)
    assert "batch 512 is above the range of the estimate (32-128)" in text
    assert "batch 512 -> 64: about 78% more steps, 78% fewer examples" in text


def test_keep_a_batch_within_the_range_and_give_no_move():
    got = advised(log_of(noise=48.0, optimizer=("SGD", 0.1)))
    assert got.new_batch is None and got.new_lr is None
    assert "- keep batch 32: it lies within the range of the estimate (24-96" in str(got)
    assert "learning rate" not in str(got)


def test_a_nan_smoothed_value_falls_back_and_few_steps_are_said():
    got = advised(log_of(noise=128.0, optimizer=("SGD", 0.1), steps=3, smoothed_nan_last=True))
    assert got.step == 1 and got.recent_steps == (0, 1, 2)
    assert str(got).rstrip().endswith("only 3 tracked steps (fewer than 10): the range is rough")


def test_no_noise_scale_says_what_to_track():
    got = advised({0: {"ParamGradRatio": {"all": {"norm_ratio": 2.0}},
                       "Optimizer": {"all": optimizer_statistics("SGD", 0.1)}}})
    assert got.sentences == [NO_NOISE_SCALE] and got.optimizer == "SGD"


def test_the_optimizer_row_is_a_number_per_statistic():
    statistics = optimizer_statistics("AdamW", 3e-4)
    assert statistics == {"class:AdamW": 1.0, "lr": 3e-4}
    assert optimizer_class(statistics) == "AdamW" and optimizer_class(["lr"]) is None


# A real run, its report and the command line ---------------------------------------------


def tracked_run(optimizer, lr, batch=4, steps=12, log=None, quantities="cheap"):
    torch.manual_seed(0)
    x, w = torch.randn(256, 6), torch.randn(6, 3)
    y = (x @ w).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model, tracker = cgn.track(model, every=1, quantities=quantities, log=log)
    opt = optimizer(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for step in range(steps):
            rows = torch.randint(0, 256, (batch,))
            opt.zero_grad()
            losses = F.cross_entropy(model(x[rows]), y[rows], reduction="none")
            with tracker(step, losses, optimizer=opt) as loss:
                loss.backward()
            opt.step()
    return tracker


@pytest.mark.parametrize("optimizer, lr, rule", [(torch.optim.SGD, 0.05, SGD_RULE),
                                                 (torch.optim.Adam, 1e-3, SQRT_RULE)])
def test_a_tracked_run_logs_its_optimizer_and_its_report_starts_with_the_advice(optimizer, lr, rule):
    tracker = tracked_run(optimizer, lr)
    frame = tracker.frame()
    rows = frame[frame.quantity == "Optimizer"]
    assert set(rows.step) == set(range(12))
    assert set(rows.statistic) == {"lr", f"class:{optimizer.__name__}"}
    assert list(rows.value[rows.statistic == "lr"]) == [lr] * 12
    advice = tracker.advice()
    assert (advice.optimizer, advice.lr, advice.rule, advice.batch_size) == (optimizer.__name__, lr, rule, 4)
    text = tracker.report()
    header, first_block = text.split("\n\n")[:2]
    assert header.splitlines()[1].startswith("step 11")
    assert first_block == str(advice).rstrip("\n")
    # What the advice says follows from its numbers.
    found = advice.recommendation
    assert found.noise_scale == frame[(frame.quantity == "GradientNoiseScale") & (frame.param == "all")
                                      & (frame.statistic == "b_simple_smoothed")].value.iloc[-1]
    if advice.new_batch is not None:
        assert advice.new_lr == pytest.approx(
            learning_rate_for(lr, rule, 4, advice.new_batch, found.noise_scale), rel=1e-15)


def test_a_tracked_adam_run_with_the_adaptive_preset_is_advised_from_the_preconditioned_noise_scale():
    tracker = tracked_run(torch.optim.Adam, 1e-3, quantities="adaptive")
    frame = tracker.frame()
    advice = tracker.advice()
    assert advice.source == "PreconditionedNoiseScale" and advice.rule == SQRT_RULE
    smoothed = frame[(frame.param == "all") & (frame.statistic == "b_simple_smoothed")]
    preconditioned = smoothed[smoothed.quantity == "PreconditionedNoiseScale"].value
    plain = smoothed[smoothed.quantity == "GradientNoiseScale"].value
    assert len(preconditioned) == len(plain) == 12
    assert advice.recommendation.noise_scale == preconditioned.iloc[-1] != plain.iloc[-1]
    assert "PreconditionedNoiseScale" in str(advice) and "weak proxy" not in str(advice)


def test_the_command_line_report_of_a_streamed_log_starts_with_the_same_advice(capsys, tmp_path):
    tracker = tracked_run(torch.optim.SGD, 0.05, log=tmp_path / "run")
    tracker.close()
    path = tmp_path / "run.jsonl"
    assert cli.main(["report", str(path)]) == 0
    printed = capsys.readouterr().out
    whole = build_report(cgn.to_frame(path), source=str(path))
    assert printed == format_report(whole)
    assert printed.split("\n\n")[1] == str(whole.advice).rstrip("\n")
    assert printed.split("\n\n")[1].startswith("advice:\n- noise scale B_noise = ")
    assert cli.main(["report", str(path), "--format", "json"]) == 0
    import json

    advice = json.loads(capsys.readouterr().out)["advice"]
    assert advice["sentences"] == whole.advice.sentences and advice["optimizer"] == "SGD"


def test_a_report_without_a_noise_scale_says_what_to_track():
    output = {0: {"ParamGradRatio": {"all": {"norm_ratio": 2.0}, "w": {"norm_ratio": 2.0}}}}
    text = cgn.report(cgn.to_frame(output))
    assert text.split("\n\n")[1] == f"advice:\n- {NO_NOISE_SCALE}"


def test_a_streamed_log_read_in_part_gives_the_advice_of_the_whole_log(capsys, tmp_path):
    """The report of a streamed log decodes only some rows (``views/reads.py``): among them
    the recent noise scales the advice falls back on where the last is NaN."""
    from types import SimpleNamespace

    output = log_of(noise=128.0, optimizer=("SGD", 0.1), smoothed_nan_last=True)
    with cgn.LogStream(tmp_path / "hand") as stream:
        stream.append(SimpleNamespace(quantities=[], output=output))
    path = tmp_path / "hand.jsonl"
    assert cli.main(["report", str(path), "--step", "11"]) == 0
    printed = capsys.readouterr().out
    whole = build_report(cgn.to_frame(path), source=str(path), step=11)
    assert whole.advice.step == 10 and whole.advice.new_lr == pytest.approx(0.25, rel=1e-15)
    assert printed == format_report(whole)


def test_the_docs_example_prints_what_the_page_shows(tmp_path, monkeypatch):
    """docs/advice.md: its first example, run, prints the text block after it."""
    import contextlib
    import io
    from pathlib import Path

    from tests.test_docs import code_blocks

    page = Path(__file__).resolve().parent.parent / "docs" / "advice.md"
    blocks = code_blocks(page)
    example, shown = blocks[0], blocks[1]
    assert (example.language, shown.language) == ("python", "text")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        exec(compile(example.code, str(page), "exec"), {"__name__": "docs_advice"})
    assert printed.getvalue() == shown.code + "\n"  # print adds a newline to the block's own


def test_a_wrapped_optimizer_is_logged_under_the_name_of_the_one_it_wraps():
    from collections import defaultdict
    from types import SimpleNamespace

    from cockpit_gradnoise.tracked_step import record_optimizer

    class Wrapper(torch.optim.Optimizer):  # as Accelerate's AcceleratedOptimizer: an Optimizer too
        def __init__(self, optimizer):
            self.optimizer, self.param_groups = optimizer, optimizer.param_groups

    inner = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=torch.tensor(3e-4))
    cockpit = SimpleNamespace(output=defaultdict(dict))
    record_optimizer(cockpit, 3, SimpleNamespace(optimizer=Wrapper(inner)))  # Lightning's, around it
    record_optimizer(cockpit, 4, None)
    assert dict(cockpit.output) == {3: {"Optimizer": {"all": {"class:AdamW": 1.0,
                                                              "lr": float(torch.tensor(3e-4))}}}}


@pytest.mark.parametrize("name", ["write_log.json", "cockpit_write.json"])
def test_an_old_log_on_disk_gets_the_batch_advice_and_says_why_there_is_no_learning_rate(name):
    from pathlib import Path

    old = Path(__file__).resolve().parent / "data" / "logs" / name  # written before Optimizer rows
    got = cgn.advice(old, batch_size=2)
    # B_noise 6.28 (smoothed), range [3.14, inf]: batch 2 is below it
    assert (got.optimizer, got.lr, got.new_batch, got.new_lr) == (None, None, 6, None)
    assert "- no learning rate: the log does not record the optimizer" in str(got)
    assert cgn.report(old).split("\n\n")[1].startswith("advice:\n- noise scale B_noise = 6.28 at step 4")


def test_the_norms_preset_is_advised_from_two_batch_noise_scale():
    output = log_of(noise=128.0, optimizer=("SGD", 0.1))
    for values in output.values():
        values["TwoBatchNoiseScale"] = values.pop("GradientNoiseScale")
    got = advised(output)
    assert (got.source, got.new_batch) == ("TwoBatchNoiseScale", 128)
    assert "(b_simple_smoothed of all, TwoBatchNoiseScale)" in str(got)
