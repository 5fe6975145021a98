"""The batch size a noise scale recommends, the trade-off of moving there, the learning rate.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training": with ``B_noise`` the gradient noise scale, training to a given
loss takes ``S = S_min (1 + B_noise / B)`` steps and ``E = E_min (1 + B /
B_noise)`` examples at batch ``B`` (Eq. 2.11, 2.12); the critical batch
``B_crit ~ B_noise`` is where both are twice their minimum. Pure functions
of numbers (no frame, no torch, no pandas): the report's advice
(:mod:`cockpit_gradnoise.views.advice`) says them in words, and a batch-size
schedule can call them each step.
"""

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from cockpit_gradnoise.views.common import THRESHOLDS

import numpy

#: How many of the last tracked ``b_simple`` values give the estimate's range: the
#: memory of ``b_simple_smoothed``'s default moving average (weight 0.9 on the past).
DEFAULT_RECENT = 10

#: The learning-rate rules: McCandlish et al.'s for SGD, the square-root rule for Adam.
SGD_RULE = "sgd"
SQRT_RULE = "sqrt"
#: Optimizer class -> rule. Malladi et al. 2022 derive the square-root rule for
#: RMSprop and Adam; AdamW, Adamax, NAdam and RAdam share Adam's SDE. Other classes
#: (Adagrad, LBFGS, ...) get no learning rate: no rule is stated for them.
RULES = {"SGD": SGD_RULE, **{name: SQRT_RULE for name in (
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "FusedAdam")}}
#: The optimizers whose step is ``P g`` with ``P`` from the gradients' second moments:
#: their noise is that of the preconditioned gradient (``PreconditionedNoiseScale``).
ADAPTIVE = frozenset(name for name, rule in RULES.items() if rule == SQRT_RULE) | {"Adagrad"}


# The formulas ---------------------------------------------------------------------


def _checked(noise_scale: float, batch: float, new_batch: float) -> None:
    if not (batch > 0 and new_batch > 0):
        raise ValueError(f"batch sizes must be positive, got {batch!r} and {new_batch!r}")
    if noise_scale < 0:
        raise ValueError(f"the noise scale must be >= 0 (clip an estimate below 0), got {noise_scale!r}")


def steps_and_examples_change(noise_scale: float, batch: float, new_batch: float
                              ) -> Tuple[float, float]:
    """``(S1 / S0, E1 / E0)``: how the steps and examples to a given loss change from
    ``batch`` (``B0``) to ``new_batch`` (``B1``).

    McCandlish et al. 2018, Eq. 2.11-2.12: ``S/S_min - 1 = B_noise/B`` and
    ``E/E_min - 1 = B/B_noise``, so

    .. math::

        \\frac{S_1}{S_0} = \\frac{1 + B_{noise}/B_1}{1 + B_{noise}/B_0}, \\qquad
        \\frac{E_1}{E_0} = \\frac{B_{noise} + B_1}{B_{noise} + B_0}
        = \\frac{S_1}{S_0}\\,\\frac{B_1}{B_0}.

    An infinite ``B_noise`` gives ``(B0/B1, 1)``, ``0`` gives ``(1, B1/B0)``, NaN
    gives NaN.

    Raises:
        ValueError: If a batch is not positive or ``noise_scale < 0``.
    """
    _checked(noise_scale, batch, new_batch)
    if math.isnan(noise_scale):
        return math.nan, math.nan
    examples = 1.0 if math.isinf(noise_scale) else (noise_scale + new_batch) / (noise_scale + batch)
    return examples * batch / new_batch, examples


def learning_rate_factor(rule: str, batch: float, new_batch: float, noise_scale: float = math.nan
                         ) -> float:
    """``lr1 / lr0`` from ``batch`` to ``new_batch`` under ``rule``.

    - :data:`SGD_RULE`: McCandlish et al. 2018, Eq. 2.6-2.7, the optimal step
      ``eps_opt(B) = eps_max / (1 + B_noise / B)``, so
      ``lr1 / lr0 = (1 + B_noise/B0) / (1 + B_noise/B1)``: ``S0 / S1`` of
      :func:`steps_and_examples_change`; ``B1/B0`` (linear scaling) for an
      infinite ``B_noise``, ``1`` for ``0``.
    - :data:`SQRT_RULE`: the square-root scaling rule of Malladi et al. 2022,
      "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"
      (NeurIPS), for Adam and RMSprop: ``lr1 / lr0 = sqrt(B1 / B0)`` (the rule
      also scales ``1 - beta1``, ``1 - beta2`` by ``B1/B0`` and ``eps`` by
      ``sqrt(B0/B1)``). ``noise_scale`` is not used.

    Raises:
        ValueError: If ``rule`` is neither, a batch is not positive or
            ``noise_scale < 0``.
    """
    if rule == SQRT_RULE:
        _checked(0.0, batch, new_batch)
        return math.sqrt(new_batch / batch)
    if rule != SGD_RULE:
        raise ValueError(f"unknown learning-rate rule {rule!r}: use {SGD_RULE!r} or {SQRT_RULE!r}")
    steps, _ = steps_and_examples_change(noise_scale, batch, new_batch)
    return 1.0 / steps


