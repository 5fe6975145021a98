"""What the views share: which layers, in what order, coverage, batch size, thresholds.

The report, the panels and the dashboard all read these, so that they list
layers in one order, agree on which are the noisiest, on what the network's
row covers and on the batch size a log recorded, and draw the bands the
report's findings use. Like them, this module reads only the tidy frame of
:func:`cockpit_gradnoise.to_frame`; it imports neither pandas (a frame brings
its own methods) nor matplotlib, so that the command line starts fast.

Frames of long runs have millions of rows: every selection here is one
vectorised comparison per column (:func:`select`), never a loop over rows.

Besides a pandas frame, the functions the panels and the dashboard call
here (all but the ranking's) take :class:`~cockpit_gradnoise.logs.table.Rows`: the same rows as NumPy
arrays, which the command line draws from without importing pandas (its
import was a tenth of ``plot``'s time).
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Tuple

from cockpit_gradnoise.logs.schema import (
    B_SIMPLE,
    B_SIMPLE_SMOOTHED,
    BATCH_SCHEDULE,
    BATCH_SIZE,
    GRADIENT_VARIANCE,
    MAX,
    MEAN,
    MEDIAN_LEVEL,
    NETWORK,
    NOISE_SCALE,
    NORM_RATIO,
    PARAM_GRAD_RATIO,
    PARAMS_COVERED,
    PARAMS_TOTAL,
    PRECONDITIONED_NOISE_SCALE,
    RANKINGS,
    SCHEDULE_HIGH,
    SCHEDULE_LOW,
    SCHEDULE_NOISE_SCALE,
    SNR_PREFIX,
    TWO_BATCH_NOISE_SCALE,
    UPDATE_RELATIVE,
    UPDATE_SIZE,
    median_name,
    quantile_level,
    quantile_levels,
    schedule_lr_reason,
    schedule_reason,
)
from cockpit_gradnoise.logs.table import Column, steps_of, values_of

import numpy

if TYPE_CHECKING:
    import pandas


@dataclass(frozen=True)
class Thresholds:
    """When a number in the report becomes a finding."""

    #: The batch is "below" the noise scale when B_noise / B is at least this,
    #: "above" it when B / B_noise is; in between it is "close to" it.
    noise_scale_factor: float = 2.0
    #: The usual relative update ``||theta(s+1) - theta(s)|| / ||theta(s)||`` per step.
    usual_relative_update: float = 1e-3
    #: Relative updates more than this factor above or below the usual one are findings.
    relative_update_factor: float = 10.0
    #: A layer whose median ``|grad_j| / sd_j`` is below this is dominated by noise.
    low_snr: float = 1.0
    #: A layer with at least this fraction of exactly-zero gradient elements is a finding.
    zero_grad_fraction: float = 0.5
    #: Largest / smallest ``||theta|| / ||grad||`` across layers from which a finding is made.
    norm_ratio_spread: float = 100.0
    #: Largest / median per-example gradient norm (network) from which a finding is made.
    outlier_norm_factor: float = 10.0
    #: The network has stopped learning when at least this fraction of its gradient
    #: elements is exactly zero (dead ReLUs: its output no longer depends on the input).
    stopped_zero_grad_fraction: float = 0.95
    #: A tracked step that moves the network by at least this fraction of its norm
    #: (200 times the usual ``1e-3``) is a learning rate too large.
    large_relative_update: float = 0.2
    #: A run that stopped with no large step was knocked out by noise when the median
    #: ``B_simple`` before the stop is at least this times the batch size: the noise
    #: of a step then outweighs its signal (``E||noise||^2 / |G|^2 = B_noise / B``).
    stopped_noise_factor: float = 1.0

    def relative_update_range(self) -> Tuple[float, float]:
        """The range of relative update sizes that raises no finding."""
        usual, factor = self.usual_relative_update, self.relative_update_factor
        return usual / factor, usual * factor


THRESHOLDS = Thresholds()


#: Layers drawn as lines by default; more become unreadable (the heatmap shows all).
DEFAULT_TOP_K = 6

def band_statistics(names) -> Optional[Tuple[str, str, str]]:
    """``(lowest, middle, highest)``: the quantiles a band is drawn of, of the logged ``names``.

    ``middle`` is the median where it was logged, else the quantile closest to
    it (:func:`median_note` says so); ``None`` without quantiles.
    """
    levels = {quantile_level(name): name for name in names if quantile_level(name) is not None}
    if not levels:
        return None
    ordered = sorted(levels)
    middle = min(ordered, key=lambda q: abs(q - MEDIAN_LEVEL))
    return levels[ordered[0]], levels[middle], levels[ordered[-1]]


def median_note(what: str, names) -> str:
    """``"median sd not logged (quantiles asked: 0.1, 0.9)"``, or ``""`` where the median of
    the logged statistic ``names`` is among them (:func:`~cockpit_gradnoise.logs.schema.median_name`)."""
    if median_name(names) is not None:
        return ""
    levels = quantile_levels(names)
    asked = f"quantiles asked: {', '.join(f'{q:g}' for q in levels)}" if levels else "no quantiles asked"
    return f"median {what} not logged ({asked})"


def equals(column: "pandas.Series", value) -> numpy.ndarray:
    """The boolean mask ``column == value`` of a text column, fast for every storage.

    A categorical column compares its integer codes; Python strings (``object``
    or pandas' ``"python"`` string storage) compare as a NumPy object array,
    about four times faster than pandas' own comparison; other storage (e.g.
    pyarrow) uses pandas'.
    """
    if isinstance(column, Column):
        if value not in column.categories:
            return numpy.zeros(len(column), dtype=bool)
        return column.codes == column.categories.index(value)
    categories = getattr(column.dtype, "categories", None)
    if categories is not None:
        if value not in categories:
            return numpy.zeros(len(column), dtype=bool)
        return column.cat.codes.to_numpy() == categories.get_loc(value)
    if column.dtype == object or getattr(column.dtype, "storage", None) == "python":
        return numpy.asarray(column.to_numpy() == value, dtype=bool)
    return (column == value).to_numpy(dtype=bool, na_value=False)


def select(frame: "pandas.DataFrame", quantity=None, param=None, statistic=None):
    """The rows of ``frame`` with the given quantity, parameter and statistic (``None``: any)."""
    mask = None
    for column, value in (("quantity", quantity), ("param", param), ("statistic", statistic)):
        if value is not None:
            found = equals(frame[column], value)
            mask = found if mask is None else mask & found
    # All rows (a panel's own quantity, split off before): the frame, not a copy of it.
    return frame if mask is None or mask.all() else frame[mask]


def finite_rows(frame: "pandas.DataFrame") -> "pandas.DataFrame":
    """The rows of ``frame`` with a finite value (a boolean mask even when empty)."""
    return frame[numpy.isfinite(values_of(frame))]


#: ``(quantity, statistic)``: ``+inf`` by definition where a denominator is 0 or
#: negative (:func:`cockpit_gradnoise.logs.schema.ratio_or_inf`) or where a ratio
#: overflows: a value of a healthy run, not a sign of divergence.
DEFINED_INFINITE = frozenset({
    *((quantity, statistic) for quantity in (NOISE_SCALE, TWO_BATCH_NOISE_SCALE, PRECONDITIONED_NOISE_SCALE)
      for statistic in (B_SIMPLE, B_SIMPLE_SMOOTHED)),
    # A batch schedule's change where B_noise is infinite, or the estimate's range unbounded.
    *((BATCH_SCHEDULE, statistic) for statistic in (SCHEDULE_NOISE_SCALE, SCHEDULE_LOW, SCHEDULE_HIGH)),
    (PARAM_GRAD_RATIO, NORM_RATIO), (PARAM_GRAD_RATIO, MEAN), (PARAM_GRAD_RATIO, MAX),
    (UPDATE_SIZE, UPDATE_RELATIVE),
})


def non_finite(frame: "pandas.DataFrame") -> numpy.ndarray:
    """Boolean mask of the rows whose value says the run went NaN or inf.

    Every NaN, ``-inf`` or ``+inf`` but the values a healthy run has:
    ``+inf`` in :data:`DEFINED_INFINITE`, and NaN in
    ``GradientVarianceQuantiles``' signal-to-noise statistics (``snr_*``),
    left undefined where no element of a layer has ``sd_j > 0``. A
    non-finite gradient makes every statistic of its layer and of the
    network NaN, so these exceptions never hide one.
    """
    values = values_of(frame)
    mask = ~numpy.isfinite(values)
    if not mask.any():
        return mask
    # Few rows unless the run diverged: the exceptions are read on these only.
    positions = numpy.flatnonzero(mask)
    inf = positions[values[positions] == math.inf]
    mask[inf[_defined_infinite(frame.iloc[inf])]] = False
    nan = positions[numpy.isnan(values[positions])]
    nan = nan[equals(frame.quantity.iloc[nan], GRADIENT_VARIANCE)]
    statistics = frame.statistic.iloc[nan]
    for name in statistics.unique():
        if str(name).startswith(SNR_PREFIX):
            mask[nan[equals(statistics, name)]] = False
    return mask


def _defined_infinite(rows: "pandas.DataFrame") -> numpy.ndarray:
    """Mask of the ``rows`` of a statistic in :data:`DEFINED_INFINITE`."""
    found = numpy.zeros(len(rows), dtype=bool)
    for quantity, statistic in DEFINED_INFINITE:
        found |= equals(rows.quantity, quantity) & equals(rows.statistic, statistic)
    return found


def tracked_steps(frame: "pandas.DataFrame") -> List[int]:
    """The frame's distinct steps, ascending (Python ints)."""
    return distinct(steps_of(frame).astype(numpy.int64, copy=False)).tolist()


