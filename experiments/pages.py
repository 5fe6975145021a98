"""What every experiment writes beside its numbers: versions, seeds, command, figures.

Each experiment writes a markdown page and its figures to ``docs/experiments/``
(or ``--out``); the page records how to reproduce it.
"""

import argparse
import os
import platform
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: Where the pages go by default, from the repository root.
PAGES = Path("docs") / "experiments"

#: Figures in the docs stay small: the repository keeps every version of them.
MAX_FIGURE_BYTES = 200_000

_DISTRIBUTIONS = {
    "torch": "torch",
    "backpack": "backpack-for-pytorch",
    "cockpit": "cockpit-for-pytorch",
    "cockpit-gradnoise": "cockpit-gradnoise",
    "numpy": "numpy",
}


def versions() -> dict:
    """``{name: version}`` of Python and the libraries the numbers depend on."""
    found = {"python": platform.python_version()}
    for name, distribution in _DISTRIBUTIONS.items():
        try:
            found[name] = version(distribution)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def command(module: str, argv) -> str:
    """The command that reproduces a run, from the repository root."""
    return " ".join(["PYTHONPATH=. python -m", module, *argv])


def argument_parser(description: str) -> argparse.ArgumentParser:
    """The options every experiment has: ``--quick`` and ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--quick", action="store_true",
        help="a short run with the same outputs (the test suite runs it)",
    )
    parser.add_argument(
        "--out", type=Path, default=PAGES, help=f"output folder (default: {PAGES})"
    )
    return parser


def setup(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse ``argv``; run on one thread; silence BackPACK's expected hook warning.

    The warning (no input gradient at the first layer) fires on every step.
    """
    import torch  # here: the page helpers above need no torch

    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def provenance(module: str, argv, seeds, quick: bool) -> str:
    """The page's closing section: command, seeds, versions, and whether it was quick."""
    lines = ["## How this page was made", "", "```bash", command(module, argv), "```", ""]
    if quick:
        lines += ["**QUICK MODE**: a short smoke run; its numbers mean little.", ""]
    lines.append(f"Seeds: {seeds}. CPU, one thread (`torch.set_num_threads(1)`); load average "
                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores when the page was written "
                 "(timings on a shared machine are noisy).")
    lines.append("")
    lines.append("| | version |")
    lines.append("|---|---|")
    lines += [f"| {name} | {found} |" for name, found in versions().items()]
    lines.append(f"| platform | {platform.platform()}, {platform.machine()} |")
    return "\n".join(lines) + "\n"


def save_figure(fig, path: Path, dpi: int) -> Path:
    """Save ``fig`` as a PNG; warn if it is larger than :data:`MAX_FIGURE_BYTES`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    size = path.stat().st_size
    if size > MAX_FIGURE_BYTES:
        warnings.warn(f"{path} is {size} bytes, more than {MAX_FIGURE_BYTES}: lower the dpi",
                      stacklevel=2)
    return path


def markdown_table(header, rows) -> str:
    """A markdown table from a header and rows of cells (already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def argv_of(argv) -> list:
    """The arguments a script was called with (``sys.argv[1:]`` when ``argv`` is None)."""
    return list(sys.argv[1:] if argv is None else argv)


def seed_ranges(seeds) -> str:
    """Seeds as runs of consecutive numbers: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    seeds = sorted(set(seeds))
    runs = []
    for seed in seeds:
        if runs and seed == runs[-1][1] + 1:
            runs[-1][1] = seed
        else:
            runs.append([seed, seed])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
