"""Hooks that run BackPACK's first-order extensions without making outputs views.

BackPACK's ``extend`` gives every module a forward hook that stores
``module.input0`` and ``module.output`` and a ``register_full_backward_hook``
that runs the active extensions. Both get in the way of models as people
write them:

- a full backward hook turns the module's output into a view, so an in-place
  operation on it (``ReLU(inplace=True)``, a ResNet's ``out += identity``,
  torchvision's ``result += input``) fails in the forward pass;
- ``module.output = output`` raises ``TypeError`` on a module with a
  submodule called ``output`` (every Hugging Face BERT layer), and containers
  get the attributes too.

:func:`add_hooks` instead gives every module that has parameters of its own
(``parameters(recurse=False)``; containers get nothing) one forward hook,
which keeps the call's inputs and output, detached, on a small record, and
registers a tensor hook on the output (``output.register_hook``): a tensor hook
makes no view, and PyTorch documents that a hook registered before an in-place
modification receives the gradient with respect to the value before it (the
autograd notes, "Behavior of Tensor hooks when Tensor is modified in-place";
``tests/test_hooks.py`` checks it). That gradient is the layer's output
gradient, with which the hook runs BackPACK's own dispatch of every active
extension, ``extension(module, g_inp, g_out)``, then the context's extension
hook (Cockpit's), as BackPACK's ``hook_run_extensions`` does (a first-order
rule's parameter methods are then called without BackPACK's generic steps,
:mod:`.direct`). For the time of the dispatch only, the record is shown to the
rules under BackPACK's names
(``module.input0``, ``input1``, ..., ``module.output``), written into the
module's ``__dict__`` so that they shadow, and never replace, a submodule of
that name; they are removed right after.

What BackPACK's first-order rules read, and what is given here:

- ``module.input0`` (every weight rule): the input as the layer saw it. If it
  was modified in place between the forward and the backward pass (its
  version counter moved), the hook refuses with an error naming the layer.
- ``module.output``: its shape (convolutions), ``data_ptr`` and ``grad_fn``
  (``ModuleExtension.__call__`` looks up second-order quantities by them; a
  first-order extension has none); only the RNN and LSTM rules read its
  values, and their output is checked as the input is.
- ``g_inp``: read by no first-order rule (BackPACK's or this package's); it
  is not computed yet when the output's gradient arrives, and is given as
  ``None`` for each input.
- ``g_out``: ``(output gradient,)``, of the first output for modules that
  return a tuple (RNN, LSTM), as BackPACK's ``module.output = output[0]``.

Second-order extensions (Cockpit's ``HessTrace``, ``TICDiag``) backpropagate
through every module, including those without parameters, and are refused
with the fix (``prepare_model(model, use_converter=True)``).

Memory: the record is emptied after the module's backward pass (BackPACK's
``memory_cleanup``), unless the backpack context was given
``retain_graph=True``. A forward pass without a backward pass leaves nothing
on the module: the record hangs on the graph and goes with it. Under
``torch.no_grad()``, inside ``backpack.disable()``, inside ``torch.func``
transforms and while the rules run, the forward hook stores nothing.

Several calls of one module in one forward pass (a tied or reused layer) each
get their own record, so each use is dispatched with its own input; the
records of one module in one forward pass whose backward pass has not run yet
are marked ``repeated`` (:func:`_note_call`), and their contributions are summed
per example (:mod:`.repeated`).

Idle hooks: a prepared model carries one :class:`Switch`, shared by all its
modules (:func:`install_switch`). It is on by default and stays on unless a
:class:`~cockpit_gradnoise.Tracker` turns it off for steps at which no
quantity needs per-example results (:mod:`cockpit_gradnoise.arming`). While it
is off, the package's hooks (these, the fallback's, the tied uses') are taken
out of the modules' hook tables (:func:`park`) and put back, in their places,
when it is turned on: a module without hooks takes ``nn.Module.__call__``'s
fast path, so a forward and backward pass costs what the plain model's does
(with the hooks in place, returning at once, they cost about 1% of the MLP's
step on one thread: the slow path of ``__call__`` and a Python call per
hooked module, with caches cold from the layers' work, issue 21). A copy
(``copy.deepcopy``, pickling) of a model whose hooks are parked gets them back
in its own tables (:class:`Parked`), and starts on. A hook that runs asks
the switch first all the same (:func:`idle`). The switch notes whether the
last forward pass with gradients went unrecorded (it counts as such from the
moment the hooks are parked), so a tracked step whose forward pass was not
recorded is refused, never computed from nothing.
"""

