"""Window attention's layers: per-example results from the batch's own pass, where the rows' map is proven.

Swin's blocks (``transformers``' ``SwinLayer``) take ``[N, H*W, C]`` and return it, but
run their attention on windows, ``[N*W, t, C]`` (``window_partition`` of each example's
grid, padded to a multiple of the window and rolled within it for the shifted variant):
the rows are a fixed regrouping of the batch, window ``r`` being example ``r // W``'s.
:mod:`.blocks` recomputes such a block per example. Where every layer it computes is
either an ``nn.Linear`` on those rows (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) or a
module called without a tensor input whose output, ``[1, ...]``, is broadcast over them
(``SwinRelativePositionBias``: the table gathered into ``[1, heads, t, t]``), each
example's contribution comes from the batch's own backward pass instead, with ``G_r`` the
gradient at a layer's output rows and ``a_r`` its input rows:

.. math::

    x_i(W) = \\sum_{r:\\, r // W = i} G_r^{\\top} a_r, \\qquad
    x_i(b) = \\sum_{r:\\, r // W = i} \\mathbf{1}^{\\top} G_r, \\qquad
    x_i(\\theta) = J_\\theta^{\\top} \\sum_{r:\\, r // W = i} D_r,

the Linear rule's own formulas on the rows regrouped as ``[N, W*t, C]``
(:func:`.linear.linear_weight_sums_and_squared_norms`, the bias with its structural zeros:
Swin's key bias, :func:`.sums.position_sums`); ``D_r`` the gradient at row ``r`` of the
position bias's output, made per row in the batch's pass by returning it expanded to the
``N*W`` rows (a view: the same numbers reach every window), and ``J_theta`` the Jacobian
of that module's output with respect to its parameters (one vector-Jacobian product per
example). No forward pass per example.

The map is proven, not assumed, once per shape of the block's inputs, at its first tracked
step, by NaN-poisoned passes of the block (:func:`.window_map.proven`).
Where any fails (windows that mix examples, another order of the windows), the block is
recomputed per example, as before, for good. On the first step with the fast way, the block
is also recomputed per example and both ways' per-example squared norms must agree
(:data:`CONFIRM`, as :mod:`.experts`); and every step, the contributions must add up to
each parameter's gradient (:func:`.blocks.reached_otherwise`).
Two more kinds of member: a plain ``nn.LayerNorm`` on the rows (OPT's ``final_layer_norm``
on the flattened tokens, ``x_i(gamma) = sum_r G_r * x_hat_r``, ``x_i(beta) = sum_r G_r``,
:func:`.normalization.layer_norm_contributions` on ``[N, L, C]``); and a module with
parameters of its own and children (*direct*: SwinV2's attention, its ``logit_scale`` and
position-bias MLP), whose tensors computed from its parameters alone are expanded to the rows
where they meet them (:mod:`.broadcast`), the members called inside it on such tensors (the
MLP's layers) its own. A block's per-example integer inputs (OPT's ``position_ids``) cannot be
set to NaN: they are kept as they are in the poisoned passes, and their values are part of the
proof (a call with others is proven again before its rows are used).
A member ``nn.Linear`` its parent never calls but whose weight it passes to ``F.linear`` itself
(:data:`.window_map.FUNCTIONAL`, found by the survey: torchvision's ``ShiftedWindowAttention``,
which takes ``[N, H, W, C]`` and cuts the windows itself, is then its own block; timm's SwinV2
``qkv``) has that call for its call: the parent's :class:`.Broadcasts` hands its input and output
over (:func:`_functional`), and the parent's rows are that call's. The Linear formulas above
apply; a bias the parent computed from batch-free tensors (timm's ``cat(q_bias, k_bias, v_bias)``,
torchvision's SwinV2 copy of ``qkv.bias`` with the key third zeroed) is one more of the parent's
broadcast operands, its share per example the call's output gradient summed over the example's
rows and positions (:func:`_linear_bias_shares`), taken back to the parameters it was computed from
with the tables. Why the batch's pass and not ``vmap`` over the windows: the rows' input and output
gradient are already there, so the Linear's contributions cost one product per layer (what its rule
costs), where a batched replay would run the attention's forward and backward pass once more.
Tests: ``tests/test_swin_windows.py``, ``tests/test_swin_windows_torchvision.py``.
"""

