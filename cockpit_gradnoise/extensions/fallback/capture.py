"""What the fallback keeps of a forward pass, on the modules that need it.

:func:`install_fallback` (called by ``prepare_model`` with the package's
``has_rule``) puts a forward hook (``with_kwargs=True``) on each module with
direct trainable parameters that no rule covers: it keeps the call's
positional and keyword arguments (detached, so no graph is held twice) until
the backward pass (:class:`Call`). The module's direct children get a
forward pre-hook and hook that record each of their calls during the
module's call (:class:`ChildCall`): the output, and the gradient that flows
into the child through each input that requires grad (the child is given a
view of it, whose gradient is kept).
"""

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from cockpit_gradnoise.extensions import facts, precision
from cockpit_gradnoise.extensions.fallback import caches, draws
from cockpit_gradnoise.extensions.fallback.closed_form import ClosedForm, look_alike
from cockpit_gradnoise.extensions.fallback.parameters import (
    attributes_before,
    attributes_set,
    clear_parameter_caches,
    direct_parameters,
)
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)

import torch
from backpack.context import CTX
from torch import Tensor, nn
from torch.utils import _pytree

#: The attribute of a module that :func:`install_fallback` equipped: its :class:`Fallback`.
ATTRIBUTE = "cgn_fallback"

#: The attribute (in ``__dict__``) of a module hooked as a block (:mod:`.blocks`): its ``Block``.
BLOCK_ATTRIBUTE = "cgn_block"

#: The savefields the fallback computes.
SAVEFIELDS = (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)


@dataclass
class Call:
    """One call of a module, as its forward hook saw it.

    Attributes:
        leaves: The tensors and other values of ``(args, kwargs)``, flattened
            (``torch.utils._pytree``); tensors detached.
        spec: How to rebuild ``(args, kwargs)`` from ``leaves``.
        versions: ``{leaf index: tensor._version}`` at the call, to see in-place changes.
        outputs: Positions of the output's tensors, in the order of the
            output gradients the backward hooks hand over: the output itself
            (``None``), or the indices of the tensors of an output tuple.
    """

    leaves: List[Any]
    spec: Any
    versions: Dict[int, int]
    outputs: Optional[Tuple[int, ...]]
    #: The autocast of the call (:func:`.precision.autocast_state`), re-entered to recompute it.
    autocast: Optional[Tuple[str, torch.dtype]] = None
    #: The calls of the module's direct children during this call, in order (:class:`ChildCall`).
    children: List["ChildCall"] = field(default_factory=list)
    #: The input of a call ``module(x)`` with one tensor and one tensor out (detached), else ``None``.
    one_input: Optional[Tensor] = None
    #: The leading sizes of the output's tensors (:func:`output_sizes`), for :mod:`.layout`.
    output_sizes: List[Optional[int]] = field(default_factory=list)
    #: The gradients of the later output tensors (positions 1, 2, ... of ``outputs``), which
    #: the hooks do not hand over: kept by tensor hooks as the backward pass reaches them.
    later_grads: Dict[int, Tensor] = field(default_factory=dict)
    #: Later outputs that require grad and are leaves (a parameter returned as it is): no
    #: hook on them (it would stay); whether they got a gradient is not known.
    unhooked: List[int] = field(default_factory=list)
    #: The call's own part of the autograd graph (:class:`Nodes`).
    nodes: "Nodes" = field(default_factory=lambda: Nodes())
    #: Whether the end of this backward pass checks that the first output's hook ran
    #: (:func:`_first_output_without_gradient`).
    watched: bool = False
    #: Indices of the leaves that are key/value caches this call filled from empty: ``None``
    #: in the recomputation (:mod:`.caches`).
    fresh_caches: FrozenSet[int] = frozenset()
    #: ``(shape, dtype, device)`` of the first output (a tensor), for its gradient of zeros
    #: where only later outputs reached the loss (:func:`_first_output_without_gradient`).
    first: Optional[Tuple[torch.Size, torch.dtype, torch.device]] = None
    #: The random state at the call's start in training mode (:mod:`.draws`), else ``None``.
    rng: Optional[draws.Snapshot] = None
    #: The first output (detached), if a tensor: a recomputation on each example alone (where
    #: it draws random numbers, or ``vmap`` cannot run it) is checked against it.
    output: Optional[Tensor] = None
    #: ``output._version`` right after the call (an in-place change after it is refused).
    output_version: int = 0
    #: The module's attributes the call set, as it found them (:func:`.parameters.attributes_set`).
    attributes: Dict[str, Any] = field(default_factory=dict)


