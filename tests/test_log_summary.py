"""The summary line a streamed log ends with, and the ranking read from it.

`LogStream.close` writes, per layer, the finite sums of the statistics that
rank layers; `view_rows._summed` ranks from them without decoding a number.
That ranking must be `noise_ranking` of the full frame to the bit (scores,
their order, the network's mean, the step counts), and a log without the
summary (older, a killed writer, something appended after it, a step
written twice) must be ranked from its numbers, with the same report and
dashboard.
"""

import json
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import cli
from cockpit_gradnoise.logs import selective
from cockpit_gradnoise.logs.schema import GRADIENT_VARIANCE, NETWORK, SNR_MEDIAN, encode_float
from cockpit_gradnoise.views import reads as view_rows
from cockpit_gradnoise.views.common import noise_ranking
from cockpit_gradnoise.views.report import build_report, format_report

import numpy
import pandas
import pytest

from benchmarks import benchmark_log

TENSORS = 8


def _snr(rng, layer: int, step: int) -> float:
    """Values whose plain sum and compensated sum differ in the last bits: magnitudes
    twenty decades apart, cancellations, and now and then no finite value."""
    if layer == 0:
        return [1e10, 1.0, -1e10, 3.0][step % 4] * (1 + rng.uniform(0, 1e-6))
    if layer == 1 and step % 3 == 0:
        return [math.nan, math.inf, -math.inf][step % 9 // 3]
    return float(rng.uniform(0.1, 3.0) * 10.0 ** rng.integers(-10, 10))


#: The last step finite (benchmark_log.fill puts a NaN or inf in every 7th and 5th), so
#: that the report is at the last step, where the summary ranks.
STEPS = range(402)


def write_log(path, steps=STEPS, *, repeat=None):
    """A streamed log of the five quantities, the median SNRs of :func:`_snr`; ``repeat``:
    that step written twice (the second replaces the first)."""
    cockpit, rng = benchmark_log.synthetic_cockpit(TENSORS), numpy.random.default_rng(5)
    with cgn.LogStream(path) as stream:
        for step in steps:
            for _ in range(2 if step == repeat else 1):
                benchmark_log.fill(cockpit, step, rng)
                rows = cockpit.quantities[0].output[step]
                assert type(cockpit.quantities[0]).__name__ == GRADIENT_VARIANCE
                for layer, name in enumerate(cockpit.names):
                    rows[name][SNR_MEDIAN] = encode_float(_snr(rng, layer, step))
                stream.append(cockpit)
    return path


def without_summary(path, to):
    """The log at ``path`` as a killed writer (or an older version) leaves it."""
    data = path.read_bytes()
    to.write_bytes(data[:data.rindex(b'{"layout": [], "summary"')])
    return to


def same_ranking(got, expected):
    assert (got.quantity, got.statistic, got.steps) == (expected.quantity, expected.statistic,
                                                        expected.steps)
    assert list(got.scores.index) == list(expected.scores.index)
    assert got.scores.to_numpy().view(numpy.int64).tolist() == \
        expected.scores.to_numpy().view(numpy.int64).tolist()  # to the bit
    assert numpy.float64(got.network).view(numpy.int64) == \
        numpy.float64(expected.network).view(numpy.int64)
    assert got.finite_steps.to_dict() == {str(k): v for k, v in expected.finite_steps.items()}


def test_the_summary_ranks_as_the_full_frame_to_the_bit(tmp_path):
    path = write_log(tmp_path / "run.jsonl")
    full = cgn.to_frame(path)
    expected = noise_ranking(full)
    summed, ranking = view_rows._summed(selective.index_log(path))
    assert summed
    same_ranking(ranking, expected)
    # The log makes that delicate: a plain sum of layer 0 differs from pandas' in the last bits.
    rows = full[(full.statistic == SNR_MEDIAN) & (full.param == "layer0.weight")]
    values = rows.value.to_numpy()
    plain = values[numpy.isfinite(values)].sum() / numpy.isfinite(values).sum()
    assert plain != expected.scores[rows.param.iloc[0]]
    assert expected.finite_steps[rows.param.iloc[0]] == len(STEPS)
    assert 0 < expected.finite_steps["layer0.bias"] < len(STEPS)


def test_the_summary_line_holds_sums_and_counts(tmp_path):
    path = write_log(tmp_path / "run.jsonl", range(3))
    index = selective.index_log(path)
    sums = index.sums(GRADIENT_VARIANCE, SNR_MEDIAN)
    frame = cgn.to_frame(path)
    rows = frame[(frame.quantity == GRADIENT_VARIANCE) & (frame.statistic == SNR_MEDIAN)]
    assert sums.steps == 3
    assert sums.params == [*dict.fromkeys(rows[numpy.isfinite(rows.value)].param.astype(str))]
    assert NETWORK in sums.params
    for param, finite in zip(sums.params, sums.finite.tolist()):
        values = rows[rows.param == param].value.to_numpy()
        assert finite == numpy.isfinite(values).sum()


def test_plot_and_report_read_no_ranking_number_with_a_summary(tmp_path, monkeypatch):
    path = write_log(tmp_path / "run.jsonl")
    full = cgn.to_frame(path)
    expected_layers = view_rows.plot_rows(without_summary(path, tmp_path / "old.jsonl"))[1]
    part, ranking = view_rows.report_frame(path)
    snr = (part.quantity == GRADIENT_VARIANCE) & (part.statistic == SNR_MEDIAN)
    assert ranking is not None and snr.sum() <= TENSORS + 1 + (~numpy.isfinite(part.value)).sum()
    assert format_report(build_report(part, ranking=ranking)) == format_report(build_report(full))

    def refuse(self, picks):
        raise AssertionError("decoded the ranking's numbers")

    monkeypatch.setattr(selective.LogIndex, "numbers", refuse)
    assert view_rows.plot_rows(path)[1] == expected_layers


@pytest.mark.parametrize("case", ["killed writer", "appended after", "step twice"])
def test_without_a_valid_summary_the_numbers_rank_alike(tmp_path, case, capsys):
    if case == "step twice":
        path = write_log(tmp_path / "run.jsonl", repeat=120)
    else:
        path = without_summary(write_log(tmp_path / "whole.jsonl"), tmp_path / "run.jsonl")
        if case == "appended after":
            summary = (tmp_path / "whole.jsonl").read_bytes()[len(path.read_bytes()):]
            path.write_bytes(path.read_bytes() + summary + b'{"names": {}}\n')
    index = selective.index_log(path)
    assert view_rows._summed(index) == (False, None)
    if case == "step twice":  # the writer sums nothing of a quantity with a step replaced
        quantity = index.quantities.index(GRADIENT_VARIANCE)
        assert [e for e in index.summary["sums"] if e["quantity"] == quantity] == []
    full = cgn.to_frame(path)
    order = [n for n in dict.fromkeys(full.param.astype(str)) if n != NETWORK]
    for k in (1, 3, TENSORS):
        assert view_rows._noisiest(index, k, order) == \
            view_rows.chosen_layers(list(noise_ranking(full).scores.index), order, k)
    part, ranking = view_rows.report_frame(path)
    assert ranking is None
    assert format_report(build_report(part)) == format_report(build_report(full))
    assert cli.main(["report", str(path)]) == 0
    assert "noisiest" in capsys.readouterr().out


def test_a_report_before_the_last_step_ranks_from_the_numbers(tmp_path):
    path = write_log(tmp_path / "run.jsonl")
    index = selective.index_log(path)
    assert view_rows._summed(index, until=STEPS[-2]) == (False, None)
    assert view_rows._summed(index, until=STEPS[-1])[0]
    full = cgn.to_frame(path)
    part, ranking = view_rows.report_frame(path, step=200)
    assert ranking is None
    assert format_report(build_report(part, step=200)) == \
        format_report(build_report(full, step=200))


def test_logs_with_and_without_the_summary_give_the_same_report_and_picture(tmp_path):
    path = write_log(tmp_path / "run.jsonl")
    old = without_summary(path, tmp_path / "old.jsonl")
    assert cgn.report(path).replace(str(path), "") == cgn.report(old).replace(str(old), "")
    shown = []
    for log in (path, old):
        rows, drawn = view_rows.plot_rows(log)
        shown.append((list(drawn), pandas.util.hash_pandas_object(rows.frame()).sum()))
    assert shown[0] == shown[1]


def test_a_reader_from_before_summaries_takes_the_line_for_an_empty_layout(tmp_path):
    """Readers before the summary refuse lines they do not know; to them it is a layout
    line that declares nothing, and that no record names."""
    path = write_log(tmp_path / "run.jsonl", range(5))
    last = path.read_bytes().splitlines()[-1]
    item = json.loads(last)
    assert set(item) == {"layout", "summary"} and item["layout"] == []
    old = tmp_path / "old.jsonl"  # what such a reader reads of it
    old.write_bytes(path.read_bytes()[:-len(last) - 1] + b'{"layout": []}\n')
    pandas.testing.assert_frame_equal(cgn.to_frame(old), cgn.to_frame(path))
