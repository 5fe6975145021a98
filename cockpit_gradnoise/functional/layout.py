"""Tensors' elements in the order they lie in memory: where the order does not matter."""

from torch import Tensor


def memory_order(tensor: Tensor) -> Tensor:
    """A 1d view of a dense tensor's elements in the order they lie in memory.

    For the permuted layouts of convolutions' sums: a view, not a copy (a
    copy when the tensor is not dense).
    """
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    return tensor.permute(order).reshape(-1)