class Nodes:
    """The autograd node of a call's (first) output and those of its tensor arguments: the
    call's own part of the graph lies between (:func:`.replay.used_by_forward`). Not copied
    with the model (autograd nodes cannot be): a copy has none."""

    def __init__(self, output=None, inputs: frozenset = frozenset()):
        self.output, self.inputs = output, inputs

    def __deepcopy__(self, memo):
        return Nodes()

    def __reduce__(self):
        return (Nodes, ())


@dataclass
class ChildCall:
    """One call of a direct child of a module with the fallback, during the module's call.

    The recomputation replays it (:class:`.replay._Replay`) instead of running it.

    Attributes:
        module: The child.
        output: Its output, detached, if one tensor (else ``None``: it is run again).
        version: ``output._version`` right after the call: a later in-place
            change makes the recorded value differ from what the child returned.
        grads: ``{leaf index: gradient}`` of the inputs that required grad, as
            the backward pass hands them to the child through its input only
            (each input was given to the child as a view of its own).
    """

    module: nn.Module
    output: Optional[Tensor] = None
    version: int = 0
    grads: Dict[int, Tensor] = field(default_factory=dict)
    #: Whether an input was given as a view whose gradient is kept.
    viewed: bool = False
    #: Copies of earlier calls' outputs this call received, taken before it ran (in case
    #: it changes them in place: ``ReLU(inplace=True)`` after a dropout).
    copies: List[Tuple["ChildCall", Tensor]] = field(default_factory=list)


@dataclass
class Fallback:
    """A module's fallback state.

    Attributes:
        call: The last call with gradients enabled, until its backward pass used it.
        refused: Why the last backward pass gave no rows (``None`` if it gave them).
        computed: Whether a backward pass computed rows with the fallback.
        warned: The reasons already warned about.
    """

    call: Optional[Call] = None
    refused: Optional[str] = None
    computed: bool = False
    warned: set = field(default_factory=set)
    #: Between the first and the last active extension of a backward hook: their results.
    results: Optional[Dict[str, Dict[str, Tensor]]] = None
    pending: set = field(default_factory=set)
    #: The call was used by a backward pass and no forward pass came since.
    taken: bool = False
    #: A closed form that gives the same contributions as the vmap (:func:`look_alike`).
    closed_form: Optional[ClosedForm] = None
    #: The children's calls of the module's call in progress (``None``: not recording).
    recording: Optional[List[ChildCall]] = None
    #: The output gradients of a computation left to the end of the backward pass
    #: (:func:`.running._compute_after_backward`), and whether another use of the module came.
    deferred: Optional[tuple] = None
    used_twice: bool = False
    #: ``id``s of the children's parameters it computed (:func:`.running.computed_parameters`).
    borrowed: set = field(default_factory=set)
    #: The parameters of the call whose results the active extensions are taking.
    params: Optional[Dict[str, nn.Parameter]] = None
    #: Which tensors of a call depend on the batch, per structure of its arguments
    #: (:mod:`.layout`, learned from a forward pass one example larger).
    layouts: Dict[str, Any] = field(default_factory=dict)
    #: Every call of the forward pass in progress or last recorded, in order (``call`` is the
    #: last): more than one for a module called several times (:mod:`.several`).
    calls: List[Call] = field(default_factory=list)
    #: The recorded forward pass is over (:func:`.layout.learn`): the next call starts a new
    #: list of ``calls``.
    sealed: bool = False
    #: The lengths of the key/value caches the call in progress was given (:mod:`.caches`).
    cache_lengths: Dict[int, List[int]] = field(default_factory=dict)
    #: The call whose first output's gradient arrived last (its hooks run next).
    arriving: Optional[Call] = None
    #: The calls of a module called several times that this backward pass reached, with their
    #: output gradients, until its end (:func:`.running.run`).
    arrivals: Optional[Any] = None
    #: The random state at the start of the call in progress, in training mode (:mod:`.draws`).
    rng: Optional[draws.Snapshot] = None
    #: Whether ``vmap`` met random numbers in its forward at an earlier step (:mod:`.running`).
    random: bool = False
    #: The module's own attributes at the start of the call in progress
    #: (:func:`.parameters.attributes_before`).
    before: Optional[dict] = None
    #: Whether the per-example contributions of ``vmap``'s route were checked to add up to the
    #: module's gradient from the batch (once, at its first tracked step: :mod:`.running`), and
    #: why they did not (``None``: they did, or not checked yet).
    sums_checked: bool = False
    not_summing: Optional[str] = None


