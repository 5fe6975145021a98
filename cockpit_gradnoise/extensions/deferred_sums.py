"""Per-element sums ``[T, S]`` unscaled and marked for many of a backward pass's layers at once.

On other devices than the CPU, every float32 rule forms its sums ``[T, S] = [sum_i x_i,
sum_i x_i**2]`` at a power-of-two scale ``s`` (:mod:`._squares`) and unscales them, widened
to float64, with the mark of what underflow lost (:func:`._squares.unscaled_sums`): three
comparisons and two logical operations for the mark, a multiplication by ``(1/s, 1/s**2)``,
a ``masked_fill``, and the product of a weight's two factors' powers: about eight launches
per parameter, whatever its size. On a GPU a step of a small or medium model is bound by its
launches (``benchmarks/README.md``, "On a GPU"), so, as for the squared norms
(:mod:`.deferred_norms`), those are made once per backward pass for the sums that nothing
reads before the pass ends: such a rule hands its float32 sums at their scale over with its
factors' powers and its number of terms (:meth:`DeferredSums.add`), and gets back an
uninitialised float64 tensor, saved on the parameter as its result;
:meth:`DeferredSums.settle` concatenates what was handed over (grouped by device and number of
factors, in memory order, in batches of at most :data:`SETTLE_ELEMENTS` elements), runs the same
operations on the batch, and copies each parameter's rows into its tensor, at the end of the
backward pass (``facts._end``, the first callback the pass queued).

Exact: the same numbers as :func:`._squares.unscaled_sums` gives each parameter alone. Each
element goes through the same elementwise operations on the same operands:

- the mark: its float32 ``S`` compared with its own floor (of its own number of terms, a
  float32 number gathered to it: the Python floor is rounded so where it is compared with a
  float32 tensor, :func:`.functional.underflow.floors_of`), its ``S`` and ``T`` compared with
  0, the same ``&`` and ``|``;
- the unscaling: its float32 ``T`` (``S``) times its own ``1/s`` (``1/s**2``), float64: the
  product of its factors' (powers of two of float64's range, so each product is exact
  either way, as ``Scale.powers``' product), gathered to it by index (a copy of numbers);
- ``UNRESOLVED`` written where marked.

Concatenating, gathering and copying move numbers without changing them.
``tests/test_deferred_sums.py`` compares the two for equality on the layers this applies to,
with sums that underflow, structural zeros and dead units.

Only where nothing reads the result before the pass ends (a placeholder read early would be a
silently wrong number): in the window :func:`.uses.run` opens for the squared norms
(``BackwardFacts.deferring``: neither a tied parameter nor an embedding broadcast over the
batch, not one of several calls, not the ``torch.func`` fallback, inside a backward pass
whose end is queued, not while FSDP2's or tensor parallelism's hooks that read results in
the pass are armed: :func:`.sharded.armed_in_backward`), on other devices, without a graph
(``create_graph``: the sums would carry none), and for ``[T, S]`` only: a convolution's or a
Linear's ``[T, S, R]`` expanded over positions is multiplied in place after its unscaling
(``R = w(L) A``), a read that stays per parameter. The structural zeros of a bias's sums
over positions are written at the scale, before the hand-over (:func:`.sums.sums_of`).
A parameter of more than :data:`LARGEST` elements keeps its own unscaling: its launches are
a small share of its work, and its sums would be held at their scale until the pass ends.
Every other reader of the sums reads them once the pass is over: the quantities (and their
sums across micro-batches, ``quantities/_accumulation.py``, and processes), FSDP2's
:func:`.sharded.collect`, ``amp``'s unscaling, ``check_model``. The placeholder has the
strides the per-layer product would have (``empty_like`` of the sums at their scale: a
convolution's are permuted), and views of it (``Conv1D``'s transposed weight) show the
settled numbers.
"""

from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.functional.layout import dimension_order
from cockpit_gradnoise.functional.underflow import UNRESOLVED, floors_of, lost_to_underflow

import numpy
import torch
from torch import Tensor

#: The most elements of a parameter whose sums are handed over (each row: float32 at the scale
#: until the pass ends, 8 bytes per element; larger layers' launches are a small share).
LARGEST = 1 << 18
#: The most elements settled in one set of operations (temporaries of about 40 bytes each).
SETTLE_ELEMENTS = 1 << 21

#: ``{(device, sizes, terms): (owners, floors)}``: which entry each element of a batch belongs
#: to and each entry's floor, made once per set of layers (copies from the host), kept for a few.
_TABLES: Dict[Tuple[torch.device, Tuple[int, ...], Tuple[int, ...]], Tuple[Tensor, Tensor]] = {}
_TABLES_KEPT = 16

#: Whether rules may hand their sums over (tests turn it off to compare with the other path).
ENABLED = True

#: An entry: ``(at_scale [2, n] float32, powers [k, 3] float64, placeholder [2, n] float64,
#: terms)``, the rows in memory order.
Entry = Tuple[Tensor, Tensor, Tensor, int]


