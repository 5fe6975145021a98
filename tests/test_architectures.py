"""The models people train: ResNets (in-place operations, BatchNorm in training mode)."""

import copy
import itertools
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.logs import schema

import pytest
import torch
from backpack import extend
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import Problem, run_step
from tests.helpers import RTOL, assert_statistics_match, rounding_bounds, rows, sd_rtol


def resnet18(inplace=True):
    from torchvision.models import resnet18 as torchvision_resnet18

    model = torchvision_resnet18(num_classes=3)
    for module in model.modules():
        if hasattr(module, "inplace"):
            module.inplace = inplace
    return model


def test_prepare_model_keeps_resnet18_as_it_is_and_its_in_place_operations_work():
    model = resnet18()
    names = [n for n, _ in model.named_parameters()]
    prepared = cgn.prepare_model(model)
    assert prepared is model and type(prepared).__name__ == "ResNet"
    assert [n for n, _ in prepared.named_parameters()] == names
    duplicate = copy.deepcopy(prepared)  # as references and checkpoints make
    prepared(torch.randn(2, 3, 32, 32)).sum().backward()  # no in-place error
    duplicate(torch.randn(2, 3, 32, 32)).sum().backward()


def test_the_converter_on_request_keeps_resnet18s_parameters_and_names():
    model = resnet18()
    names = [n for n, _ in model.named_parameters()]
    prepared = cgn.prepare_model(model, use_converter=True)
    assert isinstance(prepared, torch.fx.GraphModule)
    assert [n for n, _ in prepared.named_parameters()] == names
    assert all(a is b for a, b in zip(prepared.parameters(), model.parameters()))
    prepared(torch.randn(2, 3, 32, 32)).sum().backward()


def test_plain_backpack_extend_of_resnet18_fails_as_the_issue_reports():
    """The failure the hooks of prepare_model avoid, so the tests above stay meaningful."""
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        extend(resnet18())(torch.randn(2, 3, 32, 32))


def train_mode_problem(n, reduction):
    torch.manual_seed(0)
    model = cgn.prepare_model(resnet18().double().train())
    return Problem(
        model,
        extend(nn.CrossEntropyLoss(reduction=reduction)),
        nn.CrossEntropyLoss(reduction="none"),
        torch.randn(n, 3, 32, 32, dtype=torch.float64),
        torch.randint(0, 3, (n,)),
        reduction,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_resnet18_in_training_mode_gives_each_examples_contribution_through_the_batch(reduction):
    """Exact against contributions formed from one batch backward pass with hooks."""
    n = 3
    problem = train_mode_problem(n, reduction)
    reference_model = copy.deepcopy(problem.model)
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
        cgn.GradientNoiseScale(linear(1), param_names=problem.names),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = run_step(problem, quantities)
    interact = [str(w.message) for w in caught if "examples interact" in str(w.message)]
    assert len(interact) == 1 and "GradientNoiseScale's estimates" in interact[0]  # one for the step
    contributions = references.contributions_through_batch(
        reference_model, problem.loss_fn, problem.inputs, problem.targets
    )
    scale = 1.0 / n if reduction == "mean" else 1.0
    gradients = {name: x / scale for name, x in contributions.items()}
    args = (None, None, problem.inputs, None)
    expected_sd = references.gradient_variance_quantiles(
        *args, reduction=reduction, gradients=gradients
    )
    tolerances = {name: sd_rtol(gradients, n, name, 32 * 32) for name in expected_sd}
    assert_statistics_match(
        rows(cockpit, schema.GRADIENT_VARIANCE),
        expected_sd,
        rtol_of=lambda name, statistic: tolerances[name],
    )
    assert_statistics_match(
        rows(cockpit, schema.PER_EXAMPLE_NORM),
        references.per_example_grad_norm(*args, gradients=gradients),
    )
    got = rows(cockpit, schema.NOISE_SCALE)
    numel = {name: x[0].numel() for name, x in gradients.items()}
    numel[schema.NETWORK] = sum(numel.values())
    for name, stats in references.gradient_noise_scale(*args, gradients=gradients).items():
        grad_sq, trace_cov = stats[schema.GRAD_SQ], stats[schema.TRACE_COV]
        atol_g, atol_t = rounding_bounds(n, numel[name], grad_sq, trace_cov)
        assert got[name][schema.GRAD_SQ] == pytest.approx(grad_sq, rel=RTOL, abs=atol_g)
        assert got[name][schema.TRACE_COV] == pytest.approx(trace_cov, rel=RTOL, abs=atol_t)


def attention_pair(batch_first, bias=True):
    torch.manual_seed(0)
    original = nn.MultiheadAttention(8, 2, bias=bias, batch_first=batch_first).double()
    converted = cgn.attention.from_multihead_attention(copy.deepcopy(original))
    return original, converted


def masks(length):
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)  # True: may not attend
    padding = torch.zeros(3, length, dtype=torch.bool)
    padding[1, -2:] = True
    return [
        {},
        {"attn_mask": causal},
        {"attn_mask": causal.double().masked_fill(causal, -1e4)},
        {"key_padding_mask": padding},
        {"attn_mask": causal, "key_padding_mask": padding},
        {"attn_mask": causal, "is_causal": True},
    ]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_linear_attention_computes_multihead_attention_outputs_and_gradients(
    batch_first, bias, need_weights
):
    original, converted = attention_pair(batch_first, bias)
    for kwargs, inputs in itertools.product(masks(5), ["self", "key-is-value", "distinct"]):
        query, key, value = (torch.randn(3, 5, 8, dtype=torch.float64) for _ in range(3))
        if not batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        args = {"self": (query, query, query), "key-is-value": (query, key, key),
                "distinct": (query, key, value)}[inputs]
        results = []
        for module in (original, converted):
            module.zero_grad()
            out, weights = module(*args, need_weights=need_weights, **kwargs)
            out.square().sum().backward()
            results.append((out, weights, [p.grad for p in module.parameters()]))
        (out_a, w_a, g_a), (out_b, w_b, g_b) = results
        torch.testing.assert_close(out_b, out_a, rtol=1e-12, atol=1e-12)
        for grad_b, grad_a in zip(g_b, g_a, strict=True):
            torch.testing.assert_close(grad_b, grad_a, rtol=1e-10, atol=1e-12)
        assert (w_a is None) == (w_b is None) == (not need_weights)
        if need_weights:
            torch.testing.assert_close(w_b, w_a, rtol=1e-12, atol=1e-12)


