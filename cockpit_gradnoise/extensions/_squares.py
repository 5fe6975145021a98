"""Squares of contributions that cannot underflow: a power-of-two scale, float64 results.

A float32 square below about ``1e-38`` (``1.4e-45`` as a
subnormal) is lost: contributions of ``1e-22`` (layers of a network at
initialization) would give sums of squares, norms and sd of 0. So squares
are formed at a power-of-two scale (:func:`power_of_two_scale`: one
max-reduction per layer, of the contributions or of their factors), which
changes no rounding, and the results are unscaled in float64
(:func:`unscaled_sums`, :func:`unscaled_norms`, :func:`saved_dtype`): the sums and the per-example squared
norms of a float32 (or narrower) parameter are saved as float64 tensors
(on the CPU only for layers below :data:`SMALLEST_UNSCALED`). Their
rounding is float32's (they were summed in float32):
:class:`~cockpit_gradnoise.GradientVarianceQuantiles` takes the bound of the
parameter's dtype. float64 parameters are summed as before (squares
underflow only below ``1e-308``).
"""

import functools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import facts
from cockpit_gradnoise.functional.underflow import (
    UNRESOLVED,
    lost_to_underflow,
    marked_lost,
    underflow_floor,
    unresolved_sums,
)

import torch
from torch import Tensor


class Scale:
    """A power-of-two scale ``s`` that squares were formed at, as unscaling needs it.

    Of several factors (``s = prod_k s_k``, :func:`scaled_factors` on other devices), it keeps
    each factor's powers and rows and reduces them when first asked (one ``prod``, one
    ``amin``): a rule whose norms are unscaled at the end of the backward pass
    (:mod:`.deferred_norms`) hands the factors' over, reduced there for all layers at once.

    Attributes:
        powers: ``(s, 1/s, 1/s**2)``, float64 (:func:`scale_powers`): unscaling a sum or a
            squared norm is one multiplication (:func:`unscaled_sums`, :func:`unscaled_norms`);
            ``[P, 3]`` for the norms ``[P, N]`` of ``P`` parameters (:func:`squared_norms_of_many`).
        rows: ``[N]``, where known (other devices, norms of examples' rows): per example, the
            smallest over the factors of its row's largest magnitude; not 0 exactly where every
            factor's row of the example holds a nonzero number, so that a squared norm of 0
            there is marked (underflow lost it, :func:`unscaled_norms`). ``None`` elsewhere.
        factor_powers: ``[k, 3]``, each factor's powers (their column products are ``powers``), or ``None``.
        factor_rows: ``[k, N]``, each factor's row magnitudes (their smallest: ``rows``), or ``None``.
    """

    __slots__ = ("_powers", "_rows", "factor_powers", "factor_rows")

    def __init__(self, powers: Optional[Tensor] = None, rows: Optional[Tensor] = None,
                 factor_powers: Optional[Tensor] = None, factor_rows: Optional[Tensor] = None):
        self._powers, self._rows = powers, rows
        self.factor_powers, self.factor_rows = factor_powers, factor_rows

    @property
    def powers(self) -> Tensor:
        if self._powers is None:
            # The product of each column: (prod s, 1 / prod s, 1 / (prod s)**2), exact (powers of
            # two of float64's range for two factors: 1/s**2 within [2**-250, 2**254] each).
            self._powers = self.factor_powers.prod(0)
        return self._powers

    @property
    def rows(self) -> Optional[Tensor]:
        if self._rows is None and self.factor_rows is not None:
            self._rows = self.factor_rows.amin(0)
        return self._rows

    def rows_shape(self) -> Optional[torch.Size]:
        """The shape of :attr:`rows` (``None`` without), without reducing the factors'."""
        if self._rows is not None:
            return self._rows.shape
        return None if self.factor_rows is None else self.factor_rows.shape[1:]

    def handed_over(self) -> Tuple[Tensor, Tensor]:
        """``(powers [k, 3], rows [k, N])`` for one parameter's norms ``[N]``: the factors',
        unreduced where not reduced yet (one factor: ``k = 1``)."""
        powers = self.factor_powers if self._powers is None else self._powers.reshape(1, 3)
        rows = self.factor_rows if self._rows is None else self._rows.unsqueeze(0)
        return powers, rows


