"""What a bad run looks like: a healthy run, a learning rate 10x too large, a batch of 4.

The digits CNN of ``experiments/train_digits.py``, trained three times with
SGD (momentum 0.9) from the same seed: the healthy settings (batch 32,
learning rate 0.05), the learning rate ten times larger, and a batch of 4 at
the healthy learning rate. Writes the three dashboards side by side
(``bad-runs.png``) and a page with what ``cockpit-gradnoise report`` says about
each (``bad-runs.md``).

    PYTHONPATH=. python -m experiments.bad_runs                # docs/experiments/
    PYTHONPATH=. python -m experiments.bad_runs --quick --out /tmp/bad
"""

import contextlib
import io
import re
import tempfile
import time
from pathlib import Path

import cockpit_gradnoise as cgn
from cockpit_gradnoise.views.findings import run_findings, run_history
from cockpit_gradnoise.views.report import build_report, format_report

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from experiments import pages, train_digits  # noqa: E402

#: name, batch size, learning rate.
RUNS = (("healthy", 32, 0.05), ("lr-10x", 32, 0.5), ("batch-4", 4, 0.05))
SEED = 0
#: Seeds of the robustness table (the full run); the dashboards and reports are seed 0's.
SEEDS = (0, 1, 2)
#: The statistics the report reads (its table, ranking and run findings), kept in tests/data.
REPORT_STATISTICS = ("q0.5", "snr_q0.5", "max", "norm_ratio", "zero_grad_fraction",
                     "relative", "b_simple", "b_simple_smoothed", "batch_size")
SLUG = "bad-runs"


def run(name, batch_size, lr, logs, epochs, track_every, seed=SEED):
    """Train one run; return its tidy frame, its report's text and the last epoch's line."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        _, log = train_digits.train(logs / f"{name}-{seed}", epochs, batch_size, lr,
                                    track_every, seed)
    frame = cgn.to_frame(log)
    text = format_report(build_report(frame, source=f"{name}/digits.json"))
    return frame, text, printed.getvalue().strip().splitlines()[-1]


def dashboards(frames, path):
    """The three dashboards side by side, each titled with its run."""
    figure = plt.figure(figsize=(39, 9), layout="constrained")
    for subfigure, (name, batch_size, lr), frame in zip(figure.subfigures(1, 3), RUNS, frames):
        cgn.plot(frame, fig=subfigure, batch_size=batch_size, top_k=4, heatmap="off")
        title = subfigure._suptitle.get_text()
        subfigure.suptitle(f"{name} (batch {batch_size}, lr {lr}): {title}",
                           fontsize="x-large", fontweight="bold")
    pages.save_figure(figure, path, dpi=36)
    plt.close(figure)


def write_test_data(frames, folder):
    """The report's statistics of each run, as gzipped CSV (tests/test_bad_runs.py reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for (name, _, _), frame in zip(RUNS, frames):
        kept = frame[frame.statistic.isin(REPORT_STATISTICS)]
        # mtime 0: the same numbers give the same file, so a rerun changes nothing in git.
        kept.to_csv(folder / f"{name}.csv.gz", index=False, float_format="%.9g",
                    compression={"method": "gzip", "mtime": 0})


def history_row(seed, name, batch_size, frame):
    """Seed, run, and what :func:`cockpit_gradnoise.views.findings.run_history` reads from it."""
    history = run_history(frame)
    stopped = "-" if history.stopped_at is None else history.stopped_at
    step, largest = history.largest_update or (None, float("nan"))
    noise = history.noise_scale[0] / batch_size if history.noise_scale else float("nan")
    said = [key for key, phrase in FINDING_PHRASES.items()
            if any(phrase in line for line in run_findings(history, batch_size))]
    return [seed, name, stopped, f"{100 * largest:.1f}% (step {step})", f"{noise:.3g}",
            ", ".join(said) or "none"]


#: Short name of each run finding: a phrase of its line.
FINDING_PHRASES = {"stopped": "training has stopped", "lr too large": "learning rate is too large",
                   "batch too small": "is too small for the learning rate"}


