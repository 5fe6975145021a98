"""Running the fallback in the backward pass: once per module, every active extension's results.

The package's extensions call :func:`run` on every module that has the
fallback (the choice is theirs: ``_RecordingExtension._rules_run``); it
computes, once per module and backward pass, the results of every active
package extension from the call the forward hook kept (:mod:`.capture`),
and saves each extension's own. A module with children computes at the end
of the backward pass, when the gradients flowing into them are there
(:func:`_defer`). What cannot be computed exactly is refused, with a
warning and without rows (:func:`refusal`).
"""

import dataclasses
import functools
import warnings
from typing import Dict, List, Optional, Union

from cockpit_gradnoise.extensions import cost_model, facts, meetings, precision
from cockpit_gradnoise.extensions.fallback import blocks, caches, draws, regroup, several, sum_check
from cockpit_gradnoise.extensions.fallback.capture import (
    ATTRIBUTE,
    BLOCK_ATTRIBUTE,
    SAVEFIELDS,
    Call,
    Fallback,
    active_savefields,
    first_tensor,
)
from cockpit_gradnoise.extensions.fallback.layout import Layout, layout_of, state_kept, structure
from cockpit_gradnoise.extensions.fallback.parameters import (
    attributes_as_called,
    caches_bypassed,
    direct_parameters,
    hooks_off,
    own_parameters,
)
from cockpit_gradnoise.extensions.fallback.reduce import reduce_chunks, with_structural_zeros
from cockpit_gradnoise.extensions.fallback.replay import Refused, per_example_gradients
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD

import torch
from torch import Tensor, nn
from torch.utils import _pytree


def computed_parameters(module: nn.Module, call: Optional[Call]) -> Dict[str, nn.Parameter]:
    """The parameters the fallback computes for a call of ``module``: its direct ones, and
    those of the children the call did not run, which ``module`` uses itself
    (torchvision's Swin attention: ``F.linear(x, self.qkv.weight, ...)``), under
    ``"child.name"``; a child's parameter ``module`` did not use gets no rows."""
    params = direct_parameters(module)
    if call is None:
        return params
    ran = {id(child.module) for child in call.children}
    for child_name, child in module.named_children():
        if id(child) not in ran:
            params.update({f"{child_name}.{n}": p for n, p in child.named_parameters()
                           if p.requires_grad})
    return params


def refusal(module: nn.Module, call: Optional[Call], grads: Dict[int, Tensor],
            layout: Layout) -> Optional[str]:
    """Why ``module``'s per-example results cannot be computed from ``call`` with ``layout``
    (:mod:`.layout`; ``None``: they can)."""
    if call is None:
        return "no call of the module was recorded in the forward pass (prepare the model first)"
    if 0 not in grads:  # the first output's gradient is where the batch is read from
        return "its (first) output received no gradient"
    sizes = {g.shape[0] if g.dim() else None for p, g in grads.items() if p == 0 or p in layout.outputs}
    if len(sizes) != 1 or None in sizes:
        return f"its outputs lead with different sizes {sorted(map(str, sizes))}"
    for k, version in call.versions.items():
        if call.leaves[k]._version != version:
            return "an input was changed in place after the call"
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            return (f"its submodule {name!r} is a BatchNorm in training mode: examples "
                    "interact, so no per-example gradient of the module's parameters exists")
    if layout.refusal is not None:
        return layout.refusal
    if not batched_leaves(call, sizes.pop(), layout):
        return ("none of its inputs leads with the batch dimension of its output and depends "
                "on the batch")
    if 0 not in layout.outputs:
        return "its (first) output does not depend on the batch (its gradient is the batch's sum)"
    return None


