"""``sum_i x_i`` and ``sum_i x_i**2`` from one computation of the contributions ``x_i``.

The standard deviation of the gradient comes from ``S - T**2 / N`` with
``S = sum_i x_i**2`` and ``T = sum_i x_i``
(:func:`~cockpit_gradnoise.functional.centred_sum_of_squares`). Where all
``x_i`` agree the difference is rounding noise, which
:func:`~cockpit_gradnoise.functional.variance_rounding_bound` sets to 0. That
bound is tight (``inner_terms = 1``) only if ``T`` adds up the very computed
``x_i`` that are squared into ``S``: ``param.grad`` sums the same numbers in
another order (for a convolution or a Linear on sequences, over examples and
positions in one matrix product), and where the terms of one contribution
cancel, identical examples then give an sd far above 0 (an SNR of ~3e7).

So the module extensions here return both sums, stacked as
``[2, *param.shape]`` (``[T, S]``), computed from the same contributions:
one result and one savefield per parameter, which Cockpit frees after the
step as it frees every savefield. The contributions are formed wherever
each is a sum of several terms; where each is one product (a Linear layer
without extra dimensions, a convolution with one output position) the two
sums are two matrix products, within the bound with ``inner_terms = 1``. A
convolution with few output positions expands the square instead and saves
a third row, ``[T, S, R]``, the absolute terms its bound needs
(:mod:`.conv_math`, :func:`~cockpit_gradnoise.functional.expansion_rounding_bound`).
Linear layers are in :mod:`.linear`, convolutions in :mod:`.convolution`,
BatchNorm and Embedding in :mod:`.batchnorm` and :mod:`.embedding`.

**Underflow.** For float32 and narrower, where squares could underflow,
they are formed at a power-of-two scale and the sums saved in float64
(:mod:`._squares`).

**Structural zeros.** Some gradients are exactly zero for every example in
exact arithmetic, yet computed as rounding noise: an attention key's bias
adds one constant to every score of a query, which softmax ignores, so each
example's contribution ``x_i = sum_l t_il`` (``l`` over the sequence, ``t_il``
the output gradients) sums terms that cancel exactly; a convolution's bias
before a BatchNorm in training mode likewise. Reported as computed, that
noise gives an sd of ``1e-21`` and an SNR of order 1 to an element that has
neither. The computed sum differs from the exact sum of the exact terms by
two errors (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
ch. 4; ``u = eps / 2``, ``A_i = sum_l |t_il|``, one more reduction):

- the summation's own, at most ``(L - 1) u A_i`` in any order;
- the terms' own, ``|fl(t_il) - t_il| <= kappa u |t_il|``, where ``kappa``
  is the relative condition of the computation upstream that produced
  them: at most ``kappa u A_i`` in all.

For the key bias the second dominates wherever the sequence is short:
softmax's backward ``ds_qt = p_qt (dp_qt - sum_t' p_qt' dp_qt')`` cancels,
and its error is relative to ``|dp|``, not to ``|ds|`` (nor to the terms
``t_il = sum_q ds_ql q_q`` built from it). A contribution with
``|x_i| <= ROUNDING_NOISE * (L + TERM_ROUNDING) * eps * A_i`` is taken for
rounding noise (:data:`ROUNDING_NOISE` ``= 1``: ``2 (L + TERM_ROUNDING) u A_i``,
both errors above with ``kappa = 2 TERM_ROUNDING``; :data:`TERM_ROUNDING`
``= 1024``); an element all of whose contributions are noise is a structural
zero and gets ``T = S = 0`` exactly (:func:`structural_zeros`,
:func:`sums_of_position_sums`): gradient 0, sd 0, and no SNR (``0 / 0``).
A contribution that is one term (``L = 1``) is flagged only where it is
exactly 0.

Measured on nanoGPT-style models with random weights
(``python -m benchmarks.structural_zero_margins``), in units of
``eps A_i``: key contributions reach at most 177 for ``L = 4`` (float64,
20,480 of them; 24 at the 0.999 quantile), 19 for ``L = 8``, 2.4 for
``L = 64`` to ``1024``; for ``L = 2`` the tail is heavy (0.06% above the
threshold, which then escape the test). The allowance ``L eps A_i`` alone
missed 4.4% of the key contributions at ``L = 4`` (23% at ``L = 2``), and
an element escapes if any of its examples does. Query and value elements
have a contribution of at least ``8.4e6``, ``1.0e6``, ``1.65e5``, ``2.7e4``
for ``L = 4, 64, 256, 1024`` in float32 (8,200, 956, 129 and 13 times the
threshold; this margin falls with ``L``; in float64 it is ``7e9`` or more).
Not covered, where the upstream condition exceeds the allowance and a key
element escapes the test and keeps its noise: sharply peaked attention
(``p_qt`` near 1; the upstream error relative to ``A_i`` grows like
``1 / (1 - p)``), and queries and keys nearly constant over the positions
(a projection whose bias dominates its weights: GPT-2's ``Conv1D`` with
weights of sd 0.02 and a bias of sd 0.1 gave up to ``4.7e3 eps A_i`` at
``L = 4``).

Applied to the biases of ``Linear`` layers on sequences (also Hugging Face's
``Conv1D``, whose rule is the Linear one), of convolutions (sums of output
gradients over positions) and to the biases the torch.func fallback sees
added by ``F.linear`` only (torchvision's Swin attention:
:class:`.fallback.replay._LinearBiases`); a weight's terms ``g_il a_il^T`` would
need a second matrix product per layer.
"""

