"""Smoke test of benchmarks/benchmark.py: it runs and prints the expected table.

Never a timed assertion: timings depend on the machine. This only checks that
every method runs (or says why not) and that the table and JSON are complete.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from cockpit_gradnoise.extensions import PerExampleSquaredNorms

import pytest
import torch
from backpack.extensions.firstorder.batch_l2_grad.convnd import BatchL2Conv2d
from cockpit.utils.schedules import linear

from benchmarks import (
    benchmark,
    harness,
    methods,
    models,
    preconditioned_cost,
    readme_tables,
    scaling,
    support_cost,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_runs_as_documented_a_script_from_anywhere(tmp_path):
    """``python benchmarks/benchmark.py`` from another directory finds its ``benchmarks`` and the GPT."""
    # On the path: this checkout's package alone, as an install gives it (not the repository).
    (tmp_path / "installed").mkdir()
    (tmp_path / "installed" / "cockpit_gradnoise").symlink_to(ROOT / "cockpit_gradnoise")
    # Beside it a top-level `benchmarks`, as Opacus' wheel installs one: it must not shadow ours.
    (tmp_path / "installed" / "benchmarks").mkdir()
    (tmp_path / "installed" / "benchmarks" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "installed")}
    command = [sys.executable, str(ROOT / "benchmarks" / "benchmark.py"), "--quick", "--no-memory",
               "--models", "gpt", "--methods", "", "--threads", "1"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert list(table_rows(result.stdout)) == [("gpt", "plain step")]


def table_rows(stdout):
    """``{(model, method): cells}`` from the markdown table printed to stdout."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] != "model":
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_quick_run_prints_every_method_for_the_mlp(keep_threads, tmp_path, capsys):
    path = tmp_path / "result.json"
    benchmark.main(["--quick", "--models", "mlp", "--json", str(path)])
    out = capsys.readouterr().out
    assert "default glibc malloc" in out or "NOT the default allocator" in out
    assert "threads: 2" in out and "device: cpu" in out and "QUICK MODE" in out

    rows = table_rows(out)
    assert list(rows) == [("mlp", "plain step")] + [("mlp", m) for m in methods.METHODS]
    assert rows.pop(("mlp", "plain step"))[1::2] == ["1.00", "1.00"]
    # The MLP has no LayerNorm, embedding, attention or convolution.
    not_applicable = [*[f"package: all together {label}" for label in methods.FROZEN_LABELS],
                      *[m for m in methods.METHODS if m.endswith("(BackPACK's conv rows)")]]
    assert len(not_applicable) == 6
    assert all(rows[("mlp", method)][0].startswith("not applicable") for method in not_applicable)
    for (_, method), (median_ms, ratio, memory, memory_ratio) in rows.items():
        reason = methods.unavailable(method) or (median_ms if method in not_applicable else None)
        if reason is not None:  # e.g. Opacus not installed: said, not measured
            assert median_ms == reason and ratio == memory_ratio == "-"
            continue
        assert not median_ms.startswith("error"), (method, median_ms)
        assert float(median_ms) > 0 and float(ratio) > 0 and float(memory_ratio) > 0
        assert memory.endswith(" MiB") and float(memory[:-4]) > 0

    saved = json.loads(path.read_text())
    assert saved["environment"]["batch_size"] == 8
    assert [(r["model"], r["method"]) for r in saved["rows"]][1:] == list(rows)
    measured = [r for r in saved["rows"] if r["note"] is None]
    assert all(math.isfinite(r["ratio"]) and r["peak_extra_mib"] > 0 for r in measured)
    # A plain step's extra memory is its gradient plus a little (activations of 8 examples).
    gradient_mib = sum(p.numel() for p in models.make_mlp().parameters()) * 4 / 2**20
    assert gradient_mib <= saved["rows"][0]["peak_extra_mib"] < gradient_mib + 0.5


def test_quick_run_on_the_cnn_with_a_method_filter(keep_threads, capsys):
    benchmark.main(["--quick", "--models", "cnn", "--methods", "PerExampleGradNorm"])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == [("cnn", "plain step"), ("cnn", "PerExampleGradNorm")]
    assert float(rows[("cnn", "PerExampleGradNorm")][1]) > 0