import functools
import sys
import weakref
from typing import Callable, Optional, Tuple

from cockpit_gradnoise.extensions import facts, own_index, precision, tensor_parallel

import torch
from backpack import disable
from backpack.context import CTX
from torch import Tensor, nn

#: A module's flag that it carries these hooks (a plain attribute: it survives
#: ``copy.deepcopy`` and pickling, as the hook, a module-level function, does).
HOOKED_FLAG = "_cgn_hooked"

#: The attribute (in ``module.__dict__``) of a prepared model's modules holding its :class:`Switch`.
SWITCH_ATTR = "_cgn_switch"

#: Modules whose first-order rules read the values of ``module.output``.
READS_OUTPUT = (nn.RNN, nn.LSTM)

_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)

#: The forward pass being recorded: a count the model's forward pre-hook moves
#: (:func:`new_forward`), so that calls of two forward passes are never taken for one's.
_FORWARD = [0]


class Call:
    """One call of a hooked module, as its rules see it in the backward pass.

    Attributes:
        inputs: The positional inputs, tensors detached (they share storage
            and version counter with the originals).
        kwargs: The keyword arguments, as given.
        output: The (first) output, detached.
        versions: The tensors' version counters after the forward pass:
            ``{position: version}`` of the inputs, ``"output"`` for the output.
        repeated: Whether the module ran more than once in this forward pass
            (set on every such call by :func:`_note_call`).
        forward: The forward pass it belongs to (:func:`new_forward`'s count).
    """

    __slots__ = ("inputs", "kwargs", "output", "versions", "repeated", "forward", "__weakref__")

    def __init__(self, args: tuple, kwargs: dict, output: Tensor):
        inputs, versions = [], {}
        for i, a in enumerate(args):  # one loop, no generator: a call of every layer
            if isinstance(a, Tensor):
                versions[i] = a._version
                a = a.detach()
            inputs.append(a)
        versions["output"] = output._version
        self.inputs, self.kwargs, self.output, self.versions = tuple(inputs), kwargs, output.detach(), versions
        self.repeated, self.forward = False, _FORWARD[0]

    def clear(self):
        """Let go of the tensors (after the backward pass)."""
        self.inputs, self.kwargs, self.output = (), {}, None


class Switch:
    """Whether the package's hooks on one prepared model record its forward passes.

    Attributes:
        armed: ``True`` (the default): the hooks are in place and record each
            forward pass for the extensions. ``False``: they are parked
            (:func:`park`; set on a switch without its model, as a copy's before
            :func:`install_switch`, they stay in place and return at once).
        missed: Whether the last forward pass with gradients enabled went
            unrecorded (``True`` from the moment the hooks are parked until a
            forward pass records).
        step: The step ``armed`` was last set for (``None``: never set), named in errors.
    """

    __slots__ = ("_armed", "missed", "step", "_model")

    def __init__(self):
        self._armed, self.missed, self.step = True, False, None
        self._model: Optional[weakref.ref] = None  # the model whose hooks it parks

    @property
    def armed(self) -> bool:
        return self._armed

    @armed.setter
    def armed(self, value: bool):
        value = bool(value)
        if value == self._armed:
            return
        self._armed = value
        if not value:
            self.missed = True  # no hook sees the forward passes to come
        self._apply()

    def _apply(self):
        """Park the model's hooks or put them back, as ``armed`` says."""
        model = None if self._model is None else self._model()
        if model is not None:
            (unpark if self._armed else park)(model)

    def __reduce__(self):
        # A copy (copy.deepcopy, pickling) is another model: it starts armed, as a
        # freshly prepared model does, whatever its original's tracker had set.
        return (Switch, ())


#: Module hook tables that hold the package's hooks -> their tables of flags.
_TABLES = {
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
}

#: The attribute (in ``module.__dict__``) of a module's :class:`Parked` hooks.
PARKED_ATTR = "_cgn_parked"

#: The attribute (in ``model.__dict__``) of the functions ``f(model)`` run when the model's
#: hooks are parked (:func:`on_park`).
ON_PARK_ATTR = "_cgn_on_park"


