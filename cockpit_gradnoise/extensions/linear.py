"""``Linear`` weights: both sums of the contributions and per-example squared norms.

Applied to ``[N, L, in]`` (``L`` positions of a sequence; any extra dimensions
are flattened into ``L``), a Linear's weight contributions are sums over
positions, ``x_i = sum_l g_il a_il^T``: the convolution's case with one group
(:mod:`.conv_math`), ``C_b = out``, ``C_a = in``. Without extra dimensions
each is one product, and BackPACK's identities are exact and cheap: the
sums are :func:`linear_weight_sums`' two matrix products, the norms
``(sum_j g_ij^2)(sum_k a_ik^2)`` by BackPACK's ``BatchL2Linear``.

With positions, two exact ways to get ``||x_i||^2``, chosen per layer by the
convolutions' cost model (``cost_model.use_formation(gram_cost, out, in, L)``,
which ``cost_model.FORCE_METHOD`` overrides as it does for convolutions):

- **Gram matrices**: ``||x_i||^2 = sum_{l,l'} (g_il . g_il') (a_il . a_il')``
  (:func:`gram_squared_norms`), ``2 L^2 (out + in)`` operations per example (about
  ``5/8`` of them at ``L = 256``: the Gram matrices are symmetric, :func:`symmetric_gram_inner`);
- **formation**: form ``x_i`` and square it (:func:`formed_squared_norms`),
  ``2 L out in`` operations and ``out in`` numbers written and read.

BackPACK's ``BatchL2Linear`` contracts the Gram form as one four-operand
``einsum``, slower than the two ``bmm`` here (a path search every call,
another order of products).

The sums ``[T, S]`` (:mod:`.sums`) have the same two ways, chosen by
``cost_model.use_formation(expansion_cost, out, in, L)``: formation, or, with
few positions (ConvNeXt's stage-3 pointwise layers see 4 positions at
32x32), the convolutions' expansion of the square over pairs of positions
(:func:`.conv_math.expanded_sums_of_factors`: a Linear over ``L``
positions is a 1x1 convolution with one group, ``b_il = g_il``, ``a_il =
a_il``), which saves ``[T, S, R]`` with the same rounding bound ``N eps R``
(:func:`linear_expanded_sums`). Where the sums are formed and
``SumsOfContributions`` and ``PerExampleSquaredNorms`` both run in one
backward pass, whichever reaches the layer first forms each chunk of ``x_i``
once and takes both results from it
(:func:`linear_weight_sums_and_squared_norms`); the second takes its result
from the backward pass's layer cache (:mod:`._layer_cache`) and computes
nothing. Its norms then come from formation, not the Gram matrices it would use alone: the same
numbers up to rounding, not bit for bit. Where the sums are expanded, each
extension computes alone (the norms by the Gram matrices or formation, as
the cost model chooses). A tied weight (:mod:`.tied`) is never expanded:
its uses' sums are combined over ``[T, S]`` only.
"""

from typing import Iterator, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import conv_math, cost_model, facts
from cockpit_gradnoise.extensions._squares import (
    SquaredNormsFromContributionsMixin,
    exact_where_lost,
    joined,
    scaled_factors,
    squared_norms_of,
    unscaled_norms,
    unscaled_sums,
)
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD, TIED_ATTR
from cockpit_gradnoise.extensions.sums import (
    SumsFromContributionsMixin,
    position_sums,
    stacked,
    sums_of,
    sums_of_position_sums,
)

import torch
from backpack.context import CTX
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions.firstorder.batch_l2_grad.linear import BatchL2Linear
from backpack.extensions.firstorder.sum_grad_squared.sgs_base import SGSBase
from torch import Tensor


def one_position(grad_output: Tensor) -> bool:
    """Whether each example's weight contribution is one outer product: no extra
    dimensions (``[N, out]``), or all of them 1 (``[N, 1, 1, out]``: ConvNeXt's
    last stage on 32x32 images), so that no contribution needs forming."""
    return grad_output.dim() == 2 or grad_output[0].numel() == grad_output.shape[-1]


