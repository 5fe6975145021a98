"""Mixture-of-experts blocks in ``transformers``' 3-D layout: per-example results from the batch's pass.

A block recomputed per example (:mod:`.blocks`) runs its forward pass and its
backward pass once more per example. The experts modules that
``transformers`` builds with ``@use_experts_implementation`` (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, DeepSeek-V3, GPT-OSS and some sixty
families in 5.x) share one computation, told by the attributes the decorator
sets (``has_gate``, ``has_bias``, ``is_transposed``): on tokens ``x_t``
(``[M, H]``), each routed to ``k`` experts ``e_ts`` with weights ``w_ts``,

.. math::

    h = W^{\\uparrow}_e x_t (+ b^{\\uparrow}_e), \\quad u = \\mathrm{gate}(h), \\quad
    y_{ts} = W^{\\downarrow}_e u (+ b^{\\downarrow}_e), \\quad
    \\mathrm{out}_t = \\sum_s w_{ts}\\, y_{ts},

``gate`` the module's own ``_apply_gate`` (``act_fn(gate) * up``; GPT-OSS's
clamped one) or ``act_fn`` without a gate. With ``G_t`` the gradient of the
batch's loss at ``out_t`` (kept by a tensor hook on the experts' output), each
routed row ``r = (t, s)`` of expert ``e`` contributes the outer products
``(w_ts G_t) u_r^T`` to ``W^down_e`` and ``dh_r x_t^T`` to ``W^up_e`` (``dh_r``
the vector-Jacobian product of ``gate`` at ``h_r`` with ``w_ts W^down_e^T G_t``),
and those factors to the biases; example ``i``'s contribution sums the rows of
its tokens, ``x_i(W_e) = sum_{r of i} b_r a_r^T``. Per expert, each example's
``x_i`` is one product of its own rows, squared and added to
``[sum_i x_i, sum_i x_i**2]`` while in the cache (:func:`formed_sums_and_norms`):
one example's gradient of one expert at a time, never every expert's. Where
the sums of squares are not asked for (``PerExampleGradNorm`` and
``GradientNoiseScale`` alone), no ``x_i`` is formed: the norms come from Gram
matrices, ``||x_i||^2 = sum_{r,r'} (b_r . b_r') (a_r . a_r')``
(:func:`gradient_and_gram_norms`). Units as every rule's: the output gradient
holds the loss's ``1/N``, so ``x_i`` is the contribution ``c g_i``.

The router: a child of the block whose trainable parameters are one 2-D weight and
perhaps a bias (:func:`router_parameters`), called with the token rows first (any
other input, a bias buffer, passed again as it was), whose first output is
``F.linear`` of those rows and two others the routing weights and indices the
experts got (the very tensors): its logits' gradient *through the
experts* is the vector-Jacobian product of the router run again on the rows
at ``dL/dw_ts = G_t . y_ts = (W^down_e^T G_t) . u_r (+ G_t . b^down_e)``, and
``x_i(W) = sum_{t of i} dlogits_t x_t^T`` (in the wider of the logits' and the rows'
dtypes). Whatever the router does between its logits and its weights goes through
that vector-Jacobian product: softmax then top-k (Mixtral, Qwen, OLMoE, Jamba), top-k
then softmax (GraniteMoE), DeepSeek-V3's sigmoid scores with group-limited,
bias-corrected top-k. A router that computes its logits in float32 inside a float64
model (GraniteMoE's ``.float()``, DeepSeek-V3's ``weight.type(torch.float32)``) is
compared with ``F.linear`` of the rows at float32's rounding. A term of the loss that
reaches the router otherwise (the auxiliary load-balancing loss) is not in it, so the
check that the contributions add up to the gradient (:func:`.blocks.reached_otherwise`)
leaves the router out by name, as before. The block's shared experts (``nn.Linear`` layers:
Qwen2-MoE's shared expert and its gate, DeepSeek-V3's shared experts) get theirs from one pass
of the block on the batch (:mod:`.shared`); any other parameter keeps the per-example
recomputation, for its parameters only.

Which token is whose: one of the block's per-example inputs (``[N, T, H]``) must
be, exactly, the experts' rows (``view(-1, H)``, as the blocks of ``transformers``
flatten it): token ``t`` is then example ``t // T``'s. Never a silently wrong
number: on the experts' first call the reimplemented output must equal the
module's own (to ``sqrt(eps)`` of its largest magnitude,
:func:`.precision.rounding_bound`), and on a block's first tracked step the
block is also recomputed per example and the per-example squared norms of both
ways must agree (to :func:`.precision.rounding_bound` of the recomputation's; :data:`CONFIRM`); where either
differs (a future ``transformers`` whose experts compute otherwise, a block that
mixes tokens after its experts) the block is recomputed per example for good.
Anything else (autocast, half precision, expert parallelism, a norm after each
expert, a parameter the layout does not name, an experts module called twice)
leaves the block to :mod:`.blocks`, that step. Tests: ``tests/test_moe_experts.py``.
"""

