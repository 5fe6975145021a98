"""Across-mini-batch gradient statistics and the full-dataset gradient, for any model.

Both functions walk over batches at fixed parameters, take each batch's
gradient with ``torch.autograd.grad`` (so ``param.grad`` is never written)
and fold it into accumulators updated in place: memory is O(number of
parameters), independent of the number of batches. They need no BackPACK and
no Cockpit, so they work on any ``nn.Module`` autograd can differentiate
(LayerNorm, attention, ...).

A parameter that gets no gradient in a batch (unused by that batch's forward
pass) has a zero gradient there: the loss does not depend on it. A parameter
that gets a gradient in no batch at all is left out, with a warning.

Under ``torch.distributed`` every process passes the same batches (and the
same model, or its ``DistributedDataParallel`` wrapper): process ``r`` of
``W`` takes batches ``r, r + W, ...``, and the accumulators are combined
across processes, so every process returns what one process returns for all
the batches (up to rounding).
"""

import itertools
import math
import warnings
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from cockpit_gradnoise import distributed, functional
from cockpit_gradnoise.logs.schema import NETWORK, sd_statistic_names
from cockpit_gradnoise.order_statistics import check_quantile_levels

import torch
from torch import Tensor, nn

DEFAULT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def minibatch_gradient_stats(
    model: nn.Module,
    batches: Iterable,
    loss_fn: Callable,
    *,
    quantiles=DEFAULT_QUANTILES,
    num_batches: Optional[int] = None,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = False,
    return_sd: bool = False,
):
    """Standard deviation of each gradient element over mini-batches, per layer.

    For ``n`` batches with gradients ``G_1, ..., G_n`` (each what
    ``loss_fn(model(inputs), targets).backward()`` would leave in
    ``param.grad``), per element ``j``

    .. math::

        \\mathrm{sd}_j = \\sqrt{\\frac{1}{n-1} \\sum_{k=1}^n (G_{kj} - \\bar G_j)^2},

    accumulated with Welford's update
    (:func:`~cockpit_gradnoise.functional.welford_update_`). With independent
    batches of size ``B`` this estimates the same thing as
    :class:`~cockpit_gradnoise.GradientVarianceQuantiles` estimates from one
    batch of size ``B``, and the statistics have the same names: ``q<level>``
    and ``mean`` of ``sd_j`` over a layer's elements, ``snr_q0.5`` and
    ``snr_mean`` of ``|mean_k G_kj| / sd_j`` over elements with ``sd_j > 0``.

    The parameters, ``param.grad`` and the model's buffers (e.g. BatchNorm
    running statistics) are as before the call when it returns, also after an
    error. The model's mode (``train()``/``eval()``) is used as it is: in
    training mode, dropout noise is part of the measured noise.

    Memory: three copies of the parameters in ``accumulate_dtype`` (the
    mean, ``M2``, and the current batch's gradient gathered into one flat
    buffer), plus what one forward and backward pass needs, whatever the
    number of batches.

    Args:
        model: Any module; its parameters with ``requires_grad`` are measured.
        batches: Iterable of ``(inputs, targets)``, e.g. a ``DataLoader``.
            Batches should be independent draws of one size ``B`` (a shuffled
            loader with ``drop_last=True``); mixed sizes give a warning.
        loss_fn: ``loss_fn(model(inputs), targets)`` returns the scalar loss
            of the batch.
        quantiles: Quantile levels in ``[0, 1]``.
        num_batches: Use only the first ``num_batches`` batches (at least 2).
        accumulate_dtype: Dtype of the accumulators. The default ``float64``
            keeps the result accurate for float32 models over many batches of
            nearly equal gradients; ``torch.float32`` halves the memory.
        progress: Show a tqdm progress bar.
        return_sd: Also return the per-element standard deviations.

    Returns:
        ``{param name: {statistic: float}}`` plus ``"all"`` (every element of
        the network); with ``return_sd``, the pair ``(statistics, {param name:
        sd tensor shaped like the parameter, in accumulate_dtype})``. If a
        parameter's gradient was NaN or inf in some batch, its statistics and
        those of ``"all"`` are NaN, with a warning.

    Raises:
        ValueError: If there are fewer than 2 batches, a batch is not a pair,
            the loss is not a scalar or depends on no trainable parameter.

    Example:
        >>> stats = minibatch_gradient_stats(model, loader, nn.CrossEntropyLoss(),
        ...                                  num_batches=400)  # doctest: +SKIP
        >>> stats["0.weight"]["q0.5"]  # doctest: +SKIP
    """
    who = "minibatch_gradient_stats"
    levels = check_quantile_levels(quantiles)
    _check_count(batches, num_batches, minimum=2, who=who)
    model = distributed.unwrap(model)
    names, params = _trainable(model, who)
    flat = _FlatGradients(params, accumulate_dtype)
    means = flat.zeros()
    m2s = flat.zeros()
    count, sizes = 0, set()
    with _state_kept(model):
        for targets, grads in _batch_gradients(
            model, params, batches, loss_fn, num_batches, progress, who
        ):
            count += 1
            sizes.add(_length(targets))
            for device, gradient in flat.gather(grads).items():
                # The gathered copy doubles as the scratch for delta.
                functional.welford_update_(
                    means[device], m2s[device], gradient, count, delta=gradient
                )
    flat.buffers.clear()  # free the gathered copy before the statistics need memory
    count, sizes = _combine_welford(means, m2s, count, sizes, flat)
    _check_count(range(count), None, minimum=2, who=who)
    _warn_missing(names, flat.seen, who)
    if len(sizes) > 1:
        warnings.warn(
            f"{who}: batches of different sizes {sorted(sizes, key=str)}: the "
            "standard deviation depends on the batch size, so this mixes several; "
            "pass batches of one size (DataLoader(..., drop_last=True))",
            stacklevel=2,
        )
    for m2 in m2s.values():
        functional.welford_sd(m2, count, in_place=True)  # M2 is not needed any more
    sds = {names[i]: sd for i, sd in flat.split(m2s).items()}
    mean_grads = {names[i]: mean for i, mean in flat.split(means).items()}
    stats = _statistics(sds, mean_grads, levels, who)
    return (stats, sds) if return_sd else stats


