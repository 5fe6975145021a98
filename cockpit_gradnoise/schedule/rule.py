"""The adaptive batch schedule's rule: pure functions of numbers (no torch, no tracker).

Each optimizer step runs ``K`` micro-batches of ``micro_batch`` examples: the
batch is ``B = micro_batch * K``. After each new noise-scale estimate the
rule decides ``K`` of the next step from the recommendation of
:func:`~cockpit_gradnoise.views.batch_size.recommended_batch` (the critical
batch estimate ``B_crit ~ B_noise``, McCandlish et al. 2018, and the range of
the estimate):

- **grow** where ``B`` lies below the **target band** (:func:`target_band`:
  the range of the estimate, the recent quartiles of ``b_simple`` widened to
  at least ``[B_noise/2, 2 B_noise]``, times ``multiple * factor``; at
  ``multiple = 1``, ``[min(B_noise, 2 q25), max(4 B_noise, 2 q75)]``) and the
  estimate is **resolved** (the range's upper end finite, below): to the
  band's **near end** ``low``, never past it, by at most ``max_change`` per
  change;
- **unresolved**: no growth where the range's upper end is infinite (an
  infinite ``B_noise``, or a quarter or more of the recent steps with no
  signal resolved): the batch is kept;
- **shrink** only where the whole band lies below ``B``: to its near end
  ``high``, never below it, and by at most ``max_change``;
- **hold** where the batch lies outside the band but the next whole
  micro-batch toward it would pass its near end;
- **keep** otherwise, without an estimate (NaN), within ``patience``
  estimates of the last change (or of the start: the range needs them), and
  where a bound stops the move.

Why the band is the range times ``multiple * factor`` (the rule ``target``,
after ``resolved``, which moved to the near end of the range itself: the
same as ``multiple = 1 / factor`` here). On McCandlish et al. 2018's model
(eq. 2.11) a fixed batch ``B = k B_noise`` takes ``S / S_min - 1 = 1 / k``
and ``E / E_min - 1 = k``: the product is 1 for every ``k``, which sets only
the trade. A batch tracking a changing estimate, ``B(t) = k B_noise(t)``,
makes that trade at each step, ``S = (1 + 1/k) S_min*`` and ``E = (1 + k)
E_min*`` with ``E_min* = int B_noise dS_min``, below the fixed-batch fit's
``E_min`` where ``B_noise`` varies: that is what can take it below the fitted
hyperbola, and ``k`` where along it. The schedule states ``k = multiple``,
default 1, the critical batch the advice recommends: ``(S / S_min)(E /
E_min) = 2 + k + 1/k`` is least there, and ``d ln S / d ln E = -1 / k = -1``.
The band's near end is where a rising estimate is followed, so the rule
before, at the range's lower end ``B_noise / factor``, had ``k = 1/2`` (less
between changes): the examples-saving side, where the experiment's adaptive
runs took more steps than the batch-size warmup with fewer examples (digits
per-example 230.1 steps and 2,939 examples against 173.8 and 5,080, GPT norms
135.7 and 2,225 against 118.2 and 2,518; ``docs/experiments/adaptive-batch.md``).
Scaling the band, not narrowing it, keeps the hysteresis below: a change is
reversed only once the estimate has moved by the band's width. The price: a
batch may sit at up to ``multiple * factor**2 * B_noise`` before a falling
estimate shrinks it; and a larger ``k`` is no lower frontier value by itself
(with ``r = E_min* / E_min``, ``S_min* = S_min``: ``(1/k)((1 + k) r - 1)``,
``3r - 2`` at ``k = 1/2``, ``2r - 1`` at ``k = 1``): it moves the run along
the frontier toward fewer steps.

Why the near end, not ``round(B_noise)`` (the rule until ``near-end``): a
move to the centre of the range is reversed as soon as the estimate moves by
the range's half-width (``factor = 2``: a batch grown to ``B_noise`` shrinks
once ``B_noise`` halves), and on the digits CNN of
``docs/experiments/adaptive-batch.md`` the estimate moves by 10x within a
run: the schedule grew to 64-128 early, shrank to 8-16 as ``B_noise`` fell,
and grew again, 9-10 shrinks per arm over 3 seeds, each spending examples on
growth it then undid. Moving only to the near end is hysteresis of the
range's full width (the estimate's own noise, what the advice reports as its
uncertainty): after a grow to ``B' <= low`` a shrink needs the whole new
range below ``B'``, i.e. the estimate to fall by the range's width (at least
``factor**2 = 4``) below where it was, not by ``factor``; the same for a
shrink followed by a grow. At an unchanged estimate no change is ever
reversed. Moves in one direction are not delayed: the batch follows a rising
estimate at the range's lower end (``min(B_noise / factor, q25)``), which
is where a batch-size warmup sits (Merrill et al. 2025, "Critical
Batch Size Revisited", arXiv:2505.23971: the batch doubles once the critical
batch has passed it, and never shrinks). A fixed batch anywhere in the range
lies on the same steps-examples frontier (McCandlish et al. 2018, eq. 2.11);
what an adaptive batch gains is following the estimate as it drifts, and
what it loses is examples spent on moves it undoes. What the rule did on the
experiment's two tasks: ``docs/experiments/adaptive-batch.md``.

Why no growth on an unresolved estimate (the rule ``resolved``, after
``near-end``). ``b_simple = tr(Sigma) / |G|^2`` of one step is ``+inf``
exactly where that step's unbiased estimate ``g_t`` of ``|G|^2`` is ``<= 0``,
and the range's upper end is ``max(factor B_noise, q75)`` of the last
``recent`` steps: it is finite only where ``B_noise`` is and fewer than a
quarter of those steps are unresolved (at ``recent = 10``, at most 2). With
``g_t`` approximately normal, mean ``|G|^2`` and standard deviation ``s``,
a step is unresolved with probability ``Phi(-|G|^2 / s)``; below a quarter
means ``|G|^2 / s > z_0.75 = 0.674``, so the mean of ``g_t`` over the
window of ``n = 10`` has a relative standard error below ``1 / (0.674
sqrt(10)) = 0.47``, and one standard error moves ``B_noise`` by a factor
within ``[1/1.47, 1/0.53] = [0.68, 1.9]``: inside the band ``factor = 2``
within which the rule calls a batch close. Past that bound the ratio is
ruled by its denominator's noise: heavy-tailed, with no moments (the delta
method fails), and a moving average of ``g_t`` that is positive by chance
gives any value. A grow is a move toward the range's lower end, and that end
carries no information when the upper one is unbounded: the data are then
consistent with ``|G|^2 = 0``, and with a critical batch at any value above
the batch. What it cost, in the experiment's run under ``near-end``: on the
digits CNN (SGD, ``B_crit`` 19.7 fitted), in the two main arms' 6 runs, 22
of the 23 grows before step 50 (24 of all 28) rested on an infinite upper
end (``B_noise`` infinite, or 35 to 4,618 with it), the batch reached 32 to
136, and 19 shrinks then undid them: the examples of those batches were
spent at ``E / E_min - 1 = B / B_noise`` (McCandlish et al. 2018, eq. 2.11)
on steps the run did not keep. Keeping the batch instead costs at most the
steps of the fixed batch it stays at, a point on the same frontier. A
shrink needs the whole range below the batch, hence a resolved estimate;
nothing changes for it. The price: a grow waits until the estimate is
resolved at the current batch. For Gaussian gradient noise the batch
gradient's ``|g_B|^2`` has variance ``4 G^T Sigma G / B + 2 tr(Sigma^2) /
B^2``: ``s`` falls with the batch, and a batch far below ``B_noise`` is the
last to resolve it.

Why McCandlish et al.'s learning-rate rule under Adam too, not the square-root
rule (:func:`in_run_rule`; the rule ``adam-lr``, after ``target``). Malladi et
al. 2022's ``sqrt(B/B0)`` compares runs each at its own fixed batch, in which
Adam's second moment ``v`` has settled to that batch's gradient noise: where
the noise dominates, ``v ~ 1/B``, ``P = 1/(sqrt(v_hat) + eps) ~ sqrt(B)``, and
``sqrt(B)`` of the linear scaling is already in ``P``. Within a run ``v_hat``
averages ``g_B**2`` over the last ``min(t, 1/(1 - beta2))`` steps (1,000 at
``beta2 = 0.999``; with the bias correction, evenly over the first ones): after
a change of batch ``P`` is still the earlier batches' for as many steps again,
and the step ``-eps P g_B`` is SGD with a fixed preconditioner. McCandlish et
al. 2018's eq. 2.6-2.7 for it: ``E[L(theta - eps P g_B)] ~ L - eps G^T P G +
eps**2 / 2 (G^T P H P G + tr(P H P Sigma) / B)``, least at ``eps_opt(B) =
eps_max / (1 + B_noise / B)`` with ``B_noise = tr(P H P Sigma) / (G^T P H P
G)``, under their ``H ~ I`` the preconditioned ``B_simple = tr(P Sigma P) /
|P G|**2`` that ``PreconditionedNoiseScale`` measures: the SGD rule, on the
noise scale the schedule reads. On the experiment's GPT (Adam) the
square-root rule held the learning rate below the grid's best at the batches
the schedule passed (x1.41 at batch 16, x2.83 at 64, against the grid's x2
and x4 from batch 8: ``docs/experiments/critical-batch-size.md``); on six
tuning seeds (100-105, none of those reported) the rule lowered every
``adaptive-norms`` run's frontier value (mean 1.38 -> 1.16) and five of six
``adaptive-per-example`` runs' (``docs/experiments/adaptive-batch.md``). The
bound is SGD's: ``sqrt(B/B0)`` unless ``max_lr_factor`` is given (``eps_max``
needs ``H``, not measured here). With ``a = B_noise/B0 > b = B_noise/B``,
``f**2 - B/B0 = (a - b)(a b - 1) / (b (1 + b)**2)``: the rule's ``f`` is at
least ``sqrt(B/B0)`` wherever ``B_noise**2 >= B0 B``, so a batch grown toward
``B_noise`` (never past it) gets the square-root rule's rate by default, as
before: the rule changes the rate where ``max_lr_factor`` is given (as in the
experiment), or where ``B_noise**2 < B0 B`` (less than the square-root rule).

``K`` stays within ``[min_accumulation, max_accumulation]``
(:func:`bounds_of`: from ``min_batch``, ``max_batch`` and the most
micro-batches). The learning rate at batch ``B`` is the start's times
:func:`learning_rate_from_start`: the rule's factor
(:func:`~cockpit_gradnoise.views.batch_size.learning_rate_factor`) from the
start batch ``B0`` to ``B`` at the current estimate, never a product over
changes, and never above a stated bound.
"""

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from cockpit_gradnoise.views.batch_size import (
    DEFAULT_RECENT,
    SGD_RULE,
    SQRT_RULE,
    Recommendation,
    learning_rate_factor,
    noise_range,
    recommended_batch,
)
from cockpit_gradnoise.views.common import THRESHOLDS