def distinct(values: numpy.ndarray) -> numpy.ndarray:
    """``numpy.unique(values)``, in one pass where they already ascend.

    A frame's steps do: hashing the million steps of a long run's rows, as
    ``numpy.unique`` does, took a tenth of the dashboard's time.
    """
    values = numpy.asarray(values)
    if len(values) > 1 and (values[1:] >= values[:-1]).all():
        return values[numpy.r_[True, values[1:] != values[:-1]]]
    return numpy.unique(values)


class NonFinite(NamedTuple):
    """Where a run went NaN or inf (:func:`non_finite`), over its tracked steps."""

    #: The first tracked step with a non-finite value.
    first: int
    #: The parameters non-finite at ``first``: layers in model order, the network last.
    params: List[str]
    #: The quantities non-finite at ``first``.
    quantities: List[str]
    #: Every tracked step with a non-finite value, ascending.
    steps: List[int]
    #: Every tracked step, ascending.
    tracked: List[int]

    @property
    def since(self) -> Optional[int]:
        """The first step of the final stretch of non-finite steps, if the run ends in one."""
        if self.steps[-1] != self.tracked[-1]:
            return None
        bad = set(self.steps)
        finite = [step for step in self.tracked if step not in bad]
        return min(s for s in self.steps if not finite or s > finite[-1])

    @property
    def last_finite(self) -> Optional[int]:
        """The last tracked step without a non-finite value (``None``: there is none)."""
        bad = set(self.steps)
        return next((step for step in reversed(self.tracked) if step not in bad), None)