import functools
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions._squares import saved_dtype, scaled_factors, unscaled_norms, unscaled_sums
from cockpit_gradnoise.extensions.fallback.parameters import hooks_off
from cockpit_gradnoise.extensions.fallback.reduce import norms_and_sums, squared_norms_agree
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.linear import gram_squared_norms
from cockpit_gradnoise.extensions.precision import rounding_bound
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils import _pytree

#: The attribute (in a block's ``__dict__``) of its :class:`Capture`.
ATTRIBUTE = "_cgn_experts_capture"
#: The attribute (in a block's ``__dict__``) saying :func:`install` ran on it.
INSTALLED = "_cgn_experts_installed"

#: Whether a block's first step with the fast way also recomputes it per example and compares
#: (module docstring). A setting for tests and measurements, not per-pass state.
CONFIRM = True


class Capture:
    """What one forward pass of a block left for its experts and router, and whether the
    fast way was confirmed against the per-example recomputation (``verified``: ``None``
    before the first comparison)."""

    def __init__(self, experts: nn.Module, routers: List[nn.Module]):
        self.experts, self.routers = experts, routers
        self.verified: Optional[bool] = None
        self.output_checked = False  # the reimplemented output equalled the module's once
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.inputs: Optional[Tuple[Tensor, Tensor, Tensor]] = None  # rows, index, weights
        self.output: Optional[Tensor] = None
        self.grad: Optional[Tensor] = None
        self.router: Optional[nn.Module] = None
        self.router_call: Optional[Tuple[tuple, dict, Tuple]] = None  # args, kwargs, detached outputs
        self.slots: Optional[Tuple[int, int]] = None  # router outputs: (weights, index)
        self.pending: Dict[nn.Module, Tuple[tuple, dict, tuple]] = {}  # routers' calls, raw outputs

    def __reduce__(self):  # a copy of the model starts afresh, with its own modules
        return (Capture, (self.experts, self.routers))


def layout(experts: nn.Module) -> Optional[Dict[str, str]]:
    """``{role: parameter name}`` of an experts module in the 3-D layout, or ``None``."""
    flags = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel")
    if not all(isinstance(getattr(experts, flag, None), bool) for flag in flags) \
            or experts.has_post_expert_norm or experts._is_expert_parallel:
        return None
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    roles = {"up": up, "down": "down_proj"}
    if experts.has_bias:
        roles.update(up_bias=f"{up}_bias", down_bias="down_proj_bias")
    params = dict(experts.named_parameters())
    if set(params) != set(roles.values()) or any(params[roles[r]].dim() != 3 for r in ("up", "down")):
        return None
    return roles


def install(block: nn.Module) -> None:
    """Hooks on ``block``'s experts child in the 3-D layout and its router candidates
    (children whose only parameters are a 2-D ``weight`` and perhaps a ``bias``). Idempotent."""
    if block.__dict__.get(INSTALLED):
        return
    block.__dict__[INSTALLED] = True
    experts = next((child for child in block.children() if layout(child) is not None), None)
    if experts is None:
        return
    routers = [child for child in block.children() if child is not experts and _router_like(child)]
    capture = Capture(experts, routers)
    for module in (block, experts, *routers):  # the hooks find it there (a copy, its own)
        module.__dict__[ATTRIBUTE] = capture
    block.register_forward_pre_hook(eager_under_compile(_reset))
    experts.register_forward_hook(eager_under_compile(_experts_hook), with_kwargs=True)
    for router in routers:
        router.register_forward_hook(eager_under_compile(_router_hook), with_kwargs=True)


def _reset(block, args):
    capture = block.__dict__.get(ATTRIBUTE)
    if capture is not None:
        capture.reset()


