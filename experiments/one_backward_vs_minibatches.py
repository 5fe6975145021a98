"""One backward pass against many mini-batches: the gradient's sd per layer, two ways.

At several steps of a training run of the digits CNN, the per-element standard
deviation of the mini-batch gradient (batch size B) is estimated twice:

- ``GradientVarianceQuantiles``: from the B per-example contributions of one
  batch, in one backward pass;
- ``minibatch_gradient_stats``: from M independent mini-batches of size B, at
  the same parameters (the method of the user's ``grad_analysis.py``).

Both estimate ``sd_j`` of the same random variable, the mini-batch gradient
element ``j``. Each layer's quantiles of ``sd_j`` are shown side by side
with their sampling error, a bootstrap over what each method averages: the
B examples of the one batch, the M batch gradients. Writes
``one-backward-vs-minibatches.png`` and ``.md``.

    PYTHONPATH=. python -m experiments.one_backward_vs_minibatches
    PYTHONPATH=. python -m experiments.one_backward_vs_minibatches --quick --out /tmp/ob
"""

import statistics
import time

import cockpit_gradnoise as cgn

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from backpack import extend  # noqa: E402
from cockpit.utils.schedules import linear  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

from experiments import pages, train_digits  # noqa: E402

SLUG = "one-backward-vs-minibatches"
SEED = 0
BATCH = 32
LR = 0.05
QUANTILES = (0.1, 0.5, 0.9)
#: (epochs, checkpoint steps, mini-batches M, bootstrap resamples, timing repeats)
FULL = (3, (0, 15, 45, 135), 200, 300, 7)
QUICK = (1, (0, 30), 6, 20, 2)


def sd_quantiles(samples, scale, levels=QUANTILES) -> np.ndarray:
    """Quantiles over elements of ``sd_j = scale * std_k(samples[k, j])`` (ddof 1).

    For per-example gradients ``g_i`` of one batch, ``scale = 1/sqrt(B)``
    gives the sd of their mean, what ``GradientVarianceQuantiles`` reports
    (``sqrt(B/(B-1) sum_i (x_ij - mean x_j)^2)`` with ``x_i = g_i / B``); for
    batch gradients ``G_k``, ``scale = 1`` gives what
    ``minibatch_gradient_stats`` reports.
    """
    sd = samples.std(axis=0, ddof=1) * scale
    return np.quantile(sd, levels)


def bootstrap_se(samples, scale, resamples, rng) -> np.ndarray:
    """Standard error of :func:`sd_quantiles` by resampling the rows with replacement."""
    n = len(samples)
    draws = [sd_quantiles(samples[rng.integers(0, n, n)], scale) for _ in range(resamples)]
    return np.std(draws, axis=0, ddof=1)


