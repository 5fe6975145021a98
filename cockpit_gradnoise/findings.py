"""The report: a per-layer table at one step, and findings in plain language.

Every threshold that turns a number into a finding is a field of
:data:`THRESHOLDS`, a :class:`Thresholds` (documented in ``docs/dashboard.md``).
Both live in :mod:`cockpit_gradnoise._views`, the helpers the views share:
the dashboard's reference band for update sizes reads the same values. Like
the panels, the report reads only the tidy frame of
:func:`cockpit_gradnoise.to_frame`, and it ranks the noisiest layers as the
dashboard does (:func:`cockpit_gradnoise._views.noise_ranking`).

Importing this module imports no pandas (only building a table does), so the
command line's ``--help`` starts fast.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from cockpit_gradnoise._views import (
    RANKINGS,
    THRESHOLDS,
    Coverage,
    NonFinite,
    Ranking,
    Thresholds,
    coverage_note,
    equals,
    layer_order,
    network_coverage,
    noise_ranking,
    non_finite_summary,
    recorded_batch_size,
    run_heads,
    select,
    tracked_steps,
    unique_in_order,
)
from cockpit_gradnoise.schema import (
    B_SIMPLE,
    B_SIMPLE_SMOOTHED,
    BATCH_SIZE,
    COVERAGE_STATISTICS,
    GRAD_SCALER,
    GRADIENT_VARIANCE,
    MAX,
    NETWORK,
    NOISE_SCALE,
    NORM_RATIO,
    PARAM_GRAD_RATIO,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    PER_EXAMPLE_NORM,
    QUANTITIES,
    SD_MEDIAN,
    SKIPPED,
    SNR_MEDIAN,
    UPDATE_RELATIVE,
    UPDATE_SIZE,
    ZERO_GRAD_FRACTION,
    encode_float,
    quantile_name,
)

import numpy

if TYPE_CHECKING:
    import pandas


#: Report column: (quantity, statistic) it is read from.
COLUMNS: Dict[str, Tuple[str, str]] = {
    "sd_median": (GRADIENT_VARIANCE, SD_MEDIAN),
    "snr_median": (GRADIENT_VARIANCE, SNR_MEDIAN),
    "norm_median": (PER_EXAMPLE_NORM, quantile_name(0.5)),
    "norm_max": (PER_EXAMPLE_NORM, MAX),
    "norm_ratio": (PARAM_GRAD_RATIO, NORM_RATIO),
    "zero_grad_fraction": (PARAM_GRAD_RATIO, ZERO_GRAD_FRACTION),
    "relative_update": (UPDATE_SIZE, UPDATE_RELATIVE),
    "b_simple": (NOISE_SCALE, B_SIMPLE),
    "b_simple_smoothed": (NOISE_SCALE, B_SIMPLE_SMOOTHED),
}

FORMATS = ("text", "csv", "json")

#: Findings of one kind named one layer per line, at most this many; the rest are counted.
MAX_LAYER_LINES = 5


def _steps_text(steps: List[int]) -> str:
    """``"26 tracked steps: 0, 2, 4, ..., 48, 50"``: the first three and the last two."""
    shown = [str(s) for s in steps]
    if len(shown) > 6:
        shown = shown[:3] + ["..."] + shown[-2:]
    counted = "1 tracked step" if len(steps) == 1 else f"{len(steps)} tracked steps"
    return f"{counted}: {', '.join(shown)}"


def _step_blocks(frame: pandas.DataFrame) -> pandas.DataFrame:
    """``step, quantity`` of the first row of each run of rows of one step and quantity.

    A tidy frame is sorted by step and quantity: a few thousand runs stand
    for millions of rows (any order is right, just slower).
    """
    return frame.iloc[run_heads(frame.step, frame.quantity)][["step", "quantity"]]


def holdings(frame: pandas.DataFrame) -> str:
    """``"Custom (3 tracked steps: 0, 1, 2)"``: the frame's quantities and their steps."""
    blocks = _step_blocks(frame)
    return "; ".join(
        f"{quantity} ({_steps_text(tracked_steps(blocks[equals(blocks.quantity, quantity)]))})"
        for quantity in unique_in_order(blocks.quantity)
    )