class DeferredSums:
    """One backward pass's sums handed over for unscaling.

    ``groups``: ``{(device, k): [entries]}``: a parameter's ``1/s`` and ``1/s**2`` are the
    products of its ``k`` factors' (``Scale.powers``), taken here for all the parameters of
    a batch at once; each its own floor (of its own number of terms).
    """

    __slots__ = ("groups",)

    def __init__(self):
        self.groups: Dict[Tuple[torch.device, int], List[Entry]] = {}

    def add(self, at_scale: Tensor, powers: Tensor, terms: int) -> Optional[Tensor]:
        """The float64 tensor that will hold ``at_scale``'s unscaled and marked sums once the
        pass ends, or ``None`` where they are not taken (not ``[T, S]`` float32, each row not
        one dense piece of memory, more than :data:`LARGEST` elements): ``at_scale``
        ``[2, *shape]``, ``powers`` ``[k, 3]`` its factors' ``(s, 1/s, 1/s**2)``; ``terms`` the
        squares in each ``S``."""
        if not ENABLED or len(at_scale) != 2 or at_scale.dtype != torch.float32 or at_scale[0].numel() > LARGEST:
            return None
        # In memory order (a convolution's sums may be permuted), each row one piece of memory.
        order = dimension_order(at_scale)
        rows = at_scale.permute(order)
        if order[0] != 0 or not rows.is_contiguous():
            return None
        # With at_scale's strides, as the product unscaled_sums takes gives them.
        placeholder = torch.empty_like(at_scale, dtype=torch.float64)
        self.groups.setdefault((at_scale.device, len(powers)), []).append(
            (rows.view(2, -1), powers, placeholder.permute(order).view(2, -1), terms))  # views: no launch
        return placeholder

    def settle(self) -> None:
        """Unscale and mark every group's sums, batch by batch, and write them into their
        tensors (:func:`._squares.unscaled_sums`' operations)."""
        groups, self.groups = self.groups, {}
        for (device, _), entries in groups.items():
            for batch in _batches(entries):
                _settled(batch, device)


def _batches(entries: List[Entry]) -> List[List[Entry]]:
    """Consecutive entries, at most :data:`SETTLE_ELEMENTS` elements in each batch (one
    entry alone where larger: never, as :data:`LARGEST` is smaller)."""
    batches, size = [[]], 0
    for entry in entries:
        if batches[-1] and size + entry[0].shape[1] > SETTLE_ELEMENTS:
            batches.append([])
            size = 0
        batches[-1].append(entry)
        size += entry[0].shape[1]
    return batches


def _settled(entries: List[Entry], device: torch.device) -> None:
    """One batch of entries of one group unscaled, marked and copied into their placeholders."""
    at_scale, powers, placeholders, terms = zip(*entries)
    sizes = [len(p[0]) for p in placeholders]
    owners, floors = _tables(device, sizes, terms)
    sums = at_scale[0] if len(at_scale) == 1 else torch.cat(at_scale, 1)  # [2, M] float32
    powers = torch.stack(powers)  # [P, k, 3]
    # (1/s, 1/s**2) of each parameter, [P, 2]: the product of its factors' (exact).
    inverse = powers[:, 0, 1:] if powers.shape[1] == 1 else powers[..., 1:].prod(1)
    inverse = inverse.T  # [2, P]; one entry's broadcast, else each element its entry's (copies)
    if owners is not None:
        inverse, floors = inverse.index_select(1, owners), floors.index_select(0, owners)
    # Each S compared with its entry's floor, a float32 number as the Python floor is where
    # unscaled_sums compares a float32 tensor with it.
    lost = lost_to_underflow(sums[1], floors, sums[1], sums[0])
    result = sums * inverse  # [2, M] float64, exact: a float32 number times a power of two
    result[1].masked_fill_(lost, UNRESOLVED)
    for row in (0, 1):  # contiguous pieces: one launch each on CUDA
        torch._foreach_copy_([p[row] for p in placeholders], list(result[row].split(sizes)))


def _tables(device: torch.device, sizes: List[int], terms) -> Tuple[Optional[Tensor], Tensor]:
    """``(owners, floors)`` on ``device`` (copied without the host waiting), cached: ``[M]``
    int32 (``M = sum(sizes)``), the index of the entry each element belongs to (``None`` for
    one entry), and ``[P]`` float32, each entry's floor of its ``terms`` squares
    (:func:`.functional.underflow.floors_of`)."""
    key = (device, tuple(sizes), tuple(terms))
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        owners = None
        if len(sizes) > 1:
            # In NumPy: the host's numbers (torch's repeat_interleave by a tensor reads it back).
            index = torch.from_numpy(numpy.repeat(numpy.arange(len(sizes), dtype=numpy.int32), sizes))
            owners = _device.copied_without_waiting(index, device)
        tables = _TABLES[key] = (owners, floors_of(terms, torch.float32, device))
    return tables
