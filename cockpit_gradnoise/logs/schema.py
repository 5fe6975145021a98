"""What stored data means: quantity, parameter and statistic names, and numbers.

Every quantity stores, per step, ``{param name: {statistic name: number}}``
(``UpdateSize`` a list of items that :func:`update_statistics` turns into the
same shape). The names below are the contract between the quantities that
write logs and the views (frame, report, panels, dashboard, command line) that
read them; views read names from here and never import the quantities.

Non-finite numbers are stored as the strings ``"nan"``, ``"inf"`` and
``"-inf"``: ``Cockpit.write`` (json_tricks with ``allow_nan=False``) raises on
a raw non-finite float.

This module imports neither torch nor Cockpit, so reading a log stays fast.
"""

import math
import re
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

NETWORK = "all"
"""Name under which every quantity reports the whole network."""

# Quantities: the keys Cockpit stores them under (their class names).
GRADIENT_VARIANCE = "GradientVarianceQuantiles"
PER_EXAMPLE_NORM = "PerExampleGradNorm"
PARAM_GRAD_RATIO = "ParamGradRatio"
UPDATE_SIZE = "UpdateSize"
NOISE_SCALE = "GradientNoiseScale"
#: The noise scale of the preconditioned gradients ``P g_i`` the optimizer's update sees
#: (Adam's ``P``; the ``"adaptive"`` preset), and of micro-batch norms (the ``"norms"``
#: preset): both store GradientNoiseScale's statistics under the same names.
PRECONDITIONED_NOISE_SCALE = "PreconditionedNoiseScale"
TWO_BATCH_NOISE_SCALE = "TwoBatchNoiseScale"
QUANTITIES = (GRADIENT_VARIANCE, PER_EXAMPLE_NORM, PARAM_GRAD_RATIO, UPDATE_SIZE, NOISE_SCALE)

# Statistics shared by several quantities.
MEAN = "mean"
MEDIAN = "median"
MIN = "min"
MAX = "max"
SNR_PREFIX = "snr_"

# GradientVarianceQuantiles: quantiles and mean of sd, SNR median and mean. SD_MEDIAN is
# logged only where 0.5 is among the quantiles asked for (:func:`median_name`); the SNR's
# median always.
SD_MEDIAN = "q0.5"
SNR_MEDIAN = SNR_PREFIX + "q0.5"
SNR_MEAN = SNR_PREFIX + MEAN

# ParamGradRatio.
RATIO_STATISTICS = (MEAN, MEDIAN, MIN, MAX)
ZERO_GRAD_FRACTION = "zero_grad_fraction"
NORM_RATIO = "norm_ratio"

# UpdateSize.
UPDATE_NORM = "norm"
UPDATE_RELATIVE = "relative"

# GradientNoiseScale.
GRAD_SQ = "grad_sq"
TRACE_COV = "trace_cov"
B_SIMPLE = "b_simple"
B_SIMPLE_SMOOTHED = "b_simple_smoothed"
BATCH_SIZE = "batch_size"

# A GradScaler's loss scale at each tracked step, and whether the scaler skipped
# the step (inf/NaN gradients: no rows of the quantities there), under NETWORK.
GRAD_SCALER = "GradScaler"
LOSS_SCALE = "scale"
SKIPPED = "skipped"

# The optimizer of each tracked step, recorded by the tracker under NETWORK: the
# learning rate of its first parameter group, and its class as a statistic named
# ``class:<name>`` of value 1 (a log holds numbers; names are text). Logs written
# before they existed have no such rows: the advice then gives no learning rate.
OPTIMIZER = "Optimizer"
LEARNING_RATE = "lr"
OPTIMIZER_CLASS_PREFIX = "class:"

# The changes of an adaptive batch schedule (cgn.BatchSchedule), under NETWORK at the
# step whose noise-scale estimate decided them (the new batch applies from the next
# step): the batch and accumulation before and after, the learning rate of the first
# parameter group before and after and the factor every group's was scaled by, the
# noise scale and the range of the estimate the decision rests on, and why, as a
# statistic ``why:<reason>`` of value 1 (names are text).
BATCH_SCHEDULE = "BatchSchedule"
SCHEDULE_BATCH = "batch"
SCHEDULE_NEW_BATCH = "new_batch"
SCHEDULE_ACCUMULATION = "accumulation"
SCHEDULE_NEW_ACCUMULATION = "new_accumulation"
SCHEDULE_NEW_LR = "new_lr"
SCHEDULE_LR_FACTOR = "lr_factor"
SCHEDULE_NOISE_SCALE = "noise_scale"
SCHEDULE_LOW = "low"
SCHEDULE_HIGH = "high"
SCHEDULE_WHY_PREFIX = "why:"
# The learning rate's factor from the start batch that the rule gave (before the bound),
# the bound, and ``lr_why:<bound|kept>`` (value 1) where the bound stopped the rule or no
# finite noise scale kept the learning rate.
SCHEDULE_LR_RULE_FACTOR = "lr_rule_factor"
SCHEDULE_LR_BOUND = "lr_bound"
SCHEDULE_LR_WHY_PREFIX = "lr_why:"

