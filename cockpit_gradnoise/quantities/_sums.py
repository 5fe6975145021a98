"""A quantity's declared sums over the batch: added across micro-batches, reduced across processes.

:class:`DeclaredSums` is the part of
:class:`~cockpit_gradnoise.quantities._base.ParameterQuantity` that forms
the declared :attr:`~cockpit_gradnoise.ParameterQuantity.sums` of a step:
this process's (:meth:`DeclaredSums.local_sums`), those of every
micro-batch of an accumulated step (:class:`Accumulation`), and under
distributed training those of every process, where every quantity of a
cockpit call reduces its sums in one round of collectives
(:func:`reduced_sums`).
"""

import math
from typing import Any, Dict, Optional, Tuple

from cockpit_gradnoise import _device, distributed
from cockpit_gradnoise.extensions import sharded, tensor_parallel
from cockpit_gradnoise.logs.schema import NETWORK
from cockpit_gradnoise.quantities._accumulation import Accumulation
from cockpit_gradnoise.step import Batch, Step

import torch


def reduced_sums(step, quantity, params):
    """``(global Batch, {name: reduced sums})`` of ``quantity``, or ``None`` (skipped).

    The first quantity of the call to ask forms the local sums of every
    quantity that joined the call (:attr:`Step.members
    <cockpit_gradnoise.step.Step.members>`) and reduces them all in one
    round of collectives
    (:func:`~cockpit_gradnoise.distributed.reduce_step`); the others take
    their results, so no collective runs after the first quantity. A
    quantity that did not join reduces alone.
    """
    if quantity not in step.members:
        return _reduce(step, [quantity], params)[quantity]
    if step.reduced is None:
        step.reduced = {}  # taken, also if the reduction raises
        step.reduced = _reduce(step, step.members, params)
    return step.reduced.pop(quantity, None)


def _reduce(step, quantities, params):
    # Fixed by the model and the quantities, so the header has one length everywhere.
    slots = [(q, name) for q in quantities for name, _ in q.trainable(params)]
    contribution = distributed.Contribution(
        slots=[f"{type(q).__name__}:{name}" for q, name in slots]
    )
    parts, kept = {}, _with_their_shard(quantities, params, step.presharded)
    try:
        for q in quantities:
            parts[q] = q.step_sums(step, params)
        shards = _sharded_in_backward(step, parts, params)
        batches = [part[0] for part in parts.values() if part is not None]
        if any(not b.same_as(batches[0]) for b in batches):
            raise ValueError(
                f"the quantities read different batches from info at step "
                f"{step.global_step}: {batches}; pass consistent 'batch_size', "
                "'individual_losses' and 'loss'"
            )
        if batches:
            contribution.examples = batches[0].examples
            contribution.scale = batches[0].loss_scale
        entries = [(q, name, sum_name, sums[sum_name], how) for q, part in parts.items() if part is not None
                   for name, sums in part[1].items() for sum_name, how in q.sums.items()]
        contribution.sums = [
            (value.new_zeros(0) if (q, name) in kept
             else _non_finite(value) if (q, name, sum_name) in shards else value, how)
            for q, name, sum_name, value, how in entries
        ]
        if tensor_parallel.duplicate_examples(params):
            _contribute_no_examples(contribution, [(q, name, s) in shards for q, name, s, _, _ in entries])
    except Exception as error:  # every process must still take part, to raise together
        contribution.error, contribution.sums, shards = error, [], set()
    contribution.available = [
        parts.get(q) is not None and name in parts[q][1] for q, name in slots
    ]
    device = params[0].device if params else torch.device("cpu")
    reduced = distributed.reduce_step(contribution, device, step.global_step)
    batch = Batch(reduced.examples, reduced.scale)
    values = iter(reduced.sums)
    own = _added_over_dp(parts, kept)
    results = {}
    for q, part in parts.items():
        if part is None:
            results[q] = None
            continue
        sums = {name: {sum_name: next(values) for sum_name in q.sums} for name in part[1]}
        # Kept with their shard: this process's own, added over dp inside FSDP2.
        sums.update(own[q])
        results[q] = (batch, sums)
    _take_shards(shards, parts, results)
    return results


