"""The adaptive batch schedule the user's loop consults each step: :class:`BatchSchedule`.

It reads the tracker's newest noise-scale estimate (:attr:`Tracker.latest
<cockpit_gradnoise.Tracker.latest>`, no frame), decides the number of
micro-batches of the next step by the rule of
:mod:`cockpit_gradnoise.schedule.rule`, sets every parameter group's learning
rate to its start value times :func:`~cockpit_gradnoise.schedule.rule.learning_rate_from_start`
(the rule's factor from the start batch, within a bound) when the batch changes,
and logs each change, and why, into the tracker's log
(``BatchSchedule`` rows, :data:`~cockpit_gradnoise.logs.schema.BATCH_SCHEDULE`).
"""

import math
import warnings
from collections import deque
from typing import Any, Dict, List, Mapping, Optional

from cockpit_gradnoise.distributed import world_size
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.schedule.rule import (
    BOOTSTRAP,
    DEFAULT_MAX_CHANGE,
    DEFAULT_MULTIPLE,
    DEFAULT_PATIENCE,
    GROW,
    LR_BOUND,
    LR_KEPT,
    NO_ESTIMATE,
    Decision,
    bounds_of,
    check_multiple,
    decide,
    in_run_rule,
    learning_rate_from_start,
)
from cockpit_gradnoise.views.advice import NOISE_SOURCES
from cockpit_gradnoise.views.batch_size import ADAPTIVE, DEFAULT_RECENT, SGD_RULE, noise_range, rule_for
from cockpit_gradnoise.views.common import THRESHOLDS

#: ``rule=`` values: from the optimizer's class, McCandlish et al.'s, the square-root rule.
AUTO = "auto"
RULES = (AUTO, "sgd", "sqrt", None)
#: ``estimate=`` values: the noise scale the rule reads (see :class:`BatchSchedule`).
SMOOTHED, MEDIAN = "smoothed", "median"
ESTIMATES = (SMOOTHED, MEDIAN)


def inner_optimizer(optimizer):
    """The optimizer a wrapper holds as ``.optimizer`` (Lightning's ``LightningOptimizer``,
    Accelerate's ``AcceleratedOptimizer``), or ``optimizer`` itself."""
    for _ in range(4):  # Accelerate's wrapper is an Optimizer too
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


