"""Convolutions' per-example maths: patches, factors, sums and norms of the contributions.

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

Two exact ways to compute each result, chosen per layer by the cost model of
:mod:`.cost_model`:

- **formation**: form ``x_i`` for a chunk of examples, square them and add
  them up at once. About the flops of the layer's weight gradient, but
  ``N |W|`` numbers written and read: slow where ``L`` is small.
- **products of positions**: ``||x_i||^2 = sum_{l,l'} (b_il . b_il')
  (a_il . a_il')`` (Gram matrices; BackPACK's ``BatchL2Grad`` contracts the
  same but ignores ``groups``, and for transposed convolutions works over
  output positions), whose work grows as ``L^2``: cheap only where ``L`` is
  small. With one position, ``[sum_i x_i, sum_i x_i**2]`` are the two matrix
  products ``B^T A`` and ``(B**2)^T (A**2)``, as for a Linear layer.

For ``[sum_i x_i, sum_i x_i**2]`` (:func:`weight_sums`, behind the
gradient's standard deviation) formation sums ``T`` and ``S`` from the same
computed ``x_i``: identical examples give identical ``x_i`` and so a centred
sum within :func:`~cockpit_gradnoise.functional.variance_rounding_bound`
(``inner_terms = 1``), however the terms of one ``x_i`` cancel. The expanded
square (:func:`expanded_sums`) forms no ``x_i``; its rounding is relative to
the absolute terms, which it sums alongside:

.. math::

    A = \\sum_i \\Big(\\sum_l |b_{il}|\\,|a_{il}|^T\\Big)^2
      = \\sum_i \\sum_{l,l'} |b_{il} b_{il'}|\\,|a_{il} a_{il'}|^T \\ \\ge S
      \\quad \\text{(elementwise)} .

**The expansion's rounding bound.** Per element, with ``u = eps / 2`` and
Higham's ``gamma_m = m u / (1 - m u)`` (Higham 2002, "Accuracy and Stability
of Numerical Algorithms", ch. 3-4: a sum of ``m`` terms in any order, each
term a product of ``k`` rounded factors, is off by at most
``gamma_{m - 1 + k}`` times the sum of the absolute terms), ``M = N L(L+1)/2``
pairs ``(i, l <= l')``, ``alpha_i = sum_l |b_il| |a_il|``:

- ``S``: each term ``w (b_il b_il') (a_il a_il')`` has three rounded
  products (the factor ``w = 2`` above the diagonal is exact) and enters a
  sum of ``M`` terms: ``|dS| <= gamma_{M+2} A``.
- ``T = sum_{i,l} b_il a_il``: a sum of ``N L`` products,
  ``|dT| <= gamma_{NL} sum_i alpha_i``, and ``(sum_i alpha_i)**2 <= N A``
  (Cauchy-Schwarz), so ``|d(T**2) / N| <= (2 gamma_{NL} + gamma_{NL}**2) A``;
  squaring ``T`` and multiplying by ``1 / N`` add ``gamma_3 A``
  (``T**2 / N <= A``).
- The subtraction: ``u |S - T**2 / N| <= u (1 + gamma) A``.
- Sums of ``K <= N`` micro-batches or processes: ``K - 1`` more additions
  in each of ``S`` and ``T``, and ``T``'s rows are then those of the largest
  part (``N_k <= N``); unscaling by the loss scale: two roundings.

Together, since ``gamma_a + gamma_b <= gamma_{a+b}`` (Higham, Lemma 3.3),
the centred sum ``S - T**2 / N`` is off by at most ``gamma_m A`` with
``m = M + 2 N L + 3 K + 6 <= N w(L)``, ``w(L) = L(L+1)/2 + 2L + 6``
(:func:`expansion_rounding_terms`; ``N >= 2``), and
``gamma_m <= 2 m u = m eps`` wherever ``m u <= 1/2``: the bound is
``N w(L) eps A``. (Where ``m u > 1/4``, ``N L**2`` above about ``8e6`` in
float32, the rounding of ``A`` itself is no longer negligible. The cost
model expands only layers with ``L <= 5``: the expansion's products have
``L(L+1)`` rows per example for ``S`` and ``A``, and more than ``40`` of
them cost more than formation's writes, :mod:`.cost_model`.)
The extension saves ``R = w(L) A`` as a third row, ``[T, S, R]``, which adds
over examples, micro-batches and processes as the sums do;
:func:`~cockpit_gradnoise.functional.expansion_rounding_bound` gives
``N eps R``, which :class:`~cockpit_gradnoise.GradientVarianceQuantiles` adds
to ``variance_rounding_bound``: the sd is exact (to the sums' rounding)
where the centred sum is above the bound and 0 where it is rounding noise,
the contract of formation.

Measured (``python -m benchmarks.conv_sums_methods``, resnet18 3x32x32,
batch 64, float32, random weights; benchmarks/README.md): the largest error
of the centred sum was ``5e-3`` of the bound on the ``L = 4`` layers
(``3e-4`` for ``L = 16``); identical examples gave at most ``0.06`` of it
(so sd 0); and no element with real variance came within it at ``L = 4``:
the smallest exact centred sum was ``32`` times the bound (about ``1000`` at
the 0.001 quantile), and there expansion took half to two thirds of
formation's time. At ``L = 16`` the smallest was ``0.24`` times the bound (1
element in 1e5) and at ``L = 64`` 0.6% of the elements fall below it: the
bound grows like ``N L**2``; the cost model chooses formation there anyway
(expansion is 4-6 times slower at ``L = 16``, 50 at ``L = 64``).

Both run over chunks of examples sized to :data:`.cost_model.CHUNK_BYTES`: no more
than about that is allocated at once beyond the layer's inputs and output
gradients. Neither uses BackPACK's derivatives, so BackPACK's
``weight_jac_t_save_memory`` setting does not matter.
"""