def _sharded_in_backward(step, parts, params) -> set:
    """``{(quantity, name, sum name)}`` of the per-element sums that FSDP2's parameters'
    hooks reduce-scattered inside the backward pass (:meth:`DeclaredSums.arm_reduction_in_backward`):
    this process's rows of the global sums already, not reduced again."""
    if not step.presharded:
        return set()
    return {(q, name, sum_name) for q, part in parts.items() if part is not None and q.sums_sharded_in_backward
            for name, param in q.trainable(params)
            if id(param) in step.presharded.get(q.sums_sharded_in_backward, ()) and name in part[1]
            for sum_name, value in part[1][name].items() if value.dim() > 0}


def _non_finite(shard):
    """What a sum reduce-scattered in the backward pass adds to the reduction: whether this
    process's rows hold a value that is not finite (0 or 1, float64, 0-dim), so that every
    process tells the same parameters' sums not finite."""
    return torch.logical_not(torch.isfinite(shard).all()).to(torch.float64)


def _take_shards(shards, parts, results) -> None:
    """Put this process's rows of the sums reduced in the backward pass in ``results``, in
    place of their counts of processes with values not finite; all NaN where there are."""
    if not shards:
        return
    keys = list(shards)
    counts = torch.stack([results[q][1][name][sum_name] for q, name, sum_name in keys]).tolist()
    for (q, name, sum_name), count in zip(keys, counts):
        shard = parts[q][1][name][sum_name]
        results[q][1][name][sum_name] = shard if count == 0 else torch.full_like(shard, math.nan)


def _with_their_shard(quantities, params, presharded) -> dict:
    """``{(quantity, name): dp mesh or None}`` whose sums are not reduced across every
    process: the per-element sums (``per_element_sums_stay``) of a parameter split by
    tensor parallelism, whose processes hold disjoint elements of it, each over every
    example of its batch; inside FSDP2 they are added over the ``dp`` mesh only, unless
    reduce-scattered over it in the backward pass already (in ``presharded``, by savefield:
    :attr:`Step.presharded <cockpit_gradnoise.step.Step.presharded>`)."""
    split = {id(param) for param, _, placements in tensor_parallel.split_parameters(params)
             if any(placement.is_shard() for placement in placements)}
    if not split:
        return {}
    managed = sharded.fsdp2_parameters()
    dp = {key: fsdp_param.mesh_info.mesh for key, fsdp_param in managed.items()}
    return {(q, name): dp.get(id(param)) for q in quantities if q.per_element_sums_stay
            for name, param in q.trainable(params) if id(param) in split
            and id(param) not in presharded.get(q.sums_sharded_in_backward, ())}


def _added_over_dp(parts, kept) -> dict:
    """``{quantity: {name: sums}}`` of the sums ``kept`` with their shard, added over their
    ``dp`` mesh where FSDP2 shards them (one ``all_reduce`` per mesh, dtype and mesh
    dimension: HSDP's replicate x shard mesh adds over both; collective)."""
    import torch.distributed as dist

    found: dict = {q: {} for q in parts}
    pending: dict = {}
    for (q, name), dp in kept.items():
        part = parts.get(q)
        if part is None or name not in part[1]:
            continue
        found[q][name] = sums = dict(part[1][name])
        for key, value in sums.items():
            if dp is not None:
                pending.setdefault((dp, value.dtype), []).append((sums, key))
    for (dp, _), entries in pending.items():
        buffer = torch.cat([sums[key].reshape(-1) for sums, key in entries])
        for dim in range(dp.ndim):
            dist.all_reduce(buffer, group=dp.get_group(dim))
        for (sums, key), block in zip(entries, buffer.split([sums[key].numel() for sums, key in entries])):
            sums[key] = block.view_as(sums[key])
    return found