def router_parameters(module: nn.Module) -> Optional[Dict[str, nn.Parameter]]:
    """``{"weight": W, "bias": b}`` (no bias: ``W`` only) of a router candidate: its trainable
    parameters are one 2-D weight (``weight``, or a child's: AFMoE's ``gate.weight``) and
    perhaps one 1-D bias beside it; frozen ones (ERNIE-4.5's routing statistics) aside."""
    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    weights = [name for name, p in trainable.items() if name.rsplit(".", 1)[-1] == "weight" and p.dim() == 2]
    if len(weights) != 1:
        return None
    bias = weights[0][: -len("weight")] + "bias"
    if set(trainable) - {weights[0], bias} or (bias in trainable and trainable[bias].dim() != 1):
        return None
    return {"weight": trainable[weights[0]], **({"bias": trainable[bias]} if bias in trainable else {})}


def _router_like(module: nn.Module) -> bool:
    return router_parameters(module) is not None


def _tensors(args, kwargs) -> List[Tensor]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]


def _router_hook(module, args, kwargs, output):
    capture = module.__dict__.get(ATTRIBUTE)
    if capture is None or idle(module) or not torch.is_grad_enabled():
        return
    if _tensors(args, kwargs) and isinstance(output, tuple):  # raw outputs, for their identity
        detached = _pytree.tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, (args, kwargs))
        capture.pending[module] = (*detached, output)


def _experts_hook(module, args, kwargs, output):
    capture = module.__dict__.get(ATTRIBUTE)
    if capture is None or idle(module) or not torch.is_grad_enabled():
        return
    capture.calls += 1
    inputs = _tensors(args, kwargs)
    if capture.calls != 1 or len(inputs) != 3 or not isinstance(output, Tensor) or not output.requires_grad:
        capture.inputs = None
        return
    rows, index, weights = inputs
    capture.inputs = (rows.detach(), index.detach(), weights.detach())
    capture.output = output.detach()
    for router, (router_args, router_kwargs, outputs) in capture.pending.items():
        slot_w = [k for k, o in enumerate(outputs) if o is weights]
        slot_i = [k for k, o in enumerate(outputs) if o is index]
        if len(slot_w) == 1 and len(slot_i) == 1:
            capture.router, capture.slots = router, (slot_w[0], slot_i[0])
            capture.router_call = (router_args, router_kwargs,
                                   tuple(o.detach() if isinstance(o, Tensor) else o for o in outputs))
    capture.pending = {}
    output.register_hook(functools.partial(_keep_grad, capture))


def _keep_grad(capture: Capture, grad: Tensor) -> None:
    capture.grad = grad.detach()


def capture_of(block: nn.Module) -> Optional[Capture]:
    """``block``'s :class:`Capture` where its last forward pass left one to compute from."""
    capture = block.__dict__.get(ATTRIBUTE)
    if capture is None or capture.verified is False or capture.inputs is None or capture.grad is None:
        return None
    return capture


def batch_call(block: nn.Module) -> Optional[Tuple[Tuple[Tensor, Tensor, Tensor], Tensor]]:
    """The experts' inputs ``(rows, index, weights)`` and output (detached) in ``block``'s last
    forward pass, where its :class:`Capture` keeps them (before :func:`results` lets go)."""
    capture = capture_of(block)
    return None if capture is None or capture.output is None else (capture.inputs, capture.output)


def _example_rows(rows: Tensor, leaves: List[Tensor], examples: int) -> Optional[int]:
    """``T`` where one of the block's per-example inputs (``leaves``) is, exactly, the experts'
    rows (``view(-1, H)``) in example-major order: token ``t`` is example ``t // T``'s."""
    count, width = rows.shape
    if count % examples:
        return None
    for leaf in leaves:
        if leaf.shape[-1] == width and leaf.numel() == rows.numel() and leaf.dtype == rows.dtype \
                and torch.equal(leaf.reshape(-1, width), rows):
            return count // examples
    return None


class _Factors:
    """Per expert, the rows routed to it (tokens, slots) and each parameter's factors
    ``(b_r, a_r)``: contribution ``b_r a_r^T`` (a bias: ``b_r``)."""

    def __init__(self):
        self.tokens: Dict[int, Tensor] = {}
        self.factors: Dict[str, Dict[int, Tuple[Tensor, Optional[Tensor]]]] = {}
        self.d_weights: Optional[Tensor] = None  # [M, k]: G_t . y_ts