def expanded_parameter(module: nn.Module, call: Optional[Call],
                       grads: Dict[int, Tensor]) -> Optional[Dict[str, Tensor]]:
    """``{name: [N, *shape]}``, each example's contribution, where ``module``'s one output
    is its one parameter expanded over the batch and nothing else (Perceiver's latents,
    ``self.latents.expand(batch_size, -1, -1)``, and trainable position encodings): example
    ``i``'s contribution is its row ``G_i`` of the output's gradient, summed over the other
    dimensions the parameter broadcasts from. ``None`` otherwise. The output's rows must
    have been seen to be the examples (the survey's batch one example larger,
    :func:`.regroup.rows_were_examples`): a size equal to the batch's by chance is not."""
    params = direct_parameters(module)
    if call is None or set(grads) != {0} or len(params) != 1 or call.nodes.output is None \
            or not regroup.rows_were_examples(module):
        return None
    (name, param), = params.items()
    node = call.nodes.output
    while node is not None and node.name() == "BackwardHookFunctionBackward" \
            and len(node.next_functions) == 1:  # BackPACK's module hooks
        node = node.next_functions[0][0]
    if node is None or node.name() != "ExpandBackward0":
        return None
    source = node.next_functions[0][0]
    gradient = grads[0]
    padded = (1,) * (gradient.dim() - param.dim()) + tuple(param.shape)
    if getattr(source, "variable", None) is not param or padded[0] != 1 or gradient.dim() < 1:
        return None
    return {name: meetings.sum_to(gradient.unsqueeze(1), param.shape)}


def batched_leaves(call: Call, examples: int, layout: Layout) -> List[int]:
    """Indices of the tensor leaves that lead with the batch dimension (``examples``) and
    depend on the batch (``layout``): a batch-free tensor whose leading size happens to
    equal the batch size is not per example (Funnel's ``cls_mask`` at batch 4)."""
    return [
        k for k, leaf in enumerate(call.leaves)
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == examples
        and k in layout.leaves
    ]


def output_gradients(call: Call, g_out) -> Dict[int, Tensor]:
    """``{output position: gradient}`` of the outputs that received one: the first's from
    the hooks (``g_out``), the later ones' as their tensor hooks kept them."""
    found = {0: g_out[0]} if g_out and g_out[0] is not None else {}
    return {**found, **call.later_grads}


def compute(module: nn.Module, state: Fallback, g_out, savefields) -> Dict:
    """The results of ``savefields`` for ``module``'s direct parameters; ``{}`` if refused (warned)."""
    call = state.call
    if call is not None:
        _refuse_layers_passed_in(module, call)
    grads = output_gradients(call, g_out) if call is not None else {}
    layout = layout_of(state) if call is not None else Layout()
    reason = refusal(module, call, grads, layout)
    expanded = None if reason is None else expanded_parameter(module, call, grads)
    if expanded is not None:
        return reduce_chunks(iter([expanded]), savefields)
    if reason is None and state.closed_form is not None and call.one_input is not None:
        form = state.closed_form
        contributions = form.contributions(module, call.one_input, grads[0], form.eps)
        return reduce_chunks(iter([contributions]), savefields)
    if reason is None:
        # An output without the batch dimension has no gradient per example (.replay: blind);
        # one that got no gradient did not reach the loss.
        blind_outputs = [p for p in grads if p not in layout.outputs] + call.unhooked
        grads = {p: g for p, g in grads.items() if p in layout.outputs}
        params = {n: p.detach() for n, p in computed_parameters(module, call).items()}
        examples = next(iter(grads.values())).shape[0]
        batched = batched_leaves(call, examples, layout)
        numel = sum(p.numel() for p in params.values())
        size = cost_model.examples_per_chunk(max(numel, 1), next(iter(params.values())).element_size())
        blind: Dict[str, str] = {}
        chunks = (
            per_example_gradients(module, params, call, batched, layout.children, grads,
                                  start, start + size, blind_outputs, blind)
            for start in range(0, examples, size)
        )
        # Where vmap met random numbers at an earlier step, it is not tried again in training mode.
        replayed = _replayed(module, call, grads, blind_outputs, layout, savefields) \
            if state.random and call.rng is not None else None
        if isinstance(replayed, dict):
            return replayed
        try:
            if replayed is not None:
                raise Refused(replayed)
            results = sum_check.reduced_and_checked(module, state, params, [(call, layout.children, grads)],
                                                    chunks, savefields)
            _leave_out(module, state, blind)
            return results
        except Refused as error:
            reason = str(error)
        except Exception as error:  # vmap cannot run this forward per example
            replayed = _vmap_failed(module, state, error, grads, blind_outputs, layout, savefields)
            if isinstance(replayed, dict):
                return replayed
            reason = replayed
    _refuse(module, state, reason)
    return {}


