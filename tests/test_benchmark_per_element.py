"""Smoke test of benchmarks/benchmark_per_element.py: every candidate runs, and the floor
line adds up the table's medians. Never a timed assertion."""

import re

import cockpit_gradnoise  # noqa: F401  (first: makes `import cockpit` work)
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions

import pytest
import torch
from backpack import backpack, extend

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


def family_rows(stdout):
    """``[(model, family, layers, elements, candidate, median)]`` of the table per family."""
    rows = []
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[2].isdigit():
            rows.append((cells[0], cells[1], int(cells[2]), int(cells[3].replace(",", "")),
                         cells[4], float(cells[5])))
    return rows


def test_quick_run_prints_each_family_with_every_candidate(one_thread, capsys):
    benchmark_per_element.main(["--quick"])
    rows = family_rows(capsys.readouterr().out)
    # The MLP 784-512-512-10: one family, its three Linear layers' six parameters.
    assert {(model, family, layers) for model, family, layers, *_ in rows} == {("mlp", "Linear", 6)}
    assert [row[4] for row in rows] == list(benchmark_per_element.FAMILY_CANDIDATES)
    assert {row[3] for row in rows} == {784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10}
    assert all(row[5] > 0 for row in rows)


def test_families_partition_the_trainable_parameters_by_the_class_holding_them(one_thread):
    """On the benchmark GPT: its Linear layers, LayerNorms and embeddings, every trainable
    parameter in exactly one family, each candidate timed once per round."""
    measured = benchmark_per_element.measure_families("gpt", 2, batch_size=2)
    by_family, _ = benchmark_per_element.tracked_tensors("gpt", 2, by_family=True)
    assert {"Linear", "LayerNorm", "Embedding"} <= set(measured)
    model_params = [p for params in by_family.values() for p in params]
    assert len({id(p) for p in model_params}) == len(model_params)
    spec = benchmark_per_element.MODELS["gpt"]
    assert sum(p.numel() for p in model_params) == sum(
        p.numel() for p in spec.make().parameters() if p.requires_grad)
    for family, (layers, elements, times) in measured.items():
        assert layers == len(by_family[family])
        assert elements == sum(p.numel() for p in by_family[family])
        assert set(times) == set(benchmark_per_element.FAMILY_CANDIDATES)
        assert all(len(ns) == 2 and min(ns) > 0 for ns in times.values())


def test_the_quantities_candidates_leave_the_sums_for_the_next_round():
    """A family of one layer, whose own sums tile their storage: each round of the
    candidates computes from the same sums (the quantity would form sd over them)."""
    model = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(6, 4)
    with backpack(SumsOfContributions()):
        extend(torch.nn.MSELoss())(extend(model)(x), torch.zeros(6, 3)).backward()
    sums = getattr(model.weight, SUMS_SAVEFIELD).clone()
    candidates = benchmark_per_element.family_candidates([model.weight], 6)
    first = [function() for function in candidates.values()]
    assert torch.equal(getattr(model.weight, SUMS_SAVEFIELD), sums)
    assert [function() for function in candidates.values()][1:] == first[1:]
