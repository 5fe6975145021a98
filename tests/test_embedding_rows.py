"""An Embedding's per-example norms and ``[T, S]`` from each example's rows only (issue 32, speed).

``extensions/embedding.py`` no longer forms the ``[N, V, d]`` contributions: it writes
``x_i[v]`` once per example, at the first position that uses row ``v``
(:func:`first_use_contributions`), and takes the norms and the sums from that. Each shortcut
is compared here with a float64 loop over examples and positions that forms ``x_i`` whole,
and :func:`in_memory_order` (the largest magnitude of a transposed output gradient read in
memory order) with the plain reduction.
"""

import math

from cockpit_gradnoise import references
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    SUMS_SAVEFIELD,
    PerExampleSquaredNorms,
    SumsOfContributions,
    embedding,
)
from cockpit_gradnoise.extensions._squares import in_memory_order, largest_magnitude

import pytest
import torch
from backpack import backpack, extend
from torch import nn

ROWS, WIDTH = 7, 3


def dense_contributions(idx, grad, rows, padding_idx=None):
    """``x_i`` ``[N, V, d]`` in float64, by a loop over examples and positions."""
    examples = grad.shape[0]
    flat_idx = idx.reshape(examples, -1)
    flat_grad = grad.reshape(examples, flat_idx.shape[1], -1)
    result = torch.zeros(examples, rows, flat_grad.shape[2], dtype=torch.float64)
    for i in range(examples):
        for p, v in enumerate(flat_idx[i].tolist()):
            if v != padding_idx:
                result[i, v] += flat_grad[i, p].double()
    return result


def lookup(seed, dtype, padding_idx=None, shape=(4, 2, 5)):
    """An Embedding, indices with repeats within and across examples, output gradients
    (NaN at the padding positions, which reach nothing)."""
    generator = torch.Generator().manual_seed(seed)
    module = nn.Embedding(ROWS, WIDTH, padding_idx=padding_idx)
    idx = torch.randint(0, ROWS - 2, shape, generator=generator)  # the last two rows unused
    idx[0, 0] = 2  # one row used at every position of a group
    grad = torch.randn(*shape, WIDTH, generator=generator, dtype=torch.float64).to(dtype)
    if padding_idx is not None:
        idx[1, 0, 0] = padding_idx
        grad[idx == padding_idx] = math.nan
    return module, idx, grad


@pytest.mark.parametrize("padding_idx", [None, 4])
def test_each_examples_row_is_written_once_at_its_first_position(padding_idx):
    module, idx, grad = lookup(0, torch.float64, padding_idx)
    flat_idx, flat_grad = embedding.lookups(module, idx, grad)
    written = embedding.first_use_contributions(flat_idx, flat_grad, ROWS)
    dense = dense_contributions(idx, grad, ROWS, padding_idx)
    for i in range(len(flat_idx)):
        nonzero = written[i].abs().sum(1) != 0
        used = flat_idx[i][nonzero].tolist()
        assert len(used) == len(set(used))  # each row once
        expected = [v for v in range(ROWS) if dense[i, v].abs().sum() != 0]
        assert sorted(used) == expected
        for p in nonzero.nonzero().flatten().tolist():
            assert flat_idx[i, :p].tolist().count(flat_idx[i, p].item()) == 0  # its first position
            torch.testing.assert_close(written[i, p], dense[i, flat_idx[i, p]], rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padding_idx", [None, 4])
def test_norms_and_sums_are_those_of_the_dense_contributions(dtype, padding_idx):
    module, idx, grad = lookup(1, dtype, padding_idx)
    dense = dense_contributions(idx, grad, ROWS, padding_idx)
    norms = embedding.BatchL2EmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)
    sums = embedding.SumsEmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)
    assert norms.dtype == torch.float64 and sums.shape == (2, ROWS, WIDTH)
    # Each x_i[v] is a float32 sum of at most P = 10 terms of magnitude <= max|e| (Higham:
    # error <= (P - 1) u sum |e|), then squared and summed in float32 (another N u or d V u
    # relative); float64 the same with its own eps.
    eps = torch.finfo(dtype).eps
    magnitudes = dense_contributions(idx, grad.abs(), ROWS, padding_idx)
    bound = 2 * (10 + ROWS * WIDTH) * eps
    assert ((norms - dense.square().sum((1, 2))).abs() <= bound * magnitudes.square().sum((1, 2))).all()
    assert ((sums[0] - dense.sum(0)).abs() <= bound * magnitudes.sum(0)).all()
    assert ((sums[1] - dense.square().sum(0)).abs() <= bound * magnitudes.square().sum(0)).all()
    unused = dense.abs().sum((0, 2)) == 0
    assert unused.any() and (sums[:, unused] == 0).all()  # rows no token uses: exactly 0
    if padding_idx is not None:
        assert (sums[:, padding_idx] == 0).all()


def test_squares_that_underflow_in_float32_are_summed_at_a_scale():
    module, idx, grad = lookup(2, torch.float32)
    grad = grad * 1e-25  # squares of 1e-50: 0 in float32
    dense = dense_contributions(idx, grad, ROWS)
    norms = embedding.embedding_squared_norms(module, idx, grad)
    sums = embedding.embedding_sums(module, idx, grad)
    torch.testing.assert_close(norms, dense.square().sum((1, 2)), rtol=1e-5, atol=0)
    torch.testing.assert_close(sums[1], dense.square().sum(0), rtol=1e-5, atol=0)


