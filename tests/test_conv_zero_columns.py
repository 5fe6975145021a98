"""A convolution's sums skip the kernel elements that read only zero padding (``conv_math``):
against the per-example loop in float64 (``tests/test_convolution_extensions.py``'s), and the
products of every column where a factor is not finite (``0 * inf`` is NaN)."""

import math

from cockpit_gradnoise.extensions import conv_math, cost_model

import pytest
import torch
from torch import nn

from tests.helpers import RTOL
from tests.test_convolution_extensions import ConvCase, assert_results_match, build, expected_for, extension_results

PADDED_ONE_POSITION = ConvCase(  # resnet18's last stage at 32x32: 8 of 9 kernel elements read padding
    "conv2d-one-position-padded", lambda bias: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=bias), (4, 1, 1))
PADDED_FOUR_POSITIONS = ConvCase(  # resnet18's third stage at 32x32: 3x3 over 2x2 positions
    "conv2d-four-positions-padded", lambda bias: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=bias), (4, 2, 2))


def recorded(monkeypatch, name):
    """``conv_math.<name>``'s results, recorded as the rules call it."""
    results, original = [], getattr(conv_math, name)
    monkeypatch.setattr(conv_math, name, lambda b, a: results.append(original(b, a)) or results[-1])
    return results


def test_one_position_skips_the_columns_of_padding(monkeypatch):
    """At one position, the kernel elements that read only zero padding are left out of the
    two products (:func:`.conv_math.add_products`), and the sums still match the loop."""
    kept = recorded(monkeypatch, "nonzero_columns")
    model, _, loss_fn, inputs, targets = build(PADDED_ONE_POSITION, True, 7, "mean")
    got = extension_results(model, loss_fn, inputs, targets)
    # Columns ordered (kernel element, channel): the centre (element 4) of both channels of a group.
    assert [k.tolist() for k in kept] == [[8, 9]]
    assert_results_match(got, expected_for(PADDED_ONE_POSITION, True, 7, "mean"))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunks"])
