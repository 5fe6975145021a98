"""The cost model and the memory budget of the convolution and sequence-Linear rules.

Each result of a layer whose contributions are sums over ``L`` positions,
``x_i = sum_l b_il a_il^T`` (``C_b x L`` by ``L x C_a`` per example and
group), has two exact computations (:mod:`.conv_math`, :mod:`.linear`):
forming ``x_i`` or working on products of positions (the expanded square,
Gram matrices for norms). :func:`use_formation` chooses between them per
layer from the work each takes per example and group; :data:`FORCE_METHOD`
overrides it. Both run over chunks of examples of :func:`examples_per_chunk`.
"""

from typing import Callable, Optional

#: Bytes of temporary tensors (copies of a chunk's inputs and patches,
#: per-example gradients or products of positions) one chunk of examples may
#: allocate; at least one example is processed at a time whatever it needs.
#: 16 MiB: small beside a plain step of resnet18 at batch 64, and below glibc's
#: largest mmap threshold (32 MiB), so that chunks are reused from the heap
#: instead of being mapped and page-faulted anew.
CHUNK_BYTES = 16 * 2**20

#: On the host, the bytes of a chunk of formed per-example gradients of a Linear on
#: sequences (:func:`.linear.formed_contributions`), when :data:`CHUNK_BYTES` allows as
#: many: each chunk is written once and read four times (the two sums, the squares, the
#: norms), which a chunk of the size of a core's cache (1-2 MiB) keeps close. Measured in
#: the benchmark GPT's step (``--preconditioned-cost``, ``benchmarks/README.md``, "The
#: noise scale Adam sees"): with the whole batch in one chunk (6-8 MB per layer) the
#: formation took about 14 ms more per step (of ~230 ms) than in chunks of 2 MiB; alone,
#: in a loop, the two take the same time. On other devices :data:`CHUNK_BYTES`.
HOST_FORMATION_BYTES = 2 * 2**20

#: ``None`` chooses per layer by :func:`formation_is_cheaper`; ``"formation"``
#: or ``"expansion"`` (expanding the square, with its absolute terms, or Gram matrices for norms)
#: forces one method for every convolution and sequence Linear (tests,
#: measurements). A setting, not per-pass state: no backward pass changes it.
FORCE_METHOD: Optional[str] = None

#: Cost of moving one number through memory, in floating-point operations of a
#: matrix product. Measured on resnet18's layers; any value from 10 to 320
#: makes the same choices for resnet18 and the benchmark CNN.
FLOPS_PER_ELEMENT_MOVED = 40

#: ``(c_b, c_a, positions) -> work`` of one example and group.
Cost = Callable[[int, int, int], int]


def formation_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of forming one example's gradient of one group, squaring and summing it.

    A ``C_b x L`` by ``L x C_a`` product (``2 C_b C_a L`` operations), whose
    ``C_b C_a`` numbers are written and read again.
    """
    return 2 * c_b * c_a * positions + FLOPS_PER_ELEMENT_MOVED * 2 * c_b * c_a


def expansion_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of one example's and group's share of ``[T, S]`` (and ``A``) without forming ``x_i``.

    With one position (:func:`.conv_math.weight_sums`): two products of one
    row each, for ``T`` and ``S``, whose ``C_b + C_a`` numbers are written and
    read. With ``L > 1`` (:func:`.conv_math.expanded_sums`): ``L`` rows for
    ``T`` (copied, read: 3 moves per number) and ``L(L+1)/2`` products of
    positions for both ``S`` and ``A`` (written, made absolute, read twice:
    6 moves). Each row costs ``2 C_b C_a`` operations in each product it
    enters.
    """
    if positions == 1:
        return 2 * c_b * c_a * 2 + FLOPS_PER_ELEMENT_MOVED * 2 * 2 * (c_b + c_a)
    pairs = positions * (positions + 1) // 2
    moves = (3 * positions + 6 * pairs) * (c_b + c_a)
    return 2 * c_b * c_a * (positions + 2 * pairs) + FLOPS_PER_ELEMENT_MOVED * moves


def gram_cost(c_b: int, c_a: int, positions: int) -> int:
    """Work of one example's and group's ``||x_i||^2`` from two ``L x L`` Gram matrices."""
    return 2 * positions**2 * (c_b + c_a) + FLOPS_PER_ELEMENT_MOVED * 4 * positions**2


def formation_is_cheaper(alternative_cost: Cost, c_b: int, c_a: int, positions: int) -> bool:
    """Whether :func:`formation_cost` is at most ``alternative_cost`` (same arguments).

    Both costs are per example and group, so neither the batch size nor the
    number of groups changes the choice.
    """
    return formation_cost(c_b, c_a, positions) <= alternative_cost(c_b, c_a, positions)


def use_formation(alternative_cost: Cost, c_b: int, c_a: int, positions: int) -> bool:
    """Whether to form ``x_i`` rather than use ``alternative_cost``'s method.

    :func:`formation_is_cheaper`, unless :data:`FORCE_METHOD` says otherwise.

    Raises:
        ValueError: If :data:`FORCE_METHOD` is none of its three values.
    """
    if FORCE_METHOD is None:
        return formation_is_cheaper(alternative_cost, c_b, c_a, positions)
    if FORCE_METHOD not in ("formation", "expansion"):
        raise ValueError(
            f"FORCE_METHOD must be None, 'formation' or 'expansion', got {FORCE_METHOD!r}"
        )
    return FORCE_METHOD == "formation"


def examples_per_chunk(numbers_per_example: int, itemsize: int, budget: Optional[int] = None) -> int:
    """How many examples' temporaries fit in ``budget`` bytes (default :data:`CHUNK_BYTES`; at least one)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // (numbers_per_example * itemsize))


def formation_bytes(on_host: bool) -> int:
    """The budget of a chunk of formed per-example gradients of a Linear on sequences:
    :data:`HOST_FORMATION_BYTES` on the host (at most :data:`CHUNK_BYTES`), else :data:`CHUNK_BYTES`."""
    return min(CHUNK_BYTES, HOST_FORMATION_BYTES) if on_host else CHUNK_BYTES
