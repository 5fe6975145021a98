"""``Linear`` on sequences: per-example squared norms and the sums, alone and together.

``PerExampleSquaredNorms`` and ``SumsOfContributions`` in one backward pass
form each sequence Linear's contributions once (:mod:`cockpit_gradnoise.extensions.linear`).
Against one backward pass per example, in float64: both extensions together in
either order, each alone, both methods of the norms, chunks of examples.
"""

import gc
import weakref

from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    cost_model,
    linear,
)

import pytest
import torch
from backpack import backpack
from torch import nn

from tests.cases import ModelCase, build, case_named
from tests.helpers import RTOL


class SequenceMLP(nn.Module):
    """A Linear on ``[N, 2, 5, 3]`` (two extra dimensions, 10 positions), then one on ``[N, 40]``;
    other widths (``inner`` in and out, ``flat`` the second's input) as given."""

    def __init__(self, inner=(3, 4), flat=40):
        super().__init__()
        self.inner, self.out = nn.Linear(*inner), nn.Linear(flat, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)).flatten(1))


SEQUENCE_MLP = ModelCase("sequence-mlp", SequenceMLP, lambda n: torch.randn(n, 2, 5, 3))
CASES = [case_named("gpt"), SEQUENCE_MLP]
FORMED_CONTRIBUTIONS = linear.formed_contributions
ORDERS = {
    "sums-first": (SumsOfContributions, PerExampleSquaredNorms),
    "norms-first": (PerExampleSquaredNorms, SumsOfContributions),
    "sums-alone": (SumsOfContributions,),
    "norms-alone": (PerExampleSquaredNorms,),
}


def sequence_weights(model):
    """``(names, hooks)``: the hooks fill ``names`` in the forward pass with the weights
    of Linear layers applied to sequences (inputs of more than 2 dimensions)."""
    names, hooks = [], []

    def record(name):
        def hook(module, inputs, output):
            if inputs[0].dim() > 2:
                names.append(name + ".weight")

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(record(name)))
    return names, hooks


def run(case, n, reduction, extensions, monkeypatch, chunk=None):
    """``(problem, {name: (sums or None, norms or None)}, chunk sizes formed, names)``
    of one backward pass with ``extensions`` (in that order)."""
    problem = build(case, n, reduction)
    names, hooks = sequence_weights(problem.model)
    formed = []

    def recording(g, a):
        for x in FORMED_CONTRIBUTIONS(g, a):
            formed.append(len(x))
            yield x

    monkeypatch.setattr(linear, "formed_contributions", recording)
    if chunk is not None:
        monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: chunk)
    loss = problem.loss_fn(problem.model(problem.inputs), problem.targets)
    with backpack(*(extension() for extension in extensions)):
        loss.backward()
    for hook in hooks:
        hook.remove()
    params = dict(problem.model.named_parameters())
    results = {
        name: (getattr(params[name], SUMS_SAVEFIELD, None), getattr(params[name], BATCH_L2_SAVEFIELD, None))
        for name in names
    }
    return problem, results, formed, names


def expected(problem, n, reduction):
    """``{name: per-example contributions x_i}`` from one backward pass per example."""
    grads = references.per_example_gradients(
        problem.model, problem.per_example_loss, problem.inputs, problem.targets
    )
    scale = 1.0 / n if reduction == "mean" else 1.0
    return {name: scale * g for name, g in grads.items()}


def assert_match(results, contributions, order):
    assert results, "the case must have Linear layers on sequences"
    for name, (sums, norms) in results.items():
        x = contributions[name]
        if SumsOfContributions in order:
            squares = x.pow(2).sum(0)
            assert (sums[1] - squares).norm() <= RTOL * squares.norm(), name
            assert (sums[0] - x.sum(0)).norm() <= RTOL * x.abs().sum(0).norm(), name
        else:
            assert sums is None
        if PerExampleSquaredNorms in order:
            torch.testing.assert_close(norms, x.pow(2).sum((1, 2)), rtol=RTOL, atol=0)
        else:
            assert norms is None