class BatchSchedule:
    """Grows (and shrinks) the batch through gradient accumulation toward the critical batch.

    Example (``docs/advice.md``, "An adaptive batch schedule")::

        model, tracker = cgn.track(model, every=1, quantities="norms")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        schedule = cgn.BatchSchedule(micro_batch=8, min_batch=16, max_batch=512)
        for step in range(steps):
            K = schedule.accumulation
            opt.zero_grad()
            for k in range(K):
                x, y = next(micro_batches)        # micro_batch examples each
                losses = F.cross_entropy(model(x), y, reduction="none")
                with tracker(step, losses, optimizer=opt, micro_batch=k, micro_batches=K) as loss:
                    loss.backward()
            opt.step()
            schedule.update(step, tracker, opt)  # may change .accumulation and the lr

    The rule (:mod:`cockpit_gradnoise.schedule.rule`): after each new estimate,
    grow where the batch lies below the target band (the range of the
    estimate scaled by ``multiple * factor``, so that its lower end is
    ``multiple * B_noise``) and the estimate is resolved (the range's upper
    end finite: no growth on an infinite ``B_noise``, nor where a quarter of
    the recent steps resolve no signal), shrink only where the whole band
    lies below the batch, each time to the band's near end and never past it
    (hysteresis of the band's width: a change is reversed only once the
    estimate has moved by that width), by at most
    ``max_change`` per change and at most once per ``patience`` new
    estimates, within the bounds. ``B_noise`` is the network's
    ``b_simple_smoothed`` of ``PreconditionedNoiseScale`` where the optimizer
    is adaptive and it is tracked, else of ``GradientNoiseScale`` or
    ``TwoBatchNoiseScale`` (as the advice reads it). A NaN or missing
    estimate keeps the batch, with one warning.

    With ``TwoBatchNoiseScale`` (the ``"norms"`` preset) on one process an
    estimate needs two micro-batches: if the schedule is at one, the first
    :meth:`update` raises it to two (``why`` ``"bootstrap"``); start at two
    (``min_batch >= 2 * micro_batch``) to have an estimate from step 0.

    Args:
        micro_batch: Examples per micro-batch.
        min_batch: The smallest batch (default ``micro_batch``).
        max_batch: The largest batch.
        max_accumulation: The most micro-batches per step.
        rule: The learning rate's rule: ``"auto"`` (from the optimizer's class,
            :data:`~cockpit_gradnoise.views.batch_size.RULES`: SGD McCandlish et
            al.'s, Adam and its kin McCandlish et al.'s too, on the preconditioned
            step (:func:`~cockpit_gradnoise.schedule.rule.in_run_rule`: within a run
            Adam's ``v`` keeps the earlier batches' noise, so the square-root rule's
            ``sqrt(B)`` held in ``P`` is not there), others none), ``"sgd"``,
            ``"sqrt"`` (Malladi et al. 2022), or ``None`` (the learning rate is left alone).
            The learning rate at batch ``B`` is the one at the start batch ``B0``
            times the rule's factor from ``B0`` to ``B`` at the current estimate
            (:func:`~cockpit_gradnoise.schedule.rule.learning_rate_from_start`),
            not a product over changes; without a finite estimate SGD's is kept.
        max_lr_factor: The most any group's learning rate may be, as a multiple of
            its value at the start (one factor, so the groups keep their ratios).
            ``None``: for SGD's rule the square-root rule's ``sqrt(B/B0)``
            (McCandlish et al.'s ``eps_max`` needs the Hessian, not measured here:
            the linear regime is not trusted unbounded), for the square-root rule
            that rule itself. A change the bound stops is logged (``lr_why``
            ``"bound"``).
        estimate: The ``B_noise`` the rule reads: ``"smoothed"``, the newest
            ``b_simple_smoothed`` (a ratio of moving averages of ``trace_cov`` and
            ``grad_sq``); ``"median"``, the median of the last ``recent`` per-step
            ``b_simple`` (each a ratio within one step), robust to single
            steps. (Under Adam the preconditioned ``(P g)^2`` shrinks by orders
            of magnitude over the first steps: PreconditionedNoiseScale's
            ``b_simple_smoothed`` averages scale-free values for that,
            :func:`~cockpit_gradnoise.functional.scale_free_smoothed_noise_scale`.)
        accumulation: The micro-batches of the first step (default: the fewest
            the bounds allow).
        patience: New estimates needed after a change (and at the start)
            before the next change.
        max_change: The most the batch changes by at one change.
        recent: How many of the last ``b_simple`` values give the estimate's range.
        factor: The band around ``B_noise`` within which the batch is kept.
        multiple: ``k``, the batch the schedule steers to as a multiple of
            ``B_noise``: it follows a rising estimate at ``k B_noise`` and keeps
            the batch within ``k * factor`` times the estimate's range
            (:func:`~cockpit_gradnoise.schedule.rule.target_band`). 1 (the
            default): the critical batch, where ``(S/S_min)(E/E_min)`` is least;
            below 1 saves examples and spends steps, above 1 the reverse
            (McCandlish et al. 2018, eq. 2.11). ``0.5``: the rule before
            ``target`` (the band's near end ``B_noise / factor``).

    Attributes:
        accumulation: Micro-batches of the next optimizer step.
        changes: One dict per change: ``step`` (whose estimate decided it; the
            new batch applies from the next step), ``batch``, ``new_batch``,
            ``accumulation``, ``new_accumulation``, ``lr``, ``new_lr`` (the first
            group's), ``lr_factor``, ``noise_scale``, ``low``, ``high`` (the
            estimate's range), ``why`` (``grow``, ``shrink``, ``bootstrap``),
            ``lr_why`` (``rule``, ``bound``, ``kept``, ``none``), ``lr_rule_factor``
            (the rule's factor from the start, before the bound), ``lr_bound``
            and ``reason`` (a sentence).
        start_batch: ``B0``, the batch of the first step: the learning rate the
            optimizer holds there is the one the rule scales.
        lr_factor: ``lr / lr0`` now, from the start batch (the product of every
            change's ``lr_factor``).
        decisions: How many new estimates led to each decision, by its ``why``
            (``grow``, ``shrink``, and those that kept the batch:
            :data:`~cockpit_gradnoise.schedule.rule.NON_CHANGES`).
    """

    def __init__(self, micro_batch: int, min_batch: Optional[int] = None,
                 max_batch: Optional[int] = None, max_accumulation: Optional[int] = None, *,
                 rule: Optional[str] = AUTO, accumulation: Optional[int] = None,
                 patience: int = DEFAULT_PATIENCE, max_change: float = DEFAULT_MAX_CHANGE,
                 recent: int = DEFAULT_RECENT, factor: float = THRESHOLDS.noise_scale_factor,
                 max_lr_factor: Optional[float] = None, estimate: str = SMOOTHED,
                 multiple: float = DEFAULT_MULTIPLE):
        self.bounds = bounds_of(micro_batch, min_batch, max_batch, max_accumulation)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if not max_change > 1:
            raise ValueError(f"max_change must be > 1 (a factor of the batch), got {max_change!r}")
        for name, value in (("patience", patience), ("recent", recent)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if accumulation is None:
            accumulation = self.bounds.low
        if self.bounds.clamp(accumulation) != accumulation:
            raise ValueError(f"accumulation={accumulation!r} lies outside the bounds "
                             f"[{self.bounds.low}, {self.bounds.high}] micro-batches")
        if estimate not in ESTIMATES:
            raise ValueError(f"estimate must be one of {ESTIMATES}, got {estimate!r}")
        self.estimate = estimate
        check_multiple(multiple)
        self.multiple = float(multiple)
        if max_lr_factor is not None and not (isinstance(max_lr_factor, (int, float))
                                              and max_lr_factor >= 1):
            raise ValueError(f"max_lr_factor must be a number >= 1 (the most the learning rate "
                             f"grows by from the start; None: the default), got {max_lr_factor!r}")
        self.rule, self.patience, self.max_change, self.factor = rule, patience, max_change, factor
        self.max_lr_factor = None if max_lr_factor is None else float(max_lr_factor)
        self.accumulation = int(accumulation)
        self.start_batch = self.batch
        self.changes: List[Dict[str, Any]] = []
        self.lr_factor = 1.0
        self.source: Optional[str] = None  # the quantity the noise scale is read from
        self.decisions: Dict[str, int] = {}
        self._recent = deque(maxlen=recent)  # the last b_simple values
        self._since_change = 0  # new estimates since the last change (or the start)
        self._last_read: Optional[int] = None  # the step of the newest estimate read
        self._warned: set = set()

    @property
    def micro_batch(self) -> int:
        """Examples per micro-batch."""
        return self.bounds.micro_batch

    @property
    def batch(self) -> int:
        """The batch of the next optimizer step: ``micro_batch * accumulation``."""
        return self.bounds.micro_batch * self.accumulation

    def update(self, step: int, tracker, optimizer=None) -> Optional[Dict[str, Any]]:
        """After ``optimizer.step()`` of ``step``: decide the next step's accumulation.

        Reads the tracker's newest estimate; with a new one, applies the rule,
        and on a change sets :attr:`accumulation`, scales every parameter
        group's ``"lr"`` by the rule's factor and logs the change in the
        tracker's log (:meth:`Tracker.record <cockpit_gradnoise.Tracker.record>`).

        Returns:
            The change (as in :attr:`changes`), or ``None``.
        """
        step = int(step)
        source = self._source_of(tracker, optimizer)
        if source is None:
            self._warn("no-source", "the tracker tracks no noise scale (GradientNoiseScale, "
                       "TwoBatchNoiseScale or PreconditionedNoiseScale): the batch schedule keeps "
                       f"batch {self.batch}; track with quantities=\"norms\" or \"all\"")
            return None
        if (source == schema.TWO_BATCH_NOISE_SCALE and self.accumulation < 2 and
                world_size() < 2):
            return self._bootstrap(step, tracker, optimizer)
        newest = getattr(tracker, "latest", {}).get(source)
        if newest is None or (self._last_read is not None and newest[0] <= self._last_read):
            return None  # no new estimate since the last update
        self._last_read = int(newest[0])
        row = newest[1]
        self._recent.append(float(row.get(schema.B_SIMPLE, math.nan)))
        self._since_change += 1
        noise_scale = (noise_range(self._recent).median if self.estimate == MEDIAN
                       else float(row.get(schema.B_SIMPLE_SMOOTHED, math.nan)))
        decision = decide(self.accumulation, self.bounds, noise_scale, self._recent,
                          since_change=self._since_change, patience=self.patience,
                          max_change=self.max_change, multiple=self.multiple, factor=self.factor)
        self.decisions[decision.why] = self.decisions.get(decision.why, 0) + 1
        if decision.why == NO_ESTIMATE:
            self._warn("nan", f"the noise scale ({source}) is NaN at step {newest[0]}: the batch "
                       f"schedule keeps batch {self.batch} while it is (see the report's findings)")
        if not decision.changes:
            return None
        return self._change(step, decision, tracker, optimizer)

    def _bootstrap(self, step: int, tracker, optimizer) -> Optional[Dict[str, Any]]:
        if self.bounds.high < 2:
            self._warn("one", "TwoBatchNoiseScale needs two micro-batches per step on one "
                       f"process, and the bounds allow {self.bounds.high}: the batch schedule "
                       "has no estimate; raise max_batch or max_accumulation")
            return None
        return self._change(step, Decision(max(2, self.bounds.low), BOOTSTRAP), tracker, optimizer)

    def _source_of(self, tracker, optimizer) -> Optional[str]:
        """The quantity the noise scale is read from, chosen at the first update (as the advice)."""
        if self.source is None:
            tracked = {type(q).__name__ for q in getattr(getattr(tracker, "cockpit", None),
                                                         "quantities", ())}
            adaptive = type(inner_optimizer(optimizer)).__name__ in ADAPTIVE
            sources = ((schema.PRECONDITIONED_NOISE_SCALE,) if adaptive else ()) + NOISE_SOURCES
            self.source = next((name for name in sources if name in tracked), None)
        return self.source

    def _rule_of(self, optimizer) -> Optional[str]:
        if self.rule != AUTO:
            return self.rule
        name = type(inner_optimizer(optimizer)).__name__ if optimizer is not None else None
        rule = in_run_rule(rule_for(name))  # Adam's kin: McCandlish's rule on the P g step
        if rule is None:
            self._warn("rule", "the learning rate is left alone: "
                       + ("update() got no optimizer" if name is None else
                          f"no learning-rate rule is stated for {name}")
                       + " (pass rule=\"sgd\" or \"sqrt\", or the optimizer)")
        return rule

    def _change(self, step: int, decision: Decision, tracker, optimizer) -> Dict[str, Any]:
        """Apply ``decision``: the accumulation, every group's learning rate, the log."""
        old, new = self.batch, self.bounds.micro_batch * decision.accumulation
        found = decision.recommendation
        noise_scale = math.nan if found is None else found.noise_scale
        rule = self._rule_of(optimizer)
        found_lr = learning_rate_from_start(rule, self.start_batch, new, noise_scale,
                                            self.lr_factor, self.max_lr_factor)
        # Set from the start's value (lr0 * found), as a ratio to the factor now: a user's
        # own change of the learning rate between changes is kept.
        lr_factor = found_lr.factor / self.lr_factor
        groups = getattr(inner_optimizer(optimizer), "param_groups", None) or []
        lr = _number(groups[0].get("lr")) if groups else None
        for group in groups:
            if lr_factor != 1.0 and group.get("lr") is not None:
                if hasattr(group["lr"], "mul_"):  # a tensor lr (capturable Adam): kept in place
                    group["lr"].mul_(lr_factor)
                else:
                    group["lr"] = group["lr"] * lr_factor
        change = {
            "step": step, "batch": old, "new_batch": new, "accumulation": self.accumulation,
            "new_accumulation": decision.accumulation, "lr": lr,
            "new_lr": None if lr is None else lr * lr_factor, "lr_factor": lr_factor,
            "noise_scale": noise_scale, "low": math.nan if found is None else found.low,
            "high": math.nan if found is None else found.high, "why": decision.why,
            "lr_why": found_lr.why, "lr_rule_factor": found_lr.rule_factor,
            "lr_bound": found_lr.bound,
        }
        change["reason"] = reason(change, rule)
        self.accumulation = decision.accumulation
        self.lr_factor = found_lr.factor
        self._since_change = 0
        self.changes.append(change)
        if hasattr(tracker, "record"):
            tracker.record(step, schema.BATCH_SCHEDULE, statistics_of(change))
        return change

    def _warn(self, key: str, message: str):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def state_dict(self) -> Dict[str, Any]:
        """The schedule's state for a checkpoint (plain numbers, strings, lists, dicts),
        saved next to the optimizer's: with both loaded, a resumed run takes the same
        decisions as one that never stopped."""
        return {
            "bounds": [self.bounds.micro_batch, self.bounds.low, self.bounds.high],
            "accumulation": self.accumulation, "changes": [dict(c) for c in self.changes],
            "lr_factor": self.lr_factor, "start_batch": self.start_batch,
            "max_lr_factor": self.max_lr_factor, "multiple": self.multiple,
            "source": self.source, "recent": list(self._recent),
            "since_change": self._since_change, "last_read": self._last_read,
            "warned": sorted(self._warned), "decisions": dict(self.decisions),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (the optimizer's state, with its learning rates,
        is loaded by the optimizer's own ``load_state_dict``).

        Raises:
            ValueError: If the state is of a schedule with other bounds.
        """
        bounds = [self.bounds.micro_batch, self.bounds.low, self.bounds.high]
        if list(state["bounds"]) != bounds:
            raise ValueError(f"the state is of a schedule with micro-batch and accumulation bounds "
                             f"{list(state['bounds'])}, this one has {bounds}: build it as before")
        self.accumulation = int(state["accumulation"])
        self.changes = [dict(c) for c in state["changes"]]
        self.lr_factor = float(state["lr_factor"])
        if state.get("max_lr_factor", self.max_lr_factor) != self.max_lr_factor:
            raise ValueError(f"the state is of a schedule with max_lr_factor="
                             f"{state['max_lr_factor']!r}, this one has {self.max_lr_factor!r}: "
                             "build it as before")
        # Older states, without it, were of the rule before `multiple` (0.5): state it to resume.
        if float(state.get("multiple", 0.5)) != self.multiple:
            raise ValueError(f"the state is of a schedule with multiple={state.get('multiple', 0.5)!r}"
                             f" (a state without one: 0.5, the rule before it), this one has "
                             f"{self.multiple!r}: build it as before")
        self.start_batch = int(state.get("start_batch", self.start_batch))  # older states: ours
        self.source = state["source"]
        self._recent.clear()
        self._recent.extend(float(v) for v in state["recent"])
        self._since_change = int(state["since_change"])
        self._last_read = state["last_read"]
        self._warned = set(state["warned"])
        self.decisions = {str(k): int(v) for k, v in state.get("decisions", {}).items()}  # older: none


def _number(value) -> Optional[float]:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def statistics_of(change: Mapping[str, Any]) -> Dict[str, float]:
    """The logged statistics of a change (:data:`~cockpit_gradnoise.logs.schema.BATCH_SCHEDULE`)."""
    statistics = {schema.SCHEDULE_BATCH: change["batch"], schema.SCHEDULE_NEW_BATCH: change["new_batch"],
                  schema.SCHEDULE_ACCUMULATION: change["accumulation"],
                  schema.SCHEDULE_NEW_ACCUMULATION: change["new_accumulation"],
                  schema.SCHEDULE_LR_FACTOR: change["lr_factor"],
                  schema.SCHEDULE_NOISE_SCALE: change["noise_scale"],
                  schema.SCHEDULE_LOW: change["low"], schema.SCHEDULE_HIGH: change["high"],
                  schema.SCHEDULE_LR_RULE_FACTOR: change.get("lr_rule_factor", math.nan),
                  schema.SCHEDULE_LR_BOUND: change.get("lr_bound", math.nan),
                  schema.SCHEDULE_WHY_PREFIX + change["why"]: 1.0}
    if change.get("lr_why") in (LR_BOUND, LR_KEPT):
        statistics[schema.SCHEDULE_LR_WHY_PREFIX + change["lr_why"]] = 1.0
    if change["lr"] is not None:
        statistics[schema.LEARNING_RATE] = change["lr"]
        statistics[schema.SCHEDULE_NEW_LR] = change["new_lr"]
    # No estimate (the bootstrap), no bound: left out, not NaN or inf, which the views read
    # as a run gone non-finite.
    return {name: value for name, value in statistics.items()
            if not math.isnan(value) and not (name == schema.SCHEDULE_LR_BOUND and math.isinf(value))}


def reason(change: Mapping[str, Any], rule: Optional[str]) -> str:
    """A change in words: the batches, why, and the learning rate's rule."""
    old, new = change["batch"], change["new_batch"]
    if change["why"] == BOOTSTRAP:
        why = ("TwoBatchNoiseScale needs two micro-batches per step to estimate the noise scale "
               "on one process")
    else:
        where, end = ("below", "low") if change["why"] == GROW else ("above", "high")
        why = (f"batch {old} lies {where} the target band ({change['low']:.3g}-"
               f"{change['high']:.3g}) of B_noise = {change['noise_scale']:.3g}; moved toward "
               f"its near end {change[end]:.3g}, never past it")
    cited = "McCandlish et al. 2018" if rule == SGD_RULE else "the square-root rule, Malladi et al. 2022"
    lr_why = change.get("lr_why")
    if lr_why == LR_KEPT:
        lr = "learning rate unchanged (no finite B_noise for McCandlish et al. 2018's rule)"
    elif rule is None or change["lr_factor"] == 1.0 and lr_why != LR_BOUND:
        lr = "learning rate unchanged"
    else:
        lr = f"learning rate x {change['lr_factor']:.4g} ({cited}"
        if lr_why == LR_BOUND:
            lr += (f" gives x {change['lr_rule_factor']:.4g} from the start batch; bounded at "
                   f"x {change['lr_bound']:.4g} of the start's learning rate")
        lr += ")"
    return f"step {change['step']}: batch {old} -> {new} ({why}); {lr}"
