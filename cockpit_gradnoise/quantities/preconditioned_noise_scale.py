"""The noise scale Adam sees: ``B_simple`` of the preconditioned gradients ``P g_i``, per layer."""

import math

from cockpit_gradnoise import _device, distributed, functional
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD, SumsOfContributions, sharded
from cockpit_gradnoise.extensions.precision import accumulation_dtype
from cockpit_gradnoise.functional.preconditioner import piece_size, preconditioned_noise_sums
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.quantities import _shards, preconditioners
from cockpit_gradnoise.quantities._declarations import SUM
from cockpit_gradnoise.quantities._shared_checks import unresolved_sums_once
from cockpit_gradnoise.quantities.gradient_noise_scale import DEFAULT_SMOOTHING, GradientNoiseScale


class PreconditionedNoiseScale(GradientNoiseScale):
    """Is my batch too small for Adam? ``B_simple`` of the gradients the optimizer's update sees.

    An adaptive optimizer moves along ``P g`` with ``P = diag(1 / (sqrt(v_hat)
    + eps))`` from its own running second moment, so the noise that matters
    for its batch size is that of ``P g_i``, not of ``g_i`` (Malladi et al.
    2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms":
    Adam's stochastic dynamics are driven by the preconditioned noise; Merrill
    et al. 2025 find the raw noise scale a weak proxy under Adam). Here the
    estimators of :class:`~cockpit_gradnoise.GradientNoiseScale`
    (:func:`~cockpit_gradnoise.functional.noise_scale_estimates`) are applied
    to ``P g_i``: with ``Q_j = sum_i g_ij^2`` and ``T_j = sum_i g_ij`` per
    element ``j`` (:func:`~cockpit_gradnoise.functional.preconditioned_noise_sums`),

    - ``S_P = mean_i ||P g_i||^2 = sum_j p_j^2 Q_j / N`` and
      ``M_P = ||P mean_i g_i||^2 = sum_j p_j^2 T_j^2 / N^2``;
    - ``grad_sq``, ``trace_cov``, ``b_simple`` and ``batch_size`` as
      GradientNoiseScale reports them (the same names), per parameter and
      for ``"all"``;
    - ``b_simple_smoothed``: moving averages of ``trace_cov`` and ``grad_sq``
      each divided by the step's own ``S_P = grad_sq + trace_cov``
      (:func:`~cockpit_gradnoise.functional.scale_free_smoothed_noise_scale`),
      not of the raw values as GradientNoiseScale's: ``P`` changes by orders
      of magnitude over Adam's first steps, and the raw averages let one
      early step outweigh a hundred later ones. A step with ``S_P = 0``
      (every example's preconditioned gradient 0) is not averaged (NaN
      there, with a warning).

    **Which P.** The ``P`` the optimizer's next ``step()`` applies, read from
    its state when the backward pass has ended (:mod:`~cockpit_gradnoise.quantities.preconditioners`):

    - ``Adam``, ``AdamW``: ``v_t = beta2 v_{t-1} + (1 - beta2) g^2`` and
      ``v_hat = v_t / (1 - beta2^t)``, with ``t`` the step count of the update
      being measured (``state["step"] + 1``) and ``g = param.grad``, the
      gradient this update adds (torch updates ``v`` with it *before* dividing;
      plus ``weight_decay * param`` for Adam's coupled decay, as torch adds it;
      ``amsgrad``: ``max(max_exp_avg_sq, v_t)``);
    - ``RMSprop``: ``1 / (sqrt(s_t) + eps)``, centered ``1 / (sqrt(s_t -
      bar g_t^2) + eps)``, no bias correction; ``Adagrad``: ``1 / (sqrt(sum_t)
      + eps)``;
    - ``SGD`` (any momentum, Nesterov, weight decay): ``P = I``, and the
      numbers are GradientNoiseScale's (to rounding: both sum the same
      squares in another order);
    - any other optimizer, a subclass of these included: refused, with a
      warning naming it; nothing is recorded (never an approximation).

    Why the ``P`` that includes this step's gradient: it is the matrix the
    update multiplies by, so the numbers are those of the update the
    optimizer takes, checkable against it. The gradient's weight in
    ``v_hat`` is ``w_t = (1 - beta2) / (1 - beta2^t)``: ``1`` at ``t = 1``,
    about ``1 / t`` while ``t << 1 / (1 - beta2)``, ``1 - beta2`` later. The
    estimators are unbiased for a ``P`` that does not depend on the batch;
    Malladi et al.'s analysis treats ``v`` as varying slowly (``w_t`` small), where
    this ``P`` and the previous step's agree to ``O(w_t)``. While ``w_t`` is
    large the estimates describe this batch's update and are biased: at the
    first step (no state yet: ``v_0 = 0``, ``t = 1``) ``v_hat = g^2`` exactly,
    ``P g = g / (|g| + eps)``, Adam's first update is sign descent, and the
    numbers are those of that update (``grad_sq`` near the number of elements with
    ``|g_j| >> eps``); trust the smoothed value after some ``1 / (1 - beta2)``
    steps less than the early raw ones. ``P`` scales with the gradient's
    units (a mean or a sum loss), which ``b_simple`` does not depend on but
    ``grad_sq`` and ``trace_cov`` do (they are in units of ``(P g)^2``).

    Needs ``info["optimizer"]`` (:meth:`Tracker.__call__
    <cockpit_gradnoise.Tracker.__call__>`'s ``optimizer=``), ``info["loss"]``
    and ``info["individual_losses"]``. Every parameter tracked must be in
    the optimizer; otherwise nothing is recorded, with a warning. A gradient
    clipped after the backward pass (``clip_grad_norm_``) is not seen: ``P``
    is that of the unclipped gradient.

    Cost: the per-element sums of
    :class:`~cockpit_gradnoise.GradientVarianceQuantiles` (the extension
    :class:`~cockpit_gradnoise.extensions.SumsOfContributions`, computed once
    when both are tracked), and elementwise work over the parameters: ``P`` as the
    optimizer forms it, piece by piece on the CPU, each piece weighting the sums in
    float64 while it is in the cache (:meth:`OptimizerPreconditioner.pieces
    <cockpit_gradnoise.quantities.preconditioners.OptimizerPreconditioner.pieces>`);
    no per-example squared norms, and beside GradientVarianceQuantiles not its own
    underflow check of the sums, whose count it takes from it (:mod:`~cockpit_gradnoise.quantities._shared_checks`;
    measured: ``benchmarks/README.md``). Under gradient accumulation
    (``docs/accumulation.md``) and distributed training (``docs/distributed.md``)
    ``Q`` and ``T`` are added over every micro-batch and process, as
    GradientVarianceQuantiles' are, and ``P`` is applied once, after the
    last micro-batch, to those of the global batch. Under FSDP2 each process
    applies the ``P`` of its shard (the optimizer's state is sharded like the
    parameter) to its rows of the sums, and the two sums over elements are
    added across processes (under HSDP, by each shard's first replica only); under
    tensor parallelism (alone or inside FSDP2) likewise, on the elements of the
    process's shard of a split parameter.

    Args:
        track_schedule: Function from step to bool.
        smoothing: Weight of the past in ``b_simple_smoothed``'s moving
            averages (see GradientNoiseScale).
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

    extension_classes = (SumsOfContributions,)
    sums = {"sum_of_squares": SUM, "sum_of_gradients": SUM}
    reads_local_gradient = False
    micro_batch_gradient = None
    #: Under HSDP its sums are cut to each shard's first replica (quantities/_shards.py), beside
    #: the optimizer's state of the same elements: the sums over elements count each once.
    supports_hsdp = True
    sums_sharded_in_backward = SUMS_SAVEFIELD  # under FSDP2: each process keeps its rows
    #: Under tensor parallelism a split parameter's sums stay with its shard (inside FSDP2
    #: added over dp), beside the optimizer's state of the same elements (a DTensor placed
    #: as the parameter): each process applies the P of its elements, as under FSDP2.
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True
    per_element_sums_stay = True

    def __init__(
        self, track_schedule, *, smoothing=DEFAULT_SMOOTHING, param_names=None, verbose=False
    ):
        super().__init__(track_schedule, smoothing=smoothing, param_names=param_names, verbose=verbose)
        self._preconditioner = None  # this step's OptimizerPreconditioner
        self._params = {}  # name -> parameter, this step's
        self._scalars_scaled = False  # sums in units of x_i, scalars divided by c^2 (step_context)
        self._cuts = None  # under FSDP2, {name: this process's rows} (step_context)
        self._checks = None  # the call's Step.shared_checks (step_context)

    def step_context(self, step, params):
        self._checks = step.shared_checks
        batch = step.loss_batch(self)
        micro = step.micro_batch()
        # One batch on one process: the sums stay in units of x_i = c g_i, and the two
        # scalars are divided by c^2 (no pass over them); else in units of g_i, to add.
        self._scalars_scaled = micro is None and distributed.world_size() == 1
        self._cuts = _shards.cuts(self.trainable(params), step.presharded.get(SUMS_SAVEFIELD, {}))
        if micro is not None and not micro.last:
            return batch  # P is read after the last micro-batch, from the step's gradient
        try:
            optimizer = step.info("optimizer", self)
        except KeyError:
            raise KeyError(
                "PreconditionedNoiseScale reads the optimizer's state: pass the optimizer, "
                "`tracker(step, losses, optimizer=opt)` or `cockpit(step, info={'optimizer': opt, "
                "...})`"
            ) from None
        trainable = self.trainable(params)
        try:
            reader = preconditioners.OptimizerPreconditioner(optimizer)
            for _, param in trainable:
                reader.check(param)
        except preconditioners.UnsupportedOptimizer as refusal:
            self.warn_once(
                "unsupported-optimizer",
                f"PreconditionedNoiseScale: {refusal}: nothing is recorded. Use GradientNoiseScale "
                "for the plain noise scale",
            )
            return None
        missing = [name for name, param in trainable if not reader.updates(param)]
        if missing:
            self.warn_once(
                "not-in-optimizer",
                f"PreconditionedNoiseScale: parameters {missing} are not in the optimizer passed "
                "as info['optimizer'], so the step's preconditioner is unknown for them: nothing "
                "is recorded. Pass the optimizer that updates every tracked parameter",
            )
            return None
        self._preconditioner, self._params = reader, dict(trainable)
        return batch

    def parameter_sums(self, param, batch):
        # What the backward pass left, as GradientVarianceQuantiles reads it (never altered).
        grad, squares = getattr(param, SUMS_SAVEFIELD).detach()[:2]
        grad = grad.to(accumulation_dtype(param.dtype))
        if batch.loss_scale != 1.0 and not self._scalars_scaled:  # in units of g_i
            grad, squares = grad / batch.loss_scale, squares / batch.loss_scale**2
        return {"sum_of_squares": squares, "sum_of_gradients": grad}

    unresolved_reads = None  # its own per-element sums: checked right after each value

    def unresolved(self, param, sums, batch):
        # Its own per-element sums (GradientVarianceQuantiles' check), not the per-example
        # norms GradientNoiseScale checks: P weights each element's S_j. Beside
        # GradientVarianceQuantiles, the same views of the same sums: its count, not a second pass.
        squares, grad = sums["sum_of_squares"], sums["sum_of_gradients"]
        scale = 1.0 if self._scalars_scaled else batch.loss_scale
        row = getattr(param, SUMS_SAVEFIELD)[0] if scale == 1.0 else None  # grad: row.to(dtype)
        count = unresolved_sums_once(self._checks, param, squares, grad, batch.examples, scale, row)
        return None if count is None else (count, lambda k: (
            f"the squares of the per-example contributions of {k} of its elements underflow "
            f"(their sums in {squares.dtype} are below 4 N tiny), so the preconditioned "
            "tr(Sigma) cannot be told from them"))

    def named_value_from_sums(self, name, sums, batch):
        n = batch.examples
        param = self._params[name]
        size = piece_size(sums["sum_of_squares"], sums["sum_of_gradients"])
        if self._cuts is None and _device.on_host(param) and param.numel() > size:
            # P formed piece by piece as the weighted sums take it (issue 34's speed); a
            # parameter of one piece whole (the pieces' Python would cost more than they save).
            weights = self._preconditioner.pieces(param, size)
        else:
            weights = self._preconditioner.preconditioner(param)
        if self._cuts is not None:
            # FSDP2, tensor parallelism: P of this process's shard (the optimizer's state is
            # a DTensor beside the parameter: elementwise, its local values are those of the
            # whole P's elements), on the same elements of the sums; the partial sums over
            # elements are added across processes in statistics_of_values.
            rank = distributed.rank()
            sums = {key: _shards.local_part(value, self._cuts[name], rank) for key, value in sums.items()}
            if weights is not None:
                weights = _shards.local_weights(sharded.local_tensor(weights), self._cuts[name], rank)
        mean_squared_norm, squared_norm_of_mean = preconditioned_noise_sums(
            weights, sums["sum_of_squares"], sums["sum_of_gradients"], n, defer=True
        )
        if self._scalars_scaled and batch.loss_scale != 1.0:  # x_i = c g_i
            scale = batch.loss_scale**2
            mean_squared_norm, squared_norm_of_mean = mean_squared_norm / scale, squared_norm_of_mean / scale
        return mean_squared_norm, squared_norm_of_mean, n

    def statistics_of_values(self, values, network):
        if self._cuts is not None and values:  # FSDP2: every process's partial sums added
            values = _shards.added_across_processes(values)
        return super().statistics_of_values(values, network)

    def derived_statistics(self, name, statistics):
        grad_sq, trace_cov = statistics[schema.GRAD_SQ], statistics[schema.TRACE_COV]
        averages, smoothed = functional.scale_free_smoothed_noise_scale(
            self._averages.get(name), grad_sq, trace_cov, self.smoothing)
        if averages is not None:
            self._averages[name] = averages
        if math.isnan(smoothed) and math.isfinite(grad_sq) and math.isfinite(trace_cov):
            self.warn_once(  # S_P <= 0: 0, or below by rounding
                "zero-batch-gradient",
                f"every example's preconditioned gradient of {name!r} is 0, "
                "a step without units to average in: b_simple_smoothed is NaN at such steps "
                "and their moving averages skip them",
            )
        return {schema.B_SIMPLE_SMOOTHED: smoothed}