from typing import Callable, Optional, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import arena, cost_model, facts
from cockpit_gradnoise.extensions._squares import contributions_scale, saved_dtype, scaled, unscaled_sums
from cockpit_gradnoise.functional.underflow import unresolved_sums

import torch
from backpack.extensions.firstorder.sum_grad_squared.rnn import SGSLSTM, SGSRNN
from torch import Tensor


def stacked(op, first: tuple, second: tuple, shape) -> Tensor:
    """``torch.stack([op(*first), op(*second)])``, each written in place where autograd allows.

    Under ``create_graph`` the operands require grad and ``out=`` is refused;
    otherwise writing into the result saves a copy of it. In a backward pass
    the result may be a slot of the pass's buffer of all layers' sums
    (:func:`.arena.place`).
    """
    if torch.is_grad_enabled():
        return torch.stack([op(*first), op(*second)])
    result = arena.place(first[0], shape)
    op(*first, out=result[0])
    op(*second, out=result[1])
    return result


def sums_of(contributions: Tensor, axis: int = 0, zeros: Optional[Tensor] = None) -> Tensor:
    """``[T, S]``: ``sum_i x_i`` and ``sum_i x_i**2`` over ``axis`` of the contributions.

    For float32 and narrower, where squares could underflow: summed at a
    power-of-two scale, saved in float64 (:mod:`._squares`); where some
    element's squares underflow even so (below
    :func:`.functional.underflow.underflow_floor`: contributions far below the
    layer's largest), on the CPU summed from float64 squares, exactly (elsewhere
    marked :data:`.functional.underflow.UNRESOLVED` by :func:`._squares.unscaled_sums`).

    ``zeros``: elements (``[*shape]``, bool) whose ``T`` and ``S`` are set to 0 (structural
    zeros, :func:`sums_of_position_sums`). On other devices they are set at the scale, before
    :func:`._squares.unscaled_sums` (which may hand the sums over, :mod:`.deferred_sums`): the
    same numbers as setting them after, 0 unscaled is 0 (times a power of two) and not marked
    (``S = T = 0`` is no underflow), and the other elements are untouched. On the CPU after,
    as the check for underflow saw the sums before (it may form all of them again in float64).
    """
    shape = contributions.shape[:axis] + contributions.shape[axis + 1 :]
    scale = contributions_scale(contributions)
    at_scale = scaled(contributions, scale)
    sums = stacked(torch.sum, (at_scale, axis), (at_scale.square(), axis), shape)
    if zeros is not None and not _device.on_host(sums):
        return unscaled_sums(sums.masked_fill(zeros, 0.0), scale, contributions.shape[axis])

    def wide() -> Tensor:  # no square of a float32 number underflows in float64
        contributions_wide = contributions.to(saved_dtype(sums.dtype))
        return torch.stack([contributions_wide.sum(axis), contributions_wide.square().sum(axis)])

    sums = unscaled_or_wide(sums, scale, contributions.shape[axis], wide)
    return sums if zeros is None else sums.masked_fill(zeros, 0.0)


