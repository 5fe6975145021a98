"""How a prepared model uses its parameters: tied parameters, embeddings without the batch.

:func:`install` (one call in ``prepare_model``) finds the tied parameters
(:mod:`.tied`) and installs three forward hooks: on the model, before its
forward pass (the batch size, from its first tensor argument, and a fresh
record of the pass) and after it (:func:`.batchless.find_broadcasts` for the
embedding calls recorded); on each ``nn.Embedding`` and each layer that holds
a tied parameter (how often it ran, and an embedding's index without the
batch dimension). The record of a pass lives on the model (:class:`Uses`,
shared by the marked layers), so a copy of the model has its own.

In the backward pass, :func:`run` wraps each of this package's extensions'
work on a layer: after the layer's module extension saved its results, it
records the layer (:mod:`.facts`), replaces the results of an embedding
broadcast over the batch by exact ones, combines the uses of tied
parameters, and removes the results of what cannot be computed (recording
why in the facts: the quantities refuse it with an error naming the parameter).
"""

from typing import Dict, List, Optional

from cockpit_gradnoise.extensions import (
    batchless,
    deferred_norms,
    facts,
    hooks,
    own_index,
    precision,
    repeated,
    scaled_embedding,
    sharded,
    tied,
)
from cockpit_gradnoise.extensions.fallback import layout, regroup
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.savefields import TIED_ATTR

import torch
from torch import Tensor, nn

#: The attribute of the model and its marked layers that holds their :class:`Uses`.
USES_ATTR = "_cgn_uses"


class Uses:
    """The tied groups of a model, and what its current forward pass did."""

    def __init__(self, groups: List[tied.TiedGroup], holders=()):
        self.groups = groups
        self.holders: List[nn.Module] = list(holders)  # the layers that hold a tied parameter
        self.new_forward(None)

    def new_forward(self, examples: Optional[int], storages=()):
        """A forward pass of ``examples`` examples (``None``: unknown) begins; ``storages``:
        the addresses of its tensor arguments' storages."""
        self.examples, self.storages = examples, set(storages)
        self.calls: Dict[nn.Module, int] = {}
        self.inputs: Dict[nn.Module, Tensor] = {}  # of the marked layers, not BackPACK's input0
        self.broadcasts: Dict[nn.Module, batchless.Broadcast] = {}
        self.suspects: Dict[nn.Module, List[batchless.Broadcast]] = {}  # of every call
        #: The lookups' autograd nodes of the embeddings that built their index (.own_index),
        #: and those whose table was also used otherwise in the pass (why: refused).
        self.built: Dict[nn.Module, list] = {}
        self.used_otherwise: Dict[nn.Module, str] = {}
        #: The tied layers' calls (their output's and input's autograd nodes), and the tied
        #: parameters an operation took outside them (why: refused), :func:`_tied_used_directly`.
        self.tied_calls: Dict[nn.Module, list] = {}
        self.tied_otherwise: Dict[int, str] = {}
        for group in self.groups:
            group.new_pass()

    def __getstate__(self):
        return {"groups": self.groups, "holders": self.holders}

    def __setstate__(self, state):
        self.__init__(state["groups"], state.get("holders", ()))