def quantity_steps(frame: pandas.DataFrame, step: Optional[int] = None) -> Dict[str, int]:
    """For each quantity, its latest tracked step at or before ``step`` (default: the last).

    Raises:
        ValueError: If the frame holds none of this package's quantities
            (naming those it holds and their steps), or ``step`` is before the
            first or after the last tracked step (naming them).
    """
    if frame.empty:
        raise ValueError("the log holds none of cockpit-gradnoise's quantities")
    blocks = _step_blocks(frame)
    if not any(equals(blocks.quantity, quantity).any() for quantity in QUANTITIES):
        raise ValueError(
            f"the log holds none of cockpit-gradnoise's quantities ({', '.join(QUANTITIES)}), "
            f"only {holdings(frame)}: its numbers are in cockpit_gradnoise.to_frame"
        )
    tracked = tracked_steps(blocks)
    if step is not None and step < tracked[0]:
        raise ValueError(
            f"no tracked step at or before step {step}: the first is {tracked[0]} "
            f"({_steps_text(tracked)})"
        )
    if step is not None and step > tracked[-1]:
        raise ValueError(
            f"no tracked step {step}: the log ends at step {tracked[-1]} "
            f"({_steps_text(tracked)})"
        )
    last = tracked[-1] if step is None else int(step)
    steps = blocks[blocks.step <= last].groupby("quantity", observed=True).step.max()
    return {str(quantity): int(s) for quantity, s in steps.items()}


def layer_table(frame: pandas.DataFrame, steps: Dict[str, int]) -> pandas.DataFrame:
    """One row per layer (model order, :func:`~cockpit_gradnoise._views.layer_order`),
    the network last; one column per :data:`COLUMNS` entry.

    Each quantity's numbers come from its step in ``steps``; NaN where absent.
    """
    import pandas  # here, not at the top: see the module's docstring

    at_steps = frame[frame.step.isin(set(steps.values()))]
    chosen = numpy.zeros(len(at_steps), dtype=bool)
    for quantity, step in steps.items():
        chosen |= (at_steps.step.to_numpy() == step) & equals(at_steps.quantity, quantity)
    chosen = at_steps[chosen]
    params = layer_order(chosen) + ([NETWORK] if equals(chosen.param, NETWORK).any() else [])
    table = pandas.DataFrame(index=pandas.Index(params, name="param"))
    for column, (quantity, statistic) in COLUMNS.items():
        rows = select(chosen, quantity, statistic=statistic)
        values = rows.drop_duplicates("param", keep="last").set_index("param").value
        table[column] = values.reindex(table.index).astype(float)
    return table


def coverages(frame: pandas.DataFrame, steps: Dict[str, int]) -> Dict[str, Coverage]:
    """``{quantity: coverage}`` of the quantities whose network row, at their step in
    ``steps``, leaves parameters out (:func:`~cockpit_gradnoise._views.network_coverage`)."""
    found = {q: network_coverage(frame[frame.step.to_numpy() == s], q) for q, s in steps.items()}
    return {quantity: coverage for quantity, coverage in found.items() if coverage}


@dataclass
class Report:
    """A report: the table, the steps it was read at, the batch size and the findings.

    ``ranking`` ranks the layers noisiest first over the tracked steps up to
    ``step``, as the dashboard does; ``coverage`` names the quantities whose
    ``"all"`` row covers only some of the parameters. ``non_finite`` says
    where the run went NaN or inf (its finding is the first); ``finite_step``:
    the report's step was moved back to the last step without NaN or inf,
    the last tracked step being non-finite.
    """

    source: str
    step: int
    steps: Dict[str, int]
    batch_size: Optional[int]
    table: pandas.DataFrame
    findings: List[str]
    ranking: Optional[Ranking] = None
    coverage: Dict[str, Coverage] = field(default_factory=dict)
    non_finite: Optional[NonFinite] = None
    finite_step: bool = False


#: Every statistic a report reads: its columns, the ranking, the run's history,
#: coverage and the batch size. The rest of a large frame is left out at once.
_READ = sorted(
    {statistic for _, statistic in COLUMNS.values()}
    | {statistic for _, statistic, _ in RANKINGS}
    | {ZERO_GRAD_FRACTION, UPDATE_RELATIVE, B_SIMPLE, BATCH_SIZE, *COVERAGE_STATISTICS}
)


def finite_report_step(summary: Optional[NonFinite], step: Optional[int] = None) -> Optional[int]:
    """The step to report: ``step``; by default the last tracked one, unless the run
    diverged: then the last without NaN or inf (``None``: the last tracked step)."""
    if step is None and summary is not None and summary.since is not None \
            and summary.last_finite is not None:
        return summary.last_finite
    return step