def unscaled_or_wide(sums: Tensor, scale, terms: int, wide: Callable[[], Tensor]) -> Tensor:
    """``[T, S]`` from sums of ``terms`` contributions at ``scale``: :func:`._squares.unscaled_sums`
    (elsewhere than on the CPU, an ``S`` that underflowed is marked there); on the CPU, where
    some element's ``S`` is below the floor while ``S`` or ``T`` is not 0
    (:func:`.functional.underflow.unresolved_sums`), ``wide()``: the sums formed again from
    the contributions in the saved dtype, exactly."""
    if (saved_dtype(sums.dtype) != sums.dtype and _device.on_host(sums)
            and _underflowed(sums, terms)):
        return wide()
    return unscaled_sums(sums, scale, terms)


def _underflowed(sums: Tensor, terms: int) -> bool:
    """Whether an element's ``S`` of ``terms`` squares is below the floor while ``S`` or ``T``
    is not 0 (:func:`.functional.underflow.unresolved_sums`)."""
    return unresolved_sums(sums[1], sums[0], terms) is not None


#: A contribution within ``ROUNDING_NOISE * (L + TERM_ROUNDING) * eps * sum_l |t_il|`` of zero
#: is rounding noise.
ROUNDING_NOISE = 1.0
#: The relative error, in units of ``eps``, allowed to each term ``t_il`` from the computation
#: upstream that produced it (softmax's backward for an attention key; the module's docstring).
TERM_ROUNDING = 1024


def structural_zeros(contributions: Tensor, magnitudes: Tensor, terms: int,
                     eps: Optional[float] = None) -> Tensor:
    """Elements (``[*shape]``, bool) all of whose contributions are rounding noise.

    ``contributions``: ``x_i = sum_l t_il``, ``[N, *shape]``, each a sum of
    ``terms`` terms ``t_il``; ``magnitudes``: ``sum_l |t_il|``, same shape.
    An ``x_i`` with ``|x_i| <= ROUNDING_NOISE * (terms + TERM_ROUNDING) * eps * magnitudes_i``
    is rounding noise, of the summation and of the terms themselves (the
    module's docstring); an element is a structural zero when every
    example's is. ``eps``: of the contributions' dtype unless given (the
    larger of two dtypes', where the terms were rounded in another).
    """
    eps = torch.finfo(contributions.dtype).eps if eps is None else eps
    noise = contributions.abs() <= magnitudes * (ROUNDING_NOISE * (terms + TERM_ROUNDING) * eps)
    return noise.all(0)


#: The layer cache's slot (:mod:`._layer_cache`) of :func:`summed_over_positions`' result.
_SUMMED_OVER_POSITIONS = "contributions summed over positions and their structural zeros"