def per_example_gradients(twin, x, y) -> dict:
    """``{name: [B, *shape]}``: each example's own loss gradient, float64, by torch.func."""
    params = {name: p.detach() for name, p in twin.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(twin, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)


def flat_by_layer(grads: dict) -> dict:
    """``{name: [rows, numel]}`` and ``"all"`` (every element), as numpy."""
    layers = {name: g.reshape(len(g), -1).numpy() for name, g in grads.items()}
    layers[cgn.NETWORK] = np.concatenate(list(layers.values()), axis=1)
    return layers


def across_batches(twin, batches):
    """What one backward pass would report on each of ``batches``, and their pooling.

    Returns ``(gradients, quantiles, pooled)`` per layer: the M batch
    gradients ``G_k = mean_i g_i`` (rows), the M one-batch quantile estimates
    (the sampling distribution of ``GradientVarianceQuantiles``), and the
    quantiles of ``sqrt(mean_k sd_kj^2)``: variances averaged over batches,
    each unbiased, so their mean estimates the same ``sd_j^2`` as the
    mini-batch method.
    """
    gradients, quantiles, variances = {}, {}, {}
    for x, y in batches:
        for layer, samples in flat_by_layer(per_example_gradients(twin, x, y)).items():
            gradients.setdefault(layer, []).append(samples.mean(axis=0))
            variance = samples.var(axis=0, ddof=1) / len(samples)
            quantiles.setdefault(layer, []).append(np.quantile(np.sqrt(variance), QUANTILES))
            variances[layer] = variances.get(layer, 0) + variance
    pooled = {layer: np.quantile(np.sqrt(v / len(batches)), QUANTILES)
              for layer, v in variances.items()}
    return ({k: np.stack(v) for k, v in gradients.items()},
            {k: np.stack(v) for k, v in quantiles.items()}, pooled)


def independent_batches(dataset, count, generator):
    """``count`` batches of ``BATCH`` examples drawn uniformly with replacement.

    Independent draws make the batch gradients i.i.d., the assumption of both
    estimators (a shuffled epoch would draw without replacement: a finite
    population correction of ``1 - (B-1)/(1500-1)``, 2% in variance).
    """
    x, y = dataset.tensors
    picks = torch.randint(0, len(y), (count, BATCH), generator=generator)
    return [(x[p], y[p]) for p in picks]


def time_one_backward(model, cockpit, batch, losses, step, repeats):
    """Median seconds of forward + tracked backward; the frame of the last repeat."""
    loss_fn, per_example = losses
    x, y = batch
    times = []
    for repeat in range(repeats):
        start = time.perf_counter()
        model.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        info = {"batch_size": len(x), "individual_losses": per_example(out, y), "loss": loss}
        with cockpit(step * repeats + repeat, info=info):
            loss.backward()
        times.append(time.perf_counter() - start)
    frame = cgn.to_frame(cockpit)
    return statistics.median(times), frame[frame.step == step * repeats + repeats - 1]


def time_plain(model, batch, loss_fn, repeats):
    """Median seconds of a plain forward + backward (no Cockpit) on ``batch``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.zero_grad()
        loss_fn(model(batch[0]), batch[1]).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, twin, cockpit, losses, batches, index, settings, rng):
    """Both methods at the model's current parameters; one dict per layer, plus timings."""
    _, _, m, resamples, repeats = settings
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    one_batch, many = batches[0], batches[1:]
    seconds_one, frame = time_one_backward(model, cockpit, one_batch, losses, index, repeats)
    seconds_plain = time_plain(model, one_batch, losses[0], repeats)
    start = time.perf_counter()
    stats = cgn.minibatch_gradient_stats(model, many, nn.CrossEntropyLoss(),
                                         quantiles=QUANTILES, num_batches=m)
    seconds_many = time.perf_counter() - start
    examples = flat_by_layer(per_example_gradients(twin, *one_batch))
    gradients, one_each, pooled = across_batches(twin, many)
    names = [q for q in (f"q{level:g}" for level in QUANTILES)]
    rows = {}
    for layer, samples in examples.items():
        scale = 1 / np.sqrt(len(samples))
        reported = frame[(frame.param == layer) & (frame.quantity == "GradientVarianceQuantiles")]
        reported = reported.set_index("statistic").value
        rows[layer] = {
            "one": np.array([reported[q] for q in names]),
            "one_check": sd_quantiles(samples, scale),
            "one_se": bootstrap_se(samples, scale, resamples, rng),
            "one_each": np.quantile(one_each[layer], (0.1, 0.5, 0.9), axis=0),
            "one_each_sd": one_each[layer].std(axis=0, ddof=1),
            "pooled": pooled[layer],
            "many": np.array([stats[layer][q] for q in names]),
            "many_check": sd_quantiles(gradients[layer], 1.0),
            "many_se": bootstrap_se(gradients[layer], 1.0, resamples, rng),
        }
    return rows, {"one": seconds_one, "plain": seconds_plain, "many": seconds_many}


def relative_gap(a, b) -> float:
    """Largest ``|a - b| / max(|a|, |b|)`` over entries (0 where both are 0)."""
    scale = np.maximum(np.abs(a), np.abs(b))
    return float(np.max(np.where(scale > 0, np.abs(a - b) / np.where(scale > 0, scale, 1), 0)))


def train_and_measure(settings):
    """Train the digits CNN; measure both methods at each checkpoint."""
    epochs, checkpoints, m, _, _ = settings
    torch.manual_seed(SEED)
    train_loader, _ = train_digits.digits_loaders(BATCH, SEED)
    model = extend(train_digits.digits_cnn())
    twin = train_digits.digits_cnn().double()
    losses = (extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none"))
    names = [n for n, _ in model.named_parameters()]
    quantity = cgn.GradientVarianceQuantiles(linear(1), quantiles=QUANTILES, param_names=names)
    cockpit = cgn.Cockpit(model.parameters(), quantities=[quantity])
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    generator = torch.Generator().manual_seed(SEED + 1)
    rng = np.random.default_rng(SEED)
    results, step = {}, 0
    for _ in range(epochs):
        for x, y in train_loader:
            if step in checkpoints:
                batches = independent_batches(train_loader.dataset, m + 1, generator)
                results[step] = measure(model, twin, cockpit, losses, batches,
                                        len(results), settings, rng)
            opt.zero_grad()
            losses[0](model(x), y).backward()
            opt.step()
            step += 1
    return results, names + [cgn.NETWORK]


def _errors(r, method, k):
    """Error bar (below, above) of one method's quantile ``k``."""
    if method == "one_each":  # the 10th to 90th percentile over batches, around their median
        low, mid, high = r["one_each"][:, k]
        return mid, (mid - low, high - mid)
    return r[method][k], (r[f"{method}_se"][k],) * 2


#: Method, offset on the x axis, colour, legend label.
METHODS = (("one", -0.24, "C0", "one backward, this batch (bars: bootstrap SE)"),
           ("one_each", 0.0, "C2", "one backward on each of the M batches (median, 10-90%)"),
           ("many", 0.24, "C3", "minibatch_gradient_stats over M batches (bars: bootstrap SE)"))


def figure(results, layers, path):
    steps = sorted(results)
    cols = 2 if len(steps) > 1 else 1
    rows = (len(steps) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.4 * rows + 0.8), squeeze=False,
                             layout="constrained")
    x = np.arange(len(layers))
    markers = {0.1: "v", 0.5: "o", 0.9: "^"}
    for ax, step in zip(axes.flat, steps):
        measured = results[step][0]
        for k, level in enumerate(QUANTILES):
            for method, shift, color, label in METHODS:
                values, bars = zip(*(_errors(measured[layer], method, k) for layer in layers))
                values, bars = np.array(values), np.array(bars).T
                shown = values > 0  # a zero quantile has no place on the log axis
                ax.errorbar(x[shown] + shift, values[shown], yerr=bars[:, shown],
                            fmt=markers[level], color=color, ms=3.5, capsize=1.5, lw=0.8,
                            label=label if k == 1 else None)
        ax.set_yscale("log")
        ax.set_xticks(x, layers, rotation=45, fontsize="small")
        ax.set_title(f"step {step}", fontsize="medium")
        ax.set_ylabel("sd of grad element")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(steps):]:
        ax.set_visible(False)
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside lower center",
               fontsize="small", ncols=1, title="markers: v q0.1, o q0.5, ^ q0.9 over the "
               "layer's elements", title_fontsize="small")
    fig.suptitle(f"per-layer quantiles of the gradient's sd (batch {BATCH}): one backward "
                 "against many mini-batches", fontsize="medium")
    pages.save_figure(fig, path, dpi=80)
    plt.close(fig)