def test_no_vocabulary_sized_per_example_tensor_is_formed(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the dense [N, V, d] contributions were formed")

    monkeypatch.setattr(embedding.EmbeddingDerivativesAnyDtype, "_weight_jac_t_mat_prod", refused)
    module, idx, grad = lookup(3, torch.float32)
    embedding.BatchL2EmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)
    embedding.SumsEmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)
    embedding.GradEmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)


def _with_input(module, idx):
    module.input0 = idx
    return module


def test_the_largest_magnitude_of_a_transposed_tensor_is_read_in_memory_order():
    stored = torch.randn(3, 5, 4)
    stored[1, 2, 3] = -7.5
    transposed = stored.transpose(1, 2)  # [3, 4, 5] stored as [3, 5, 4], as GPT-2's head gradient
    assert not transposed.is_contiguous() and in_memory_order(transposed).is_contiguous()
    assert in_memory_order(transposed).data_ptr() == stored.data_ptr()
    assert largest_magnitude(transposed) == 7.5
    stored[0, 0, 0] = math.nan
    assert largest_magnitude(transposed).isnan()
    every_other = stored[:, ::2]  # not dense: left as it is, the same maximum
    assert in_memory_order(every_other) is every_other
    assert largest_magnitude(every_other) == every_other.abs().nan_to_num(0).amax() or \
        largest_magnitude(every_other).isnan()


def test_two_uses_sums_are_added_with_twice_their_cross_term_and_neither_is_written():
    from cockpit_gradnoise.extensions.tied import summed_pair

    generator = torch.Generator().manual_seed(4)
    before, own = (torch.randn(2, ROWS, WIDTH, generator=generator) for _ in range(2))
    cross = torch.randn(ROWS, WIDTH, generator=generator)
    kept = before.clone(), own.clone()
    result = summed_pair(before, own, cross)
    wide = before.double() + own.double()
    wide[1] += 2 * cross.double()
    magnitudes = before.double().abs() + own.double().abs()
    magnitudes[1] += 2 * cross.double().abs()
    # Two roundings of float32 at most: each within eps / 2 of the magnitudes it adds.
    assert ((result.double() - wide).abs() <= torch.finfo(torch.float32).eps * magnitudes).all()
    assert torch.equal(before, kept[0]) and torch.equal(own, kept[1])


@pytest.mark.parametrize("padding_idx", [None, 4])
def test_the_gradient_adds_each_positions_output_gradient_into_its_row(padding_idx):
    module, idx, grad = lookup(5, torch.float64, padding_idx)
    gradient = embedding.GradEmbeddingAnyDtype().weight(None, _with_input(module, idx), None, (grad,), None)
    torch.testing.assert_close(gradient, dense_contributions(idx, grad, ROWS, padding_idx).sum(0),
                               rtol=1e-14, atol=0)


class TwoLookups(nn.Module):
    """Two Embeddings on ``[N, 6]`` tokens (one with padding; rows repeated within examples),
    summed, and a Linear head on their mean over positions."""

    def __init__(self):
        super().__init__()
        self.words, self.positions = nn.Embedding(ROWS, WIDTH, padding_idx=4), nn.Embedding(ROWS, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.words(idx) + self.positions(idx.flip(1))).mean(1))


@pytest.mark.parametrize("order", ["sums-first", "norms-first"])
def test_both_extensions_form_the_first_use_contributions_once(order, monkeypatch):
    """With the sums and the norms in one backward pass, each Embedding's
    :func:`first_use_contributions` is formed once (the layer cache), and both results are
    the very numbers of each extension alone, and those of a float64 loop over examples."""
    torch.manual_seed(0)
    model = extend(TwoLookups().double())
    idx = torch.randint(0, ROWS, (5, 6))
    idx[0, :3] = 4  # padding
    targets = torch.randint(0, 3, (5,))
    formed = []
    first_use = embedding.first_use_contributions
    monkeypatch.setattr(embedding, "first_use_contributions",
                        lambda *args: (formed.append(args[0].shape), first_use(*args))[1])

    def results(*extensions):
        formed.clear()
        model.zero_grad()
        with backpack(*(extension() for extension in extensions)):
            extend(nn.CrossEntropyLoss())(model(idx), targets).backward()
        fields = {name: (getattr(p, SUMS_SAVEFIELD, None), getattr(p, BATCH_L2_SAVEFIELD, None))
                  for name, p in model.named_parameters() if name.endswith("s.weight")}
        for p in model.parameters():
            p.__dict__.pop(SUMS_SAVEFIELD, None), p.__dict__.pop(BATCH_L2_SAVEFIELD, None)
        return fields, len(formed)

    both = (SumsOfContributions, PerExampleSquaredNorms)
    together, count = results(*(both if order == "sums-first" else both[::-1]))
    assert count == 2  # once per Embedding, not once per extension
    sums_alone, count_sums = results(SumsOfContributions)
    norms_alone, count_norms = results(PerExampleSquaredNorms)
    assert count_sums == count_norms == 2
    x = references.per_example_gradients(model, nn.CrossEntropyLoss(reduction="none"), idx, targets)
    for name, (sums, norms) in together.items():
        assert torch.equal(sums, sums_alone[name][0]) and torch.equal(norms, norms_alone[name][1])
        contributions = x[name] / len(idx)
        torch.testing.assert_close(sums[0], contributions.sum(0), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(sums[1], contributions.square().sum(0), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(norms, contributions.square().sum((1, 2)), rtol=1e-12, atol=0)