class Parked:
    """The package's hooks of one module, out of its hook tables while the switch is off.

    ``tables``: ``[(table, flag tables, keys of the table when parked, {key: (hook,
    flags)})]``; the tables are the module's own dicts, so a copy of the module
    (whose memo maps them to the copy's tables) puts the hooks back into its own.
    """

    __slots__ = ("tables",)

    def __init__(self, tables: list):
        self.tables = tables

    def restore(self):
        """Put each hook back under its key, with its flags, where it was in its table."""
        for table, flag_tables, order, ours in self.tables:
            for key, (hook, flags) in ours.items():
                table[key] = hook
                for flag_table, flag in zip(flag_tables, flags):
                    if flag is not None:
                        flag_table[key] = flag
            rank = {key: i for i, key in enumerate(order)}
            keys = sorted(table, key=lambda key: rank.get(key, len(order)))  # stable
            if keys != list(table):  # hooks registered while parked go after the parked ones
                items = [(key, table[key]) for key in keys]
                table.clear()
                table.update(items)

    def __reduce__(self):
        return (_restored_copy, (self.tables,))


def _restored_copy(tables: list) -> None:
    """A copy's :class:`Parked` (its tables are the copy's): the hooks go back; nothing stays parked."""
    Parked(tables).restore()


def _park_module(module: nn.Module):
    tables = []
    for name, flag_names in _TABLES.items():
        table = module.__dict__.get(name)
        keys = [key for key, hook in table.items() if isinstance(hook, eager_under_compile)] if table else ()
        if not keys:
            continue
        flag_tables = tuple(module.__dict__.get(flag_name, {}) for flag_name in flag_names)
        order = list(table)
        ours = {key: (table.pop(key), tuple(flags.pop(key, None) for flags in flag_tables))
                for key in keys}
        tables.append((table, flag_tables, order, ours))
    if tables:
        module.__dict__[PARKED_ATTR] = Parked(tables)


def park(model: nn.Module):
    """Take the package's hooks (the :class:`eager_under_compile` ones) out of every
    module's hook tables; :func:`unpark` puts them back."""
    for module in model.modules():
        if module.__dict__.get(PARKED_ATTR) is None:
            _park_module(module)
    for forget in model.__dict__.get(ON_PARK_ATTR, ()):
        forget(model)


def on_park(model: nn.Module, forget: Callable[[nn.Module], None]):
    """Run ``forget(model)`` whenever ``model``'s hooks are parked (:func:`park`), once however
    often it is asked: it lets go of what the last recorded forward pass left on the model.

    Asked by whoever installs such a record (the tied uses', :func:`.uses.install`);
    ``forget`` is a module-level function, so that the model still copies and pickles.
    """
    functions = model.__dict__.setdefault(ON_PARK_ATTR, [])
    if forget not in functions:
        functions.append(forget)


def unpark(model: nn.Module):
    """Put back the hooks :func:`park` took out, each where it was."""
    for module in model.modules():
        parked = module.__dict__.pop(PARKED_ATTR, None)
        if parked is not None:
            parked.restore()


def install_switch(model: nn.Module) -> Switch:
    """Give every module of ``model`` the model's :class:`Switch` (kept if it has one),
    which parks and puts back the hooks of ``model``'s modules from now on."""
    switch = model.__dict__.get(SWITCH_ATTR)
    if not isinstance(switch, Switch):
        switch = Switch()
    for module in model.modules():
        module.__dict__[SWITCH_ATTR] = switch
    switch._model = weakref.ref(model)
    switch._apply()  # hooks added since (a prepared model prepared again) follow the switch
    return switch


def switch_of(model: nn.Module) -> Optional[Switch]:
    """The :class:`Switch` of a prepared model, or ``None``."""
    return model.__dict__.get(SWITCH_ATTR)


def idle(module: nn.Module) -> bool:
    """Whether ``module``'s hooks are switched off; a forward hook asks first.

    With gradients enabled, it also notes on the switch whether this forward
    pass goes unrecorded (:attr:`Switch.missed`).
    """
    switch = module.__dict__.get(SWITCH_ATTR)
    if switch is None:
        return False
    if torch.is_grad_enabled():
        switch.missed = not switch.armed
    return not switch.armed