def as_products(inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``(inputs [N, in], grad_output [N, out])`` of a layer with :func:`one_position`."""
    return inputs.reshape(inputs.shape[0], -1), grad_output.reshape(grad_output.shape[0], -1)


def sequence_factors(inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``(g, a)``: output gradients ``[N, L, out]`` and inputs ``[N, L, in]``."""
    return grad_output.flatten(1, -2), inputs.flatten(1, -2)


def formed_contributions(g: Tensor, a: Tensor) -> Iterator[Tensor]:
    """``x_i = g_i^T a_i`` (``[n, out, in]``) for consecutive chunks of examples, of
    :func:`.cost_model.formation_bytes` each (cache-sized on the host).

    Every chunk is written into one buffer, allocated once per call: a chunk is valid until
    the next one is asked for (each caller reduces it first). A fresh chunk each time was a
    fresh allocation of up to 2 MiB page-faulted in on the host, which doubled the ``bmm``'s
    time in a tracked step (Swin's 16-position Linears, 11 chunks each: 43-44 -> 33-34 ms a
    step for its 38 layers; ``benchmarks/README.md``, "Swin's sequence Linears"). Where
    autograd records the product (``create_graph``), which refuses ``out=``, a new one each.
    """
    budget = cost_model.formation_bytes(_device.on_host(a))
    size = cost_model.examples_per_chunk(g.shape[2] * a.shape[2], a.element_size(), budget)
    into = None
    if not (torch.is_grad_enabled() and (g.requires_grad or a.requires_grad)):
        into = torch.empty(min(size, g.shape[0]), g.shape[2], a.shape[2], dtype=torch.result_type(g, a),
                           device=g.device)
    for start in range(0, g.shape[0], size):
        rows, columns = g[start : start + size].transpose(1, 2), a[start : start + size]
        yield torch.bmm(rows, columns) if into is None else torch.bmm(rows, columns, out=into[: len(columns)])


#: Positions per block of :func:`symmetric_gram_inner`: a block's products stay efficient
#: matrix products (64 rows) while the blocks below the diagonal, skipped, are most of them.
GRAM_BLOCK = 64


def gram_squared_norms(g: Tensor, a: Tensor) -> Tensor:
    """``||x_i||^2 = sum_{l,l'} (g_il . g_il') (a_il . a_il')``, ``[N]``, chunk by chunk
    (:func:`symmetric_gram_inner`)."""
    positions = g.shape[1]
    size = cost_model.examples_per_chunk(2 * positions * min(positions, GRAM_BLOCK), a.element_size())
    return joined([symmetric_gram_inner(g[start : start + size], a[start : start + size])
                   for start in range(0, g.shape[0], size)])


def symmetric_gram_inner(g: Tensor, a: Tensor) -> Tensor:
    """``sum_{l,l'} (g_l . g_l') (a_l . a_l')`` of each example (``g [n, L, out]``, ``a [n, L, in]``), ``[n]``.

    Both Gram matrices are symmetric, so with the positions in blocks ``p`` of
    :data:`GRAM_BLOCK`, ``sum_{l,l'} = sum_p sum_{l,l' in p} + 2 sum_{p < q} sum_{l in p, l' in q}``:
    block ``p``'s rows of the Gram matrices are formed against the positions from ``p`` on only,
    ``L^2 (out + in) (B + 1) / (2B)`` operations for ``B`` blocks instead of ``L^2 (out + in)``
    (0.625 of them at ``L = 256``: GPT-2 small's Linears and its head took 0.70-0.74 of the
    time of the whole products, one thread). Each product is the one of the whole matrix
    restricted to those rows and columns; the doubling is exact; only the order in which
    float32 adds the ``L^2`` terms differs.
    """
    positions = g.shape[1]
    total = g.new_zeros(len(g)) if positions == 0 else None
    for start in range(0, positions, GRAM_BLOCK):
        rows = slice(start, start + GRAM_BLOCK)
        products = torch.bmm(g[:, rows], g[:, start:].transpose(1, 2)).mul_(
            torch.bmm(a[:, rows], a[:, start:].transpose(1, 2)))  # [n, b, L - start]
        width = products.shape[1]  # the block's own columns: every pair of them once
        part = products[:, :, :width].sum((1, 2))
        if products.shape[2] > width:  # the blocks after it: each pair for both orders
            part = part + 2 * products[:, :, width:].sum((1, 2))
        total = part if total is None else total + part
    return total


def formed_squared_norms(g: Tensor, a: Tensor) -> Tensor:
    """``||x_i||^2`` from the formed ``x_i``, ``[N]``."""
    return joined([x.square_().sum((1, 2)) for x in formed_contributions(g, a)])


def linear_weight_squared_norms(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2`` of a Linear's weight on sequences (inputs ``[N, ..., in]``), ``[N]``.

    By the Gram matrices or by formation, whichever the cost model finds
    cheaper; at a power-of-two scale of each factor (:func:`._squares.scaled_factors`).
    """
    (g, a), scale = scaled_factors(*sequence_factors(inputs, grad_output), rows=True)
    if cost_model.use_formation(cost_model.gram_cost, g.shape[2], a.shape[2], g.shape[1]):
        return unscaled_norms(formed_squared_norms(g, a), scale, g.shape[2] * a.shape[2])
    return unscaled_norms(gram_squared_norms(g, a), scale, g.shape[2] * a.shape[2])


def linear_weight_sums_and_squared_norms(inputs: Tensor, grad_output: Tensor) -> Tuple[Tensor, Tensor]:
    """``([T, S], ||x_i||^2)`` of a Linear's weight on sequences, from one formation of ``x_i``.

    ``[T, S] = [sum_i x_i, sum_i x_i**2]`` (``[2, out, in]``, :mod:`.sums`) and
    the per-example squared norms (``[N]``) are sums of the same squared
    contributions, over examples and over elements; at a power-of-two scale of
    each factor (:func:`._squares.scaled_factors`).
    """
    (g, a), scale = scaled_factors(*sequence_factors(inputs, grad_output), rows=True)
    sums = g.new_zeros(2, g.shape[2] * a.shape[2])
    norms = []
    for x in formed_contributions(g, a):
        flat = x.view(len(x), -1)
        accumulate_rows(sums[0:1], flat)
        squares = flat.square_()
        accumulate_rows(sums[1:2], squares)
        norms.append(squares.sum(1))
    sums = sums.view(2, g.shape[2], a.shape[2])
    return unscaled_sums(sums, scale, len(g)), unscaled_norms(joined(norms), scale, g.shape[2] * a.shape[2])


def accumulate_rows(total: Tensor, rows: Tensor) -> None:
    """``total += sum_i rows[i]`` in place (``total [1, K]``, ``rows [n, K]``), as a product with a row of ones.

    The same sum of the same computed ``x_i`` as ``rows.sum(0)`` (each multiplication by 1 is
    exact, so the matrix-vector product adds the terms in some order, as any order bounds
    them: :mod:`.sums`' bound with ``inner_terms = 1`` holds as before), in one pass that reads
    ``rows`` and writes ``total`` once: ``total[0] += rows.sum(0)`` wrote the sum, added it and
    copied it back (Python's ``+=`` on an index), three passes over ``K`` numbers per chunk,
    which cost more than the chunk's ``bmm`` for Swin's stage-3 Linears (16 positions, 768 x 192;
    ``benchmarks/README.md``, "Swin's sequence Linears"). A chunk of one example is added as it is.
    """
    if len(rows) == 1:
        total.add_(rows)
    else:
        total.addmm_(rows.new_ones(1, len(rows)), rows)


def expands(module, inputs: Tensor, grad_output: Tensor) -> bool:
    """Whether the sums of a sequence Linear's weight are expanded over pairs of
    positions (:func:`linear_expanded_sums`): the cost model chooses it over
    formation, and the weight is not tied."""
    out, positions = grad_output.shape[-1], grad_output[0].numel() // grad_output.shape[-1]
    if "weight" in module.__dict__.get(TIED_ATTR, {}) or positions < 2:
        return False
    return not cost_model.use_formation(cost_model.expansion_cost, out, inputs.shape[-1], positions)


def linear_expanded_sums(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S, R]`` of a Linear's weight on sequences (inputs ``[N, ..., in]``), no ``x_i`` formed.

    ``x_i = sum_l g_il a_il^T`` is a 1x1 convolution's contribution with one
    group, so :func:`.conv_math.expanded_sums_of_factors` of the factors
    ``b_i = g_i^T`` (``[1, out, L]``) and ``a_i`` (``[1, L, in]``) gives

    .. math::

        T = \\sum_{i,l} g_{il} a_{il}^T, \\quad
        S = \\sum_i \\sum_{l \\le l'} w_{ll'} (g_{il} g_{il'}) (a_{il} a_{il'})^T, \\quad
        R = w(L) \\sum_i \\Big(\\sum_l |g_{il}|\\,|a_{il}|^T\\Big)^2,

    ``w(L) = L(L+1)/2 + 2L + 6`` (:func:`.conv_math.expansion_rounding_terms`),
    and the centred sum ``S - T**2 / N`` is off by at most ``N eps R``
    (the derivation of :mod:`.conv_math`, which is about the factors only).
    At a power-of-two scale of each factor (:func:`._squares.scaled_factors`).
    """
    (g, a), scale = scaled_factors(*sequence_factors(inputs, grad_output))
    positions = g.shape[1]
    size = cost_model.examples_per_chunk(
        conv_math.expansion_temporaries(1, g.shape[2], a.shape[2], positions), a.element_size())
    chunks = ((g[start : start + size].transpose(1, 2).unsqueeze(1), a[start : start + size].unsqueeze(1))
              for start in range(0, g.shape[0], size))
    sums = unscaled_sums(conv_math.expanded_sums_of_factors(chunks, positions)[:, 0], scale)
    sums[2] *= conv_math.expansion_rounding_terms(positions)  # A, to R = w(L) A
    return sums


def linear_weight_sums(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``[T, S]`` of a Linear's weight, with inputs ``[N, ..., in]``.

    Without extra dimensions each contribution is one product, ``x_i = g_i a_i^T``:
    ``T = G^T A`` and ``S = (G**2)^T (A**2)`` are two matrix products (no
    ``N x |W|`` tensor), exact to the bound with ``inner_terms = 1``. With extra
    dimensions (positions of a sequence), ``x_i = sum_l g_il a_il^T`` is formed
    for chunks of examples of at most :data:`.cost_model.CHUNK_BYTES`, and both sums
    taken from it, by :func:`linear_weight_sums_and_squared_norms` (so that
    ``T`` and ``S`` are the same numbers, alone or beside the norms).
    """
    if grad_output.dim() == 2:
        (g, a), scale = scaled_factors(grad_output, inputs)
        shape = (g.shape[1], a.shape[1])
        sums = stacked(torch.mm, (g.T, a), (g.square().T, a.square()), shape)
        return unscaled_sums(sums, scale, len(g))
    return linear_weight_sums_and_squared_norms(inputs, grad_output)[0]


# Sharing one formation between the two extensions, within one layer's hook ----------

#: The layer cache's slot (:mod:`._layer_cache`) of a sequence Linear's ``([T, S], ||x_i||^2)``.
_SUMS_AND_NORMS = "linear weight sums and squared norms"


def is_active(savefield: str) -> bool:
    """Whether an extension saving ``savefield`` runs in the current backward pass."""
    return any(getattr(ext, "savefield", None) == savefield for ext in CTX.get_active_exts())


def _shared_weight_result(ext, module, grad_output: Tensor, other_savefield: str, alone):
    """This extension's weight result for a Linear on sequences (``ext.savefield`` is
    :data:`SUMS_SAVEFIELD` or :data:`BATCH_L2_SAVEFIELD`, the other one
    ``other_savefield``): ``alone(inputs, grad_output)`` when the other does not
    run, else formed with the other's by whichever reaches the layer first and
    taken from the backward pass's layer cache by the second."""
    if not is_active(other_savefield) or expands(module, module.input0, grad_output):
        kind = "s" if ext.savefield == SUMS_SAVEFIELD else "n"
        return exact(alone, kind, module.input0, grad_output)
    sources = (module, module.input0, grad_output)
    both = facts.recording().layer_cache.take(_SUMS_AND_NORMS, sources)
    if both is None:
        both = exact(linear_weight_sums_and_squared_norms, "sn", module.input0, grad_output)
        facts.recording().layer_cache.put(_SUMS_AND_NORMS, sources, both)
    sums, norms = both
    return sums if ext.savefield == SUMS_SAVEFIELD else norms


def exact(compute, kinds: str, inputs: Tensor, grad_output: Tensor):
    """``compute(inputs, grad_output)`` of a Linear's weight (``kinds`` as
    :func:`._squares.exact_where_lost` takes them), from float64 factors where underflow
    lost a sum of squares of a float32 layer."""
    return exact_where_lost(compute, kinds, inputs.shape[0], inputs.shape[-1] * grad_output.shape[-1],
                            inputs, grad_output)


def _outer_product_squared_norms(inputs: Tensor, grad_output: Tensor) -> Tensor:
    """``||x_i||^2 = ||g_i||^2 ||a_i||^2`` of ``x_i = g_i a_i^T`` (inputs ``[N, in]``), ``[N]``,
    at a power-of-two scale of each factor."""
    (g, a), scale = scaled_factors(grad_output, inputs, rows=True)
    return unscaled_norms(g.square().sum(1) * a.square().sum(1), scale, g.shape[1] * a.shape[1])


class SumsLinear(SumsFromContributionsMixin, SGSBase):
    """``[T, S]`` of a ``Linear``: weight by :func:`linear_weight_sums` (``[T, S, R]`` by
    :func:`linear_expanded_sums` where it :func:`expands`), bias from its
    contributions (on sequences with its structural zeros, :func:`.sums.sums_of_position_sums`)."""

    def __init__(self):
        super().__init__(derivatives=LinearDerivatives(), params=["bias", "weight"])

    def weight(self, ext, module, g_inp, g_out, bp_quantities):
        if one_position(g_out[0]):
            return exact(linear_weight_sums, "s", *as_products(module.input0, g_out[0]))
        if expands(module, module.input0, g_out[0]):
            return exact(linear_expanded_sums, "s", module.input0, g_out[0])
        return _shared_weight_result(ext, module, g_out[0], BATCH_L2_SAVEFIELD, linear_weight_sums)

    def bias(self, ext, module, g_inp, g_out, bp_quantities):
        if g_out[0].dim() == 2:
            return sums_of(g_out[0])
        # Sums over positions: an attention key's bias is a structural zero (.sums).
        return sums_of_position_sums(g_out[0].flatten(1, -2), 1, (module, g_out[0]))


class SquaredNormsLinear(SquaredNormsFromContributionsMixin, BatchL2Linear):
    """``||x_i||^2`` of a ``Linear``: BackPACK's identity ``||g_i||^2 ||a_i||^2``
    without extra dimensions, on sequences :func:`linear_weight_squared_norms`;
    the bias from its contributions (:func:`._squares.squared_norms_of`). Squares at
    a power-of-two scale (:mod:`._squares`)."""

    def weight(self, ext, module, g_inp, g_out, backproped):
        if one_position(g_out[0]):
            inputs, grad_output = as_products(module.input0, g_out[0])
            return exact(_outer_product_squared_norms, "n", inputs, grad_output)
        return _shared_weight_result(
            ext, module, g_out[0], SUMS_SAVEFIELD, linear_weight_squared_norms
        )

    def bias(self, ext, module, g_inp, g_out, backproped):
        if g_out[0].dim() == 2:
            return squared_norms_of(g_out[0])
        # Structural zeros exactly 0, as in the sums (an attention key's bias).
        return squared_norms_of(position_sums(g_out[0].flatten(1, -2), 1, (module, g_out[0])))
