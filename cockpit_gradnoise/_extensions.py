"""BackPACK extensions the quantities request.

They are BackPACK's own ``BatchL2Grad`` and ``SumGradSquared`` with three
changes:

- their own savefields, so they never collide with (or get deleted by) the
  same extensions that Cockpit's own quantities request in one backward pass;
- unsupported layers are skipped silently (the quantities warn once, naming
  the parameters) instead of failing or warning on every step;
- ``Embedding`` works for float64 models (BackPACK 1.7.1 builds a float32
  one-hot tensor there and fails on any other dtype);
- ``BatchL2Grad`` for grouped convolutions (``groups > 1``), where BackPACK
  1.7.1 is 40-65% wrong, computes the layer's per-example gradients and
  reduces them right away (memory: one layer's per-example gradients).
"""

import torch
from backpack.core.derivatives.embedding import EmbeddingDerivatives
from backpack.extensions import BatchL2Grad, SumGradSquared
from backpack.extensions.backprop_extension import FAIL_SILENT
from backpack.extensions.firstorder.batch_l2_grad import convnd, convtransposend
from backpack.extensions.firstorder.batch_l2_grad.embedding import BatchL2Embedding
from backpack.extensions.firstorder.sum_grad_squared.embedding import SGSEmbedding
from backpack.utils.subsampling import subsample
from torch import nn

BATCH_L2_SAVEFIELD = "cgn_batch_l2"
SUM_GRAD_SQUARED_SAVEFIELD = "cgn_sum_grad_squared"


class _ConvWeightNormsMixin:
    """Per-example squared norms of a convolution's weight, right for any ``groups``.

    BackPACK's ``weight`` contracts Gram matrices over output positions, about
    ``L^2 (C_out + C_in k)`` operations per example for ``L`` output positions;
    forming the layer's per-example gradients costs about ``L * weight.numel()``.
    For convolutions (not transposed) with ``groups == 1`` the cheaper one is
    used; grouped ones always form the gradients (BackPACK's is wrong there).
    """

    def weight(self, ext, module, g_inp, g_out, backproped):
        if module.groups == 1 and not self._direct_is_cheaper(module, g_out[0]):
            return super().weight(ext, module, g_inp, g_out, backproped)
        per_example = self.derivatives.param_mjp(
            "weight", module, g_inp, g_out, g_out[0], sum_batch=False
        )
        return per_example.pow(2).flatten(start_dim=1).sum(1)

    @staticmethod
    def _direct_is_cheaper(module, grad_output):
        if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
            return False
        positions = grad_output[0, 0].numel()
        c_out = module.weight.shape[0]
        return module.weight.numel() < positions * (c_out + module.weight[0].numel())


class _EmbeddingDerivatives(EmbeddingDerivatives):
    """BackPACK's Embedding derivatives with the one-hot tensor in the gradient's dtype."""

    def _weight_jac_t_mat_prod(
        self, module, g_inp, g_out, mat, sum_batch=True, subsampling=None
    ):
        self._check_parameters(module)
        input0 = subsample(module.input0, subsampling=subsampling)
        # [num_embeddings, N, ...]: which examples and positions use each row.
        one_hot = torch.nn.functional.one_hot(input0, module.num_embeddings)
        one_hot = one_hot.movedim(-1, 0).to(mat.dtype)
        equation = f"sn...,vn...h->v{'' if sum_batch else 'n'}sh"
        return torch.einsum(equation, one_hot, mat)


def _with_embedding_derivatives(module_extension):
    module_extension.derivatives = _EmbeddingDerivatives()
    return module_extension


def _with_conv_weight_norms(base):
    return type(base.__name__ + "Exact", (_ConvWeightNormsMixin, base), {})


_EXACT_CONV_MODULE_EXTENSIONS = {
    nn.Conv1d: _with_conv_weight_norms(convnd.BatchL2Conv1d),
    nn.Conv2d: _with_conv_weight_norms(convnd.BatchL2Conv2d),
    nn.Conv3d: _with_conv_weight_norms(convnd.BatchL2Conv3d),
    nn.ConvTranspose1d: _with_conv_weight_norms(convtransposend.BatchL2ConvTranspose1d),
    nn.ConvTranspose2d: _with_conv_weight_norms(convtransposend.BatchL2ConvTranspose2d),
    nn.ConvTranspose3d: _with_conv_weight_norms(convtransposend.BatchL2ConvTranspose3d),
}


class PerExampleSquaredNorms(BatchL2Grad):
    """``||x_i||^2`` per example and parameter, saved as ``param.cgn_batch_l2`` (``[N]``)."""

    def __init__(self):
        super().__init__()
        self.savefield = BATCH_L2_SAVEFIELD
        self._fail_mode = FAIL_SILENT
        for module_class, extension_class in _EXACT_CONV_MODULE_EXTENSIONS.items():
            self.set_module_extension(module_class, extension_class(), overwrite=True)
        self.set_module_extension(
            nn.Embedding, _with_embedding_derivatives(BatchL2Embedding()), overwrite=True
        )


class SumOfSquaredContributions(SumGradSquared):
    """``sum_i x_i**2`` per element, saved as ``param.cgn_sum_grad_squared``."""

    def __init__(self):
        super().__init__()
        self.savefield = SUM_GRAD_SQUARED_SAVEFIELD
        self._fail_mode = FAIL_SILENT
        self.set_module_extension(
            nn.Embedding, _with_embedding_derivatives(SGSEmbedding()), overwrite=True
        )
