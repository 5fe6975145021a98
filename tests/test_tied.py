"""Tied parameters and embeddings applied without the batch dimension, against float64 loops.

The models are in the case matrix (``tests/cases.py``: ``nanogpt-tied-arange``,
``three-uses``, and the full nanoGPT patterns and GPT-2 tied, ``nanogpt`` and
``hf-gpt2-tied``, every statistic of every parameter at T equal to the batch
size); here: the forms of each path (dense cross terms in chunks, views
before the addition, label embeddings), and what is refused, by name.
"""

import copy
import math
import pickle
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
    cost_model,
    uses,
)
from cockpit_gradnoise.extensions import linear as linear_layers
from cockpit_gradnoise.logs import schema

import pytest
import torch
from backpack import backpack, extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import NANO_CONTEXT, Problem, build, case_named, run_step
from tests.helpers import RTOL, assert_statistics_match, rounding_bounds, rows, sd_rtol

QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


def _quantities(names):
    return [
        cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names),
        cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=names),
        cgn.GradientNoiseScale(linear(1), param_names=names),
    ]


def assert_matches_references(problem, inner_terms, grads=None):
    """GradientVarianceQuantiles, PerExampleGradNorm and GradientNoiseScale equal their
    references on every trainable parameter the forward pass uses, and on ``"all"``
    (``grads``: the per-example gradients, by default a per-example loop)."""
    named = dict(problem.model.named_parameters())
    n = len(problem.inputs)
    if grads is None:
        grads = references.per_example_gradients(
            problem.model, problem.per_example_loss, problem.inputs, problem.targets)
    names = [name for name in problem.names if name in grads]
    quantities = _quantities(names)
    cockpit = cgn.Cockpit([named[name] for name in names], quantities=quantities)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_step(problem, quantities, cockpit=cockpit)
    got = cockpit.get_output()[0]
    chosen = {name: grads[name] for name in names}
    args = (problem.model, problem.per_example_loss, problem.inputs, problem.targets)
    assert_statistics_match(got["PerExampleGradNorm"], references.per_example_grad_norm(
        *args, quantiles=QUANTILES, gradients=chosen))
    numel = {name: named[name].numel() for name in names}
    numel[schema.NETWORK] = sum(numel.values())
    _assert_noise_scale(rows(cockpit, "GradientNoiseScale"), references.gradient_noise_scale(
        *args, gradients=chosen), n, numel)
    expected = references.gradient_variance_quantiles(
        *args, reduction=problem.reduction, quantiles=QUANTILES, gradients=chosen)
    tolerance = {name: sd_rtol(chosen, n, name, inner_terms) for name in expected}
    assert_statistics_match(got["GradientVarianceQuantiles"], expected,
                            rtol_of=lambda name, statistic: tolerance[name])


def _assert_noise_scale(got, expected, n, numel):
    """As ``tests/test_gradient_noise_scale.py`` compares: to 1e-10 relative or the
    rounding bounds of the differences that form ``grad_sq`` and ``trace_cov``."""
    assert set(got) == set(expected)
    for name, stats in expected.items():
        grad_sq, trace_cov = stats["grad_sq"], stats["trace_cov"]
        atol_g, atol_t = rounding_bounds(n, numel[name], grad_sq, trace_cov)
        assert got[name]["grad_sq"] == pytest.approx(grad_sq, rel=RTOL, abs=atol_g), name
        assert got[name]["trace_cov"] == pytest.approx(trace_cov, rel=RTOL, abs=atol_t), name
        if grad_sq > atol_g:
            rtol = atol_g / grad_sq + atol_t / trace_cov
            assert got[name]["b_simple"] == pytest.approx(stats["b_simple"],
                                                          rel=max(RTOL, rtol)), name
        elif grad_sq < -atol_g:
            assert got[name]["b_simple"] == math.inf, name


def _untied_plain(case_name, n):
    """The case's model with its head untied, extended by ``backpack.extend`` alone."""
    problem = build(case_named(case_name), n, "mean")
    model = case_named(case_name).make().double()
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    problem.model = extend(model)
    return problem


