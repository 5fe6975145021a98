"""``Embedding`` for any dtype and with ``padding_idx``.

BackPACK 1.7.1 builds a float32 one-hot tensor, so its per-example results
fail on float64 models, and it refuses ``padding_idx`` (``NotImplementedError``
in the backward pass). The derivatives below build the one-hot tensor in the
gradient's dtype and leave the padding row out of it: torch's embedding
backward never writes that row, so its gradient, and every example's
contribution to it, is exactly 0 by definition (not a sum that rounds to 0), and the
padding positions' output gradients are left out before the sum (a NaN there, as torch
ignores it, never reaches another row).
"""

from cockpit_gradnoise.extensions._squares import SquaredNormsFromContributionsMixin
from cockpit_gradnoise.extensions.sums import SumsFromContributionsMixin

import torch
from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.extensions.firstorder.batch_l2_grad.embedding import BatchL2Embedding
from backpack.extensions.firstorder.gradient.embedding import GradEmbedding
from backpack.extensions.firstorder.sum_grad_squared.embedding import SGSEmbedding
from backpack.utils.subsampling import subsample


class EmbeddingDerivativesAnyDtype(EmbeddingDerivatives):
    """BackPACK's Embedding derivatives with the one-hot tensor in the gradient's dtype."""

    def _weight_jac_t_mat_prod(
        self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None
    ):
        self._check_parameters(module)
        input0 = subsample(module.input0, subsampling=subsampling)
        # [num_embeddings, N, ...]: which examples and positions use each row.
        # By comparison, not F.one_hot, which reads the largest index back to
        # the host (a wait for the device on a GPU); the forward pass checked them.
        rows = torch.arange(module.num_embeddings, device=input0.device)
        one_hot = (input0.unsqueeze(0) == rows.reshape(-1, *[1] * input0.dim())).to(mat.dtype)
        if module.padding_idx is not None:  # non-negative: nn.Embedding normalizes it
            one_hot[module.padding_idx] = 0
            # The padding positions' output gradients reach nothing, not even as 0 * NaN (LED's
            # encoder pads its input with the padding token, whose attention rows are NaN).
            mat = torch.where((input0 != module.padding_idx).unsqueeze(0).unsqueeze(-1), mat, 0)
        equation = f"sn...,vn...h->v{'' if sum_batch else 'n'}sh"
        return torch.einsum(equation, one_hot, mat)

    def _check_parameters(self, module):
        """BackPACK's checks, less ``padding_idx`` (supported above)."""
        if module.max_norm is not None:
            raise NotImplementedError("Only max_norm=None supported.")
        if module.scale_grad_by_freq:
            raise NotImplementedError("Only scale_grad_by_freq=False supported.")
        if module.sparse:
            raise NotImplementedError("Only sparse=False supported.")


class BatchL2EmbeddingAnyDtype(SquaredNormsFromContributionsMixin, BatchL2Embedding):
    """Per-example squared norms of an Embedding's weight, any dtype, squares at a
    power-of-two scale (:mod:`._squares`)."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()


class SGSEmbeddingAnyDtype(SGSEmbedding):
    """Sum of squared per-example contributions to an Embedding's weight, any dtype."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()


class SumsEmbeddingAnyDtype(SumsFromContributionsMixin, SGSEmbeddingAnyDtype):
    """``[T, S]`` of an Embedding's weight, any dtype (:mod:`.sums`)."""


class GradEmbeddingAnyDtype(GradEmbedding):
    """The gradient of an Embedding's weight, any dtype."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()