def _scale_in_backward(step, field) -> Optional[float]:
    """This process's loss scale ``c`` for the sums of ``field`` reduced in the backward
    pass, or ``None`` (not reduced there) where a reader of it in the call does not declare
    them so; raises where ``c`` cannot be read (raised again after the backward pass)."""
    readers = step.readers.get(field, [])
    if not readers or any(getattr(q, "sums_sharded_in_backward", None) != field for q in readers):
        return None
    return step.loss_batch(readers[0]).loss_scale


def _contribute_no_examples(contribution, own):
    """Empty a part whose examples another process of its tensor-parallel mesh contributes:
    no examples, no rows, sums of 0 (the layout unchanged); but where ``own`` (per sum) is
    true: the flag of this process's rows of a sum reduced in the backward pass (its own
    elements: a value not finite there makes the row NaN on every process)."""
    contribution.examples = 0
    contribution.sums = [(value if mine else value[:0] if how == "cat" else torch.zeros_like(value), how)
                         for (value, how), mine in zip(contribution.sums, own)]


class DeclaredSums:
    """The declared sums of a :class:`~cockpit_gradnoise.ParameterQuantity`: local, accumulated, reduced.

    What the :class:`~cockpit_gradnoise.step.Step` and the quantity's
    ``_values`` ask; it reads the quantity's declarations and hooks
    (``sums``, ``step_context``, ``parameter_sums``, ``value_from_sums``,
    ``accepts``).
    """

    def local_sums(self, step: Step, params) -> Optional[Tuple[Batch, Dict[str, Dict[str, Any]]]]:
        """This process's :class:`Batch` and ``{name: declared sums}``, in per-example units.

        What :func:`reduced_sums` reduces across processes; ``None`` when
        ``step_context`` records nothing.
        """
        batch = self.step_context(step, params)
        if batch is None:
            return None
        if isinstance(batch, Batch) and math.isnan(batch.loss_scale):
            self._warn_if_loss_not_finite(step)  # its sums are NaN, so the reduced ones are
        if not isinstance(batch, Batch):
            raise TypeError(
                f"{type(self).__name__}.step_context returned {type(batch).__name__}: a quantity "
                "with declared sums returns a Batch, whose examples and loss scale are "
                "combined across processes"
            )
        self._warn_if_examples_interact(step)
        usable = step.usable(
            self, self.trainable(params), self._savefields, self._has_local_results,
            batch.examples,
        )
        sums = {name: self._checked_sums(param, batch) for name, param in usable}
        return batch, self._without_unresolved(step, usable, sums, batch)

    #: The keys of the sums :meth:`unresolved` reads where it checks a step's parameters
    #: together, after all their values (:meth:`unresolved_of_many`; they are kept until
    #: then: small ones only); ``None``: each parameter right after its value.
    unresolved_reads: Optional[Tuple[str, ...]] = None

    def unresolved(self, param, sums: Dict[str, Any], batch: Batch):
        """``(count, reason)`` where ``param``'s values cannot be exact from its ``sums`` (this
        process's, from :meth:`parameter_sums`) for squares of its contributions that underflow
        lost (:mod:`~cockpit_gradnoise.functional.underflow`): ``count`` (an int, or a 0-dim
        tensor on other devices than the CPU) of its elements or examples lost, ``reason(count)``
        the words; ``None`` where nothing can be lost. Such a parameter is left out, named in a
        warning. None by default."""
        return None

    def unresolved_of_many(self, items, batch: Batch) -> Dict[str, Any]:
        """``{name: unresolved(param, sums, batch)}`` of ``items`` ``[(name, param, sums)]``,
        the parameters of one step: one at a time by default; a quantity may check them
        together (on a GPU a few launches for all, not a few per parameter)."""
        return {name: self.unresolved(param, sums, batch) for name, param, sums in items}

    def _without_unresolved(self, step, usable, sums, batch):
        """``sums`` without the parameters :meth:`unresolved` finds, warning about them once.

        Before the sums are added across micro-batches and processes: counts on other
        devices than the CPU are read here, in one transfer per device."""
        found = self.unresolved_of_many([(name, param, sums[name]) for name, param in usable], batch)
        found = {name: pair for name, pair in found.items() if pair is not None}
        counts = _device.resolve({name: count for name, (count, _) in found.items()})
        left_out = self._told_unresolved(step, found, counts, "they have no rows at such steps and "
                                         f"are left out of {NETWORK!r}")
        return {name: value for name, value in sums.items() if name not in left_out}

    def _told_unresolved(self, step, found, counts, outcome: str) -> Dict[str, str]:
        """``{name: reason}`` of the parameters whose ``counts`` (of what :meth:`unresolved`
        found, ``found``) are not 0, told in a warning once, with ``outcome``."""
        reasons = {name: found[name][1](count) for name, count in counts.items() if count}
        if reasons:
            step.warn_names(
                "underflow", sorted(reasons),
                lambda names: f"{type(self).__name__} cannot give exact values for parameters "
                f"{names} (from step {step.global_step}): "
                + "; ".join(f"{n!r}: {reasons[n]}" for n in names)
                + f"; {outcome} (see docs/gradient-variance-quantiles.md, 'Squares that underflow')",
                self,
            )
        return reasons

    def arm_reduction_in_backward(self, step: Step, params=()) -> None:
        """Under FSDP2, reduce-scatter this quantity's per-element sums inside the coming
        backward pass, one parameter at a time (:func:`.extensions.sharded.reduce_in_backward`),
        where it declares them so (``sums_sharded_in_backward``: the savefield) and every
        reader of that savefield in the call does too; the parameters done are noted in
        :attr:`Step.presharded <cockpit_gradnoise.step.Step.presharded>`. Those of ``params``
        split by tensor parallelism too: inside FSDP2 (over ``dp``, the rows each process keeps
        those :func:`torch.chunk` gives it of its ``tp`` shard), and alone unless their
        per-element sums stay with their shard there anyway (``per_element_sums_stay``)."""
        field = self.sums_sharded_in_backward
        if field and self.supports_fsdp2 and distributed.world_size() > 1:
            sent = self.sent_in_backward(step, lambda: _scale_in_backward(step, field))
            sharded.reduce_in_backward(step, field, sent, step.presharded.setdefault(field, {}),
                                       params=params, split=self.supports_tensor_parallel,
                                       alone=not self.per_element_sums_stay)

    def sent_in_backward(self, step: Step, scale) -> sharded.Prepare:
        """What :meth:`arm_reduction_in_backward` reduce-scatters of a parameter (``prepare``
        of :func:`.extensions.sharded.reduce_in_backward`), ``scale()`` being this process's
        loss scale: by default the per-element sums ``[k, *shape]`` of the savefield, row 0
        in units of ``c``, the others of ``c**2``."""
        return sharded.sums_in_units(self.sums_sharded_in_backward, scale)

    def noted_squared_norms(self, step: Step, params) -> Dict[str, Any]:
        """``{name: ||sum_i g_i||^2}`` of this process's micro-batch gradient where the hooks
        of :meth:`arm_reduction_in_backward` noted it before they reduce-scattered it (the
        ``micro_batch_gradient`` sum is then this process's rows of every process's); none
        by default."""
        return {}

    def step_sums(self, step: Step, params) -> Optional[Tuple[Batch, Dict[str, Dict[str, Any]]]]:
        """:meth:`local_sums`, or at the last micro-batch of an accumulated step, those of all.

        What :func:`reduced_sums` reduces across processes.
        """
        micro = step.micro_batch()
        if micro is None:
            return self.local_sums(step, params)
        accumulated = self._accumulate(step, params, micro)
        if accumulated is None or accumulated.void:
            return None
        if accumulated.error is not None:
            raise accumulated.error
        if accumulated.dropped:
            step.warn_names(
                "accumulation-dropped", sorted(set(accumulated.dropped)),
                lambda names: f"parameters {names} got no per-example results in some "
                f"micro-batches of step {step.global_step} (unused in their forward pass): "
                f"they have no rows at such steps and are left out of {NETWORK!r}",
                self,
            )
        if accumulated.micro_batches:
            self.micro_batch_gradients = {step.global_step: accumulated.micro_batches}
        return accumulated.total()

    def _accumulate(self, step, params, micro) -> Optional[Accumulation]:
        """Add this micro-batch's sums to the step's; ``None`` where the step cannot be recorded."""
        held = self._accumulation
        if micro.index == 0:
            if held is not None:
                self._warn_incomplete(step, held)
            held = self._accumulation = Accumulation(step.global_step, micro.count)
        elif held is None or not held.expects(step.global_step, micro.index, micro.count):
            self._accumulation = None
            step.warn(
                "micro-batch-order",
                f"micro-batch {micro.index} of {micro.count} at step {step.global_step} does "
                f"not follow micro-batch {micro.index - 1} of the same step: this step is not "
                "recorded. Track every micro-batch of a step, in order, from micro_batch=0",
                self,
            )
            return None
        if micro.last:
            self._accumulation = None
        if not self.sums:  # param.grad accumulates: only the order is followed
            held.next += 1
            return held
        try:
            part = self.local_sums(step, params)
        except Exception as error:
            if distributed.world_size() == 1:
                self._accumulation = None
                raise
            # Raised at the last micro-batch, where every process takes part.
            held.error, part = held.error or error, None
        if part is None:
            held.next += 1
            held.void = held.void or held.error is None
        else:
            held.add(*part, self.sums, self.micro_batch_gradient, self.noted_squared_norms(step, params))
        return held

    def forget_step(self, global_step: int) -> None:
        """Drop the micro-batches held of ``global_step``: a step the ``GradScaler`` skips
        (logged as skipped), whose later micro-batches are not computed, so that the next
        step does not warn that it ended early."""
        held = self._accumulation
        if held is not None and held.global_step == global_step:
            self._accumulation = None

    def _warn_incomplete(self, step, held):
        step.warn(
            "incomplete-accumulation",
            f"step {held.global_step} ended after {held.next} of its {held.count} "
            f"micro-batches (micro_batches={held.count}): it is not recorded. Track every "
            "micro-batch of a step, with micro_batches the number of micro-batches in it",
            self,
        )

    def _global_values(self, step, params):
        """As :meth:`_local_values`, for the global batch: the sums reduced across processes."""
        reduced = reduced_sums(step, self, params)
        if reduced is None:
            return None
        return self._values_of_sums(step, *reduced)

    def _values_of_sums(self, step, batch, sums):
        """As :meth:`_local_values`, from sums over the batch (reduced, or accumulated)."""
        if not self.accepts(batch):
            return None
        # The parameters with results on every process, in order (see local_sums);
        # the reduced sums are identical on every process, so is this split.
        usable = list(sums)
        finite = {name: step.finite(list(sums[name].values())) for name in usable}
        values = [
            (name, self.named_value_from_sums(name, sums.pop(name), batch)) for name in usable if finite[name]
        ]
        # A process's non-finite loss made its sums, and so the reduced ones, NaN.
        return usable, values, finite, True

    def _checked_sums(self, param, context) -> Dict[str, torch.Tensor]:
        sums = self.parameter_sums(param, context)
        if set(sums) != set(self.sums):
            raise TypeError(
                f"{type(self).__name__}.parameter_sums returned {sorted(sums)}, "
                f"but the class declares sums {sorted(self.sums)}"
            )
        return sums