def test_backpack_alone_takes_the_positions_for_examples_when_T_equals_the_batch_size():
    """The failure the exact path exists for: the shapes agree, the numbers do not."""
    problem = _untied_plain("nanogpt-tied-arange", NANO_CONTEXT)
    quantity = cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=problem.names)
    got = rows(run_step(problem, [quantity]), schema.PER_EXAMPLE_NORM)["transformer.wpe.weight"]
    expected = references.per_example_grad_norm(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets,
        quantiles=QUANTILES)["transformer.wpe.weight"]
    assert got["q0"] != pytest.approx(expected["q0"], rel=1e-3)


def test_a_tied_model_extended_by_backpack_alone_is_refused_naming_the_fix():
    problem = build(case_named("three-uses"), 3, "mean")
    problem.model = extend(ThreeUsesPlain())
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    with pytest.raises(ValueError, match=r"\['encoder_embedding.weight'\] are used by several "
                                         r"layers.*cgn.prepare_model\(model\)"):
        run_step(problem, [quantity])


class ThreeUsesPlain(nn.Module):
    """Encoder embedding, decoder embedding and head sharing one matrix, in double."""

    def __init__(self):
        super().__init__()
        self.encoder_embedding, self.decoder_embedding = nn.Embedding(11, 8), nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.encoder_embedding.weight = self.decoder_embedding.weight = self.head.weight
        self.double()

    def forward(self, idx):
        return self.head(torch.tanh(self.encoder_embedding(idx) + self.decoder_embedding(idx)))


class TwoLinearUses(nn.Module):
    """A square Linear weight used by two layers: the dense cross terms."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(11, 6)
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.second.weight = self.first.weight
        self.head = nn.Linear(6, 11)

    def forward(self, idx):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(self.embedding(idx))))))


def _token_problem(model, n, reduction="mean", length=NANO_CONTEXT, vocabulary=11, seed=0):
    from tests.models import TokenCrossEntropy

    torch.manual_seed(seed)
    model = cgn.prepare_model(model.double())
    return Problem(model, extend(TokenCrossEntropy(reduction)),
                   TokenCrossEntropy("none", per_token=reduction),
                   torch.randint(0, vocabulary, (n, length)),
                   torch.randint(0, vocabulary, (n, length)), reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_two_linear_uses_are_combined_from_dense_contributions_in_chunks(reduction, monkeypatch):
    monkeypatch.setattr(cost_model, "CHUNK_BYTES", 6 * 6 * 8 * 2 * 2)  # two examples per chunk
    problem = _token_problem(TwoLinearUses(), 5, reduction)
    assert_matches_references(problem, inner_terms=2 * NANO_CONTEXT)


def test_a_tied_linear_weight_is_formed_where_the_untied_ones_are_expanded(monkeypatch):
    """:func:`~cockpit_gradnoise.extensions.tied.combine` adds the uses' ``[T, S]``: a
    tied Linear weight is never expanded (its ``R`` would be dropped), the untied
    Linear layers over the 4 positions are, with the expansion forced; all match."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")
    choices, original = {}, linear_layers.expands

    def recording(module, inputs, grad_output):
        choices[module] = original(module, inputs, grad_output)
        return choices[module]

    monkeypatch.setattr(linear_layers, "expands", recording)
    problem = _token_problem(TwoLinearUses(), 5)
    assert_matches_references(problem, inner_terms=2 * NANO_CONTEXT)
    model = problem.model
    assert choices == {model.first: False, model.second: False, model.head: True}