import functools
from typing import Dict, List

from cockpit_gradnoise.extensions.fallback.broadcast import Broadcasts, example_shares, summed_per_example
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters, hooks_off
from cockpit_gradnoise.extensions.fallback.reduce import linear_on_rows, norms_and_sums, squared_norms_agree
from cockpit_gradnoise.extensions.fallback.window_map import (
    DIRECT,
    LINEAR,
    NORM,
    ON_ROWS,
    Windows,
    functional_call,
    kind,
    linear_call,
    member_rows,
    parent_call,
    parents,
    proven,
    shapes,
    table_call,
    tensor_inputs,
)
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.normalization import layer_norm_contributions
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD, SUMS_SAVEFIELD

import torch
from torch import Tensor, nn
from torch.utils import _pytree

#: The attribute (in the block's and its layers' ``__dict__``) of the :class:`Windows` state.
ATTRIBUTE = "_cgn_window_rows"
#: The attribute (in a layer's ``__dict__``) saying its capture hook is registered.
INSTALLED = "_cgn_window_rows_installed"
#: The attribute (in the block's ``__dict__``) saying its hook is registered.
RESET_INSTALLED = "_cgn_window_rows_reset_installed"
#: The attribute (in a table's parent's ``__dict__``) saying its hook is registered.
PARENT_INSTALLED = "_cgn_window_rows_parent_installed"
#: Whether a block's first step with the fast way also recomputes it per example and compares
#: (module docstring). A setting for tests and measurements, not per-pass state.
CONFIRM = True

def _state(block: nn.Module) -> Windows:
    state = block.__dict__.get(ATTRIBUTE)
    if state is None:
        state = block.__dict__[ATTRIBUTE] = Windows()
    return state


def _keep(store: Dict[int, Tensor], key: int, grad: Tensor) -> None:
    store[key] = grad.detach()


def _capture(module, args, kwargs, output):
    """Forward hook of a member in the batch's pass: keep its rows' input and output gradient
    (a table: its output expanded to the rows, and that view's gradient)."""
    state = module.__dict__.get(ATTRIBUTE)
    if state is None or not state.maps.get(state.shapes) or state.failed or idle(module) \
            or not torch.is_grad_enabled():
        return None  # (a shape not proven yet: its forward pass as it is, tables not expanded)
    found = kind(module)
    if found == DIRECT:
        return None  # (its own hooks: _enter, _leave)
    if found in ON_ROWS and state.mode is not None and state.mode.is_free(tensor_inputs(args, kwargs)[0]):
        state.calls[id(module)] = state.calls.get(id(module), 0) + 1  # inside a DIRECT member's tables
        state.table_calls.add(id(module))
        return None
    if found in ON_ROWS:
        linear_call(state, module, args, kwargs, output)
        if not state.broken and output.requires_grad:
            state.inputs[id(module)] = tensor_inputs(args, kwargs)[0].detach()
            output.register_hook(functools.partial(_keep, state.grads, id(module)))
        return None
    expanded = table_call(state, module, args, kwargs, output)
    if expanded is None or not expanded.requires_grad:
        return None
    expanded.register_hook(functools.partial(_keep, state.grads, id(module)))
    return expanded


def _rows_from_parent(module, args, kwargs):
    state = module.__dict__.get(ATTRIBUTE)
    if state is not None and state.maps.get(state.shapes) and not state.failed and not idle(module) \
            and torch.is_grad_enabled():
        parent_call(state, args, kwargs)


def _reset(block, args, kwargs):
    state = block.__dict__.get(ATTRIBUTE)
    if state is not None:
        leaves = _pytree.tree_leaves((args, kwargs))
        state.reset(shapes(leaves))
        state.examples = next((leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim()), None)


def _table_parameters(state: Windows, module: nn.Module) -> List[nn.Parameter]:
    """A DIRECT member's parameters computed from its batch-free tensors: its own, those of
    the members called inside it on batch-free inputs, and the bias of a layer it passes to
    ``F.linear`` where it gives a bias computed from it (torchvision's SwinV2: a copy of ``qkv``'s
    with the key third zeroed)."""
    found = list(direct_parameters(module).values())
    for sub in module.modules():
        if id(sub) in state.table_calls:
            found += list(direct_parameters(sub).values())
    for _, layer in state.modes[id(module)].linear_biases:
        bias = layer.bias
        if bias is not None and bias.requires_grad and all(bias is not p for p in found):
            found.append(bias)
    return found