def _vmap_failed(module: nn.Module, state: Fallback, error: Exception, grads: Dict[int, Tensor],
                 blind_outputs: List[int], layout: Layout, savefields) -> Union[Dict, str]:
    """Where ``vmap`` could not run the module's forward per example: the results with the
    batch's random draws replayed, if it met random numbers (:func:`_replayed`); else, but for
    a key/value cache it was given, the results of the module run on each example alone
    without ``vmap`` (:func:`_replayed`, each example's output checked against its row of the
    batch's: a custom ``autograd.Function`` without ``setup_context``, a ``nonzero``); else
    why not."""
    call = state.call
    reason = f"torch.func.vmap cannot run its forward per example ({type(error).__name__}: {error})"
    if "random" in str(error):
        state.random = True
        replayed = _replayed(module, call, grads, blind_outputs, layout, savefields)
        return random_forward(module, reason) if replayed is None else replayed
    if _given_a_cache(call):
        return cache_updated(reason)
    old_style = "setup_context" in str(error)
    if old_style:
        reason = OLD_STYLE_FUNCTION
    # Run on each example alone, each output checked against its row of the batch's (a
    # ModelOutput's experts calling nonzero, ZayaModel; RecurrentGemma's RG-LRU).
    try:
        alone = _replayed(module, call, grads, blind_outputs, layout, savefields)
    except Exception as failure:  # noqa: BLE001 - it cannot run alone either: refused
        alone = f"{type(failure).__name__}: {failure}"
    if isinstance(alone, str):
        return f"{reason}, nor can it run on each example alone: {alone}" + (OLD_STYLE_FIX if old_style else "")
    return (reason + (OLD_STYLE_FIX if old_style else "")) if alone is None else alone


def _replayed(module: nn.Module, call: Call, grads: Dict[int, Tensor], blind_outputs: List[int],
              layout: Layout, savefields) -> Union[Dict, str, None]:
    """The results of a module whose forward draws random numbers (``vmap`` raised there), from
    the module run again on each example alone with its part of the batch's draws, as a block
    is (:mod:`.draws`, :func:`.blocks.per_example_gradients`, which checks each example's output
    against its row of the batch's); why not (a string); ``None`` where no draws can be
    replayed (no random state kept: not in training mode) or its outputs are not one tensor
    per example."""
    if call.output is None or set(grads) != {0} or blind_outputs:
        return None
    if call.output._version != call.output_version:
        return "its output was changed in place after the call (nothing to check each example's against)"
    # Its tensor arguments copied: a forward that changes its input in place would change the
    # tensors the backward pass still holds (and the next example's input).
    leaves = [leaf.clone() if isinstance(leaf, Tensor) else leaf for leaf in call.leaves]
    call = dataclasses.replace(call, leaves=leaves)
    block = blocks.Block()
    block.call, block.output, block.layouts = call, call.output, {structure(call): layout}
    grad = grads[0]
    params = {n: p.detach().requires_grad_() for n, p in computed_parameters(module, call).items()}
    devices = sorted({grad.device.index or 0} if grad.device.type == "cuda" else set())
    args, kwargs = _pytree.tree_unflatten([leaf.clone() if isinstance(leaf, Tensor) else leaf
                                           for leaf in leaves], call.spec)
    drawn = []
    try:  # (copies of the parameters: their own gradient hooks stay out of it)
        with hooks_off(module), caches_bypassed(module), state_kept(module, devices), \
                own_parameters(module, params), attributes_as_called(module, call.attributes):
            if call.rng is not None:
                drawn = draws.record(module, args, kwargs, call.rng, call.output, first_tensor, call.autocast)
            chunks = blocks.per_example_gradients(module, block, grad, params, drawn)
            results = reduce_chunks(with_structural_zeros(chunks),
                                    sorted({*savefields, LOCAL_GRADIENT_SAVEFIELD, BATCH_L2_SAVEFIELD}))
            if not drawn:  # (with draws: the output check, as before)
                why = _not_summing(module, call, grad, params, results, blocks.rounding(block, grad.dtype))
                if why is not None:
                    return why
            return {field: results[field] for field in savefields}
    except (blocks.Interacting, draws.Unreplayable) as error:
        random = drawn or isinstance(error, draws.Unreplayable)
        return f"its forward draws random numbers in training mode: {error}" if random else str(error)