# Stored under NETWORK by a per-parameter quantity whose network row leaves
# out some of the parameters it was given (with requires_grad): how many it
# covers, of how many. Absent: the row covers every parameter.
PARAMS_COVERED = "params_covered"
PARAMS_TOTAL = "params_total"
COVERAGE_STATISTICS = (PARAMS_COVERED, PARAMS_TOTAL)

_QUANTILE_NAME = re.compile(r"^q(\d*\.?\d+(?:e-?\d+)?)$")


def quantile_name(level: float, prefix: str = "") -> str:
    """The statistic name of a quantile level: ``prefix + "q" + %g``, e.g. ``q0.05``."""
    return f"{prefix}q{float(level):g}"


def quantile_level(name: str, prefix: str = "") -> Optional[float]:
    """The level of a quantile statistic's name, ``None`` if ``name`` is not one."""
    if not name.startswith(prefix):
        return None
    match = _QUANTILE_NAME.match(name[len(prefix):])
    return float(match.group(1)) if match else None


def quantile_levels(names: Iterable[str], prefix: str = "") -> List[float]:
    """Sorted levels of the quantile statistics among ``names``."""
    levels = (quantile_level(name, prefix) for name in names)
    return sorted({level for level in levels if level is not None})


#: What ranks layers, noisiest first: (quantity, statistic, lowest first), the
#: first one present in the frame (the views' noise ranking uses it;
#: a streamed log sums them as it goes, :mod:`cockpit_gradnoise.logs.stream`).
RANKINGS = (
    (GRADIENT_VARIANCE, SNR_MEDIAN, True),
    (GRADIENT_VARIANCE, SD_MEDIAN, False),
    (PER_EXAMPLE_NORM, quantile_name(0.5), False),
)


#: The level of the median among a quantity's quantiles.
MEDIAN_LEVEL = 0.5


def median_name(names: Iterable[str], prefix: str = "") -> Optional[str]:
    """The name of the median (the quantile at :data:`MEDIAN_LEVEL`) among the logged
    statistic ``names``; ``None`` where it was not logged (other levels were asked for)."""
    return next((name for name in names if quantile_level(name, prefix) == MEDIAN_LEVEL), None)


def sd_statistic_names(levels: Iterable[float]) -> List[str]:
    """GradientVarianceQuantiles' statistics for quantile ``levels``."""
    return [quantile_name(q) for q in levels] + [MEAN, SNR_MEDIAN, SNR_MEAN]


def norm_statistic_names(levels: Iterable[float]) -> List[str]:
    """PerExampleGradNorm's statistics for quantile ``levels``."""
    return [quantile_name(q) for q in levels] + [MEAN, MAX]


def optimizer_statistics(class_name: str, lr: Optional[float]) -> Dict[str, float]:
    """The statistics of an :data:`OPTIMIZER` row: ``{"class:<class_name>": 1.0, "lr": lr}``
    (no ``lr`` where it is ``None``)."""
    statistics = {OPTIMIZER_CLASS_PREFIX + class_name: 1.0}
    if lr is not None:
        statistics[LEARNING_RATE] = float(lr)
    return statistics


def optimizer_class(names: Iterable[str]) -> Optional[str]:
    """The optimizer's class name among the statistic ``names`` of an :data:`OPTIMIZER` row
    (:func:`optimizer_statistics`); ``None`` if none names it."""
    return _text_after(OPTIMIZER_CLASS_PREFIX, names)


def _text_after(prefix: str, names: Iterable[str]) -> Optional[str]:
    """The text after ``prefix`` in the first of ``names`` that starts with it (a text
    stored as a statistic's name), ``None`` if none does."""
    return next((name[len(prefix):] for name in names if name.startswith(prefix)), None)


def schedule_reason(names: Iterable[str]) -> Optional[str]:
    """The reason among the statistic ``names`` of a :data:`BATCH_SCHEDULE` row
    (``why:<reason>``); ``None`` if none names it."""
    return _text_after(SCHEDULE_WHY_PREFIX, names)


