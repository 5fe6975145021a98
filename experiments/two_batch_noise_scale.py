"""The noise scale from micro-batch norms against the one from per-example gradients.

A small CNN trains on scikit-learn's digits with SGD, each optimizer step
accumulating 4 micro-batches of 16. At every step both estimates of
``|G|^2`` and ``tr(Sigma)`` are computed for the same 64 examples:
``TwoBatchNoiseScale`` from the 4 micro-batch gradients' norms and the
accumulated gradient's (no BackPACK), and ``GradientNoiseScale`` from the 64
per-example gradients (a prepared twin of the model with the same weights, one
backward pass of the whole batch). Both are unbiased; the page says how far
their means over the run are apart, in standard errors, and how much noisier
the cheap one is. Writes ``two-batch-noise-scale.png`` and ``.md``.

    PYTHONPATH=. python -m experiments.two_batch_noise_scale
    PYTHONPATH=. python -m experiments.two_batch_noise_scale --quick --out /tmp/tb
"""

import copy
import math
import time

import cockpit_gradnoise as cgn

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments import pages, train_digits  # noqa: E402

SLUG = "two-batch-noise-scale"
SEED = 0
MICRO_BATCHES, MICRO_BATCH = 4, 16
LR = 0.05
FULL, QUICK = 300, 8  # optimizer steps
STATISTICS = ("grad_sq", "trace_cov", "b_simple_smoothed")


def network_rows(frame, statistic):
    rows = frame[(frame.param == cgn.NETWORK) & (frame.statistic == statistic)]
    return rows.set_index("step").value.sort_index()


def train(steps):
    """Both estimators' frames over ``steps`` accumulated steps, and the last loss."""
    torch.manual_seed(SEED)
    model = train_digits.digits_cnn()
    twin, tracker = cgn.track(copy.deepcopy(model), every=1, quantities=["GradientNoiseScale"])
    noise = cgn.TwoBatchNoiseScale(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader, _ = train_digits.digits_loaders(MICRO_BATCHES * MICRO_BATCH, SEED)
    step, loss = 0, math.nan
    while step < steps:
        for x, y in loader:
            if step == steps:
                break
            for part_x, part_y in zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)):
                loss = F.cross_entropy(model(part_x), part_y) / MICRO_BATCHES
                loss.backward()
                noise.micro_batch(len(part_y))
            noise.step(step)
            twin.load_state_dict(model.state_dict())
            twin.zero_grad()
            with tracker(step, F.cross_entropy(twin(x), y, reduction="none")) as whole:
                whole.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
    return {"two-batch": noise.frame(), "per-example": tracker.frame()}, float(loss) * MICRO_BATCHES


def comparison(frames):
    """Per statistic: each estimator's mean and standard error over steps, and the paired test."""
    found = {}
    for statistic in ("grad_sq", "trace_cov"):
        cheap, full = (network_rows(frames[k], statistic).to_numpy() for k in ("two-batch", "per-example"))
        difference = cheap - full
        n = len(difference)
        found[statistic] = {
            "two-batch": (cheap.mean(), cheap.std(ddof=1) / math.sqrt(n)),
            "per-example": (full.mean(), full.std(ddof=1) / math.sqrt(n)),
            "z": difference.mean() / (difference.std(ddof=1) / math.sqrt(n)),
            # One step's disagreement, relative to the quantity's size.
            "noise": difference.std(ddof=1) / abs(full.mean()),
        }
    return found


def figure(frames, path):
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), layout="constrained")
    for ax, statistic in zip(axes, STATISTICS):
        for label, color in (("two-batch", "C1"), ("per-example", "C0")):
            series = network_rows(frames[label], statistic)
            ax.plot(series.index, series.to_numpy(), color=color, lw=0.8, label=label)
        ax.set_title(f"network {statistic}", fontsize="medium")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if statistic != "grad_sq":
            ax.set_yscale("log")
    axes[0].legend(fontsize="small")
    pages.save_figure(fig, path, dpi=80)
    plt.close(fig)


def sentences(found) -> str:
    grad, trace = found["grad_sq"], found["trace_cov"]
    return (
        f"Over the run the two estimators' means differ by {trace['z']:+.1f} standard errors "
        f"for `trace_cov` (paired over steps), as two unbiased estimates of the same quantity "
        f"should; at one step, from {MICRO_BATCHES} micro-batches instead of "
        f"{MICRO_BATCHES * MICRO_BATCH} examples, the cheap estimate is off the per-example one "
        f"by {100 * trace['noise']:.0f}% of `trace_cov`'s mean and {100 * grad['noise']:.0f}% of "
        f"`grad_sq`'s (standard deviation over steps)."
    )


def page(frames, found, seconds, loss, steps, argv, quick) -> str:
    rows = [[statistic, f"{v['two-batch'][0]:.4g} ± {v['two-batch'][1]:.2g}",
             f"{v['per-example'][0]:.4g} ± {v['per-example'][1]:.2g}", f"{v['z']:+.2f}",
             f"{v['noise']:.2f}"] for statistic, v in found.items()]
    table = pages.markdown_table(
        ["network statistic", "two-batch: mean ± s.e.", "per-example: mean ± s.e.",
         "paired difference / s.e.", "one step's difference / mean"], rows)
    last = {label: network_rows(frames[label], "b_simple_smoothed").iloc[-1] for label in frames}
    return f"""# Two-batch against per-example noise scale

{sentences(found)}

![network grad_sq, trace_cov and b_simple_smoothed from both estimators]({SLUG}.png)

`TwoBatchNoiseScale` (McCandlish et al. 2018, appendix A.1; what nanoGNS and
k-diffusion compute) needs only the squared norm of each micro-batch's
gradient and of the accumulated one; `GradientNoiseScale` needs every
example's gradient norm (BackPACK, one backward pass). The model is
`experiments.train_digits.digits_cnn`, trained with SGD (learning rate {LR}) on
scikit-learn's digits, {steps} optimizer steps of {MICRO_BATCHES} micro-batches
of {MICRO_BATCH} (last loss {loss:.3f}, {seconds:.0f} s for both estimators
and the twin's backward passes). Both estimate `|G|^2` and `tr(Sigma)` for
the same {MICRO_BATCHES * MICRO_BATCH} examples at every step, so their
difference is paired. `b_simple_smoothed` at the last step: {last['two-batch']:.3g}
(two-batch), {last['per-example']:.3g} (per-example).

{table}
The last column is the standard deviation over steps of the two estimates'
difference, divided by the per-example estimate's mean: the price of costing
nothing. Both estimators satisfy `grad_sq + trace_cov / B = |G_B|^2` exactly
(`B` the batch, `G_B` its mean gradient, which both see), so they differ only
in how they split the batch gradient's norm, and the `grad_sq` difference is
the `trace_cov` one divided by `-B`: one comparison, shown twice.

{pages.provenance("experiments.two_batch_noise_scale", argv, SEED, quick)}"""


def main(argv=None):
    argv = pages.argv_of(argv)
    args = pages.setup(pages.argument_parser(__doc__.splitlines()[0]), argv)
    steps = QUICK if args.quick else FULL
    start = time.perf_counter()
    frames, loss = train(steps)
    seconds = time.perf_counter() - start
    found = comparison(frames)
    figure(frames, args.out / f"{SLUG}.png")
    text = page(frames, found, seconds, loss, steps, argv, args.quick)
    (args.out / f"{SLUG}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