# Which modules: direct trainable parameters and no rule -----------------------


def needs_fallback(module: nn.Module, has_rule: Callable[[nn.Module], bool]) -> bool:
    """Whether ``module`` has direct trainable parameters that no rule covers (``has_rule``)."""
    return bool(direct_parameters(module)) and not has_rule(module)


def install_fallback(model: nn.Module, has_rule: Callable[[nn.Module], bool]) -> List[str]:
    """Equip every module that needs it (:func:`needs_fallback`) with the fallback.

    Idempotent. The hook is a module-level function: it survives
    ``copy.deepcopy`` and pickling of the model.

    Args:
        model: The network.
        has_rule: Whether the package's extensions have a rule for a module
            (:func:`cockpit_gradnoise.extensions.has_rule`): the fallback is
            told, and asks nothing back.

    Returns:
        The names (``model.named_modules()``) of the modules that have it.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, ATTRIBUTE, None), Fallback):
            names.append(name)
        elif needs_fallback(module, has_rule):
            state = Fallback(closed_form=look_alike(module))
            setattr(module, ATTRIBUTE, state)
            module.register_forward_pre_hook(eager_under_compile(_start_recording), with_kwargs=True)
            module.register_forward_hook(eager_under_compile(_capture), with_kwargs=True)
            for child in module.children():
                _record_calls_of(child, state)
            names.append(name)
    return names


#: The attribute of a direct child of a module with the fallback: that module's :class:`Fallback`.
PARENT_ATTRIBUTE = "cgn_fallback_parent"


def _record_calls_of(child: nn.Module, state: Fallback):
    if getattr(child, PARENT_ATTRIBUTE, None) is None:
        child.register_forward_pre_hook(eager_under_compile(_child_inputs), with_kwargs=True)
        child.register_forward_hook(eager_under_compile(_child_output))
    setattr(child, PARENT_ATTRIBUTE, state)


def _start_recording(module, args, kwargs):
    """Forward pre-hook: record the calls of the direct children during this call, and the
    lengths of the key/value caches it is given (:mod:`.caches`)."""
    state = getattr(module, ATTRIBUTE, None)
    if state is not None:
        recording = torch.is_grad_enabled() and not idle(module)
        state.recording = [] if recording else None
        state.cache_lengths = caches.lengths(_pytree.tree_leaves((args, kwargs))) \
            if recording and caches.reads_none_as_no_cache(module) else {}
        if recording:  # computed again from the parameters, as in training mode
            clear_parameter_caches(module)
        state.before = attributes_before(module) if recording else None
        # Where a recomputation meets random numbers, the batch's draws are replayed from it.
        # (Not where a closed form takes the call: nothing runs again.)
        one_input = state.closed_form is not None and not kwargs and len(args) == 1
        state.rng = draws.snapshot((*args, *kwargs.values())) \
            if recording and module.training and not one_input else None


def _child_inputs(child, args, kwargs):
    """Forward pre-hook of a child: give it views of its inputs that require grad, whose
    gradients are then what flows into the child (not into other uses of the inputs)."""
    state = getattr(child, PARENT_ATTRIBUTE, None)
    if state is None or state.recording is None:
        return None
    record = ChildCall(child)
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    for earlier in state.recording:
        if any(_same_tensor(leaf, earlier) for leaf in leaves):
            record.copies.append((earlier, earlier.output.clone()))
    state.recording.append(record)
    if not any(isinstance(leaf, Tensor) and leaf.requires_grad for leaf in leaves):
        return None
    record.viewed = True
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            leaves[k] = leaf.view_as(leaf)
            leaves[k].register_hook(functools.partial(_keep_gradient, record, k))
    return _pytree.tree_unflatten(leaves, spec)


def _keep_gradient(record: ChildCall, k: int, grad: Tensor):
    record.grads[k] = grad.detach()


def _child_output(child, args, output):
    """Forward hook of a child: keep its output (one tensor) for the recomputation."""
    state = getattr(child, PARENT_ATTRIBUTE, None)
    if state is None or not state.recording or state.recording[-1].module is not child:
        return
    record = state.recording[-1]
    for earlier, copy in record.copies:
        if earlier.output._version != earlier.version:  # changed by this call: keep the copy
            earlier.output, earlier.version = copy, copy._version
    record.copies = []
    if isinstance(output, Tensor):
        record.output, record.version = output.detach(), output._version


def _same_tensor(leaf, earlier: ChildCall) -> bool:
    """Whether ``leaf`` is the (unchanged) output an earlier call recorded."""
    output = earlier.output
    return (isinstance(leaf, Tensor) and output is not None and leaf.data_ptr() == output.data_ptr()
            and leaf.shape == output.shape and output._version == earlier.version)


def tensor_positions(output) -> Optional[Tuple[int, ...]]:
    """The output's tensors as the backward hooks hand their gradients over."""
    if isinstance(output, Tensor):
        return None
    if isinstance(output, tuple):
        return tuple(i for i, value in enumerate(output) if isinstance(value, Tensor))
    return model_output_position(output) or ()  # () : no tensor whose gradient would be reported


