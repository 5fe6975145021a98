"""Tensors a module computes from its parameters alone, broadcast over its rows: each example's share.

SwinV2's window attention (``transformers``' ``Swinv2SelfAttention``) reads its ``logit_scale``
(``[heads, 1, 1]``) in its own forward pass (``scores * exp(clamp(logit_scale))``) and adds a
position bias an MLP computes from a table without the batch
(``continuous_position_bias_mlp(relative_coords_table)``, then ``[1, heads, t, t]``): tensors
``B`` computed from the module's parameters and buffers alone (*batch-free*), each broadcast
over the ``N*W`` rows of the windows at one elementwise operation. During the module's call,
:class:`Broadcasts` follows which tensors are batch-free, and at an elementwise operation of
such a tensor (requiring a gradient) with a tensor led by the rows, puts ``B`` expanded to the
rows in its place (``expand``: a view, the same numbers). With ``D_r`` the gradient at row
``r`` of that view, each example's contribution to every parameter ``theta`` ``B`` is computed
from is

.. math::

    x_i(\\theta) = J_\\theta(B)^{\\top} \\sum_{r:\\, r // W = i} D_r ,

one vector-Jacobian product per example (:func:`example_shares`, batched), after the batch's
backward pass (which keeps only ``sum_r D_r`` per example): through ``B`` computed again from
the parameters by the operations the call recorded (:meth:`Broadcasts.replay`; no module is
called again, no hook runs). An attention kernel's floating mask (:data:`MASKED`: timm's fused
window attention passes its position bias to ``scaled_dot_product_attention`` so) is added to the
scores as broadcast over the query's leading dimensions, and is expanded to the query's rows the
same way. Any other use of a batch-free tensor that requires a gradient together with the batch's
tensors (a matrix product) marks the call :attr:`Broadcasts.broken`: the fast way does not know it
(:mod:`.windows` then recomputes the block). A parameter used as it is (a member ``nn.Linear``'s
weight) is that layer's business.

A layer whose weight the module passes to ``F.linear`` itself, never calling the layer
(torchvision's ``ShiftedWindowAttention``: ``F.linear(x, self.qkv.weight, self.qkv.bias)`` inside
``shifted_window_attention``; timm's SwinV2 ``WindowAttention``: ``F.linear(x, weight=self.qkv.weight,
bias=cat(q_bias, k_bias, v_bias))``), is one of :attr:`Broadcasts.linears`: at that call, on an input
led by the rows, the call runs as it is and its input and output are handed to ``on_linear``, as a
forward hook of the layer would see them (:mod:`.windows` computes the layer from them as a member
called on the rows). Its bias, where it is not the layer's own but computed from batch-free tensors
(the concatenation, or torchvision's SwinV2 copy with its key third zeroed), is added to every
position of every row, as the expanded tensors above: an operand whose per-example share is the
output's gradient summed over the example's rows and positions (:attr:`Broadcasts.linear_biases`).
"""

import itertools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

#: Elementwise operations at which a batch-free operand is expanded to the rows (as the tensor
#: methods reach a mode, and as functions); in place, only as the second operand.
IN_PLACE = ("__iadd__", "__isub__", "__imul__", "__itruediv__", "add_", "sub_", "mul_", "div_")
_NAMES = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
          "add", "sub", "mul", "div")
ELEMENTWISE = frozenset(
    {getattr(owner, name) for owner in (Tensor, torch._C.TensorBase) for name in _NAMES + IN_PLACE
     if hasattr(owner, name)} | {torch.add, torch.sub, torch.mul, torch.div})
_IN_PLACE = frozenset(getattr(owner, name) for owner in (Tensor, torch._C.TensorBase) for name in IN_PLACE
                      if hasattr(owner, name))
#: Attention kernels whose floating ``attn_mask`` (their fourth argument) is added to the scores,
#: broadcast over the query's leading dimensions (timm's fused window attention passes its
#: position bias so): a batch-free mask is expanded to the rows there, as at an addition.
MASKED = frozenset({torch.nn.functional.scaled_dot_product_attention})
#: The operation whose weight, where it is one of :attr:`Broadcasts.linears`, is that layer's use.
LINEAR = torch.nn.functional.linear


#: Arguments that hold no tensor: not flattened (:func:`_tensors`).
_PLAIN = (int, float, bool, complex, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device,
          torch.Size, torch.layout, torch.memory_format)


