"""Blocks whose layers see rows that are not examples: recomputed one example at a time.

A mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE, GraniteMoE in
``transformers``) takes ``[N, T, C]`` and returns ``[N, T, C]``, but inside it
flattens the tokens to ``[N*T, C]``: its router and its experts (3-D
parameters, or ``nn.Linear`` modules) run on rows that are tokens, gathered
by expert (``torch.where``, ``index_add_``, grouped matrix products). No
rule of a layer inside sees the examples, and ``vmap`` cannot run the
routing (``nonzero`` has a data-dependent shape).

The block as a whole is batch-first, and where its examples are independent
(each token routed on its own, as in ``transformers``' blocks: no capacity
limit), each example's contribution to the gradient of every parameter ``p``
inside it is exact from the block alone, with ``a_i`` the block's input of
example ``i``, ``f`` its forward pass and ``G_i`` the gradient of the batch's
loss with respect to its output of example ``i``:

.. math::

    x_i(p) = \\Big(\\frac{\\partial f(a_i; \\theta)}{\\partial p}\\Big)^{\\top} G_i .

:func:`compute` computes it by running the block again on each example alone
(the full parameters, ``torch.autograd.grad`` of the output at ``G_i``), at
the end of the backward pass, and reduces each example's gradients at once
(``||x_i||^2``, ``[sum_i x_i, sum_i x_i**2]``, ``sum_i x_i``, :mod:`.reduce`):
one example's gradients of one block at a time, never the network's. No rule
per module: the block's own forward pass, whatever it does inside.

Which blocks: the parent of each module with the fallback (direct parameters
and no rule, :func:`install_fallback`) is hooked; it takes over (it is
*active* for a backward pass) when one of those children's calls had a
per-example input that does not lead with the batch (:func:`takes_over`,
from their :mod:`.layout`). Then the one choice point
(``_RecordingExtension._rules_run``) gives no layer inside it rows of its own
(:func:`covers`), and the block saves every parameter's.

Checked at each step, refused with a warning naming the parameters (never a
silently wrong number): the block's output for one example alone must equal
its output in the batch (to ``sqrt(eps)`` of its largest magnitude: examples
that interact, through capacity limits or batch-level routing, change it by far more; a
forward pass that draws random numbers, such as dropout or router jitter in training mode,
is given each example's part of the batch's draws, :mod:`.draws`, and checked the same way); and
the contributions must add up to the gradient the backward pass gave each
parameter (a parameter hook): a gradient reaching the parameter other than
through the block's output (the router's auxiliary load-balancing loss with
``output_router_logits=True``, a batch-level term; a parameter shared with a
layer outside) leaves that parameter out. ``eps`` is that of the narrowest dtype the
block computes in (:func:`rounding`): a float64 model whose router computes in float32
(AFMoE, MiniMax-M2, Llama 4, ERNIE-4.5-MoE in ``transformers``: ``router_logits.float()``)
rounds the routing of one example alone otherwise than the batch's, by float32's rounding;
the rows are then each example's own gradient through the block run alone.

The experts of ``transformers``' mixture-of-experts blocks in their common 3-D layout,
and a Mixtral-style router, get their rows from the batch's own pass instead
(:mod:`.experts`), and its shared experts' ``nn.Linear`` layers from one more pass of the
block on the whole batch (:mod:`.shared`): only the block's other parameters are recomputed
per example.
"""

import functools
import math
from typing import Dict, Iterator, List, Optional, Union

from cockpit_gradnoise.extensions import facts, precision
from cockpit_gradnoise.extensions.fallback import draws, experts, shared, window_map, windows
from cockpit_gradnoise.extensions.fallback.block_alone import (  # noqa: F401 (Block, output_tolerance: used by others as blocks.*)
    Block,
    Interacting,
    batched_leaves,
    output_tolerance,
    per_example_gradients,
    rounding,
    vectorized,
)
from cockpit_gradnoise.extensions.fallback.capture import (
    ATTRIBUTE,
    BLOCK_ATTRIBUTE,
    Call,
    Fallback,
    active_savefields,
    first_tensor,
)
from cockpit_gradnoise.extensions.fallback.capture import install_fallback as install_on_modules
from cockpit_gradnoise.extensions.fallback.layout import key_of, layout_of, state_kept
from cockpit_gradnoise.extensions.fallback.parameters import caches_bypassed, direct_parameters, hooks_off
from cockpit_gradnoise.extensions.fallback.reduce import reduce_chunks, with_structural_zeros
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD, TIED_ATTR