def model_output_position(output) -> Optional[Tuple[int]]:
    """``(k,)`` for a ``transformers`` ``ModelOutput`` (a dict that ``output[k]`` indexes as
    the tuple of its values that are not ``None``) whose ``k``-th value is its one
    floating-point tensor, else ``None``. The backward hooks of a module see no tensor in a
    dict, so that tensor's own hook hands its gradient over instead (:func:`_capture`); a
    second floating-point tensor could carry gradient that no hook sees: not taken. Not
    whether it requires grad: the same in a pass without gradients (:mod:`.layout`)."""
    if not hasattr(output, "to_tuple") or not isinstance(output, dict):
        return None
    floating = [(k, leaf) for k, value in enumerate(output.to_tuple()) for leaf in _pytree.tree_leaves(value)
                if isinstance(leaf, Tensor) and leaf.is_floating_point()]
    return (floating[0][0],) if len(floating) == 1 and floating[0][1] is output[floating[0][0]] else None


def first_tensor(output) -> Optional[Tensor]:
    """The first tensor of a module's output in :mod:`torch.utils._pytree`'s order (``None``
    if it has none): the output itself, a tuple's first tensor, or a ``transformers``
    ``ModelOutput``'s (XLNet's and FSMT's models, the batch-first blocks around their
    sequence-first layers, return one; it is a dict, not a tuple)."""
    return next((leaf for leaf in _pytree.tree_leaves(output) if isinstance(leaf, Tensor)), None)


def output_sizes(output) -> List[Optional[int]]:
    """The leading sizes of the output's tensors, in the order of :func:`tensor_positions`."""
    positions = tensor_positions(output)
    tensors = [output] if positions is None else [output[p] for p in positions]
    return [t.shape[0] if t.dim() > 0 else None for t in tensors]