def _cell(value, se):
    return f"{value:.3g} ± {se:.2g}"


def _z(r) -> np.ndarray:
    """``(one - many) / sqrt(SE_one^2 + SE_many^2)`` per quantile; NaN where both SEs are 0."""
    scale = np.hypot(r["one_se"], r["many_se"])
    safe = np.where(scale > 0, scale, 1)
    return np.where(scale > 0, (r["one"] - r["many"]) / safe, np.nan)


def _range(ratios) -> str:
    """``"3.1-4.2"``: the smallest and largest of ``ratios``."""
    ratios = sorted(ratios)
    return f"{ratios[0]:.2g}-{ratios[-1]:.2g}"


def _share(flags) -> str:
    return f"{np.mean(flags):.0%}" if len(flags) else "-"


def comparisons(results, layers):
    """Per quantile: the z of this batch against many, whether many lies in the one-backward
    10-90% range, and the relative gap of pooled variances to many; and the recomputation check."""
    names = [f"q{level:g}" for level in QUANTILES]
    found = {q: {"z": [], "inside": [], "pooled": []} for q in names}
    checks = []
    for step in sorted(results):
        for layer in layers:
            r = results[step][0][layer]
            z = _z(r)
            for k, q in enumerate(names):
                if np.isfinite(z[k]):
                    found[q]["z"].append(abs(z[k]) < 2)
                low, _, high = r["one_each"][:, k]
                found[q]["inside"].append(low <= r["many"][k] <= high)
                if r["many"][k] > 0:
                    found[q]["pooled"].append(abs(r["pooled"][k] / r["many"][k] - 1))
            checks += [relative_gap(r["one"], r["one_check"]),
                       relative_gap(r["many"], r["many_check"])]
    return found, max(checks)


