"""The tables of a run as the README shows them: results, issue 10's targets, issue 9's support cost."""

from benchmarks.methods import FROZEN_LABELS


def markdown(table):
    lines = [
        "| model | method | median ms | ratio to plain | peak extra memory | memory ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in table:
        if "median_ms" in row:
            memory = ["not measured", "-"]
            if "peak_extra_mib" in row:
                memory = [f"{row['peak_extra_mib']:.1f} MiB", f"{row['memory_ratio']:.2f}"]
            cells = [f"{row['median_ms']:.2f}", f"{row['ratio']:.2f}", *memory]
        else:
            cells = [row["note"], "-", "-", "-"]
        lines.append("| " + " | ".join([row["model"], row["method"], *cells]) + " |")
    return "\n".join(lines)


#: Issue 10's targets: ratio to a plain step of the same model (its default batch size).
TARGETS = {
    "mlp": (2.5, 1.6, 1.6, 1.3, 1.3, 3),
    "cnn": (2, 1.8, 1.8, 1.15, 1.15, 2.5),
    "resnet18": (3, 2, 2, 1.2, 1.2, 4),
    "gpt": (2.5, 2, 2, 1.2, 1.2, 3.5),
}
TARGET_METHODS = (
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "GradientNoiseScale",
    "ParamGradRatio",
    "UpdateSize",
    "package: all together",
)
#: Rows measuring the package before its own convolution extensions (issue 10's "before").
BEFORE = "{} (BackPACK's conv rows)"
#: The cost of LayerNorm/embedding/attention rows may be this much above the model without them.
SUPPORT_COST_TARGET = 0.10


def targets_markdown(table):
    """Issue 10's targets against the measured ratios (and "before" where measured)."""
    ratios = {(r["model"], r["method"]): r["ratio"] for r in table if "ratio" in r}
    models = [m for m in dict.fromkeys(r["model"] for r in table) if m in TARGETS]
    lines = [
        "| model | " + " | ".join(TARGET_METHODS).replace("package: all together", "all five")
        + " | floor: extended model, empty Cockpit |",
        "|---|" + "---|" * (len(TARGET_METHODS) + 1),
    ]
    for model in models:
        cells = []
        for method, target in zip(TARGET_METHODS, TARGETS[model]):
            after = ratios.get((model, method))
            if after is None:
                cells.append(f"not measured (<= {target:g})")
                continue
            before = ratios.get((model, BEFORE.format(method)))
            verdict = "met" if after <= target else f"missed by {after - target:.2f}"
            was = f"{before:.2f} before, " if before is not None else ""
            cells.append(f"{was}**{after:.2f}** (<= {target:g}: {verdict})")
        floor = [ratios.get((model, m)) for m in ("extended model (no Cockpit)", "empty Cockpit")]
        cells.append(" / ".join("-" if f is None else f"{f:.2f}" for f in floor))
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def support_cost_markdown(table):
    """What the LayerNorm, embedding and attention rows add, where measured (issue 9)."""
    ratios = {(r["model"], r["method"]): r["ratio"] for r in table if "ratio" in r}
    lines = []
    for model in dict.fromkeys(r["model"] for r in table):
        whole = ratios.get((model, "package: all together"))
        for label in FROZEN_LABELS:
            without = ratios.get((model, f"package: all together {label}"))
            if whole is None or without is None:
                continue
            cost = whole / without - 1
            verdict = "met" if cost <= SUPPORT_COST_TARGET else "missed"
            lines.append(
                f"- {model}: all five {whole:.2f}x a plain step; {label[1:-1]} (in the plain "
                f"step too) {without:.2f}x; their rows cost {100 * cost:+.0f}% "
                f"(target <= +{100 * SUPPORT_COST_TARGET:.0f}%: {verdict})."
            )
    return "\n".join(lines)


def report_markdown(table):
    """The results table, the targets table and the support cost: what the README shows."""
    parts = [markdown(table), targets_markdown(table), support_cost_markdown(table)]
    return "\n\n".join(part for part in parts if part)