#: The most the batch changes by at one change (doubling, as batch-size warmups do).
DEFAULT_MAX_CHANGE = 2.0
#: The batch as a multiple of ``B_noise`` that the rule follows a rising estimate at: the
#: critical batch, where ``(S / S_min)(E / E_min)`` is least (the module's docstring).
DEFAULT_MULTIPLE = 1.0
#: New estimates needed after a change (and at the start) before the next one: the
#: memory of ``b_simple_smoothed``'s moving average, and the range's window.
DEFAULT_PATIENCE = DEFAULT_RECENT

# Why a decision was taken (the ``why:<reason>`` of a logged change).
GROW, SHRINK, KEEP, HOLD, WAIT, NO_ESTIMATE, AT_BOUND, BOOTSTRAP, UNRESOLVED = (
    "grow", "shrink", "keep", "hold", "wait", "no-estimate", "at-bound", "bootstrap", "unresolved")
#: Why a decision did not change the batch (``Decision.why``).
NON_CHANGES = (KEEP, HOLD, WAIT, NO_ESTIMATE, AT_BOUND, UNRESOLVED)
# Why the learning-rate factor is what it is (the ``lr_why`` of a change).
LR_RULE, LR_BOUND, LR_KEPT, LR_NONE = "rule", "bound", "kept", "none"