def test_expanded_sums_skip_the_columns_of_padding_row_by_row(chunked, monkeypatch):
    """Over 2x2 positions each position reads padding at 5 of 9 kernel elements, each product
    of two positions at 5 to 8: the expansion's products skip them row by row
    (:func:`.conv_math.nonzero_columns_of_rows`), and ``[T, S, R]`` match the loop within
    the expansion's bound."""
    monkeypatch.setattr(cost_model, "FORCE_METHOD", "expansion")
    monkeypatch.setattr(conv_math, "COLUMN_BLOCK", 2)  # a kernel element's 2 channels of a group
    if chunked:  # chunks of 3, 3 and 1 examples
        monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: 3)
    kept = recorded(monkeypatch, "nonzero_columns_of_rows")
    model, _, loss_fn, inputs, targets = build(PADDED_FOUR_POSITIONS, True, 7, "mean")
    got = extension_results(model, loss_fn, inputs, targets)
    assert len(kept) == (3 if chunked else 1) and all(rows is not None for rows in kept)
    # Kernel elements read at each position, then at both of each pair (l, l'), l <= l'.
    elements = [sum(stop - start for start, stop in runs) // 2 for runs in kept[0]]
    assert elements == [4, 4, 4, 4] + [4, 2, 2, 1] + [4, 1, 2] + [4, 2] + [4]
    assert_results_match(got, expected_for(PADDED_FOUR_POSITIONS, True, 7, "mean"), expanded=True)


def test_products_over_nonzero_columns_are_the_products_where_b_is_finite():
    generator = torch.Generator().manual_seed(0)
    b = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    a = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    a[..., [0, 2, 3, 5, 7]] = 0
    a[1, 0, 5] = math.nan  # a NaN is not 0: its column is multiplied
    sums = torch.zeros(2, 2, 3, 8, dtype=torch.float64)
    conv_math.add_products(sums, b, a)
    assert conv_math.nonzero_columns(b, a).tolist() == [1, 4, 5, 6]
    torch.testing.assert_close(sums, torch.stack([b @ a, b.square() @ a.square()]), rtol=RTOL, atol=0,
                               equal_nan=True)
    assert (sums[..., [0, 2, 3, 7]] == 0).all()
    for large in (math.inf, 1e200):  # b, or only its square, not finite: 0 * inf is NaN
        b[0, 1, 2] = large
        sums.zero_()
        conv_math.add_products(sums, b, a)
        torch.testing.assert_close(sums, torch.stack([b @ a, b.square() @ a.square()]), rtol=RTOL, atol=0,
                                   equal_nan=True)
        assert sums[1, 0, 1, 0].isnan()


def test_expanded_products_where_a_product_of_b_is_not_finite_are_those_of_every_column(monkeypatch):
    """``b_il b_il'`` overflowing to ``inf`` (``b`` finite): every column is multiplied, so a
    column of zeros gives NaN, as the products over all columns do."""
    generator = torch.Generator().manual_seed(1)
    b = torch.randn(3, 1, 2, 2, generator=generator, dtype=torch.float64)  # [n, G, C_b, L]
    a = torch.randn(3, 1, 2, 4, generator=generator, dtype=torch.float64)  # [n, G, L, C_a]
    a[..., 1] = 0
    a[:, :, 0, 2] = a[:, :, 1, 3] = 0
    skipping = conv_math.nonzero_columns_of_rows
    monkeypatch.setattr(conv_math, "COLUMN_BLOCK", 1)

    def both():
        """``(sums, the same over every column, the columns kept)``."""
        kept = []
        monkeypatch.setattr(conv_math, "nonzero_columns_of_rows", lambda b, a: kept.append(skipping(b, a)) or kept[0])
        got = conv_math.expanded_sums_of_factors(iter([(b, a)]), 2)
        monkeypatch.setattr(conv_math, "nonzero_columns_of_rows", lambda b, a: None)
        return got, conv_math.expanded_sums_of_factors(iter([(b, a)]), 2), kept[0]

    b[0, 0, 0] = 1e200
    got, every, kept = both()
    assert kept is None and got[1, 0, 0, 1].isnan()
    torch.testing.assert_close(got, every, rtol=RTOL, atol=0, equal_nan=True)
    b[0, 0, 0] = 1.0  # finite: the zeros skipped
    got, every, kept = both()
    assert kept == [[(0, 1), (3, 4)], [(0, 1), (2, 3)], [(0, 1), (3, 4)], [(0, 1)], [(0, 1), (2, 3)]]
    assert (got[:, :, :, 1] == 0).all()
    torch.testing.assert_close(got, every, rtol=RTOL, atol=0)


def test_zeros_scattered_over_columns_keep_whole_blocks_or_every_column(monkeypatch):
    """Columns are kept in aligned blocks (a block with one nonzero column whole), and rows cut
    into more than ``RUNS_PER_ROW`` runs on average take the products of every column."""
    monkeypatch.setattr(conv_math, "COLUMN_BLOCK", 4)
    b = torch.ones(1, 2, 3)  # [G, C_b, rows]
    a_rows = torch.zeros(1, 3, 2, 40)  # [G, rows, n, C_a]
    a_rows[0, :, 1, [1, 6, 30]] = 1.0  # blocks 0, 1 and 7 of 10
    assert conv_math.nonzero_columns_of_rows(b, a_rows) == [[(0, 8), (28, 32)]] * 3
    a_rows[0, 0, 0, 12:24:4] = 1.0  # blocks 3 to 5 of the first row: 7 runs in 3 rows
    assert conv_math.nonzero_columns_of_rows(b, a_rows) is not None
    monkeypatch.setattr(conv_math, "RUNS_PER_ROW", 1)
    assert conv_math.nonzero_columns_of_rows(b, a_rows) is None
