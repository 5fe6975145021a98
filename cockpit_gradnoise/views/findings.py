"""The findings: what the numbers of a report mean, in plain language.

Each function turns the report's per-layer table at one step, or the
network's history over the run, into sentences; every threshold that turns a
number into a finding is a field of :data:`~cockpit_gradnoise.views.common.THRESHOLDS`.
:mod:`cockpit_gradnoise.views.report` builds the report from them. Importing
this module imports no pandas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from cockpit_gradnoise.logs.schema import (
    B_SIMPLE,
    B_SIMPLE_SMOOTHED,
    GRAD_SCALER,
    GRADIENT_VARIANCE,
    MAX,
    NETWORK,
    NOISE_SCALE,
    NORM_RATIO,
    PARAM_GRAD_RATIO,
    PER_EXAMPLE_NORM,
    SD_MEDIAN,
    SKIPPED,
    SNR_MEDIAN,
    UPDATE_RELATIVE,
    UPDATE_SIZE,
    ZERO_GRAD_FRACTION,
    quantile_name,
)
from cockpit_gradnoise.views.common import (
    THRESHOLDS,
    NonFinite,
    Ranking,
    Thresholds,
    select,
)

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

#: Findings of one kind named one layer per line, at most this many; the rest are counted.
MAX_LAYER_LINES = 5



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
    """The noisiest layer by :func:`~cockpit_gradnoise.views.common.noise_ranking`.

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
    """Where the run went NaN or inf (:func:`~cockpit_gradnoise.views.common.non_finite_summary`).

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

    ``ranking`` (:func:`~cockpit_gradnoise.views.common.noise_ranking`) names the
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


#: The network's statistics over the run that :func:`run_history` reads (its rows
#: of ``param == NETWORK``): what the streamed log's reader decodes for it.
HISTORY = (ZERO_GRAD_FRACTION, UPDATE_RELATIVE, B_SIMPLE)


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
