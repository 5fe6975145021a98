"""``cockpit-gradnoise``: the dashboard and the report of a saved Cockpit log.

    cockpit-gradnoise plot runs/digits.json -o dashboard.png
    cockpit-gradnoise report runs/digits.json --format text

Bad input (a missing file, a truncated, corrupt or non-UTF-8 file, a log
without this package's quantities, an unknown layer, a step outside the log,
a ``--dpi`` or an image too large to render) ends with a one-line error that
names the file or option and the problem, and exit code 2.

Start-up stays fast: ``--help`` imports neither pandas nor matplotlib,
``report`` no matplotlib, ``plot`` of a streamed log with its summary line
no pandas, and neither imports torch or Cockpit.
"""

import argparse
import contextlib
import gc
import sys
from pathlib import Path

from cockpit_gradnoise.logs.schema import QUANTITIES
from cockpit_gradnoise.views.common import DEFAULT_TOP_K
from cockpit_gradnoise.views.report import FORMATS, build_report, format_report, holdings

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """A problem with the user's input, reported in one line."""


def _one_line(error) -> str:
    return " ".join(str(error).split())


def load_frame(path):
    """The tidy frame of the log at ``path``.

    Raises:
        BadInput: Naming the file, if it is missing, unreadable, not a Cockpit
            log, or holds none of this package's quantities.
    """
    from cockpit_gradnoise.logs.frame import read_log, to_frame  # pandas: not for --help

    try:
        output = read_log(path)
    except UnicodeDecodeError as error:  # a ValueError that does not name the file
        raise BadInput(f"{path}: not a text file ({error.reason} at byte {error.start})") from None
    except (FileNotFoundError, ValueError) as error:
        raise BadInput(_one_line(error)) from None
    except OSError as error:
        raise BadInput(f"{path}: cannot read the file ({error.strerror})") from None
    try:
        frame = to_frame(output)
    except (AttributeError, TypeError, ValueError) as error:
        raise BadInput(f"{path}: not a cockpit-gradnoise log ({_one_line(error)})") from None
    if frame.empty or not frame.quantity.isin(QUANTITIES).any():
        found = holdings(frame) if not frame.empty else ", ".join(
            sorted({name for values in output.values() for name in values}))
        raise BadInput(
            f"{path}: holds none of cockpit-gradnoise's quantities (found: "
            f"{found or 'nothing'}); track e.g. "
            "cockpit_gradnoise.GradientVarianceQuantiles in the Cockpit"
        )
    return frame


