"""Window attention's rows: which member is what, the rows of its call, and the map's proof.

:mod:`.windows` computes a block's members (``nn.Linear`` and ``nn.LayerNorm`` on rows
``[N*W, ...]``, tables broadcast over them, *direct* members with batch-free tensors,
:func:`kind`) from the batch's own pass, row ``r`` taken for example ``r // W``'s.
The map is proven, not assumed (:func:`proven`, once per shape of the block's inputs, at
its first tracked step): the block is run (no gradient, hooks off) on its inputs with the
examples of a set ``P`` set to NaN, for ``P`` each half of the batch by each bit of the
example's index (``2 ceil(log2 N)`` passes), and must show, in every pass, each layer's
input and output row ``r`` NaN exactly where ``r // W`` is in ``P``, the position bias's
expanded rows (NaN on ``P``'s) reach no output row outside ``P``, and no output row
outside ``P`` NaN. A row that depended on another example's input, or an output that
depended on another example's rows, would be NaN in a pass that poisons that example but
not its own; so each example's loss reaches only its own rows. And the block run with the
bias expanded must give the batch's output (to ``sqrt(eps)`` of its largest magnitude).
Until a shape of the block's inputs is proven, its forward pass runs as it is (no table
expanded, nothing kept), and a step the fast way cannot reduce is recomputed. A
:data:`FUNCTIONAL` member's call is its parent's ``F.linear`` with its weight: the proof's passes
see its input and output rows there (:meth:`_Proof.linear`).
Tests: ``tests/test_swin_windows.py``.
"""

import math
from typing import Dict, List, Optional

from cockpit_gradnoise.extensions.fallback.broadcast import Broadcasts
from cockpit_gradnoise.extensions.fallback.capture import first_tensor
from cockpit_gradnoise.extensions.fallback.layout import state_kept
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters, hooks_off

import torch
from torch import Tensor, nn
from torch.utils import _pytree

LINEAR, NORM, TABLE, DIRECT = "linear", "norm", "table", "direct"
#: The kinds computed from their own rows' input and output gradient.
ON_ROWS = (LINEAR, NORM)
#: The attribute (in an ``nn.Linear``'s ``__dict__``) saying the survey saw its parent pass its
#: weight to ``F.linear`` on rows that are not examples, never calling it (torchvision's Swin,
#: timm's SwinV2: :mod:`.regroup`): a member whose call is that ``F.linear`` (:mod:`.broadcast`).
FUNCTIONAL = "_cgn_window_functional"


class Windows:
    """A block's proven maps and what its last forward and backward pass left."""

    def __init__(self):
        self.maps: Dict[tuple, bool] = {}  # shape of the inputs -> the map proven
        # shape of the inputs -> the per-example integer inputs (OPT's position_ids) of the
        # calls proven: their values, which no NaN can mark, are part of a proof.
        self.integers: Dict[tuple, List[List[Tensor]]] = {}
        self.failed = False  # a map or the confirmation failed: recomputed for good
        self.verified: Optional[bool] = None  # the confirmation against the recomputation
        self.reset()

    def reset(self, shapes: Optional[tuple] = None) -> None:
        self.shapes = shapes  # of this block call's tensor inputs: its map proven, or not
        self.rows: Optional[int] = None  # N*W of this block call
        self.broken = False  # a call the fast way does not know (noted by the hooks)
        self.calls: Dict[int, int] = {}
        self.inputs: Dict[int, Tensor] = {}
        self.grads: Dict[int, Tensor] = {}
        self.own_bias: Dict[int, bool] = {}  # id(FUNCTIONAL layer) -> whether its call added its own bias
        self.examples: Optional[int] = None  # N of this block call
        self.mode: Optional[Broadcasts] = None  # during a DIRECT member's call
        self.table_calls: set = set()  # members called on batch-free inputs inside it (SwinV2's MLP)
        self.modes: Dict[int, Broadcasts] = {}  # id(DIRECT member) -> what its call recorded
        self.shares: Dict[int, Dict[int, Tensor]] = {}  # id(DIRECT member) -> {k: k-th expanded's, per example}

    def __reduce__(self):  # a copy of the model proves its maps again
        return (Windows, ())


