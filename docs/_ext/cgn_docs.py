"""Directives that read the project's own sources, so that the pages cannot drift.

- ``cli-help`` (optional argument: a command): the ``--help`` text of
  ``cockpit-gradnoise`` or of one of its commands, as argparse prints it in a
  terminal 80 columns wide.
- ``benchmark-rows`` (argument: a method of the benchmark, e.g.
  ``GradientNoiseScale``): a table of that method's rows and the plain step's
  from the results table of ``benchmarks/README.md``, one pair per model. The
  build fails if the table has no row for the method.
"""

import argparse
import os
from pathlib import Path
from unittest import mock

from docutils import nodes
from docutils.parsers.rst import Directive

BENCHMARK_README = Path(__file__).resolve().parents[2] / "benchmarks" / "README.md"
PLAIN = "plain step"
HELP_COLUMNS = "80"


def help_text(command=None) -> str:
    """``cockpit-gradnoise [command] --help``, at 80 columns and without colour."""
    from cockpit_gradnoise import cli

    parser = cli.parser()
    if command:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = commands.choices[command]
    # argparse reads the width from COLUMNS; NO_COLOR keeps Python >= 3.14 plain.
    with mock.patch.dict(os.environ, {"COLUMNS": HELP_COLUMNS, "NO_COLOR": "1"}):
        return parser.format_help()


def benchmark_rows(method, path=BENCHMARK_README):
    """Header and rows of the results table of ``path`` for ``method`` and the plain step."""
    header, rows = None, []
    for line in Path(path).read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[:3] == ["model", "method", "median ms"]:
            header = cells
        elif header and len(cells) == len(header) and cells[1] in (PLAIN, method):
            rows.append(cells)
    if not any(cells[1] == method for cells in rows):
        raise ValueError(f"{path}: the results table has no row for {method!r}")
    return header, rows


class CliHelp(Directive):
    """``.. cli-help:: [command]``: the command line's help text, from its parser."""

    optional_arguments = 1

    def run(self):
        text = help_text(self.arguments[0] if self.arguments else None)
        return [nodes.literal_block(text, text, language="text")]


def _row(cells, cell_type=nodes.entry):
    row = nodes.row()
    for text in cells:
        entry = cell_type()
        entry += nodes.paragraph(text=text)
        row += entry
    return row


class BenchmarkRows(Directive):
    """``.. benchmark-rows:: method``: a method's rows of the benchmark's results table."""

    required_arguments = 1

    def run(self):
        try:
            header, rows = benchmark_rows(self.arguments[0])
        except ValueError as error:
            raise self.error(str(error)) from None
        group = nodes.tgroup(cols=len(header))
        group.extend(nodes.colspec(colwidth=1) for _ in header)
        group += nodes.thead("", _row(header))
        group += nodes.tbody("", *(_row(cells) for cells in rows))
        return [nodes.table("", group)]


def setup(app):
    app.add_directive("cli-help", CliHelp)
    app.add_directive("benchmark-rows", BenchmarkRows)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