@dataclass(frozen=True)
class Bounds:
    """The micro-batch's size and the accumulation's range ``[low, high]`` (micro-batches)."""

    micro_batch: int
    low: int
    high: int

    def clamp(self, accumulation: int) -> int:
        return min(self.high, max(self.low, accumulation))


def bounds_of(micro_batch: int, min_batch: Optional[int] = None, max_batch: Optional[int] = None,
              max_accumulation: Optional[int] = None) -> Bounds:
    """The accumulation's :class:`Bounds`: ``K`` with ``min_batch <= micro_batch * K <=
    max_batch`` and ``K <= max_accumulation`` (``None``: no bound but 1 micro-batch).

    Raises:
        ValueError: Naming the fix, for a size that is not a positive int, or bounds no
            accumulation meets.
    """
    for name, value in (("micro_batch", micro_batch), ("min_batch", min_batch),
                        ("max_batch", max_batch), ("max_accumulation", max_accumulation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    low = 1 if min_batch is None else -(-min_batch // micro_batch)  # ceil
    high = math.inf if max_batch is None else max_batch // micro_batch
    if max_accumulation is not None:
        high = min(high, max_accumulation)
    if high == math.inf:
        raise ValueError("give max_batch or max_accumulation: the schedule's batch needs a bound")
    if high < low:
        raise ValueError(
            f"no accumulation of micro-batches of {micro_batch} lies within min_batch={min_batch}, "
            f"max_batch={max_batch} and max_accumulation={max_accumulation}: widen the bounds")
    return Bounds(micro_batch, low, int(high))


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` found: the accumulation of the next step and why.

    ``why`` is one of ``grow``, ``shrink`` (a change), ``keep``, ``hold``,
    ``wait``, ``no-estimate``, ``at-bound``, ``unresolved`` (none:
    :data:`NON_CHANGES`); ``recommendation`` the
    :class:`~cockpit_gradnoise.views.batch_size.Recommendation` it rests on
    (``None`` without an estimate).
    """

    accumulation: int
    why: str
    recommendation: Optional[Recommendation] = None

    @property
    def changes(self) -> bool:
        return self.why in (GROW, SHRINK)


def decide(accumulation: int, bounds: Bounds, noise_scale: float, recent: Sequence[float] = (),
           *, since_change: int = DEFAULT_PATIENCE, patience: int = DEFAULT_PATIENCE,
           max_change: float = DEFAULT_MAX_CHANGE, multiple: float = DEFAULT_MULTIPLE,
           factor: float = THRESHOLDS.noise_scale_factor) -> Decision:
    """The accumulation of the next step (the rule of this module's docstring).

    Args:
        accumulation: ``K`` of the step just taken (batch ``micro_batch * K``).
        bounds: The accumulation's bounds (:func:`bounds_of`).
        noise_scale: ``B_noise``, e.g. the newest ``b_simple_smoothed`` (NaN: none).
        recent: The last tracked ``b_simple`` values (the range of the estimate).
        since_change: New estimates since the last change (or the start).
        patience: Estimates needed after a change before the next.
        max_change: The most the batch changes by at one change (> 1).
        multiple: ``k``: the batch follows a rising estimate at ``k B_noise``
            (:func:`target_band`; ``1/factor``: the rule before ``target``).
        factor: ``recommended_batch``'s band around ``B_noise``.
    """
    if not max_change > 1:
        raise ValueError(f"max_change must be > 1 (a factor of the batch), got {max_change!r}")
    check_multiple(multiple)
    batch = bounds.micro_batch * accumulation
    if math.isnan(noise_scale):
        return Decision(accumulation, NO_ESTIMATE)
    found = target_band(noise_scale, recent, batch, multiple, factor)
    if found.move not in (GROW, SHRINK):
        return Decision(accumulation, KEEP, found)
    if found.move == GROW and math.isinf(found.high):  # no upper end: the estimate bounds nothing
        return Decision(accumulation, UNRESOLVED, found)
    if since_change < patience:
        return Decision(accumulation, WAIT, found)
    micro = bounds.micro_batch
    if found.move == GROW:  # to the range's near end (low), never past it
        candidate = math.floor(min(batch * max_change, found.low) / micro)
        too_close = candidate <= accumulation
    else:  # to the near end (high), never below it
        candidate = max(1, math.ceil(max(batch / max_change, found.high) / micro))
        too_close = candidate >= accumulation
    if too_close:  # the next whole micro-batch would pass the near end
        return Decision(accumulation, HOLD, found)
    new = bounds.clamp(candidate)
    if new == accumulation:
        return Decision(accumulation, AT_BOUND, found)
    return Decision(new, found.move, found)


def check_multiple(multiple: float) -> None:
    """Raises ValueError, naming the fix, unless ``multiple`` is a finite number > 0."""
    if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not (
            0 < multiple < math.inf):
        raise ValueError(f"multiple must be a finite number > 0 (the batch as a multiple of "
                         f"B_noise; 1: the critical batch), got {multiple!r}")


def target_band(noise_scale: float, recent: Sequence[float], batch: float,
                multiple: float = DEFAULT_MULTIPLE,
                factor: float = THRESHOLDS.noise_scale_factor) -> Recommendation:
    """The band the batch is kept in: the estimate's range scaled by ``multiple * factor``.

    :func:`~cockpit_gradnoise.views.batch_size.recommended_batch` of
    ``c B_noise`` and ``c b_simple`` (``c = multiple * factor``): its ``low``
    and ``high`` are ``c`` times the estimate's range, ``[min(k B_noise, c q25),
    max(k factor**2 B_noise, c q75)]`` with ``k = multiple``, and its ``move``
    is the batch's place against them; ``noise_scale`` (and ``spread``, the
    quartiles of ``recent``) are the estimate's own
    (``max(B_noise, 0)``; the learning-rate rule and the log read it) and
    ``batch`` the target ``round(k B_noise)`` (at least 1). A rising estimate
    is followed at the band's lower end, ``k B_noise`` (or ``c q25`` below it).
    """
    scale = multiple * factor
    found = recommended_batch(noise_scale * scale, [value * scale for value in recent], batch,
                              factor)
    estimate = max(float(noise_scale), 0.0)
    return replace(found, noise_scale=estimate, spread=noise_range(recent),
                   batch=None if found.batch is None else max(1, round(multiple * estimate)))


def in_run_rule(rule: Optional[str]) -> Optional[str]:
    """The learning-rate rule the schedule applies within a run for an optimizer whose
    advice rule (:func:`~cockpit_gradnoise.views.batch_size.rule_for`) is ``rule``.

    ``"sqrt"`` (Adam and its kin) -> ``"sgd"``: McCandlish et al. 2018's
    ``eps_opt(B) = eps_max / (1 + B_noise / B)`` (eq. 2.6-2.7) on the
    preconditioned step ``-eps P g_B``, whose ``P`` a change of batch leaves as
    it was for about as many steps as the run has taken (the module's docstring,
    "Why McCandlish et al.'s learning-rate rule under Adam too"). Others unchanged.
    """
    return SGD_RULE if rule == SQRT_RULE else rule


@dataclass(frozen=True)
class LearningRate:
    """What :func:`learning_rate_from_start` found: the factor ``lr(B) / lr(B0)`` and why.

    ``why``: ``rule`` (the rule's factor), ``bound`` (the bound stopped it; ``rule_factor``
    is what the rule gave, ``bound`` the bound), ``kept`` (no finite estimate for a rule
    that needs one: the current factor), ``none`` (no rule: 1).
    """

    factor: float
    why: str
    rule_factor: float = math.nan
    bound: float = math.nan


def learning_rate_from_start(rule: Optional[str], start_batch: float, batch: float,
                             noise_scale: float, current: float = 1.0,
                             max_lr_factor: Optional[float] = None) -> LearningRate:
    """The learning rate's factor at ``batch`` against the one tuned at ``start_batch``.

    Path-independent: ``lr(B) = lr(B0) * min(f(B0 -> B), bound)`` with ``f`` the
    rule's :func:`~cockpit_gradnoise.views.batch_size.learning_rate_factor` at the
    current ``noise_scale``, whatever batches came between (a product of factors
    over changes, each with its own estimate, compounds their errors).

    - ``"sgd"`` (McCandlish et al. 2018, ``eps_opt(B) = eps_max / (1 + B_noise/B)``):
      ``f = (1 + B_noise/B0) / (1 + B_noise/B)``, which grows linearly in ``B`` while
      ``B << B_noise``, up to ``B/B0``. Its bound, unless ``max_lr_factor`` is given,
      is the square-root rule's ``sqrt(B/B0)``: ``eps_max = |G|^2 / (G^T H G)`` needs
      the Hessian, which this package does not measure, so nothing shows that
      ``eps(B0) * f`` stays below ``eps_max``. Without a finite ``B_noise`` (``inf``:
      no signal resolved; NaN) the factor is ``current``, kept.
    - ``"sqrt"`` (Malladi et al. 2022): ``f = sqrt(B/B0)``; ``noise_scale`` unused.
    - ``None``: 1.

    Args:
        rule: ``"sgd"``, ``"sqrt"`` or ``None``.
        start_batch: ``B0``, the batch the learning rate was tuned for.
        batch: ``B``, the new batch.
        noise_scale: ``B_noise`` now.
        current: The factor now (kept without an estimate).
        max_lr_factor: The most ``lr(B) / lr(B0)`` may be (``None``: see above).
    """
    if rule is None:
        return LearningRate(1.0, LR_NONE)
    if rule == SGD_RULE and not math.isfinite(noise_scale):
        return LearningRate(current, LR_KEPT)
    rule_factor = learning_rate_factor(rule, start_batch, batch, noise_scale)
    if max_lr_factor is not None:
        bound = float(max_lr_factor)
    elif rule == SQRT_RULE:
        bound = math.inf
    else:
        bound = learning_rate_factor(SQRT_RULE, start_batch, batch)
    if rule_factor > bound:
        return LearningRate(bound, LR_BOUND, rule_factor, bound)
    return LearningRate(rule_factor, LR_RULE, rule_factor, bound)
