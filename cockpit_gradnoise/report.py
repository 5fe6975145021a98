"""The report: a per-layer table at one step, and findings in plain language.

Every threshold that turns a number into a finding is a field of
:data:`THRESHOLDS` (documented in ``docs/dashboard.md``); the dashboard's
reference band for update sizes reads the same values. Like the panels, the
report reads only the tidy frame of :func:`cockpit_gradnoise.to_frame`.
"""

import json
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pandas

from cockpit_gradnoise.frame import encode_float
from cockpit_gradnoise.quantities._base import NETWORK


@dataclass(frozen=True)
class Thresholds:
    """When a number in the report becomes a finding."""

    #: The batch is "below" the noise scale when B_noise / B is at least this,
    #: "above" it when B / B_noise is; in between it is "close to" it.
    noise_scale_factor: float = 2.0
    #: The usual relative update ||theta(s+1) - theta(s)|| / ||theta(s)|| per step.
    usual_relative_update: float = 1e-3
    #: Relative updates more than this factor above or below the usual one are findings.
    relative_update_factor: float = 10.0
    #: A layer whose median |grad_j| / sd_j is below this is dominated by noise.
    low_snr: float = 1.0
    #: A layer with at least this fraction of exactly-zero gradient elements is a finding.
    zero_grad_fraction: float = 0.5
    #: Largest / smallest ||theta|| / ||grad|| across layers from which a finding is made.
    norm_ratio_spread: float = 100.0
    #: Largest / median per-example gradient norm (network) from which a finding is made.
    outlier_norm_factor: float = 10.0

    def relative_update_range(self) -> Tuple[float, float]:
        """The range of relative update sizes that raises no finding."""
        usual, factor = self.usual_relative_update, self.relative_update_factor
        return usual / factor, usual * factor


THRESHOLDS = Thresholds()

#: Report column: (quantity, statistic) it is read from.
COLUMNS: Dict[str, Tuple[str, str]] = {
    "sd_median": ("GradientVarianceQuantiles", "q0.5"),
    "snr_median": ("GradientVarianceQuantiles", "snr_q0.5"),
    "norm_median": ("PerExampleGradNorm", "q0.5"),
    "norm_max": ("PerExampleGradNorm", "max"),
    "norm_ratio": ("ParamGradRatio", "norm_ratio"),
    "zero_grad_fraction": ("ParamGradRatio", "zero_grad_fraction"),
    "relative_update": ("UpdateSize", "relative"),
    "b_simple": ("GradientNoiseScale", "b_simple"),
    "b_simple_smoothed": ("GradientNoiseScale", "b_simple_smoothed"),
}

FORMATS = ("text", "csv", "json")

#: Findings of one kind named one layer per line, at most this many; the rest are counted.
MAX_LAYER_LINES = 5


def sort_layers(names) -> List[str]:
    """Layer names sorted with numbers compared as numbers (``2.weight`` before
    ``10.weight``), ``"all"`` last: close to model order, which a log does not keep."""

    def key(name):
        parts = re.split(r"(\d+)", name)
        return (name == NETWORK, [(0, int(p)) if p.isdigit() else (1, p) for p in parts])

    return sorted(names, key=key)


def noisiest_layers(frame: pandas.DataFrame, k: int) -> List[str]:
    """The ``k`` noisiest layers, noisiest first.

    Ranked by the mean over tracked steps of the median signal-to-noise ratio
    (``GradientVarianceQuantiles`` ``snr_q0.5``, lowest first); without it by
    the median sd (``q0.5``, highest first), then by the median per-example
    norm (highest first); layers without any of these follow in :func:`sort_layers` order.
    """
    layers = sort_layers(set(frame.param) - {NETWORK})
    for quantity, statistic, ascending in (
        ("GradientVarianceQuantiles", "snr_q0.5", True),
        ("GradientVarianceQuantiles", "q0.5", False),
        ("PerExampleGradNorm", "q0.5", False),
    ):
        rows = frame[(frame.quantity == quantity) & (frame.statistic == statistic)]
        rows = rows[rows.param != NETWORK]
        if len(rows):
            finite = rows[rows.value.map(math.isfinite)]
            score = finite.groupby("param").value.mean().sort_values(ascending=ascending)
            ranked = list(score.index)
            return (ranked + [name for name in layers if name not in ranked])[:k]
    return layers[:k]


