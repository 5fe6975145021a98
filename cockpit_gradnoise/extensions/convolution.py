"""Convolutions: sums of squared per-example contributions and per-example norms.

Every convolution's weight gradient is, per example ``i`` and group, a sum over
positions ``l`` of outer products, ``x_i = sum_l b_il a_il^T``:

- ``Conv``: ``b_il`` is the output gradient at output position ``l``
  (``C_out / G`` numbers) and ``a_il`` the input patch read there
  (``C_in / G * K`` numbers, ``K`` kernel elements);
- ``ConvTranspose``: its weight gradient is that of an ordinary convolution
  of the *output gradient* (same kernel size, stride, padding, dilation and
  groups) whose "output" is the layer's input. So ``b_il`` is the input at
  input position ``l`` (``C_in / G``) and ``a_il`` the output-gradient patch
  read there (``C_out / G * K``). Positions past the input (``output_padding``)
  are dropped. This is exact for ``output_padding``, where BackPACK 1.7.1's
  ``BatchGrad`` crashes, and reads ``L`` = input positions, not BackPACK's
  mostly-zero unfolding over output positions.

Two exact ways to compute each result, chosen per layer by a cost model
(:func:`formation_is_cheaper`):

- **formation**: form ``x_i`` for a chunk of examples, square them and add
  them up at once. About the flops of the layer's weight gradient, but
  ``N |W|`` numbers written and read: slow where ``L`` is small.
- **expansion**: ``sum_i x_i**2 = sum_{i,l,l'} (b_il * b_il') (a_il * a_il')^T``
  (elementwise products), one matrix product with inner dimension ``N L(L+1)/2``
  (pairs ``l <= l'``, off-diagonal ones counted twice). For ``L = 1`` this is
  the Linear identity ``(B**2)^T (A**2)``. Likewise
  ``||x_i||^2 = sum_{l,l'} (b_il . b_il') (a_il . a_il')`` (Gram matrices;
  BackPACK's ``BatchL2Grad`` contracts the same but ignores ``groups``, and
  for transposed convolutions works over output positions). Its
  work grows as ``L^2``: cheap only where ``L`` is small. Its terms
  can cancel (a sum of squares is formed from products of either sign):
  the relative error of an element is about ``eps`` times the ratio of
  ``sum_i (sum_l |b_il a_il|)^2`` to the result, small where ``L`` is small,
  where it is chosen; elements that are exactly zero stay zero.

For ``[sum_i x_i, sum_i x_i**2]`` (:func:`weight_sums`, behind the
gradient's standard deviation) only formation is accurate enough where
``L > 1``; it is used there whatever the cost.

Both run over chunks of examples sized to :data:`CHUNK_BYTES`: no more than
about that is allocated at once beyond the layer's inputs and output
gradients. Neither uses BackPACK's derivatives, so BackPACK's
``weight_jac_t_save_memory`` setting does not matter.
"""

import math
from typing import Callable, Optional, Tuple

from cockpit_gradnoise.extensions.sums import sums_of

import torch
import torch.nn.functional as F
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.extensions.firstorder.gradient import (
    conv1d,
    conv2d,
    conv3d,
    convtranspose1d,
    convtranspose2d,
    convtranspose3d,
)
from torch import Tensor, nn

#: Bytes of temporary tensors (copies of a chunk's inputs and patches,
#: per-example gradients or products of positions) one chunk of examples may
#: allocate; at least one example is processed at a time whatever it needs.
#: 16 MiB: small beside a plain step of resnet18 at batch 64, and below glibc's
#: largest mmap threshold (32 MiB), so that chunks are reused from the heap
#: instead of being mapped and page-faulted anew.
CHUNK_BYTES = 16 * 2**20

#: ``None`` chooses per layer by :func:`formation_is_cheaper`; ``"formation"``
#: or ``"expansion"`` (expanding the square, or Gram matrices for norms)
#: forces one method for every layer (tests, measurements), also for the
#: norms of Linear layers on sequences (:mod:`.linear`).
FORCE_METHOD: Optional[str] = None