def _linear_bias_shares(state: Windows, module: nn.Module, examples: int) -> Dict[int, Tensor]:
    """``{k: [N, 1, out]}``: the share of each bias a DIRECT member computed and gave ``F.linear``
    (operand ``k``, :attr:`.Broadcasts.linear_biases`), the gradient at that call's output summed
    over the example's rows and positions."""
    shares = {}
    for k, layer in state.modes[id(module)].linear_biases:
        grad = state.grads[id(layer)]
        rows = grad.flatten(1, -2).sum(1) if grad.dim() > 2 else grad  # [N*W, out]
        shares[k] = summed_per_example(rows, examples)
    return shares


def _share(state: Windows, module: nn.Module, k: int, grad: Tensor) -> None:
    """Tensor hook on a batch-free tensor expanded to the rows: its gradient summed per example."""
    shares = state.shares.setdefault(id(module), {})
    summed = summed_per_example(grad.detach(), state.examples)
    shares[k] = summed + shares[k] if k in shares else summed


def _expand_hooked(state: Windows, module: nn.Module, k: int, expanded: Tensor) -> Tensor:
    if expanded.requires_grad:
        expanded.register_hook(functools.partial(_share, state, module, k))
    return expanded


def _functional(state: Windows, layer: nn.Module, x: Tensor, output: Tensor, own_bias: bool) -> None:
    """A FUNCTIONAL member's call (its weight at ``F.linear`` in a DIRECT member's call): as
    :func:`_capture` keeps a Linear's rows."""
    functional_call(state, layer, x)
    if not state.broken and output.requires_grad:
        state.inputs[id(layer)], state.own_bias[id(layer)] = x.detach(), own_bias
        output.register_hook(functools.partial(_keep, state.grads, id(layer)))


def _enter(module, args, kwargs):
    """A DIRECT member's call in the batch's pass: its batch-free tensors expanded to its rows."""
    state = module.__dict__.get(ATTRIBUTE)
    if state is None or not state.maps.get(state.shapes) or state.failed or idle(module) \
            or not torch.is_grad_enabled() or state.mode is not None:
        return
    linears = member_rows(state, module, args, kwargs)
    if state.broken or state.examples is None:
        return
    state.mode = Broadcasts(module, state.rows, functools.partial(_expand_hooked, state, module), linears,
                            functools.partial(_functional, state))
    state.mode.__enter__()


def _leave(module, args, kwargs, output):
    state = module.__dict__.get(ATTRIBUTE)
    if state is None or state.mode is None:
        return
    mode, state.mode = state.mode, None
    mode.__exit__(None, None, None)
    state.calls[id(module)] = state.calls.get(id(module), 0) + 1
    state.modes[id(module)] = mode
    state.broken = state.broken or mode.broken or not mode.operands or state.rows is None \
        or state.rows % state.examples != 0


def _install(block: nn.Module, members: List[nn.Module], state: Windows) -> None:
    block.__dict__[ATTRIBUTE] = state
    if not block.__dict__.get(RESET_INSTALLED):  # first: a table's parent may be the block itself
        block.__dict__[RESET_INSTALLED] = True
        block.register_forward_pre_hook(eager_under_compile(_reset), with_kwargs=True)
    for parent in parents(block, members):
        parent.__dict__[ATTRIBUTE] = state
        if not parent.__dict__.get(PARENT_INSTALLED):
            parent.__dict__[PARENT_INSTALLED] = True
            parent.register_forward_pre_hook(eager_under_compile(_rows_from_parent), with_kwargs=True)
    for module in members:
        module.__dict__[ATTRIBUTE] = state
        if not module.__dict__.get(INSTALLED):
            module.__dict__[INSTALLED] = True
            module.register_forward_hook(eager_under_compile(_capture), with_kwargs=True)
            if kind(module) == DIRECT:
                module.register_forward_pre_hook(eager_under_compile(_enter), with_kwargs=True)
                module.register_forward_hook(eager_under_compile(_leave), with_kwargs=True, always_call=True)


#: How many calls' integer inputs are kept per shape (:attr:`Windows.integers`): a model whose
#: position ids change every step proves its map every step (its rows still from the batch's pass).
INTEGERS_KEPT = 4