def test_converting_attention_keeps_parameters_names_and_state_dict_both_ways():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    before, state = dict(layer.named_parameters()), copy.deepcopy(layer.state_dict())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    expected = layer(x)
    cgn.convert_attention(layer)
    assert isinstance(layer.self_attn, cgn.LinearAttention)
    after = dict(layer.named_parameters())
    assert list(after) == list(before) and all(after[n] is p for n, p in before.items())
    assert list(layer.state_dict()) == list(state)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # nn.TransformerEncoderLayer's fast path reads the same parameters
        torch.testing.assert_close(layer.eval()(x), expected, rtol=1e-12, atol=1e-12)
    layer.train()
    fresh = cgn.convert_attention(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                             batch_first=True).double())
    fresh.load_state_dict(state)  # a checkpoint of the original layout
    torch.testing.assert_close(fresh(x), expected, rtol=1e-12, atol=1e-12)
    cgn.restore_attention(layer)
    assert type(layer.self_attn) is nn.MultiheadAttention
    restored = dict(layer.named_parameters())
    assert list(restored) == list(before) and all(restored[n] is p for n, p in before.items())
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


class PositionsWithoutBatch(nn.Module):
    """Token and position embeddings; positions ``wpe(arange(T))`` or expanded per example."""

    def __init__(self, tied=False, expand=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(10, 4), nn.Embedding(6, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.expand = expand
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx):
        batch, length = idx.shape
        positions = torch.arange(length)
        positions = positions.expand(batch, length) if self.expand else positions
        return self.head(self.wte(idx) + self.wpe(positions)).mean(1)


def embedding_problem(**kwargs):
    torch.manual_seed(0)
    model = extend(PositionsWithoutBatch(**kwargs).double())
    return Problem(model, extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none"),
                   torch.randint(0, 10, (3, 5)), torch.randint(0, 10, (3,)), "mean")


def test_tied_parameters_are_refused_naming_them():
    problem = embedding_problem(tied=True)
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    with pytest.raises(ValueError, match=r"\['wte.weight'\] are used by several layers"):
        run_step(problem, [quantity])


def test_a_layer_applied_without_the_batch_dimension_is_left_out_naming_the_fix():
    problem = embedding_problem(expand=False)
    quantities = [
        cgn.GradientVarianceQuantiles(linear(1), param_names=problem.names),
        cgn.PerExampleGradNorm(linear(1), param_names=problem.names),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = run_step(problem, quantities)
    messages = [str(w.message) for w in caught if "without the batch dimension" in str(w.message)]
    assert len(messages) == 1 and "wpe(pos.expand(B, T))" in messages[0]  # one for the step
    got = rows(cockpit, schema.PER_EXAMPLE_NORM)
    assert set(got) == {"wte.weight", "head.weight", schema.NETWORK}
    assert got[schema.NETWORK][schema.PARAMS_COVERED] == 2
    expected = references.per_example_grad_norm(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    for name in ("wte.weight", "head.weight"):
        for statistic, value in expected[name].items():
            assert got[name][statistic] == pytest.approx(value, rel=RTOL)