def page(results, seconds, histories, argv, quick) -> str:
    seeds = ", ".join(str(seed) for seed in sorted({row[0] for row in histories}))
    rows = []
    for (name, batch_size, lr), (frame, text, last_epoch) in zip(RUNS, results):
        history = run_history(frame)
        loss, accuracy = re.search(r"loss ([\d.]+), test accuracy ([\d.]+)", last_epoch).groups()
        stopped = "-" if history.stopped_at is None else str(history.stopped_at)
        rows.append([name, batch_size, lr, int(frame.step.max()), loss, accuracy, stopped,
                     f"{seconds[name]:.1f}"])
    table = pages.markdown_table(
        ["run", "batch", "lr", "last tracked step", "last loss", "test accuracy", "stopped at step",
         "time (s)"], rows)
    robustness = pages.markdown_table(
        ["seed", "run", "stopped at step", "largest network update before the stop",
         "median B_simple / B before the stop", "run findings"], histories)
    reports = "\n".join(
        f"### {name}\n\n```text\n{text}```\n" for (name, _, _), (_, text, _) in zip(RUNS, results)
    )
    return f"""# What a bad run looks like

The digits CNN (`experiments/train_digits.py`: two 3x3 convolutions, max
pooling, two linear layers; 1,500 training and 297 test images of
scikit-learn's digits), SGD with momentum 0.9, every quantity of the package
tracked every few steps, the same seed for all three runs:

- **healthy**: batch 32, learning rate 0.05;
- **lr-10x**: the learning rate ten times too large (0.5);
- **batch-4**: a batch of 4 at the healthy learning rate.

{table}
Both bad runs end the same way: every ReLU is dead, 99.9% of the gradient
elements are exactly zero, the network outputs the same class for every
image (test accuracy near chance, 0.1). Their last steps look alike; what
tells them apart is what came before the stop, which the report now reads.

![the three dashboards side by side](bad-runs.png)

Left to right: healthy, lr-10x, batch-4 (the lines are the four noisiest
layers and the network). In the lr-10x run the relative update of the
network jumps to tens of percent of its norm per step within the first 30
steps, then the gradients vanish (the ratio `||theta||/||grad||` shoots up,
the per-example norms collapse). In the batch-4 run the updates stay at a few
percent, as in the healthy run, but the noise scale `B_simple` sits above
the batch of 4 through the whole run until the network dies.

## What `cockpit-gradnoise report` says

Each report is `cockpit-gradnoise report <log>` at the run's last step. The
first lines (when present) are the findings about the whole run:

- *training has stopped* when, at the report's step, at least 95% of the
  network's gradient elements are exactly zero;
- *the learning rate is too large* when some tracked step before the stop
  moved the network by at least 20% of its norm (200 times the usual
  `1e-3`);
- *the batch is too small for the learning rate* when the run stopped with
  no such step but the median `B_simple` before the stop is at least the
  batch size: the expected squared norm of a step's noise, `B_noise / B`
  times its signal's (McCandlish et al. 2018), outweighed the signal.

Before these were added the report read only the last step, and for both
bad runs it described the corpse: seven layers with 100% zero gradients,
layers that "barely move", and for lr-10x "batch 32 is above the noise scale
1.4: smaller batches save compute", measured on the one bias that still gets
a gradient. That line is now left out when training has stopped. The
thresholds are `stopped_zero_grad_fraction`, `large_relative_update` and
`stopped_noise_factor` in [the report's thresholds](../dashboard.md#thresholds).
The same three runs from other seeds, and what the findings read from them
(`tests/test_bad_runs.py` checks the three logs of seed 0, kept in
`tests/data/bad_runs/`):

{robustness}
The noise ratio alone separates the runs less than one might hope: the
healthy run's batch of 32 also sits below its noise scale (median
`B_simple / B` above 1 in the table), and the report's ordinary noise-scale
line says so for it ("below" or "close to"). The batch-too-small finding is a
diagnosis of a run that *stopped* with no large step, not an alarm raised
on a healthy run whose batch could be larger.

What the healthy report still says, and why it is left alone: its biases
update 2-4% of their norm per step, above the report's usual band
(`1e-4` to `1e-2`): a rule of thumb for weights, which small biases exceed
at this healthy learning rate; and the largest per-example gradient norm is
about 100 times the median, which is what a classifier that fits most
examples looks like late in training.

{reports}
{pages.provenance("experiments.bad_runs", argv, seeds, quick)}"""


def main(argv=None):
    argv = pages.argv_of(argv)
    parser = pages.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, help="keep the Cockpit logs here (default: dropped)")
    parser.add_argument("--test-data", type=Path,
                        help="write the report's statistics of each run here (tests/data/bad_runs)")
    args = pages.setup(parser, argv)
    epochs, track_every = (1, 10) if args.quick else (3, 5)
    seeds = (SEED,) if args.quick else SEEDS
    results, seconds, histories = [], {}, []
    with tempfile.TemporaryDirectory() as scratch:
        logs = args.logs or Path(scratch)
        for seed in seeds:
            for name, batch_size, lr in RUNS:
                start = time.perf_counter()
                result = run(name, batch_size, lr, logs, epochs, track_every, seed)
                histories.append(history_row(seed, name, batch_size, result[0]))
                if seed == SEED:
                    results.append(result)
                    seconds[name] = time.perf_counter() - start
                    print(result[1])
    frames = [frame for frame, _, _ in results]
    dashboards(frames, args.out / f"{SLUG}.png")
    if args.test_data:
        write_test_data(frames, args.test_data)
    (args.out / f"{SLUG}.md").write_text(page(results, seconds, histories, argv, args.quick))
    print(f"wrote {args.out / SLUG}.md and .png")


if __name__ == "__main__":
    main()
