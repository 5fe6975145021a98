"""Native rules for Hugging Face ``transformers`` layers, found by class name (no import).

Cheaper than the ``torch.func`` fallback (:mod:`.fallback`), and exact:

- ``transformers.pytorch_utils.Conv1D`` (GPT-2's every projection):
  ``y = x W + b`` with ``W`` stored ``[in, out]``, a ``Linear`` with the
  weight transposed. The Linear rules (:mod:`.linear`) read only the layer's
  input and output gradient, so they give ``[T, S]`` and ``||x_i||^2`` of
  ``W^T``; ``[T, S]`` is transposed back, a norm is the same for ``W``.
- The RMSNorm classes of Llama, Qwen2 and Mistral: ``y = w * x_hat`` with
  ``x_hat = (x_32 / sqrt(mean(x_32^2) + eps)).to(x.dtype)`` computed in
  float32 whatever the input's dtype, so the contributions
  ``x_i(w) = sum_p x_hat_ip G_ip`` use that very float32 ``x_hat``
  (a float64 ``x_hat`` would differ from the layer's own gradient by ~1e-7).
- T5's ``T5LayerNorm``: ``y = w * x_hat`` with ``x_hat = x * rsqrt(mean(x_32^2)
  + eps)``, only the variance in float32 (the product in ``x``'s dtype), rounded
  to ``w``'s dtype where that is half precision, as the layer computes it.

The classes are matched by their qualified name, so the package never
imports ``transformers``; a model that has these layers imported it.
"""

from typing import Callable, Dict, Optional

from cockpit_gradnoise.extensions import facts, linear, normalization
from cockpit_gradnoise.extensions.hf_names import CONV1D, RMS_NORMS, T5_LAYER_NORM, qualified_name
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.extensions.sums import sums_of

import torch
from backpack.extensions.firstorder.gradient.linear import GradLinear
from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn


class SumsConv1D(linear.SumsLinear):
    """``[T, S]`` of ``Conv1D``: the Linear rule's, weight transposed back to ``[2, in, out]``."""

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        return super().weight(ext, module, g_inp, g_out, bp_quantities).transpose(1, 2)


class GradConv1D(GradLinear):
    """``sum_i x_i`` of ``Conv1D``: ``W.grad = sum_{n,p} a_np^T G_np`` (``[in, out]``)."""

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        inputs, grads = module.input0, g_out[0]
        return torch.mm(inputs.reshape(-1, inputs.shape[-1]).T, grads.reshape(-1, grads.shape[-1]))


def layer_input_dtype(input: Tensor) -> torch.dtype:
    """The dtype of the layer's first input as the layer got it (the hooks widen what the
    rules see, :mod:`.precision`), where a rule's result depends on it (Hugging Face
    RMSNorm's cast of ``x_hat``); ``input``'s own dtype outside a dispatch of :mod:`.hooks`."""
    call = facts.recording().call
    first = call.inputs[0] if call is not None and call.inputs else None
    return first.dtype if isinstance(first, Tensor) and first.is_floating_point() else input.dtype


def hf_rms_norm_contributions(module: nn.Module, input: Tensor, grad_output: Tensor, name: str) -> Tensor:
    """``sum_p x_hat_ip G_ip`` over the positions, ``x_hat`` in float32 as the layer computes it."""
    hidden = input.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    # Rounded to the dtype the layer got (bfloat16 in a bfloat16 model), as it rounds it.
    normalized = hidden.to(layer_input_dtype(input))
    return normalization.scale_contributions(normalized, grad_output, tuple(range(1, input.dim() - 1)))


def t5_layer_norm_contributions(module: nn.Module, input: Tensor, grad_output: Tensor,
                                name: str) -> Tensor:
    """``sum_p x_hat_ip G_ip`` over the positions, ``x_hat`` as ``T5LayerNorm`` computes it."""
    variance = input.to(torch.float32).pow(2).mean(-1, keepdim=True)
    normalized = input * torch.rsqrt(variance + module.variance_epsilon)
    if module.weight.dtype in (torch.float16, torch.bfloat16):
        normalized = normalized.to(module.weight.dtype)
    return normalization.scale_contributions(normalized, grad_output, tuple(range(1, input.dim() - 1)))


_REDUCERS = {
    BATCH_L2_SAVEFIELD: normalization.squared_norms,
    SUMS_SAVEFIELD: sums_of,
    LOCAL_GRADIENT_SAVEFIELD: normalization.gradient,
}


def _rules() -> Dict[str, Dict[str, ModuleExtension]]:
    conv1d = {
        BATCH_L2_SAVEFIELD: linear.SquaredNormsLinear(),
        SUMS_SAVEFIELD: SumsConv1D(),
        LOCAL_GRADIENT_SAVEFIELD: GradConv1D(),
    }
    rules = {CONV1D: conv1d}
    contributions = {name: hf_rms_norm_contributions for name in RMS_NORMS}
    contributions[T5_LAYER_NORM] = t5_layer_norm_contributions
    for name, of in contributions.items():
        rules[name] = {
            savefield: normalization.NormalizationModuleExtension(of, reduce, ("weight",))
            for savefield, reduce in _REDUCERS.items()
        }
    return rules


#: Qualified class name -> {savefield: module extension}.
RULES: Dict[str, Dict[str, ModuleExtension]] = _rules()


def rule_for(savefield: str, module: nn.Module) -> Optional[Callable]:
    """The module extension of ``module`` for the extension saving ``savefield``, or ``None``."""
    return RULES.get(qualified_name(module), {}).get(savefield)


def has_rule(module: nn.Module) -> bool:
    """Whether ``module``'s class has a rule here."""
    return qualified_name(module) in RULES