def _factors(experts: nn.Module, roles: Dict[str, str], rows: Tensor, index: Tensor, weights: Tensor,
             grad: Tensor, output: Optional[Tensor]) -> Optional[_Factors]:
    """Every expert's rows and factors, and ``dL/dw_ts = G_t . y_ts``; ``None`` where the
    reimplemented output is not ``output``, the module's own (``None``: not compared again)."""
    params = {name: p.detach() for name, p in experts.named_parameters()}
    up, down = params[roles["up"]], params[roles["down"]]
    up_bias, down_bias = params.get(roles.get("up_bias", "")), params.get(roles.get("down_bias", ""))
    count_experts, top = up.shape[0], index.shape[1]
    found, flat = _Factors(), index.reshape(-1)
    if not flat.numel() or int(flat.min()) < 0 or int(flat.max()) > count_experts:
        return None  # (count_experts itself: a slot no expert takes, as transformers' sentinel)
    found.d_weights = rows.new_zeros(index.shape)
    recomputed = None if output is None else torch.zeros_like(output)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=count_experts + 1).tolist()
    start = 0
    for e, size in enumerate(counts[:count_experts]):
        routed, start = order[start : start + size], start + size
        if not size:
            continue
        tokens, slots = routed // top, routed % top
        x, w_down = rows[tokens], (down[e].T if experts.is_transposed else down[e])  # w_down: [out, in]
        with torch.enable_grad():
            h = x @ up[e] if experts.is_transposed else x @ up[e].T
            h = (h if up_bias is None else h + up_bias[e]).requires_grad_(True)
            u = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
        weight, g = weights[tokens, slots].unsqueeze(-1), grad[tokens]
        g_down = g.to(u.dtype) @ w_down  # G_t W^down: dL/dy_ts W^down without the weight
        d_weights = (g_down * u.detach()).sum(-1)  # G_t . (W^down u): y_ts's share...
        if down_bias is not None:
            d_weights += g.to(u.dtype) @ down_bias[e]  # ... and its bias's
        found.d_weights[tokens, slots] = d_weights.to(found.d_weights.dtype)
        (b_up,) = torch.autograd.grad(u, h, g_down * weight)
        b_down = (g * weight).to(u.dtype)
        if recomputed is not None:
            y = u.detach() @ w_down.T
            y = y if down_bias is None else y + down_bias[e]
            recomputed.index_add_(0, tokens, (y * weight).to(output.dtype))
        found.tokens[e] = tokens
        pairs = {"up": (b_up, x), "down": (b_down, u.detach()), "up_bias": (b_up, None),
                 "down_bias": (b_down, None)}
        for role, name in roles.items():
            found.factors.setdefault(name, {})[e] = pairs[role]
    if recomputed is not None and (
            not output.numel() or not float((recomputed - output).abs().max()) <= rounding_bound(output)):
        return None
    return found


