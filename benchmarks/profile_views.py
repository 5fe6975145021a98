"""Where ``cockpit-gradnoise report`` and ``plot`` spend their time on a streamed log, by phase.

Each command's phases run in a fresh process (imports count), each phase's
CPU time printed, and the process's peak RSS (``ru_maxrss``) at the end;
``--cprofile N`` adds the N functions of most own time over the whole run.
Make a log with ``benchmarks/benchmark_log.py --target --dir DIR`` (it
keeps ``DIR/synthetic.jsonl``).

    python benchmarks/profile_views.py runs/synthetic.jsonl
    python benchmarks/profile_views.py runs/synthetic.jsonl --only plot --cprofile 25
"""

import argparse
import subprocess
import sys
from pathlib import Path

_PHASES = {
    "report": """
from cockpit_gradnoise.logs import selective
from cockpit_gradnoise.views import reads as view_rows
lap("import (the package; pandas comes with the first frame)")
index = selective.index_log(LOG)
lap(f"index_log: {len(index):,} records")
frame = view_rows.report_frame(LOG)
lap(f"report_frame (its own index too): {len(frame):,} rows")
from cockpit_gradnoise.views.report import build_report, format_report
text = format_report(build_report(frame, source=LOG))
lap("build_report, format_report")
""",
    "plot": """
from cockpit_gradnoise.views import dashboard, reads as view_rows
lap("import (matplotlib without pyplot, the package)")
rows, layers = view_rows.plot_rows(LOG)
lap(f"plot_rows: {len(rows):,} rows")
fig = dashboard.figure(rows, layers=layers, fig=dashboard.OwnFigure())  # as the command line
lap("plot, without saving")
fig.savefig(OUT)
lap("savefig (layout and drawing)")
""",
}

_CHILD = """
import cProfile, pstats, resource, sys, time
LOG, OUT, TOP = sys.argv[1], sys.argv[2], int(sys.argv[3])
last = [time.process_time()]
def lap(name):
    now = time.process_time()
    print(f"  {now - last[0]:6.2f} s CPU  {name}")
    last[0] = now
profile = cProfile.Profile() if TOP else None
if profile:
    profile.enable()
exec(sys.argv[4])
if profile:
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(TOP)
print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a streamed log (.jsonl)")
    parser.add_argument("--only", choices=sorted(_PHASES))
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print the N functions of most own time (cProfile inflates "
                        "the phases' times)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/cgn-profile-dashboard.png"))
    args = parser.parse_args(argv)
    home = str(Path(__file__).resolve().parents[1])
    for name, code in _PHASES.items():
        if args.only in (None, name):
            print(f"cockpit-gradnoise {name} {args.log}")
            subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {home!r})\n"
                            + _CHILD, str(args.log), str(args.out), str(args.cprofile), code],
                           check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