@pytest.mark.parametrize("method", ["formation", "expansion", None], ids=["formation", "gram", "chosen"])
@pytest.mark.parametrize("order", ORDERS, ids=list(ORDERS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_results_match_per_example_loop(case, reduction, order, method, monkeypatch):
    monkeypatch.setattr(cost_model, "FORCE_METHOD", method)
    problem, results, _, _ = run(case, 5, reduction, ORDERS[order], monkeypatch)
    assert_match(results, expected(problem, 5, reduction), ORDERS[order])


@pytest.mark.parametrize("order", ORDERS, ids=list(ORDERS))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_chunks_of_examples_match_per_example_loop(case, order, monkeypatch):
    """7 examples in chunks of 3, 3 and 1, formed or by Gram matrices."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    problem, results, formed, names = run(case, 7, "sum", ORDERS[order], monkeypatch, chunk=3)
    assert formed == [3, 3, 1] * len(names)
    assert_match(results, expected(problem, 7, "sum"), ORDERS[order])
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")
    problem, results, _, _ = run(case, 7, "sum", ORDERS[order], monkeypatch, chunk=3)
    assert_match(results, expected(problem, 7, "sum"), ORDERS[order])


@pytest.mark.parametrize("order", ["sums-first", "norms-alone"])
def test_on_the_host_chunks_of_the_formation_budget_match_per_example_loop(order, monkeypatch):
    """On the host a sequence Linear forms its contributions in chunks of
    ``HOST_FORMATION_BYTES`` (here two float64 examples of the 4 x 3 weight, 192 bytes),
    at most ``CHUNK_BYTES`` (then one example at a time)."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    monkeypatch.setattr(cost_model, "HOST_FORMATION_BYTES", 2 * 12 * 8 + 10)
    problem, results, formed, names = run(SEQUENCE_MLP, 7, "mean", ORDERS[order], monkeypatch)
    assert formed == [2, 2, 2, 1] * len(names)
    assert_match(results, expected(problem, 7, "mean"), ORDERS[order])
    monkeypatch.setattr(cost_model, "CHUNK_BYTES", 12 * 8)
    problem, results, formed, names = run(SEQUENCE_MLP, 7, "mean", ORDERS[order], monkeypatch)
    assert formed == [1] * 7 * len(names)
    assert_match(results, expected(problem, 7, "mean"), ORDERS[order])  # one example's chunks added as they are


@pytest.mark.parametrize("order", ["sums-first", "norms-first"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_together_each_layer_is_formed_once(case, order, monkeypatch):
    """Each sequence Linear's contributions are formed once for both extensions,
    and the sums are the very numbers computed alone."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    _, together, formed, names = run(case, 5, "mean", ORDERS[order], monkeypatch)
    assert len(formed) == len(names) > 0
    _, sums_alone, formed_sums, _ = run(case, 5, "mean", ORDERS["sums-alone"], monkeypatch)
    _, norms_alone, formed_norms, _ = run(case, 5, "mean", ORDERS["norms-alone"], monkeypatch)
    assert len(formed_sums) == len(formed_norms) == len(names)
    for name in names:
        assert torch.equal(together[name][0], sums_alone[name][0]), name
        assert torch.equal(together[name][1], norms_alone[name][1]), name


def test_cost_model_chooses_gram_for_the_tests_gpt_and_formation_for_long_sequences(monkeypatch):
    """The case matrix's GPT (4 positions) takes the Gram matrices when the norms run
    alone; the sequence MLP (10 positions of 3 -> 4) takes formation."""
    for case, method in [(case_named("gpt"), "gram"), (SEQUENCE_MLP, "formation")]:
        _, _, formed, names = run(case, 5, "mean", ORDERS["norms-alone"], monkeypatch)
        assert len(formed) == (len(names) if method == "formation" else 0), case.name


@pytest.mark.parametrize(
    "shape, formation",
    [
        ((384, 128, 64), False),  # benchmark GPT: qkv
        ((128, 128, 64), False),  # proj
        ((512, 128, 64), False),  # MLP in
        ((128, 512, 64), False),  # MLP out
        ((4, 3, 10), True),  # the sequence MLP above
    ],
)
def test_cost_model_choices(shape, formation):
    """The choices for the benchmark GPT's layers, measured faster (per-layer tables of
    benchmarks/README.md at bb7178a, in git)."""
    assert cost_model.formation_is_cheaper(cost_model.gram_cost, *shape) is formation


@pytest.mark.parametrize("order", ["sums-first", "norms-first"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_together_no_result_outlives_its_savefield(case, order, monkeypatch):
    """The result formed for the second extension is not kept once it took it:
    deleting the savefields frees every result."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "formation")
    problem, results, _, _ = run(case, 5, "mean", ORDERS[order], monkeypatch)
    refs = [weakref.ref(result) for pair in results.values() for result in pair]
    del results
    for param in problem.model.parameters():
        for field in (SUMS_SAVEFIELD, BATCH_L2_SAVEFIELD):
            if hasattr(param, field):
                delattr(param, field)
    gc.collect()
    assert refs and all(ref() is None for ref in refs)


class OnePositionMLP(nn.Module):
    """A Linear on ``[N, 1, 1, 3]`` (extra dimensions of size 1, as ConvNeXt's last stage
    on 32x32 images), then one on ``[N, 4]``."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(3, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x)).flatten(1))


@pytest.mark.parametrize("order", ORDERS, ids=list(ORDERS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_one_position_is_two_products_and_no_formation(reduction, order, monkeypatch):
    case = ModelCase("one-position-mlp", OnePositionMLP, lambda n: torch.randn(n, 1, 1, 3))
    problem, results, formed, names = run(case, 5, reduction, ORDERS[order], monkeypatch)
    assert names == ["inner.weight"] and formed == []
    assert_match(results, expected(problem, 5, reduction), ORDERS[order])


# A Linear 160 -> 160 on [N, 2, 2, 160] (4 positions, as ConvNeXt's stage-3 pointwise layers
# at 32x32: the cost model expands its sums), then one on [N, 640].
FEW_POSITIONS = ModelCase("few-positions-mlp", lambda: SequenceMLP((160, 160), 640),
                          lambda n: torch.randn(n, 2, 2, 160))


@pytest.mark.parametrize("order", ORDERS, ids=list(ORDERS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_few_positions_expand_the_sums_and_take_the_norms_apart(reduction, order, monkeypatch):
    """The sums are ``[T, S, R]`` by the expansion, the norms by the Gram matrices, alone
    or together: no contribution is formed; both match the per-example loop."""
    problem, results, formed, names = run(FEW_POSITIONS, 5, reduction, ORDERS[order], monkeypatch)
    assert names == ["inner.weight"] and formed == []
    assert_match(results, expected(problem, 5, reduction), ORDERS[order])
    sums, _ = results["inner.weight"]
    if sums is not None:
        assert len(sums) == 3 and (sums[2] >= sums[1]).all()  # R = w(L) A >= A >= S


@pytest.mark.parametrize(
    "shape, formation",
    [
        ((1536, 384, 4), False),  # ConvNeXt-T stage 3 at 32x32: pointwise in
        ((384, 1536, 4), False),  # and out
        ((768, 192, 16), True),  # stage 2
        ((384, 96, 64), True),  # stage 1
        ((160, 160, 4), False),  # the few-positions MLP above
    ],
)
def test_cost_model_expands_the_sums_of_convnext_stage_3(shape, formation):
    """ConvNeXt-T's pointwise layers at 32x32: expansion measured 2-4x faster at 4
    positions (``benchmarks/README.md``); formation at 16 and 64."""
    assert cost_model.formation_is_cheaper(cost_model.expansion_cost, *shape) is formation


@pytest.mark.parametrize("block", [3, 10])
def test_gram_blocks_of_positions_match_per_example_loop(block, monkeypatch):
    """The norms by Gram matrices in blocks of ``GRAM_BLOCK`` positions (10 positions in
    blocks of 3, 3, 3, 1: pairs within a block once, pairs across blocks twice; or one
    block) are those of one backward pass per example."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")  # the norms by Gram matrices
    monkeypatch.setattr(linear, "GRAM_BLOCK", block)
    problem, results, formed, _ = run(SEQUENCE_MLP, 7, "mean", ORDERS["norms-alone"], monkeypatch)
    assert formed == []
    assert_match(results, expected(problem, 7, "mean"), ORDERS["norms-alone"])
    g, a = torch.randn(3, 10, 4, dtype=torch.float64), torch.randn(3, 10, 5, dtype=torch.float64)
    whole = torch.bmm(g, g.transpose(1, 2)).mul(torch.bmm(a, a.transpose(1, 2))).sum((1, 2))
    torch.testing.assert_close(linear.symmetric_gram_inner(g, a), whole, rtol=1e-13, atol=0)


def test_on_the_host_chunks_share_one_buffer_and_create_graph_records_a_new_one_each(monkeypatch):
    """``linear.formed_contributions`` writes each chunk into one buffer (its caller reduces a chunk
    before asking for the next); under ``create_graph``, where autograd refuses ``out=``, each chunk is
    its own product in the graph: the same sums and norms, differentiable."""
    monkeypatch.setattr(cost_model, "HOST_FORMATION_BYTES", 2 * 4 * 3 * 8)  # two float64 examples a chunk
    g, a = torch.randn(5, 6, 4, dtype=torch.float64), torch.randn(5, 6, 3, dtype=torch.float64)
    chunks = list(FORMED_CONTRIBUTIONS(g, a))  # all kept: fresh ones would each have their own memory
    assert [len(x) for x in chunks] == [2, 2, 1]
    assert len({x.untyped_storage().data_ptr() for x in chunks}) == 1
    sums, norms = linear.linear_weight_sums_and_squared_norms(a, g)
    x = torch.einsum("nlo,nli->noi", g, a)
    torch.testing.assert_close(sums, torch.stack([x.sum(0), x.square().sum(0)]))
    torch.testing.assert_close(norms, x.square().sum((1, 2)))
    wide = g.clone().requires_grad_()
    with torch.enable_grad():
        graph_sums, graph_norms = linear.linear_weight_sums_and_squared_norms(a, wide)
    torch.testing.assert_close(graph_sums, sums)
    torch.testing.assert_close(graph_norms, norms)
    assert graph_norms.requires_grad