def _capture(module, args, kwargs, output):
    """Forward hook: keep the call's arguments for the backward pass (not under ``no_grad``,
    nor while the model's hooks are idle)."""
    if idle(module):
        return
    state = getattr(module, ATTRIBUTE, None)
    positions = tensor_positions(output)
    if state is None or not torch.is_grad_enabled() or positions == ():
        if state is not None:
            state.recording = None
        return  # no gradient to come (a torch.fx trace's proxies, too)
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    fresh = caches.filled_from_empty(leaves, state.cache_lengths) if state.cache_lengths else frozenset()
    versions = {k: leaf._version for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor)}
    input_nodes = frozenset(leaf.grad_fn for leaf in leaves
                            if isinstance(leaf, Tensor) and leaf.grad_fn is not None)
    leaves = [leaf.detach() if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    device = next((leaf.device.type for leaf in leaves if isinstance(leaf, Tensor)), "cpu")
    call = Call(leaves, spec, versions, positions, precision.autocast_state(device),
                children=state.recording or [], output_sizes=output_sizes(output))
    call.fresh_caches = fresh
    call.rng, state.rng = state.rng, None
    if state.before is not None:
        call.attributes, state.before = attributes_set(module, state.before), None
    if positions is None and not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
        call.one_input = leaves[0]
    state.recording = None
    # The calls of one forward pass of the model (sealed at its end) are kept together.
    earlier = [] if state.taken or state.sealed or state.call is None else state.calls
    state.calls, state.sealed = [*earlier, call], False
    state.call, state.results, state.taken = call, None, False
    first = output if positions is None else output[positions[0]] if positions else None
    call.nodes = Nodes(first.grad_fn if isinstance(first, Tensor) else None, input_nodes)
    if isinstance(first, Tensor):
        call.first = (first.shape, first.dtype, first.device)
        # Where vmap cannot run the module, it is run on each example alone and each output
        # checked against this one (.running._vmap_failed). (A view of it: no copy.)
        call.output, call.output_version = first.detach(), first._version
    if first is not None and first.requires_grad:
        # Which call the module's backward hooks that follow are of; steps without the
        # package's extensions free the arguments in the backward pass.
        first.register_hook(_releaser(state, call))
        if positions and not isinstance(output, tuple):  # a ModelOutput: no backward hook runs
            first.register_hook(functools.partial(_run_extensions, module))
    return _keep_later_gradients(module, call, output)


def _keep_later_gradients(module: nn.Module, call: Call, output) -> Optional[tuple]:
    """Hook the later output tensors that require grad: their gradients, where the backward
    pass brings one, are kept on ``call`` (one that gets none did not reach the loss).

    The hook goes on an alias of each (``view_as``), returned in its place: a later output
    can also lead to the first inside the module (an attention's weights to its output),
    and a hook on the tensor itself would add the gradient flowing back through the module
    to the one from outside, counting that path twice. ``None``: the output is unchanged.
    """
    replaced = list(output) if call.outputs and len(call.outputs) > 1 else None
    for p, position in enumerate((call.outputs or ())[1:], 1):
        tensor = output[position]
        if not tensor.requires_grad:
            continue
        if tensor.grad_fn is None:
            call.unhooked.append(p)
        else:
            alias = tensor.view_as(tensor)
            alias.register_hook(functools.partial(_keep_output_gradient, module, call, p))
            replaced[position] = alias
    if replaced is None:
        return None
    return type(output)._make(replaced) if hasattr(output, "_make") else tuple(replaced)  # a namedtuple


def _keep_output_gradient(module: nn.Module, call: Call, p: int, grad: Tensor):
    call.later_grads[p] = grad.detach()
    if not call.watched and active_savefields():
        call.watched = True
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(functools.partial(_first_output_without_gradient, module, call))


def _first_output_without_gradient(module: nn.Module, call: Call):
    """End of the backward pass: where a later output reached the loss and the first did not
    (CvT's last stage returns its hidden states, which the classifier does not use, then its
    class token), the first output's hook never ran and no extension saw the module. The
    first output did not reach the loss, so its gradient is exactly zero: the active
    extensions are run on the module with that gradient of zeros (one output's size), as
    the hook would have run them, and the later outputs' gradients the call kept
    (:func:`.running.compute`)."""
    state = getattr(module, ATTRIBUTE, None)
    if state is None or state.call is not call or state.taken or state.deferred is not None \
            or state.results is not None or state.arrivals is not None:
        return  # the first output's hook ran (or the call is gone)
    facts.recording().record_owner(module)
    shape, dtype, device = call.first  # (a tuple's first tensor: set with the hooks on the later)
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    for extension in CTX.get_active_exts():
        if getattr(extension, "savefield", None) in SAVEFIELDS:
            extension(module, (None,), (zeros,))


def _run_extensions(module: nn.Module, grad: Tensor) -> None:
    """The first output's tensor hook of a module that returns a ``ModelOutput``
    (:func:`model_output_position`): run the active extensions on the module with that
    gradient, as its backward hook would have (it sees no tensor in a dict)."""
    facts.recording().record_owner(module)
    for extension in CTX.get_active_exts():
        if getattr(extension, "savefield", None) in SAVEFIELDS:
            extension(module, (None,), (grad,))


def _releaser(state: Fallback, call: Call):
    kept = weakref.ref(call)  # (the graph must not keep a call the module let go of)

    def release(grad):
        state.arriving = kept()
        if not active_savefields():
            state.call, state.calls, state.taken = None, [], True

    return release


def active_savefields() -> List[str]:
    """The savefields of :data:`SAVEFIELDS` whose extensions run in this backward pass."""
    return [
        ext.savefield for ext in CTX.get_active_exts()
        if getattr(ext, "savefield", None) in SAVEFIELDS
    ]