def learning_rate_for(lr: float, rule: str, batch: float, new_batch: float,
                      noise_scale: float = math.nan) -> float:
    """The learning rate for ``new_batch``: ``lr * learning_rate_factor(...)``, ``lr`` tuned for ``batch``."""
    return lr * learning_rate_factor(rule, batch, new_batch, noise_scale)


def rule_for(optimizer: Optional[str]) -> Optional[str]:
    """The learning-rate rule of an optimizer class name (:data:`RULES`); ``None``: none stated."""
    return RULES.get(optimizer) if optimizer else None


def _quantile(ordered: numpy.ndarray, q: float) -> float:
    """NumPy's linear quantile of ascending ``ordered``, with ``+inf`` where a neighbour is."""
    position = q * (len(ordered) - 1)
    below, above = math.floor(position), math.ceil(position)
    low, high = float(ordered[below]), float(ordered[above])
    if below == above or math.isinf(high):
        return low if below == above else math.inf
    return low + (high - low) * (position - below)


@dataclass(frozen=True)
class NoiseRange:
    """The spread of recent ``b_simple`` values: quartiles and median.

    Why quartiles: ``b_simple`` of one step is a ratio of two noisy unbiased
    estimates, skewed and heavy-tailed, and ``+inf`` where the estimated
    ``|G|^2 <= 0`` (no signal resolved). A standard deviation is dominated by
    one step and undefined with ``inf``; quartiles are robust and defined
    (``inf`` ranks above every number). Values below 0 (``tr(Sigma)``
    estimated below 0) count as 0; NaN values are left out and counted.
    """

    low: float
    median: float
    high: float
    #: Values used (finite or ``+inf``), of them ``+inf``, and NaN left out.
    used: int
    infinite: int
    left_out: int


def noise_range(values: Sequence[float]) -> NoiseRange:
    """The :class:`NoiseRange` (25%, 50%, 75% quantiles) of ``values``; NaN where none is usable."""
    values = numpy.asarray(values, dtype=float)
    usable = numpy.sort(numpy.maximum(values[~numpy.isnan(values)], 0.0))
    if len(usable) == 0:
        return NoiseRange(math.nan, math.nan, math.nan, 0, 0, len(values))
    low, median, high = (_quantile(usable, q) for q in (0.25, 0.5, 0.75))
    return NoiseRange(low, median, high, len(usable), int(numpy.isinf(usable).sum()),
                      len(values) - len(usable))


@dataclass(frozen=True)
class Recommendation:
    """The batch a noise scale recommends, and whether to move there from the batch used.

    ``move``: ``"keep"`` where the batch used lies within the range of the
    estimate (:attr:`low` to :attr:`high`), ``"grow"`` below it, ``"shrink"``
    above it, ``"unknown"`` without a batch or an estimate. An infinite
    ``noise_scale`` recommends ``"grow"`` without a batch (``batch`` None).
    """

    noise_scale: float
    batch: Optional[int]
    spread: NoiseRange
    move: str
    #: The range of the estimate: the quartiles of recent ``b_simple`` widened to
    #: ``[B_noise / factor, B_noise * factor]`` (:func:`recommended_batch`).
    low: float = math.nan
    high: float = math.nan


def recommended_batch(noise_scale: float, recent: Sequence[float] = (), batch: Optional[float] = None,
                      factor: float = THRESHOLDS.noise_scale_factor) -> Recommendation:
    """The critical batch estimate ``round(B_noise)`` (at least 1), its range, the move.

    The batch moves only where the measurement resolves a difference: outside
    both the quartiles of the recent ``b_simple`` values (:func:`noise_range`)
    and ``[B_noise / factor, B_noise * factor]``. Within that factor the run
    is near the knee of the steps-examples trade-off, and the report's finding
    calls the batch "close to" the noise scale (``Thresholds.noise_scale_factor``);
    moving there trades steps for examples on the same frontier.

    Args:
        noise_scale: ``B_noise``, e.g. ``b_simple_smoothed`` of the network
            (below 0 counts as 0; ``+inf``: no gradient signal resolved).
        recent: The last tracked ``b_simple`` values.
        batch: The batch used now.
        factor: The band around ``B_noise`` within which the batch is kept.
    """
    spread = noise_range(recent)
    noise_scale = math.nan if math.isnan(noise_scale) else max(float(noise_scale), 0.0)
    if math.isnan(noise_scale):
        return Recommendation(noise_scale, None, spread, "unknown")
    if math.isinf(noise_scale):
        return Recommendation(noise_scale, None, spread, "grow", math.inf, math.inf)
    chosen = max(1, round(noise_scale))
    low, high = noise_scale / factor, noise_scale * factor
    if spread.used:
        low, high = min(low, spread.low), max(high, spread.high)
    move = "unknown" if batch is None else "grow" if batch < low and chosen > batch else \
        "shrink" if batch > high and chosen < batch else "keep"
    return Recommendation(noise_scale, chosen, spread, move, low, high)