def page(results, layers, settings, argv, quick) -> str:
    epochs, checkpoints, m, resamples, repeats = settings
    median = QUANTILES.index(0.5)
    rows = []
    for step in sorted(results):
        for layer in layers:
            r = results[step][0][layer]
            low, mid, high = r["one_each"][:, median]
            z = _z(r)[median]
            rows.append([step, layer, _cell(r["one"][median], r["one_se"][median]),
                         f"{mid:.3g} [{low:.3g}, {high:.3g}]", f"{r['pooled'][median]:.3g}",
                         _cell(r["many"][median], r["many_se"][median]),
                         f"{z:+.1f}" if np.isfinite(z) else "-"])
    table = pages.markdown_table(
        ["step", "layer", "this batch ± bootstrap SE", f"each of M={m} batches: median [10%, 90%]",
         "pooled variance", f"M={m} batches ± bootstrap SE", "z"], rows)
    found, check = comparisons(results, layers)
    agree = pages.markdown_table(
        ["quantile", "abs(z) < 2: this batch vs M batches",
         "M-batch value inside the one-backward 10-90% range",
         "pooled vs M batches: median relative gap", "largest"],
        [[q, _share(f["z"]), _share(f["inside"]),
          f"{np.median(f['pooled']):.1%}" if f["pooled"] else "-",
          f"{np.max(f['pooled']):.1%}" if f["pooled"] else "-"] for q, f in found.items()])
    timing = pages.markdown_table(
        ["step", "plain forward+backward (ms)", "one backward with GradientVarianceQuantiles (ms)",
         f"minibatch_gradient_stats, M={m} (ms)", "ratio many / one"],
        [[step, f"{t['plain'] * 1e3:.1f}", f"{t['one'] * 1e3:.1f}", f"{t['many'] * 1e3:.0f}",
          f"{t['many'] / t['one']:.0f}x"] for step, (_, t) in sorted(results.items())])
    names = [f"q{level:g}" for level in QUANTILES]
    times = [t for _, t in results.values()]
    gaps = [gap for f in found.values() for gap in f["pooled"]]
    inside = [flag for f in found.values() for flag in f["inside"]]
    verdict = (
        f"**In short**: averaged over the M batches, the one-backward variances agree with "
        f"`minibatch_gradient_stats` to {np.median(gaps):.1%} (median over every layer, "
        f"quantile and step; largest {np.max(gaps):.1%})"
        + (": the two methods measure the same noise." if np.median(gaps) < 0.05
           else ", too loosely to tell with so few batches.")
        + f" A single batch's quantiles scatter around it (the M-batch value lies in the "
        f"10-90% range of the one-backward estimates in {np.mean(inside):.0%} of the cases), "
        f"widely and low when per-example gradients are heavy-tailed, and then its bootstrap "
        f"error bar understates the scatter. One tracked backward pass cost "
        f"{_range(t['one'] / t['plain'] for t in times)} times a plain one here, the M={m} "
        f"mini-batches {_range(t['many'] / t['one'] for t in times)} times more."
    )
    return f"""# One backward pass against many mini-batches

Does `GradientVarianceQuantiles`, from **one** batch of B = {BATCH} examples
and one backward pass, measure the same per-layer gradient noise as the
user's original method, `minibatch_gradient_stats` over **M = {m}**
mini-batches of {BATCH} at fixed parameters? Both estimate, per gradient
element `j`, the standard deviation `sd_j` of the mini-batch gradient
element; each layer's quantiles {", ".join(names)} over its elements are
compared at steps {", ".join(map(str, checkpoints))} of a training run of the
digits CNN ({epochs} epochs, SGD, learning rate {LR}, momentum 0.9, batch
{BATCH}). All batches of the comparison are drawn independently, uniformly
with replacement from the 1,500 training images, at the checkpoint's
parameters.

{verdict}

Four numbers per layer and quantile:

- **this batch**: what `GradientVarianceQuantiles` reported for one batch;
- **each of the M batches**: what one backward pass reports on each of the
  M batches (recomputed in float64 from per-example gradients, `torch.func`
  on an un-extended copy): the *sampling distribution* of the one-backward
  estimate, shown as its median and 10-90% range;
- **pooled variance**: the quantile of `sqrt(mean_k sd_kj^2)`, the
  one-backward *variances* averaged over the M batches;
- **M batches**: `minibatch_gradient_stats` over the same M batches.

![quantiles of sd per layer, one backward against M mini-batches]({SLUG}.png)

## Expected sampling error

The error bars of "this batch" and "M batches" are the **bootstrap standard
error** over what each estimate averages ({resamples} resamples): resample
the B per-example gradients `g_i` with replacement and recompute
`sd_j = std_i(g_ij) / sqrt(B)` for every element and the layer's quantiles;
likewise resample the M batch gradients and recompute `sd_j = std_k(G_kj)`.
The spread of the recomputed quantiles is the SE. Normal theory would give
a relative SE of an sd from n draws of `1/sqrt(2(n-1))`:
{1 / np.sqrt(2 * (BATCH - 1)):.0%} for one batch (n = {BATCH}),
{1 / np.sqrt(2 * (m - 1)):.0%} for the mini-batches (n = {m}). It is not used
because per-example gradients are far from normal (ReLUs make many
contributions exactly zero, the rest are heavy-tailed: the variance of a
sample variance is `sigma^4 (kappa - (n-3)/(n-1)) / n`, and the kurtosis
`kappa` is far above the normal 3 here), and because a quantile over a
layer's elements pools elements whose errors are correlated (they come from
the same examples). The bootstrap needs no model of either.

The bootstrap of one batch has a blind spot, and the run shows it: it can
only resample the examples the batch holds. Late in training most examples
are fit and have tiny gradients while a few carry large ones; a batch of
{BATCH} often holds none of those few, and then its sd is far below the true
one while its bootstrap SE, built from the same quiet examples, is small.
The one-backward column over all M batches is the honest sampling error: it
is the distribution of the estimate itself, no resampling needed.

## Results

`z = (this batch − M batches) / sqrt(SE² + SE²)`; "inside" asks whether the
M-batch value lies in the 10-90% range of the one-backward estimates;
"pooled" compares the one-backward variances averaged over the M batches with
the M-batch estimate (both unbiased for `sd_j^2`, from the same batches).

{agree}
Median (q0.5) per layer:

{table}
Each variance estimate is unbiased, but the sd of one batch is a skewed
estimate when per-example gradients are heavy-tailed, so a typical single
batch reports less noise than there is; averaging the one-backward
*variances* over steps (as `GradientNoiseScale` smooths its numerator and
denominator) recovers the M-batch value, as the pooled column shows. An
sd quantile that is exactly 0 means that at least that fraction of the
layer's elements had no nonzero contribution in the batch (dead ReLUs for
those examples).

As a check, every reported number was recomputed from the float64
per-example and per-batch gradients: the largest relative difference over
every layer, quantile and step is {check:.1e} (float32 model and sums
against the float64 recomputation).

## Time

Median of {repeats} repeats on one CPU thread; `minibatch_gradient_stats` is
timed once (its M forward and backward passes dominate). The tracked backward
pass cost {_range(t["one"] / t["plain"] for t in times)} times a plain forward
and backward pass (BackPACK's hooks and the quantiles; on a model this small
the fixed costs dominate), and the M={m} mini-batches
{_range(t["many"] / t["one"] for t in times)} times the tracked one.

{timing}
{pages.provenance("experiments.one_backward_vs_minibatches", argv, SEED, quick)}"""


def main(argv=None):
    argv = pages.argv_of(argv)
    args = pages.setup(pages.argument_parser(__doc__.splitlines()[0]), argv)
    settings = QUICK if args.quick else FULL
    results, layers = train_and_measure(settings)
    figure(results, layers, args.out / f"{SLUG}.png")
    text = page(results, layers, settings, argv, args.quick)
    (args.out / f"{SLUG}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