import torch
from torch import Tensor, nn
from torch.utils import _pytree


def hook_block(module: nn.Module) -> Block:
    """``module``'s :class:`Block`, its hook installed the first time."""
    block = module.__dict__.get(BLOCK_ATTRIBUTE)
    if block is None:
        block = module.__dict__[BLOCK_ATTRIBUTE] = Block()
        # Hooked as its call begins (the model itself, by the survey in the model's pre-hook,
        # whose passes keep the random state): the state its pre-hook would have kept.
        block.rng = draws.snapshot(list(module.parameters())) \
            if module.training and torch.is_grad_enabled() else None
        module.register_forward_pre_hook(eager_under_compile(_keep_random_state), with_kwargs=True)
        module.register_forward_hook(eager_under_compile(_capture), with_kwargs=True)
        experts.install(module)  # its experts' rows kept in the batch's pass, where it has them
    return block


def install_fallback(model: nn.Module, has_rule) -> List[str]:
    """:func:`.capture.install_fallback`, and the hooks of a :class:`Block` on the parent of
    each module that got the fallback. Idempotent; the names of the modules with the fallback."""
    names = install_on_modules(model, has_rule)
    for parent in model.modules():
        if any(isinstance(getattr(child, ATTRIBUTE, None), Fallback) for child in parent.children()):
            hook_block(parent)
    return names


def _keep_random_state(module, args, kwargs):
    """Forward pre-hook: the random state at the call's start in training mode (:mod:`.draws`)."""
    block = module.__dict__.get(BLOCK_ATTRIBUTE)
    if block is not None:
        block.rng = draws.snapshot((*args, *kwargs.values())) \
            if module.training and torch.is_grad_enabled() and not idle(module) else None


