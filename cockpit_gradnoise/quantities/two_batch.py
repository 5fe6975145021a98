"""The gradient noise scale from micro-batch and process gradient norms alone: no BackPACK.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1: the squared norm of a small batch's mean gradient and
of a big batch's give ``|G|^2`` and ``tr(Sigma)``
(:func:`~cockpit_gradnoise.functional.two_batch_noise_scale_estimates`).
Under gradient accumulation and DataParallel training both batches come for
free: each micro-batch on each process is a small batch, the optimizer's
accumulated, all-reduced gradient is the big one. This is what nanoGNS and
k-diffusion compute; it costs one float64 norm of every gradient per
backward pass (a tensor hook on each parameter,
:func:`~cockpit_gradnoise.functional.norm_tensor`; the norms stay tensors
until the micro-batch closes, then are gathered in one vector) and, under
DDP, two small all-reduces per step. It needs at least two small batches per step (two
micro-batches, or two processes).

Its estimates are noisier than :class:`~cockpit_gradnoise.GradientNoiseScale`'s,
which sees every example's gradient: a handful of small batches per step
instead of ``N`` examples; ``b_simple_smoothed`` averages over steps.
"""

import functools
import math
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

from cockpit_gradnoise import _device, distributed, fsdp2, functional
from cockpit_gradnoise.extensions import sharded, tensor_parallel
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities.gradient_noise_scale import DEFAULT_SMOOTHING, smoothed_noise_scale
from cockpit_gradnoise.step import Step

import torch
from cockpit.quantities.quantity import Quantity
from torch import Tensor, nn


