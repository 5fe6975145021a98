"""Per-layer quantiles of the gradient's standard deviation, from one batch."""

from typing import Dict, List, NamedTuple, Optional, Set, Tuple

from cockpit_gradnoise import _device, distributed, functional, order_statistics
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions, arena
from cockpit_gradnoise.extensions.precision import accumulation_dtype
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities import _shards
from cockpit_gradnoise.quantities._base import ParameterQuantity
from cockpit_gradnoise.quantities._declarations import SUM
from cockpit_gradnoise.quantities._shared_checks import remember, unresolved_sums_once
from cockpit_gradnoise.step import Batch

import torch
from torch import Tensor


class GradientVarianceQuantiles(ParameterQuantity):
    """How noisy is each gradient element? Quantiles over a layer's elements.

    For element ``j`` of a parameter, the standard deviation of the mini-batch
    gradient ``param.grad[j]``, estimated from the ``N`` examples of one batch,

    .. math::

        \\mathrm{sd}_j = \\sqrt{\\frac{N}{N-1} \\sum_{i=1}^N (x_{ij} - \\bar x_j)^2},

    where ``x_ij`` is example ``i``'s contribution to ``param.grad[j]``
    (:func:`~cockpit_gradnoise.functional.gradient_sd`; units of
    ``param.grad``). Statistics per parameter and for ``"all"`` (every element
    of the network): ``q<level>`` (exact, as ``numpy.quantile``) and ``mean``
    of ``sd_j``; ``snr_mean`` and ``snr_q0.5`` of ``|grad_j| / sd_j`` over
    the elements that are not ``0 / 0``, capped at the largest ratio the
    one-pass formula resolves, ``R = sqrt((N - 1) / ((3N + 4) eps))``
    (:func:`~cockpit_gradnoise.functional.resolvable_snr`): an element with
    ``sd_j = 0`` (its examples agree to rounding) and ``grad_j != 0`` counts
    as ``R``, above every other element (absent when every element is ``0 / 0``).

    Declared sums per parameter: ``sum_i x_ij`` and ``sum_i x_ij**2``, both
    summed from one computation of the contributions ``x_ij`` (the extension
    :class:`~cockpit_gradnoise.extensions.SumsOfContributions`), not
    ``param.grad``, which sums the same numbers
    in another order: so that identical examples give ``sd_j = 0`` exactly
    (:func:`~cockpit_gradnoise.functional.variance_rounding_bound`, with
    ``inner_terms = 1``; where a convolution's sums expand the square over its
    few positions, plus
    :func:`~cockpit_gradnoise.functional.expansion_rounding_bound`).
    Needs ``info["individual_losses"]`` (or ``info["batch_size"]``); under
    distributed training and gradient accumulation ``info["individual_losses"]``
    and ``info["loss"]``, to add the processes' (micro-batches') sums in
    per-example units (``x_ij / c``; see ``docs/distributed.md``,
    ``docs/accumulation.md``), and the whole batch's ``x_ij = c g_ij`` with
    ``c = 1/N`` for a mean loss, ``1`` for a sum.
    With batch size 1 no variance is defined: nothing is recorded, with one
    warning.

    Under FSDP2 (``fully_shard``) each process keeps only its rows of the
    reduced sums (those FSDP2 gives it of the parameter; reduce-scattered inside
    the backward pass as each layer's gradient is accumulated:
    ``sums_sharded_in_backward``), forms sd and SNR
    there, and the quantiles over all processes' elements come from a
    distributed selection
    (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries_across`),
    identical on every process (``docs/distributed.md``). Under HSDP (a replicate x
    shard mesh) the sums are added over the replicas as well, and only a shard's first
    replica holds its rows, so that each element is counted once. Under tensor
    parallelism (``parallelize_module``, a 1-D mesh) a split parameter's sums
    are this process's, of its shard, over every example: they stay there, not
    reduced (inside FSDP2, on a ``("dp", "tp")`` mesh, reduce-scattered over ``dp`` only,
    in the backward pass: each process keeps its rows of its shard's); the quantiles as
    under FSDP2.

    Memory: on the CPU, for one batch on one process, where every layer's
    sums lie in the backward pass's one buffer (:mod:`~cockpit_gradnoise.extensions.arena`:
    from the second tracked step of a model whose sums are all two matrix
    products or sums of per-example contributions, such as an MLP), sd and
    SNR are formed over the sums and their quantiles taken there; in a network
    of :data:`OVER_SUMS_AT_LEAST` elements or more (VGG-11), over each layer's
    own sums (the small layers' over one copy of theirs); otherwise into two
    buffers of the network's elements. Over the sums only where nothing reads
    them afterwards, which holds when all of these do:

    - one batch on one process: under gradient accumulation the sums are the
      micro-batches' added, under distributed training the processes' reduced
      (and FSDP2's rows), held for the reduction or the next micro-batch;
    - no other quantity of the cockpit call reads the savefield
      (:class:`~cockpit_gradnoise.PreconditionedNoiseScale`, a quantity of the
      user's declaring :class:`~cockpit_gradnoise.extensions.SumsOfContributions`:
      :attr:`Step.readers <cockpit_gradnoise.step.Step.readers>`, known before
      the backward pass), which must find them unaltered whichever computes first;
    - per parameter, no other tensor on it (``param.grad``, its data, another
      savefield) lies in the sums' storage: the ``torch.func`` fallback leaves its
      local gradient, which GradientNoiseScale reads, as the sums' row 0; such a
      layer's sd and SNR are formed over a copy of its sums;
    - no two layers' sums overlap in memory
      (:func:`~cockpit_gradnoise.functional.fused.disjoint`), else into buffers.

    Each layer's sums are read once, by the formation of its own sd and SNR,
    before they are overwritten. A savefield formed over is then taken off its
    parameter (Cockpit would remove it after the step): a reader the call does
    not know of (a Cockpit quantity of another base class computing after this
    one, or the user after the step where an extension passed to the cockpit
    call kept the savefield) finds no sums, never sd and SNR under their name.
    The rows are the same numbers whichever way sd and SNR are formed (the same
    operations on the same sums, written into other memory; VGG-11's rows at
    batch 2 identical to the buffers' bit for bit, ``benchmarks/README.md``).

    Args:
        track_schedule: Function from step to bool.
        quantiles: Quantile levels in ``[0, 1]``.
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

    extension_classes = (SumsOfContributions,)
    supports_fsdp2 = True
    #: Under tensor parallelism a split parameter's sums stay with its shard (inside FSDP2
    #: added over dp), whole sums of every other parameter are held by the first process of
    #: the tp group; the quantiles as under FSDP2.
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True
    #: Under HSDP the sums are added over the replicas too, and a shard's elements are held by
    #: its first replica only (quantities/_shards.py): each counted once in the selection.
    supports_hsdp = True
    per_element_sums_stay = True
    sums_sharded_in_backward = SUMS_SAVEFIELD  # under FSDP2: each process keeps its rows
    # "rounding_magnitudes": R of sums expanded over positions (a convolution's
    # weight with few positions: functional.expansion_rounding_bound); 0-dim 0 elsewhere.
    sums = {"sum_of_contributions": SUM, "sum_of_squared_contributions": SUM,
            "rounding_magnitudes": SUM}

    def __init__(
        self,
        track_schedule,
        *,
        quantiles=(0.05, 0.25, 0.5, 0.75, 0.95),
        param_names=None,
        verbose=False,
    ):
        super().__init__(track_schedule, param_names=param_names, verbose=verbose)
        self.quantiles = order_statistics.check_quantile_levels(quantiles)
        self._in_place = True  # sd and SNR may overwrite the sums (step_context)
        self._own_sums = False  # each layer's sums are this step's own, read by no one after (step_context)
        self._overwritten: List[Tensor] = []  # parameters whose sums sd and SNR may overwrite
        self._cuts = None  # under FSDP2, {name: this process's rows} (step_context)
        self._checks = None  # the call's Step.shared_checks (step_context)

    def step_context(self, step, params):
        self._checks = step.shared_checks  # the underflow check shared with PreconditionedNoiseScale
        # Not in place where another quantity of the call reads the sums (PreconditionedNoiseScale).
        self._in_place = all(q is self for q in step.readers.get(SUMS_SAVEFIELD, ()))
        self._cuts = _shards.cuts(self.trainable(params), step.presharded.get(SUMS_SAVEFIELD, {}))
        self._own_sums, self._overwritten = False, []
        if distributed.world_size() > 1 or step.micro_batch() is not None:
            return step.loss_batch(self)  # sums in units of g_i, to add across batches
        self._own_sums = self._in_place  # each layer's sums: _formed, _viewed_elsewhere
        # One batch on one process: the sums stay in units of x (scale 1), as sd
        # is wanted in them, and the reduction need not be known. sd and SNR can
        # then be formed over the sums: the next backward pass of this model
        # writes them into one buffer (extensions.arena).
        arena.confirm(step.facts)
        return Batch(step.examples(self), 1.0)

    def accepts(self, batch):
        if batch.examples < 2:
            self.warn_once(
                "batch-size-1",
                "batch size 1 defines no gradient variance; nothing is recorded at "
                "such steps",
            )
            return False
        return True

    def parameter_sums(self, param, batch):
        # Views of what the backward pass left (overwritten by sd and SNR where
        # they tile one buffer: _formed). Both sums are this process's own,
        # also under distributed training.
        field = getattr(param, SUMS_SAVEFIELD).detach()
        if self._in_place and _device.on_host(field) and _viewed_elsewhere(param, field):
            # Another attribute of the parameter views its sums (the torch.func fallback's
            # local gradient is their row 0, read by GradientNoiseScale): sd and SNR are
            # formed over a copy of this layer's.
            field = field.clone()
        elif self._own_sums:
            self._overwritten.append(param)
        grad, squares, *magnitudes = field
        magnitudes = magnitudes[0] if magnitudes else squares.new_zeros(())
        # The extensions may keep float32 sums in float64 (where squares
        # below 1e-38 would underflow); the gradient's sum goes back, exactly,
        # to the dtype it was accumulated in, which sets the rounding bound
        # (float32 for bfloat16 and float16 parameters: extensions.precision).
        grad = grad.to(accumulation_dtype(param.dtype))
        if batch.loss_scale != 1.0:  # in units of g_i, to add across processes
            grad, squares = grad / batch.loss_scale, squares / batch.loss_scale**2
            magnitudes = magnitudes / batch.loss_scale**2
        return {"sum_of_contributions": grad, "sum_of_squared_contributions": squares,
                "rounding_magnitudes": magnitudes}

    def unresolved(self, param, sums, batch):
        squares, grad = sums["sum_of_squared_contributions"], sums["sum_of_contributions"]
        row = getattr(param, SUMS_SAVEFIELD)[0] if batch.loss_scale == 1.0 else None  # grad: row.to(dtype)
        count = unresolved_sums_once(self._checks, param, squares, grad, batch.examples, batch.loss_scale, row)
        return _told(count, squares.dtype)

    def values_of_many(self, items, batch, deferred):
        # On other devices every parameter's sd and SNR formed together, a bounded number of
        # elements at a time (functional.gradient_sd_of_many: each one's own numbers, a few
        # launches a group where value_from_sums takes about fifty a parameter), and their
        # underflow counts with them (unresolved_sums_of_segments: the same counts, kept for
        # PreconditionedNoiseScale as unresolved would). FSDP2's shards, a subclass's own sums,
        # sums in units of g_i and a parameter without elements: one at a time.
        if self._cuts is not None or batch.loss_scale != 1.0 or not self.forms_values_together(
                GradientVarianceQuantiles, items,
                ("parameter_sums", "value_from_sums", "named_value_from_sums", "unresolved")):
            return None
        fields = [getattr(param, SUMS_SAVEFIELD).detach() for _, param in items]
        if any(field[0].numel() == 0 for field in fields):
            return None
        groups: Dict[tuple, List[int]] = {}
        for k, ((_, param), field) in enumerate(zip(items, fields)):
            key = (field.device, field.dtype, accumulation_dtype(param.dtype), field.shape[0] == 3)
            groups.setdefault(key, []).append(k)
        found = {}
        for (_, _, dtype, expanded), members in groups.items():
            for part in _parts(members, [fields[k][0].numel() for k in members]):
                found.update(self._values_of_part([items[k] for k in part], [fields[k] for k in part],
                                                  dtype, expanded, batch.examples, deferred))
        if self._own_sums:
            self._overwritten += [param for _, param in items]
        return found

    def _values_of_part(self, items, fields, dtype, expanded, n, deferred):
        """``{name: (sd, SNR, 0)}`` of ``items`` (their savefields ``fields``), formed together;
        each one's underflow count into ``deferred``."""
        numels = [field[0].numel() for field in fields]
        # The same parameters every step: their lengths on the device made once (the segments').
        _, _, lengths = order_statistics.segment_layout(tuple(numels), fields[0].device)
        squares = torch.cat([field[1].reshape(-1) for field in fields])
        # The gradient's sum back to the dtype it was accumulated in, as parameter_sums does.
        total = torch.cat([field[0].reshape(-1) for field in fields]).to(dtype)
        counts = functional.unresolved_sums_of_segments(squares, total, lengths, n).unbind()
        magnitudes = torch.cat([field[2].reshape(-1) for field in fields]) if expanded else None
        sd = functional.gradient_sd_of_many(squares, total, lengths, n, dtype=dtype, magnitudes=magnitudes)
        snr = functional.signal_to_noise(total, sd, functional.resolvable_snr(n, dtype))
        found = {}
        for (name, param), field, sd_k, snr_k, count in zip(items, fields, sd.split(numels), snr.split(numels),
                                                            counts):
            remember(self._checks, param, field[1], field[0], dtype, n, count)
            deferred.append((name, param, {_COUNT: _told(count, field.dtype)}))
            found[name] = (sd_k.view(field.shape[1:]), snr_k, 0)
        return found

    def unresolved_of_many(self, items, batch):
        # values_of_many's counts, found with the values; parameter_sums' sums otherwise.
        return {name: sums[_COUNT] if _COUNT in sums else self.unresolved(param, sums, batch)
                for name, param, sums in items}

    def named_value_from_sums(self, name, sums, batch):
        if self._cuts is not None:  # FSDP2: this process's elements of the reduced sums
            rank = distributed.rank()
            sums = {key: _shards.local_part(value, self._cuts[name], rank) for key, value in sums.items()}
        return self.value_from_sums(sums, batch)

    def value_from_sums(self, sums, batch):
        grad, squares = sums["sum_of_contributions"], sums["sum_of_squared_contributions"]
        magnitudes = sums["rounding_magnitudes"]
        if self._cuts is None and _fused(grad, squares, magnitudes):
            # Formed with the other layers' in statistics_of_values: into
            # buffers of the network's elements, small layers together (sums
            # expanded over positions alone: their bound adds their R).
            return _Sums(squares, grad, batch, None if magnitudes.dim() == 0 else magnitudes)
        # The sums were accumulated in the contributions' dtype (grad's), whose
        # rounding the bound takes; squares may be wider (float64 for float32
        # models: no underflow). sd is computed and reported in grad's dtype.
        extra = None if magnitudes.dim() == 0 else functional.expansion_rounding_bound(
            magnitudes, batch.examples, grad.dtype)
        sd = functional.gradient_sd(squares, grad, batch.examples, dtype=grad.dtype,
                                    extra_rounding=extra)
        # SNR is elementwise and free of units: the network's elements are the
        # layers', computed once. Elements whose examples agree to rounding
        # (sd 0, grad not 0) count at the largest resolvable SNR.
        snr = functional.signal_to_noise(
            grad, sd, functional.resolvable_snr(batch.examples, grad.dtype)
        )
        if batch.loss_scale != 1.0:  # sums in units of g_i: sd of x_i = c g_i
            sd.mul_(batch.loss_scale)
        return sd, snr, 0  # the SNR's left-out elements are absent here

    def network_value(self, values):
        return list(values)

    def statistics(self, value):
        return self.statistics_of_values(value, network=True)[1]

    def statistics_of_values(self, values, network):
        if not values:
            return [], None
        values, joined, written = _formed(values, self._in_place, self._own_sums)
        # A savefield that sd and SNR overwrote no longer holds the sums: taken off its
        # parameter now (Cockpit removes it after the step), so that nothing reads it
        # for sums, in this step or after (not even where it is kept past the step).
        for param in self._overwritten:
            field = param.__dict__.get(SUMS_SAVEFIELD)
            if isinstance(field, Tensor) and field.untyped_storage().data_ptr() in written:
                del param.__dict__[SUMS_SAVEFIELD]
        self._overwritten = []
        sds, snrs, left_out = zip(*values)
        if self._cuts is not None:  # FSDP2: each process holds some elements of each layer
            return functional.sd_statistics_across(sds, snrs, self.quantiles, network)
        if _device.on_host(sds[0]):
            # Reorders the values, which are this step's own and read only here.
            return functional.sd_statistics_in_place(
                sds, snrs, left_out, self.quantiles, network, joined
            )
        return functional.sd_statistics_of_layers(sds, snrs, self.quantiles, network)

    def statistic_names(self):
        return schema.sd_statistic_names(self.quantiles)


