"""Tensors' elements in the order they lie in memory: where the order does not matter."""

from typing import Tuple

from torch import Tensor


def memory_order(tensor: Tensor) -> Tensor:
    """A 1d view of a dense tensor's elements in the order they lie in memory.

    For the permuted layouts of convolutions' sums: a view, not a copy (a
    copy when the tensor is not dense).
    """
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    return tensor.permute(dimension_order(tensor)).reshape(-1)


def dimension_order(tensor: Tensor) -> Tuple[int, ...]:
    """The dimensions of ``tensor`` from the largest stride to the smallest: the order in
    which a dense tensor is contiguous (that of :func:`memory_order`)."""
    return tuple(sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True))