def _not_summing(module: nn.Module, call: Call, grad: Tensor, params: Dict[str, Tensor],
                 results: Dict, eps: float) -> Optional[str]:
    """Why the contributions of each example alone (``results``) are not the module's
    contributions to the gradient: their sum differs from the gradient of the module run
    once more on the batch, at its output gradient ``grad`` (:func:`.blocks.reached_otherwise`'s
    tolerance); ``None`` where they add up.

    The output check sees a forward pass that mixes the examples; not one that mixes them in
    its gradient only (a term zero in value, ``(h - h.detach()).mean(0)``): each example's
    output alone is then its row of the batch's, but its gradient alone is not its share."""
    leaves = [leaf.clone() if isinstance(leaf, Tensor) else leaf for leaf in call.leaves]
    args, kwargs = _pytree.tree_unflatten(leaves, call.spec)
    with torch.enable_grad(), precision.autocast_as(call.autocast):
        first = first_tensor(module(*args, **kwargs))
    names = list(params)
    totals = torch.autograd.grad(first, [params[name] for name in names], grad.to(first.dtype),
                                 allow_unused=True)
    for name, total in zip(names, totals):
        if blocks.reached_otherwise(total, results[LOCAL_GRADIENT_SAVEFIELD][name],
                                    results[BATCH_L2_SAVEFIELD][name], eps):
            return (f"the contributions of each example alone to {name} do not add up to its "
                    "gradient from the batch: its examples interact in its backward pass")
    return None


#: Why a forward that calls an ``autograd.Function`` without ``setup_context`` gets no rows
#: from ``vmap`` (it is then run on each example alone: :func:`_vmap_failed`), and the fix.
OLD_STYLE_FUNCTION = (
    "its forward calls a custom torch.autograd.Function whose forward takes ctx (no separate "
    "setup_context), which torch.func.vmap cannot run per example")
OLD_STYLE_FIX = (
    ": give the Function a setup_context staticmethod (torch's 'Extending torch.func with "
    "autograd.Function'), or use plain torch operations at tracked steps, to give its parameters rows")


def random_forward(module: nn.Module, reason: str) -> str:
    """Why a forward that draws random numbers gets no rows, naming the submodules that draw
    them (dropout, drop path: timm's BEiT, EVA-02, CrossViT, Hiera in training mode)."""
    drawing = [name or type(module).__name__ for name, sub in module.named_modules()
               if sub.training and (
                   (isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0)
                   or ("DropPath" in type(sub).__name__ and getattr(sub, "drop_prob", 0) > 0))]
    if not drawing:
        return reason
    shown = ", ".join(drawing[:3]) + (f" and {len(drawing) - 3} more" if len(drawing) > 3 else "")
    return (f"its forward draws random numbers in training mode ({shown}: dropout or drop path "
            "run again inside it), which a recomputation per example cannot draw as the "
            "forward pass did: set their rate to 0 (or call them outside the module) to give "
            "its parameters rows")