import itertools
import math
from typing import Iterator, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import cost_model
from cockpit_gradnoise.extensions._squares import joined, scaled_factors, unscaled_norms, unscaled_sums

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def padded_input(module: nn.Module, inputs: Tensor) -> Tensor:
    """The input of an ``nn.Conv*d`` as the convolution saw it, padded.

    The padding ``nn.Conv*d`` computes for any ``padding`` and ``padding_mode``,
    also for ``padding="same"`` (longer on the right for even kernels); it uses
    the module's private ``_reversed_padding_repeated_twice``, present since
    torch 1.5.
    """
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(inputs, module._reversed_padding_repeated_twice, mode=mode)


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
    if isinstance(module, TRANSPOSED):
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
        padded = padded_input(module, inputs)
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


def as_weights(module: nn.Module, results: Tensor) -> Tensor:
    """:func:`as_weight` of each of ``results`` ``[R, G, C_b, C_a]``: ``[R, *module.weight.shape]``.

    Laid out as ``torch.stack`` of each :func:`as_weight` lays it out: for two and
    three spatial dimensions channels last (``C / G`` innermost), a view of
    contiguous ``results``, without the stack's copy (19 MB for each of
    resnet18's 512-channel layers, in fresh pages each step); for one,
    contiguous (a copy, as the stack's).
    """
    kernel_first = results.reshape(len(results), *module.weight.shape[:1], *module.kernel_size, -1)
    weights = kernel_first.movedim(-1, 2)
    return weights.contiguous() if len(module.kernel_size) == 1 else weights


def layer_shape(
    module: nn.Module, inputs: Tensor, grad_output: Tensor
) -> Tuple[int, int, int, int]:
    """``(G, C_b, C_a, L)`` of :func:`weight_factors`, without computing them."""
    groups, kernel = module.groups, math.prod(module.kernel_size)
    if isinstance(module, TRANSPOSED):
        c_b, c_a, grid = module.in_channels, module.out_channels * kernel, inputs.shape[2:]
    else:
        c_b, c_a, grid = module.out_channels, module.in_channels * kernel, grad_output.shape[2:]
    return groups, c_b // groups, c_a // groups, math.prod(grid)