def _storage(tensor: Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _forget(model: nn.Module):
    """Let go of what the last recorded forward pass left (its layers' inputs)."""
    uses = model.__dict__.get(USES_ATTR)
    if uses is not None and (uses.calls or uses.broadcasts):
        uses.new_forward(None)


def _begin_forward(model, args, kwargs):
    if idle(model):  # nothing recorded; let go of what an earlier forward pass recorded
        _forget(model)
        return
    hooks.new_forward()
    tensors = [value for value in list(args) + list(kwargs.values()) if isinstance(value, Tensor)]
    first = tensors[0] if tensors else None
    examples = first.shape[0] if first is not None and first.dim() > 0 else None
    model.__dict__[USES_ATTR].new_forward(examples, map(_storage, tensors))
    if torch.is_grad_enabled():  # layers on rows that are not examples: their blocks hooked
        regroup.survey(model, args, kwargs, examples)


def _end_forward(model, args, kwargs, output):
    if idle(model):
        return
    uses = model.__dict__[USES_ATTR]
    if torch.is_grad_enabled():  # the fallback's calls recorded: which inputs are per example
        layout.learn(model, args, kwargs, uses.examples)
    if uses.broadcasts or uses.suspects or uses.built:
        earlier = {(module, k): call for module, calls in uses.suspects.items()
                   for k, call in enumerate(calls) if call is not uses.broadcasts.get(module)}
        consumers = batchless.find_broadcasts(output, {**uses.broadcasts, **earlier}, uses.examples)
        _tables_used_otherwise(uses, consumers)
    if torch.is_grad_enabled() and any(module not in uses.calls for module in uses.holders):
        _tied_used_directly(uses, batchless.consumers_of(output))


def _tables_used_otherwise(uses: Uses, consumers) -> None:
    """Note the embeddings that built their index (:mod:`.own_index`) whose weight an
    operation of the pass took outside their calls' lookups (ProphetNet's decoder looks its
    positions up again through ``_forward``, which no hook sees): the rule would miss that use."""
    for module, nodes in uses.built.items():
        weight_node = nodes[0].next_functions[0][0]
        users = {consumer for consumer, _ in consumers.get(weight_node, [])}
        if users - set(nodes):
            uses.used_otherwise[module] = (
                f"its layer ({type(module).__name__}) builds its index, and its weight is also "
                f"used outside its calls ({len(users - set(nodes))} more operations take it "
                "directly, as ProphetNet's decoder looks its positions up again through "
                "_forward), which no hook sees: take every lookup through the layer's own "
                "calls (or give the other use a layer of its own) to give it rows")


def _tied_used_directly(uses: Uses, consumers) -> None:
    """Note the tied parameters whose weight an operation of the pass took outside the calls
    of the layers that hold it, where one of those layers did not run: NeoMME's masked-LM
    head multiplies by ``unembedding_projection.weight`` (tied to its embedding's
    ``embedding_projection``) without calling that layer, a use no rule sees, so the rows
    combined over the layers that ran would miss it (silently, as a gradient off by it)."""
    for module in uses.holders:
        if module in uses.calls:
            continue
        for attribute in module.__dict__.get(TIED_ATTR, {}):
            param = getattr(module, attribute, None)
            if param is None or not param.requires_grad or id(param) in uses.tied_otherwise:
                continue
            node = param.view_as(param).grad_fn.next_functions[0][0]  # its AccumulateGrad
            inside = set()
            for holder, calls in uses.tied_calls.items():
                if any(p is param for p in holder.parameters(recurse=False)):
                    for call in calls:
                        inside |= _takers_in_call(call, node)
            others = [taker for taker, _ in consumers.get(node, []) if taker not in inside]
            if others:
                uses.tied_otherwise[id(param)] = (
                    f"it is tied, and {len(others)} operation(s) of the forward pass took it "
                    f"directly ({others[0].name()}, as hidden @ {type(module).__name__}.{attribute}) "
                    f"outside the calls of the layers that hold it, a use no rule sees: call the "
                    f"layer itself, or untie it (tie_word_embeddings=False in transformers)")


def _takers_in_call(call, node, depth: int = 8) -> set:
    """The autograd nodes of one layer call (from its output's node down to, not past, its
    input's) that take ``node`` (the weight's accumulator) as an operand."""
    output, stop = call
    found, seen, stack = set(), set(), [(output, 0)]
    while stack:
        current, level = stack.pop()
        if current is None or current is stop or current in seen or level > depth:
            continue
        seen.add(current)
        for child, _ in current.next_functions:
            if child is node:
                found.add(current)
            elif child is not None:
                stack.append((child, level + 1))
    return found


def _after_layer(module, args, output):
    if idle(module):
        return
    uses = module.__dict__[USES_ATTR]
    uses.calls[module] = uses.calls.get(module, 0) + 1
    if TIED_ATTR in module.__dict__ and isinstance(output, Tensor) and output.grad_fn is not None:
        given = args[0] if args and isinstance(args[0], Tensor) else None
        uses.tied_calls.setdefault(module, []).append((output.grad_fn, getattr(given, "grad_fn", None)))
    # An embedding subclass may take something else (Blenderbot's and LED's learned
    # positions take the input's torch.Size and build the index inside: .own_index).
    first = output[0] if isinstance(output, tuple) and output else output  # as the hooks read it
    built = own_index.index_of(module, first)
    index = uses.inputs[module] = args[0] if built is None else built
    if built is not None:
        output = first
        uses.built.setdefault(module, []).append(output.grad_fn)
    if (isinstance(module, nn.Embedding) and isinstance(index, Tensor)
            and isinstance(output, Tensor) and output.grad_fn is not None):
        # A model input, or an index whose rows the survey saw follow the batch (.regroup).
        from_inputs = _storage(index) in uses.storages or regroup.embedding_rows_are_examples(module)
        if batchless.suspect(index, uses.examples, from_inputs):
            uses.broadcasts[module] = batchless.Broadcast(
                index, output.shape, output.grad_fn, uses.examples, from_inputs)
            uses.broadcasts[module].built = built is not None
        else:
            uses.broadcasts.pop(module, None)
        if module in uses.broadcasts:  # every call's, for a layer called several times (.repeated)
            uses.suspects.setdefault(module, []).append(uses.broadcasts[module])


def install(model: nn.Module) -> nn.Module:
    """Mark ``model``'s tied parameters and install the hooks above; return ``model``.

    Again on a prepared model (after tying or untying), the marks are renewed
    and each hook stays installed once.
    """
    uses = model.__dict__.get(USES_ATTR)
    if uses is None or _ROOT_HOOKED not in model.__dict__:
        uses = model.__dict__[USES_ATTR] = Uses([])
        model.__dict__[_ROOT_HOOKED] = True
        model.register_forward_pre_hook(eager_under_compile(_begin_forward), with_kwargs=True)
        model.register_forward_hook(eager_under_compile(_end_forward), with_kwargs=True)
    hooks.on_park(model, _forget)  # when the model's hooks are parked (hooks.park)
    for module in model.modules():
        module.__dict__.pop(TIED_ATTR, None)
    uses.groups = tied.mark(model)
    uses.holders = [module for module in model.modules() if TIED_ATTR in module.__dict__]
    for module in model.modules():
        if isinstance(module, nn.Embedding) or TIED_ATTR in module.__dict__:
            module.__dict__[USES_ATTR] = uses
            if _LAYER_HOOKED not in module.__dict__:
                module.__dict__[_LAYER_HOOKED] = True
                module.register_forward_hook(eager_under_compile(_after_layer))
    return model


_ROOT_HOOKED, _LAYER_HOOKED = "_cgn_uses_root_hooked", "_cgn_uses_layer_hooked"


def _drop(extension, param, recorded: facts.BackwardFacts, why: str) -> None:
    """Remove ``extension``'s result from ``param`` (where it wrote one) and refuse the
    parameter, saying ``why`` (the quantities leave it out, warning)."""
    if hasattr(param, extension.savefield):
        delattr(param, extension.savefield)
    recorded.refuse(param, why)


def _ran_twice(extension, module: nn.Module, recorded: facts.BackwardFacts) -> bool:
    """Whether ``module`` ran more than once in the forward pass (T5 calls its shared
    embedding in the encoder and in the decoder); then drop and refuse its parameters."""
    uses = module.__dict__[USES_ATTR]
    if uses.calls.get(module, 0) <= 1:
        return False
    for param in module.parameters(recurse=False):
        _drop(extension, param, recorded, (
            f"its layer ({type(module).__name__}) ran {uses.calls[module]} times in one "
            "forward pass, and BackPACK keeps the last input of a layer only"))
    return True


def _may_hand_over(recorded) -> bool:
    """Whether the rule about to run may hand its norms over, to be unscaled at the pass's end
    (:mod:`.deferred_norms`): inside the pass the facts are of, and not while the hooks of
    :func:`.sharded.reduce_in_backward` are armed (FSDP2, tensor parallelism), which read a
    layer's per-example norms inside the pass (GradientNoiseScale's gradient sent there)."""
    return deferred_norms.ENABLED and recorded.may_defer() and not sharded.armed_in_backward()


def _rule_ran(call, module: nn.Module, g_inp, g_out, recorded, deferring: bool) -> bool:
    """Whether a rule covers ``module`` (``call(module, g_inp, g_out)``, the extension's work,
    returns ``False`` where none does); where ``deferring``, its norms are handed over while it
    runs, to be unscaled at the pass's end (:mod:`.deferred_norms`)."""
    recorded.deferring = deferring
    try:
        return call(module, g_inp, g_out) is not False
    finally:
        recorded.deferring = False


def run(extension, module: nn.Module, g_inp, g_out, call):
    """``call(module, g_inp, g_out)`` (the extension's work on ``module``; ``False`` if no
    rule covers it), then the above."""
    recorded = facts.recording()
    dispatched = recorded.call
    uses = module.__dict__.get(USES_ATTR)
    if dispatched is not None and uses is None and not dispatched.repeated:
        # The package's hooks (.hooks), a layer without embedding or tied parameter, called
        # once: none of the below applies (no autocast refusal: the hooks keep what the layer
        # computed with; no tied use, broadcast or repeated call): the rule, the record.
        # Nothing reads the rule's results before the pass ends: its norms may be unscaled
        # with the other layers' then (.deferred_norms).
        if _rule_ran(call, module, g_inp, g_out, recorded, _may_hand_over(recorded)):
            recorded.record(extension, module, g_out)
        return
    if _autocast_without_hooks(module, recorded, g_out):
        return
    batch_free = _batch_free_call(uses, module)
    if _refuse_used_otherwise(extension, module, uses, recorded) or repeated.defers(
            extension, module, g_out, batch_free):
        return  # refused (its rule would miss a use); or one of several calls: summed per
        # example at the end of the backward pass
    # A layer whose parameters are all tied, called several times: each call one use of the tie.
    by_tie = uses is not None and repeated.summed_by_tie(module, dispatched, batch_free)
    if uses is not None and not by_tie and _ran_twice(extension, module, recorded):
        return
    before = tied.values_before(extension, module)
    # Neither broadcast nor tied: nothing below reads the results, whose norms may be unscaled
    # with the other layers' at the pass's end (.deferred_norms).
    deferring = (_may_hand_over(recorded) and not module.__dict__.get(TIED_ATTR)
                 and (uses is None or module not in uses.broadcasts))
    if not _rule_ran(call, module, g_inp, g_out, recorded, deferring):  # no rule: nothing written
        return
    recorded.record(extension, module, g_out)
    if uses is None:
        return
    broadcast = uses.broadcasts.get(module)
    if broadcast is not None:
        _broadcast_results(extension, module, broadcast, recorded, g_out[0])
    # The call's own input where the layer ran several times (the record keeps the last call's),
    # as the rules see it (low-precision inputs widened: .precision, shown by .hooks).
    inputs = module.__dict__.get("input0") if by_tie else uses.inputs.get(module)
    refused = tied.combine(extension, module, inputs, g_out[0], before, dispatched,
                           _tied_calls(uses, module))
    for attribute in module.__dict__.get(TIED_ATTR, {}):
        param = getattr(module, attribute)
        why = refused.get(attribute) or uses.tied_otherwise.get(id(param))
        if why is not None:
            _drop(extension, param, recorded, why)


def _tied_calls(uses: Uses, module: nn.Module) -> Dict[int, int]:
    """``{id(group): calls}``: how many calls of the layers holding each of ``module``'s tied
    parameters this forward pass made (the uses to combine before letting go of them)."""
    counts = {}
    for group in module.__dict__.get(TIED_ATTR, {}).values():
        counts[id(group)] = sum(uses.calls.get(holder, 0) for holder in uses.holders
                                if any(g is group for g in holder.__dict__[TIED_ATTR].values()))
    return counts


def _refuse_used_otherwise(extension, module: nn.Module, uses: Optional[Uses],
                           recorded: facts.BackwardFacts) -> bool:
    """Refuse the parameters of an embedding that built its index and whose weight the pass
    also used outside its calls (:func:`_tables_used_otherwise`); whether it did."""
    if uses is None or module not in uses.used_otherwise:
        return False
    for param in module.parameters(recurse=False):
        _drop(extension, param, recorded, uses.used_otherwise[module])
    return True


def _batch_free_call(uses: Optional[Uses], module: nn.Module) -> bool:
    """Whether a call of the embedding ``module`` in the forward pass was not read per example:
    applied without the batch dimension (broadcast) or refused (:meth:`.batchless.Broadcast.refusal`)."""
    calls = () if uses is None else uses.suspects.get(module, ())
    return any(call.exact or call.refusal() is not None for call in calls)


def _autocast_without_hooks(module: nn.Module, recorded: facts.BackwardFacts, g_out) -> bool:
    """Refuse the parameters of a layer that ran under ``torch.autocast`` in a model extended
    by ``backpack.extend`` alone (whether it was refused).

    BackPACK's hooks keep the float32 input the layer was given while its output gradient
    arrives in the autocast dtype, and its rules crash on the mix (``expected m1 and m2
    to have the same dtype``) inside ``loss.backward()``. The package's hooks
    (``prepare_model``) keep what the layer computed with (:mod:`.precision`); here the
    layer is left without results and the quantities raise, naming the parameters and
    the fix, once the backward pass is over.
    """
    if recorded.call is not None or not precision.is_bilinear(module):  # the package's hooks
        return False
    given, grad = getattr(module, "input0", None), g_out[0] if g_out else None
    if not (isinstance(given, Tensor) and isinstance(grad, Tensor) and given.is_floating_point()
            and grad.is_floating_point() and given.dtype != grad.dtype):
        return False
    for param in module.parameters(recurse=False):
        recorded.refuse(param, (
            f"its layer ({type(module).__name__}) ran under torch.autocast (input {given.dtype}, "
            f"output gradient {grad.dtype}) in a model extended by backpack.extend alone: "
            "prepare the model with cgn.prepare_model(model) (or cgn.track(model)) instead, "
            "whose hooks keep the input the layer computed with"), setup=True)
    return True


def _broadcast_results(extension, module, broadcast, recorded, grad_output):
    param = module.weight
    if not param.requires_grad or not hasattr(param, extension.savefield):
        return
    reason = broadcast.refusal()
    if reason is None and broadcast.exact and TIED_ATTR in module.__dict__:
        reason = "it is tied and applied without the batch dimension"
    if reason is None and broadcast.exact and not broadcast.built and scaled_embedding.lookup_gradient(
            module, grad_output) is None:
        reason = (f"it is applied without the batch dimension by {type(module).__name__}, "
                  "whose forward is not nn.Embedding's")
    if reason is None and broadcast.meetings and broadcast.gradient is None:
        reason = "the backward pass did not reach where its output meets the batch"
    if reason is not None:
        _drop(extension, param, recorded, reason)
    elif broadcast.exact:
        if broadcast.single:  # one example: its gradient is the batch's
            broadcast.gradient = grad_output.unsqueeze(0)
        value = batchless.embedding_results(module, broadcast, extension.savefield)
        setattr(param, extension.savefield, value)
        recorded.leading_sizes[id(param)] = broadcast.gradient.shape[0]