def dataset_gradient(
    model: nn.Module,
    batches: Iterable,
    loss_fn: Callable,
    *,
    reduction: str = "mean",
    num_batches: Optional[int] = None,
    accumulate_dtype: torch.dtype = torch.float64,
    progress: bool = False,
) -> Dict[str, Tensor]:
    """The exact gradient of the mean loss over every example of every batch.

    .. math::

        \\nabla L = \\frac{1}{\\sum_k B_k} \\sum_k w_k G_k,

    where ``G_k`` is the gradient of batch ``k``'s loss and ``B_k =
    len(targets)``; ``w_k = B_k`` if ``loss_fn`` returns the batch's mean
    (``reduction="mean"``), ``w_k = 1`` if it returns the sum. So an unequal
    last batch counts exactly as much as its examples. Summed in place in
    ``accumulate_dtype``. Parameters, ``param.grad`` and buffers are left as
    they were (see :func:`minibatch_gradient_stats`).

    Args:
        model: Any module; its parameters with ``requires_grad`` are used.
        batches: Iterable of ``(inputs, targets)``, at least one.
        loss_fn: ``loss_fn(model(inputs), targets)`` returns the scalar loss.
        reduction: ``"mean"`` or ``"sum"``: what ``loss_fn`` does over a batch.
        num_batches: Use only the first ``num_batches`` batches.
        accumulate_dtype: Dtype of the running sum.
        progress: Show a tqdm progress bar.

    Returns:
        ``{param name: gradient}`` with each parameter's shape, dtype and
        device, ready for ``param.grad = ...``. A parameter's gradient is NaN
        or inf where some batch's was, with a warning.

    Raises:
        ValueError: If there is no batch, a batch is not a pair, the loss is
            not a scalar or depends on no trainable parameter, or
            ``reduction`` is unknown.
    """
    who = "dataset_gradient"
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    _check_count(batches, num_batches, minimum=1, who=who)
    model = distributed.unwrap(model)
    names, params = _trainable(model, who)
    flat = _FlatGradients(params, accumulate_dtype)
    totals = flat.zeros()
    examples = 0
    with _state_kept(model):
        for targets, grads in _batch_gradients(
            model, params, batches, loss_fn, num_batches, progress, who
        ):
            size = _length(targets)
            if size is None:
                raise ValueError(
                    f"{who}: len(targets) must be the number of examples of a batch, "
                    f"got targets of type {type(targets).__name__}"
                )
            examples += size
            weight = size if reduction == "mean" else 1
            for device, gradient in flat.gather(grads).items():
                totals[device].add_(gradient, alpha=weight)
    flat.buffers.clear()
    distributed.all_reduce_(totals.values())
    examples = sum(_combine_processes(examples, flat))
    if examples == 0:
        raise ValueError(f"{who} got no examples: pass at least one non-empty batch")
    _warn_missing(names, flat.seen, who)
    result = {
        names[i]: (total / examples).to(params[i].dtype)
        for i, total in flat.split(totals).items()
    }
    non_finite = [name for name, grad in result.items() if not bool(grad.isfinite().all())]
    if non_finite:
        warnings.warn(
            f"{who}: the gradient of {non_finite} is NaN or inf (some batch gave a "
            "non-finite loss or gradient)",
            stacklevel=2,
        )
    return result