def non_finite_summary(frame: "pandas.DataFrame") -> Optional[NonFinite]:
    """The :class:`NonFinite` of ``frame``, ``None`` if it never went NaN or inf."""
    bad = frame[non_finite(frame)]
    if bad.empty:
        return None
    steps = tracked_steps(bad)
    first = bad[steps_of(bad) == steps[0]]
    params = set(first.param.unique())
    # In model order: that of the step's rows, finite or not.
    params = [name for name in layer_order(frame[steps_of(frame) == steps[0]])
              if name in params] + ([NETWORK] if NETWORK in params else [])
    return NonFinite(steps[0], params, unique_in_order(first.quantity), steps,
                     tracked_steps(frame))


def _comparable(column: "pandas.Series") -> numpy.ndarray:
    """``column``'s values as an array that compares fast: a categorical's codes."""
    if isinstance(column, Column):
        return column.codes
    return column.cat.codes.to_numpy() if hasattr(column, "cat") else column.to_numpy()


def run_heads(*columns: "pandas.Series") -> numpy.ndarray:
    """Positions of the rows where any of ``columns`` differs from the row before (and 0)."""
    changed = numpy.zeros(max(len(columns[0]) - 1, 0), dtype=bool)
    for column in columns:
        values = _comparable(column)
        changed |= values[1:] != values[:-1]
    return numpy.flatnonzero(numpy.r_[len(columns[0]) > 0, changed])