def _given_a_cache(call) -> bool:
    """Whether the call was given a key/value cache of ``transformers`` (a ``Cache``) that
    its recomputation keeps (one filled from empty by the call is left out: :mod:`.caches`)."""
    return any(caches.is_cache(leaf) for k, leaf in enumerate(call.leaves) if k not in call.fresh_caches)


def cache_updated(reason: str) -> str:
    """Why a module given a key/value cache gets no rows: its forward appended this pass's
    keys to the cache, so a recomputation per example finds the batch's there.

    A cache of ``transformers`` the call filled from empty is left out of the recomputation
    instead (:mod:`.caches`: GraniteMoE-SWA's attention with the cache its model creates).
    """
    return (f"{reason}: its forward updates the key/value cache it was given (past_key_values), "
            "which already holds the batch's keys when it runs again per example: call the model "
            "with use_cache=False at tracked steps (transformers creates a cache in training mode "
            "too where config.use_cache is true) to give its parameters rows")


def _leave_out(module: nn.Module, state: Fallback, blind: Dict[str, str]) -> None:
    """The parameters the recomputation could not give rows (``blind``, name: why): refused
    in the pass's facts (the quantities leave them out, naming them), warned once."""
    params = computed_parameters(module, state.call)
    for name, reason in blind.items():
        facts.recording().refuse(params[name], f"{type(module).__name__}.{name}: {reason}")
        if (name, reason) not in state.warned:
            state.warned.add((name, reason))
            warnings.warn(f"cockpit-gradnoise: {type(module).__name__}.{name} gets no per-example "
                          f"rows from the torch.func fallback: {reason}", stacklevel=4)


def _refuse_layers_passed_in(module: nn.Module, call: Call) -> None:
    """Refuse the parameters of the layers ``module`` was called with as arguments.

    Perceiver's decoder gets the input embedding as an argument and multiplies by its
    weight: a use of that weight that neither the embedding's rule nor the recomputation
    of ``module`` (which holds the argument's parameters constant) sees. The embedding's
    rows would miss that use's contributions: silently wrong, so refused (left out, named).
    """
    own = {id(p) for p in module.parameters()}
    reason = (f"its layer was passed as an argument to {type(module).__name__}, whose forward "
              "may use its parameters directly, a use no rule sees: call the layer itself "
              "(or use the parameter in a layer of its own) to give it rows")
    recorded = facts.recording()
    for leaf in call.leaves:
        if isinstance(leaf, nn.Module):
            for param in leaf.parameters():
                if param.requires_grad and id(param) not in own:
                    recorded.refuse(param, f"{type(leaf).__name__}: {reason}")


def _refuse(module: nn.Module, state: Fallback, reason: str) -> None:
    """No rows for ``module``'s parameters: warned once, and the reason recorded in the
    pass's facts, for the quantities' warning about the parameters without results."""
    state.refused = reason
    recorded = facts.recording()
    for name, param in computed_parameters(module, state.call).items():
        recorded.reasons.setdefault(id(param), f"{type(module).__name__}.{name}: {reason}")
    if reason not in state.warned:
        state.warned.add(reason)
        warnings.warn(
            f"cockpit-gradnoise: {type(module).__name__} ({', '.join(direct_parameters(module))}) "
            f"gets no per-example rows from the torch.func fallback: {reason}", stacklevel=3,
        )