# Helpers ------------------------------------------------------------------------


class _FlatGradients:
    """Each batch's gradients gathered into one flat buffer per device.

    Accumulators are flat tensors of the same layout (see :meth:`zeros`), so
    one update is three elementwise operations however many parameters the
    model has. A missing gradient is gathered as zeros.
    """

    def __init__(self, params, dtype):
        self.params = params
        self.dtype = dtype
        self.seen = [False] * len(params)
        self.slices: Dict[torch.device, List[Tuple[int, int, int]]] = {}
        for index, param in enumerate(params):
            members = self.slices.setdefault(param.device, [])
            start = members[-1][2] if members else 0
            members.append((index, start, start + param.numel()))
        self.buffers = self.zeros()

    def zeros(self) -> Dict[torch.device, Tensor]:
        """One flat zero tensor per device, in the layout of the gathered gradients."""
        return {
            device: torch.zeros(members[-1][2], dtype=self.dtype, device=device)
            for device, members in self.slices.items()
        }

    def gather(self, grads) -> Dict[torch.device, Tensor]:
        """Copy ``grads`` (``None`` for zeros) into the flat buffers and return them."""
        for device, members in self.slices.items():
            buffer = self.buffers[device]
            for index, start, stop in members:
                grad = grads[index]
                if grad is None:
                    buffer[start:stop].zero_()
                else:
                    buffer[start:stop].view(grad.shape).copy_(grad)
                    self.seen[index] = True
        return self.buffers

    def split(self, flat) -> Dict[int, Tensor]:
        """Views of ``flat`` shaped like each parameter that ever had a gradient."""
        return {
            index: flat[device][start:stop].view(self.params[index].shape)
            for device, members in self.slices.items()
            for index, start, stop in members
            if self.seen[index]
        }


def _combine_processes(value, flat) -> list:
    """Every process's ``value`` (``[value]`` on one process); marks parameters any process saw."""
    parts = distributed.gather_objects((value, flat.seen))
    flat.seen = [any(seen) for seen in zip(*(seen for _, seen in parts))]
    return [part for part, _ in parts]


def _combine_welford(means, m2s, count, sizes, flat) -> Tuple[int, set]:
    """Merge the processes' Welford accumulators, in place, into those of all their batches.

    Chan, Golub and LeVeque 1979: with ``n_r`` batches, mean ``m_r`` and
    ``M2_r`` on process ``r``, ``n = sum_r n_r``, ``m = sum_r n_r m_r / n``
    and ``M2 = sum_r (M2_r + n_r (m_r - m)**2)``. Returns the total count and
    the batch sizes seen on any process.
    """
    parts = _combine_processes((count, sizes), flat)
    total = sum(n for n, _ in parts)
    sizes = set().union(*(s for _, s in parts))
    if len(parts) == 1 or total == 0:
        return total, sizes
    for device, mean in means.items():
        global_mean = mean * count
        distributed.all_reduce_([global_mean])
        global_mean /= total
        mean.sub_(global_mean)  # m_r - m
        m2s[device].addcmul_(mean, mean, value=count)
        distributed.all_reduce_([m2s[device]])
        mean.copy_(global_mean)
    return total, sizes