def _chunks(module, inputs, grad_output, temporaries_per_example) -> Iterator[Tuple[Tensor, Tensor]]:
    """:func:`weight_factors` of consecutive chunks of examples within :data:`.cost_model.CHUNK_BYTES`.

    ``temporaries_per_example``: numbers a method allocates per example besides
    the factors; the factors' copies (padded channels-last tensor, patches) are
    added here.
    """
    _, _, c_a, positions = layer_shape(module, inputs, grad_output)
    copies = inputs[0].numel() + grad_output[0].numel() + module.groups * c_a * positions
    size = cost_model.examples_per_chunk(copies + temporaries_per_example, inputs.element_size())
    for start in range(0, inputs.shape[0], size):
        end = start + size
        yield weight_factors(module, inputs[start:end], grad_output[start:end])


def _formed_gradients(module, inputs, grad_output) -> Iterator[Tensor]:
    """Per-example weight gradients ``[n, G, C_b, C_a]``, chunk by chunk.

    A whole chunk at once: fewer, larger operations than one example at a
    time, which on a shared machine wait less for descheduled threads.
    """
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    if from_windows(module, positions):
        pads = module._reversed_padding_repeated_twice  # (last left, last right, ..., first right)
        padded = inputs.shape[1] * math.prod(
            size + pads[-2 * d - 2] + pads[-2 * d - 1] for d, size in enumerate(inputs.shape[2:]))
        # The padded input's copy and the gradients.
        size = cost_model.examples_per_chunk(padded + groups * c_b * c_a, inputs.element_size())
        for start in range(0, inputs.shape[0], size):
            end = start + size
            yield depthwise_gradients(module, inputs[start:end], grad_output[start:end])
        return
    for b, a in _chunks(module, inputs, grad_output, groups * c_b * c_a):
        yield torch.matmul(b, a)


def forms(module: nn.Module, alternative_cost: cost_model.Cost, c_b: int, c_a: int, positions: int) -> bool:
    """Whether to form ``x_i`` rather than use ``alternative_cost``'s method: always where
    :func:`from_windows` (formed without copying patches, which the alternatives
    copy: 2-6 times faster on ConvNeXt-T's at 1 and 4 positions), unless
    :data:`.cost_model.FORCE_METHOD` says otherwise; else :func:`.cost_model.use_formation`."""
    if cost_model.FORCE_METHOD is None and from_windows(module, positions):
        return True
    return cost_model.use_formation(alternative_cost, c_b, c_a, positions)


def from_windows(module: nn.Module, positions: int) -> bool:
    """Whether a convolution's per-example weight gradients are formed from the input's
    windows (:func:`depthwise_gradients`): not transposed, one input channel per group,
    and at most as many output positions as its kernel has elements.

    The windows take one multiply-add per output position, the patches of the
    other ways one copy per kernel element. Per layer, one thread, batch 32,
    formation alone (ms, windows against patches): 2.2 against 11.4 at one
    position (a 7x7 depthwise convolution, 768 channels), about equal at 16 and
    64 (7x7), 125 against 105 at 256 (7x7), 78 against 40 at 784 (3x3), and
    170 against 9 for a 3x3 convolution of one input channel over 676
    positions (an MNIST network's first, batch 128).
    """
    return (not isinstance(module, TRANSPOSED) and module.in_channels == module.groups
            and positions <= math.prod(module.kernel_size))