def _segments(tokens: Tensor, positions: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Of rows whose tokens ascend: ``(examples reached [n], rows of each [n], segment of each
    row)``, token ``t`` being example ``t // positions``'s."""
    owners = torch.div(tokens, positions, rounding_mode="floor")
    reached, counts = torch.unique_consecutive(owners, return_counts=True)
    return reached, counts, torch.repeat_interleave(torch.arange(len(reached), device=tokens.device), counts)


def _padded(rows: Tensor, counts: Tensor, segment: Tensor) -> Tensor:
    """``rows`` of consecutive segments (``counts``) as ``[n, longest, width]``, zeros after each."""
    starts = torch.cumsum(counts, 0) - counts
    padded = rows.new_zeros(len(counts), int(counts.max()), rows.shape[1])
    padded[segment, torch.arange(len(rows), device=rows.device) - starts[segment]] = rows
    return padded


def gradient_and_gram_norms(b: Tensor, a: Tensor, counts: Tensor, segment: Tensor,
                            transposed: bool) -> Tuple[Tensor, Tensor]:
    """``(sum_i x_i [1, *shape], ||x_i||^2)`` without forming any ``x_i`` (where the sums of
    squares are not asked for): the gradient one product of all rows, the norms by the Gram
    matrices of each example's rows, ``sum_{r,r'} (b_r . b_r') (a_r . a_r')``
    (:func:`.linear.gram_squared_norms`), at a power-of-two scale of each factor."""
    gradient = (a.T @ b if transposed else b.T @ a).unsqueeze(0)
    (b, a), scale = scaled_factors(b, a)
    return gradient, unscaled_norms(gram_squared_norms(_padded(b, counts, segment), _padded(a, counts, segment)), scale)


def formed_sums_and_norms(b: Tensor, a: Tensor, counts: Tensor, transposed: bool) -> Tuple[Tensor, Tensor]:
    """``([sum_i x_i, sum_i x_i**2], ||x_i||^2)`` of ``x_i = sum_{r of i} b_r a_r^T`` (``a_r b_r^T``
    where ``transposed``), the rows of each example consecutive (``counts`` of them).

    Each ``x_i`` is one matrix product of its own rows (no padding), squared and added to the
    sums while it is in the cache (two buffers for all examples): never all examples' at once.
    At a power-of-two scale of each factor (:func:`._squares.scaled_factors`).
    """
    (b, a), scale = scaled_factors(b, a)
    shape = (a.shape[1], b.shape[1]) if transposed else (b.shape[1], a.shape[1])
    sums, x, squares, norms, start = b.new_zeros(2, *shape), b.new_empty(shape), b.new_empty(shape), [], 0
    for count in counts.tolist():
        rows_b, rows_a = b[start : start + count], a[start : start + count]
        start += count
        torch.mm(rows_a.T, rows_b, out=x) if transposed else torch.mm(rows_b.T, rows_a, out=x)
        sums[0].add_(x)
        torch.mul(x, x, out=squares)
        sums[1].add_(squares)
        norms.append(squares.sum())
    return unscaled_sums(sums, scale), unscaled_norms(torch.stack(norms), scale)


def _expert_results(param: Tensor, found: _Factors, name: str, positions: int, transposed: bool,
                    examples: int, squares: bool) -> Tuple[Tensor, Tensor]:
    """``(||x_i||^2 [N], [sum_i x_i, sum_i x_i**2])`` of an experts parameter, one expert at a
    time; without ``squares`` (the sums of squares not asked for), ``[sum_i x_i]`` only."""
    norms = param.new_zeros(examples, dtype=saved_dtype(param.dtype))
    parts = {}
    for e, tokens in found.tokens.items():
        b, a = found.factors[name][e]
        reached, counts, segment = _segments(tokens, positions)
        if a is None:  # a bias: x_i = sum_{r of i} b_r
            part_norms, parts[e] = norms_and_sums(b.new_zeros(len(reached), b.shape[1]).index_add_(0, segment, b))
        elif not squares:
            parts[e], part_norms = gradient_and_gram_norms(b, a, counts, segment, transposed)
        else:
            parts[e], part_norms = formed_sums_and_norms(b, a, counts, transposed)
        norms.index_add_(0, reached, part_norms.to(norms.dtype))
    # In float64 where one expert's needed a scale (.._squares), else in the parameter's dtype.
    wide = max((part.dtype for part in parts.values()), key=lambda dtype: torch.finfo(dtype).bits,
               default=param.dtype)
    sums = param.new_zeros(2 if squares else 1, *param.shape, dtype=wide)
    for e, part in parts.items():
        sums[:, e] = part[: len(sums)]
    return norms, sums


def _coarser_eps(*tensors: Tensor) -> float:
    """The largest ``eps`` of the tensors' dtypes: a router of a float64 model that computes its
    logits in float32 (GraniteMoE's ``.float()``, DeepSeek-V3's ``weight.type(torch.float32)``)
    gives ``F.linear`` of the rows to float32's rounding."""
    return max(torch.finfo(t.dtype).eps for t in tensors)


def _router_parts(capture: Capture, found: _Factors, rows: Tensor, positions: int):
    """``{param: (||x_i||^2, [sum_i x_i, sum_i x_i**2])}`` of the router's parameters (module
    docstring), ``None`` where it
    is not ``F.linear`` of the rows with its routing weights among its outputs."""
    router, (args, kwargs, outputs), (slot_w, slot_i) = capture.router, capture.router_call, capture.slots
    params = router_parameters(router)
    router_input = _tensors(args, kwargs)[0]  # the rows; any other input (a bias buffer) as it was
    if params is None or router_input.numel() != rows.numel() \
            or not torch.equal(router_input.reshape(rows.shape), rows):
        return None
    with torch.enable_grad(), hooks_off(router):
        again = router(*args, **kwargs)
    if not isinstance(again, tuple) or len(again) != len(outputs) or not torch.equal(again[slot_i], outputs[slot_i]):
        return None
    logits, weights = again[0], again[slot_w]
    expected = F.linear(rows, params["weight"].detach(), None if "bias" not in params else params["bias"].detach())
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.shape != expected.shape \
            or weights.shape != outputs[slot_w].shape:
        return None
    if not float((logits.detach() - expected).abs().max()) <= rounding_bound(expected, _coarser_eps(logits, expected)) \
            or not float((weights.detach() - outputs[slot_w]).abs().max()) <= rounding_bound(outputs[slot_w]):
        return None
    (d_logits,) = torch.autograd.grad(weights, logits, found.d_weights.to(weights.dtype))
    examples, wide = rows.shape[0] // positions, torch.promote_types(d_logits.dtype, rows.dtype)
    d_logits, per_example_rows = d_logits.reshape(examples, positions, -1), rows.reshape(examples, positions, -1)
    found = {params["weight"]: torch.bmm(d_logits.transpose(1, 2).to(wide), per_example_rows.to(wide))}
    if "bias" in params:
        found[params["bias"]] = d_logits.sum(1)
    return {param: norms_and_sums(x) for param, x in found.items()}


def results(block: nn.Module, leaves: List[Tensor], grad: Tensor, params: Dict[str, nn.Parameter],
            savefields) -> Dict[str, Dict[str, Tensor]]:
    """``{savefield: {name: result}}`` (the three savefields) of the parameters of ``params``
    (``{name: param}`` of ``block``'s) the fast way covers, from what ``block``'s last forward
    and backward pass left; empty where it covers none. ``leaves``: the block's per-example
    inputs; ``grad``: the gradient at its output (``[N, ...]``)."""
    capture = capture_of(block)
    if capture is None:
        return {}
    try:
        return _results(capture, leaves, grad, params, savefields)
    except Exception:  # noqa: BLE001 - an experts module otherwise made: the block recomputes it
        return {}
    finally:
        capture.reset()


def _results(capture: Capture, leaves: List[Tensor], grad: Tensor, params: Dict[str, nn.Parameter], savefields):
    rows, index, weights = capture.inputs
    roles, experts = layout(capture.experts), capture.experts
    wanted = {id(p) for p in params.values()}
    dtypes = {p.dtype for p in experts.parameters()} | {rows.dtype, capture.output.dtype}
    if roles is None or len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.float64) \
            or any(id(p) not in wanted for p in experts.parameters()) or capture.grad.shape != capture.output.shape:
        return {}
    positions = _example_rows(rows, leaves, grad.shape[0])
    if positions is None or capture.output.shape != rows.shape:
        return {}
    found = _factors(experts, roles, rows, index, weights, capture.grad,
                     None if capture.output_checked else capture.output)
    if found is None:  # it computes otherwise: the block is recomputed per example for good
        capture.verified = False
        return {}
    capture.output_checked = True
    own = dict(experts.named_parameters())
    squares = SUMS_SAVEFIELD in savefields
    reduced = {own[name]: _expert_results(own[name], found, name, positions,
                                          experts.is_transposed and role in ("up", "down"), grad.shape[0], squares)
               for role, name in roles.items()}
    if capture.router is not None and all(id(p) in wanted for p in (router_parameters(capture.router) or {}).values()):
        reduced.update(_router_parts(capture, found, rows, positions) or {})
    names = {id(p): name for name, p in params.items()}
    out = {savefield: {} for savefield in savefields}
    for param, (norms, sums) in reduced.items():
        name = names[id(param)]
        found_here = {BATCH_L2_SAVEFIELD: norms, SUMS_SAVEFIELD: sums, LOCAL_GRADIENT_SAVEFIELD: sums[0]}
        for savefield in savefields:
            out[savefield][name] = found_here[savefield]
    return out


def confirmed(block: nn.Module, fast: Dict[str, Dict[str, Tensor]], recomputed: Dict[str, Dict[str, Tensor]],
              eps: float) -> bool:
    """On a block's first step with both ways: whether the fast way's per-example squared norms
    agree with the per-example recomputation's (to :func:`.precision.rounding_bound` of
    the latter, at ``eps``), noted for
    good; ``True`` once noted so."""
    capture = block.__dict__.get(ATTRIBUTE)
    if capture is not None and not CONFIRM:
        return capture.verified is not False
    if capture is None or capture.verified is not None:
        return capture is not None and bool(capture.verified)
    capture.verified = squared_norms_agree(fast, recomputed, eps)
    return capture.verified


def confirming(block: nn.Module) -> bool:
    """Whether ``block``'s fast way is still to be compared with the per-example recomputation."""
    capture = block.__dict__.get(ATTRIBUTE)
    return CONFIRM and capture is not None and capture.verified is None