def saved_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of squares of contributions in ``dtype`` are saved in: float64
    for float32 and narrower (no underflow), else ``dtype``."""
    return dtype if torch.finfo(dtype).bits >= 64 else torch.float64


def needs_scale(dtype: torch.dtype) -> bool:
    """Whether squares of ``dtype`` can underflow where the contributions are not tiny."""
    return saved_dtype(dtype) != dtype


def largest_magnitude(tensor: Tensor) -> Tensor:
    """``max |t|``, 0-dim, in ``tensor``'s dtype: one pass, no copy (``abs()`` would write
    one), NaN where ``tensor`` holds one (the inf-norm's maximum propagates NaN on the CPU
    and on CUDA), ``inf`` where it holds an infinity. ``tensor`` must not be empty.

    On the CPU by ``aminmax`` (one pass, both extremes; ``maximum`` propagates its NaN):
    torch's CPU inf-norm takes about ten times as long (a ``[32, 64, 512]`` float32 factor,
    one thread: 2.7 ms against 0.15 ms), which was a fifth of a GradientNoiseScale step on
    the benchmark GPT (``benchmarks/README.md``, "The noise scale Adam sees"). Elsewhere the
    inf-norm, one launch.
    """
    tensor = tensor.detach()
    if _device.on_host(tensor):
        smallest, largest = torch.aminmax(in_memory_order(tensor))
        return torch.maximum(largest, smallest.neg())
    return torch.linalg.vector_norm(tensor, math.inf)


def in_memory_order(tensor: Tensor) -> Tensor:
    """``tensor`` with its dimensions permuted into the order of its memory (largest stride
    first), where that makes it contiguous; else ``tensor`` itself.

    For reductions over every element, whose result does not depend on the order (a
    maximum, a minimum): the same elements, read in one sweep. GPT-2's head gets its
    output gradient ``[N, T, V]`` stored as ``[N, V, T]`` (the cross-entropy's class
    dimension second): the CPU's ``aminmax`` of that view took 0.61 s where it takes
    0.015 s in memory order (8 x 256 x 50257 float32, one thread).
    """
    if tensor.is_contiguous() or tensor.dim() < 2:
        return tensor
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.shape[d]))
    permuted = tensor.permute(order)
    return permuted if permuted.is_contiguous() else tensor


#: ``k`` of the bounds ``2**k`` of :func:`exponent_table`: every power of two float32 holds.
_BOUND_EXPONENTS = range(-149, 128)


def _scale_for_exponent(exponent: int) -> float:
    """``2**-e`` for ``frexp``'s exponent ``e``, ``e`` kept within ``[-125, 127]``."""
    return 2.0 ** -min(max(exponent, -125), 127)


#: ``{device: (bounds, scales)}`` of :func:`exponent_table`, made once per device.
_EXPONENT_TABLES: Dict[torch.device, Tuple[Tensor, Tensor]] = {}