class Positions(nn.Module):
    """Token embeddings plus position embeddings, applied as ``how`` says."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.wte, self.wpe = nn.Embedding(11, 6), nn.Embedding(NANO_CONTEXT, 6)
        self.label = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, idx):
        n, length = idx.shape
        positions = torch.arange(length, device=idx.device)
        tokens = self.wte(idx)
        if self.how == "unsqueeze":
            x = tokens + self.wpe(positions)[None]
        elif self.how == "view":
            x = tokens - self.wpe(positions).view(1, length, -1)
        elif self.how == "label-added":  # one label per example (the first token), added
            x = tokens + (self.wpe(positions) + self.label(idx[:, 0])[:, None])
        elif self.how == "label-concatenated":  # one label per example, not added
            x = torch.cat([tokens[:, 1:], self.label(idx[:, 0]).unsqueeze(1)], 1)
            x = x + self.wpe(positions)
        elif self.how == "permuted":  # transposed, then multiplied where they meet the batch
            x = tokens * self.wpe(positions).T.T
        elif self.how == "cumsum":  # through an operation the package does not follow
            x = tokens + self.wpe(positions).cumsum(0)
        else:
            raise ValueError(self.how)
        return self.head(torch.tanh(x))


@pytest.mark.parametrize("how", ["unsqueeze", "view", "label-added", "label-concatenated",
                                 "permuted"])
@pytest.mark.parametrize("n", [NANO_CONTEXT, 3])
def test_positions_through_views_and_label_embeddings_are_exact(how, n):
    problem = _token_problem(Positions(how), n)
    assert_matches_references(problem, inner_terms=NANO_CONTEXT)


def assert_left_out_by_name(problem, quantity, name, match):
    """One step: ``name`` (or each of a tuple of names) is left out with a warning matching
    ``match``; every other parameter the loss reached keeps its rows, and the step is
    recorded (never lost)."""
    names = {name} if isinstance(name, str) else set(name)
    with pytest.warns(UserWarning, match=match):
        cockpit = run_step(problem, [quantity])
    got = rows(cockpit, type(quantity).__name__)
    reached = {n for n, p in problem.model.named_parameters() if p.requires_grad and p.grad is not None}
    assert names <= reached and not names & set(got)
    assert set(got) == (reached - names) | {schema.NETWORK}


@pytest.mark.parametrize("n", [NANO_CONTEXT, 3])
def test_positions_that_meet_the_batch_through_an_unfollowed_operation_are_refused_by_name(n):
    problem = _token_problem(Positions("cumsum"), n)
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, "wpe.weight",
                            r"\['wpe.weight'\].*index \(shape \(4,\)\) is not an input of the model")


class SharedModule(nn.Module):
    """T5's sharing: one embedding module called by the encoder and by the decoder."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(11, 6)
        self.encoder_tokens = self.decoder_tokens = self.shared
        self.head = nn.Linear(6, 11)

    def forward(self, idx):
        return self.head(torch.tanh(self.encoder_tokens(idx) + self.decoder_tokens(idx.flip(1))))


class TiedToANorm(nn.Module):
    """A Linear's bias tied to a LayerNorm's weight: both uses recomputed per example
    (exact: tests/test_tied_calls.py, which also has the use that stays refused)."""

    def __init__(self):
        super().__init__()
        self.embedding, self.norm, self.lin = nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 6)
        self.lin.bias = self.norm.weight
        self.head = nn.Linear(6, 11)

    def forward(self, idx):
        return self.head(torch.tanh(self.lin(self.norm(self.embedding(idx)))))


class LinearRunTwice(nn.Module):
    """One Linear applied twice in a row (ALBERT's shared layer, in small): no tie, so no
    layer is marked; its two calls are summed per example (extensions/repeated.py)."""

    def __init__(self):
        super().__init__()
        self.embedding, self.lin, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11)

    def forward(self, idx):
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(self.embedding(idx))))))


@pytest.mark.parametrize("model", [SharedModule, LinearRunTwice])
@pytest.mark.parametrize("n", [3, NANO_CONTEXT])
def test_a_module_called_twice_sums_its_calls_per_example(model, n):
    """Left out before ("ran several times in one forward pass"); now each example's
    contribution is the sum of its calls' (extensions/repeated.py, tests/test_repeated_layers.py)."""
    assert_matches_references(_token_problem(model(), n), inner_terms=2 * NANO_CONTEXT)