def _capture(module, args, kwargs, output):
    """Forward hook: keep the call, hook its output's gradient and its parameters' gradients."""
    block = module.__dict__.get(BLOCK_ATTRIBUTE)
    if block is None or idle(module) or not torch.is_grad_enabled():
        return
    for handle in block.handles:
        handle.remove()
    block.handles, block.totals, block.call, block.covered = [], {}, None, []
    block.later, block.later_grads, block.first_grad = {}, {}, None
    first = first_tensor(output)
    if first is None or not first.requires_grad or first.dim() == 0 \
            or not (block.members or takes_over(module, first.shape[0], unknown=True)):
        return  # (the hooks below cost a Python call per parameter and pass)
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    versions = {k: leaf._version for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor)}
    leaves = [leaf.detach() if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    device = next((leaf.device.type for leaf in leaves if isinstance(leaf, Tensor)), "cpu")
    block.call = Call(leaves, spec, versions, None, precision.autocast_state(device), rng=block.rng)
    block.output, block.version = first.detach(), first._version
    replaced, hooked = _hook_later_outputs(module, block, output, first)
    block.handles.append(hooked.register_hook(lambda grad: _output_gradient(module, block, grad)))
    for param in _parameters(module).values():
        block.handles.append(param.register_hook(_keep_total(block, param)))
    return replaced


def _hook_later_outputs(module: nn.Module, block: Block, output, first: Tensor):
    """Hook each later output with rows per example (:attr:`Block.example_outputs`) that
    requires grad: ProphetNet's decoder returns its main stream first, which its loss does
    not read, and its predicting stream second. Each is replaced by an alias (``view_as``)
    whose hook keeps its gradient, and so is the first where there are later ones: an output
    the module also used to compute another would otherwise bring that path's gradient too
    (as :func:`.capture._keep_later_gradients`). ``(output or None, the tensor to hook for
    the first's gradient)``. A gradient through an output not hooked (without rows per
    example) reaches the parameters otherwise than through the hooked outputs: the sum check
    refuses them (:func:`reached_otherwise`)."""
    leaves, spec = _pytree.tree_flatten(output)
    positions = [k for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
    for t, k in enumerate(positions[1:], 1):
        leaf = leaves[k]
        if t in block.example_outputs and leaf is not first and leaf.requires_grad and leaf.grad_fn is not None \
                and leaf.is_floating_point() and leaf.dim() > 0 and leaf.shape[0] == first.shape[0]:
            leaves[k] = leaf.view_as(leaf)
            block.later[t] = leaf.detach()
            block.handles.append(leaves[k].register_hook(functools.partial(_later_gradient, module, block, t)))
    if not block.later:
        return None, first
    leaves[positions[0]] = first.view_as(first)
    return _pytree.tree_unflatten(leaves, spec), leaves[positions[0]]


def _later_gradient(module: nn.Module, block: Block, t: int, grad: Tensor) -> None:
    block.later_grads[t] = grad.detach()
    if not block.covered:  # the first output has brought none (yet): the block starts here
        _output_gradient(module, block, None)


def _keep_total(block: Block, param: nn.Parameter):
    def keep(grad):
        block.totals[id(param)] = grad.detach()

    return keep


def _parameters(module: nn.Module, covered: Optional[List[nn.Module]] = None) -> Dict[str, nn.Parameter]:
    """``{name: param}`` of ``module``'s trainable parameters (those of ``covered`` only)."""
    if covered is None:
        return {name: p for name, p in module.named_parameters() if p.requires_grad}
    ids, found, seen = {id(sub) for sub in covered}, {}, set()
    for prefix, sub in module.named_modules():
        if id(sub) in ids:
            for name, p in sub.named_parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    found[f"{prefix}.{name}" if prefix else name] = p
    return found


def takes_over(module: nn.Module, examples: int, unknown: bool = False) -> bool:
    """Whether a child of ``module`` with the fallback ran on rows that are not examples in
    its last call: a per-example input (:mod:`.layout`) none of which leads with ``examples``;
    ``unknown``: what a call whose layout is not learned yet counts as."""
    return any(True for _ in _taking_over(module, examples, unknown))


def _taking_over(module: nn.Module, examples: int, unknown: bool = False) -> Iterator[nn.Module]:
    """The children of ``module`` that make it take over (:func:`takes_over`)."""
    for child in module.children():
        state = getattr(child, ATTRIBUTE, None)
        if not isinstance(state, Fallback) or state.call is None:
            continue
        if key_of(state, state.call) not in state.layouts:
            if unknown:
                yield child
            continue
        found = layout_of(state)
        if found.refusal is None and found.leaves and not batched_leaves(state.call, examples, found.leaves):
            yield child


def _members_alone(module: nn.Module, block: Block, examples: int) -> bool:
    """Whether the block computes its members alone although a child takes over (timm's Swin:
    ``WindowAttention``, with the relative position table as its own parameter, on the windows'
    rows), as where no child takes over, its other layers (``norm1``, ``mlp``: on rows that are
    examples, the survey found) keeping their own rows: where every child that takes over is a
    member, every member is of a kind the windows' way knows (:func:`.window_map.kind`; not a
    mixture of experts' 3-D experts), and the block has no parameter of its own (OLMo-Hybrid's
    gated delta rule is its own block: its ``A_log`` is the block's). Otherwise the block
    computes every parameter inside it."""
    members = {id(member) for member in block.members}
    return bool(members) and not direct_parameters(module) and module.__dict__.get(experts.ATTRIBUTE) is None \
        and all(window_map.kind(m) is not None and experts.layout(m) is None for m in block.members) \
        and all(id(child) in members for child in _taking_over(module, examples))


def _output_gradient(module: nn.Module, block: Block, grad: Optional[Tensor]):
    """Tensor hook on the block's output: in a tracked backward pass where the block takes
    over, note it in the pass's facts (its layers then get no rows of their own) and leave
    the computation to the end of the pass. ``grad`` ``None``: a later output's gradient came
    first (:func:`_later_gradient`)."""
    if grad is not None:
        block.first_grad = grad.detach()
        if block.covered:  # (started by a later output's gradient)
            return
    savefields = active_savefields()
    if not savefields or block.call is None or block.output.dim() == 0 or covers(module):
        _let_go(block)  # (inside an active block: that block computes it)
        return
    examples = block.output.shape[0]
    if takes_over(module, examples) and not _members_alone(module, block, examples):
        block.covered = list(module.modules())
    elif block.members:  # (.regroup): the other layers' rules give exact rows
        block.covered = list({id(sub): sub for member in block.members for sub in member.modules()}.values())
    else:
        _let_go(block)
        return
    _absorb_inner_blocks(module, block)
    recorded = facts.recording()
    recorded.inside_blocks.update(id(sub) for sub in block.covered)
    for sub in block.covered:
        state = getattr(sub, ATTRIBUTE, None)
        if isinstance(state, Fallback):  # its call is the block's business now
            state.call, state.taken = None, True
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: _save(module, block, _first_gradient(block), savefields, recorded))


def _first_gradient(block: Block) -> Optional[Tensor]:
    """The first output's gradient, zeros where only later outputs brought one (it did not
    reach the loss: its gradient is exactly zero)."""
    if block.first_grad is None and block.output is not None:
        return torch.zeros_like(block.output)
    return block.first_grad


def _let_go(block: Block) -> None:
    """No totals needed (the parameters' gradients come later), nor the call."""
    for handle in block.handles:
        handle.remove()
    block.handles, block.call, block.output, block.covered = [], None, None, []


def _absorb_inner_blocks(module: nn.Module, block: Block) -> None:
    """Let go of each block inside ``module`` with a module this one covers: this one
    computes them, and also what that one covers where it took over first (its output
    hook ran first: both outputs are one tensor, DBRX's experts' and their block's), and
    its members where it has not run yet (XLNet's model inside its LM head's block, which
    holds the word embedding tied to the head: .regroup)."""
    ids = {id(sub) for sub in block.covered}
    for sub in module.modules():
        inner = sub.__dict__.get(BLOCK_ATTRIBUTE)
        if sub is module or inner is None or inner.call is None \
                or not any(id(s) in ids for s in sub.modules()):
            continue
        owed = inner.covered + [s for member in inner.members for s in member.modules()]
        block.covered += list({id(s): s for s in owed if id(s) not in ids}.values())
        ids.update(id(s) for s in owed)
        _let_go(inner)


def covers(module: nn.Module) -> bool:
    """Whether an active block computes ``module``'s parameters in this backward pass."""
    return id(module) in facts.recording().inside_blocks


def refusal(module: nn.Module, block: Block, examples: int) -> Optional[str]:
    """Why the block's per-example results cannot be computed (``None``: they can)."""
    call = block.call
    found = layout_of(block)
    if found.refusal is not None:
        return found.refusal
    if not batched_leaves(call, examples, found.leaves):
        return "none of its inputs leads with the batch dimension of its output"
    if any(call.leaves[k]._version != v for k, v in call.versions.items()) \
            or block.output._version != block.version:
        return "an input or its output was changed in place after the call"
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            return f"its submodule {name!r} is a BatchNorm in training mode: examples interact"
    return None


def _from_the_batch(module: nn.Module, block: Block, way, batched: List[int], grad: Tensor,
                    params: Dict[str, nn.Parameter], wanted: List[str]) -> Dict[str, Dict[str, Tensor]]:
    """The results ``way`` (:mod:`.experts` or :mod:`.windows`) gives from the batch's pass; none
    under autocast."""
    if block.call.autocast:
        return {}
    if way is experts:
        return experts.results(module, [block.call.leaves[k] for k in batched], grad, params, wanted)
    return windows.results(module, block.call, batched, block.members, block.output, grad, params, wanted)


def compute(module: nn.Module, block: Block, grad: Tensor,
            savefields) -> Union[Dict[str, Dict[str, Tensor]], str]:
    """``{savefield: {name: result}}`` of every trainable parameter of the block, plus
    ``sum_i x_i`` (:data:`LOCAL_GRADIENT_SAVEFIELD`) and ``||x_i||^2`` for the check; or a
    refusal's reason (a string)."""
    examples = grad.shape[0]
    reason = refusal(module, block, examples)
    if reason is not None:
        return reason
    params = _parameters(module, block.covered)
    wanted = set(savefields) | {LOCAL_GRADIENT_SAVEFIELD, BATCH_L2_SAVEFIELD}
    devices = sorted({grad.device.index or 0} if grad.device.type == "cuda" else set())
    # Experts (and their router) in transformers' 3-D layout, or window attention's layers on
    # rows whose map to the examples is proven: from the batch's pass (.experts, .windows).
    batched = batched_leaves(block.call, examples, layout_of(block).leaves)
    way = experts if module.__dict__.get(experts.ATTRIBUTE) is not None else windows
    kept = experts.batch_call(module) if way is experts and not block.call.autocast else None
    fast = {} if block.later_grads else _from_the_batch(module, block, way, batched, grad, params, sorted(wanted))
    if way is windows and windows.settled(module, fast, params):
        # Nothing runs again: no module's hooks, caches or state to set aside (state_kept walks the block).
        return {savefield: dict(fast[savefield]) for savefield in wanted}
    try:
        with hooks_off(module), caches_bypassed(module), state_kept(module, devices):
            if fast.get(BATCH_L2_SAVEFIELD) and way is experts:  # its shared experts too (.shared)
                others = {n: p for n, p in params.items() if n not in fast[BATCH_L2_SAVEFIELD]}
                rows, block.dtype = shared.results(module, block.call, grad, block.output, others, sorted(wanted),
                                                   kept)
                for savefield, found in rows.items():
                    fast[savefield].update(found)
            names = fast.get(BATCH_L2_SAVEFIELD, {})
            rest = params if way.confirming(module) else {n: p for n, p in params.items() if n not in names}
            found = {savefield: {} for savefield in wanted}
            if rest:
                found = _reduced(module, block, grad, rest, sorted(wanted))
            if names and way.confirmed(module, fast, found, rounding(block, grad.dtype)):
                for savefield in wanted:
                    found[savefield].update(fast[savefield])
            return found
    except (Interacting, draws.Unreplayable) as error:
        return str(error)
    except Exception as error:  # the block cannot run on one example
        return f"it cannot run on one example alone ({type(error).__name__}: {error})"


def _reduced(module: nn.Module, block: Block, grad: Tensor, params: Dict[str, nn.Parameter],
             wanted: List[str]) -> Dict[str, Dict[str, Tensor]]:
    """The results of ``params`` by :func:`vectorized` or the loop; where the block's output for
    an example alone differs from the batch's in a call in training mode, with the batch's
    random draws replayed (:mod:`.draws`), at this step and every later one."""
    if not block.random or block.call.rng is None:
        try:
            chunks = vectorized(module, block, grad, params) or per_example_gradients(module, block, grad, params)
            return reduce_chunks(with_structural_zeros(chunks), wanted)
        except Interacting:
            if block.call.rng is None:
                raise
    call = block.call  # (its arguments copied: a forward may change them in place)
    args, kwargs = _pytree.tree_unflatten([leaf.clone() if isinstance(leaf, Tensor) else leaf
                                           for leaf in call.leaves], call.spec)
    drawn = draws.record(module, args, kwargs, call.rng, block.output, first_tensor, call.autocast)
    if not drawn:
        if not block.random:  # it draws nothing: its examples interact
            raise Interacting("its output for one example alone differs from its output in the batch: "
                              "its examples interact (a capacity limit, routing over the batch)")
        block.random = False  # it no longer draws (its rates set to 0): vmap again
        return _reduced(module, block, grad, params, wanted)
    block.random, block.vectorized = True, None  # (vmap failed on the draws: tried again in eval mode)
    chunks = per_example_gradients(module, block, grad, params, drawn)
    return reduce_chunks(with_structural_zeros(chunks), wanted)


def reached_otherwise(total: Optional[Tensor], summed: Tensor, norms: Tensor, eps: float,
                      block_scale: float = 0.0) -> bool:
    """Whether a parameter's gradient in the backward pass (``total``) is not the sum of the
    block's contributions (``summed``): farther than ``sqrt(eps)`` times ``||total||`` plus
    ``sqrt(sum_i ||x_i||^2)`` (``norms``), far above the rounding of two orders of summation,
    plus ``eps`` times ``block_scale`` (the largest gradient norm of the block's parameters):
    a gradient zero by structure (an attention key's bias) is rounding noise of terms of the
    block's scale, both ways (1e-18 against 1e-17, OPT's ``k_proj.bias`` in float64)."""
    if total is None:  # no gradient reached it in this pass: its contributions are zeros
        return bool(summed.abs().max() > 0) if summed.numel() else False
    scale = float(total.double().norm()) + float(norms.double().sum().sqrt())
    distance = float((summed.double() - total.double()).norm())
    return distance > math.sqrt(eps) * scale + eps * block_scale


def _save(module: nn.Module, block: Block, grad: Tensor, savefields, recorded) -> None:
    """End of the backward pass: the block's results saved on its parameters, or its
    parameters refused (left out with a warning by the quantities)."""
    if block.call is None:  # let go of by a block around it, whose output is the same tensor
        return
    for handle in block.handles:  # the recomputation must not overwrite the totals
        handle.remove()
    try:
        results = compute(module, block, grad, savefields)
        params = _parameters(module, block.covered)
        eps = rounding(block, grad.dtype)
        block_scale = max((float(t.double().norm()) for t in block.totals.values()), default=0.0)
        for name, param in params.items():
            for savefield in savefields:
                if hasattr(param, savefield):
                    delattr(param, savefield)
            if isinstance(results, str):
                _refuse(module, recorded, param, results)
                continue
            summed = results[LOCAL_GRADIENT_SAVEFIELD][name]
            if reached_otherwise(block.totals.get(id(param)), summed, results[BATCH_L2_SAVEFIELD][name],
                                 eps, block_scale):
                _refuse(module, recorded, param, _why_reached_otherwise(block, param))
                continue
            for savefield in savefields:
                setattr(param, savefield, results[savefield][name])
            if id(param) not in recorded.setup_refusals:  # a rule's, before the block took over
                recorded.refusals.pop(id(param), None)
            recorded.leading_sizes[id(param)] = grad.shape[0]
            recorded.block_rows[id(param)] = type(module).__name__
    finally:
        for handle in block.handles:
            handle.remove()
        block.handles, block.totals, block.call, block.output, block.covered = [], {}, None, None, []
        block.dtype = None


def _why_reached_otherwise(block: Block, param: nn.Parameter) -> str:
    """Why part of ``param``'s gradient did not come through its block's output: a tie with
    a layer outside the block, where ``prepare_model`` marked one (MobileBERT's word
    embedding, tied to its prediction head's decoder), else a term of the loss."""
    start = "part of its gradient did not come through its block's output: "
    for sub in block.covered:
        for attribute, group in sub.__dict__.get(TIED_ATTR, {}).items():
            if getattr(sub, attribute, None) is param:
                return start + (
                    f"it is tied ({', '.join(group.names)}) and used outside the block too, which "
                    "the block run on each example does not see: untie it (tie_word_embeddings="
                    "False in transformers) and prepare the model (cgn.prepare_model) again to "
                    "give it rows")
    return start + (
        "a term of the loss reaches it another way (the router's auxiliary load-balancing loss, "
        "output_router_logits=True, is a term of the whole batch, not of examples) or it is "
        "shared with a layer outside the block")


def _refuse(module: nn.Module, recorded, param, reason: str) -> None:
    """Left out by the quantities, with a warning naming it and ``reason``."""
    recorded.refuse(param, f"its block ({type(module).__name__}), whose layers run on rows that "
                    f"are not examples, was recomputed per example, and {reason}")
