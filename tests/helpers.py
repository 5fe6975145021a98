"""Assertions and frame helpers shared by several test files."""

import pytest

import cockpit_gradnoise as cgn
from cockpit_gradnoise import schema

RTOL = 1e-10


def without_coverage(rows):
    """``rows`` without the network's ``params_covered``/``params_total`` (tested apart)."""
    return {
        name: {s: v for s, v in stats.items() if s not in schema.COVERAGE_STATISTICS}
        for name, stats in rows.items()
    }


def assert_statistics_match(got, expected, rtol=RTOL, rtol_of=None):
    """``got`` equals ``expected`` statistic by statistic (``inf == inf``).

    Both are ``{param: {statistic: float}}``; the network's coverage
    statistics in ``got`` are left out. ``rtol_of(name, statistic)``, if given,
    overrides ``rtol`` per statistic.
    """
    got = without_coverage(got)
    assert set(got) == set(expected)
    for name, stats in expected.items():
        assert set(got[name]) == set(stats), name
        for statistic, value in stats.items():
            tolerance = rtol if rtol_of is None else rtol_of(name, statistic)
            assert got[name][statistic] == pytest.approx(value, rel=tolerance, abs=0), (
                name,
                statistic,
            )


def rows(cockpit, quantity, step=0):
    """``{param: {statistic: float}}`` of ``quantity`` at ``step``, via ``to_frame``."""
    frame = cgn.to_frame(cockpit)
    frame = frame[(frame.quantity == quantity) & (frame.step == step)]
    result = {}
    for param, statistic, value in zip(frame.param, frame.statistic, frame.value):
        result.setdefault(param, {})[statistic] = value
    return result