#: ``values_of_many``'s key of a parameter's underflow count, found with the values.
_COUNT = "unresolved, found with the values"

#: Elements of sums joined at most in ``values_of_many`` (each parameter with its group's or
#: alone): about 60 bytes each while formed (the sums' copies, scales, the wide sd).
_PART_ELEMENTS = 1 << 22


def _parts(members: List[int], numels: List[int]) -> List[List[int]]:
    """``members`` in runs of at most :data:`_PART_ELEMENTS` elements (one larger alone)."""
    parts, size = [], 0
    for k, numel in zip(members, numels):
        if not parts or size + numel > _PART_ELEMENTS:
            parts.append([])
            size = 0
        parts[-1].append(k)
        size += numel
    return parts


def _told(count, dtype: torch.dtype):
    """``(count, reason)`` of :meth:`GradientVarianceQuantiles.unresolved`, ``None`` without count."""
    return None if count is None else (count, lambda k: (
        f"the squares of the per-example contributions of {k} of its elements underflow "
        f"(their sums in {dtype} are below 4 N tiny), so their sd and SNR cannot "
        "be told from 0 and the SNR cap"))


def _viewed_elsewhere(param: Tensor, sums: Tensor) -> bool:
    """Whether ``param.grad``, its data or a tensor attribute of ``param`` other than the
    sums savefield lies in the storage of ``sums`` (``LOCAL_GRADIENT_SAVEFIELD`` as
    ``sums[0]``): then forming sd and SNR over ``sums`` would change what it reads."""
    storage = sums.untyped_storage().data_ptr()
    others = [param.grad, param.data] + [value for key, value in vars(param).items()
                                         if key != SUMS_SAVEFIELD]
    return any(isinstance(other, Tensor) and _storage_address(other) == storage for other in others)