class TwoBatchNoiseScale(Quantity):
    """``B_simple = tr(Sigma) / |G|^2`` per parameter and for the network, from gradient norms.

    Example (4 micro-batches per optimizer step, also under DDP)::

        noise = cgn.TwoBatchNoiseScale(model)
        for step, micro_batches in enumerate(loader):
            for x, y in micro_batches:
                (F.cross_entropy(model(x), y) / len(micro_batches)).backward()
                noise.micro_batch(len(x))
            noise.step(step)               # before optimizer.zero_grad()
            optimizer.step()
            optimizer.zero_grad()

    A tensor hook on every trainable parameter keeps the squared norm of each
    backward pass's own gradient (before it is added to ``param.grad``, and
    before DDP averages it), in float64. :meth:`micro_batch` closes one
    backward pass: its examples and the weight of each example's loss in it.
    :meth:`step` reads ``param.grad``, the big batch, and records per
    parameter and for ``"all"`` (norms summed over parameters):
    ``grad_sq``, ``trace_cov``, ``b_simple`` (``+inf`` when ``grad_sq <= 0``),
    ``b_simple_smoothed`` (moving averages of both, as
    :class:`~cockpit_gradnoise.GradientNoiseScale`) and ``batch_size`` (all
    examples of the step, on all processes).

    The big batch's gradient is ``param.grad`` with DDP's average undone:
    ``G_B = W param.grad / sum_k w_k b_k`` (``W`` processes, micro-batch ``k``
    of ``b_k`` examples weighted ``w_k``), and its effective size is
    ``(sum_k w_k b_k)^2 / sum_k w_k^2 b_k``, the number of examples when all
    weights are equal.

    It is also a Cockpit quantity, which the front door builds for the
    ``"norms"`` preset (``cgn.track(model, quantities="norms")``): around every
    micro-batch of a tracked step (``tracker(step, losses, micro_batch=k,
    micro_batches=K)``, see ``docs/accumulation.md``) it closes the micro-batch
    with the weight the tracker's loss gives, and records the step after the
    last one; its hooks record only during tracked steps.

    Args:
        model: The model (a DDP wrapper is fine); its trainable parameters
            now. Unchanged apart from the hooks (:meth:`remove` takes them off).
            Not with ``param_names``.
        track_schedule: Cockpit's schedule (step to bool), when the quantity
            runs in a Cockpit; ``None`` (default): on its own, by
            :meth:`micro_batch` and :meth:`step`.
        param_names: ``{name: parameter}``, as the front door gives it, instead of ``model``.
        smoothing: Weight of the past in ``b_simple_smoothed``, in ``[0, 1)``.
        verbose: Cockpit's verbose flag.
    """

    name = "TwoBatchNoiseScale"
    #: The front door builds it with the parameters (``param_names``), not only their names.
    needs_parameters = True
    #: Under FSDP2 the small batches' norms come from FSDP2's unsharded parameters (:mod:`.fsdp2`).
    supports_fsdp2 = True
    #: Under tensor parallelism (alone or inside FSDP2) each process's squared norms of a split
    #: parameter's elements add over the mesh, examples counted once per tp group (:meth:`_over_tp`).
    supports_tensor_parallel = True
    #: Under HSDP every process's micro-batch is a small batch; the big batch's squared norm
    #: adds each shard once, from its first replica (:meth:`_big_squared_norms`).
    supports_hsdp = True

    def __init__(self, model: Optional[nn.Module] = None, track_schedule=None, *,
                 param_names: Optional[Dict[str, nn.Parameter]] = None,
                 smoothing: float = DEFAULT_SMOOTHING, verbose: bool = False):
        super().__init__(track_schedule or (lambda step: True), verbose=verbose)
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must lie in [0, 1) (the weight of the past), got {smoothing!r}")
        if (model is None) == (param_names is None):
            raise ValueError("give the model, or param_names={name: parameter}, not both")
        named = (list(param_names.items()) if model is None else
                 [(n, p) for n, p in distributed.unwrap(model).named_parameters()])
        named = [(n, p) for n, p in named if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameter")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.smoothing = float(smoothing)
        #: On its own every backward pass counts; in a Cockpit those of tracked steps.
        self._standalone = track_schedule is None
        self._armed = self._standalone
        self.warned = set()  # keys of Step.warn told to this quantity
        self._averages: Dict[str, Tuple[float, float]] = {}
        # This backward pass's norms as the hooks give them, [(parameter index, 0-dim float64)]:
        # gathered into one vector when the micro-batch closes (no per-parameter indexing).
        self._pending: Optional[List[Tuple[Optional[int], Tensor]]] = None
        self._micro_batches: List[Tuple[Tensor, int, Optional[float]]] = []
        self._orders: Dict[tuple, _Order] = {}  # _order_of's
        self._dropped = False  # a micro-batch of this step was refused (micro_batch)
        # The hooks on the parameters: on its own always; in a Cockpit only from a tracked
        # step's call to the end of the last tracked step before an untracked one (_hook, _park),
        # so that an untracked backward pass makes no Python call per parameter.
        self._handles, self._removed = [], False
        #: FSDP2: hooks on the unsharded copies, made at tracked steps ({index: (copy, handle)}).
        self._sharded, self._unsharded_hooks = fsdp2.is_sharded(self.params), {}
        #: Tensor parallelism: (mesh, which local norms this process counts, first of the mesh).
        self._tp = tensor_parallel.norm_counts(self.params) if self._sharded else None
        if self._sharded:  # its big batch adds each process's shard, once per shard
            self._check_layout()
            if self._standalone:
                raise TypeError("under FSDP2 (fully_shard) or tensor parallelism TwoBatchNoiseScale "
                                "runs in a Cockpit: cgn.track(model, quantities=\"norms\") after "
                                "fully_shard, or cgn.Cockpit(params, quantities=[cgn.TwoBatchNoiseScale("
                                "track_schedule=..., param_names=...)])")
            self._sharded = fsdp2.fsdp2_managed(self.params)  # not tensor parallelism alone
        if self._standalone:  # after self._tp: the hooks depend on it (_hook_of)
            self._hook()

    def _check_layout(self):
        distributed.check_not_sharded(self.params, fsdp2=True, tensor_parallel=True,
                                      fsdp2_tensor_parallel=True, hsdp=True, quantity="TwoBatchNoiseScale")

    def _record(self, index: int, grad: Tensor) -> None:
        if not self._armed:
            return
        if self._pending is None:
            self._pending = []
        if self._tp is not None:  # this process's elements (a SequenceParallel norm's: summed first)
            grad = tensor_parallel.local_values(grad)
        # Accumulated in float64 (squares of float32 and narrower values are exact there), a
        # large CPU gradient by pieces; squared once per micro-batch, on the gathered vector.
        self._pending.append((index, functional.norm_tensor(grad)))

    def _squared_norms(self, pending: List[Tuple[Optional[int], Tensor]]) -> Tensor:
        """The squared norms of one backward pass, ``[params]`` float64, from the hooks' norms
        ``(index, norm)``, or from a checkpoint's squared norms of every parameter
        ``(None, squared norms)``."""
        device = pending[0][1].device
        order = self._order_of(pending, device)
        norms = [norm if norm.device == device else norm.to(device) for i, norm in pending if i is not None]
        if order.inverse is not None:  # every parameter once: the squares put in parameter order
            return torch.stack(norms).square_().index_select(0, order.inverse)
        total = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        if norms:
            total.index_add_(0, order.index, torch.stack(norms).square_())
        for i, squared in pending:
            if i is None:
                total += squared.to(device)
        return total

    def _order_of(self, pending: List[Tuple[Optional[int], Tensor]], device) -> "_Order":
        """The order in which the hooks gave ``pending``'s norms, kept per order and device:
        the backward pass reaches the parameters in the same order at every micro-batch (a
        tensor from a list, and a search for a parameter reached twice, cost more than the sum)."""
        indices = tuple(i for i, _ in pending)
        key = (indices, device)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) >= 8:  # orders that change (a model whose path varies)
                self._orders.clear()
            order = self._orders[key] = _order(indices, self.names, device)
        return order

    def micro_batch(self, examples: int, weight: Optional[float] = None) -> None:
        """Close the backward pass just run: ``examples`` examples, each loss weighted ``weight``.

        Args:
            examples: Examples in this micro-batch (on this process), at least 1.
            weight: The factor of each example's loss in the loss just
                differentiated. Default: the micro-batch's mean divided by the
                number of micro-batches of the step (``loss.mean() / K``),
                i.e. ``1 / (examples * K)``. For ``loss.sum()``, 1.

        Raises:
            RuntimeError: If no gradient reached a parameter since the last call, or
                two backward passes reached one (the micro-batch is dropped).
        """
        if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
            raise ValueError(f"examples must be a positive int, got {examples!r}")
        if weight is not None and not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a positive finite number, got {weight!r}")
        if self._pending is None:
            raise RuntimeError(
                "no gradient reached the model's parameters since the last micro_batch(): call "
                "micro_batch() once after each loss.backward()"
            )
        twice = self._order_of(self._pending, self._pending[0][1].device).repeated
        if twice:  # |g1|^2 + |g2|^2 is not |g1 + g2|^2
            self._pending, self._dropped = None, True  # param.grad holds it: not this step
            raise RuntimeError(
                f"two backward passes reached {twice} since the last micro_batch(): the squared "
                "norm of their summed gradient is not known from the two norms, so this "
                "micro-batch is dropped. Call micro_batch() after each loss.backward() (or "
                "backward the sum of the losses once)")
        self._micro_batches.append((self._squared_norms(self._pending), examples, weight))
        self._pending = None

    def step(self, step: int) -> Optional[dict]:
        """Record ``step`` from the micro-batches closed since the last step and ``param.grad``.

        Returns:
            ``{name: {statistic: value}}`` as stored in :attr:`output`, or
            None with a warning when there is only one small batch in all
            (one micro-batch on one process defines no estimate).

        Raises:
            RuntimeError: If a backward pass was not closed by :meth:`micro_batch`,
                or none was.
        """
        if self._pending is not None:
            raise RuntimeError("a backward pass since the last micro_batch() was not closed: "
                               "call micro_batch() after each loss.backward()")
        micro, self._micro_batches = self._micro_batches, []
        dropped, self._dropped = self._dropped, False
        if dropped:
            warnings.warn("a micro-batch of this step was dropped (two backward passes), and "
                          "param.grad holds its gradient: nothing recorded at this step", stacklevel=2)
            return None
        if not micro:
            raise RuntimeError("no micro-batch since the last step: call micro_batch() after "
                               "each loss.backward() of the step")
        weights = [1.0 / (b * len(micro)) if w is None else w for _, b, w in micro]
        sizes = [b for _, b, _ in micro]
        device = micro[0][0].device
        if self._tp is not None:
            micro = self._over_tp(micro)
        once = self._tp is None or self._tp[2]  # a tp group's examples: counted by its first
        # Summed over processes: total weight, sum of w^2 b, examples, small batches.
        weight, squared_weights, examples, small_batches = _summed_over_processes(
            [sum(w * b for w, b in zip(weights, sizes)), sum(w * w * b for w, b in zip(weights, sizes)),
             sum(sizes), len(micro)], once, device)
        # The processes whose param.grad FSDP2 averages: one per tp group.
        world = distributed.world_size() // (1 if self._tp is None else self._tp[0].size())
        if small_batches < 2:
            warnings.warn("one micro-batch on one process defines no two-batch noise scale: "
                          "nothing recorded at this step", stacklevel=2)
            return None
        big_examples = weight**2 / squared_weights
        if any(b == big_examples for b in sizes):  # the two equations are one
            warnings.warn(f"a micro-batch of {big_examples:g} examples is as large as the step's "
                          "batch (its effective size, by the weights): nothing recorded at this "
                          "step", stacklevel=2)
            return None
        big = _with_network(self._big_squared_norms(device) * (world / weight) ** 2)
        # The small batches stacked, [K, params + 1]: every operation below is one for all K.
        small = torch.stack([squared for squared, _, _ in micro])
        small /= torch.tensor([(w * b) ** 2 for w, b in zip(weights, sizes)], dtype=small.dtype, device=device)[:, None]
        small = _with_network(small)
        terms = functional.two_batch_noise_scale_terms(
            small, torch.tensor(sizes, dtype=small.dtype, device=device)[:, None], big, big_examples)
        # This process's sum over its small batches: summed over processes.
        sums = torch.stack([term.sum(0) for term in terms])
        if not once:
            sums.zero_()
        distributed.all_reduce_([sums])
        grad_sq, trace_cov = (sums / small_batches).tolist()
        record = {name: self._statistics(name, g, t, examples)
                  for name, g, t in zip([*self.names, schema.NETWORK], grad_sq, trace_cov)}
        self.output[int(step)] = record
        return record

    def state_dict(self) -> dict:
        """The running state a checkpoint keeps: the moving averages of ``b_simple_smoothed``,
        the micro-batches closed since the last :meth:`step` (and a backward pass not
        closed yet, and whether one was dropped), and the warnings told."""
        return {"averages": {name: list(pair) for name, pair in self._averages.items()},
                "micro_batches": [[squared.clone(), examples, weight]
                                  for squared, examples, weight in self._micro_batches],
                "pending": None if self._pending is None else self._squared_norms(self._pending),
                "warned": sorted(self.warned), "dropped": self._dropped}

    def load_state_dict(self, state) -> None:
        """Take back the running state of :meth:`state_dict`."""
        device = self.params[0].device
        self._averages = {name: tuple(pair) for name, pair in state["averages"].items()}
        self._micro_batches = [(squared.to(device), examples, weight)
                               for squared, examples, weight in state["micro_batches"]]
        self._pending = None if state["pending"] is None else [(None, state["pending"].to(device))]
        self.warned = set(state["warned"])
        self._dropped = state.get("dropped", False)  # absent from older checkpoints

    # As a Cockpit quantity ----------------------------------------------------------

    def should_compute(self, global_step) -> bool:
        """Whether ``global_step`` is tracked (Cockpit's schedule)."""
        return bool(self._track_schedule(global_step))

    def extensions(self, global_step):
        """No BackPACK extension (asked without effect: the tracker asks about steps ahead)."""
        return []

    #: A call at an untracked step does nothing (:meth:`track` returns at once, the hooks
    #: are parked): the tracker may skip Cockpit's context then (:func:`~cockpit_gradnoise.arming.idle_step`).
    idle_when_untracked = True

    def protected_savefields(self, global_step):
        """None; arms the hooks for a tracked step (Cockpit asks this before the backward pass)."""
        self._armed = self._standalone or self.should_compute(global_step)
        if self._armed and not self._handles and not self._removed:
            self._hook()
        if self._armed and self._sharded:  # after the forward pass: FSDP2's copies exist
            self._check_layout()
            fsdp2.hook_unsharded(self.params, self._record, self._unsharded_hooks)
        return set()

    def _hook(self):
        self._handles = [p.register_hook(functools.partial(self._hook_of(p), i))
                         for i, p in enumerate(self.params)]

    def _hook_of(self, param):
        """:meth:`_record`, or for a gradient that :func:`~cockpit_gradnoise.functional.norm_tensor`
        takes whole (not a large CPU one, not a DTensor's) :meth:`_record_whole`, the same
        norm with fewer Python calls: the hooks run for every parameter at every micro-batch."""
        plain = self._tp is None and type(param.data) is torch.Tensor  # not a DTensor (FSDP2's)
        whole = plain and not (_device.on_host(param) and param.numel() > _device.CHUNK)
        return self._record_whole if whole else self._record

    def _record_whole(self, index: int, grad: Tensor) -> None:
        if self._armed:
            if self._pending is None:
                self._pending = []
            self._pending.append((index, torch.linalg.vector_norm(grad.detach(), dtype=torch.float64)))

    def _park(self):
        """Take the hooks on the parameters off until the next tracked step (in a Cockpit)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def track(self, global_step, params, batch_loss):
        """After a tracked call's backward pass: close its micro-batch, and record after the last."""
        if self._standalone or not self.should_compute(global_step):
            return
        self._armed = False
        step = Step.of(self, global_step)
        batch, micro = step.loss_batch(self), step.micro_batch()
        if (micro is None or micro.last) and not self.should_compute(global_step + 1):
            self._park()  # the step's last backward pass is over, and the next step is not tracked
        if self._pending is None:  # no gradient reached the parameters: nothing to close
            return
        if not math.isfinite(batch.loss_scale):
            step.warn("two-batch-nonfinite", f"{self.name}: the losses are not finite; nothing "
                      "recorded at this step", self)
            self._pending, self._micro_batches = None, []
            return
        try:
            self.micro_batch(batch.examples, batch.loss_scale)
        except RuntimeError as error:  # two backward passes in one tracked call: not this step
            step.warn("two-batch-twice", f"{self.name}: {error}", self)
        if micro is None or micro.last:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.step(global_step)
            for warning in caught:  # once per run, not at every step
                step.warn(f"two-batch: {warning.message}", f"{self.name}: {warning.message}", self)

    def _over_tp(self, micro):
        """Each small batch's squared norms added over the tensor-parallel mesh (a split
        parameter's local ones on every process, any other's from the first: ``norm_counts``),
        so that every process of a tp group holds its group's (one ``all_reduce``)."""
        import torch.distributed as dist

        mesh, counted, _ = self._tp
        stacked = torch.stack([squared for squared, _, _ in micro])
        stacked *= torch.tensor(counted, dtype=stacked.dtype, device=stacked.device)
        dist.all_reduce(stacked, group=mesh.get_group())
        return [(row, b, w) for row, (_, b, w) in zip(stacked, micro)]

    def _big_squared_norms(self, device) -> Tensor:
        if self._sharded or self._tp is not None:  # FSDP2, tensor parallelism: shards of param.grad
            zero = torch.zeros((), dtype=torch.float64, device=device)
            grads = [zero if p.grad is None else tensor_parallel.local_values(p.grad) for p in self.params]
            # A shard once: by the first process of its tp group, and of HSDP's replicas.
            managed = sharded.fsdp2_parameters()
            counted = [True] * len(self.params) if self._tp is None else self._tp[1]
            counted = [c and sharded.first_replica(p, managed) for c, p in zip(counted, self.params)]
            return fsdp2.squared_norms(grads, True, counted)
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if len(grads) == len(self.params):  # every parameter's: in their order, no index
            return functional.squared_norm_tensors(grads).to(device)
        squares = torch.zeros(len(self.params), dtype=torch.float64, device=device)
        if grads:  # in float64 as the hooks' norms, in one call for all but large CPU ones
            index = torch.tensor([i for i, p in enumerate(self.params) if p.grad is not None], device=device)
            squares.index_copy_(0, index, functional.squared_norm_tensors(grads).to(device))
        return squares

    def _statistics(self, name, grad_sq, trace_cov, examples) -> dict:
        return {
            schema.GRAD_SQ: grad_sq,
            schema.TRACE_COV: trace_cov,
            schema.B_SIMPLE: schema.ratio_or_inf(trace_cov, grad_sq),
            schema.B_SIMPLE_SMOOTHED: smoothed_noise_scale(self._averages, name, trace_cov,
                                                           grad_sq, self.smoothing),
            schema.BATCH_SIZE: float(examples),
        }

    def get_output(self) -> dict:
        """``{step: {"TwoBatchNoiseScale": {name: {statistic: value}}}}``, Cockpit's layout.

        For :func:`~cockpit_gradnoise.to_frame` and :func:`~cockpit_gradnoise.write_log`.
        In a Cockpit, :attr:`output` itself (``{step: value}``): the Cockpit puts each
        value under the quantity's name.
        """
        if not self._standalone:
            return self.output
        return {step: {self.name: value} for step, value in self.output.items()}

    def frame(self):
        """The recorded numbers as :func:`~cockpit_gradnoise.to_frame`'s table."""
        from cockpit_gradnoise.logs.frame import to_frame

        return to_frame(self.get_output())

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles + [handle for _, handle in self._unsharded_hooks.values()]:
            handle.remove()
        self._handles, self._unsharded_hooks, self._removed = [], {}, True