def has_own_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters itself (not only through submodules)."""
    return next(module.parameters(recurse=False), None) is not None


class eager_under_compile:  # noqa: N801 (used as a function)
    """``hook``, run as Python under ``torch.compile`` rather than traced by TorchDynamo.

    Traced, a hook's arguments (a module's name, the module) are constants of
    the graph, so TorchDynamo compiles it again for every module until its
    cache limit makes it give up; the hook ends a graph anyway (it hooks a
    tensor's gradient). The class's call is ``torch._dynamo.disable``'d once
    TorchDynamo is imported (:func:`~cockpit_gradnoise.track` imports it;
    importing it here would take seconds), about 0.4 us per call in eager
    mode. A class, so that a prepared model pickles (a disabled function does
    not).
    """

    _disabled = False

    def __init__(self, hook: Callable):
        self.hook = hook
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and not eager_under_compile._disabled:
            eager_under_compile.__call__ = dynamo.disable(eager_under_compile._call)
            eager_under_compile._disabled = True

    def _call(self, *args, **kwargs):
        return self.hook(*args, **kwargs)

    __call__ = _call


def add_hooks(model: nn.Module) -> nn.Module:
    """Give every module of ``model`` with parameters of its own the hooks (in place).

    Modules already hooked are left alone, so a second call adds nothing.

    Args:
        model: The network.

    Returns:
        ``model``.
    """
    for name, module in model.named_modules():
        if has_own_parameters(module) and not module.__dict__.get(HOOKED_FLAG, False):
            module.register_forward_hook(
                eager_under_compile(functools.partial(_store_call, name or type(module).__name__)),
                with_kwargs=True,
            )
            module.__dict__[HOOKED_FLAG] = True
    return model


def _store_call(name: str, module: nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook: keep the call and hook the gradient of its (first) output."""
    if idle(module):
        return
    if not (torch.is_grad_enabled() and disable.should_store_io()):
        return
    if facts.recording().call is not None or _functorch_active():  # the rules' own call
        return
    first = output[0] if isinstance(output, tuple) else output
    if not (isinstance(first, Tensor) and first.requires_grad):
        return
    index = own_index.index_of(module, first)  # learned positions: the index it built
    call = Call(args if index is None else (index,), kwargs if index is None else {}, first)
    if index is not None:
        own_index.note(call, module)
    _note_call(module, call)
    hook = functools.partial(_run_extensions, name, module, call)
    base = _linear_base(module, first)
    if base is None:
        first.register_hook(hook)
    else:  # the gradient of the matrix product, in the output's shape
        base.register_hook(lambda grad: hook(grad.view(first.shape)))


def _linear_base(module: nn.Module, output: Tensor) -> Optional[Tensor]:
    """The result of ``F.linear`` of which ``output`` is a view, where it is one.

    ``F.linear`` on an input of three or more dimensions returns a view of its
    matrix product (``[N, out]``), and a hook on a view is lost when the view is
    modified in place (the view's node is replaced; timm's NaFlexViT adds its
    position table to its projection's output with ``add_``): hooked on that
    product, which no other operation reads, the gradient arrives, with respect to
    the value before the change, as for any other output. Only for ``nn.Linear``'s
    own forward, and a view of all of it in the same order.
    """
    base = output._base
    if (base is None or type(module).forward is not nn.Linear.forward or not base.requires_grad
            or base.numel() != output.numel() or not base.is_contiguous()
            or not output.is_contiguous() or output.storage_offset() != base.storage_offset()):
        return None
    return base


#: The attribute (in ``module.__dict__``) of a module's :class:`_Calls`.
CALLS_ATTR = "_cgn_calls"


def new_forward() -> None:
    """A forward pass of a prepared model begins (``uses``' pre-hook on the model)."""
    _FORWARD[0] += 1


class _Calls:
    """The calls of one module in one forward pass whose backward pass has not run yet,
    held weakly (a call whose graph is gone goes with it). Not copied with the model."""

    __slots__ = ("forward", "refs")

    def __init__(self, forward: int = -1):
        self.forward, self.refs = forward, []

    def __reduce__(self):
        return (_Calls, ())


def _note_call(module: nn.Module, call: Call) -> None:
    """Keep ``call`` among ``module``'s calls of this forward pass; where another is
    pending (not yet cleared by its backward pass), mark them all ``repeated``."""
    calls = module.__dict__.get(CALLS_ATTR)
    if not isinstance(calls, _Calls) or calls.forward != call.forward:
        calls = module.__dict__[CALLS_ATTR] = _Calls(call.forward)
    if not calls.refs:  # the first call of this forward pass (every layer's, most layers' only)
        calls.refs = [weakref.ref(call)]
        return
    pending = [c for c in (ref() for ref in calls.refs) if c is not None and c.output is not None]
    for other in pending:
        other.repeated = call.repeated = True
    calls.refs = [weakref.ref(c) for c in pending] + [weakref.ref(call)]


def _run_extensions(name: str, module: nn.Module, call: Call, grad_output: Tensor):
    """Tensor hook on the output: BackPACK's dispatch of the active extensions."""
    extensions = CTX.active_exts
    if extensions and call.output is not None:
        if extensions is not _FIRST_ORDER[0]:  # one check per `with backpack(...)`: its tuple
            _refuse_second_order(extensions)
            _FIRST_ORDER[0] = extensions
        _refuse_modified(name, module, call)
        _dispatch(module, call, extensions, (grad_output,))
    if not CTX.retain_graph:
        call.clear()


#: The last tuple of active extensions found first-order (``CTX.active_exts``, a new tuple
#: for each ``with backpack(...)``): held, so that its ``id`` is never another's.
_FIRST_ORDER = [None]


def _shown(module: nn.Module, call: Call, g_out: Tuple[Tensor]):
    """``(inputs, output, g_out)`` as the rules see them: this process's shards under tensor
    parallelism (:mod:`.tensor_parallel`; ``None``: refused, no rule runs), low-precision
    factors as the layer computed with them, in float32 (:mod:`.precision`)."""
    local = tensor_parallel.local_call(module, call.inputs, call.output, g_out)
    if local is None:
        return None
    inputs, output, g_out = local
    return precision.shown_inputs(module, inputs, output), output, precision.shown_grad_outputs(g_out)


def _dispatch(module: nn.Module, call: Call, extensions, g_out: Tuple[Tensor]):
    """Run ``extensions`` on ``module`` with the call shown under BackPACK's names."""
    shown = _shown(module, call, g_out)
    if shown is None:  # refused (tensor parallelism): the names shown, no rule runs
        extensions, shown = (), (call.inputs, call.output, g_out)
    inputs, output, g_out = shown
    # In __dict__, so that they shadow a submodule or parameter of that name
    # for the time of the dispatch and leave it untouched.
    names = _NAMES[len(inputs)] if len(inputs) < len(_NAMES) else _names(len(inputs))
    attributes = module.__dict__
    hidden = {key: attributes[key] for key in names if key in attributes}
    attributes.update(zip(names, inputs))
    attributes["output"] = output
    # On the backward pass, for rules that need more than BackPACK's names give (.hf).
    backward = facts.recording()
    backward.call = call
    try:
        g_inp = (None,) * len(call.inputs)
        debug = CTX.debug
        for extension in extensions:
            if debug:
                print("[DEBUG] Running extension", extension, "on", module)
            extension(module, g_inp, g_out)
        CTX.extension_hook(module)
    finally:
        backward.call = None
        for key in names:
            attributes.pop(key, None)
        attributes.update(hidden)


def _names(inputs: int) -> Tuple[str, ...]:
    """BackPACK's names of a call's ``inputs`` inputs and its output: ``input0``, ..., ``output``."""
    return (*(f"input{i}" for i in range(inputs)), "output")


#: :func:`_names` of calls of up to 7 inputs, made once.
_NAMES = tuple(_names(inputs) for inputs in range(8))


def _refuse_second_order(extensions):
    """Second-order extensions need hooks on every module (BackPACK's own)."""
    for extension in extensions:
        if extension.expects_backpropagation_quantities():
            raise RuntimeError(
                f"{type(extension).__name__} is a second-order BackPACK extension (as Cockpit's "
                "HessTrace and TICDiag request): it needs BackPACK's hooks on every module. "
                "Prepare the model with cockpit_gradnoise.prepare_model(model, "
                "use_converter=True), or leave these quantities out."
            )


def _refuse_modified(name: str, module: nn.Module, call: Call):
    """The rules need the input (and an RNN's output) as the layer saw it."""
    inputs, versions = call.inputs, call.versions
    changed = [f"input {i}" for i, version in versions.items()
               if i != "output" and inputs[i]._version != version]
    if isinstance(module, READS_OUTPUT) and call.output._version != versions["output"]:
        changed.append("output")
    if changed:
        raise RuntimeError(
            f"{name} ({type(module).__name__}): its {' and '.join(changed)} was modified in "
            "place after the forward pass, and the per-example results need the values the "
            "layer saw: make the operation that modifies it out of place (e.g. `x = x + y` "
            "for `x += y`)."
        )