def recorded_batch_size(frame: pandas.DataFrame) -> Optional[int]:
    """The batch size a quantity recorded as statistic ``batch_size`` (latest), else ``None``.

    :class:`~cockpit_gradnoise.GradientNoiseScale` records it; without that
    quantity, pass it (``batch_size=``, ``--batch-size``) to compare it with
    the gradient noise scale.
    """
    rows = frame[(frame.statistic == "batch_size") & frame.value.map(math.isfinite)]
    return None if rows.empty else int(rows.loc[rows.step.idxmax(), "value"])


def quantity_steps(frame: pandas.DataFrame, step: Optional[int] = None) -> Dict[str, int]:
    """For each quantity, its latest tracked step at or before ``step`` (default: the last).

    Raises:
        ValueError: If no quantity has a step at or before ``step``.
    """
    if frame.empty:
        raise ValueError("the log holds none of cockpit-gradnoise's quantities")
    last = int(frame.step.max()) if step is None else int(step)
    steps = frame[frame.step <= last].groupby("quantity").step.max()
    if steps.empty:
        raise ValueError(
            f"no tracked step at or before step {last}: the first is {int(frame.step.min())}"
        )
    return {quantity: int(s) for quantity, s in steps.items()}


def layer_table(frame: pandas.DataFrame, steps: Dict[str, int]) -> pandas.DataFrame:
    """One row per layer (:func:`sort_layers` order), one column per :data:`COLUMNS` entry.

    Each quantity's numbers come from its step in ``steps``; NaN where absent.
    """
    chosen = frame[[steps.get(q) == s for q, s in zip(frame.quantity, frame.step)]]
    table = pandas.DataFrame(index=pandas.Index(sort_layers(set(chosen.param)), name="param"))
    for column, (quantity, statistic) in COLUMNS.items():
        rows = chosen[(chosen.quantity == quantity) & (chosen.statistic == statistic)]
        table[column] = rows.set_index("param").value.reindex(table.index).astype(float)
    return table


@dataclass
class Report:
    """A report: the table, the steps it was read at, the batch size and the findings."""

    source: str
    step: int
    steps: Dict[str, int]
    batch_size: Optional[int]
    table: pandas.DataFrame
    findings: List[str]


def build_report(frame, *, source="", step=None, batch_size=None, thresholds=THRESHOLDS):
    """Build the :class:`Report` of ``frame`` at ``step`` (default: the last tracked step).

    Args:
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        source: Name of the log, for the header.
        step: Step to report; each quantity is read at its latest step at or
            before it.
        batch_size: The batch size used, to compare with the noise scale;
            default :func:`recorded_batch_size`.
        thresholds: A :class:`Thresholds`.
    """
    steps = quantity_steps(frame, step)
    table = layer_table(frame, steps)
    if batch_size is None:
        batch_size = recorded_batch_size(frame)
    return Report(
        source=str(source),
        step=max(steps.values()),
        steps=steps,
        batch_size=batch_size,
        table=table,
        findings=findings(table, batch_size, thresholds),
    )


# Findings -------------------------------------------------------------------------


def _sci(value: float) -> str:
    """``0.0147`` -> ``"1.5e-2"``, ``0.001`` -> ``"1e-3"``: two digits, compact exponent."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def _value(table, column, param=NETWORK) -> float:
    if param not in table.index:
        return math.nan
    return float(table.at[param, column])


def _layer_values(table, column) -> pandas.Series:
    """The column's finite values of the layers (without the network)."""
    values = table[column].drop(index=NETWORK, errors="ignore")
    return values[values.map(math.isfinite)]


def _capped(lines, what):
    """At most :data:`MAX_LAYER_LINES` lines, then one that counts the rest."""
    if len(lines) <= MAX_LAYER_LINES:
        return lines
    rest = len(lines) - MAX_LAYER_LINES
    return lines[:MAX_LAYER_LINES] + [f"... and {rest} more layers {what}"]


