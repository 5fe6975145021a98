"""Mixed precision: the rules see the factors as the layer computed with them, in float32 or wider.

Two setups put low-precision numbers into a backward pass:

- **autocast** (``torch.autocast(device, dtype=torch.bfloat16)`` or
  ``float16``) on a float32 model: a ``Linear`` or a convolution casts its
  float32 input and weight to the autocast dtype and returns its output in
  it, so its output gradient arrives in that dtype too, while the input kept
  by the forward hook is the float32 tensor the layer was given;
- a **bfloat16 or float16 model**: inputs, output gradients and parameters
  are all in that dtype.

The per-example contribution that the low-precision backward pass computes
is ``x_i = sum_l g_il a_il^T`` of the low-precision factors: the output
gradient ``g`` and the input ``a`` *as the layer computed with it* (cast to
the autocast dtype). So, before the rules run (:func:`shown_inputs`,
:func:`shown_grad_output`, called by :mod:`.hooks` for every module):

- a floating input wider than the layer's output dtype of a layer that
  multiplies it by its weight (``Linear``, convolutions, Hugging Face
  ``Conv1D``: :func:`is_bilinear`) is rounded to the output's dtype, which
  is the autocast cast the layer applied;
- every floating input and output gradient is then widened to
  :func:`accumulation_dtype` (float32, or wider): widening is exact, and the
  rules' products and sums then run in float32. The product of two bfloat16
  (8-bit significand) or two float16 (11-bit) numbers is exact in float32
  (24 bits), so the only rounding the rules add to the low-precision factors
  of a ``Linear`` or a convolution is float32's, in the sums;
- normalization rules recompute ``x_hat`` from the widened input, in
  float32, as torch's own low-precision normalization kernels compute it
  internally (``RMSNorm``'s default ``eps`` is then float32's, as torch's
  kernels add for bfloat16 and float16 inputs); where the result depends on
  the dtype the layer got (Hugging Face's RMSNorm rounds ``x_hat`` to it),
  the rule reads it (:func:`.hf.layer_input_dtype`).
  Embeddings' indices are left as they are.

Every savefield is therefore summed in float32 or float64, never in the
low dtype; the per-example squared norms and the sums are saved in float64
where squares could underflow (:mod:`._squares`). For float32 and float64
models outside autocast nothing changes (``Tensor.to`` of the same dtype
returns the tensor itself).

The ``torch.func`` fallback (:mod:`.fallback`) recomputes the module's
forward pass: it runs it under the autocast state of the forward call
(:func:`autocast_state`, :func:`autocast_as`) and widens the per-example
gradients before reducing them (:func:`widened`).

Accuracy (what ``tests/test_mixed_precision.py`` checks): with ``u`` the
unit roundoff of the low dtype (``eps / 2``: ``2**-8`` for bfloat16,
``2**-11`` for float16), the low-precision backward pass's own per-example
gradient of example ``i`` (the gradient of its loss alone, through the same
low-precision batch computation, rounded to the low dtype as autograd
leaves it) differs from the contribution the rules form by at most one
rounding to the low dtype plus float32's summation error:
``||x_i^rules - x_i^low|| <= u ||x_i^low|| + 2 gamma_K(2**-24) ||A_i||`` with
``gamma_K(v) = K v / (1 - K v)`` for sums of ``K`` products and ``A_i`` the
sum of their magnitudes (Higham 2002, "Accuracy and Stability of Numerical
Algorithms", ch. 3).
"""

import contextlib
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.conv import _ConvNd
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

#: Hugging Face's GPT-2 projection, ``y = x W + b`` (:mod:`.hf`), matched by name.
_HF_CONV1D = "transformers.pytorch_utils.Conv1D"