def run(extension, module: nn.Module, g_inp, g_out) -> None:
    """Save ``extension``'s results on ``module``'s direct parameters, if it has the fallback.

    Called by the package's extensions on the modules that have the
    fallback (their one choice point); does nothing for others. The first
    active extension to reach the module computes every active extension's
    results from the call its forward hook kept; each extension takes its
    own, and the last frees the call. A module called several times in the forward pass
    has its calls' contributions summed per example at the end of the backward pass
    (:func:`_arrive`, :mod:`.several`). A second backward hook of a module called once in
    the forward pass it recorded (two forward passes, one backward pass of both) finds the
    call taken: the rows already saved are removed and the module refused.
    """
    state = getattr(module, ATTRIBUTE, None)
    if not isinstance(state, Fallback) or extension.savefield not in SAVEFIELDS:
        return
    if state.arrivals is not None or (state.results is None and state.call is not None
                                      and len(state.calls) > 1):
        _arrive(module, state, extension, g_out)  # one of several calls: summed at the end
        return
    if state.results is None:
        if state.call is None:
            if state.taken:
                for param in direct_parameters(module).values():
                    if hasattr(param, extension.savefield):
                        delattr(param, extension.savefield)
                _refuse(module, state, "it was called more than once in one forward pass")
            return
        active = active_savefields()
        if _after_backward(state) or _own_block(module):
            _defer(module, state, g_out, active or [extension.savefield])
            return
        state.params = computed_parameters(module, state.call)
        state.results = compute(module, state, g_out, active or [extension.savefield])
        if state.results:
            state.refused, state.computed = None, True
        state.pending = set(active) | {extension.savefield}
    _save(state, state.params, extension.savefield, state.results.pop(extension.savefield, {}))
    state.pending.discard(extension.savefield)
    if not state.pending:  # every active extension has its results: free the call
        state.call, state.results, state.taken, state.params = None, None, True, None


def _after_backward(state: Fallback) -> bool:
    """Whether the computation needs gradients the backward pass has not reached yet: those
    flowing into the children (the module's hook runs when its output's gradient arrives)."""
    form = state.closed_form is not None and state.call.one_input is not None
    # Also the later outputs' gradients (.capture._keep_later_gradients), which may come later.
    later = state.call.outputs is not None and len(state.call.outputs) > 1
    return not form and (later or any(child.viewed for child in state.call.children))


def _own_block(module: nn.Module) -> bool:
    """Whether ``module`` is also a block (:mod:`.blocks`) that kept this call: its output's hook,
    which may take its parameters over (torchvision's Swin attention, :mod:`.windows`), comes
    after the module's own (the survey hooked it later), so the fallback waits for the end of
    the backward pass, which it skips where the block took over."""
    block = module.__dict__.get(BLOCK_ATTRIBUTE)
    return block is not None and block.call is not None


def _defer(module: nn.Module, state: Fallback, g_out, savefields: List[str]) -> None:
    """Leave the computation to the end of the backward pass, once per backward pass; a
    second use of the module in the same pass is noted (and refused there)."""
    if state.deferred is None:
        state.deferred, state.used_twice = g_out, False
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(functools.partial(_compute_after_backward, module, state, savefields))
    elif g_out[0] is not state.deferred[0]:
        state.used_twice = True


def _compute_after_backward(module: nn.Module, state: Fallback, savefields: List[str]) -> None:
    """Compute and save every active extension's results (:func:`_defer`), free the call."""
    g_out, state.deferred = state.deferred, None
    if id(module) in facts.recording().inside_blocks:  # a block took it over after (.blocks)
        state.call, state.results, state.taken = None, None, True
        return
    if state.used_twice:
        _refuse(module, state, "it was called more than once in one forward pass")
        results = {}
    else:
        results = compute(module, state, g_out, savefields)
    if results:
        state.refused, state.computed = None, True
    params = computed_parameters(module, state.call)
    for savefield, values in results.items():
        _save(state, params, savefield, values)
    state.call, state.results, state.taken = None, None, True


def _save(state: Fallback, params: Dict[str, nn.Parameter], savefield: str, values: Dict[str, Tensor]):
    """Save one extension's results on the parameters; note the children's (``"child.name"``)."""
    for name, value in values.items():
        setattr(params[name], savefield, value)
        if "." in name:
            state.borrowed.add(id(params[name]))