def _storage_address(tensor: Tensor) -> Optional[int]:
    """Where ``tensor``'s storage lies; ``None`` for a storage that holds no memory to share
    (FSDP2's unsharded parameters between passes: torch refuses its data pointer)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _fused(grad, squares, magnitudes) -> bool:
    """Whether :func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise` serves these sums
    (``magnitudes``: ``R``, or 0-dim where the sums are not expanded)."""
    return (
        _device.on_host(grad)
        and grad.dtype == squares.dtype
        and grad.dtype in (torch.float32, torch.float64)
        and grad.stride() == squares.stride()
        and (magnitudes.dim() == 0
             or (magnitudes.dtype == squares.dtype and magnitudes.stride() == squares.stride()))
    )


class _Sums(NamedTuple):
    """A layer's sums, whose sd and SNR are formed with the other layers' (:func:`_formed`)."""

    squares: Tensor
    grad: Tensor
    batch: Batch
    #: ``R`` of sums expanded over positions
    #: (:func:`~cockpit_gradnoise.functional.expansion_rounding_bound`), else None.
    magnitudes: Optional[Tensor]

    def layer(self) -> Tuple[Tensor, ...]:
        """``(S, T)``, or ``(S, T, R)``: a layer of :func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise`."""
        return (self.squares, self.grad) + (() if self.magnitudes is None else (self.magnitudes,))


def _formed(values, in_place: bool = True, own_sums: bool = False
            ) -> Tuple[list, Optional[Tuple[Tensor, Tensor]], Set[int]]:
    """The values with every :class:`_Sums` formed: ``[(sd, snr, left out)]``, the
    buffers of all layers' sd and SNR where they hold the whole network (else None),
    and the storages (``data_ptr``) of the sums that sd and SNR were formed over.

    Layers of one dtype are formed together (over their sums, overwritten, where
    ``in_place`` and they tile one buffer; where ``own_sums`` and they hold
    :data:`OVER_SUMS_AT_LEAST` elements or more, over each layer's own sums)
    (:func:`~cockpit_gradnoise.functional.sd_and_signal_to_noise`); the SNR of
    an element left out is a counted ``0.0`` there, absent elsewhere.
    """
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for k, value in enumerate(values):
        if isinstance(value, _Sums):
            by_dtype.setdefault(value.grad.dtype, []).append(k)
    values, joined, written = list(values), None, set()
    for indices in by_dtype.values():
        batch = values[indices[0]].batch
        limit = functional.resolvable_snr(batch.examples, values[indices[0]].grad.dtype)
        layers = [values[k].layer() for k in indices]
        # Sums of this step's one batch that tile one buffer: overwritten by sd and SNR.
        union = arena.union_of(layers) if batch.loss_scale == 1.0 and in_place else None
        # Each layer's own sums (no buffer of the network's elements) where the network's
        # quantiles are selected over the layers' arrays without joining them.
        over_sums = own_sums and sum(layer[1].numel() for layer in layers) >= OVER_SUMS_AT_LEAST
        sd, snr, sds, snrs, left_out = functional.sd_and_signal_to_noise(
            layers, batch.examples, limit, union, over_sums=over_sums and union is None
        )
        if batch.loss_scale != 1.0:  # sums in units of g_i: sd of x_i = c g_i
            sd.mul_(batch.loss_scale)
        for k, formed in zip(indices, zip(sds, snrs, left_out)):
            values[k] = formed
        written.update(layer[1].untyped_storage().data_ptr() for layer, snr_k in zip(layers, snrs)
                       if snr_k.untyped_storage().data_ptr() == layer[1].untyped_storage().data_ptr())
        if len(indices) == len(values) and sd is not None:
            joined = sd, snr
    return values, joined, written


#: Networks of at least this many elements (of one dtype) have their sd and SNR formed
#: over each layer's own sums where they may be overwritten (``step_context``,
#: :func:`_viewed_elsewhere`): the network's quantiles are then selected over the layers'
#: arrays, not a joined copy (:data:`~cockpit_gradnoise.order_statistics.BRACKET_AT_LEAST`).
#: Below it the union is a joined copy, which the two buffers of the network's elements spare.
OVER_SUMS_AT_LEAST = order_statistics.BRACKET_AT_LEAST
