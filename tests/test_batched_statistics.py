"""Statistics of every parameter of a step at once (issue 32): the same numbers as one at a time.

The per-example norms' quantiles of a ``[P, N]`` table equal ``numpy.quantile`` of each row bit
for bit, as the one-parameter path does; means (float64 sums in another order) agree to their
rounding, ``(N - 1) eps64`` relative for ``N`` terms of one sign; finiteness of all parameters
at once is ``isfinite(t).all()`` of each parameter's tensors.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device, functional, order_statistics
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.step import Step

import numpy
import pytest
import torch

LEVELS = (0.0, 0.05, 0.25, 0.5, 0.95, 1.0)


def _table(rows, n, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, n, generator=generator, dtype=torch.float64).exp().to(dtype)
    table[0, : n // 2] = table[0, -1]  # ties
    return table


@pytest.mark.parametrize("n", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantiles_of_each_row_equal_numpy_bit_for_bit(n, dtype):
    table = _table(5, n, dtype)
    ordered = order_statistics.sorted_rows(table)
    columns = order_statistics.quantiles_of_sorted_rows(ordered, LEVELS)
    for r, row in enumerate(table.numpy().astype(numpy.float64)):
        expected = numpy.quantile(row, LEVELS)
        assert [float(column[r]) for column in columns] == expected.tolist(), (n, r)


def test_sorted_rows_put_every_nan_last_and_sort_the_rest():
    table = torch.tensor([[3.0, math.nan, 1.0, -math.nan, 2.0], [5.0, 4.0, math.inf, -1.0, 0.0]])
    ordered = order_statistics.sorted_rows(table)
    assert ordered[0, :3].tolist() == [1.0, 2.0, 3.0] and ordered[0, 3:].isnan().all()
    assert ordered[1].tolist() == [-1.0, 0.0, 4.0, 5.0, math.inf]


@pytest.mark.parametrize("on_host", [True, False])
def test_norm_statistics_of_rows_are_those_of_each_row(on_host, monkeypatch):
    """Against :func:`per_example_norm_statistics` of each row, the path of one parameter."""
    if not on_host:
        monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    table = _table(6, 9, torch.float64)
    table[2, 3] = -1e-30  # a rounding-negative squared norm counts as 0
    columns = functional.per_example_norm_statistics_of_rows(table, LEVELS)
    rows = functional.rows_of_columns(schema.norm_statistic_names(LEVELS), columns)
    assert len(rows) == 6
    for row, squared_norms in zip(rows, table):
        expected = functional.per_example_norm_statistics(squared_norms, LEVELS)
        got = _device.resolve(row)
        assert list(got) == list(expected)
        for name, value in expected.items():
            rel = 8 * 2.0**-53 if name == schema.MEAN else 0  # 9 float64 terms in another order
            assert got[name] == pytest.approx(value, rel=rel, abs=0), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finiteness_of_every_parameter_at_once_is_isfinite_all(dtype, monkeypatch):
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    monkeypatch.setattr(_device, "CHUNK", 8)  # "large" tensors, small: the test stays fast
    largest = torch.finfo(dtype).max
    big = torch.full((4,), largest, dtype=dtype)
    groups = [[torch.ones(3, dtype=dtype), big]]
    for value in (math.inf, -math.inf, math.nan):
        groups += [[torch.tensor([1.0, value], dtype=dtype), big], [big, torch.tensor([value], dtype=dtype)]]
    large = torch.ones(_device.CHUNK + 1, dtype=torch.float64)  # float64 beyond CHUNK: one by one
    groups += [[large, torch.ones(2, dtype=dtype)], [large, torch.tensor([math.nan], dtype=dtype)]]
    step = Step(0)
    expected = [all(bool(torch.isfinite(t).all()) for t in group) for group in groups]
    for _ in range(2):  # the second time from what the first computed
        answers = step.finite_each(groups)
        assert [bool(answer) for answer in answers] == expected
    assert [bool(step.finite(group)) for group in groups] == expected  # shared with finite()
    groups[0][0][1] = math.nan  # in place: its version moved, tested again
    assert not bool(step.finite_each(groups)[0])


def test_norms_of_parameters_of_two_dtypes_and_the_network_at_once():
    """Rows of float32 and float64 per-example norms each in their own dtype, the network's
    their float64 sum: as :meth:`statistics` of each value and of the values' sum."""
    quantity = cgn.PerExampleGradNorm(lambda step: True, quantiles=LEVELS)
    values = [_table(1, 8, dtype, seed)[0] for seed, dtype in
              enumerate([torch.float32, torch.float64, torch.float32, torch.float64])]
    rows, network = quantity.statistics_of_values(values, True)
    for row, value in zip(rows, values):
        expected = quantity.statistics(value)
        assert row[schema.MEAN] == pytest.approx(expected[schema.MEAN], rel=8 * 2.0**-53, abs=0)
        assert {k: v for k, v in row.items() if k != schema.MEAN} == \
            {k: float(v) for k, v in expected.items() if k != schema.MEAN}
    expected = _device.resolve(quantity.statistics(sum(v.double() for v in values)))
    assert network == pytest.approx(expected, rel=4 * 2.0**-53, abs=0)


def test_noise_scale_estimates_of_every_parameter_at_once(monkeypatch):
    """On other devices S and M are tensors: every row's estimates at once, the network's
    from their sums, as :meth:`statistics` of each value and of :meth:`network_value`."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    quantity = cgn.GradientNoiseScale(lambda step: True)
    generator = torch.Generator().manual_seed(1)
    pieces = torch.rand(5, 2, generator=generator, dtype=torch.float64)
    values = [(s + m, m, 4) for s, m in pieces]  # S >= M
    values[1] = (values[1][0], torch.zeros((), dtype=torch.float64), 4)  # grad_sq < 0: b_simple inf
    rows, network = _device.resolve(quantity.statistics_of_values(values, True))
    expected = [_device.resolve(quantity.statistics(v)) for v in values + [quantity.network_value(values)]]
    assert rows[1][schema.B_SIMPLE] == math.inf
    for got, wanted in zip(rows + [network], expected):
        assert got == pytest.approx(wanted, rel=1e-15, abs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_finiteness_of_every_parameter_at_once_on_the_cpu(dtype, monkeypatch):
    """The CPU's answers (bools): each group as :meth:`Step.finite` answers it."""
    monkeypatch.setattr(_device, "CHUNK", 8)  # "large" tensors, small: the test stays fast
    largest = torch.finfo(dtype).max
    big = torch.full((4,), largest, dtype=dtype)
    groups = [[torch.ones(3, dtype=dtype), big], [torch.ones(_device.CHUNK + 1, dtype=dtype), big]]
    for value in (math.inf, -math.inf, math.nan):
        groups += [[torch.tensor([1.0, value], dtype=dtype), big], [big, torch.tensor([value], dtype=dtype)]]
    groups.append([torch.full((_device.CHUNK + 1,), value, dtype=dtype), big])
    step = Step(0)
    expected = [all(bool(torch.isfinite(t).all()) for t in group) for group in groups]
    assert step.finite_each(groups) == expected
    assert [step.finite(group) for group in groups] == expected
    groups[0][0][1] = math.nan  # in place: its version moved, tested again
    assert step.finite_each(groups)[0] is False