def _tensors(value, found: List[Tensor]) -> List[Tensor]:
    """The tensors among ``value``'s leaves (``_pytree.tree_leaves``), appended to ``found``: tensors,
    plain lists, tuples and dicts of them and of plain values walked here, anything else (a named
    tuple, a registered node) flattened by ``_pytree``. Per operation of a module's call, where
    ``_pytree`` took about half of the attention's calls' time under cProfile (timm's Swin, 52 of
    110 ms a step)."""
    if isinstance(value, Tensor):
        found.append(value)
    elif type(value) in (tuple, list):
        for item in value:
            _tensors(item, found)
    elif type(value) is dict:
        for item in value.values():
            _tensors(item, found)
    elif not isinstance(value, _PLAIN):
        found.extend(leaf for leaf in _pytree.tree_leaves(value) if isinstance(leaf, Tensor))
    return found


class Broadcasts(TorchFunctionMode):
    """During one call of ``module``: batch-free tensors followed, and expanded to ``rows`` where
    they meet the rows (``expand(k, expanded)``, ``k`` its index in :attr:`operands`, gives the
    tensor put in its place); ``F.linear`` with the weight of one of ``linears`` (``{id(weight):
    layer}``) handed to ``on_linear(layer, input, output, own_bias)`` (module docstring). ``rows``
    ``None``: the leading size of the first such call's input."""

    def __init__(self, module: nn.Module, rows: Optional[int], expand: Callable[[Tensor, Tensor], Tensor],
                 linears: Optional[Dict[int, nn.Module]] = None, on_linear: Optional[Callable] = None):
        super().__init__()
        self.rows, self.expand = rows, expand
        self.linears, self.on_linear = linears or {}, on_linear
        #: ``(k, layer)``: operand ``k`` is the bias computed from batch-free tensors of ``layer``'s call.
        self.linear_biases: List[Tuple[int, nn.Module]] = []
        self.own = {id(p) for p in module._parameters.values() if p is not None}
        self.free = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
        # The batch-free tensors computed from a trainable parameter (known without autograd:
        # the proof's passes run without gradients).
        self.trained = {id(p) for p in module.parameters() if p.requires_grad}
        self.operands: List[Tuple[Tensor, tuple]] = []  # the tensors expanded, and their shape there
        self.tape: list = []  # (func, args, kwargs, output) of each operation on batch-free tensors
        self.broken = False  # a use of a batch-free tensor the fast way does not know

    def is_free(self, tensor) -> bool:
        return isinstance(tensor, Tensor) and id(tensor) in self.free

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is LINEAR and self.linears:
            layer = self._layer_of(args, kwargs)
            if layer is not None:
                return self._linear(func, layer, args, kwargs)
        tensors = _tensors(kwargs, _tensors(args, []))
        free = [t for t in tensors if id(t) in self.free]
        if free and len(free) < len(tensors):
            args, kwargs = self._met(func, args, kwargs, free)
        out = func(*args, **kwargs)
        outputs = _tensors(out, [])
        trained = any(id(t) in self.trained for t in free)
        if outputs and len(free) == len(tensors):  # (a factory's output, arange's, too)
            self.tape.append((func, args, kwargs, out))
        for leaf in outputs:  # (an in-place operation with the batch's tensors unmarks its target)
            if len(free) == len(tensors):
                self.free[id(leaf)] = leaf
                if trained:
                    self.trained.add(id(leaf))
            else:
                self.free.pop(id(leaf), None)
                self.trained.discard(id(leaf))
        return out

    def _met(self, func, args, kwargs, free: List[Tensor]):
        """``(args, kwargs)`` with a batch-free operand expanded to the rows, where the operation
        is one of :data:`ELEMENTWISE` of two tensors, the other led by the rows, or one of
        :data:`MASKED` whose mask is the one batch-free operand, its query led by the rows."""
        grads = [t for t in free if id(t) in self.trained]
        if not grads:
            return args, kwargs
        if func in ELEMENTWISE and not kwargs and len(args) == 2 and all(isinstance(a, Tensor) for a in args):
            k = 0 if self.is_free(args[0]) else 1
            operand, other = args[k], args[1 - k]
            if k == 1 or func not in _IN_PLACE:
                replaced = self._expanded(operand, other)
                if replaced is not None:
                    return ((replaced, other) if k == 0 else (other, replaced)), kwargs
        if func in MASKED:
            found = self._masked(args, kwargs, grads)
            if found is not None:
                return found
        if not all(isinstance(t, nn.Parameter) and id(t) not in self.own for t in grads):
            self.broken = True
        return args, kwargs

    def _expanded(self, operand: Tensor, other: Tensor) -> Optional[Tensor]:
        """``operand`` broadcast to ``other`` (led by the rows), expanded to the rows and noted;
        ``None`` where it has a leading size of its own there."""
        if other.dim() < max(operand.dim(), 1) or other.shape[0] != self.rows:
            return None
        shaped = operand.reshape((1,) * (other.dim() - operand.dim()) + tuple(operand.shape))
        if shaped.shape[0] != 1:
            return None
        self.operands.append((operand, tuple(shaped.shape)))
        return self.expand(len(self.operands) - 1, shaped.expand(self.rows, *shaped.shape[1:]))

    def _masked(self, args, kwargs, grads: List[Tensor]) -> Optional[tuple]:
        """``(args, kwargs)`` of an attention kernel (:data:`MASKED`) with its floating mask, the one
        batch-free operand that requires a gradient, expanded to the rows of its query: the
        kernel adds it to the scores ``[rows, ..., L, S]`` as broadcast (the same numbers)."""
        keyword = "attn_mask" in kwargs
        mask = kwargs["attn_mask"] if keyword else args[3] if len(args) > 3 else None
        query = args[0] if args else kwargs.get("query")
        if not isinstance(mask, Tensor) or not isinstance(query, Tensor) or len(grads) != 1 \
                or grads[0] is not mask or not mask.is_floating_point() or self.is_free(query):
            return None
        replaced = self._expanded(mask, query)
        if replaced is None:
            return None
        if keyword:
            return args, {**kwargs, "attn_mask": replaced}
        return (*args[:3], replaced, *args[4:]), kwargs

    def _layer_of(self, args, kwargs) -> Optional[nn.Module]:
        """The layer of :attr:`linears` whose weight this ``F.linear`` call takes, if any."""
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        layer = self.linears.get(id(weight))
        return layer if layer is not None and weight is layer.weight else None

    def _linear(self, func, layer: nn.Module, args, kwargs):
        """``F.linear`` with ``layer``'s weight: run as it is; its input and output handed to
        :attr:`on_linear` where the input is led by the rows and the bias is none, the layer's
        own, or computed from batch-free tensors (noted in :attr:`linear_biases`); else the call
        is one the fast way does not know (:attr:`broken`)."""
        bound = dict(zip(("input", "weight", "bias"), args), **kwargs)
        x, bias = bound.get("input"), bound.get("bias")
        known = len(bound) == len(args) + len(kwargs) and set(bound) <= {"input", "weight", "bias"} \
            and isinstance(x, Tensor) and x.dim() >= 2 and not self.is_free(x) \
            and self.rows in (None, x.shape[0]) and (bias is None or bias is layer.bias or (
                self.is_free(bias) and bias.dim() == 1))
        out = func(*args, **kwargs)
        self.free.pop(id(out), None)
        if not known:
            self.broken = True
            return out
        self.rows = x.shape[0]
        own = bias is not None and bias is layer.bias
        if bias is not None and not own and id(bias) in self.trained:
            self.operands.append((bias, (1, bias.shape[0])))
            self.linear_biases.append((len(self.operands) - 1, layer))
        self.on_linear(layer, x, out, own)
        return out

    def replay(self) -> Dict[int, Tensor]:
        """``{id(recorded tensor): the same computed again}`` from the parameters and buffers, by
        the recorded operations (with gradients where enabled: a graph of its own)."""
        again: Dict[int, Tensor] = {}

        def swap(leaf):
            return again.get(id(leaf), leaf) if isinstance(leaf, Tensor) else leaf

        for func, args, kwargs, out in self.tape:
            found = func(*_pytree.tree_map(swap, args), **_pytree.tree_map(swap, kwargs))
            for leaf, new in zip(_pytree.tree_leaves(out), _pytree.tree_leaves(found)):
                if isinstance(leaf, Tensor):
                    again[id(leaf)] = new
        return again