def kind(module: nn.Module) -> Optional[str]:
    """How the fast way computes ``module``: a plain ``nn.Linear``; a plain ``nn.LayerNorm`` (OPT's
    ``final_layer_norm`` on the flattened tokens); a module without children with parameters
    (called, :func:`proven` checks, without a tensor input: a table); else ``None``."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return LINEAR
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        return NORM
    if direct_parameters(module) and not any(True for child in module.children() for _ in child.parameters()):
        return TABLE
    if direct_parameters(module):  # (SwinV2's attention: its logit_scale, its position-bias MLP)
        return DIRECT
    return None


def tensor_inputs(args, kwargs) -> List[Tensor]:
    return [leaf for leaf in _pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]


def linear_call(state: Windows, module, args, kwargs, output) -> None:
    """A Linear's or LayerNorm's call: its rows (``N*W``, the same for every member), input and output."""
    inputs = tensor_inputs(args, kwargs)
    state.calls[id(module)] = state.calls.get(id(module), 0) + 1
    if len(inputs) != 1 or not isinstance(output, Tensor) or inputs[0].dim() < 2 \
            or state.rows not in (None, inputs[0].shape[0]):
        state.broken = True
        return
    state.rows = inputs[0].shape[0]


def functional_layers(module: nn.Module) -> Dict[int, nn.Module]:
    """``{id(weight): layer}`` of the layers inside ``module`` whose weight it passes to ``F.linear``
    itself (:data:`FUNCTIONAL`): their calls are those ``F.linear`` calls (:class:`.Broadcasts`)."""
    return {id(sub.weight): sub for sub in module.modules() if sub.__dict__.get(FUNCTIONAL)}


def functional_call(state: Windows, layer: nn.Module, x: Tensor) -> None:
    """A :data:`FUNCTIONAL` layer's call (its weight at ``F.linear``): counted, its rows those of ``x``."""
    state.calls[id(layer)] = state.calls.get(id(layer), 0) + 1
    if state.rows not in (None, x.shape[0]):
        state.broken = True
        return
    state.rows = x.shape[0]


def member_rows(state: Windows, module: nn.Module, args, kwargs) -> Dict[int, nn.Module]:
    """A DIRECT member's call: its :func:`functional_layers`; where it has none, its rows are
    those of its first tensor input (:func:`parent_call`), else those of the first ``F.linear``
    call with one of their weights (torchvision's attention takes ``[N, H, W, C]`` and cuts it
    into windows itself)."""
    linears = functional_layers(module)
    if not linears:
        parent_call(state, args, kwargs)
    return linears


def parent_call(state: Windows, args, kwargs) -> None:
    """A table's parent's call (``SwinAttention``): its first tensor input leads with the rows."""
    inputs = tensor_inputs(args, kwargs)
    rows = inputs[0].shape[0] if inputs and inputs[0].dim() else None
    if rows is None or state.rows not in (None, rows):
        state.broken = True
        return
    state.rows = rows


def table_call(state: Windows, module, args, kwargs, output) -> Optional[Tensor]:
    """A table's call: its output ``[1, ...]`` expanded to the rows of its parent's call (those
    of its Linear siblings; where they are examples, one window each, only the table is a member)."""
    state.calls[id(module)] = state.calls.get(id(module), 0) + 1
    if tensor_inputs(args, kwargs) or not isinstance(output, Tensor) or output.dim() < 1 \
            or output.shape[0] != 1 or state.rows is None:
        state.broken = True
        return None
    return output.expand(state.rows, *output.shape[1:])


def parents(block: nn.Module, members: List[nn.Module]) -> List[nn.Module]:
    """The parents (inside ``block``) of its table members."""
    tables = {id(m) for m in members if kind(m) == TABLE}
    return list({id(parent): parent for parent in block.modules()
                 for child in parent.children() if id(child) in tables}.values())


def shapes(leaves) -> tuple:
    """The shapes of a block call's tensor inputs: a proof holds for them."""
    return tuple(tuple(leaf.shape) for leaf in leaves if isinstance(leaf, Tensor))


def _nan_rows(tensor: Tensor) -> Tensor:
    return tensor.isnan().reshape(tensor.shape[0], -1).any(1)