class _Order(NamedTuple):
    """How one backward pass's hooks gave the norms (:meth:`TwoBatchNoiseScale._order_of`)."""

    #: The parameter of each hooked norm, in the hooks' order (``index_add_``'s index).
    index: Tensor
    #: Where each parameter's norm is, when every parameter was hooked once; else ``None``.
    inverse: Optional[Tensor]
    #: The names of the parameters hooked more than once, sorted.
    repeated: List[str]


def _order(indices: Tuple[Optional[int], ...], names: List[str], device) -> _Order:
    """The :class:`_Order` of hooked parameter ``indices`` (``None``: a checkpoint's entry)."""
    hooked = [i for i in indices if i is not None]
    repeated = sorted({names[i] for i in hooked if hooked.count(i) > 1}) if len(set(hooked)) < len(hooked) else []
    whole = len(hooked) == len(indices) == len(names) and not repeated
    inverse = None
    if whole:  # a permutation of the parameters: where each one's norm is
        where = [0] * len(names)
        for position, i in enumerate(hooked):
            where[i] = position
        inverse = torch.tensor(where, device=device)
    return _Order(torch.tensor(hooked, dtype=torch.long, device=device), inverse, repeated)


def _with_network(squared_norms: Tensor) -> Tensor:
    """Per-parameter squared norms and, last, their sum (the network's), along the last
    dimension (``[params]``, or ``[K, params]`` for ``K`` small batches)."""
    return torch.cat([squared_norms, squared_norms.sum(-1, keepdim=True)], -1)


def _summed_over_processes(values: List[float], counted: bool, device) -> List[float]:
    """``values`` (``0`` where not ``counted``) summed over the processes: in Python outside
    distributed training (no tensor made), else in one ``all_reduce`` in float64."""
    if distributed.world_size() == 1:
        return [value * counted for value in values]
    totals = torch.tensor(values, dtype=torch.float64, device=device) * counted
    distributed.all_reduce_([totals])
    return totals.tolist()
