"""The simple gradient noise scale of McCandlish et al. 2018, per layer, from one batch."""

import functools
import math

from cockpit_gradnoise import _device, functional
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    PerExampleSquaredNorms,
    sharded,
)
from cockpit_gradnoise.extensions.precision import widened
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities import _shards
from cockpit_gradnoise.quantities._base import ParameterQuantity
from cockpit_gradnoise.quantities._declarations import SUM
from cockpit_gradnoise.quantities.per_example_grad_norm import squared_norm_tables
from cockpit_gradnoise.step_checks import check_example_count

import torch

DEFAULT_SMOOTHING = 0.9
"""Default weight of the past in ``b_simple_smoothed``'s moving averages."""


class GradientNoiseScale(ParameterQuantity):
    """Is my batch too small for this learning rate? ``B_simple = tr(Sigma) / |G|^2``.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
    Training": the critical batch size is about ``B_simple``, the ratio of the
    per-example gradient covariance's trace to the squared true gradient. From
    the ``N`` examples of one batch, with ``g_i`` the gradient of example
    ``i``'s own loss (independent of the loss's reduction),
    ``S = mean_i ||g_i||^2`` and ``M = ||mean_i g_i||^2``, statistics per
    parameter and for ``"all"`` (``S`` and ``M`` summed over parameters first):

    - ``grad_sq = (N M - S) / (N - 1)``: unbiased estimate of ``|G|^2``; it can
      be negative when the signal is weak, and is reported as it is;
    - ``trace_cov = N (S - M) / (N - 1)``: unbiased estimate of ``tr(Sigma)``;
    - ``b_simple = trace_cov / grad_sq``, ``+inf`` when ``grad_sq <= 0``;
    - ``b_simple_smoothed = EMA(trace_cov) / EMA(grad_sq)``, ``+inf`` when the
      smoothed denominator is ``<= 0``. A ratio of two noisy estimates is
      biased; smoothing numerator and denominator separately first is what
      the literature does (McCandlish et al.; nanoGNS). The raw values are
      averaged: their units (those of ``g^2``) do not change from step to
      step, and a step with a larger gradient carries more signal.
      PreconditionedNoiseScale, whose ``P`` does change them, averages
      scale-free values instead
      (:func:`~cockpit_gradnoise.functional.scale_free_smoothed_noise_scale`).
      The moving averages run over tracked steps,
      start at the first tracked value and skip steps where a value is not
      finite (``b_simple_smoothed`` is NaN there);
    - ``batch_size``: ``N``, to compare ``B_simple`` with (the dashboard
      draws it as a line).

    See :func:`~cockpit_gradnoise.functional.noise_scale_estimates`. Costs the
    per-example squared norms of :class:`~cockpit_gradnoise.PerExampleGradNorm`
    (the same BackPACK extension, computed once when both are tracked) and one
    pass over ``param.grad``. Needs ``info["loss"]`` and
    ``info["individual_losses"]``; where they are not finite while the
    gradients are, only ``b_simple`` (free of the loss's scale) and
    ``batch_size`` are computed, the rest is NaN. Batch size 1 defines no estimate: nothing is
    recorded at such steps, with one warning.

    Under gradient accumulation (``docs/accumulation.md``) ``S`` and ``M``
    are those of all micro-batches' examples; the batch gradient is the sum
    of each micro-batch's own (BackPACK's, never ``param.grad``, which
    holds the earlier micro-batches too), and the squared norm of each
    micro-batch's is kept in :attr:`micro_batch_gradients`.

    Under FSDP2 each process's local gradient of a layer (``sum_i g_i`` of its
    examples) is reduce-scattered inside the backward pass, as soon as the
    layer's gradient is accumulated, each process keeping the rows of the sum
    that FSDP2 gives it of the parameter (``sums_sharded_in_backward``); ``M``
    adds every process's squared norm of its rows. A parameter split by tensor
    parallelism likewise keeps its ``tp`` shard (alone), or its rows of it reduce-scattered
    over the data-parallel mesh (inside FSDP2): never gathered whole.

    Args:
        track_schedule: Function from step to bool.
        smoothing: Weight of the past in the moving averages, in ``[0, 1)``:
            ``ema = smoothing * ema + (1 - smoothing) * value``. Default
            ``0.9`` (about the last 10 tracked steps).
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

    extension_classes = (PerExampleSquaredNorms,)
    supports_fsdp2 = True
    supports_hsdp = True
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True
    sums = {"sum_of_squared_norms": SUM, "sum_of_gradients": SUM}
    reads_local_gradient = True
    micro_batch_gradient = "sum_of_gradients"  # sum_i g_i, kept per micro-batch
    sums_sharded_in_backward = LOCAL_GRADIENT_SAVEFIELD  # under FSDP2: each process keeps its rows
    # A ratio of two sums of squares, both scaled by 1/c^2; and the count.
    loss_free_statistics = (schema.B_SIMPLE, schema.BATCH_SIZE)

    def __init__(
        self, track_schedule, *, smoothing=DEFAULT_SMOOTHING, param_names=None, verbose=False
    ):
        super().__init__(track_schedule, param_names=param_names, verbose=verbose)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(
                f"smoothing must lie in [0, 1) (the weight of the past), got {smoothing!r}"
            )
        self.smoothing = float(smoothing)
        # {name: (EMA of trace_cov, EMA of grad_sq)}
        self._averages = {}
        # Under FSDP2, the local gradients reduce-scattered in the backward pass: {id: note},
        # and {name} of those parameters (step_context), {name} of those whose rows are a
        # copy of another process's (HSDP's replicas but the first); whether each value's M
        # is this process's part, and whether it counts, in the order formed
        # (named_value_from_sums).
        self._presharded, self._partial_names, self._copies, self._partial = {}, set(), set(), []

    def step_context(self, step, params):
        self._presharded = step.presharded.get(LOCAL_GRADIENT_SAVEFIELD, {})
        self._partial_names = {name for name, param in self.trainable(params) if id(param) in self._presharded}
        self._copies = {name for name, param in self.trainable(params)
                        if name in self._partial_names and not sharded.counted_here(param)}
        self._partial = []
        return step.loss_batch(self)

    def sent_in_backward(self, step, scale):
        if self.sums_sharded_in_backward != LOCAL_GRADIENT_SAVEFIELD:  # a subclass's own sums
            return super().sent_in_backward(step, scale)
        return functools.partial(_gradient_to_send, step, scale)

    def accepts(self, batch):
        if batch.examples < 2:
            self.warn_once(
                "batch-size-1",
                "batch size 1 defines no gradient noise scale; nothing is recorded at "
                "such steps",
            )
            return False
        return True

    def parameter_sums(self, param, batch):
        squared_norms = param.cgn_batch_l2.detach()
        check_example_count(squared_norms.shape[0], batch.examples)
        # BatchL2Grad gives ||x_i||^2 = c^2 ||g_i||^2; param.grad = c * sum_i g_i.
        total = squared_norms.sum(dtype=torch.float64)
        gradient = self.local_gradient(param)
        if id(param) not in self._presharded:  # else applied before it was reduce-scattered
            gradient = without_rounding_noise(gradient, total)
        if batch.loss_scale != 1.0:
            gradient = gradient / batch.loss_scale
        # The gradient itself may be passed on (a view): the sums are never altered.
        return {
            "sum_of_squared_norms": total / batch.loss_scale**2,
            "sum_of_gradients": gradient,
        }

    def values_of_many(self, items, batch, deferred):
        # On other devices every parameter's value in a few launches for all, not a dozen each:
        # the same divisions of S's float64 sums, those taken row by row of one table per dtype
        # (within (N - 1) 2**-53 relative: maybe another order of addition); M's squared norms
        # of the same quotients g / c by divided_squared_norms ((n + 2) 2**-53, where a float64
        # dot each was n 2**-53); a structural zero's M set to 0 after its norm, not its
        # gradient before it: the same where, the same values (NaN totals keep theirs).
        # FSDP2's sums (reduce-scattered in the backward pass): one at a time.
        groups = None if self._presharded else squared_norm_tables(self, GradientNoiseScale, items, batch)
        if groups is None:
            return None
        totals = _row_sums(groups, len(items))
        n, c = batch.examples, batch.loss_scale
        mean_squared_norms = totals / c**2 / n
        # local_gradient's, widened in divided_squared_norms group by group (not all at once).
        gradients = [getattr(param, LOCAL_GRADIENT_SAVEFIELD, param.grad).detach() for _, param in items]
        squared = functional.divided_squared_norms(gradients, c)
        squared_norms_of_mean = torch.where(totals != 0, squared, 0.0) / n**2
        found = {}
        for (name, param), s, m in zip(items, mean_squared_norms.unbind(), squared_norms_of_mean.unbind()):
            self._partial.append((name in self._partial_names, name not in self._copies))
            deferred.append((name, param, {}))
            found[name] = (s, m, n)
        return found

    unresolved_reads = ()  # the per-example norms on the parameter, not the sums

    def unresolved(self, param, sums, batch):
        norms = param.cgn_batch_l2.detach()
        found = functional.unresolved_norm_sum(norms, param.numel())
        return None if found is None else (found, _lost_sum_reason(norms.dtype))

    def unresolved_of_many(self, items, batch):
        # Every parameter's norms (one length: the batch's) as one table per dtype, checked row
        # by row in a few ops for all (unresolved_norm_sum's tests): on a GPU a few launches, on
        # the CPU a few calls instead of a handful per parameter.
        if type(self).unresolved is not GradientNoiseScale.unresolved:  # a subclass checks its own
            return super().unresolved_of_many(items, batch)
        norms = [param.cgn_batch_l2.detach() for _, param, _ in items]
        groups = functional.stacked_by_dtype(norms)
        if groups is None:
            return super().unresolved_of_many(items, batch)
        found = {}
        for indices, table in groups:
            numels = [items[i][1].numel() for i in indices]
            floors = functional.floors_of(numels, table.dtype, table.device)
            sum_floors = functional.floors_of(numels, table.dtype, table.device, times=table.shape[1],
                                              compared_in=torch.float64)
            flags = functional.unresolved_norm_sums_of_rows(table, floors, sum_floors)
            for i, flag in zip(indices, functional.counts_of_rows(flags)):
                found[items[i][0]] = None if flag is None else (flag, _lost_sum_reason(table.dtype))
        return found

    def noted_squared_norms(self, step, params):
        notes = step.presharded.get(self.sums_sharded_in_backward, {})
        found = {}
        for name, param in self.trainable(params):
            if notes.get(id(param)) is None:
                continue
            squared, total = notes[id(param)]
            # Noted in the backward pass's units: under a GradScaler the savefields have been
            # divided by s**2 since (amp.py), the per-example norms beside it too: by as much.
            now = param.__dict__[BATCH_L2_SAVEFIELD].detach().sum(dtype=torch.float64)
            ratio = torch.where(total != 0, now / total, 1.0)
            found[name] = squared * (ratio.item() if _device.on_host(ratio) else ratio)
        return found

    def value_from_sums(self, sums, batch):
        n = batch.examples
        # On a GPU, tensors left there until the step's one transfer (float64); on the CPU a
        # float64 sum's division as a float's, the same IEEE division, without a tensor op.
        total = sums["sum_of_squared_norms"]
        mean_squared_norm = (total.item() / n if _device.on_host(total) and total.dtype == torch.float64
                             else functional.scalar(total / n))
        squared_norm_of_mean = functional.squared_norm(sums["sum_of_gradients"], defer=True) / n**2
        return mean_squared_norm, squared_norm_of_mean, n

    def named_value_from_sums(self, name, sums, batch):
        # FSDP2: M of this process's rows of the gradient, added in statistics_of_values
        # (HSDP: by the first replica only, the others holding the same rows).
        self._partial.append((name in self._partial_names, name not in self._copies))
        return self.value_from_sums(sums, batch)

    def statistics_of_values(self, values, network):
        partial, self._partial = self._partial, []
        if any(p for p, _ in partial):  # the same parameters on every process: collective everywhere or nowhere
            values = [v if counted else (v[0], 0.0, v[2]) for v, (_, counted) in zip(values, partial)]
            values = _shards.added_across_processes(values, [(False, p) for p, _ in partial])
        # On other devices S and M are 0-dim tensors: every parameter's (and the network's,
        # their sums) estimates in one set of vector ops, not a handful of launches each.
        stacks = [functional.stacked_by_dtype([v[k] for v in values]) for k in (0, 1)]
        if any(groups is None or len(groups) > 1 or groups[0][1].dim() != 1 for groups in stacks):
            return super().statistics_of_values(values, network)
        (_, mean_squared_norms), (_, squared_norms_of_mean) = stacks[0][0], stacks[1][0]
        if network:
            mean_squared_norms = torch.cat([mean_squared_norms, mean_squared_norms.sum(dim=0, keepdim=True)])
            squared_norms_of_mean = torch.cat([squared_norms_of_mean, squared_norms_of_mean.sum(dim=0, keepdim=True)])
        # statistics() of every row at once: its formulas are elementwise.
        columns = self.statistics((mean_squared_norms, squared_norms_of_mean, values[0][2]))
        batch_size = columns.pop(schema.BATCH_SIZE)
        rows = [{**row, schema.BATCH_SIZE: batch_size}
                for row in functional.rows_of_columns(list(columns), list(columns.values()))]
        return rows[: len(values)], rows[-1] if network else None

    def network_value(self, values):
        return sum(v[0] for v in values), sum(v[1] for v in values), values[0][2]

    def statistics(self, value):
        grad_sq, trace_cov = functional.noise_scale_estimates(*value)
        return {
            schema.GRAD_SQ: grad_sq,
            schema.TRACE_COV: trace_cov,
            schema.B_SIMPLE: schema.ratio_or_inf(trace_cov, grad_sq),
            # Recorded so that dashboards and reports compare B_simple with it.
            schema.BATCH_SIZE: float(value[2]),
        }

    def statistic_names(self):
        return [schema.GRAD_SQ, schema.TRACE_COV, schema.B_SIMPLE, schema.B_SIMPLE_SMOOTHED, schema.BATCH_SIZE]

    def state_dict(self):
        """As the base's, with the moving averages of ``b_simple_smoothed`` (per row)."""
        return {**super().state_dict(),
                "averages": {name: list(pair) for name, pair in self._averages.items()}}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._averages = {name: tuple(pair) for name, pair in state["averages"].items()}

    def derived_statistics(self, name, statistics):
        return {schema.B_SIMPLE_SMOOTHED: self._smoothed(name, statistics)}

    def _smoothed(self, name, stats):
        """Update the moving averages of ``name`` and return their ratio."""
        return smoothed_noise_scale(self._averages, name, stats[schema.TRACE_COV],
                                    stats[schema.GRAD_SQ], self.smoothing)