def unique_in_order(column: "pandas.Series") -> list:
    """The distinct values of ``column`` in the order they first appear.

    Only the first row of each run of equal values is hashed: in a tidy frame
    the parameter changes every few rows, so this is several times faster
    than ``column.unique()`` on the whole column.
    """
    return list(column.iloc[run_heads(column)].unique())


def layer_order(frame: "pandas.DataFrame") -> List[str]:
    """The frame's layers (not the network) in the order they first appear.

    Quantities store each step's parameters in model order (their
    ``param_names``), :func:`cockpit_gradnoise.write_log` keeps that order and
    :func:`cockpit_gradnoise.to_frame` sorts only by step and quantity, so
    this is model order. A log written by ``Cockpit.write`` sorts its keys:
    from it the order is by name.
    """
    return [name for name in unique_in_order(frame.param) if name != NETWORK]


class Ranking(NamedTuple):
    """Layers ranked noisiest first by one statistic, averaged over the tracked steps."""

    quantity: str
    statistic: str
    #: ``{layer: mean of the statistic over its tracked steps}``, noisiest first.
    scores: "pandas.Series"
    #: The same mean for the network, NaN if it has none.
    network: float
    #: How many tracked steps hold the statistic (finite or not).
    steps: int
    #: ``{layer or network: how many of them its value is finite at}``: its mean is over these.
    finite_steps: "pandas.Series"