def _equal(tensors: List[Tensor], others: List[Tensor]) -> bool:
    return len(tensors) == len(others) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, others))


def _prove(state: Windows, key: tuple, integers: List[Tensor], block: nn.Module, call, batched: List[int],
           members: List[nn.Module], output: Tensor) -> bool:
    """:func:`proven` for this call, noted: for good where it fails, with the call's per-example
    integer inputs (which the NaN passes keep as they are) where it holds."""
    try:
        state.maps[key] = proven(block, call, batched, members, output)
    except Exception:  # noqa: BLE001 - a block the poisoned passes cannot run: recomputed
        state.maps[key] = False
    state.failed = not state.maps[key]
    if state.maps[key]:
        kept = state.integers.setdefault(key, [])
        kept.append([tensor.clone() for tensor in integers])
        del kept[:-INTEGERS_KEPT]
    return state.maps[key]


def _with_block(block: nn.Module, members: List[nn.Module]) -> List[nn.Module]:
    """``members``, and the block itself where it is *direct* (SwinV2's attention as the block, where
    a stage has one window per example: its members the position-bias MLP's layers, on the table)."""
    return members + [block] if kind(block) == DIRECT and all(m is not block for m in members) else members


def results(block: nn.Module, call, batched: List[int], members: List[nn.Module], output: Tensor, grad: Tensor,
            params: Dict[str, nn.Parameter], savefields) -> Dict[str, Dict[str, Tensor]]:
    """``{savefield: {name: result}}`` of every parameter of ``params`` (``{name: param}`` of the
    block's members), from the batch's pass; empty where the fast way cannot give all of them
    (a member of another kind, a map not proven, a call it does not know). At a block's first
    tracked step of a shape, the map is proven (and the capture installed) and this step is
    left to the recomputation."""
    state = _state(block)
    members = _with_block(block, members)
    owned = {id(p) for m in members for p in direct_parameters(m).values()}
    if state.failed or not members or any(kind(m) is None for m in members) \
            or any(id(p) not in owned for p in params.values()) or output.shape[0] != grad.shape[0]:
        return {}
    key = shapes(call.leaves)
    integers = [call.leaves[k] for k in batched if not call.leaves[k].is_floating_point()]
    if key not in state.maps:
        if _prove(state, key, integers, block, call, batched, members, output):
            _install(block, members, state)
        return {}
    try:
        if not state.maps[key] or state.shapes != key or state.broken or state.rows is None \
                or any(state.calls.get(id(m)) != 1 or not _kept(state, m) for m in members):
            return {}
        if not any(_equal(integers, known) for known in state.integers.get(key, ())) \
                and not _prove(state, key, integers, block, call, batched, members, output):
            return {}  # (new integer inputs: this call proven, its rows kept used at once)
        return _results(state, members, grad.shape[0], params, savefields)
    except Exception:  # noqa: BLE001 - a layer it cannot reduce: the block is recomputed this step
        return {}
    finally:
        state.reset()


def _norm_results(module: nn.LayerNorm, a: Tensor, g: Tensor, squares: bool) -> Dict[str, tuple]:
    """``{param name: (||x_i||^2, sums)}`` of a LayerNorm on rows ``[N, L, *normalized_shape]``:
    ``x_i(gamma) = sum_l G_il * x_hat_il``, ``x_i(beta) = sum_l G_il`` (:mod:`..normalization`)."""
    found = {}
    for name in ("weight", "bias"):
        param = getattr(module, name)
        if param is not None and param.requires_grad:
            norms, sums = norms_and_sums(layer_norm_contributions(module, a, g, name))
            found[name] = (norms, sums if squares else sums[:1])
    return found


def _table_results(module: nn.Module, grad: Tensor, examples: int, squares: bool) -> Dict[str, tuple]:
    """``{param name: (||x_i||^2, sums)}`` of a table from its output's per-row gradient ``[N*W, ...]``."""
    per_example = grad.reshape(examples, -1, *grad.shape[1:]).sum(1).unsqueeze(1)  # [N, 1, ...]
    params = direct_parameters(module)
    with torch.enable_grad(), hooks_off(module):
        out = module()
    found = torch.autograd.grad(out, list(params.values()), per_example.to(out.dtype), is_grads_batched=True,
                                allow_unused=True)
    results = {}
    for (name, param), x in zip(params.items(), found):
        x = torch.zeros(examples, *param.shape, dtype=param.dtype, device=param.device) if x is None else x
        norms, sums = norms_and_sums(x)
        results[name] = (norms, sums if squares else sums[:1])
    return results