def without_rounding_noise(gradient: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``gradient`` (``sum_i x_i``), or 0 where ``total = sum_i ||x_i||^2`` is exactly 0.

    Every contribution exactly 0 (a structural zero: an attention key's bias): so is the
    gradient, where autograd's is rounding noise. A NaN ``total`` keeps the gradient.
    """
    if not _device.on_host(total):
        return torch.where(total != 0, gradient, 0.0)  # != keeps a NaN (no sync)
    if total.item() == 0:  # the CPU reads it at no cost; no copy of the gradient
        return torch.zeros_like(gradient)
    return gradient


def _gradient_to_send(step, scale, holder):
    """What FSDP2's hook reduce-scatters of a layer's local gradient ``sum_i x_i``
    (:func:`.extensions.sharded.reduce_in_backward`): ``[1, *shape]`` in units of this
    process's loss scale ``c``, in float32 or wider, after :func:`without_rounding_noise`
    (a rule of this process's examples, applied before the sum over processes as after
    the backward pass); noted under accumulation, this process's ``||sum_i g_i||^2``
    (its micro-batch gradient, :attr:`GradientNoiseScale.micro_batch_gradients`), with
    ``sum_i ||x_i||^2`` then (:meth:`GradientNoiseScale.noted_squared_norms`).
    ``None`` (left alone, reduced after the backward pass) without the per-example norms
    beside it, or where the scale is not wanted: on every process alike."""
    if BATCH_L2_SAVEFIELD not in holder.__dict__:
        return None
    c = sharded.loss_scale_or_nan(scale)
    if c is None:
        return None
    total = holder.__dict__[BATCH_L2_SAVEFIELD].detach().sum(dtype=torch.float64)
    gradient = without_rounding_noise(widened(holder.__dict__[LOCAL_GRADIENT_SAVEFIELD].detach()), total)
    try:
        micro = step.micro_batch() is not None
    except (TypeError, ValueError):  # refused at the call already
        micro = False
    note = (functional.squared_norm(gradient / c, defer=True), total) if micro else None
    return gradient.unsqueeze(0), [c], note


def smoothed_noise_scale(averages: dict, name: str, trace_cov: float, grad_sq: float,
                         smoothing: float) -> float:
    """``EMA(trace_cov) / EMA(grad_sq)`` of ``name``, updating ``averages[name]`` in place.

    ``+inf`` when the smoothed denominator is ``<= 0``; NaN, with the averages
    kept as they are, when a value is not finite.
    """
    if not (math.isfinite(trace_cov) and math.isfinite(grad_sq)):
        return math.nan  # and keep the averages as they are
    previous = averages.get(name, (None, None))
    averages[name] = tuple(
        functional.exponential_moving_average(old, new, smoothing)
        for old, new in zip(previous, (trace_cov, grad_sq))
    )
    return schema.ratio_or_inf(*averages[name])


def _row_sums(groups, count):
    """The float64 sum of each row of :func:`~cockpit_gradnoise.functional.stacked_by_dtype`'s
    ``groups`` of ``count`` tensors, in their order: one vector."""
    sums = [(indices, table.sum(dim=1, dtype=torch.float64)) for indices, table in groups]
    if len(sums) == 1:
        return sums[0][1]
    ordered = [None] * count
    for indices, column in sums:
        for i, total in zip(indices, column.unbind()):
            ordered[i] = total
    return torch.stack(ordered)


def _lost_sum_reason(dtype):
    """The words of :meth:`GradientNoiseScale.unresolved`'s finding."""
    return lambda _: (
        f"the squares of its per-example contributions underflow (the sum of its squared "
        f"norms in {dtype} is below N times 4 numel tiny), so tr(Sigma) and |G|^2 "
        "cannot be told from it")