def exponent_table(device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(bounds, scales)`` on ``device``, float32: the bounds ``2**k``, ``k = -149..127``, then
    ``inf``; ``scales[i]`` the scale of a largest magnitude at or above exactly ``i`` bounds.

    ``i = searchsorted(bounds, largest, right=True)`` counts the bounds at most ``largest``:
    0 for 0, ``e + 149`` for ``largest`` in ``[2**(e - 1), 2**e)`` (``frexp``'s exponent
    ``e``, subnormals included), 278 for ``inf``, and 0 or 278 for NaN (a binary search
    whose comparisons with NaN are all false ends at one end): ``scales`` is 1 at both
    ends and ``2**-e`` (``e`` within ``[-125, 127]``) between. Every entry is a power of
    two written from Python's exact arithmetic; copied to ``device`` from pinned memory,
    without waiting for it.
    """
    table = _EXPONENT_TABLES.get(device)
    if table is None:
        bounds = [2.0**k for k in _BOUND_EXPONENTS] + [math.inf]
        scales = [1.0] + [_scale_for_exponent(k + 1) for k in _BOUND_EXPONENTS] + [1.0]
        table = tuple(_device.copied_without_waiting(torch.tensor(values, dtype=torch.float32), device)
                      for values in (bounds, scales))
        _EXPONENT_TABLES[device] = table
    return table


def scales_of_largest(largest: Tensor) -> Tensor:
    """``2**-e`` of each float32 ``largest = m 2**e`` (``m`` in ``[0.5, 1)``), ``e`` kept within
    ``[-125, 127]``; 1 where ``largest`` is 0, NaN or infinite. Two launches (a binary search
    in :func:`exponent_table`'s bounds, a lookup of its scales) whatever the number of
    values, never read on the host.
    """
    bounds, scales = exponent_table(largest.device)
    return torch.take(scales, torch.searchsorted(bounds, largest, right=True))


#: ``{device: (bounds, powers)}`` of :func:`powers_table`, made once per device.
_POWERS_TABLES: Dict[torch.device, Tuple[Tensor, Tensor]] = {}


def powers_table(device: torch.device) -> Tuple[Tensor, Tensor]:
    """``(bounds, powers)`` on ``device``: :func:`exponent_table`'s float32 bounds, and ``powers``
    ``[279, 3]`` float64, row ``i`` the :func:`scale_powers` ``(s, 1/s, 1/s**2)`` of its
    ``scales[i]``. Every entry is a power of two (``s`` in ``[2**-127, 2**125]``, so ``1/s**2``
    in ``[2**-250, 2**254]``: float64 holds them exactly), written from Python's exact arithmetic."""
    table = _POWERS_TABLES.get(device)
    if table is None:
        bounds, _ = exponent_table(device)
        scales = [1.0] + [_scale_for_exponent(k + 1) for k in _BOUND_EXPONENTS] + [1.0]
        powers = torch.stack([scale_powers(s) for s in scales])
        table = _POWERS_TABLES[device] = (bounds, _device.copied_without_waiting(powers, device))
    return table


def powers_of_largest(largest: Tensor) -> Tensor:
    """:func:`scale_powers` of :func:`scales_of_largest`'s scale of each float32 ``largest`` (``[k]``):
    ``[k, 3]`` float64, rows ``(s, 1/s, 1/s**2)``. Two launches (a binary search, a gather of
    rows), never read on the host: what unscaling needs comes with the scale, and unscaling
    is then one multiplication (:func:`unscaled_norms`, :func:`unscaled_sums`)."""
    bounds, powers = powers_table(largest.device)
    return powers.index_select(0, torch.searchsorted(bounds, largest, right=True))


def scale_powers(scale: float) -> Tensor:
    """``(s, 1/s, 1/s**2)``, float64, of a power of two ``s`` (a scale read on the host); exact."""
    return torch.tensor([scale, 1.0 / scale, 1.0 / (scale * scale)], dtype=torch.float64)


def _as_powers(scale: Union[Scale, Tensor]) -> Tensor:
    """``scale``'s :func:`scale_powers` ``(s, 1/s, 1/s**2)``; a 0-dim scale ``s`` (a power of two)
    gives them formed from it, exactly."""
    if isinstance(scale, Scale):
        return scale.powers
    wide = scale.to(torch.float64)
    return torch.stack([wide, wide.reciprocal(), wide.square().reciprocal()])


def scaled(tensor: Tensor, scale: Optional[Scale]) -> Tensor:
    """``tensor`` times the scale ``s``, or itself for ``None``. A 0-dim float64 ``s`` leaves a
    float32 tensor float32 (a 0-dim operand does not promote a dimensioned one of its kind),
    and ``s``, a power of two of float32's range, is exactly a float32 number: the product
    is the float32 one, exact."""
    return tensor if scale is None else tensor * scale.powers[0]


def _row_magnitudes(tensor: Tensor) -> Tensor:
    """``[N]``: the largest magnitude of each example's row ``tensor[i]`` (0 for an empty row), one
    max-reduction, no copy; NaN where the row holds one, ``inf`` where it holds an infinity."""
    if tensor.dim() == 1:
        return tensor.detach().abs()
    if not tensor.shape[1:].numel():  # (the shape's, not tensor[0]'s: no op dispatched)
        return tensor.new_zeros(len(tensor))
    return torch.linalg.vector_norm(tensor.detach(), math.inf, dim=tuple(range(1, tensor.dim())))


def power_of_two_scale(*tensors: Tensor) -> Tensor:
    """``2**-e`` with ``max_k |t_k| = m 2**e``, ``m`` in ``[0.5, 1)``: a 0-dim float32 tensor.

    Multiplying by it brings the largest magnitude into ``[0.5, 1)`` exactly
    (a power of two changes no rounding), so that squares cannot underflow
    unless they are ``2**-126`` below the largest (``e`` is kept within
    ``[-125, 127]``, where ``2**-e`` is a normal float32). 1 when all are
    zero or one is not finite. On the tensors' device, without waiting for it.
    """
    largest = [largest_magnitude(tensor) for tensor in tensors if tensor.numel()]
    if _device.on_host(tensors[0]):
        # In Python: a handful of tiny torch operations cost more on the CPU.
        return torch.tensor(_host_scale(max((float(value) for value in largest), default=0.0)))
    if not largest:
        return torch.ones((), device=tensors[0].device)  # 2**-0, as frexp(0) gives
    # Rounding to float32 is monotone and amax propagates NaN: the float32 maximum of the
    # rounded magnitudes is the rounded maximum.
    if len(largest) > 1:
        return scales_of_largest(torch.stack([value.float() for value in largest]).amax())
    return scales_of_largest(largest[0].float())


def _host_scale(largest: float) -> float:
    """:func:`power_of_two_scale` of a largest magnitude read on the host."""
    return _scale_for_exponent(math.frexp(largest)[1]) if math.isfinite(largest) else 1.0


#: On the CPU, a layer whose largest magnitude (of the contributions, or the
#: product of its factors' largest) is at least ``2**-40`` (about ``1e-12``) is
#: summed unscaled, in its dtype, as before: the squares of all its elements
#: within float32's ``2**-23`` of that largest are normal float32 numbers, and it
#: saves converting the sums to float64 (which doubled the cost of the sums of
#: an MLP). Smaller layers, and every layer on other devices (where looking
#: at the value would make the host wait), are summed at a scale.
SMALLEST_UNSCALED = 2.0**-40


def scaled_factors(*factors: Tensor, rows: bool = False) -> Tuple[List[Tensor], Optional[Scale]]:
    """The factors of products (``x_i = sum_l g_il a_il^T``) each at its own
    :func:`power_of_two_scale`, and the product ``s`` of the scales as :func:`scale_powers`
    ``(s, 1/s, 1/s**2)`` (float64, exact: each scale is within ``[2**-127, 2**125]``);
    unchanged with scale ``None`` where their squares cannot underflow (float64, or
    :data:`SMALLEST_UNSCALED`).

    All factors' scales at once: on the host as Python numbers (one read per factor), on
    other devices as one vector (:func:`powers_of_largest`), in a dozen launches for two
    factors where one :func:`power_of_two_scale` each took thirty.

    ``rows``: the factors' first dimension is the examples' (``x_i`` from row ``i`` of each),
    and the norms formed from them are marked where underflow lost them: on other devices
    the scale then carries :attr:`Scale.rows` (from each factor's row magnitudes, the same
    one max-reduction of it that its largest magnitude is the maximum of).
    """
    if not needs_scale(factors[0].dtype):
        return list(factors), None
    if _device.on_host(factors[0]):
        if _unscaled_by_first_rows(factors):
            return list(factors), None
        scales = [_host_scale(float(largest_magnitude(factor))) if factor.numel() else 1.0
                  for factor in factors]
        # Powers of two: the float64 product is exact.
        product = math.prod(scales)
        if product * SMALLEST_UNSCALED <= 0.5:
            return list(factors), None
        return [factor * scale for factor, scale in zip(factors, scales)], Scale(scale_powers(product))
    magnitudes = None
    if rows and all(len(factor) == len(factors[0]) for factor in factors):
        magnitudes = torch.stack([_row_magnitudes(factor).float() for factor in factors])  # [k, N]
        # The largest of the rows' largest is the factor's (max is associative; NaN propagates
        # through both); the smallest over the factors of each example's is Scale.rows.
        largest = magnitudes.amax(1) if magnitudes.shape[1] else magnitudes.new_zeros(len(factors))
    else:
        largest = torch.stack([largest_magnitude(factor).float() if factor.numel()
                               else factor.new_zeros((), dtype=torch.float32) for factor in factors])
    powers = powers_of_largest(largest)  # [k, 3]: each factor's (s, 1/s, 1/s**2)
    return [factor * p[0] for factor, p in zip(factors, powers)], Scale(factor_powers=powers, factor_rows=magnitudes)


def _unscaled_by_first_rows(factors: Sequence[Tensor]) -> bool:
    """Whether the factors' first rows (``factor[:1]``) show, on the host, that
    :func:`scaled_factors` leaves them unscaled, without reading the rest.

    A first row's largest magnitude is at most the factor's, and :func:`_host_scale` does not
    grow as its argument does (finite, nonzero): the product of the first rows' scales is at
    least that of the factors'. Where it already leaves the layer unscaled
    (:data:`SMALLEST_UNSCALED`), so does the whole factors' (the same decision for finite
    factors, one max-reduction of each factor saved: both factors of Swin's sequence Linears,
    26M numbers a step, 3-4 ms). Where a first row is empty, 0 or not finite, ``False``: the
    factors decide. (A NaN or infinity past the first rows, which the factors' scale of 1 would
    have seen, leaves the layer unscaled here: its squares are then checked for underflow as
    every unscaled layer's are, :func:`exact_where_lost`.)
    """
    product = 1.0
    for factor in factors:
        if factor.dim() == 0 or not factor[:1].numel():
            return False
        largest = float(largest_magnitude(factor[:1]))
        if largest == 0 or not math.isfinite(largest):
            return False
        product *= _host_scale(largest)
    return product * SMALLEST_UNSCALED <= 0.5


def contributions_scale(contributions: Tensor, rows: bool = False) -> Optional[Scale]:
    """:func:`power_of_two_scale` of contributions ``[N, ...]`` (multiply by it with
    :func:`scaled`), ``None`` where their squares cannot underflow (float64, or
    :data:`SMALLEST_UNSCALED`). ``rows``: on other devices, with :attr:`Scale.rows` (each
    example's row magnitude: its norm of 0 is marked where the row is not 0)."""
    if not needs_scale(contributions.dtype):
        return None
    if _device.on_host(contributions):  # decided in Python
        largest = float(largest_magnitude(contributions)) if contributions.numel() else 0.0
        scale = _host_scale(largest)
        return None if scale * SMALLEST_UNSCALED <= 0.5 else Scale(scale_powers(scale))
    if not contributions.numel():
        # 2**-0, as frexp(0) gives: (1, 1, 1), made there (a copy from the host could wait).
        return Scale(torch.ones(3, dtype=torch.float64, device=contributions.device))
    if rows and contributions.dim() > 1:
        magnitudes = _row_magnitudes(contributions).float()
        return Scale(powers_of_largest(magnitudes.amax().reshape(1))[0], magnitudes)
    return Scale(powers_of_largest(largest_magnitude(contributions).float().reshape(1))[0])


def unscaled_norms(at_scale: Tensor, scale: Union[Scale, Tensor, None], terms: int = 1 << 24) -> Tensor:
    """Per-example squared norms formed at ``scale``: ``at_scale / scale**2``, in
    :func:`saved_dtype` whatever the scale (``[N]`` numbers: converting costs
    nothing, and the norms are then the same numbers on every path). ``scale``: a
    :class:`Scale` (or a 0-dim power of two).

    Where they were formed in a narrower dtype, a norm of ``terms`` squares that
    underflow may have lost (nonzero, below :func:`.functional.underflow.underflow_floor`)
    is written :data:`.functional.underflow.UNRESOLVED`: the wide dtype would
    show it as a real number, and the quantities leave such a parameter out. With
    :attr:`Scale.rows`, so is a norm of 0 whose example's rows are not 0 in any factor.
    """
    wide = saved_dtype(at_scale.dtype)
    rows_shape = scale.rows_shape() if isinstance(scale, Scale) else None
    if rows_shape is not None and rows_shape != at_scale.shape:
        raise ValueError(f"the rows' magnitudes ({tuple(rows_shape)}) are not one per norm "
                         f"({tuple(at_scale.shape)})")
    if rows_shape is not None and at_scale.dtype == torch.float32 and not _device.on_host(at_scale):
        found = facts.recording()
        if found.deferring:  # a rule on the plain path: unscaled with the others at the pass's end
            if at_scale.dim() == 1:
                result = found.deferred.add(at_scale, *scale.handed_over(), terms)
            else:  # [P, N] of P parameters, one factor each (squared_norms_of_many)
                result = found.deferred.add(at_scale, scale.powers.unsqueeze(1), scale.rows.unsqueeze(1), terms)
            setattr(result, _ZEROS_MARKED, True)  # marked there (.deferred_norms)
            return result
    rows = scale.rows if rows_shape is not None else None
    if scale is None:
        result = at_scale.to(wide)
    else:
        # 1/s**2, float64, as a 1-element vector where at_scale is one: its dtype is then the
        # product's, so the multiplication widens at_scale itself, in one launch (a power of two
        # of float64's range times a float32 number: exact, the quotient by s**2 it was).
        # (Powers [P, 3] of P parameters' norms [P, N] give [P, 1]: each row its own.)
        powers = _as_powers(scale)
        inverse_square = powers[..., 2:] if at_scale.dim() else powers[..., 2]
        result = at_scale * inverse_square
    if wide != at_scale.dtype:
        # UNRESOLVED where a norm below the floor may have lost squares, and (with the rows, for
        # exact_where_lost's five) where a 0 lies beside rows all nonzero: 3 launches, or 4.
        result = marked_lost(result, at_scale, underflow_floor(terms, at_scale.dtype), rows)
        if rows is not None:
            setattr(result, _ZEROS_MARKED, True)  # exact_where_lost need not mark them again
    return result


#: A tensor attribute: squared norms whose zeros beside nonzero rows are marked already.
_ZEROS_MARKED = "_cgn_zero_norms_marked"


def unscaled_sums(sums: Tensor, scale: Union[Scale, Tensor, None], terms: int = 1 << 24) -> Tensor:
    """``[T, S, ...]`` formed from contributions times ``scale``: ``[T / scale, S / scale**2, ...]``,
    every row after the first a sum of squares (``A`` of :func:`.conv_math.expanded_sums`).

    ``S`` of ``terms`` squares that underflow may have lost at the scale (below
    :func:`.functional.underflow.underflow_floor`, with ``S`` or ``T`` not 0) is
    written :data:`.functional.underflow.UNRESOLVED` (float64 would show it as a
    real number): the quantities leave such a parameter out.

    Inside :func:`.uses.run`'s window (``BackwardFacts.deferring``), on other devices, the
    float32 ``[T, S]`` are handed over and unscaled with other layers' at the end of the
    backward pass (:mod:`.deferred_sums`): the result is then a placeholder until then.
    """
    if scale is None:
        return sums
    if isinstance(scale, Scale) and not _device.on_host(sums) and not torch.is_grad_enabled():
        found = facts.recording()
        if found.deferring:  # a rule whose sums nothing reads in the pass: unscaled at its end
            handed = found.deferred_sums.add(sums, scale.handed_over()[0], terms)
            if handed is not None:  # (not taken: [T, S, R], or a large layer)
                return handed
    lost = lost_to_underflow(sums[1], underflow_floor(terms, sums.dtype), sums[1], sums[0])
    powers = _as_powers(scale)
    # [1/s, 1/s**2, ...], float64 (powers of two: exact): a view for [T, S]; its dtype is the
    # product's (a vector), so the multiplication widens the sums itself, in one launch.
    inverse = powers[1:] if len(sums) == 2 else torch.cat([powers[1:], powers[2:].expand(len(sums) - 2)])
    result = sums * inverse.reshape(len(sums), *[1] * (sums.dim() - 1))
    result[1].masked_fill_(lost, UNRESOLVED)
    return result


def joined(chunks: List[Tensor]) -> Tensor:
    """The results of consecutive chunks of examples as one: ``torch.cat``, or the one chunk
    itself (no copy, no launch: most layers fit one chunk)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def squared_norms_of(contributions: Tensor) -> Tensor:
    """``||x_i||^2`` of contributions ``[N, *shape]``, ``[N]``; at a scale for float32
    and narrower, saved in float64.

    Exact where the squares underflow, on the CPU: an example whose norm is below
    :func:`.functional.underflow.underflow_floor` (or 0 beside a nonzero
    contribution) is summed again from float64 squares of its contributions (no
    float32 number's square underflows there); in float64, where that cannot
    help, it is written :data:`.functional.underflow.UNRESOLVED`.
    """
    flat = contributions.flatten(start_dim=1)
    scale = contributions_scale(contributions, rows=True)
    at_scale = scaled(flat, scale).square().sum(1)
    # Elsewhere than on the CPU the host would wait to know: nonzero norms below the floor
    # are marked (unscaled_norms), and the quantities leave them out.
    if not _device.on_host(at_scale):
        return unscaled_norms(at_scale, scale, flat.shape[1])
    suspect = at_scale < underflow_floor(flat.shape[1], at_scale.dtype)
    if not bool(suspect.any()):
        return unscaled_norms(at_scale, scale, flat.shape[1])
    return _norms_resolved(flat, at_scale, scale, suspect)


def squared_norms_of_many(contributions: Sequence[Tensor]) -> List[Tensor]:
    """:func:`squared_norms_of` of each of several parameters' contributions (a normalization
    layer's scale and shift), ``[N]`` each.

    On other devices, contributions of one shape and float32 (or narrower) dtype are reduced
    together, stacked ``[P, N, ...]``, each at its own scale (from its own largest magnitude,
    as alone) and marked as alone (its rows, its floor: one shape, one number of terms): the
    same operations on each element, in 14 launches for two parameters where each alone
    took 12. Elsewhere, one at a time.
    """
    first = contributions[0]
    alike = all(c.shape == first.shape and c.dtype == first.dtype for c in contributions)
    if (len(contributions) < 2 or not alike or _device.on_host(first) or not needs_scale(first.dtype)
            or first.dim() < 2 or not first.shape[1:].numel()):
        return [squared_norms_of(c) for c in contributions]
    flat = torch.stack(list(contributions)).flatten(2)  # [P, N, K]
    rows = torch.linalg.vector_norm(flat.detach(), math.inf, dim=2).float()  # [P, N]
    powers = powers_of_largest(rows.amax(1))  # [P, 3]: each parameter's own scale
    # Each scale as a float32 number (exact: a power of two of float32's range), so that the
    # product stays float32 as each parameter's alone does.
    at_scale = (flat * powers[:, :1, None].float()).square().sum(2)  # [P, N]
    return list(unscaled_norms(at_scale, Scale(powers, rows), flat.shape[2]).unbind())


def _norms_resolved(flat: Tensor, at_scale: Tensor, scale: Optional[Scale], suspect: Tensor) -> Tensor:
    """:func:`squared_norms_of` where some examples' norms (``suspect``) are below the floor."""
    result = unscaled_norms(at_scale, scale, flat.shape[1])  # the suspect rows settled below
    rows = suspect.nonzero().squeeze(1)
    if result.dtype != flat.dtype:
        result[rows] = flat[rows].to(result.dtype).square().sum(1)  # exact: no underflow in float64
    else:  # a 0 beside nonzero contributions, or a sum below the floor: unresolved
        lost = (at_scale[rows] != 0) | (flat[rows] != 0).any(1)
        result[rows[lost]] = UNRESOLVED
    return result


Results = Union[Tensor, Tuple[Tensor, ...]]


def exact_where_lost(compute: Callable[..., Results], kinds: str, examples: int, numel: int,
                     *factors: Tensor) -> Results:
    """``compute(*factors)`` of a float32 layer, again from the factors in float64 where
    underflow lost a sum of squares (:func:`.functional.underflow.unresolved_sums`,
    ``unresolved_norms``, which find :data:`.functional.underflow.UNRESOLVED` too): no
    product of two float32 numbers, nor its square, underflows in float64, so those
    results are exact. Only on the CPU (elsewhere the host would wait to know: a norm
    of 0 beside nonzero factors is marked, and the quantities leave such a parameter
    out), and only where lost: the check is one comparison per element (and, where a
    norm is 0, one max-reduction of that example's factors).

    Args:
        compute: From the factors to the results, for float32 and float64 factors: one
            tensor, or a tuple of them.
        kinds: What each result is, one letter each: ``"s"`` for sums ``[T, S, ...]``,
            ``"n"`` for squared norms ``[N]`` (``"sn"``: a pair of them).
        examples: ``N``, the terms of each sum of squares.
        numel: The parameter's elements, the terms of each squared norm.
        factors: The layer's factors (inputs, output gradients, or contributions), in
            the layer's dtype.
    """
    results = compute(*factors)
    found = results if isinstance(results, tuple) else (results,)
    if not _device.on_host(factors[0]):
        # Without waiting: a norm of 0 beside nonzero rows of every factor is marked (one
        # max-reduction of each factor), as nonzero norms below the floor and sums are
        # (unscaled_norms, unscaled_sums); the quantities leave such parameters out. Norms that
        # unscaled_norms marked so already, from the rows' magnitudes their scale carries
        # (float32 rules: scaled_factors(..., rows=True), contributions_scale(..., rows=True);
        # tests/test_squares_marks.py checks each), are not marked again.
        for kind, r in zip(kinds, found):
            if kind == "n" and not getattr(r, _ZEROS_MARKED, False):
                r.masked_fill_((r == 0) & _nonzero_rows(factors, None), UNRESOLVED)
        return results
    lost = [_lost_norms(r, numel, factors) if kind == "n" else unresolved_sums(r[1], r[0], examples)
            for kind, r in zip(kinds, found)]
    if all(rows is None for rows in lost):
        return results
    if needs_scale(factors[0].dtype):
        return compute(*(factor.to(torch.float64) for factor in factors))
    for kind, r, rows in zip(kinds, found, lost):  # float64: the quantities leave them out
        if kind == "n" and rows is not None:
            r.masked_fill_(rows, UNRESOLVED)
    return results


def _lost_norms(norms: Tensor, numel: int, factors) -> Optional[Tensor]:
    """``[N]`` True where a squared norm is unresolved, or 0 while every factor's row of
    that example is not (``x_i = sum_l g_il a_il^T`` then not 0, but for an exact cancellation;
    formed again, it is told apart); ``None`` where none is."""
    lost = (norms != 0) & (norms < underflow_floor(numel, norms.dtype))
    zero = norms == 0
    if bool(zero.any()):
        rows = zero.nonzero().squeeze(1)
        lost[rows[_nonzero_rows(factors, rows)]] = True
    return lost if bool(lost.any()) else None


def _nonzero_rows(factors, rows: Optional[Tensor]) -> Tensor:
    """Whether every factor's row (of ``rows``; all where None) of each example holds a
    nonzero number: one max-reduction of magnitudes each, no copy."""
    picked = [factor if rows is None else factor[rows] for factor in factors]
    largest = [torch.linalg.vector_norm(f.flatten(1), ord=math.inf, dim=1) for f in picked]
    # Magnitudes are >= 0: the smallest of them is not 0 exactly where none is (2 launches
    # fewer than comparing each and stacking). Where a row holds NaN the smallest may be
    # NaN (not 0) while another row is 0; then that example's x_i = sum_l g_il a_il^T, and
    # its norm, are NaN too (NaN times anything), never the 0 this is asked beside.
    return functools.reduce(torch.minimum, largest) != 0


class SquaredNormsFromContributionsMixin:
    """Turns a BackPACK ``BatchL2Grad`` rule (a ``BatchL2Base``) into
    :func:`squared_norms_of` the contributions it forms (no underflow)."""

    def _make_param_function(self, param_str):
        def param_function(ext, module, g_inp, g_out, bp_quantities):
            contributions = self.derivatives.param_mjp(
                param_str, module, g_inp, g_out, g_out[0], sum_batch=False
            )
            return squared_norms_of(contributions)

        return param_function
