"""The documentation: its examples run, and it builds without a warning.

Every fenced ```` ```python ```` block of the pages in ``docs/`` runs here. The
blocks of one page run in order in one namespace (as in a notebook: a later
block uses what an earlier one defined), in a temporary working folder. A
block that cannot run here is marked on the last non-blank line before its
fence, with the reason:

    <!-- not run: needs the log of scripts/train_digits.sh -->

Unmarked blocks run; that is the default. A reason that names a test file
(``tests/test_x.py runs it``) is checked: that file must name the page. The README's python blocks are
excerpts of the pages: every line of each appears, in the same order, in the
blocks that run of one page, where it runs. Docstring examples (``>>>``) of
every module of the package run with doctest, and the Sphinx build runs with
warnings as errors, as ``scripts/docs.sh`` and CI run it.
"""

import doctest
import importlib
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import cockpit_gradnoise  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))

FENCE = re.compile(r"^```\s*(\S*)")  # ```python, ```{directive} argument, ```
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")


@dataclass
class Block:
    """One fenced code block of a markdown file."""

    path: Path
    line: int  # 1-based line number of the block's first line of code
    language: str
    code: str
    not_run: str  # the reason it is not run, "" if it runs


def code_blocks(path, text=None):
    """The fenced blocks of the markdown file ``path`` (or of ``text``), in order."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: code fence is never closed")
        before = [line.strip() for line in lines[:i] if line.strip()]
        marker = NOT_RUN.match(before[-1]) if before else None
        blocks.append(Block(path, i + 2, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n",
                            marker.group(1) if marker else ""))
        i = end + 1
    return blocks


def runnable(path):
    return [b for b in code_blocks(path) if b.language == "python" and not b.not_run]


RUNNABLE_PAGES = [page for page in PAGES if runnable(page)]


def test_blocks_run_unless_marked_with_a_reason():
    text = "\n".join([
        "```python", "a = 1", "```",
        "<!-- not run: needs a GPU -->", "", "```python", "b = 2", "```",
        "<!-- not run: -->", "```python", "c = 3", "```",
        "<!-- not run: a marker applies to the next block only -->", "```bash", "ls", "```",
        "```python", "d = 4", "```",
    ])
    blocks = code_blocks(Path("page.md"), text)
    assert [(b.language, b.code, b.not_run) for b in blocks] == [
        ("python", "a = 1\n", ""),
        ("python", "b = 2\n", "needs a GPU"),
        ("python", "c = 3\n", ""),  # a marker without a reason is no marker: the block runs
        ("bash", "ls\n", "a marker applies to the next block only"),
        ("python", "d = 4\n", ""),
    ]
    assert [b.line for b in blocks] == [2, 7, 11, 15, 18]


def test_blocks_said_to_run_elsewhere_do():
    for page in PAGES:
        for block in code_blocks(page):
            for test_file in re.findall(r"tests/test_\w+\.py", block.not_run):
                name = page.relative_to(DOCS).as_posix()
                assert f"docs/{name}" in (ROOT / test_file).read_text(), (
                    f"{name}:{block.line}: {test_file} does not run this block")


def test_the_pages_that_teach_have_examples_that_run():
    expected = {
        "getting-started.md", "custom-quantity.md", "pandas.md",
        "architectures.md", "gradient-variance-quantiles.md", "per-example-grad-norm.md",
        "param-grad-ratio.md", "update-size.md", "gradient-noise-scale.md",
    }
    assert expected <= {page.name for page in RUNNABLE_PAGES}


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda page: page.name)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    try:
        with matplotlib.rc_context():  # Cockpit's plotter changes rcParams
            for block in runnable(page):
                # Leading newlines make tracebacks name the page's own line numbers.
                code = "\n" * (block.line - 1) + block.code
                exec(compile(code, str(page), "exec"), namespace)
    finally:
        plt.close("all")


def test_readme_code_is_run_by_a_page():
    pages = {page: [line.rstrip() for b in runnable(page) for line in b.code.splitlines()]
             for page in RUNNABLE_PAGES}
    readme_blocks = [b for b in code_blocks(README) if b.language == "python"]
    assert readme_blocks  # issue 12: one snippet, the training loop
    for block in readme_blocks:
        wanted = [line.rstrip() for line in block.code.splitlines() if line.strip()]
        assert any(_in_order(wanted, lines) for lines in pages.values()), (
            f"README.md:{block.line}: copy this block into a page of docs/ where it runs"
        )


def _in_order(wanted, lines):
    remaining = iter(lines)
    return all(any(line == have for have in remaining) for line in wanted)


def test_in_order():
    assert _in_order(["a", "c"], ["a", "b", "c"])
    assert not _in_order(["c", "a"], ["a", "b", "c"])
    assert not _in_order(["a", "a"], ["a", "b"])


def _package_modules():
    yield cockpit_gradnoise
    for info in pkgutil.walk_packages(cockpit_gradnoise.__path__, "cockpit_gradnoise."):
        yield importlib.import_module(info.name)


def test_docstring_examples_pass():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    modules = list(_package_modules())
    assert len(modules) > 10
    for module in modules:
        for test in finder.find(module):
            runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


# Sphinx's own deprecations inside Sphinx, napoleon and myst-parser; the build's
# warnings (-W) are what this test is about.
@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning", "ignore::DeprecationWarning")
def test_docs_build_without_warnings(tmp_path):
    from sphinx.cmd.build import build_main

    html = tmp_path / "html"
    args = ["-W", "--keep-going", "-q", "-b", "html", "-d", str(tmp_path / "doctrees")]
    assert build_main([*args, str(DOCS), str(html)]) == 0
    # The API reference holds the docstrings, the command line page the parser's help.
    api = (html / "api.html").read_text()
    assert "Is my batch too small for this learning rate?" in api
    assert "class cockpit_gradnoise.ParameterQuantity" in re.sub(r"<[^>]+>", "", api)
    cli = (html / "cli.html").read_text()
    assert "--batch-size B" in cli and "{text,csv,json}" in cli