def rounding_bound(values: Tensor, eps: Optional[float] = None) -> float:
    """``sqrt(eps) * max|values|``: how far another computation of ``values`` may lie from them
    by rounding alone (0 for an empty tensor).

    Used wherever one computation is checked against another of the same exact numbers in
    another order of operations: a block's output for one example alone against its row of
    the batch's output (:func:`.fallback.blocks.output_tolerance`), the experts' output
    reimplemented and the router's logits recomputed against the module's own, the fast way's
    per-example squared norms against the per-example recomputation's
    (:mod:`.fallback.experts`), and a gradient's entries on other examples' rows against its
    largest (:func:`.fallback.mixing.mixes`).

    Why ``sqrt(eps)``: each computation's error is that of its sums and products, at most
    ``(m - 1) eps sum_k |t_k|`` for a sum of ``m`` terms in any order (Higham 2002, "Accuracy
    and Stability of Numerical Algorithms", ch. 3-4), plus the relative errors of the factors.
    The values compared here are sums of at most a few thousand terms no larger than about
    the largest magnitude, so two orders of computation differ by at most some thousand
    ``eps * max|values|`` (by far less in practice: errors grow like the square root of the
    number of terms). A difference that is not rounding (another example's rows, another
    activation, a capacity limit, dropout) changes them by a fraction of order 1 of their
    magnitude. ``sqrt(eps)`` is the geometric middle of the two scales, ``eps`` and ``1``:
    it leaves a factor ``1 / sqrt(eps)`` (``6.7e7`` in float64, ``2.9e3`` in float32, ``11``
    in bfloat16) above one rounding of the largest magnitude, and the same factor below a
    difference of that magnitude. Relative to the largest magnitude, not per element: an
    element near zero carries the rounding of the terms that formed it, of the scale of the
    largest. What it cannot see: a real difference under ``sqrt(eps)`` of the largest
    magnitude (``3.5e-4`` in float32, ``1.5e-8`` in float64, which the float64 tests use).

    Args:
        values: The reference computation's values (floating).
        eps: The unit of rounding of the computations compared; ``values``' dtype's by
            default (a float64 result of a float32 computation takes float32's).
    """
    if not values.numel():
        return 0.0
    return math.sqrt(torch.finfo(values.dtype).eps if eps is None else eps) * float(values.abs().max())


def accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the rules compute in: the widest of ``dtypes`` and float32."""
    wide = torch.float32
    for dtype in dtypes:
        if dtype.is_floating_point:
            wide = torch.promote_types(wide, dtype)
    return wide


def is_bilinear(module: nn.Module) -> bool:
    """Whether ``module``'s rules multiply its input by its output gradient (and nothing else
    of the input): ``Linear``, convolutions, Hugging Face ``Conv1D``."""
    cls = type(module)
    return (isinstance(module, (nn.Linear, _ConvNd))
            or f"{cls.__module__}.{cls.__qualname__}" == _HF_CONV1D)


def _is_float(value) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


#: The dtypes the rules compute in as they are: ``accumulation_dtype`` of each is itself.
_WIDE = (torch.float32, torch.float64)


def shown_inputs(module: nn.Module, inputs: tuple, output: Tensor) -> tuple:
    """The inputs as the rules see them (the module's docstring): rounded to the output's
    dtype where autocast cast them, then widened to float32."""
    if not _is_float(output):
        return inputs
    dtype = output.dtype
    if dtype in _WIDE and all(not isinstance(x, Tensor) or x.dtype is dtype or not x.is_floating_point()
                              for x in inputs):
        return inputs  # a float32 or float64 layer: each input is shown as it is (no cast, no widening)
    shown = []
    for x in inputs:
        if _is_float(x):
            if x.dtype != output.dtype and torch.finfo(x.dtype).bits > torch.finfo(output.dtype).bits \
                    and is_bilinear(module):
                x = x.to(output.dtype)  # autocast's cast, as the layer computed with it
            x = x.to(accumulation_dtype(x.dtype))
        shown.append(x)
    return tuple(shown)


def shown_grad_output(grad_output: Tensor) -> Tensor:
    """The output gradient widened to float32 (unchanged if float32 or wider)."""
    if not _is_float(grad_output):
        return grad_output
    return grad_output.to(accumulation_dtype(grad_output.dtype))


def shown_grad_outputs(g_out: tuple) -> tuple:
    """:func:`shown_grad_output` of each output gradient (``g_out`` itself where none changes)."""
    if all(isinstance(g, Tensor) and g.dtype in _WIDE for g in g_out):
        return g_out
    return tuple(shown_grad_output(g) for g in g_out)


def widened(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 if it is narrower (results to be summed)."""
    return shown_grad_output(tensor)


def autocast_state(device_type: str) -> Optional[Tuple[str, torch.dtype]]:
    """``(device type, dtype)`` of the autocast enabled now on ``device_type``, else ``None``."""
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return None
    try:
        enabled = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # torch < 2.4
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        elif device_type == "cuda":
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
        else:
            return None
    return (device_type, dtype) if enabled else None


def autocast_as(state: Optional[Tuple[str, torch.dtype]]):
    """The autocast context of :func:`autocast_state`'s ``state`` (disabled for ``None``)."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1])


class NarrowestResult(TorchFunctionMode):
    """The narrowest floating dtype among the results of the operations run inside
    (``dtype``, starting from the one given): a float64 model whose mixture-of-experts
    router computes in float32 (``router_logits.float()``, ``self.weight.type(torch.float32)``
    in ``transformers``) rounds to float32 there, whatever the model's dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for leaf in _pytree.tree_leaves(result):
            if _is_float(leaf) and torch.finfo(leaf.dtype).eps > torch.finfo(self.dtype).eps:
                self.dtype = leaf.dtype
        return result