def summed_over_positions(per_position: Tensor, dims, sources: Sequence = ()) -> Tuple[Tensor, Tensor]:
    """``(x_i, structural zeros)``: the sums over ``dims`` of ``per_position`` (``[N, *shape]``)
    and :func:`structural_zeros` of them (``[*shape]``, bool).

    With ``sources`` (the layer and its output gradient, of which ``per_position`` is a
    view), computed once per layer in a backward pass: the sums' extension and the norms'
    extension both read them from the layer cache (:mod:`._layer_cache`), which serves
    them only for these very tensors, unchanged. Each pass over ``per_position``
    (``abs()`` writes a copy of it) then runs once per layer instead of once per extension.
    """
    cache = facts.recording().layer_cache if sources else None
    if cache is not None:
        found = cache.get(_SUMMED_OVER_POSITIONS, sources, (tuple(per_position.shape), dims))
        if found is not None:
            return found
    contributions = per_position.sum(dims)
    terms = per_position[0].numel() // max(contributions[0].numel(), 1)
    zeros = structural_zeros(contributions, summed_magnitudes(per_position, dims), terms)
    if cache is not None:
        cache.put(_SUMMED_OVER_POSITIONS, sources, (contributions, zeros), (tuple(per_position.shape), dims))
    return contributions, zeros


def summed_magnitudes(per_position: Tensor, dims) -> Tensor:
    """``sum over dims of |per_position|`` (``[N, *shape]``, ``dims`` not the examples'), the
    magnitudes ``A_i`` of :func:`structural_zeros`.

    On the host, over chunks of examples of :func:`.cost_model.formation_bytes` (cache-sized):
    ``abs()`` writes a copy, and a copy of the whole output gradient (6 MiB for Swin's
    ``[32, 256, 192]``) was allocated afresh in each backward pass and page-faulted in (0.5 to
    2.7 ms where its sum takes 0.1). The same magnitudes, summed per example as before.
    """
    if not _device.on_host(per_position) or per_position.dim() < 2:
        return per_position.abs().sum(dims)
    budget = cost_model.formation_bytes(True)
    size = cost_model.examples_per_chunk(max(per_position[0].numel(), 1), per_position.element_size(), budget)
    if size >= len(per_position):
        return per_position.abs().sum(dims)
    return torch.cat([per_position[start : start + size].abs().sum(dims)
                      for start in range(0, len(per_position), size)])


def sums_of_position_sums(per_position: Tensor, dims, sources: Sequence = ()) -> Tensor:
    """``[T, S]`` of contributions that are sums over positions, structural zeros exactly 0.

    ``x_i = sum over dims of per_position`` (e.g. a bias's output gradient
    ``[N, L, C]`` over ``dims = 1``); :func:`sums_of` of them, with ``T = S = 0``
    where :func:`structural_zeros` finds every contribution to be rounding noise.
    ``sources``: as in :func:`summed_over_positions`.
    """
    contributions, zeros = summed_over_positions(per_position, dims, sources)
    return sums_of(contributions, zeros=zeros)


def position_sums(per_position: Tensor, dims, sources: Sequence = ()) -> Tensor:
    """Contributions ``x_i`` (sums over ``dims`` of ``per_position``), structural zeros
    exactly 0 (:func:`structural_zeros`): per-example norms agree with the sums of
    :func:`sums_of_position_sums`, where ``T = S = 0``. ``sources``: as in
    :func:`summed_over_positions`."""
    contributions, zeros = summed_over_positions(per_position, dims, sources)
    return contributions.masked_fill(zeros, 0.0)


class SumsFromContributionsMixin:
    """Turns a BackPACK ``SumGradSquared`` rule (an ``SGSBase``) into ``[T, S]`` of the
    contributions it forms: ``class Sums(SumsFromContributionsMixin, SGSRule)``."""

    def _make_param_function(self, param_str):
        def param_function(ext, module, g_inp, g_out, bp_quantities):
            contributions = self.derivatives.param_mjp(
                param_str, module, g_inp, g_out, g_out[0], sum_batch=False
            )
            return sums_of(contributions, self.N_axis)

        return param_function


class SumsRNN(SumsFromContributionsMixin, SGSRNN):
    """``RNN``."""


class SumsLSTM(SumsFromContributionsMixin, SGSLSTM):
    """``LSTM``."""
