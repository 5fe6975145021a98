"""Per-example squared norms unscaled and marked for all of a backward pass's layers at once.

On other devices than the CPU, every float32 rule forms its squared norms at a power-of-two
scale (:mod:`._squares`) and unscales them (``at_scale / s**2``, widened to float64) with the
marks of what underflow lost, :func:`._squares.unscaled_norms`: a multiplication, an
addition, a comparison with the floor, a clamp and a ``where``, five launches per parameter,
whatever its size. On a GPU a step of a small or medium model is bound by its launches
(``benchmarks/README.md``, "On a GPU"), so here those five are made once per backward pass
for all the parameters whose results nothing reads before the pass ends (below), with the
reduction of a weight's two factors' scales and rows (``prod``, ``amin``): each such rule
hands over its float32 norms at their scale with its factors' powers and rows' magnitudes
and its number of terms (:meth:`DeferredNorms.add`), and gets back an uninitialised float64
tensor, which is saved on the parameter as its result; :meth:`DeferredNorms.settle` stacks what was handed
over, runs the same five operations on the stack, and copies each row into its tensor, at
the end of the backward pass (``facts._end``, the first callback the pass queued: before any
other end-of-pass work, and before the backward call returns, so before any quantity reads).

Exact: the same numbers as :func:`._squares.unscaled_norms` gives each parameter alone. Each
element goes through the same elementwise operations on the same operands: its float32 norm
times its own ``1/s**2`` (float64, the product of its factors' ``1/s_k**2``: powers of two of
float64's range, so each product is exact either way), plus
its own row magnitude, compared with its own floor (a float32 number, as the Python floor is
rounded where a float32 tensor is compared with it: :func:`.functional.underflow.floors_of`),
clamped at :data:`.functional.underflow.UNRESOLVED`; stacking and copying move numbers
without changing them. ``tests/test_deferred_norms.py`` compares the two on the layers this
applies to, with norms that underflow and zeros beside nonzero rows.

Only where nothing reads the result before the pass ends (a placeholder read early would be a
silently wrong number): while :func:`.uses.run` runs a layer's rule (``BackwardFacts.deferring``)
that is neither tied nor an embedding broadcast over the batch, and not one of several calls
(whose results are combined, in the pass, by :mod:`.tied`, :mod:`.batchless`, :mod:`.repeated`),
for a rule of the tables (not the ``torch.func`` fallback, which compares its results), inside
a backward pass whose end is queued (``BackwardFacts.may_defer``), on other devices (the CPU's path checks the values at
once), and for norms with :attr:`._squares.Scale.rows` (whose zeros are marked here, so that
``exact_where_lost`` leaves them alone).
"""

from typing import Dict, List, Tuple

from cockpit_gradnoise.functional.underflow import floors_of, marked_lost

import torch
from torch import Tensor

#: ``{(device, numels): floors}``: each settle's floors tensor, made once per set of layers
#: (:func:`.functional.underflow.floors_of` copies from the host, one launch), kept for a few.
_FLOORS: Dict[Tuple[torch.device, Tuple[int, ...]], Tensor] = {}
_FLOORS_KEPT = 32

#: Whether rules may hand their norms over (tests turn it off to compare with the other path).
ENABLED = True


class DeferredNorms:
    """One backward pass's norms handed over for unscaling, grouped by device and batch length.

    ``groups``: ``{(device, N): {(k_powers, k_rows): [(at_scale [p, N], powers [p, k_powers, 3],
    rows [p, k_rows, N], terms, placeholder [p, N])]}}``: a parameter's scale is the product
    of its ``k`` factors' and its rows the smallest of theirs, reduced here for all parameters
    with as many factors at once (``Scale``'s ``prod`` and ``amin``, two launches per group,
    where each parameter took two).
    """

    __slots__ = ("groups",)

    def __init__(self):
        self.groups: Dict[Tuple[torch.device, int], Dict[Tuple[int, int], List[tuple]]] = {}

    def add(self, at_scale: Tensor, powers: Tensor, rows: Tensor, terms: int) -> Tensor:
        """The float64 tensor that will hold ``at_scale``'s unscaled and marked norms once the
        pass ends: ``at_scale`` ``[N]`` float32, ``powers`` ``[k, 3]`` its factors' ``(s, 1/s,
        1/s**2)``, ``rows`` ``[k, N]`` their examples' row magnitudes (or, for ``[p, N]`` norms of
        ``p`` parameters, ``[p, k, 3]`` and ``[p, k, N]``); ``terms`` the squares in each norm."""
        placeholder = torch.empty(at_scale.shape, dtype=torch.float64, device=at_scale.device)
        if at_scale.dim() == 1:  # views: no launch
            at_scale, powers, rows = at_scale.unsqueeze(0), powers.unsqueeze(0), rows.unsqueeze(0)
        kinds = self.groups.setdefault((at_scale.device, at_scale.shape[1]), {})
        kinds.setdefault((powers.shape[1], rows.shape[1]), []).append(
            (at_scale, powers, rows, terms, placeholder.view(at_scale.shape)))
        return placeholder

    def settle(self) -> None:
        """Unscale and mark every group's norms, each group in one set of operations, and
        write them into their tensors (:func:`._squares.unscaled_norms`' operations)."""
        groups, self.groups = self.groups, {}
        for (device, _), kinds in groups.items():
            entries = [entry for kind in kinds.values() for entry in kind]
            at_scale, _, _, terms, placeholders = zip(*entries)
            floors = _floors(device, [t for t, norms in zip(terms, at_scale) for _ in range(len(norms))])
            inverse_squares, rows = zip(*(_reduced(kind) for kind in kinds.values()))
            at_scale = torch.cat(at_scale)  # [K, N], in the order of the kinds' entries
            result = at_scale * _joined(inverse_squares)  # [K, N] float64, exact
            # As unscaled_norms, row by row (each its own floor).
            result = marked_lost(result, at_scale, floors, _joined(rows))
            torch._foreach_copy_(list(placeholders), list(result.split([len(p) for p in placeholders])))


def _reduced(entries: List[tuple]) -> Tuple[Tensor, Tensor]:
    """``(1/s**2 [K, 1], rows [K, N])`` of entries of one kind: the product of the factors'
    ``1/s_k**2`` (powers of two within float64's range: exact, as ``Scale.powers``' product)
    and the smallest of their rows (``Scale.rows``)."""
    powers, rows = _joined([e[1] for e in entries]), _joined([e[2] for e in entries])
    inverse_squares = powers[:, 0, 2:] if powers.shape[1] == 1 else powers[..., 2].prod(1, keepdim=True)
    return inverse_squares, rows[:, 0] if rows.shape[1] == 1 else rows.amin(1)


def _joined(parts) -> Tensor:
    """``torch.cat`` of the parts, or the one part itself (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _floors(device: torch.device, numels: List[int]) -> Tensor:
    """``[K, 1]`` float32 floors of norms of ``numels`` squares each, on ``device``, cached."""
    key = (device, tuple(numels))
    floors = _FLOORS.get(key)
    if floors is None:
        if len(_FLOORS) >= _FLOORS_KEPT:
            _FLOORS.clear()
        floors = _FLOORS[key] = floors_of(numels, torch.float32, device).reshape(-1, 1)
    return floors