def test_peak_memory_counts_a_large_temporary():
    """The CPU measurement sees an allocation that lives only inside the step."""
    megabytes = 64

    def step(x, y):
        torch.empty(megabytes * 2**20, dtype=torch.uint8).fill_(1)

    step.model = torch.nn.Linear(1, 1)
    measured = harness.peak_extra_bytes(step, None, None, torch.device("cpu"))
    assert megabytes * 2**20 <= measured < (megabytes + 1) * 2**20


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "resnet"], "unknown models"),
        (["--methods", "Magic"], "unknown methods"),
        (["--rounds", "5"], "at least 15"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_run_on_the_gpt(keep_threads, capsys):
    """Token loss, the frozen comparison with its own plain step, BackPACK's missing rows."""
    frozen = f"package: all together {methods.FROZEN}"
    chosen = [frozen, "BackPACK BatchL2Grad", "torch.func vmap norms"]
    benchmark.main(["--quick", "--no-memory", "--models", "gpt", "--methods", ",".join(chosen)])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == [
        ("gpt", "plain step"),
        ("gpt", f"plain step {methods.FROZEN}"),
        ("gpt", frozen),
        ("gpt", "BackPACK BatchL2Grad"),
        ("gpt", "torch.func vmap norms"),
    ]
    for method in [f"plain step {methods.FROZEN}", frozen, "torch.func vmap norms"]:
        assert float(rows[("gpt", method)][1]) > 0, rows[("gpt", method)]
        assert rows[("gpt", method)][2:] == ["not measured", "-"]
    assert rows[("gpt", "BackPACK BatchL2Grad")][0] == (
        "not supported: BackPACK's BatchL2Grad has no rows for LayerNorm"
    )


def test_quick_run_on_resnet18(keep_threads, capsys):
    benchmark.main(["--quick", "--no-memory", "--models", "resnet18", "--methods", "GradientVarianceQuantiles"])
    rows = table_rows(capsys.readouterr().out)
    assert list(rows) == [("resnet18", "plain step"), ("resnet18", "GradientVarianceQuantiles")]
    assert all(float(cells[1]) > 0 for cells in rows.values())


def test_quick_scaling_page(keep_threads, tmp_path):
    path = tmp_path / "scaling.md"
    benchmark.main(["--quick", "--scaling", str(path), "--scaling-batch-sizes", "4,8",
                    "--scaling-widths", "16,32", "--every", "2"])
    page = path.read_text()
    assert "| | batch 4 | batch 8 | width 16 | width 32 |" in page
    assert "(MLP, width 512, batch 8)" in page  # --quick's batch size, for the schedule too
    for method in [*scaling.SCALING_METHODS, "empty Cockpit"]:
        assert f"| {method} | " in page
    assert "From batch 4 to batch 8" in page and "From width 16 to width 32" in page
    assert "linear(2)" in page and "1 + (r - 1) / 2" in page and "`f + (r - f) / 2`" in page


def test_targets_table_says_met_and_missed():
    table = [
        {"model": "mlp", "method": "GradientVarianceQuantiles", "ratio": 2.4},
        {"model": "mlp", "method": "PerExampleGradNorm", "ratio": 1.7},
        {"model": "mlp", "method": "PerExampleGradNorm (BackPACK's conv rows)", "ratio": 2.2},
        {"model": "mlp", "method": "empty Cockpit", "ratio": 1.4},
        {"model": "gpt", "method": "package: all together", "ratio": 3.3},
        {"model": "gpt", "method": f"package: all together {methods.FROZEN}", "ratio": 3.0},
    ]
    lines = readme_tables.targets_markdown(table).splitlines()
    mlp = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert mlp[:3] == ["mlp", "**2.40** (<= 2.5: met)", "2.20 before, **1.70** (<= 1.6: missed by 0.10)"]
    assert mlp[-1] == "- / 1.40"
    assert "+10% (target <= +10%: met)" in readme_tables.support_cost_markdown(table)
    table[-1]["ratio"] = 2.9
    assert "+14% (target <= +10%: missed)" in readme_tables.support_cost_markdown(table)
    table.append({"model": "gpt", "method": "package: all together (LayerNorm frozen)", "ratio": 3.2})
    lines = readme_tables.support_cost_markdown(table).splitlines()
    assert len(lines) == 2 and "LayerNorm frozen (in the plain step too) 3.20x" in lines[1]
    assert "+3% (target <= +10%: met)" in lines[1]


def test_tables_from_a_saved_run(tmp_path, capsys):
    rows = [{"model": "mlp", "method": "plain step", "median_ms": 2.0, "ratio": 1.0,
             "peak_extra_mib": 1.0, "memory_ratio": 1.0, "note": None},
            {"model": "mlp", "method": "UpdateSize", "median_ms": 2.5, "ratio": 1.25,
             "peak_extra_mib": 1.0, "memory_ratio": 1.0, "note": None}]
    saved, written = tmp_path / "run.json", tmp_path / "tables.md"
    saved.write_text(json.dumps({"environment": {}, "rows": rows}))
    benchmark.main(["--from-json", str(saved), "--markdown", str(written)])
    assert "| mlp | UpdateSize | 2.50 | 1.25 | 1.0 MiB | 1.00 |" in written.read_text()
    assert "**1.25** (<= 1.3: met)" in capsys.readouterr().out


def test_support_cost_quick_run_measures_every_family_and_the_control(
    keep_threads, tmp_path, capsys
):
    path = tmp_path / "support.md"
    rows = benchmark.main(["--quick", "--support-cost", str(path)])
    out = capsys.readouterr().out
    assert "threads: 1" in out and "QUICK MODE" in out
    assert [row["family"] for row in rows] == support_cost.SUPPORT_LABELS
    page = path.read_text()
    lines = [line for line in page.splitlines() if line.startswith("| ") and "family" not in line]
    assert len(lines) == len(support_cost.SUPPORT_LABELS)
    assert lines[-1].startswith("| MLP frozen |") and "| control |" in lines[-1]
    for row in rows:
        assert math.isfinite(row["cost"]) and row["cost_quartiles"][0] <= row["cost_quartiles"][1]
    mlp = methods.family_members(models.make_gpt(), methods._frozen_families()[methods.MLP_FROZEN])
    assert len(mlp) == 8 and all(isinstance(m, torch.nn.Linear) for m in mlp)  # 4 blocks x 2


def test_preconditioned_cost_quick_run_times_both_pairs_and_says_met_or_missed(
    keep_threads, tmp_path, capsys
):
    path = tmp_path / "preconditioned.md"
    rows = benchmark.main(["--quick", "--models", "mlp", "--preconditioned-cost", str(path)])
    assert "threads: 1" in capsys.readouterr().out
    assert [row["beside"] for row in rows] == [label for label, _, _ in preconditioned_cost.PAIRS]
    for row in rows:
        assert row["cost"] == pytest.approx(row["with_ratio"] / row["without_ratio"] - 1)
        assert row["cost_quartiles"][0] <= row["cost_median"] <= row["cost_quartiles"][1]
    assert path.read_text().count("| mlp (") == 2
    made_up = [dict(rows[0], cost=cost) for cost in (0.049, 0.051)]
    verdicts = [line.rsplit("|", 2)[1].strip()
                for line in preconditioned_cost.preconditioned_cost_markdown(made_up).splitlines()[2:]]
    assert verdicts == ["met", "missed"]  # the target: at most +5%


def test_backpack_conv_rows_replace_rows_of_the_quantitys_own_extensions_only():
    """The "(BackPACK's conv rows)" methods: BackPACK's rows for that quantity, the package's elsewhere."""
    def rows(extension):  # BackPACK's table of module class -> module extension (no public getter)
        return vars(extension)["_BackpropExtension__module_extensions"]

    before = rows(PerExampleSquaredNorms())
    make_quantities = methods.with_backpack_convolution_rows("PerExampleGradNorm").make_quantities
    (quantity,) = make_quantities(["w"], linear(1))
    (inside,) = [rows(extension) for extension in quantity.extensions(0)]
    other = rows(PerExampleSquaredNorms())
    assert type(before[torch.nn.Conv2d]) is not BatchL2Conv2d
    assert type(inside[torch.nn.Conv2d]) is BatchL2Conv2d
    assert set(inside) == set(before) and type(other[torch.nn.Conv2d]) is not BatchL2Conv2d
