"""What counts as a use of a parameter in the survey's pass (:mod:`.regroup`'s ``_Calls``).

An operation that takes a parameter uses it, unless it reads its metadata only
(:func:`is_metadata`); the parameters an operation takes are found in its arguments
(:func:`note_parameters`). Moved out of :mod:`.regroup` as they were.
"""

import torch
from torch import Tensor, nn
from torch.utils import _pytree

#: Operations and attributes that read a tensor's metadata, not its values (or its values
#: without a gradient: ``.data``): not a use of a parameter (``.T`` is one).
METADATA = frozenset({"size", "dim", "numel", "nelement", "ndimension", "stride", "element_size",
                       "is_floating_point", "is_complex", "is_contiguous", "data_ptr", "get_device",
                       "__len__", "__format__", "__repr__", "shape", "dtype", "device", "ndim",
                       "requires_grad", "is_cuda", "is_leaf", "layout", "grad_fn", "grad", "names",
                       "itemsize", "nbytes", "data", "_version", "output_nr", "is_sparse", "is_meta"})


def is_metadata(func) -> bool:
    """Whether the torch function ``func`` reads metadata only (:data:`METADATA`); a property's
    getter is named by its property (``Tensor.shape.__get__``)."""
    name = getattr(func, "__name__", None)
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", None)
    return name in METADATA

#: Arguments of a torch function that hold no parameter: not flattened.
PLAIN = (Tensor, int, float, bool, str, type(None), slice, torch.dtype, torch.device)


def note_parameters(value, used: set) -> None:
    """Add the ``id`` of each parameter in ``value`` (the arguments of one operation) to
    ``used``: what ``_pytree.tree_leaves`` finds, without flattening plain tuples of numbers
    and tensors per operation (the survey's pass ran at 3 times a forward pass)."""
    if isinstance(value, nn.Parameter):
        used.add(id(value))
    elif isinstance(value, (list, tuple)):
        for item in value:
            if not isinstance(item, PLAIN) or isinstance(item, nn.Parameter):
                note_parameters(item, used)
    elif isinstance(value, dict):
        note_parameters(tuple(value.values()), used)
    elif not isinstance(value, PLAIN):
        used.update(id(leaf) for leaf in _pytree.tree_leaves(value) if isinstance(leaf, nn.Parameter))