def _kept(state: Windows, member: nn.Module) -> bool:
    """Whether the batch's pass left what ``member``'s results need."""
    return id(member) in state.grads or id(member) in state.table_calls or id(member) in state.modes


def _member_results(state: Windows, module: nn.Module, examples: int, squares: bool) -> Dict[int, tuple]:
    """``{id(param): (||x_i||^2, sums)}`` of a member's parameters (a DIRECT member's: of its tables)."""
    if kind(module) == DIRECT:
        table = _table_parameters(state, module)
        shares = {**state.shares.get(id(module), {}), **_linear_bias_shares(state, module, examples)}
        shares = example_shares(state.modes[id(module)], shares, table)
        found = {}
        for param, x in zip(table, shares):
            norms, sums = norms_and_sums(param.new_zeros(examples, *param.shape) if x is None else x)
            found[id(param)] = (norms, sums if squares else sums[:1])
        return found
    grad = state.grads[id(module)]
    if kind(module) == LINEAR:
        a = state.inputs[id(module)]
        # (a FUNCTIONAL layer's bias: where its call added it; a bias computed from it, the DIRECT member's)
        bias = module.bias is not None and module.bias.requires_grad and state.own_bias.get(id(module), True)
        found = linear_on_rows(a.reshape(examples, -1, a.shape[-1]), grad.reshape(examples, -1, grad.shape[-1]),
                               bias, squares)
    elif kind(module) == NORM:
        shape, a = tuple(module.normalized_shape), state.inputs[id(module)]
        found = _norm_results(module, a.reshape(examples, -1, *shape), grad.reshape(examples, -1, *shape), squares)
    else:
        found = _table_results(module, grad, examples, squares)
    return {id(getattr(module, attribute)): result for attribute, result in found.items()}


def _results(state: Windows, members: List[nn.Module], examples: int, params: Dict[str, nn.Parameter],
             savefields) -> Dict[str, Dict[str, Tensor]]:
    squares = SUMS_SAVEFIELD in savefields
    names = {id(p): name for name, p in params.items()}
    out = {savefield: {} for savefield in savefields}
    for module in members:
        if id(module) in state.table_calls:
            continue  # (its DIRECT member's)
        for key, (norms, sums) in _member_results(state, module, examples, squares).items():
            if key not in names:
                continue
            here = {BATCH_L2_SAVEFIELD: norms, SUMS_SAVEFIELD: sums, LOCAL_GRADIENT_SAVEFIELD: sums[0]}
            for savefield in savefields:
                out[savefield][names[key]] = here[savefield]
    if any(len(found) != len(params) for found in out.values()):
        return {}
    return out


def confirmed(block: nn.Module, fast: Dict[str, Dict[str, Tensor]], recomputed: Dict[str, Dict[str, Tensor]],
              eps: float) -> bool:
    """On a block's first step with both ways: whether the per-example squared norms agree (to
    ``sqrt(eps)`` of the largest), noted for good (a failure recomputes the block for good)."""
    state = block.__dict__.get(ATTRIBUTE)
    if state is None or state.failed:
        return False
    if state.verified is None and CONFIRM:
        state.verified = squared_norms_agree(fast, recomputed, eps)
        state.failed = not state.verified
    return not state.failed


def settled(block: nn.Module, fast: Dict[str, Dict[str, Tensor]], params: Dict[str, nn.Parameter]) -> bool:
    """Whether ``fast`` (:func:`results`) holds every parameter of ``params`` and ``block``'s fast way
    needs no recomputation to compare with (compared before, or :data:`CONFIRM` off) and has not
    failed: the block's results are ``fast`` alone."""
    state = block.__dict__.get(ATTRIBUTE)
    names = fast.get(BATCH_L2_SAVEFIELD, {})
    return state is not None and not state.failed and not confirming(block) and bool(names) \
        and all(name in names for name in params)


def confirming(block: nn.Module) -> bool:
    """Whether ``block``'s fast way is still to be compared with the per-example recomputation."""
    state = block.__dict__.get(ATTRIBUTE)
    return CONFIRM and state is not None and state.verified is None
