"""``Embedding`` for any dtype: BackPACK 1.7.1 builds a float32 one-hot tensor.

Its per-example results then fail on float64 models; the derivatives below
build the one-hot tensor in the gradient's dtype.
"""

from cockpit_gradnoise.extensions._squares import SquaredNormsFromContributionsMixin

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
        equation = f"sn...,vn...h->v{'' if sum_batch else 'n'}sh"
        return torch.einsum(equation, one_hot, mat)


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


class GradEmbeddingAnyDtype(GradEmbedding):
    """The gradient of an Embedding's weight, any dtype."""

    def __init__(self):
        super().__init__()
        self.derivatives = EmbeddingDerivativesAnyDtype()