def schedule_lr_reason(names: Iterable[str]) -> Optional[str]:
    """Why the learning rate was not the rule's (``lr_why:<bound|kept>``) among the
    statistic ``names`` of a :data:`BATCH_SCHEDULE` row; ``None``: the rule's."""
    return _text_after(SCHEDULE_LR_WHY_PREFIX, names)


def ratio_or_inf(numerator, denominator):
    """``numerator / denominator``, or ``+inf`` when ``denominator <= 0``.

    The ratios reported by :class:`~cockpit_gradnoise.ParamGradRatio`
    (``||theta|| / ||grad||``), :class:`~cockpit_gradnoise.UpdateSize`
    (``||update|| / ||theta||``) and :class:`~cockpit_gradnoise.GradientNoiseScale`
    (``trace_cov / grad_sq``) have a denominator that can be exactly 0 (a zero
    gradient, all-zero parameters) or, for an unbiased estimate, negative. They
    are reported as ``+inf`` then, also for ``0 / 0``: never a NaN from a zero
    denominator. NaN only if an input is NaN.

    Floats give a float. Tensors give the same elementwise and stay on their
    device (the quantities' values on a GPU); this module does not import
    torch, so it uses the torch that made the tensor.
    """
    if type(numerator) is float and type(denominator) is float:  # the common case, first
        return math.nan if numerator != numerator or denominator != denominator else (
            math.inf if denominator <= 0 else numerator / denominator)
    torch = sys.modules.get("torch")
    if torch is None or not any(isinstance(x, torch.Tensor) for x in (numerator, denominator)):
        if math.isnan(numerator) or math.isnan(denominator):
            return math.nan
        if denominator <= 0:
            return math.inf
        return numerator / denominator
    numerator, denominator = torch.as_tensor(numerator), torch.as_tensor(denominator)
    # Four ops (each a kernel launch on a GPU), NaN kept: a NaN denominator is not <= 0
    # and gives a NaN quotient; clamping to +inf keeps a NaN numerator NaN.
    return torch.where(denominator <= 0, numerator.clamp(min=math.inf), numerator / denominator)


_DECODE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode_float(value: float) -> Union[float, str]:
    """``value`` as a float, or ``"nan"``/``"inf"``/``"-inf"`` when not finite."""
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode_float(value: Union[float, int, str]) -> float:
    """Inverse of :func:`encode_float`.

    Raises:
        ValueError: If ``value`` is a string other than the three codes.
    """
    if isinstance(value, str):
        try:
            return _DECODE[value]
        except KeyError:
            raise ValueError(f"not an encoded number: {value!r}") from None
    return float(value)


def encode_statistics(statistics: Mapping[str, float]) -> Dict[str, Union[float, str]]:
    """Encode every value of ``{statistic: float}`` with :func:`encode_float`.

    The names are interned: every stored row shares one string per name
    (the quantities build them anew at each step, e.g. :func:`quantile_name`).
    A finite Python float, most values, is kept as it is without a call
    (:func:`encode_float` would return it: a few thousand values a step).
    """
    return {sys.intern(name): value if type(value) is float and value - value == 0.0 else encode_float(value)
            for name, value in statistics.items()}


def update_statistics(updates: Sequence[Any]) -> Dict[str, Dict[str, float]]:
    """``UpdateSize``'s stored items as ``{name: {"norm": ..., "relative": ...}}``.

    Each item has ``name``, ``norm = ||theta(s+1) - theta(s)||`` and
    ``start_norm = ||theta(s)||`` (a live ``LayerUpdate`` of
    :class:`~cockpit_gradnoise.UpdateSize` or a
    :class:`~cockpit_gradnoise.logs.frame.LoggedUpdate` read from a log).
    ``relative = norm / start_norm``, ``+inf`` when ``start_norm`` is 0
    (:func:`ratio_or_inf`). The network (``"all"``, last) has the root sums
    of squares of the parameters' norms.
    """
    network_norm = math.sqrt(sum(u.norm**2 for u in updates))
    network_start_norm = math.sqrt(sum(u.start_norm**2 for u in updates))
    rows = [(u.name, u.norm, u.start_norm) for u in updates]
    return {
        name: {UPDATE_NORM: norm, UPDATE_RELATIVE: ratio_or_inf(norm, start_norm)}
        for name, norm, start_norm in [*rows, (NETWORK, network_norm, network_start_norm)]
    }