def test_the_front_door_tracks_nanogpt_under_its_first_names():
    """``cgn.track`` on the nanoGPT-style model: every quantity at every step, the tied
    matrix named ``transformer.wte.weight``, no warning; copies and pickles of the
    prepared model carry no per-pass state and give the same numbers."""
    torch.manual_seed(0)
    model, tracker = cgn.track(case_named("nanogpt-tied-arange").make().double(), every=1)
    twin = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 11, (NANO_CONTEXT, NANO_CONTEXT))
    assert torch.equal(twin(idx), model(idx))
    assert twin.__dict__["_cgn_uses"] is not model.__dict__["_cgn_uses"]
    assert twin.transformer.wte.weight is twin.lm_head.weight
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="cockpit-gradnoise")
        for step in range(2):
            optimizer.zero_grad()
            logits = model(idx)
            losses = nn.functional.cross_entropy(logits.transpose(1, 2), idx, reduction="none")
            with tracker(step, losses.mean(1), optimizer=optimizer) as loss:
                loss.backward()
            optimizer.step()
    frame = tracker.frame()
    assert "transformer.wte.weight" in set(frame.param) and "lm_head.weight" not in set(frame.param)
    assert set(frame.step) == {0, 1}
    assert tracker.param_names == [n for n, p in twin.named_parameters()]


def test_local_gradient_sums_and_norms_of_a_tied_matrix_add_up_every_use_at_every_step():
    """``cgn_local_grad`` and ``sum_i x_i`` equal ``param.grad`` (to rounding: other
    orders of the same sums) and ``cgn_batch_l2`` the loop's ``||g_i||^2``, at two
    steps in a row: each forward pass starts the combination anew."""
    problem = build(case_named("three-uses"), 5, "sum")
    weight = problem.model.head.weight
    for step in range(2):
        inputs = problem.inputs.roll(step, 1)
        problem.model.zero_grad()
        loss = problem.loss_fn(problem.model(inputs), problem.targets)
        with backpack(LocalGradient(), SumsOfContributions(), PerExampleSquaredNorms()):
            loss.backward()
        scale = weight.grad.abs().max()
        for value in (weight.cgn_local_grad, weight.cgn_sums_of_contributions[0]):
            torch.testing.assert_close(value, weight.grad, rtol=0, atol=1e-14 * scale)
        grads = references.per_example_gradients(
            problem.model, problem.per_example_loss, inputs, problem.targets)
        expected = grads["encoder_embedding.weight"].flatten(1).square().sum(1)
        torch.testing.assert_close(weight.cgn_batch_l2, expected, rtol=1e-12, atol=0)


def test_the_references_sum_a_tied_parameter_over_its_uses_under_its_first_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[2].weight = model[0].weight
    model = model.double()
    inputs, targets = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    through_batch = references.contributions_through_batch(model, loss, inputs, targets)
    per_example = references.per_example_gradients(
        model, nn.CrossEntropyLoss(reduction="none"), inputs, targets)
    assert set(through_batch) == set(per_example) == {n for n, _ in model.named_parameters()}
    for name, value in per_example.items():
        torch.testing.assert_close(through_batch[name], value, rtol=1e-12, atol=1e-15)


def test_preparing_again_after_untying_renews_the_marks():
    problem = build(case_named("three-uses"), 3, "mean")
    model = problem.model
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    assert_left_out_by_name(problem, quantity, "encoder_embedding.weight",
                            r"no longer share one tensor: prepare the model")
    cgn.prepare_model(model)
    cgn.prepare_model(model)
    ours = [hook for m in model.modules() for hook in m._forward_hooks.values()
            if getattr(hook, "hook", hook) in (uses._after_layer, uses._end_forward)]
    assert len(ours) == 1 + 3  # the model's, and one per layer holding the matrix
    quantity = cgn.PerExampleGradNorm(linear(1), quantiles=QUANTILES, param_names=problem.names)
    got = rows(run_step(problem, [quantity]), schema.PER_EXAMPLE_NORM)
    expected = references.per_example_grad_norm(
        model, problem.per_example_loss, problem.inputs, problem.targets, quantiles=QUANTILES)
    assert_statistics_match(got, expected)
