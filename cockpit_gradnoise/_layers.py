"""Which layers the views show, in what order, and what the network's row covers.

The report, the panels and the dashboard all read these, so that they list
layers in one order and agree on which are the noisiest. Like them, this
module reads only the tidy frame of :func:`cockpit_gradnoise.to_frame`; it
imports neither pandas (a frame brings its own methods) nor matplotlib, so
that the command line starts fast.
"""

import math
from typing import TYPE_CHECKING, List, NamedTuple, Optional

from cockpit_gradnoise.schema import (
    GRADIENT_VARIANCE,
    NETWORK,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    PER_EXAMPLE_NORM,
    SD_MEDIAN,
    SNR_MEDIAN,
    quantile_name,
)

if TYPE_CHECKING:
    import pandas

#: Layers drawn as lines by default; more become unreadable (the heatmap shows all).
DEFAULT_TOP_K = 6

#: What ranks layers, noisiest first: (quantity, statistic, lowest first), the
#: first one present in the frame. See :func:`noise_ranking`.
RANKINGS = (
    (GRADIENT_VARIANCE, SNR_MEDIAN, True),
    (GRADIENT_VARIANCE, SD_MEDIAN, False),
    (PER_EXAMPLE_NORM, quantile_name(0.5), False),
)


def finite_rows(frame: "pandas.DataFrame") -> "pandas.DataFrame":
    """The rows of ``frame`` with a finite value (a boolean mask even when empty)."""
    return frame[frame.value.abs() < math.inf]


def layer_order(frame: "pandas.DataFrame") -> List[str]:
    """The frame's layers (not the network) in the order they first appear.

    Quantities store each step's parameters in model order (their
    ``param_names``), :func:`cockpit_gradnoise.write_log` keeps that order and
    :func:`cockpit_gradnoise.to_frame` sorts only by step and quantity, so
    this is model order. A log written by ``Cockpit.write`` sorts its keys:
    from it the order is by name.
    """
    return [name for name in frame.param.unique() if name != NETWORK]


class Ranking(NamedTuple):
    """Layers ranked noisiest first by one statistic, averaged over the tracked steps."""

    quantity: str
    statistic: str
    #: ``{layer: mean of the statistic over its tracked steps}``, noisiest first.
    scores: "pandas.Series"
    #: The same mean for the network, NaN if it has none.
    network: float
    #: How many tracked steps the means are over.
    steps: int


def noise_ranking(frame: "pandas.DataFrame") -> Optional[Ranking]:
    """The layers of ``frame`` ranked noisiest first; ``None`` without a statistic to rank by.

    The score of a layer is the mean, over the frame's tracked steps, of its
    median signal-to-noise ratio ``|grad_j| / sd_j`` (``GradientVarianceQuantiles``
    ``snr_q0.5``), lowest first; without it the mean median sd (``q0.5``),
    highest first, then the mean median per-example norm (``PerExampleGradNorm``
    ``q0.5``), highest first (:data:`RANKINGS`). Non-finite values are left out.

    Why the mean over steps rather than the last step: each step's median SNR
    is estimated from one mini-batch, so a ranking at one step changes from
    batch to batch; the mean over the tracked steps is a steadier answer to
    "which layers are noisiest", and it matches what the dashboard draws
    (whole curves). The report at step ``S`` ranks over the steps up to
    ``S``: the same layers the dashboard of the log up to ``S`` draws.
    """
    for quantity, statistic, lowest_first in RANKINGS:
        rows = frame[(frame.quantity == quantity) & (frame.statistic == statistic)]
        if rows.param.ne(NETWORK).any():
            means = finite_rows(rows).groupby("param", sort=False).value.mean()
            network = float(means.get(NETWORK, math.nan))
            # A stable sort keeps ties in layer order.
            scores = means.drop(NETWORK, errors="ignore").sort_values(
                ascending=lowest_first, kind="stable"
            )
            return Ranking(quantity, statistic, scores, network, rows.step.nunique())
    return None


def noisiest_layers(frame: "pandas.DataFrame", k: int) -> List[str]:
    """The ``k`` noisiest layers by :func:`noise_ranking`, noisiest first.

    Layers without a score follow in :func:`layer_order`.
    """
    ranking = noise_ranking(frame)
    ranked = [] if ranking is None else list(ranking.scores.index)
    return (ranked + [name for name in layer_order(frame) if name not in ranked])[:k]


def default_layers(frame: "pandas.DataFrame", top_k: int = DEFAULT_TOP_K) -> List[str]:
    """The ``top_k`` noisiest layers (:func:`noisiest_layers`) in :func:`layer_order`."""
    noisiest = set(noisiest_layers(frame, top_k))
    return [name for name in layer_order(frame) if name in noisiest]


class Coverage(NamedTuple):
    """How many parameters a quantity's network row covers, over the frame's steps."""

    fewest: int
    most: int
    total: int


def network_coverage(frame: "pandas.DataFrame", quantity: str) -> Optional[Coverage]:
    """What ``quantity``'s network row covers, ``None`` when it covers every parameter.

    Quantities store under ``"all"`` how many of the parameters they were
    given the network's numbers cover (``params_covered`` of ``params_total``):
    fewer when some had no gradient or no BackPACK result. Logs written before
    these statistics existed do not say: their network row covers every
    parameter.
    """
    rows = finite_rows(frame[(frame.quantity == quantity) & (frame.param == NETWORK)])
    covered = rows[rows.statistic == PARAMS_COVERED].value
    total = rows[rows.statistic == PARAMS_TOTAL].value
    if covered.empty or total.empty or covered.min() >= total.max():
        return None
    return Coverage(int(covered.min()), int(covered.max()), int(total.max()))


def coverage_note(coverage: Optional[Coverage]) -> str:
    """``"all: 7 of 15 parameters"`` (``"all: 7 to 15 of 15 ..."`` when it varies), or ``""``."""
    if coverage is None:
        return ""
    fewest, most, total = coverage
    counted = f"{fewest}" if fewest == most else f"{fewest} to {most}"
    return f"{NETWORK}: {counted} of {total} parameters"