def noise_scale_finding(table, batch_size, thresholds=THRESHOLDS) -> List[str]:
    """Compare the batch size with the network's noise scale (McCandlish et al. 2018).

    With ``B_noise`` the noise scale, training needs ``S_min (1 + B_noise / B)``
    steps at batch size ``B``, so doubling ``B`` takes
    ``1 - (1 + B_noise / 2B) / (1 + B_noise / B)`` fewer steps.
    """
    column = "b_simple_smoothed"
    noise_scale = _value(table, column)
    if math.isnan(noise_scale):
        column = "b_simple"
        noise_scale = _value(table, column)
    if math.isnan(noise_scale):
        return []
    source = f"({column} of {NETWORK})"
    if batch_size is None:
        return [
            f"the estimated noise scale is {noise_scale:.3g} examples; pass the batch size "
            f"(--batch-size) to compare it with yours {source}"
        ]
    if math.isinf(noise_scale):
        return [
            f"batch {batch_size}: the noise scale estimate is infinite (the estimated "
            f"|G|^2 is <= 0, no gradient signal resolved): the batch is far below the "
            f"noise scale and larger batches would cut steps almost linearly {source}"
        ]
    saved = 1 - (1 + noise_scale / (2 * batch_size)) / (1 + noise_scale / batch_size)
    doubling = f"doubling it to {2 * batch_size} takes {100 * saved:.0f}% fewer steps"
    factor = thresholds.noise_scale_factor
    if noise_scale >= factor * batch_size:
        verdict = "is below", "larger batches would cut steps almost linearly"
    elif batch_size >= factor * noise_scale:
        verdict = "is above", "larger batches would barely cut steps, smaller ones save compute"
    else:
        verdict = "is close to", "it is near the compute-efficient batch size"
    return [
        f"batch {batch_size} {verdict[0]} the estimated noise scale {noise_scale:.3g}: "
        f"{verdict[1]} ({doubling}) {source}"
    ]


def snr_findings(table, thresholds=THRESHOLDS) -> List[str]:
    """The noisiest layer, and the layers whose median SNR is below ``low_snr``."""
    snr = _layer_values(table, "snr_median").sort_values()
    if snr.empty:
        return []
    network = _value(table, "snr_median")
    lines = [
        f"noisiest layer: {snr.index[0]}, median signal-to-noise |grad_j|/sd_j "
        f"{snr.iloc[0]:.3g} (network {network:.3g}) (snr_median)"
    ]
    low = snr[snr < thresholds.low_snr]
    if len(low):
        shown = low.iloc[:MAX_LAYER_LINES].items()
        named = ", ".join(f"{name} {value:.2g}" for name, value in shown)
        more = f" and {len(low) - MAX_LAYER_LINES} more" if len(low) > MAX_LAYER_LINES else ""
        lines.append(
            f"median signal-to-noise below {thresholds.low_snr:g} in {len(low)} of "
            f"{len(snr)} layers ({named}{more}): most of their gradient elements are "
            "dominated by noise at this batch size (snr_median)"
        )
    return lines


def update_size_findings(table, thresholds=THRESHOLDS) -> List[str]:
    """Layers whose relative update is far from the usual ``1e-3``."""
    usual = thresholds.usual_relative_update
    low, high = thresholds.relative_update_range()
    relative = _layer_values(table, "relative_update")
    outside = relative[(relative > high) | (relative < low)]
    # Farthest from the usual size first; a zero update is the farthest.
    distance = outside.map(lambda v: abs(math.log(v / usual)) if v > 0 else math.inf)
    outside = outside[distance.sort_values(ascending=False).index]
    lines = []
    for name, value in outside.items():
        if value > high:
            how = f"{value / usual:.0f}x the usual {_sci(usual)}"
        elif value > 0:
            how = f"1/{usual / value:.0f} of the usual {_sci(usual)}: it barely moves"
        else:
            how = "it does not move"
        lines.append(
            f"layer {name} updates {_sci(value)} of its norm per step, {how} (relative_update)"
        )
    return _capped(lines, f"outside [{_sci(low)}, {_sci(high)}]")


