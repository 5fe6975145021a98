"""The losses a tracked step differentiates: the tracker's reduction, and padded sequences.

The front door (:class:`~cockpit_gradnoise.Tracker`) chooses the loss it
hands to the ``with`` block, ``losses.mean()`` (over ``K`` under gradient
accumulation) or ``losses.sum()``, so it knows the batch the quantities
describe, ``N`` and the scale ``c`` (``x_i = c g_i``), and declares it
(:func:`declared_batch`), as Opacus' ``make_private(loss_reduction="mean")``
does; only the explicit API infers them from Cockpit's ``info``
(:meth:`~cockpit_gradnoise.step.Step.loss_batch`).
:func:`sequence_losses` gives per-example losses of padded sequences.
"""

import math
from typing import TYPE_CHECKING, Any, Optional, Tuple

from cockpit_gradnoise import _device, accumulation, functional

import torch

if TYPE_CHECKING:  # step imports Cockpit: sequence_losses alone does not need it
    from cockpit_gradnoise.step import Batch

WEIGHTINGS = ("tokens", "examples")

#: The reductions a tracker differentiates, by name.
REDUCTIONS = {"mean": torch.mean, "sum": torch.sum}


def sequence_losses(
    token_losses: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    weighting: str = "tokens",
) -> torch.Tensor:
    """One loss per sequence of a padded batch, whose mean is the loss you train on.

    With ``m_it`` = 1 for the labelled tokens (0 for padding), ``l_it`` the
    token losses, ``n_i = sum_t m_it`` and ``n = sum_i n_i``:

    - ``weighting="tokens"`` (what nanoGPT, Hugging Face and
      ``F.cross_entropy(..., ignore_index=...)`` over the flattened batch
      train on: the mean over all labelled tokens):
      ``L_i = N sum_t m_it l_it / n``, so that ``mean_i L_i`` is that token
      mean. Example ``i`` weighs as many of its tokens as it has; its
      contribution to the batch gradient is ``L_i / N``, which the quantities
      report as they do for any mean loss. A sequence without a labelled
      token has loss and gradient 0 and still counts among the ``N`` examples.
    - ``weighting="examples"``: ``L_i = sum_t m_it l_it / n_i``, each
      sequence's own token mean; ``mean_i L_i`` weighs every sequence equally.

    Example (nanoGPT's loss, with padding labelled ``-1``)::

        logits = model(idx)
        tokens = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                 ignore_index=-1, reduction="none").view(targets.shape)
        with tracker(step, cgn.sequence_losses(tokens, targets, ignore_index=-1)) as loss:
            loss.backward()            # loss equals nanoGPT's own loss

    Args:
        token_losses: ``[N, T]`` per-token losses (``reduction="none"``);
            values at padded positions are ignored, even NaN.
        labels: ``[N, T]`` labels; tokens labelled ``ignore_index`` are padding.
        ignore_index: The padding label.
        mask: ``[N, T]`` booleans, True for labelled tokens (instead of ``labels``).
        weighting: ``"tokens"`` or ``"examples"``.

    Returns:
        ``[N]`` per-example losses.

    Raises:
        ValueError: Naming the fix, for a bad shape or weighting, neither or
            both of ``labels`` and ``mask``, no labelled token in the batch,
            or (``"examples"``) a sequence without one.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if (labels is None) == (mask is None):
        raise ValueError("give labels= (with ignore_index=) or mask=, one of them")
    mask = labels != ignore_index if mask is None else mask.bool()
    if token_losses.dim() != 2 or mask.shape != token_losses.shape:
        raise ValueError(
            f"token_losses must be [N, T] and the labels or mask of the same shape, got "
            f"{tuple(token_losses.shape)} and {tuple(mask.shape)}: reshape the flat token "
            "losses with .view(N, T)"
        )
    # where, not a product: a padded position's loss may be NaN (0 * NaN is NaN).
    sums = torch.where(mask, token_losses, torch.zeros_like(token_losses)).sum(dim=1)
    counts = mask.sum(dim=1).to(sums.dtype)
    if weighting == "examples":
        if bool((counts == 0).any()):
            raise ValueError(
                f"sequences {torch.nonzero(counts == 0).flatten().tolist()} have no labelled "
                "token, so no token mean: drop them, or use weighting='tokens'"
            )
        return sums / counts
    total = counts.sum()
    if bool(total == 0):
        raise ValueError("no token of the batch is labelled: there is no loss to train on")
    return sums * (len(sums) / total)


def loss_to_differentiate(losses, loss, reduction, micro):
    """``loss`` as given, else ``losses``' mean (over ``K`` under accumulation) or sum."""
    if loss is not None:
        if reduction is not None:
            raise ValueError(
                "give loss= or reduction=, not both: reduction= says which of losses.mean() "
                "and losses.sum() the tracker differentiates; loss= is differentiated as given"
            )
        return loss
    if reduction not in (None, *REDUCTIONS):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    loss = REDUCTIONS[reduction or "mean"](losses)
    if micro is not None and reduction != "sum":
        loss = loss / micro.count  # the accumulated gradient: the mean of all examples
    return loss