def depthwise_gradients(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """Per-example weight gradients of a convolution with one input channel per group
    (:func:`from_windows`), ``[N, C_in, m, K]``.

    Output channel ``(c, j)`` (``m = C_out / C_in`` per input channel ``c``)
    reads input channel ``c`` only; with ``p`` the padded input, stride ``s``
    and dilation ``d``, its contribution at kernel element ``k`` is

    .. math:: x_i[c, j, k] = \\sum_l g_{i,cj,l}\\; p_{ic}[l s + k d] ,

    ``L`` multiply-adds of the window read at output position ``l`` (a view,
    ``K`` elements per channel) by that position's output gradient: no
    patches are copied, and :func:`from_windows` says where that is cheaper.
    (One grouped convolution of ``p`` with ``g`` as its kernels, the other way
    without patches, took 4.2 ms at 64 positions but 165 at 1 per layer of
    ConvNeXt-T at 32x32, batch 32, one thread.)
    ``[N, C_in, m, K]`` is :func:`weight_factors`' ``[N, G, C_b, C_a]``.
    """
    n, channels, grid = inputs.shape[0], module.in_channels, grad_output.shape[2:]
    padded = padded_input(module, inputs).unsqueeze(2)  # [N, C_in, 1, *padded]
    grad = grad_output.reshape(n, channels, -1, *grid)  # [N, C_in, m, *L]
    gradients = None
    for position in itertools.product(*(range(size) for size in grid)):
        window = padded[(..., *(
            slice(p * s, p * s + d * (k - 1) + 1, d)
            for p, s, d, k in zip(position, module.stride, module.dilation, module.kernel_size)
        ))]
        term = grad[(..., *(slice(p, p + 1) for p in position))]
        gradients = window * term if gradients is None else gradients.addcmul_(window, term)
    return gradients.reshape(n, channels, grad.shape[2], -1)


def summed_over_examples(x: Tensor) -> Tensor:
    """``x.sum(0)``, its other dimensions taken in the order they lie in memory.

    The same sums; torch sums a permuted layout (a depthwise convolution's
    gradients of a channels-last input, ``[N, C, 1, K]`` with ``C`` innermost)
    over the examples ten times slower.
    """
    order = sorted(range(1, x.dim()), key=x.stride, reverse=True)
    summed = x.permute(0, *order).sum(0)
    return summed.permute(*sorted(range(len(order)), key=order.__getitem__))


def expansion_rounding_terms(positions: int) -> int:
    """``w(L) = L(L+1)/2 + 2L + 6``: the rounding error of ``S - T**2 / N`` from
    :func:`expanded_sums` is at most ``N w(L) eps A`` (the module's docstring)."""
    return positions * (positions + 1) // 2 + 2 * positions + 6


def expansion_temporaries(groups: int, c_b: int, c_a: int, positions: int) -> int:
    """Numbers :func:`expanded_sums_of_factors` allocates per example: both factors'
    rows (``L`` for ``T``, ``L(L+1)/2`` products of positions) and ``b``'s doubled copy."""
    rows = positions + positions * (positions + 1) // 2
    return groups * (rows * (c_b + c_a) + positions * c_b)


def expanded_sums(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S, A]`` of a convolution's weight, each ``[G, C_b, C_a]``, by products of
    positions (:func:`expanded_sums_of_factors` of :func:`weight_factors`' chunks)."""
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    temporaries = expansion_temporaries(groups, c_b, c_a, positions)
    chunks = _chunks(module, inputs, grad_output, temporaries)
    return expanded_sums_of_factors(chunks, positions)


def expanded_sums_of_factors(chunks: Iterator[Tuple[Tensor, Tensor]], positions: int) -> Tensor:
    """``[T, S, A]``, each ``[G, C_b, C_a]``, by products of positions (no ``x_i`` formed).

    .. math::

        T = \\sum_{i,l} b_{il} a_{il}^T, \\quad
        S = \\sum_i \\sum_{l \\le l'} w_{ll'} (b_{il} b_{il'}) (a_{il} a_{il'})^T, \\quad
        A = \\sum_i \\sum_{l \\le l'} w_{ll'} |b_{il} b_{il'}| |a_{il} a_{il'}|^T

    (products of factors elementwise, ``w = 1`` on the diagonal and ``2``
    above it): three matrix products per chunk of examples, with inner
    dimensions ``n L``, ``n L(L+1)/2`` and ``n L(L+1)/2``. ``A = sum_i (sum_l
    |b_il| |a_il|^T)**2`` is the expansion's absolute counterpart of ``S``,
    which its rounding is relative to (the module's docstring). Outside
    autograd (also under ``create_graph``): the products are written in place,
    and nothing differentiates statistics.

    Args:
        chunks: Factors ``(b [n, G, C_b, L], a [n, G, L, C_a])`` of consecutive
            chunks of examples (at least one), ``x_i[g] = b[i, g] @ a[i, g]``.
        positions: ``L``.
    """
    rows = positions + positions * (positions + 1) // 2  # T's, then S's
    sums = None
    with torch.no_grad():
        for b, a in chunks:
            if sums is None:
                sums = b.new_zeros(3, b.shape[1], b.shape[2], a.shape[3])
            _add_expanded(sums, b, a, rows)
    return sums


def _add_expanded(sums: Tensor, b: Tensor, a: Tensor, rows: int):
    """Add one chunk's share to ``[T, S, A]`` (:func:`expanded_sums_of_factors`)."""
    n, groups, c_b, positions = b.shape
    c_a = a.shape[3]
    # Rows (of the products' inner dimension) outermost: each block a plain matrix.
    b_rows = b.new_empty(groups, c_b, rows, n)
    a_rows = a.new_empty(groups, rows, n, c_a)
    b_rows[:, :, :positions] = b.permute(1, 2, 3, 0)
    a_rows[:, :positions] = a.permute(1, 2, 0, 3)
    b, a = b_rows[:, :, :positions], a_rows[:, :positions]
    doubled = b * 2  # the pairs above the diagonal count twice (exact)
    row = positions
    for first in range(positions):  # pairs (first, first..L-1)
        end = row + positions - first
        own = slice(first, first + 1)
        torch.mul(b[:, :, own], b[:, :, own], out=b_rows[:, :, row : row + 1])
        torch.mul(doubled[:, :, own], b[:, :, first + 1 :], out=b_rows[:, :, row + 1 : end])
        torch.mul(a[:, own], a[:, first:], out=a_rows[:, row:end])
        row = end
    kept = nonzero_columns_of_rows(b_rows, a_rows)  # b and its products (doubled) finite
    if kept is not None:
        _add_expanded_rows(sums, b_rows, a_rows, positions, kept)
        return
    sums[0].baddbmm_(b.flatten(2), a.flatten(1, 2))
    products_b, products_a = b_rows[:, :, positions:].flatten(2), a_rows[:, positions:].flatten(1, 2)
    sums[1].baddbmm_(products_b, products_a)
    sums[2].baddbmm_(products_b.abs_(), products_a.abs_())


#: :func:`nonzero_columns_of_rows` keeps columns in aligned blocks of this many, and gives up where
#: its rows hold more than :data:`RUNS_PER_ROW` runs of blocks on average: a kernel element's
#: columns are consecutive, while zeros scattered over channels (an input channel 0 for every example
#: at one position after a ReLU: resnet18's third stage in a training step) would cut them into
#: runs of a few columns, thousands of tiny products that took 20 times the products of all columns.
COLUMN_BLOCK, RUNS_PER_ROW = 128, 4


def nonzero_columns_of_rows(b: Tensor, a_rows: Tensor):
    """Per row ``r`` of ``a_rows`` ``[G, rows, n, C_a]`` (a position, or a product of two), runs
    ``(start, stop)`` of columns that hold every column holding a nonzero number (NaN
    included) in some group and example, in aligned blocks of :data:`COLUMN_BLOCK` columns
    (a block is kept whole: its other columns add exact zeros); where all rows together keep
    at most half of their columns in at most :data:`RUNS_PER_ROW` runs per row, ``b`` (every
    factor the columns multiply) is finite and both are on the host; else ``None``
    (:func:`nonzero_columns`, row by row)."""
    if not _device.on_host(a_rows) or not a_rows.numel():
        return None
    columns = a_rows.shape[3]
    blocks = -(-columns // COLUMN_BLOCK)
    nonzero = F.pad(a_rows.ne(0).any(2).any(0).to(torch.int8), (0, blocks * COLUMN_BLOCK - columns))
    kept = nonzero.view(len(nonzero), blocks, COLUMN_BLOCK).amax(2)  # [rows, blocks], 0 or 1
    edges = F.pad(kept, (1, 1)).diff(dim=1)  # 1 where a run starts, -1 after it
    found = edges.nonzero().tolist()
    if (2 * COLUMN_BLOCK * int(kept.sum()) > len(kept) * columns or len(found) > 2 * RUNS_PER_ROW * len(kept)
            or not bool(torch.isfinite(b).all())):
        return None
    runs = [[] for _ in range(len(kept))]
    for row, block in found:
        if edges[row, block] > 0:
            runs[row].append(block * COLUMN_BLOCK)
        else:
            runs[row][-1] = (runs[row][-1], min(block * COLUMN_BLOCK, columns))
    return runs


def _add_expanded_rows(sums: Tensor, b_rows: Tensor, a_rows: Tensor, positions: int, kept) -> None:
    """:func:`_add_expanded`'s three products row by row, each over the runs of columns ``kept[r]``
    of its row only (views: no copy): a column that is 0 in row ``r`` for every example adds
    ``b * 0 = 0`` exactly (``b`` finite). A zero-padded kernel over few positions reads padding
    at many of its elements at each position (resnet18's third stage at 32x32, 3x3 over 2x2
    positions: 5 of 9 at each position, 5 to 8 in each product of two): about a third of the
    multiply-adds are left. Each sum adds the same terms in another order (per row, then over
    rows): within the same bound."""
    for row, runs in enumerate(kept):
        b = b_rows[:, :, row]  # [G, C_b, n]
        magnitudes = None if row < positions else b.abs()
        for start, stop in runs:
            a = a_rows[:, row, :, start:stop]  # [G, n, K]
            if row < positions:
                sums[0, :, :, start:stop].baddbmm_(b, a)
            else:
                sums[1, :, :, start:stop].baddbmm_(b, a)
                sums[2, :, :, start:stop].baddbmm_(magnitudes, a.abs())


def weight_sums(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[sum_i x_i, sum_i x_i**2]`` of ``module.weight``, ``[2, *weight.shape]``; with
    a third row ``R = w(L) A`` where ``S`` is expanded over positions.

    Where the cost model (:func:`.cost_model.use_formation` with
    :func:`.cost_model.expansion_cost`) chooses formation, ``T`` and ``S``
    come from the same formed ``x_i``, within
    :func:`~cockpit_gradnoise.functional.variance_rounding_bound` with
    ``inner_terms = 1``. With one position each contribution is one product,
    ``x_i = b_i a_i^T``, as in a Linear layer: ``T = sum_i b_i a_i^T`` and
    ``S = sum_i b_i**2 (a_i**2)^T`` are two matrix products, within the same
    bound. With ``L > 1`` positions the expansion (:func:`expanded_sums`) is
    off by up to ``N w(L) eps A`` (the module's docstring), far more than that
    bound where the terms of one contribution cancel: it saves ``[T, S, R]``,
    ``R = w(L) A`` (:func:`expansion_rounding_terms`), which
    :func:`~cockpit_gradnoise.functional.expansion_rounding_bound` turns into
    the bound. At a power-of-two scale of the input and the output gradient
    (:func:`._squares.scaled_factors`), saved in float64 for float32 (no underflow).
    """
    (inputs, grad_output), scale = scaled_factors(inputs, grad_output)
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    if forms(module, cost_model.expansion_cost, c_b, c_a, positions):
        sums = inputs.new_zeros(2, groups, c_b, c_a)
        for gradients in _formed_gradients(module, inputs, grad_output):
            sums[0] += summed_over_examples(gradients)
            sums[1] += summed_over_examples(gradients.square_())
    elif positions > 1:
        sums = expanded_sums(module, inputs, grad_output)
    else:
        sums = inputs.new_zeros(2, groups, c_b, c_a)
        # The squared factors, and one factor's copy while flattening it.
        for b, a in _chunks(module, inputs, grad_output, 2 * groups * (c_b + c_a)):
            b = b.permute(1, 2, 0, 3).flatten(2)  # [G, C_b, n]
            a = a.transpose(0, 1).flatten(1, 2)  # [G, n, C_a]
            add_products(sums, b, a)
    # Terms of each S: N squares, or N L**2 products of the expansion.
    sums = unscaled_sums(as_weights(module, sums), scale,
                         len(inputs) * positions**2)
    if len(sums) == 3:  # A, to R = w(L) A
        sums[2] *= expansion_rounding_terms(positions)
    return sums


def add_products(sums: Tensor, b: Tensor, a: Tensor) -> None:
    """Add ``[b @ a, b**2 @ a**2]`` (per group: ``b [G, C_b, n]``, ``a [G, n, C_a]``) to
    ``sums`` ``[2, G, C_b, C_a]``: ``T`` and ``S`` of one-product contributions
    ``x_i = b_i a_i^T`` over a chunk of ``n`` examples.

    On the host, over the columns of ``a`` that hold a nonzero number only
    (:func:`nonzero_columns`): a column ``k`` that is 0 for every example adds
    ``sum_i b_i * 0 = 0`` to ``T`` and ``sum_i b_i**2 * 0 = 0`` to ``S``, exactly,
    where ``b`` is finite (``0 * inf`` would be NaN: then every column is
    multiplied). Such columns are a zero-padded kernel's elements that read
    only padding: at one output position (resnet18's last stage at 32x32, a
    3x3 kernel over a 1x1 input padded by 1) 8 of its 9 kernel elements, and the
    products skip them (the same products of the other columns, each sum of
    ``n`` products in its own order: within the same rounding bound).
    """
    b_squared = b.square()
    kept = nonzero_columns(b_squared, a)  # b**2 finite: b too
    if kept is None:
        sums[0].baddbmm_(b, a)
        sums[1].baddbmm_(b_squared, a.square())
        return
    a = a.index_select(2, kept)
    sums[0].index_add_(2, kept, torch.bmm(b, a))
    sums[1].index_add_(2, kept, torch.bmm(b_squared, a.square()))


def nonzero_columns(b: Tensor, a: Tensor):
    """The indices of the columns of ``a`` ``[G, n, C_a]`` that hold a nonzero number (NaN
    included) in some group and example, where at most half of them do, ``b`` (every
    factor the columns multiply) is finite and both are on the host (a read there:
    elsewhere the host would wait); else ``None``."""
    if not _device.on_host(a) or not a.numel():
        return None
    kept = a.ne(0).flatten(0, 1).any(0).nonzero().squeeze(1)
    if 2 * len(kept) > a.shape[2] or not bool(torch.isfinite(b).all()):
        return None
    return kept


def weight_sums_and_squared_norms(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``([T, S], ||x_i||^2)`` of ``module.weight`` from one formation of ``x_i``.

    Where :func:`weight_sums` forms ``x_i``: ``T = sum_i x_i`` and ``S = sum_i
    x_i**2`` (``[2, *weight.shape]``) and the per-example squared norms
    ``||x_i||^2 = sum_j x_ij^2`` (``[N]``) are sums of the same squared
    contributions, over examples and over elements, so one formation gives
    both; each is the very number :func:`weight_sums` and the formation of
    :func:`weight_squared_norms` compute alone (the same scale: each factor's
    largest magnitude, which ``rows=True`` only adds the rows' magnitudes to on
    other devices; the same chunks, the same operations). The caller checks
    that :func:`weight_sums` forms (:func:`forms` with
    :func:`.cost_model.expansion_cost`).
    """
    (inputs, grad_output), scale = scaled_factors(inputs, grad_output, rows=True)
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    sums, norms = inputs.new_zeros(2, groups, c_b, c_a), []
    for gradients in _formed_gradients(module, inputs, grad_output):
        sums[0] += summed_over_examples(gradients)
        squares = gradients.square_()
        sums[1] += summed_over_examples(squares)
        norms.append(squares.sum((1, 2, 3)))
    sums = unscaled_sums(as_weights(module, sums), scale,
                         len(inputs) * positions**2)
    return sums, unscaled_norms(joined(norms), scale, module.weight.numel())


def weight_squared_norms(module: nn.Module, inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2`` of ``module.weight``'s contributions, ``[N]``, exact.

    .. math:: \\|x_i\\|^2 = \\sum_g \\sum_{l,l'} (b_{igl} \\cdot b_{igl'})(a_{igl} \\cdot a_{igl'})

    At a power-of-two scale of the input and the output gradient
    (:func:`._squares.scaled_factors`), saved in float64 for float32 (no underflow).
    """
    (inputs, grad_output), scale = scaled_factors(inputs, grad_output, rows=True)
    groups, c_b, c_a, positions = layer_shape(module, inputs, grad_output)
    if forms(module, cost_model.gram_cost, c_b, c_a, positions):
        gradients = _formed_gradients(module, inputs, grad_output)
        return unscaled_norms(joined([x.square_().sum((1, 2, 3)) for x in gradients]), scale,
                              module.weight.numel())
    norms = []
    for b, a in _chunks(module, inputs, grad_output, 2 * groups * positions**2):
        gram_b = torch.matmul(b.transpose(-1, -2), b)
        gram_a = torch.matmul(a, a.transpose(-1, -2))
        norms.append(gram_b.mul_(gram_a).sum((1, 2, 3)))
    return unscaled_norms(joined(norms), scale, module.weight.numel() * positions**2)