def _arrive(module: nn.Module, state: Fallback, extension, g_out) -> None:
    """A backward hook of one of the several calls of ``module`` in the forward pass: its
    output gradients kept, the sum per example left to the end of the backward pass."""
    for param in direct_parameters(module).values():  # (none before the sum is saved)
        if hasattr(param, extension.savefield):
            delattr(param, extension.savefield)
    arrivals = state.arrivals
    if arrivals is None:
        arrivals = state.arrivals = several.Arrivals()
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(functools.partial(_sum_after_backward, module, state))
    arrivals.savefields.update(active_savefields() or [extension.savefield])
    call = state.arriving  # (its first output's hook, .capture, ran just before)
    if call is None or not any(call is other for other in state.calls):
        arrivals.stale = True  # a call of an earlier forward pass
        return
    arrivals.grads.setdefault(id(call), (call, g_out))


def _sum_after_backward(module: nn.Module, state: Fallback) -> None:
    """End of the backward pass: the calls' contributions summed per example, reduced and
    saved (:mod:`.several`), or the module refused, naming why."""
    calls = list(state.calls)
    if id(module) not in facts.recording().inside_blocks:  # (a block took it over after: .blocks)
        results = _summed_results(module, state, calls, state.arrivals)
        if isinstance(results, str):
            _refuse(module, state, f"it was called {len(calls)} times in one forward pass, and {results}")
        else:
            state.refused, state.computed = None, True
            params = computed_parameters(module, calls[-1])
            for savefield, values in results.items():
                _save(state, params, savefield, values)
    state.arrivals, state.call, state.calls, state.results, state.taken = None, None, [], None, True


def _summed_results(module: nn.Module, state: Fallback, calls: List[Call],
                    arrivals: "several.Arrivals"):
    """``{savefield: {name: result}}`` of the calls summed per example, or why not (a string)."""
    if arrivals.stale:
        return "a call of another forward pass reached this backward pass (its rows are other examples)"
    if any(id(call) not in arrivals.grads and call.later_grads for call in calls):
        return ("a later output of one of its calls reached the loss and its first did not "
                "(the package computes a call when the gradient of its first output arrives)")
    reached = [arrivals.grads[id(call)] for call in calls if id(call) in arrivals.grads]
    if not reached:
        return "no call's gradient arrived"
    params = computed_parameters(module, calls[-1])
    if any(set(computed_parameters(module, call)) != set(params) for call, _ in reached):
        return "its calls use different parameters of its children"
    parts = []
    for call, g_out in reached:
        _refuse_layers_passed_in(module, call)
        grads = output_gradients(call, g_out)
        layout = layout_of(state, call)
        reason = refusal(module, call, grads, layout)
        if reason is not None:
            return f"one of them cannot be computed: {reason}"
        blind_outputs = [p for p in grads if p not in layout.outputs] + call.unhooked
        grads = {p: g for p, g in grads.items() if p in layout.outputs}
        examples = next(iter(grads.values())).shape[0]
        parts.append(several.Part(call, batched_leaves(call, examples, layout), layout.children,
                                  grads, blind_outputs))
    sizes = {next(iter(part.grads.values())).shape[0] for part in parts}
    if len(sizes) > 1:
        return f"its calls' outputs lead with different sizes {sorted(sizes)}"
    params = {name: p.detach() for name, p in params.items()}
    numel = sum(p.numel() for p in params.values())
    size = cost_model.examples_per_chunk(2 * max(numel, 1), next(iter(params.values())).element_size())
    blind: Dict[str, str] = {}
    chunks = several.summed_contributions(module, state, params, parts, sizes.pop(), size, blind)
    try:
        results = sum_check.reduced_and_checked(module, state, params, [
            (part.call, part.children, part.grads) for part in parts], chunks, sorted(arrivals.savefields))
    except Refused as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - vmap cannot run this forward per example
        return f"torch.func.vmap cannot run its forward per example ({type(error).__name__}: {error})"
    _leave_out(module, state, blind)
    return results