@contextlib.contextmanager
def _no_collector():
    """The cyclic garbage collector off meanwhile: a command's garbage is freed by reference
    counting, and each collection walked the objects of pandas and matplotlib (0.2 to 0.3 s
    of a dashboard, finding next to nothing; peak RSS unchanged)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _no_artist_docs():
    """matplotlib's artists without their generated ``set()`` docstrings, if imported meanwhile.

    matplotlib writes each artist class's when it defines it, from the class's
    setters (``matplotlib.artist.kwdoc``): a fifth of the time to import it,
    for help text a command never shows. Outside a command (matplotlib
    already imported) nothing changes.
    """
    if "matplotlib.artist" in sys.modules:
        yield
        return
    import matplotlib.artist

    # Any signature: should a later matplotlib call it otherwise, the import still works.
    kwdoc, matplotlib.artist.kwdoc = matplotlib.artist.kwdoc, lambda *args, **kwargs: ""
    try:
        yield
    finally:
        matplotlib.artist.kwdoc = kwdoc


def _plot(args):
    # matplotlib only here: it takes longer to import than the rest of a report.
    with _no_artist_docs():
        from cockpit_gradnoise.views import dashboard

        from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(args.output).suffix.lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise BadInput(
            f"{args.output}: unknown image format {suffix!r}: use a suffix such as .png, "
            ".pdf or .svg"
        )
    if not 1 <= args.dpi <= dashboard.MAX_DPI:
        raise BadInput(f"--dpi {args.dpi}: use 1 to {dashboard.MAX_DPI} (default: 100)")
    from cockpit_gradnoise.views.sources import rows_to_plot

    # Of a streamed log the rows drawn (no pandas), and the layers they are drawn for.
    frame, layers = rows_to_plot(args.log, layers=args.layers, top_k=args.top_k,
                                 heatmap=args.heatmap, whole=load_frame)
    folder = Path(args.output).parent
    if not folder.exists():
        folder.mkdir(parents=True)
        print(f"cockpit-gradnoise plot: created folder {folder}", file=sys.stderr)
    try:
        dashboard.figure(
            frame,
            savefig=args.output,
            layers=layers,
            top_k=args.top_k,
            batch_size=args.batch_size,
            heatmap=args.heatmap,
            dpi=args.dpi,
            fig=dashboard.OwnFigure(),  # pyplot is not imported
        )
    except dashboard.ImageTooLarge as error:
        raise BadInput(f"--dpi {args.dpi}: {_one_line(error)}") from None
    except ValueError as error:
        raise BadInput(f"{args.log}: {_one_line(error)}") from None
    except OSError as error:
        raise BadInput(f"{args.output}: cannot write the image ({_one_line(error)})") from None
    print(f"dashboard: {args.output}")


def _report(args):
    from cockpit_gradnoise.views.sources import rows_to_report

    frame, ranking = rows_to_report(args.log, args.step, whole=load_frame)
    try:
        built = build_report(
            frame, source=args.log, step=args.step, batch_size=args.batch_size, ranking=ranking
        )
    except ValueError as error:
        raise BadInput(f"{args.log}: {_one_line(error)}") from None
    sys.stdout.write(format_report(built, args.format))


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    main_parser = argparse.ArgumentParser(
        prog="cockpit-gradnoise",
        description="Dashboard and report of the gradient-noise quantities in a log "
        "written by Cockpit.write or cockpit_gradnoise.write_log.",
    )
    commands = main_parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plot_parser = commands.add_parser(
        "plot", help="draw the dashboard to an image file",
        description="Draw the gradient-noise dashboard of a log to an image file.",
    )
    plot_parser.add_argument("log", help="the JSON log (the .json suffix may be left out)")
    plot_parser.add_argument(
        "-o", "--output", required=True,
        help="image file to write; the format follows the suffix (.png, .pdf, .svg); "
        "a missing folder is created, and said so on stderr",
    )
    plot_parser.add_argument(
        "--layers", nargs="+", metavar="NAME",
        help="parameter names to draw as lines (default: the --top-k noisiest)",
    )
    plot_parser.add_argument(
        "--top-k", type=_positive_int, default=DEFAULT_TOP_K, metavar="K",
        help=f"how many of the noisiest layers (lowest mean median SNR over the tracked "
        f"steps, as the report ranks them) to draw by default (default: {DEFAULT_TOP_K})",
    )
    plot_parser.add_argument(
        "--heatmap", choices=["auto", "sd", "snr", "off"], default="auto",
        help="layer-by-step heatmap of the median sd or median SNR; auto: the sd "
        "heatmap when there are more layers than lines (default: auto)",
    )
    plot_parser.add_argument("--dpi", type=_positive_int, default=100,
                             help="image resolution, at most 1200 and 100 megapixels in all "
                             "(default: 100)")

    report_parser = commands.add_parser(
        "report", help="print a per-layer table and findings",
        description="Print a per-layer table at the last (or chosen) step: median sd, "
        "SNR, per-example norms, norm ratio, relative update size, B_simple; the text "
        "format adds one plain-language line per finding (thresholds: "
        "cockpit_gradnoise.views.common.THRESHOLDS).",
    )
    report_parser.add_argument("log", help="the JSON log (the .json suffix may be left out)")
    report_parser.add_argument(
        "--format", choices=FORMATS, default="text",
        help="text: table and findings; csv, json: the table only (default: text)",
    )
    report_parser.add_argument(
        "--step", type=int,
        help="report at this step, between the log's first and last tracked steps; each "
        "quantity is read at its latest tracked step at or before it (default: the last "
        "step)",
    )
    for sub in (plot_parser, report_parser):
        sub.add_argument(
            "--batch-size", type=_positive_int, metavar="B",
            help="batch size used in training, compared with the gradient noise scale "
            "(default: read from the log where it records it)",
        )
    plot_parser.set_defaults(run=_plot)
    report_parser.set_defaults(run=_report)
    return main_parser


def main(argv=None) -> int:
    """Run the command line; return the exit status (2 on bad input)."""
    args = parser().parse_args(argv)
    try:
        with _no_collector():
            args.run(args)
    except BadInput as error:
        print(f"cockpit-gradnoise {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