def build_report(frame, *, source="", step=None, batch_size=None, thresholds: Thresholds = THRESHOLDS,
                 ranking: Optional[Ranking] = None):
    """Build the :class:`Report` of ``frame`` at ``step``.

    Args:
        frame: Tidy frame from :func:`cockpit_gradnoise.to_frame`.
        source: Name of the log, for the header.
        step: Step to report; each quantity is read at its latest step at or
            before it. Default: the last tracked step; if it holds NaN or inf
            (:func:`~cockpit_gradnoise._views.non_finite`), the last one that
            does not.
        batch_size: The batch size used, to compare with the noise scale;
            default :func:`recorded_batch_size`.
        thresholds: A :class:`Thresholds`.
        ranking: ``noise_ranking`` of the frame up to the reported step, if
            known (:func:`cockpit_gradnoise.view_rows.report_frame` reads it
            from a streamed log's summary); default: ranked from ``frame``.

    Raises:
        ValueError: If ``frame`` holds none of this package's quantities or
            ``step`` is outside its tracked steps.
    """
    summary = non_finite_summary(frame)
    reported = finite_report_step(summary, step)
    finite_step = reported != step
    steps = quantity_steps(frame, reported)
    last = max(steps.values())
    # Before the rows below are copied: a long run's ranking reads millions of rows.
    if ranking is None:
        ranking = noise_ranking(frame, until=last)
    # One pass over the whole frame; everything after reads the rows it needs of these.
    read = frame[(frame.step.to_numpy() <= last) & frame.statistic.isin(_READ).to_numpy()]
    table = layer_table(read, steps)
    if batch_size is None:
        batch_size = recorded_batch_size(read)
    history = run_history(select(read, param=NETWORK), thresholds)
    return Report(
        source=str(source),
        step=last,
        steps=steps,
        batch_size=batch_size,
        table=table,
        findings=non_finite_finding(summary)
        + skipped_finding(frame)
        + run_findings(history, batch_size, thresholds)
        + findings(table, batch_size, thresholds, ranking=ranking,
                   stopped=history.stopped_at is not None),
        ranking=ranking,
        coverage=coverages(read, steps),
        non_finite=summary,
        finite_step=finite_step,
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


def noise_scale_finding(table, batch_size, thresholds: Thresholds = THRESHOLDS) -> List[str]:
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


#: What a ranking's statistic is, in the noisiest-layer finding.
_RANKED_BY = {
    "snr_median": "lowest median signal-to-noise |grad_j|/sd_j",
    "sd_median": "highest median sd of its gradient elements",
    "norm_median": "highest median per-example gradient norm",
}


def noisiest_finding(ranking: Optional[Ranking]) -> List[str]:
    """The noisiest layer by :func:`~cockpit_gradnoise._views.noise_ranking`.

    The dashboard draws the layers of the same ranking, so the two agree.
    """
    if ranking is None or ranking.scores.empty:
        return []
    column = next(c for c, qs in COLUMNS.items() if qs == (ranking.quantity, ranking.statistic))
    name, score = ranking.scores.index[0], ranking.scores.iloc[0]
    finite = int(ranking.finite_steps.get(name, 0))
    counted = f"{finite} finite step" + ("" if finite == 1 else "s")
    if finite < ranking.steps:
        counted += f" (of {ranking.steps} tracked)"
    return [
        f"noisiest layer: {name}, {_RANKED_BY[column]}: {score:.3g} on average over "
        f"{counted} (network {ranking.network:.3g}) ({column})"
    ]


def _named(params: List[str]) -> str:
    """``"a, b, c, d, e and 3 more"``; the network alone as ``"the network (all)"``."""
    layers = [name for name in params if name != NETWORK]
    if not layers:
        return f"the network ({NETWORK})"
    more = len(layers) - MAX_LAYER_LINES
    return ", ".join(layers[:MAX_LAYER_LINES]) + (f" and {more} more" if more > 0 else "")


def non_finite_finding(summary: Optional[NonFinite]) -> List[str]:
    """Where the run went NaN or inf (:func:`~cockpit_gradnoise._views.non_finite_summary`).

    The report's first finding: numbers after a NaN or inf say nothing.
    """
    if summary is None:
        return []
    counted = f"{len(summary.steps)} of {len(summary.tracked)} tracked steps"
    if summary.since is not None:
        what = (f"the run diverged: its statistics are NaN or inf from step {summary.since} "
                f"to the last tracked step {summary.tracked[-1]} ({counted})")
    else:
        what = (f"statistics are NaN or inf at {counted} ({', '.join(map(str, summary.steps[:5]))}"
                f"{', ...' if len(summary.steps) > 5 else ''}); the last tracked step is finite")
    return [
        f"{what}; first at step {summary.first}, in {_named(summary.params)} "
        f"({', '.join(summary.quantities)}): a NaN or inf loss or gradient, e.g. from a "
        "learning rate too large or an overflow"
    ]


def snr_findings(table, thresholds: Thresholds = THRESHOLDS) -> List[str]:
    """The layers whose median SNR at the report's step is below ``low_snr``."""
    snr = _layer_values(table, "snr_median").sort_values()
    low = snr[snr < thresholds.low_snr]
    if low.empty:
        return []
    shown = low.iloc[:MAX_LAYER_LINES].items()
    named = ", ".join(f"{name} {value:.2g}" for name, value in shown)
    more = f" and {len(low) - MAX_LAYER_LINES} more" if len(low) > MAX_LAYER_LINES else ""
    return [
        f"median signal-to-noise below {thresholds.low_snr:g} in {len(low)} of "
        f"{len(snr)} layers ({named}{more}): most of their gradient elements are "
        "dominated by noise at this batch size (snr_median)"
    ]


def update_size_findings(table, thresholds: Thresholds = THRESHOLDS) -> List[str]:
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


def zero_grad_findings(table, thresholds: Thresholds = THRESHOLDS) -> List[str]:
    """Layers where many gradient elements are exactly zero."""
    zero = _layer_values(table, "zero_grad_fraction").sort_values(ascending=False)
    lines = [
        f"layer {name}: {100 * value:.0f}% of its gradient elements are exactly zero "
        "(dead units or unused inputs?) (zero_grad_fraction)"
        for name, value in zero[zero >= thresholds.zero_grad_fraction].items()
    ]
    return _capped(lines, f"with zero_grad_fraction >= {thresholds.zero_grad_fraction:g}")


def norm_ratio_findings(table, thresholds: Thresholds = THRESHOLDS) -> List[str]:
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


def outlier_findings(table, thresholds: Thresholds = THRESHOLDS) -> List[str]:
    """Per-example gradient norms of the network with a far outlier."""
    largest, median = _value(table, "norm_max"), _value(table, "norm_median")
    if not (median > 0 and largest >= thresholds.outlier_norm_factor * median):
        return []
    return [
        f"the largest per-example gradient norm {largest:.3g} is {largest / median:.0f}x "
        f"the median {median:.3g}: a few examples dominate the batch gradient (outliers "
        f"or mislabelled examples?) (norm_max, norm_median of {NETWORK})"
    ]


def findings(
    table, batch_size=None, thresholds: Thresholds = THRESHOLDS, *, ranking=None, stopped=False
) -> List[str]:
    """Every finding of the report's table, one plain-language line each.

    ``ranking`` (:func:`~cockpit_gradnoise._views.noise_ranking`) names the
    noisiest layer; without it that line is left out. ``stopped``: the network
    has stopped learning (:func:`run_history`), so its noise scale, measured on
    the few elements that still get a gradient, says nothing about the batch
    and is left out (:func:`run_findings` reads it from before the stop).
    """
    return (
        ([] if stopped else noise_scale_finding(table, batch_size, thresholds))
        + noisiest_finding(ranking)
        + snr_findings(table, thresholds)
        + update_size_findings(table, thresholds)
        + zero_grad_findings(table, thresholds)
        + norm_ratio_findings(table, thresholds)
        + outlier_findings(table, thresholds)
    )


# Findings over the run ----------------------------------------------------------


@dataclass
class RunHistory:
    """What the network rows of the tracked steps up to the report's step say.

    ``stopped_at``: the first step of the final stretch of tracked steps at
    which the network's ``zero_grad_fraction`` is at least the threshold
    (``None`` if the report's step is not in one). ``largest_update``: the
    step and value of the largest relative update of the network before it.
    ``noise_scale``: the median ``b_simple`` of the network before it (an
    infinite one, where no gradient signal was resolved, counts as the
    largest), and over which steps.
    """

    stopped_at: Optional[int]
    zero_grad_fraction: float
    largest_update: Optional[Tuple[int, float]]
    noise_scale: Optional[Tuple[float, int, int]]


def _network_series(frame, quantity, statistic) -> pandas.Series:
    rows = select(frame, quantity, NETWORK, statistic)
    return rows.set_index("step").value.astype(float).sort_index()


def run_history(frame: pandas.DataFrame, thresholds: Thresholds = THRESHOLDS) -> RunHistory:
    """The :class:`RunHistory` of ``frame`` (its steps up to the report's)."""
    zero = _network_series(frame, PARAM_GRAD_RATIO, ZERO_GRAD_FRACTION)
    stopped_at, fraction = None, math.nan
    if not zero.empty:
        fraction = float(zero.iloc[-1])
        dead = zero >= thresholds.stopped_zero_grad_fraction
        if dead.iloc[-1]:
            alive = dead.index[~dead.to_numpy()]
            later = dead.index[dead.index > alive.max()] if len(alive) else dead.index
            stopped_at = int(later.min())
    before = math.inf if stopped_at is None else stopped_at
    update = _network_series(frame, UPDATE_SIZE, UPDATE_RELATIVE)
    update = update[(update.index < before) & update.map(math.isfinite)]
    largest = None if update.empty else (int(update.idxmax()), float(update.max()))
    noise = _network_series(frame, NOISE_SCALE, B_SIMPLE)
    # inf (|G|^2 estimated <= 0: no signal resolved) is noise outweighing signal: kept.
    noise = noise[(noise.index < before) & ~noise.isna()]
    scale = None if noise.empty else (float(noise.median()), int(noise.index.min()),
                                      int(noise.index.max()))
    return RunHistory(stopped_at, fraction, largest, scale)


def skipped_finding(frame: "pandas.DataFrame") -> List[str]:
    """The tracked steps a GradScaler skipped (inf/NaN gradients: they have no rows)."""
    rows = frame[(frame.quantity == GRAD_SCALER).to_numpy() & (frame.statistic == SKIPPED).to_numpy()]
    if rows.empty:
        return []
    skipped = sorted(int(step) for step in rows.step[rows.value.to_numpy() > 0])
    if not skipped:
        return []
    shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
    return [
        f"the GradScaler skipped {len(skipped)} of {len(rows)} tracked steps (inf/NaN scaled "
        f"gradients; no rows there): steps {shown} ({SKIPPED} of {GRAD_SCALER})"
    ]


def run_findings(history: RunHistory, batch_size=None, thresholds: Thresholds = THRESHOLDS) -> List[str]:
    """Findings about the whole run: it stopped learning, and why.

    A step that moves the network by ``large_relative_update`` of its norm or
    more means a learning rate too large, whether or not the run stopped. A
    run that stopped (dead ReLUs) with no such step before, and a median
    noise scale ``B_simple`` before the stop at least ``stopped_noise_factor``
    times the batch, was knocked out by gradient noise: the expected squared
    norm of a step's noise is ``B_noise / B`` times its signal's (McCandlish
    et al. 2018), so the batch is too small for the learning rate.
    """
    lines = []
    if history.stopped_at is not None:
        lines.append(
            f"training has stopped: from step {history.stopped_at} on, "
            f"{100 * history.zero_grad_fraction:.1f}% of the network's gradient elements are "
            "exactly zero (dead ReLUs: the output no longer depends on the input, and "
            f"no step can revive it) (zero_grad_fraction of {NETWORK})"
        )
    large = history.largest_update
    if large is not None and large[1] >= thresholds.large_relative_update:
        step, value = large
        lines.append(
            f"the learning rate is too large: the step after step {step} moved the network by "
            f"{100 * value:.0f}% of its norm, {value / thresholds.usual_relative_update:.0f}x "
            f"the usual {_sci(thresholds.usual_relative_update)} (relative_update of {NETWORK})"
        )
    elif history.stopped_at is not None and history.noise_scale is not None and batch_size:
        noise_scale, first, last = history.noise_scale
        if noise_scale >= thresholds.stopped_noise_factor * batch_size:
            ratio = "more than" if math.isinf(noise_scale) else f"{noise_scale / batch_size:.1f}x"
            largest = "" if large is None else f" (at most {100 * large[1]:.0f}% of its norm)"
            lines.append(
                f"the batch {batch_size} is too small for the learning rate: no step moved the "
                f"network far{largest}, but before the stop (steps {first}-{last}) the median "
                f"noise scale was {noise_scale:.3g}, so the noise of a step outweighed its "
                f"signal ({ratio} in squared norm) and drove the weights to the dead state; use "
                f"a larger batch or a smaller learning rate (b_simple, relative_update of "
                f"{NETWORK})"
            )
    return lines


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
                # Only quantities whose "all" row leaves parameters out.
                "network_coverage": {
                    q: {PARAMS_COVERED: c.fewest, PARAMS_TOTAL: c.total}
                    for q, c in report.coverage.items()
                },
                "non_finite": _non_finite_json(report.non_finite),
            },
            indent=2,
        ) + "\n"
    if fmt != "text":
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return _text(report)


