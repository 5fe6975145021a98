"""Per-example gradient norms, per layer, from one backward pass."""

import functools

from cockpit_gradnoise import functional, order_statistics
from cockpit_gradnoise.extensions import PerExampleSquaredNorms
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities._base import ParameterQuantity
from cockpit_gradnoise.quantities._declarations import CAT
from cockpit_gradnoise.step_checks import check_example_count

import torch


class PerExampleGradNorm(ParameterQuantity):
    """How large are the gradients of single examples, and how spread out?

    ``||g_i||`` for each example ``i`` of the batch, where ``g_i`` is the
    gradient of example ``i``'s own loss, so the result does not depend on
    whether the loss is a mean or a sum. Per parameter, and for ``"all"``
    (``||g_i||^2`` summed over parameters). Statistics over the batch:
    ``q<level>``, ``mean`` and ``max`` of ``||g_i||`` (units of the gradient).

    Computed without materializing per-example gradients (BackPACK's
    ``BatchL2Grad``; exact also for grouped convolutions, see
    ``cockpit_gradnoise.extensions.conv_math``). Needs ``info["loss"]`` and
    ``info["individual_losses"]`` (shape ``[N]``) to tell a mean-reduced loss
    (``x_i = g_i / N``) from a sum-reduced one (``x_i = g_i``); where they
    are not finite while the gradients are, that cannot be told, and the
    statistics are NaN (one warning).

    Args:
        track_schedule: Function from step to bool.
        quantiles: Quantile levels in ``[0, 1]``.
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

    extension_classes = (PerExampleSquaredNorms,)
    supports_fsdp2 = True
    supports_hsdp = True
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True
    sums = {"squared_norms": CAT}

    def __init__(
        self, track_schedule, *, quantiles=(0.05, 0.5, 0.95), param_names=None, verbose=False
    ):
        super().__init__(track_schedule, param_names=param_names, verbose=verbose)
        self.quantiles = order_statistics.check_quantile_levels(quantiles)

    def step_context(self, step, params):
        return step.loss_batch(self)

    def parameter_sums(self, param, batch):
        squared_norms = param.cgn_batch_l2.detach()
        check_example_count(squared_norms.shape[0], batch.examples)
        # BatchL2Grad gives ||x_i||^2 = c^2 ||g_i||^2.
        return {"squared_norms": squared_norms / batch.loss_scale**2}

    def values_of_many(self, items, batch, deferred):
        # On other devices one division of a table per dtype for all, not one per parameter:
        # the same elementwise quotients (views of its rows).
        groups = squared_norm_tables(self, PerExampleGradNorm, items, batch)
        if groups is None:
            return None
        rows = [None] * len(items)
        for indices, table in groups:
            for i, row in zip(indices, (table / batch.loss_scale**2).unbind()):
                rows[i] = row
        deferred.extend((name, param, {"squared_norms": row}) for (name, param), row in zip(items, rows))
        return {name: row for (name, _), row in zip(items, rows)}

    unresolved_reads = ("squared_norms",)

    def unresolved(self, param, sums, batch):
        norms = sums["squared_norms"]
        count = functional.unresolved_norms(norms, param.numel(), batch.loss_scale)
        return None if count is None else (count, _lost_norms_reason(norms.dtype))

    def unresolved_of_many(self, items, batch):
        # Every parameter's norms (one length: the batch's) as one table per dtype, checked row
        # by row in a few ops for all (unresolved_norms' comparisons): on a GPU a few launches,
        # on the CPU a few calls instead of a handful per parameter.
        norms = [sums["squared_norms"] for _, _, sums in items]
        groups = functional.stacked_by_dtype(norms)
        if groups is None:
            return super().unresolved_of_many(items, batch)
        found = {}
        for indices, table in groups:
            floors = functional.floors_of([items[i][1].numel() for i in indices], table.dtype,
                                          table.device, batch.loss_scale)
            counts = functional.unresolved_norms_of_rows(table, floors)
            for i, count in zip(indices, functional.counts_of_rows(counts)):
                found[items[i][0]] = None if count is None else (count, _lost_norms_reason(table.dtype))
        return found

    def value_from_sums(self, sums, batch):
        return sums["squared_norms"]

    def network_value(self, values):
        return sum(values)

    def statistics_of_values(self, values, network):
        # Every parameter's per-example squared norms share the batch: one [P, N] table per
        # dtype, summarised by a few vector ops over its rows, not a handful per parameter.
        groups = functional.stacked_by_dtype(values)
        if groups is None or values[0].dim() != 1:
            return super().statistics_of_values(values, network)
        names, rows = self.statistic_names(), [None] * len(values)
        for indices, table in groups:
            columns = functional.per_example_norm_statistics_of_rows(table, self.quantiles)
            for i, row in zip(indices, functional.rows_of_columns(names, columns)):
                rows[i] = row
        if not network:
            return rows, None
        wide = functools.reduce(torch.promote_types, (table.dtype for _, table in groups))
        total = torch.cat([table.to(wide) for _, table in groups]).sum(dim=0, keepdim=True)
        columns = functional.per_example_norm_statistics_of_rows(total, self.quantiles)
        return rows, functional.rows_of_columns(names, columns)[0]

    def statistics(self, squared_norms):
        return functional.per_example_norm_statistics(squared_norms, self.quantiles, defer=True)

    def statistic_names(self):
        return schema.norm_statistic_names(self.quantiles)


def _lost_norms_reason(dtype):
    """The words of :meth:`PerExampleGradNorm.unresolved`'s finding, from its count."""
    return lambda k: (
        f"the squares of the contributions of {k} examples underflow (their squared norms "
        f"in {dtype} are below 4 numel tiny), so their norms cannot be told from 0")


def squared_norm_tables(quantity, base, items, batch):
    """Every parameter's per-example squared norms (:class:`~cockpit_gradnoise.extensions.PerExampleSquaredNorms`)
    of ``items`` as one ``[P, N]`` table per dtype (:func:`~cockpit_gradnoise.functional.stacked_by_dtype`),
    for a ``values_of_many`` on other devices than the CPU; ``None`` where ``quantity`` forms its
    values one parameter at a time: no items, the CPU's paths (a few microseconds a parameter),
    parameters on more than one device, or a subclass of ``base`` with sums of its own."""
    if not quantity.forms_values_together(base, items):
        return None
    norms = [param.cgn_batch_l2.detach() for _, param in items]
    for squared_norms in norms:
        check_example_count(squared_norms.shape[0], batch.examples)
    return functional.stacked_by_dtype(norms)