def _check_count(batches, num_batches, minimum, who):
    """Fail before any work when too few batches are known to come."""
    if num_batches is not None and num_batches < minimum:
        raise ValueError(f"{who} needs num_batches >= {minimum}, got {num_batches}")
    try:
        available = len(batches)
    except TypeError:
        return
    if num_batches is not None:
        available = min(available, num_batches)
    if available == 0:
        raise ValueError(f"{who} got no batches: pass an iterable of (inputs, targets)")
    if available < minimum:
        raise ValueError(
            f"{who} got {available} batch: the standard deviation over batches "
            f"needs at least {minimum} (pass more batches)"
        )


def _trainable(model, who) -> Tuple[List[str], List[Tensor]]:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{who}: the model has no parameter with requires_grad=True")
    return [name for name, _ in named], [p for _, p in named]


@contextmanager
def _state_kept(model):
    """Restore every ``param.grad`` and buffer to what it was, even after an error."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        for param, grad in grads:
            if param.grad is not grad:
                param.grad = grad
        for name, saved in buffers.items():
            model.get_buffer(name).copy_(saved)


def _batch_gradients(
    model, params, batches, loss_fn, num_batches, progress, who
) -> Iterator[Tuple[object, Tuple[Optional[Tensor], ...]]]:
    """Yield ``(targets, gradients)`` per batch; ``None`` for an unused parameter."""
    iterator = batches if num_batches is None else itertools.islice(batches, num_batches)
    if progress:
        from tqdm.auto import tqdm

        total = num_batches
        if total is None and hasattr(batches, "__len__"):
            total = len(batches)
        iterator = tqdm(iterator, total=total, desc=who)
    # Under torch.distributed this process's share; positions stay those in batches.
    for position, batch in distributed.share(enumerate(iterator)):
        try:
            inputs, targets = batch
        except (TypeError, ValueError):
            raise ValueError(
                f"{who}: batch {position} is not a pair (inputs, targets)"
            ) from None
        with torch.enable_grad():
            loss = loss_fn(model(inputs), targets)
            _check_loss(loss, position, who)
            grads = torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
        yield targets, grads


def _length(targets) -> Optional[int]:
    """``len(targets)``, or ``None`` where it has none (e.g. a 0-d tensor)."""
    try:
        return len(targets)
    except TypeError:
        return None


def _check_loss(loss, position, who):
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(
            f"{who}: loss_fn must return the scalar loss of a batch, got {shape} at "
            f"batch {position}: reduce it, e.g. with reduction='mean'"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{who}: the loss of batch {position} depends on no trainable parameter "
            "(frozen model, or computed under torch.no_grad / from detached outputs)"
        )


def _warn_missing(names, seen, who):
    missing = [name for name, was_seen in zip(names, seen) if not was_seen]
    if len(missing) == len(names):
        raise ValueError(f"{who}: no parameter received a gradient in any batch")
    if missing:
        warnings.warn(
            f"{who}: parameters {missing} received no gradient in any batch (unused "
            f"by the forward pass?); they are left out, also of {NETWORK!r}",
            stacklevel=3,
        )


def _statistics(sds, mean_grads, levels, who) -> Dict[str, Dict[str, float]]:
    """Statistics per parameter and for the network (the union of all, not joined).

    NaN where not finite, with a warning.
    """
    nan_stats = dict.fromkeys(sd_statistic_names(levels), math.nan)
    result, non_finite, snrs = {}, [], {}
    for name, sd in sds.items():
        if bool(sd.isfinite().all()) and bool(mean_grads[name].isfinite().all()):
            snrs[name] = functional.signal_to_noise(mean_grads[name], sd)
            result[name] = functional.sd_statistics(sd, snrs[name], levels)
        else:
            non_finite.append(name)
            result[name] = dict(nan_stats)
    if non_finite:
        warnings.warn(
            f"{who}: the gradient of {non_finite} was NaN or inf in some batch; their "
            f"statistics and those of {NETWORK!r} are NaN",
            stacklevel=3,
        )
        result[NETWORK] = dict(nan_stats)
    else:
        result[NETWORK] = functional.sd_statistics(list(sds.values()), list(snrs.values()), levels)
    return result