def _non_finite_json(summary: Optional[NonFinite]):
    """Where the run went NaN or inf, for the JSON format (``None``: it never did)."""
    if summary is None:
        return None
    return {
        "first_step": summary.first,
        "params": summary.params,
        "quantities": summary.quantities,
        "steps": summary.steps,
        "tracked_steps": len(summary.tracked),
        "diverged_from": summary.since,
        "last_finite_step": summary.last_finite,
    }


def _coverage_lines(coverage: Dict[str, Coverage]) -> List[str]:
    """``"all: 7 of 15 parameters in A, B (...)"``, one line per distinct coverage."""
    quantities: Dict[str, List[str]] = {}
    for quantity, covered in sorted(coverage.items()):
        quantities.setdefault(coverage_note(covered), []).append(quantity)
    return [
        f"{note} in {', '.join(names)} (the {NETWORK} row leaves the other parameters out)"
        for note, names in quantities.items()
    ]


def _text(report: Report) -> str:
    other = ", ".join(
        f"{q} from step {s}" for q, s in sorted(report.steps.items()) if s != report.step
    )
    if report.finite_step:
        other = "the last tracked step without NaN or inf" + (f"; {other}" if other else "")
    batch = "unknown (pass --batch-size)" if report.batch_size is None else report.batch_size
    shown = report.table.dropna(axis=1, how="all")
    # A run that went NaN or inf says so first; its finding is not repeated below.
    first = report.findings[:1] if report.non_finite is not None else []
    lines = [
        f"cockpit-gradnoise report: {report.source}",
        *[f"NON-FINITE: {line}" for line in first],
        f"step {report.step}" + (f" ({other})" if other else "") + f", batch size {batch}",
        *_coverage_lines(report.coverage),
        "",
        shown.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-") if len(shown.columns)
        else f"(no finite number at step {report.step})",
        "",
        "findings:",
    ]
    lines += [f"- {line}" for line in report.findings[len(first):]] or ["- none"]
    return "\n".join(lines) + "\n"


