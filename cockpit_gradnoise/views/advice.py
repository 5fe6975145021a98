"""The advice of a log: what its noise scale says to do with the batch and the learning rate.

:func:`advice_of` reads the network's recent noise scales, the batch and the
logged optimizer from a tidy frame, and says in plain words, each sentence
with the numbers it rests on, what the formulas of
:mod:`cockpit_gradnoise.views.batch_size` give: the batch to use, the
trade-off of moving there (McCandlish et al. 2018) and the learning rate
under the optimizer's rule. It is the first block of the report and
``tracker.advice()``. Importing this module imports no pandas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

from cockpit_gradnoise.logs.schema import (
    B_SIMPLE,
    B_SIMPLE_SMOOTHED,
    BATCH_SIZE,
    LEARNING_RATE,
    NETWORK,
    NOISE_SCALE,
    OPTIMIZER,
    PRECONDITIONED_NOISE_SCALE,
    TWO_BATCH_NOISE_SCALE,
    encode_float,
    optimizer_class,
)
from cockpit_gradnoise.views.batch_size import (
    ADAPTIVE,
    DEFAULT_RECENT,
    SGD_RULE,
    Recommendation,
    learning_rate_for,
    noise_range,
    recommended_batch,
    rule_for,
    steps_and_examples_change,
)
from cockpit_gradnoise.views.common import THRESHOLDS, schedule_changes, select

import numpy

if TYPE_CHECKING:
    import pandas

#: The quantities a noise scale is read from, most faithful first (an adaptive
#: optimizer puts PreconditionedNoiseScale before these).
NOISE_SOURCES = (NOISE_SCALE, TWO_BATCH_NOISE_SCALE, PRECONDITIONED_NOISE_SCALE)
#: The network's statistics the advice reads over the recent steps.
READ = (B_SIMPLE, B_SIMPLE_SMOOTHED, BATCH_SIZE, LEARNING_RATE)

CAVEATS = (
    "caveats: B_noise (B_simple) ignores curvature, so the critical batch can differ from it "
    "(McCandlish et al. 2018, Sec. 2.2), and it grows as the loss falls: re-measure after a change"
)


@dataclass
class Advice:
    """What a log's noise scale advises: the numbers and the sentences that say them.

    ``print(advice)`` prints the report's ``advice:`` block. Numbers that do not
    apply are ``None`` (or NaN): ``source`` is the quantity the noise scale was
    read from, ``step`` its latest step, ``batch_size`` the batch used;
    ``new_batch`` the batch the trade-off and learning rate are of (the
    recommendation, or twice the batch for an infinite noise scale; ``None``:
    keep the batch); ``steps_change`` and ``examples_change`` are ``S1/S0`` and
    ``E1/E0`` (:func:`~cockpit_gradnoise.views.batch_size.steps_and_examples_change`);
    ``optimizer``, ``lr`` the logged optimizer and its learning rate, ``rule``
    the rule that applies to it and ``new_lr`` the learning rate for
    ``new_batch``; ``recent_steps`` the tracked steps the range is over.
    """

    sentences: List[str]
    source: Optional[str] = None
    step: Optional[int] = None
    batch_size: Optional[int] = None
    recommendation: Optional[Recommendation] = None
    new_batch: Optional[int] = None
    steps_change: float = math.nan
    examples_change: float = math.nan
    optimizer: Optional[str] = None
    lr: Optional[float] = None
    rule: Optional[str] = None
    new_lr: Optional[float] = None
    recent_steps: Tuple[int, ...] = field(default_factory=tuple)
    #: The changes of a batch schedule the log holds (``BatchSchedule`` rows), by step.
    schedule: List[dict] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(["advice:", *[f"- {line}" for line in self.sentences]]) + "\n"


NO_NOISE_SCALE = (
    "no noise scale logged, so no batch-size advice: track GradientNoiseScale (cgn.track's "
    "presets \"all\" and \"cheap\"), TwoBatchNoiseScale (preset \"norms\") or "
    "PreconditionedNoiseScale"
)


def _series(rows, quantity: str, statistic: str) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """``(steps, values)`` of ``statistic`` of ``quantity`` among ``rows``, by step."""
    chosen = select(rows, quantity, statistic=statistic)
    steps, values = chosen.step.to_numpy(), chosen.value.to_numpy(dtype=float)
    order = numpy.argsort(steps, kind="stable")
    return steps[order], values[order]


def _optimizer(rows) -> Tuple[Optional[str], Optional[float]]:
    """``(class name, lr)`` of the latest :data:`OPTIMIZER` row among ``rows``."""
    chosen = select(rows, OPTIMIZER)
    if chosen.empty:
        return None, None
    latest = chosen[chosen.step.to_numpy() == chosen.step.max()]
    names = [str(name) for name in latest.statistic]
    lr = latest.value.to_numpy(dtype=float)[[name == LEARNING_RATE for name in names]]
    return optimizer_class(names), (float(lr[-1]) if len(lr) and math.isfinite(lr[-1]) else None)


def _change(ratio: float, what: str) -> str:
    """``0.55, "steps"`` -> ``"45% fewer steps"``."""
    percent = round(100 * abs(ratio - 1))
    if percent == 0:
        return f"about the same {what}"
    return f"{percent}% {'fewer' if ratio < 1 else 'more'} {what}"


def advice_of(frame: pandas.DataFrame, *, batch_size: Optional[int] = None,
              until: Optional[int] = None, recent: int = DEFAULT_RECENT,
              stopped: bool = False, factor: float = THRESHOLDS.noise_scale_factor) -> Advice:
    """The :class:`Advice` of a tidy frame (:func:`cockpit_gradnoise.to_frame`) at step ``until``.

    The noise scale ``B_noise`` is the network's latest ``b_simple_smoothed``
    that is not NaN among the last ``recent`` tracked steps up to ``until``
    (the median of their ``b_simple`` if there is none), of the first of
    :data:`NOISE_SOURCES` the frame holds; of ``PreconditionedNoiseScale``
    first where the logged optimizer is adaptive (``batch_size.ADAPTIVE``).
    The formulas are those of :mod:`cockpit_gradnoise.views.batch_size`: the
    range of the estimate is ``noise_range`` of those ``b_simple`` values, the
    batch ``recommended_batch``'s, the learning rate ``learning_rate_for``'s
    under the optimizer's rule (``batch_size.RULES``).

    Args:
        frame: Tidy frame (only its rows of the network are read).
        batch_size: The batch used; default the one the noise scale recorded.
        until: The last step read (default: every step).
        recent: How many of the last tracked ``b_simple`` values give the range.
        stopped: The network has stopped learning (the report's run history):
            its noise scale says nothing about the batch.
        factor: ``recommended_batch``'s: the band around ``B_noise`` within
            which the batch is kept (the report passes its
            ``Thresholds.noise_scale_factor``).
    """
    if recent < 1:
        raise ValueError(f"recent must be at least 1 (tracked steps), got {recent!r}")
    rows = select(frame, param=NETWORK)
    if until is not None:
        rows = rows[rows.step.to_numpy() <= until]
    optimizer, lr = _optimizer(rows)
    adaptive = optimizer in ADAPTIVE
    sources = ((PRECONDITIONED_NOISE_SCALE,) if adaptive else ()) + NOISE_SOURCES
    # The first source with b_simple rows, and those rows (read once).
    source, (steps, values) = next(((q, found) for q in sources
                                    if len((found := _series(rows, q, B_SIMPLE))[0])), (None, (None, None)))
    if source is None:
        return Advice([NO_NOISE_SCALE], optimizer=optimizer, lr=lr, rule=rule_for(optimizer))
    if stopped:
        return Advice(["the network has stopped learning (see the findings): its noise scale says "
                       "nothing about the batch, so no advice"], source=source, optimizer=optimizer,
                      lr=lr, rule=rule_for(optimizer))
    steps, values = steps[-recent:], values[-recent:]
    smoothed_steps, smoothed = _series(rows, source, B_SIMPLE_SMOOTHED)
    kept = numpy.isin(smoothed_steps, steps) & ~numpy.isnan(smoothed)
    if kept.any():
        noise_scale, step, basis = float(smoothed[kept][-1]), int(smoothed_steps[kept][-1]), B_SIMPLE_SMOOTHED
    else:
        noise_scale, step, basis = noise_range(values).median, int(steps[-1]), f"median {B_SIMPLE}"
    if batch_size is None:
        _, batches = _series(rows, source, BATCH_SIZE)
        finite = numpy.isfinite(batches)
        batch_size = int(batches[finite][-1]) if finite.any() else None
    found = recommended_batch(noise_scale, values, batch_size, factor)
    advice = Advice([], source=source, step=step, batch_size=batch_size, recommendation=found,
                    optimizer=optimizer, lr=lr, rule=rule_for(optimizer),
                    recent_steps=tuple(int(s) for s in steps))
    if found.move in ("grow", "shrink") and batch_size:
        advice.new_batch = found.batch if found.batch is not None else 2 * batch_size
        advice.steps_change, advice.examples_change = steps_and_examples_change(
            found.noise_scale, batch_size, advice.new_batch)
        if advice.rule is not None and lr is not None:
            advice.new_lr = learning_rate_for(lr, advice.rule, batch_size, advice.new_batch,
                                              found.noise_scale)
    advice.schedule = schedule_changes(rows)
    advice.sentences = [_basis(advice, basis), _batch_sentence(advice, factor), *_move_sentences(advice),
                        *_adaptive_note(advice, adaptive), *_schedule_sentence(advice.schedule),
                        _caveats(advice, recent)]
    return advice


#: The latest changes of a batch schedule the advice spells out (the others are counted).
SCHEDULE_SHOWN = 3


def _schedule_sentence(changes: List[dict]) -> List[str]:
    """What a batch schedule (``cgn.BatchSchedule``) changed, the latest changes in full."""
    if not changes:
        return []
    shown = []
    for change in changes[-SCHEDULE_SHOWN:]:
        why, noise_scale = change["why"] or "?", change.get("noise_scale", math.nan)
        if why in ("grow", "shrink") and math.isinf(noise_scale):
            why += ": B_noise infinite, no gradient signal resolved"
        elif why in ("grow", "shrink"):
            why += (f": B_noise {noise_scale:.3g}, target band "
                    f"{change.get('low', math.nan):.3g}-{change.get('high', math.nan):.3g}")
        lr = change.get("lr_factor", 1.0)
        lr = f"; lr x {lr:.3g}" if lr != 1.0 else ""
        if change.get("lr_why") == "bound":
            lr += (f"{'; lr' if not lr else ','} bounded at x {change.get('lr_bound', math.nan):.3g} "
                   f"of the start's (the rule: x {change.get('lr_rule_factor', math.nan):.3g})")
        elif change.get("lr_why") == "kept":
            lr += "; lr kept: no finite B_noise"
        shown.append(f"step {change['step']}: {change['batch']:g} -> {change['new_batch']:g} "
                     f"({why}{lr})")
    earlier = len(changes) - len(shown)
    last = changes[-1]
    return [f"the batch schedule changed the batch {len(changes)} time{'s' if len(changes) > 1 else ''}"
            f"{f' ({earlier} earlier not shown)' if earlier else ''}: {'; '.join(shown)}; batch "
            f"{last['new_batch']:g} from step {last['step'] + 1} (cgn.BatchSchedule, docs/advice.md)"]


def _basis(advice: Advice, basis: str) -> str:
    """What the noise scale is, where it comes from, and its range over recent steps."""
    found, steps = advice.recommendation, advice.recent_steps
    spread = found.spread
    which = f"{basis} of {NETWORK}, {advice.source}"
    if advice.source == PRECONDITIONED_NOISE_SCALE:
        which += (f": the noise of the preconditioned gradient P g, the one "
                  f"{advice.optimizer or 'an adaptive optimizer'}'s steps follow")
    counted = f"the last {len(steps)} tracked steps ({steps[0]}-{steps[-1]})" if len(steps) > 1 \
        else f"tracked step {steps[0]}"
    if spread.used == 0:
        over = f"b_simple is NaN at {counted}"
    else:
        over = (f"over {counted} b_simple has median {spread.median:.3g}, "
                f"quartiles {spread.low:.3g}-{spread.high:.3g}")
        if spread.infinite:
            over += f" ({spread.infinite} with grad_sq <= 0, no signal resolved, counted as infinite)"
        if spread.left_out:
            over += f" ({spread.left_out} NaN left out)"
    return f"noise scale B_noise = {found.noise_scale:.3g} at step {advice.step} ({which}); {over}"


def _batch_sentence(advice: Advice, factor: float) -> str:
    """What to do with the batch, and why."""
    found, batch = advice.recommendation, advice.batch_size
    critical = "the critical batch estimate B_crit ~ B_noise"
    if math.isnan(found.noise_scale):
        return "the noise scale is NaN at every recent step: no advice (see the findings)"
    if math.isinf(found.noise_scale):
        then = (f"double the batch to {advice.new_batch} and re-measure" if advice.new_batch
                else "measure at a larger batch")
        return (f"the noise scale is infinite (the smoothed |G|^2 estimate is <= 0: no gradient "
                f"signal resolved{f' at batch {batch}' if batch else ''}): larger batches would cut "
                f"steps almost linearly; {then}")
    if batch is None:
        return (f"recommended batch: about {found.batch}, {critical}; pass the batch size "
                "(--batch-size) to compare it with yours")
    if found.move == "keep":
        return (f"keep batch {batch}: it lies within the range of the estimate "
                f"({found.low:.3g}-{found.high:.3g}: the recent quartiles, at least a factor "
                f"{factor:g} either side of B_noise), so the measurement resolves no better "
                f"batch ({critical}: {found.batch})")
    if found.move == "grow":
        return (f"use batch {found.batch} instead of {batch}, {critical}, where a run takes about "
                "twice the fewest steps and twice the fewest examples it could "
                f"(McCandlish et al. 2018); batch {batch} is below the range of the estimate "
                f"({found.low:.3g}-{found.high:.3g})")
    return (f"batch {batch} is above the range of the estimate ({found.low:.3g}-{found.high:.3g}): "
            f"batch {found.batch}, {critical}, "
            "uses fewer examples for more steps; keep the larger batch only if steps (time on "
            "many devices) matter more than compute")


def _move_sentences(advice: Advice) -> List[str]:
    """The trade-off of moving to the new batch, and its learning rate (none: no move)."""
    old, new = advice.batch_size, advice.new_batch
    if new is None:
        return []
    noise_scale = advice.recommendation.noise_scale
    lines = [
        f"batch {old} -> {new}: about {_change(advice.steps_change, 'steps')}, "
        f"{_change(advice.examples_change, 'examples')} to the same loss (S/S_min = "
        f"1 + B_noise/B, E/E_min = 1 + B/B_noise, McCandlish et al. 2018 Eq. 2.11-2.12, "
        f"B_noise = {noise_scale:.3g})"
    ]
    optimizer, lr = advice.optimizer, advice.lr
    if optimizer is None:
        lines.append("no learning rate: the log does not record the optimizer (written before "
                     "cockpit-gradnoise recorded it, or tracked without optimizer=); pass "
                     "optimizer= to the tracker")
    elif advice.rule is None:
        lines.append(f"no learning rate: no rule is stated for {optimizer} (SGD: McCandlish "
                     f"et al. 2018; {', '.join(sorted(ADAPTIVE - {'Adagrad'}))}: the square-root rule)")
    elif lr is None:
        lines.append(f"no learning rate: the log records {optimizer} but not its learning rate")
    else:
        factor = advice.new_lr / lr
        if advice.rule == SGD_RULE:
            how = ("eps_opt(B) = eps_max / (1 + B_noise/B), McCandlish et al. 2018 Eq. 2.6-2.7, "
                   "so lr1 = lr0 (1 + B_noise/B0) / (1 + B_noise/B1)")
        else:
            how = (f"the square-root rule of Malladi et al. 2022, lr1 = lr0 sqrt(B1/B0); it also "
                   f"scales 1 - beta1 and 1 - beta2 by B1/B0 = {new / old:.3g} and eps by "
                   "sqrt(B0/B1)")
        root = math.sqrt(new / old)
        if advice.rule == SGD_RULE and factor > root:
            # McCandlish's linear regime needs lr1 below eps_max = |G|^2 / (G^T H G): not measured.
            how += (f"; trusted only if {advice.new_lr:.3g} stays below eps_max = |G|^2 / (G^T H G), "
                    f"which is not measured: the square-root rule's x {root:.3g} is the safer "
                    "step, where cgn.BatchSchedule stops unless given max_lr_factor")
        lines.append(f"learning rate {lr:.3g} -> {advice.new_lr:.3g} = {lr:.3g} x {factor:.3g} "
                     f"({optimizer}: {how}; if {lr:.3g} is tuned for batch {old}; every "
                     "parameter group's by the same factor)")
    return lines


def _adaptive_note(advice: Advice, adaptive: bool) -> List[str]:
    if not adaptive or advice.source == PRECONDITIONED_NOISE_SCALE:
        return []
    return [f"{advice.optimizer} is adaptive, but the log holds no PreconditionedNoiseScale: the "
            "plain noise scale is a weak proxy for the noise its steps see (Merrill et al. 2025); "
            "track PreconditionedNoiseScale"]


def _caveats(advice: Advice, recent: int) -> str:
    used = len(advice.recent_steps)
    if used < recent:
        return (f"{CAVEATS}; only {used} tracked step{'s' if used != 1 else ''} (fewer than "
                f"{recent}): the range is rough")
    return CAVEATS


def advice_json(advice: Advice) -> dict:
    """The :class:`Advice` as plain JSON (the report's ``"json"`` format): numbers, sentences."""
    found = advice.recommendation
    spread = None if found is None else found.spread
    return {
        "source": advice.source, "step": advice.step, "batch_size": advice.batch_size,
        "noise_scale": None if found is None else encode_float(found.noise_scale),
        "recommended_batch": None if found is None else found.batch,
        "move": None if found is None else found.move,
        "range": None if spread is None else {
            "low": encode_float(spread.low), "median": encode_float(spread.median),
            "high": encode_float(spread.high), "steps": list(advice.recent_steps),
            "infinite": spread.infinite, "nan": spread.left_out},
        "new_batch": advice.new_batch,
        "steps_change": encode_float(advice.steps_change),
        "examples_change": encode_float(advice.examples_change),
        "optimizer": advice.optimizer, "lr": advice.lr, "rule": advice.rule,
        "new_lr": advice.new_lr, "sentences": list(advice.sentences),
        "schedule": [{key: encode_float(value) if isinstance(value, float) else value
                      for key, value in change.items()} for change in advice.schedule],
    }