def zero_grad_findings(table, thresholds=THRESHOLDS) -> List[str]:
    """Layers where many gradient elements are exactly zero."""
    zero = _layer_values(table, "zero_grad_fraction").sort_values(ascending=False)
    lines = [
        f"layer {name}: {100 * value:.0f}% of its gradient elements are exactly zero "
        "(dead units or unused inputs?) (zero_grad_fraction)"
        for name, value in zero[zero >= thresholds.zero_grad_fraction].items()
    ]
    return _capped(lines, f"with zero_grad_fraction >= {thresholds.zero_grad_fraction:g}")


def norm_ratio_findings(table, thresholds=THRESHOLDS) -> List[str]:
    """A wide spread of ``||theta|| / ||grad||`` across layers."""
    ratio = _layer_values(table, "norm_ratio")
    ratio = ratio[ratio > 0].sort_values()
    if len(ratio) < 2 or ratio.iloc[-1] < thresholds.norm_ratio_spread * ratio.iloc[0]:
        return []
    return [
        f"||theta||/||grad|| spans {ratio.iloc[-1] / ratio.iloc[0]:.0f}x across layers "
        f"({ratio.index[0]} {ratio.iloc[0]:.3g} to {ratio.index[-1]} {ratio.iloc[-1]:.3g}): "
        "one learning rate moves them at very different relative speeds; layer-wise "
        "rates (LARS) would even this out (norm_ratio)"
    ]


def outlier_findings(table, thresholds=THRESHOLDS) -> List[str]:
    """Per-example gradient norms of the network with a far outlier."""
    largest, median = _value(table, "norm_max"), _value(table, "norm_median")
    if not (median > 0 and largest >= thresholds.outlier_norm_factor * median):
        return []
    return [
        f"the largest per-example gradient norm {largest:.3g} is {largest / median:.0f}x "
        f"the median {median:.3g}: a few examples dominate the batch gradient (outliers "
        f"or mislabelled examples?) (norm_max, norm_median of {NETWORK})"
    ]


def findings(table, batch_size=None, thresholds=THRESHOLDS) -> List[str]:
    """Every finding of the report's table, one plain-language line each."""
    return (
        noise_scale_finding(table, batch_size, thresholds)
        + snr_findings(table, thresholds)
        + update_size_findings(table, thresholds)
        + zero_grad_findings(table, thresholds)
        + norm_ratio_findings(table, thresholds)
        + outlier_findings(table, thresholds)
    )


# Formats --------------------------------------------------------------------------


def format_report(report: Report, fmt: str = "text") -> str:
    """The report as ``"text"`` (table and findings), ``"csv"`` or ``"json"`` (table only)."""
    if fmt == "csv":
        table = report.table.copy()
        table.insert(0, "step", report.step)
        return table.to_csv(na_rep="nan")
    if fmt == "json":
        rows = [
            {"param": param, **{c: encode_float(v) for c, v in row.items()}}
            for param, row in report.table.iterrows()
        ]
        return json.dumps(
            {
                "log": report.source,
                "step": report.step,
                "quantity_steps": report.steps,
                "batch_size": report.batch_size,
                "columns": {c: list(qs) for c, qs in COLUMNS.items()},
                "layers": rows,
            },
            indent=2,
        ) + "\n"
    if fmt != "text":
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return _text(report)


def _text(report: Report) -> str:
    other = ", ".join(
        f"{q} from step {s}" for q, s in sorted(report.steps.items()) if s != report.step
    )
    batch = "unknown (pass --batch-size)" if report.batch_size is None else report.batch_size
    shown = report.table.dropna(axis=1, how="all")
    lines = [
        f"cockpit-gradnoise report: {report.source}",
        f"step {report.step}" + (f" ({other})" if other else "") + f", batch size {batch}",
        "",
        shown.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-"),
        "",
        "findings:",
    ]
    lines += [f"- {line}" for line in report.findings] or ["- none"]
    return "\n".join(lines) + "\n"