def micro_batch_given(index, count) -> Optional[accumulation.MicroBatch]:
    """The :class:`~cockpit_gradnoise.accumulation.MicroBatch` of ``micro_batch=``, ``micro_batches=``."""
    if index is None and count is None:
        return None
    if index is None or count is None:
        raise ValueError(
            "give micro_batch= and micro_batches= together: under gradient accumulation "
            "micro_batch=k (from 0) of micro_batches=K in the optimizer step"
        )
    return accumulation.micro_batch_of({accumulation.MICRO_BATCH: index,
                                        accumulation.MICRO_BATCHES: count})


def check_loss(loss, losses, tracked, micro=None) -> Optional[float]:
    """Raise unless ``loss`` is the mean or the sum of ``losses`` (the quantities' own rule); its scale ``c``.

    Under accumulation over ``K`` micro-batches: ``losses.mean() / K`` or ``losses.sum()``.
    The values are compared at tracked steps only: that needs a device-to-host
    transfer. Returns ``c`` (NaN where the losses are not finite) at tracked
    steps, ``None`` at others.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss= must be a scalar tensor, got {loss!r}")
    if not tracked:
        return None
    if micro is not None:
        try:
            return accumulation.micro_batch_loss_scale(loss.reshape(()), losses, micro.count)
        except ValueError as error:
            raise ValueError(f"loss= {error}; or leave loss= out (the tracker gives it)") from None
    try:
        return functional.loss_scale(loss.reshape(()), losses)
    except ValueError:
        total = losses.detach().double().sum().item()
        raise ValueError(
            f"loss= {loss.item():.6g} is neither the mean ({total / len(losses):.6g}) nor the "
            f"sum ({total:.6g}) of losses: leave loss= out (the tracker differentiates "
            "losses.mean(), or losses.sum() with reduction='sum'), or pass the per-example "
            "losses of the loss you differentiate"
        ) from None


def declared_batch(losses, loss, reduction, micro, scale=None) -> Tuple["Batch", Any]:
    """The :class:`~cockpit_gradnoise.step.Batch` a tracker differentiates, and whether its losses are finite.

    ``N = len(losses)``; ``c`` is ``scale`` (that of a given ``loss=``, found
    by :func:`check_loss`), else that of the reduction the tracker chose:
    ``1/N`` for the mean (``1/(K N)`` over ``K`` micro-batches), ``1`` for the
    sum, the very numbers the explicit API infers. Whether the losses are
    finite is what the inference would find (the scale is NaN otherwise): a
    bool on the CPU, a 0-dim tensor on other devices, not read here.

    Args:
        losses: The per-example losses, ``[N]``.
        loss: The loss differentiated (unscaled).
        reduction: ``"mean"``, ``"sum"`` or ``None`` (the mean).
        micro: The call's micro-batch, or ``None``.
        scale: ``c`` of a given ``loss=``; the losses' finiteness is then in it.
    """
    from cockpit_gradnoise.step import Batch  # here: importing step imports Cockpit

    n = losses.shape[0]
    if scale is not None:
        return Batch(n, scale), True
    if reduction == "sum":
        scale = 1.0
    else:
        scale = 1.0 / n if micro is None else 1.0 / (micro.count * n)
    if micro is None and n == 1:
        return Batch(n, 1.0), True  # the mean is the sum: never told apart, never NaN
    if _device.on_host(losses) and _device.on_host(loss):  # two reads, not five tensor operations
        return Batch(n, scale), (math.isfinite(float(loss.detach()))
                                 and math.isfinite(float(losses.detach().sum(dtype=torch.float64))))
    return Batch(n, scale), torch.isfinite(loss.detach().double()) & torch.isfinite(losses.detach().double().sum())