def noise_ranking(frame: "pandas.DataFrame", until: Optional[int] = None) -> Optional[Ranking]:
    """The layers of ``frame`` ranked noisiest first; ``None`` without a statistic to rank by.

    ``until``: over the steps up to it only (default: every step).

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
    steps = frame.step.to_numpy()
    for quantity, statistic, lowest_first in RANKINGS:
        chosen = equals(frame.quantity, quantity) & equals(frame.statistic, statistic)
        if until is not None:
            chosen &= steps <= until
        # Two columns of the rows, not a copy of them: a long run has millions.
        params, values = frame.param[chosen], frame.value[chosen]
        if (~equals(params, NETWORK)).any():
            return ranking_of(quantity, statistic, *finite_means(values, params),
                              len(distinct(steps[chosen])))
    return None


def finite_means(values: "pandas.Series", keys) -> Tuple["pandas.Series", "pandas.Series"]:
    """``(means, counts)`` of ``values``' finite elements grouped by ``keys``, groups in
    order of appearance."""
    finite = numpy.isfinite(values.to_numpy(dtype=float))
    groups = values[finite].groupby(keys[finite], sort=False)
    return groups.mean(), groups.count()


def ranking_of(quantity: str, statistic: str, means: "pandas.Series", counts: "pandas.Series",
               steps: int) -> Ranking:
    """The :class:`Ranking` by ``statistic`` of ``quantity``, from each parameter's mean of
    its finite values (``means``, in the frame's order) and their ``counts``."""
    return Ranking(quantity, statistic,
                   ranked_scores(means, NETWORK, lowest_first(quantity, statistic)),
                   float(means.get(NETWORK, math.nan)), steps, counts)


def ranked_scores(means: "pandas.Series", network, lowest_first: bool) -> "pandas.Series":
    """:func:`noise_ranking`'s scores: ``means`` without the ``network`` key, sorted
    (``lowest_first`` or highest), stably, so ties keep the order of appearance (the
    layers' order)."""
    kept = means.drop(network, errors="ignore")
    return kept.iloc[stable_order(kept.to_numpy(dtype=float), lowest_first)]


def lowest_first(quantity: str, statistic: str) -> bool:
    """Whether the lowest of ``statistic`` is the noisiest (:data:`RANKINGS`)."""
    return next(low for q, s, low in RANKINGS if (q, s) == (quantity, statistic))


def stable_order(values: numpy.ndarray, ascending: bool) -> numpy.ndarray:
    """Positions of ``values`` in the order pandas' ``sort_values(kind="stable")`` gives:
    ties in their order (also descending), NaN last."""
    values = numpy.asarray(values, dtype=float)
    nan = numpy.isnan(values)
    kept = numpy.flatnonzero(~nan)
    order = kept[numpy.argsort(values[kept] if ascending else -values[kept], kind="stable")]
    return numpy.r_[order, numpy.flatnonzero(nan)].astype(numpy.int64)


def chosen_layers(ranked: List[str], order: List[str], k: int) -> List[str]:
    """:func:`default_layers` of a ranking: the first ``k`` of ``ranked`` (noisiest first),
    then of the unranked layers of ``order``, given in ``order``."""
    chosen = set(top_layers(ranked, order, k))
    return [name for name in order if name in chosen]


def top_layers(ranked: List[str], order: List[str], k: int) -> List[str]:
    """The first ``k`` of ``ranked`` and then of ``order``'s layers not in it."""
    scored = set(ranked)
    return (ranked + [name for name in order if name not in scored])[:k]


def noisiest_layers(frame: "pandas.DataFrame", k: int, order: Optional[List[str]] = None
                    ) -> List[str]:
    """The ``k`` noisiest layers by :func:`noise_ranking`, noisiest first.

    Layers without a score follow in :func:`layer_order` (``order``, if known).
    """
    ranking = noise_ranking(frame)
    ranked = [] if ranking is None else list(ranking.scores.index)
    return top_layers(ranked, layer_order(frame) if order is None else order, k)


def default_layers(frame: "pandas.DataFrame", top_k: int = DEFAULT_TOP_K,
                   order: Optional[List[str]] = None) -> List[str]:
    """The ``top_k`` noisiest layers (:func:`noisiest_layers`) in :func:`layer_order`.

    ``order``: the frame's :func:`layer_order`, if known (it reads every row).
    """
    order = layer_order(frame) if order is None else order
    ranking = noise_ranking(frame)
    return chosen_layers([] if ranking is None else list(ranking.scores.index), order, top_k)


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
    rows = finite_rows(select(frame, quantity, NETWORK))
    covered = select(rows, statistic=PARAMS_COVERED).value
    total = select(rows, statistic=PARAMS_TOTAL).value
    if len(covered) == 0 or len(total) == 0 or covered.min() >= total.max():
        return None
    return Coverage(int(covered.min()), int(covered.max()), int(total.max()))


def coverage_note(coverage: Optional[Coverage]) -> str:
    """``"all: 7 of 15 parameters"`` (``"all: 7 to 15 of 15 ..."`` when it varies), or ``""``."""
    if coverage is None:
        return ""
    fewest, most, total = coverage
    counted = f"{fewest}" if fewest == most else f"{fewest} to {most}"
    return f"{NETWORK}: {counted} of {total} parameters"


def recorded_batch_size(frame: "pandas.DataFrame") -> Optional[int]:
    """The batch size a quantity recorded as statistic ``batch_size`` (latest), else ``None``.

    :class:`~cockpit_gradnoise.GradientNoiseScale` records it; without that
    quantity, pass it (``batch_size=``, ``--batch-size``) to compare it with
    the gradient noise scale.
    """
    rows = finite_rows(select(frame, statistic=BATCH_SIZE))
    # The first row at the latest step (as ``idxmax``), by position.
    return None if rows.empty else int(values_of(rows)[numpy.argmax(steps_of(rows))])


def schedule_changes(frame: "pandas.DataFrame") -> List[dict]:
    """The changes of a batch schedule the log holds (``BatchSchedule`` rows of the
    network), by step: ``{"step": s, "why": reason, statistic: value, ...}``."""
    rows = select(frame, BATCH_SCHEDULE, param=NETWORK)
    steps, values = steps_of(rows), values_of(rows)
    codes, names = rows.statistic.factorize()
    changes = {}
    for step, code, value in zip(steps.tolist(), numpy.asarray(codes).tolist(), values.tolist()):
        changes.setdefault(step, {"step": step})[names[code]] = value
    for change in changes.values():
        change["why"] = schedule_reason(change)
        change["lr_why"] = schedule_lr_reason(change)
    return [changes[step] for step in sorted(changes)]