def report(source, path=None, *, step: Optional[int] = None, batch_size: Optional[int] = None,
           fmt: str = "text", thresholds=None) -> str:
    """The report of a run in one call: a per-layer table of one step and findings.

    ``format_report(build_report(to_frame(source)))`` (the text of
    ``cockpit-gradnoise report``).

    Args:
        source: A log's path, a :class:`~cockpit_gradnoise.Tracker`, a
            ``Cockpit``, its output dict or a frame of
            :func:`~cockpit_gradnoise.to_frame`.
        path: Where to write the text too (parent folders are created).
        step: The step to report (default: the last tracked step).
        batch_size: The batch size, compared with the noise scale; default
            the one GradientNoiseScale recorded.
        fmt: ``"text"``, ``"csv"`` or ``"json"``.
        thresholds: A :class:`Thresholds` (default: ``THRESHOLDS``).

    Returns:
        The report's text.
    """
    from cockpit_gradnoise.frame import to_frame

    import pandas  # only here: importing this module stays light

    # The header names the log, else what was reported ("Tracker", "DataFrame").
    if isinstance(source, (str, os.PathLike)):
        name = str(source)
    elif hasattr(source, "cockpit"):  # a Tracker: its get_output reads a streamed log back
        name = str(source.log or "Tracker")
    else:
        name = type(source).__name__
    frame = None
    if isinstance(source, (str, os.PathLike)):  # a streamed log: only the rows a report reads
        from cockpit_gradnoise.view_rows import report_frame, streamed_rows

        frame = streamed_rows(source, lambda path: report_frame(path, step))
    frame, ranking = (None, None) if frame is None else frame
    if frame is None:
        frame = source if isinstance(source, pandas.DataFrame) else to_frame(source)
    kwargs = {} if thresholds is None else {"thresholds": thresholds}
    built = build_report(frame, source=name, step=step, batch_size=batch_size, ranking=ranking,
                         **kwargs)
    text = format_report(built, fmt)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text