def summed_per_example(rows_grad: Tensor, examples: int) -> Tensor:
    """``[N, 1, ...]``: the gradient at the ``N*W`` rows of an expanded tensor, summed over each
    example's ``W`` rows (row ``r`` example ``r // W``'s)."""
    return rows_grad.reshape(examples, -1, *rows_grad.shape[1:]).sum(1, keepdim=True)


def example_shares(mode: Broadcasts, shares: Dict[int, Tensor], params: List[nn.Parameter]
                   ) -> List[Optional[Tensor]]:
    """``[x_i(theta) for theta in params]`` (``[N, *theta.shape]``, ``None`` where no expanded
    tensor depends on ``theta``) from ``shares`` (``{k: summed_per_example}`` of the ``k``-th
    operand expanded), through the operands computed again (module docstring)."""
    with torch.enable_grad():
        again = mode.replay()
        found: List[Optional[Tensor]] = [None] * len(params)
        for k, share in shares.items():
            operand, shape = mode.operands[k]
            operand = again.get(id(operand), operand).reshape(shape)
            grads = torch.autograd.grad(operand, params, share.to(operand.dtype), retain_graph=True,
                                        is_grads_batched=True, allow_unused=True)
            found = [g if x is None else x if g is None else x + g for x, g in zip(found, grads)]
    return found
