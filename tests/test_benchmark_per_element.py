"""Smoke test of benchmarks/benchmark_per_element.py: every candidate runs, and the floor
line adds up the table's medians. Never a timed assertion."""

import re

import pytest

from benchmarks import benchmark_per_element


def medians(stdout):
    """``{candidate: median ns/element}`` of the MLP's rows."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c for c in line.strip().strip("|").split("|")]
        if line.startswith("| mlp |") and len(cells) == 6:
            rows[cells[2]] = float(cells[3])
    return rows


def test_quick_run_prints_every_candidate_and_the_floors(one_thread, capsys):
    # one_thread restores the thread count the benchmark sets to 1.
    benchmark_per_element.main(["--quick"])
    stdout = capsys.readouterr().out
    rows = medians(stdout)
    names = [n.strip() for n in rows]
    for expected in ("reference: one sd, one SNR, one bincount", "GradientVarianceQuantiles: all",
                     benchmark_per_element.ELEMENTWISE.strip(), benchmark_per_element.PLAIN,
                     benchmark_per_element.SELECTION_FLOOR.strip(),
                     benchmark_per_element.PRODUCTS.strip(), "ParamGradRatio: all"):
        assert expected in names
    assert all(value > 0 for value in rows.values())
    line = next(line for line in stdout.splitlines() if line.startswith("mlp: "))
    numbers = [float(x) for x in re.findall(r"(\d+\.\d+)", line)]
    per_element, to_reference, step, to_plain, plain = numbers[0], numbers[1], numbers[3], numbers[4], numbers[5]
    median = {n.strip(): v for n, v in rows.items()}
    # The table prints medians to 0.01: the sums agree to the rounding of their terms.
    expected = median[benchmark_per_element.ELEMENTWISE.strip()] + median[
        benchmark_per_element.SELECTION_FLOOR.strip()]
    assert per_element == pytest.approx(expected, abs=0.011)
    assert to_reference == pytest.approx(
        per_element / median["reference: one sd, one SNR, one bincount"], rel=0.01, abs=0.006)
    assert plain == median[benchmark_per_element.PLAIN]
    assert step == pytest.approx(
        plain + median[benchmark_per_element.PRODUCTS.strip()] + per_element, abs=0.016)
    assert to_plain == pytest.approx(step / plain, rel=0.01, abs=0.006)
