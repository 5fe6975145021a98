"""Per-example squared norms unscaled and marked for all of a backward pass's layers at once.

On other devices than the CPU, every float32 rule forms its squared norms at a power-of-two
scale (:mod:`._squares`) and unscales them (``at_scale / s**2``, widened to float64) with the
marks of what underflow lost, :func:`._squares.unscaled_norms`: a multiplication, an
addition, a comparison with the floor, a clamp and a ``where``, five launches per parameter,
whatever its size. On a GPU a step of a small or medium model is bound by its launches
(``benchmarks/README.md``, "On a GPU"), so here those five are made once per backward pass
for all the parameters whose rules ran on the plain path (:func:`open_for`): each such rule
hands over its float32 norms at their scale with the scale's powers, its rows' magnitudes and
its floor (:meth:`DeferredNorms.add`), and gets back an uninitialised float64 tensor, which is
saved on the parameter as its result; :meth:`DeferredNorms.settle` stacks what was handed
over, runs the same five operations on the stack, and copies each row into its tensor, at
the end of the backward pass (``facts._end``, the first callback the pass queued: before any
other end-of-pass work, and before the backward call returns, so before any quantity reads).

Exact: the same numbers as :func:`._squares.unscaled_norms` gives each parameter alone. Each
element goes through the same elementwise operations on the same operands: its float32 norm
times its own ``1/s**2`` (float64; a power of two, so the product is exact either way), plus
its own row magnitude, compared with its own floor (a float32 number, as the Python floor is
rounded where a float32 tensor is compared with it: :func:`.functional.underflow.floors_of`),
clamped at :data:`.functional.underflow.UNRESOLVED`; stacking and copying move numbers
without changing them. ``tests/test_deferred_norms.py`` compares the two on the layers this
applies to, with norms that underflow and zeros beside nonzero rows.

Only where nothing reads the result before the pass ends (a placeholder read early would be a
silently wrong number): on the plain path of :func:`.uses.run` (no tied parameter, no
broadcast embedding, no repeated call, whose combinations read the results in the pass), for
a rule of the tables (not the ``torch.func`` fallback, which compares its results), inside a
backward pass whose end is queued, on other devices (the CPU's path checks the values at
once), and for norms with :attr:`._squares.Scale.rows` (whose zeros are marked here, so that
``exact_where_lost`` leaves them alone).
"""

from typing import Dict, List, Tuple

from cockpit_gradnoise.functional.underflow import UNRESOLVED, floors_of

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

    ``groups``: ``{(device, N): [(at_scale [p, N], inverse_squares [p, 1], rows [p, N],
    terms, placeholder [p, N])]}``.
    """

    __slots__ = ("groups",)

    def __init__(self):
        self.groups: Dict[Tuple[torch.device, int], List[tuple]] = {}

    def add(self, at_scale: Tensor, powers: Tensor, rows: Tensor, terms: int) -> Tensor:
        """The float64 tensor that will hold ``at_scale``'s unscaled and marked norms once the
        pass ends: ``at_scale`` ``[N]`` (or ``[p, N]``), float32, ``powers`` its scale's
        ``(s, 1/s, 1/s**2)`` ``[3]`` (or ``[p, 3]``), ``rows`` its examples' row magnitudes,
        shaped like ``at_scale``; ``terms`` the squares in each norm."""
        placeholder = torch.empty(at_scale.shape, dtype=torch.float64, device=at_scale.device)
        flat = at_scale if at_scale.dim() == 2 else at_scale.unsqueeze(0)
        inverse_squares = powers[..., 2:].reshape(-1, 1)  # views: no launch
        entry = (flat, inverse_squares, rows.reshape(flat.shape), terms, placeholder.view(flat.shape))
        self.groups.setdefault((at_scale.device, flat.shape[1]), []).append(entry)
        return placeholder

    def settle(self) -> None:
        """Unscale and mark every group's norms, each group in one set of operations, and
        write them into their tensors (:func:`._squares.unscaled_norms`' operations)."""
        groups, self.groups = self.groups, {}
        for (device, _), entries in groups.items():
            at_scale, inverse_squares, rows, terms, placeholders = zip(*entries)
            floors = _floors(device, [t for t, norms in zip(terms, at_scale) for _ in range(len(norms))])
            at_scale, rows = torch.cat(at_scale), torch.cat(rows)  # [K, N]
            result = at_scale * torch.cat(inverse_squares)  # [K, N] float64, exact
            # As unscaled_norms, row by row: capped at UNRESOLVED where below the floor, the
            # rows' magnitudes added first, so that a 0 beside nonzero rows is marked too.
            result = torch.where(at_scale < floors, (result + rows).clamp(max=UNRESOLVED), result)
            torch._foreach_copy_(list(placeholders), list(result.split([len(p) for p in placeholders])))


def _floors(device: torch.device, numels: List[int]) -> Tensor:
    """``[K, 1]`` float32 floors of norms of ``numels`` squares each, on ``device``, cached."""
    key = (device, tuple(numels))
    floors = _FLOORS.get(key)
    if floors is None:
        if len(_FLOORS) >= _FLOORS_KEPT:
            _FLOORS.clear()
        floors = _FLOORS[key] = floors_of(numels, torch.float32, device).reshape(-1, 1)
    return floors