def _poisoned_rows(expanded: Tensor, poisoned: Tensor, rows: int) -> Tensor:
    """A copy of ``expanded`` (``[N*W, ...]``) NaN on the rows of the examples ``poisoned``."""
    expanded = expanded.clone()
    expanded[poisoned.repeat_interleave(rows // len(poisoned)).to(expanded.device)] = math.nan
    return expanded


class _Proof:
    """The hooks of one NaN-poisoned pass (:func:`_run_poisoned`): what each member saw."""

    def __init__(self, members: List[nn.Module], poisoned: Tensor):
        self.seen: Dict[nn.Module, list] = {m: [] for m in members}
        self.state, self.poisoned = Windows(), poisoned

    def poison(self, k: int, expanded: Tensor) -> Tensor:
        if self.state.rows is None or self.state.rows % len(self.poisoned):
            self.state.broken = True
            return expanded
        return _poisoned_rows(expanded, self.poisoned, self.state.rows)

    def enter(self, module, args, kwargs):
        linears = member_rows(self.state, module, args, kwargs)
        if self.state.mode is None and not self.state.broken:
            self.state.mode = Broadcasts(module, self.state.rows, self.poison, linears, self.linear)
            self.state.mode.__enter__()

    def linear(self, layer, x, out, own_bias):
        functional_call(self.state, layer, x)
        if layer not in self.seen:  # (not a member: the fast way does not know its rows)
            self.state.broken = True
        elif not self.state.broken:
            self.seen[layer].append((_nan_rows(x), _nan_rows(out)))

    def leave(self, module, args, kwargs, output):
        state = self.state
        if state.mode is not None:
            mode, state.mode = state.mode, None
            mode.__exit__(None, None, None)
            state.broken = state.broken or mode.broken or not mode.operands
            self.seen[module].append(None)

    def observe(self, module, args, kwargs, output):
        state, found = self.state, kind(module)
        if found == DIRECT:
            return None
        if found in ON_ROWS and state.mode is not None and state.mode.is_free(tensor_inputs(args, kwargs)[0]):
            self.seen[module].append(None)  # (inside a DIRECT member's tables)
            return None
        if found in ON_ROWS:
            linear_call(state, module, args, kwargs, output)
            if not state.broken:
                self.seen[module].append((_nan_rows(tensor_inputs(args, kwargs)[0]), _nan_rows(output)))
            return None
        expanded = table_call(state, module, args, kwargs, output)
        if expanded is None or state.rows % len(self.poisoned):
            state.broken = True
            return None
        self.seen[module].append(None)
        return _poisoned_rows(expanded, self.poisoned, state.rows)


def _run_poisoned(block: nn.Module, call, batched: List[int], members: List[nn.Module],
                  poisoned: Tensor) -> Optional[tuple]:
    """The block run on its inputs with the examples ``poisoned`` (``[N]`` bool) set to NaN and
    each table's output expanded to the rows (NaN on the poisoned examples' rows): ``(rows,
    {member: [(input rows NaN, output rows NaN)]}, first output)``; ``None`` where it cannot."""
    examples = len(poisoned)
    leaves = list(call.leaves)
    floating = [k for k in batched if leaves[k].is_floating_point()]
    if not floating:  # (integer inputs kept as they are: their values are part of the proof)
        return None
    for k in floating:
        leaves[k] = leaves[k].clone()
        leaves[k][poisoned.to(leaves[k].device)] = math.nan
    args, kwargs = _pytree.tree_unflatten(leaves, call.spec)
    proof = _Proof(members, poisoned)
    state, seen = proof.state, proof.seen
    devices = sorted({leaf.device.index or 0 for leaf in leaves if isinstance(leaf, Tensor) and leaf.is_cuda})
    with hooks_off(block), state_kept(block, devices), torch.no_grad():
        handles = [m.register_forward_hook(proof.observe, with_kwargs=True) for m in members]
        for direct in (m for m in members if kind(m) == DIRECT):
            handles += [direct.register_forward_pre_hook(proof.enter, with_kwargs=True),
                        direct.register_forward_hook(proof.leave, with_kwargs=True, always_call=True)]
        handles += [parent.register_forward_pre_hook(lambda module, args, kwargs: parent_call(state, args, kwargs),
                                                     with_kwargs=True) for parent in parents(block, members)]
        try:
            output = block(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
    first = first_tensor(output)
    if state.broken or state.rows is None or state.rows % examples or first is None \
            or any(len(calls) != 1 for calls in seen.values()):
        return None
    return state.rows, seen, first


def proven(block: nn.Module, call, batched: List[int], members: List[nn.Module], output: Tensor) -> bool:
    """Whether row ``r`` of every member's ``N*W`` rows is example ``r // W``'s alone, and the block
    with its tables expanded gives ``output`` (module docstring)."""
    examples = output.shape[0]
    clean = _run_poisoned(block, call, batched, members, torch.zeros(examples, dtype=torch.bool))
    if clean is None or clean[2].shape != output.shape or not float(
            (clean[2] - output).abs().max()) <= math.sqrt(torch.finfo(output.dtype).eps) * float(output.abs().max()):
        return False
    owners = torch.arange(examples)
    for bit in range(max(1, (examples - 1).bit_length())):
        for polarity in (0, 1):
            poisoned = (owners >> bit) % 2 == polarity
            if poisoned.all() or not poisoned.any():
                continue
            found = _run_poisoned(block, call, batched, members, poisoned)
            if found is None:
                return False
            rows, seen, first = found
            expected = poisoned.repeat_interleave(rows // examples).to(first.device)
            if first.shape[0] != examples or bool((_nan_rows(first) & ~poisoned.to(first.device)).any()):
                return False
            for calls in seen.values():
                if calls[0] is not None and not all(torch.equal(nan, expected) for nan in calls[0]):
                    return False
    return True