#: Cost of moving one number through memory, in floating-point operations of a
#: matrix product. Measured on resnet18's layers; any value from 10 to 320
#: makes the same choices for resnet18 and the benchmark CNN.
FLOPS_PER_ELEMENT_MOVED = 40

_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def patches(x: Tensor, kernel_size, stride, dilation) -> Tensor:
    """Patches of an already padded, channels-last ``x`` ``[N, S_1..S_d, C]``.

    A view ``[N, L_1..L_d, C, k_1..k_d]``: patch ``(l_1..l_d)`` starts at
    ``l * stride`` and reads every ``dilation``-th element, ``kernel_size`` of
    them, per spatial dimension.
    """
    for d in range(len(kernel_size)):
        span = dilation[d] * (kernel_size[d] - 1) + 1
        x = x.unfold(1 + d, span, stride[d])[..., :: dilation[d]]
    return x


def weight_factors(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``(B, A)`` with ``x_i[g] = B[i, g] @ A[i, g]`` for the weight's contributions.

    Shapes ``B: [N, G, C_b, L]``, ``A: [N, G, L, C_a]``, ``A``'s last dimension
    ordered as ``(k_1..k_d, C / G)``: copying patches from a channels-last
    tensor into this order moves runs of ``C / G`` contiguous numbers, several
    times faster than ``torch.nn.functional.unfold``'s order at resnet18's
    sizes. :func:`as_weight` puts a result back in ``module.weight``'s order.
    """
    n, groups, dims = inputs.shape[0], module.groups, len(module.kernel_size)
    if isinstance(module, _TRANSPOSED):
        pad = [p for p in reversed(module.padding) for _ in range(2)]
        padded = F.pad(grad_output, pad)
        # Only patches starting at input positions (not those output_padding adds).
        reach = [
            (size - 1) * s + d * (k - 1) + 1
            for size, s, d, k in zip(
                inputs.shape[2:], module.stride, module.dilation, module.kernel_size
            )
        ]
        padded = padded[(..., *(slice(r) for r in reach))]
        b = inputs
    else:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        # The padding nn.Conv*d computes for any padding and padding_mode, also
        # for padding="same" (longer on the right); private, present since torch 1.5.
        padded = F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
        b = grad_output
    view = patches(
        padded.movedim(1, -1).contiguous(), module.kernel_size, module.stride, module.dilation
    )
    view = view.unflatten(1 + dims, (groups, -1))  # [N, L_1..L_d, G, C/G, k_1..k_d]
    grid, kernel = range(1, 1 + dims), range(3 + dims, 3 + 2 * dims)
    a = view.permute(0, 1 + dims, *grid, *kernel, 2 + dims)
    positions = math.prod(view.shape[1 : 1 + dims])
    return b.reshape(n, groups, -1, positions), a.reshape(n, groups, positions, -1)


def as_weight(module: nn.Module, result: Tensor) -> Tensor:
    """``[G, C_b, C_a]`` in :func:`weight_factors`' order as ``module.weight``.

    ``module.weight`` is ``[G * C_b, C / G, k_1..k_d]``.
    """
    kernel_first = result.reshape(*module.weight.shape[:1], *module.kernel_size, -1)
    return kernel_first.movedim(-1, 1)


def bias_contributions(grad_output: Tensor) -> Tensor:
    """Per-example bias gradients ``[N, C_out]``: the output gradient summed over positions."""
    return grad_output.flatten(start_dim=2).sum(2)


def layer_shape(
    module: nn.Module, inputs: Tensor, grad_output: Tensor
) -> Tuple[int, int, int, int]:
    """``(G, C_b, C_a, L)`` of :func:`weight_factors`, without computing them."""
    groups, kernel = module.groups, math.prod(module.kernel_size)
    if isinstance(module, _TRANSPOSED):
        c_b, c_a, grid = module.in_channels, module.out_channels * kernel, inputs.shape[2:]
    else:
        c_b, c_a, grid = module.out_channels, module.in_channels * kernel, grad_output.shape[2:]
    return groups, c_b // groups, c_a // groups, math.prod(grid)


def formation_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of forming one example's gradient of one group, squaring and summing it.

    A ``C_b x L`` by ``L x C_a`` product (``2 C_b C_a L`` operations), whose
    ``C_b C_a`` numbers are written and read again.
    """
    return 2 * c_b * c_a * positions + FLOPS_PER_ELEMENT_MOVED * 2 * c_b * c_a


def expansion_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of one example's and group's share of the expanded ``sum_i x_i**2``.

    ``L(L+1)/2`` products of positions, ``C_b + C_a`` numbers each, written and
    read by the matrix product, which spends ``2 C_b C_a`` operations on each.
    """
    pairs = positions * (positions + 1) // 2
    return 2 * c_b * c_a * pairs + FLOPS_PER_ELEMENT_MOVED * 2 * pairs * (c_b + c_a)


def gram_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of one example's and group's ``||x_i||^2`` from two ``L x L`` Gram matrices."""
    return 2 * positions**2 * (c_b + c_a) + FLOPS_PER_ELEMENT_MOVED * 4 * positions**2


def formation_is_cheaper(alternative_cost, c_b: int, c_a: int, positions: int) -> bool:
    """Whether :func:`formation_cost` is at most ``alternative_cost`` (same arguments).

    Both costs are per example and group, so neither the batch size nor the
    number of groups changes the choice.
    """
    return formation_cost(c_b, c_a, positions) <= alternative_cost(c_b, c_a, positions)


def _use_formation(alternative_cost, c_b, c_a, positions) -> bool:
    if FORCE_METHOD is None:
        return formation_is_cheaper(alternative_cost, c_b, c_a, positions)
    if FORCE_METHOD not in ("formation", "expansion"):
        raise ValueError(
            f"FORCE_METHOD must be None, 'formation' or 'expansion', got {FORCE_METHOD!r}"
        )
    return FORCE_METHOD == "formation"


def examples_per_chunk(numbers_per_example: int, itemsize: int) -> int:
    """How many examples' temporaries fit in :data:`CHUNK_BYTES` (at least one)."""
    return max(1, CHUNK_BYTES // (numbers_per_example * itemsize))


def _chunks(module, inputs, grad_output, temporaries_per_example):
    """:func:`weight_factors` of consecutive chunks of examples within :data:`CHUNK_BYTES`.

    ``temporaries_per_example``: numbers a method allocates per example besides
    the factors; the factors' copies (padded channels-last tensor, patches) are
    added here.
    """
    _, _, c_a, positions = layer_shape(module, inputs, grad_output)
    copies = inputs[0].numel() + grad_output[0].numel() + module.groups * c_a * positions
    size = examples_per_chunk(copies + temporaries_per_example, inputs.element_size())
    for start in range(0, inputs.shape[0], size):
        end = start + size
        yield weight_factors(module, inputs[start:end], grad_output[start:end])


def _formed_gradients(module, inputs, grad_output):
    """Per-example weight gradients ``[n, G, C_b, C_a]``, chunk by chunk (:data:`CHUNK_BYTES`).

    A whole chunk at once: fewer, larger operations than one example at a
    time, which on a shared machine wait less for descheduled threads (one
    example at a time, in cache, won only on a quiet core, for resnet18's 4x4
    layers).
    """
    groups, c_b, c_a, _ = layer_shape(module, inputs, grad_output)
    for b, a in _chunks(module, inputs, grad_output, groups * c_b * c_a):
        yield torch.matmul(b, a)


def _position_pairs(b: Tensor, a: Tensor) -> Tuple[Tensor, Tensor]:
    """Products of positions ``l <= l'`` of :func:`weight_factors`' ``(B, A)``.

    Shapes ``[G, N P, C_b]`` and ``[G, N P, C_a]`` for ``P = L(L+1)/2`` pairs.

    Off-diagonal products of ``b`` are doubled (exact in floating point), so
    that summing over the pairs equals summing over all ``(l, l')``.
    """
    positions = a.shape[2]
    first, second = torch.triu_indices(positions, positions, device=a.device)
    doubled = torch.where(first == second, 1.0, 2.0).to(a.dtype)
    b = b.transpose(-1, -2)  # [N, G, L, C_b]
    b_pairs = b[:, :, first].mul_(b[:, :, second]).mul_(doubled[:, None])
    a_pairs = a[:, :, first].mul_(a[:, :, second])
    return (
        b_pairs.transpose(0, 1).flatten(1, 2),
        a_pairs.transpose(0, 1).flatten(1, 2),
    )


def _weight_sums(module: nn.Module, inputs: Tensor, grad_output: Tensor, with_total: bool):
    """``(sum_i x_i or None, sum_i x_i**2)`` in :func:`weight_factors`' order (see :func:`weight_sums`)."""
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    squares = inputs.new_zeros(groups, c_b, c_a)
    total = inputs.new_zeros(groups, c_b, c_a) if with_total else None
    if (with_total and positions > 1) or _use_formation(expansion_cost, c_b, c_a, positions):
        for gradients in _formed_gradients(module, inputs, grad_output):
            if with_total:
                total += gradients.sum(0)
            squares += gradients.square_().sum(0)
        return total, squares
    pairs = positions * (positions + 1) // 2
    # Products of positions, and one factor's indexed copy while forming them.
    for b, a in _chunks(module, inputs, grad_output, 2 * groups * pairs * (c_b + c_a)):
        if with_total:  # one position: sum_i b_i a_i^T, [G, C_b, n] @ [G, n, C_a]
            total.baddbmm_(b.permute(1, 2, 0, 3).flatten(2), a.transpose(0, 1).flatten(1, 2))
        b_pairs, a_pairs = _position_pairs(b, a)
        squares.baddbmm_(b_pairs.transpose(1, 2), a_pairs)
    return total, squares


def weight_sum_of_squares(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``sum_i x_i**2`` per element of ``module.weight``, exact.

    .. math:: \\sum_i \\Big(\\sum_l b_{il} a_{il}^\\top\\Big)^{\\circ 2}
              = \\sum_{i,l,l'} (b_{il} \\circ b_{il'}) (a_{il} \\circ a_{il'})^\\top
    """
    return as_weight(module, _weight_sums(module, inputs, grad_output, with_total=False)[1])


def weight_sums(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[sum_i x_i, sum_i x_i**2]`` of ``module.weight``, ``[2, *weight.shape]``.

    Both from the same formed ``x_i`` wherever the layer has ``L > 1``
    positions, whatever :func:`formation_is_cheaper` (or :data:`FORCE_METHOD`)
    says: the expansion forms no ``x_i``, and where the terms of one
    contribution cancel its ``S`` is off by far more than the rounding bound of
    ``S - T**2 / N``
    (:func:`~cockpit_gradnoise.functional.variance_rounding_bound`): identical
    examples gave an sd of ``1e-3`` to ``1e-6`` of the contributions
    (``|S - T**2 / N|`` up to ``1e6`` eps ``S`` in float32, ``4e9`` in float64)
    on a 3x3 convolution with 2x2 output positions. With one position each
    contribution is one product, ``x_i = b_i a_i^T``, as in a Linear layer:
    ``T = sum_i b_i a_i^T`` and ``S`` by the expansion are within the bound
    (``inner_terms = 1``), and the cost model decides.
    """
    total, squares = _weight_sums(module, inputs, grad_output, with_total=True)
    return torch.stack([as_weight(module, total), as_weight(module, squares)])


def weight_squared_norms(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2`` of ``module.weight``'s contributions, ``[N]``, exact.

    .. math:: \\|x_i\\|^2 = \\sum_g \\sum_{l,l'} (b_{igl} \\cdot b_{igl'})(a_{igl} \\cdot a_{igl'})
    """
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    if _use_formation(gram_cost, c_b, c_a, positions):
        gradients = _formed_gradients(module, inputs, grad_output)
        return torch.cat([x.square_().sum((1, 2, 3)) for x in gradients])
    norms = []
    for b, a in _chunks(module, inputs, grad_output, 2 * groups * positions**2):
        gram_b = torch.matmul(b.transpose(-1, -2), b)
        gram_a = torch.matmul(a, a.transpose(-1, -2))
        norms.append(gram_b.mul_(gram_a).sum((1, 2, 3)))
    return torch.cat(norms)


class _ConvolutionExtension(FirstOrderModuleExtension):
    """Weight and bias of ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``."""

    #: ``(module, inputs, grad_output) -> result`` for the weight.
    weight_result: Callable
    #: ``per-example bias gradients [N, C_out] -> result`` for the bias.
    bias_result: Callable

    def __init__(self):
        super().__init__(params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, backproped):
        return type(self).weight_result(module, module.input0, g_out[0])

    def bias(self, ext, module, g_inp, g_out, backproped):
        return type(self).bias_result(bias_contributions(g_out[0]))


class SumOfSquaresConv(_ConvolutionExtension):
    """``sum_i x_i**2`` per element of weight and bias."""

    weight_result = staticmethod(weight_sum_of_squares)
    bias_result = staticmethod(lambda per_example: per_example.square().sum(0))


class SumsConv(_ConvolutionExtension):
    """``[sum_i x_i, sum_i x_i**2]`` of weight and bias (:mod:`.sums`)."""

    weight_result = staticmethod(weight_sums)
    bias_result = staticmethod(sums_of)


class SquaredNormsConv(_ConvolutionExtension):
    """``||x_i||^2`` of weight and bias, ``[N]`` each."""

    weight_result = staticmethod(weight_squared_norms)
    bias_result = staticmethod(lambda per_example: per_example.square().sum(1))


# The gradient (LocalGradient, for distributed training) -------------------------


class _ConvGradientMixin:
    """The weight's gradient by ``aten.convolution_backward``, as autograd computes it."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        inputs, padding = module.input0, module.padding
        if isinstance(padding, str) or module.padding_mode != "zeros":
            # The input as the convolution saw it: "same" pads asymmetrically
            # for even kernels, other modes pad before a convolution without.
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            inputs = F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)
            padding = (0,) * (module.weight.dim() - 2)
        transposed = isinstance(module, _TRANSPOSED)
        output_padding = module.output_padding if transposed else (0,) * (module.weight.dim() - 2)
        _, grad_weight, _ = torch.ops.aten.convolution_backward(
            g_out[0], inputs, module.weight, None, module.stride, padding,
            module.dilation, transposed, output_padding, module.groups, (False, True, False),
        )
        return grad_weight


class GradConv1dFast(_ConvGradientMixin, conv1d.GradConv1d):
    """``Conv1d``."""


class GradConv2dFast(_ConvGradientMixin, conv2d.GradConv2d):
    """``Conv2d``."""


class GradConv3dFast(_ConvGradientMixin, conv3d.GradConv3d):
    """``Conv3d``."""


class GradConvTranspose1dFast(_ConvGradientMixin, convtranspose1d.GradConvTranspose1d):
    """``ConvTranspose1d``."""


class GradConvTranspose2dFast(_ConvGradientMixin, convtranspose2d.GradConvTranspose2d):
    """``ConvTranspose2d``."""


class GradConvTranspose3dFast(_ConvGradientMixin, convtranspose3d.GradConvTranspose3d):
    """``ConvTranspose3d``."""
