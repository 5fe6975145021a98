"""Per-example losses of batches the quantities cannot read as they come: padded sequences."""

from typing import Optional

import torch

WEIGHTINGS = ("tokens", "examples")


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
