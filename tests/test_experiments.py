"""The experiments of docs/experiments/ run in their quick mode and write their pages.

Each script's ``--quick`` run trains for a few steps and writes the same
outputs as the full run (a page and a figure) into a temporary folder. No
timing is asserted: timings depend on the machine.
"""

import contextlib
import io
import re
from pathlib import Path

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from experiments import (  # noqa: E402
    bad_runs,
    one_backward_vs_minibatches,
    pages,
    trust_ratios,
    two_batch_noise_scale,
)

SCRIPTS = {
    "one-backward-vs-minibatches": one_backward_vs_minibatches,
    "bad-runs": bad_runs,
    "trust-ratios": trust_ratios,
    "two-batch-noise-scale": two_batch_noise_scale,
}


@pytest.fixture(scope="module", params=list(SCRIPTS), ids=list(SCRIPTS))
def written(request, tmp_path_factory):
    """Run one script quickly (once per module); return its slug, page text and folder."""
    slug, out = request.param, tmp_path_factory.mktemp(request.param)
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            SCRIPTS[slug].main(["--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the scripts run on one thread
    return slug, (out / f"{slug}.md").read_text(), out


def test_each_writes_a_page_with_its_figure_command_and_versions(written):
    slug, text, out = written
    figure = out / f"{slug}.png"
    assert figure.read_bytes().startswith(b"\x89PNG")
    assert figure.stat().st_size < pages.MAX_FIGURE_BYTES
    assert f"]({slug}.png)" in text
    module = SCRIPTS[slug].__name__
    assert f"PYTHONPATH=. python -m {module} --quick --out {out}" in text
    assert "QUICK MODE" in text
    for name in ("python", "torch", "backpack", "cockpit", "cockpit-gradnoise"):
        row = re.search(rf"^\| {re.escape(name)} \| (\S+) \|$", text, re.MULTILINE)
        assert row and row.group(1) != "not installed", name


def test_each_page_holds_its_own_numbers(written):
    slug, text, _ = written
    if slug == "bad-runs":
        for name, batch_size, lr in bad_runs.RUNS:
            assert f"| {name} | {batch_size} | {lr} |" in text
            assert f"### {name}\n\n```text\ncockpit-gradnoise report: {name}/" in text
    elif slug == "one-backward-vs-minibatches":
        _, checkpoints, m, _, _ = one_backward_vs_minibatches.QUICK
        for step in checkpoints:
            assert re.search(rf"^\| {step} \| all \| [0-9.e+-]+ ± ", text, re.MULTILINE)
            assert re.search(rf"^\| {step} \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \| [0-9]+x \|$",
                             text, re.MULTILINE)  # the timing row
        assert f"M={m} batches" in text
    elif slug == "two-batch-noise-scale":
        assert re.search(r"differ by [+-][0-9.]+ standard errors for `trace_cov`", text)
        for statistic in ("grad_sq", "trace_cov"):
            assert re.search(rf"^\| {statistic} \| [0-9.e+-]+ ± [0-9.e+-]+ \| ", text, re.MULTILINE)
        assert f"{two_batch_noise_scale.QUICK} optimizer steps" in text
    else:
        assert re.search(r"spans \d+x in the GPT at its last tracked step", text)
        assert re.search(r"and \d+x in resnet18 \(", text)
        for model in ("GPT", "resnet18"):
            assert re.search(rf"^\| {model} \| 0 \| weights \| ", text, re.MULTILINE)


def test_every_experiment_page_in_the_docs_is_in_the_table_of_contents():
    root = Path(__file__).resolve().parent.parent
    index = (root / pages.PAGES.parent / "index.md").read_text()
    docs = root / pages.PAGES
    found = sorted(path.stem for path in docs.glob("*.md"))
    assert set(SCRIPTS) <= set(found)  # this file's experiments; the others have their own tests
    for slug in found:
        assert f"\nexperiments/{slug}\n" in index
