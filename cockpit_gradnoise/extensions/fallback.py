"""Exact per-example results of any module that uses its parameters directly, by ``torch.func``.

A module that uses its own parameters in ``forward`` (``x * self.gamma``,
``F.layer_norm(x, ..., self.weight, self.bias)``, a class token or a position
table added to its input) has no rule in the extension tables. Its
parameters' per-example contributions are still exact vector-Jacobian
products of that module's own forward pass, as Opacus computes them for
layers without a rule (``opacus/grad_sample/functorch.py``): with ``a_i`` the
module's input(s) of example ``i``, ``G_i`` the gradient of the batch's loss
with respect to its output of example ``i`` and ``f`` its forward pass,

.. math::

    x_i(\\theta) = \\Big(\\frac{\\partial f(a_i; \\theta)}{\\partial \\theta}\\Big)^{\\top} G_i ,

``torch.func.vmap`` over the examples of ``torch.func.vjp`` of the module's
forward with its own direct parameters as the primal. ``G`` is the
output gradient the backward pass hands the module, of the batch's loss: for
a mean-reduced loss it holds the ``1/N``, so ``x_i`` is the contribution
``c g_i`` of the package's contract, as for every other rule. The rest of the
network is computed as before; the vector-Jacobian product runs over the
module's own forward only, with its own parameters as the primal.

Per-layer reductions only: the per-example gradients of one module's
parameters, for a chunk of examples at a time (:func:`._cost.examples_per_chunk`),
are reduced at once to the three results the extensions save
(``||x_i||^2``, ``[sum_i x_i, sum_i x_i**2]``, ``sum_i x_i``) and freed.
A bias added by ``F.linear`` and used nowhere else is held back to the end
(it is small): the gradient at that call's output holds the terms of each
contribution, so its structural zeros (an attention key's bias) are exact
zeros, as the native Linear rule makes them (:class:`_LinearBiases`,
:func:`.sums.structural_zeros`).

How it is wired:

- :func:`install_fallback` (called by ``prepare_model``) puts a forward hook
  (``with_kwargs=True``) on each module with direct trainable parameters that
  no rule covers: it keeps the call's positional and keyword arguments
  (detached, so no graph is held twice) until the backward pass;
- the module's direct children get a forward pre-hook and hook that record
  each of their calls during the module's call (:class:`ChildCall`): the
  output, and the gradient that flows into the child through each input that
  requires grad (the child is given a view of it, whose gradient is kept);
- the package's extensions call :func:`run` on every module BackPACK hands
  them; it computes, once per module and backward pass, the results of every
  active package extension, and saves each extension's own. The
  recomputation replays the children's calls instead of running them
  (:class:`_Replay`), so a module with children computes at the end of the
  backward pass, when the gradients flowing into them are there.

Refused, with a warning and without rows (never a silently wrong number):
a module none of whose inputs leads with the batch dimension of its output,
a module with a BatchNorm in training mode inside (its examples interact), a
forward pass ``vmap`` cannot run per example (random operations such as
dropout in training mode, data-dependent Python), and an input changed in
place after the call. Inside the recomputation, the hooks of the module and
its submodules are switched off (:func:`hooks_off`): BackPACK's would
overwrite the inputs it stored for the real backward pass.
"""

import contextlib
import functools
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device
from cockpit_gradnoise.extensions import _cost, precision
from cockpit_gradnoise.extensions._squares import (
    SMALLEST_UNSCALED,
    contributions_scale,
    needs_scale,
    saved_dtype,
    unscaled_norms,
    unscaled_sums,
)
from cockpit_gradnoise.extensions.hooks import eager_under_compile, idle
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.extensions.sums import structural_zeros

import torch
from backpack.context import CTX
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

#: The attribute of a module that :func:`install_fallback` equipped: its :class:`Fallback`.
ATTRIBUTE = "cgn_fallback"

_SAVEFIELDS = (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)


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


@dataclass
class ChildCall:
    """One call of a direct child of a module with the fallback, during the module's call.

    The recomputation replays it (:func:`replaying`) instead of running it.

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
    closed_form: Optional["ClosedForm"] = None
    #: The children's calls of the module's call in progress (``None``: not recording).
    recording: Optional[List[ChildCall]] = None
    #: The output gradients of a computation left to the end of the backward pass
    #: (:func:`_compute_after_backward`), and whether another use of the module came.
    deferred: Optional[tuple] = None
    used_twice: bool = False
    #: ``id``s of the children's parameters it computed (:func:`computed_parameters`).
    borrowed: set = field(default_factory=set)
    #: The parameters of the call whose results the active extensions are taking.
    params: Optional[Dict[str, nn.Parameter]] = None


# Which modules: direct trainable parameters and no rule -----------------------


def direct_parameters(module: nn.Module) -> Dict[str, nn.Parameter]:
    """``{name: parameter}`` of the trainable parameters ``module`` holds itself.

    Not those a submodule also holds: the module hands them to that layer
    (``attention.LinearAttention``'s ``in_proj_weight`` is its ``in_proj``'s weight).
    """
    # From ``_parameters``: ``named_parameters`` costs more than the fallback's closed forms'
    # reductions of a small module; the same parameter under two names counts once.
    seen = delegated_parameters(module) if module._modules else set()
    found = {}
    for n, p in module._parameters.items():
        if p is not None and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            found[n] = p
    return found


def computed_parameters(module: nn.Module, call: Optional["Call"]) -> Dict[str, nn.Parameter]:
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


def delegated_parameters(module: nn.Module) -> set:
    """``{id(param)}`` of the parameters ``module`` holds that a submodule holds too."""
    own = {id(p) for p in module._parameters.values() if p is not None}
    if not own:
        return set()
    below = {id(p) for child in module.children() for p in child.parameters()}
    return own & below


def needs_fallback(module: nn.Module) -> bool:
    """Whether ``module`` has direct trainable parameters that no rule of the package covers."""
    from cockpit_gradnoise.extensions import has_rule

    return bool(direct_parameters(module)) and not has_rule(module)


def install_fallback(model: nn.Module) -> List[str]:
    """Equip every module that needs it (:func:`needs_fallback`) with the fallback.

    Idempotent. The hook is a module-level function: it survives
    ``copy.deepcopy`` and pickling of the model.

    Returns:
        The names (``model.named_modules()``) of the modules that have it.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, ATTRIBUTE, None), Fallback):
            names.append(name)
        elif needs_fallback(module):
            state = Fallback(closed_form=look_alike(module))
            setattr(module, ATTRIBUTE, state)
            module.register_forward_pre_hook(eager_under_compile(_start_recording))
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


def _start_recording(module, args):
    """Forward pre-hook: record the calls of the direct children during this call."""
    state = getattr(module, ATTRIBUTE, None)
    if state is not None:
        recording = torch.is_grad_enabled() and not idle(module)
        state.recording = [] if recording else None


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


def _tensor_positions(output) -> Optional[Tuple[int, ...]]:
    """The output's tensors as the backward hooks hand their gradients over."""
    if isinstance(output, Tensor):
        return None
    if isinstance(output, tuple):
        return tuple(i for i, value in enumerate(output) if isinstance(value, Tensor))
    return ()  # no tensor whose gradient a backward hook would report


def _capture(module, args, kwargs, output):
    """Forward hook: keep the call's arguments for the backward pass (not under ``no_grad``,
    nor while the model's hooks are idle)."""
    if idle(module):
        return
    state = getattr(module, ATTRIBUTE, None)
    positions = _tensor_positions(output)
    if state is None or not torch.is_grad_enabled() or positions == ():
        if state is not None:
            state.recording = None
        return  # no gradient to come (a torch.fx trace's proxies, too)
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    versions = {k: leaf._version for k, leaf in enumerate(leaves) if isinstance(leaf, Tensor)}
    leaves = [leaf.detach() if isinstance(leaf, Tensor) else leaf for leaf in leaves]
    device = next((leaf.device.type for leaf in leaves if isinstance(leaf, Tensor)), "cpu")
    call = Call(leaves, spec, versions, positions, precision.autocast_state(device),
                children=state.recording or [])
    if positions is None and not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
        call.one_input = leaves[0]
    state.recording = None
    state.call, state.results, state.taken = call, None, False
    first = output if positions is None else output[positions[0]] if positions else None
    if first is not None and first.requires_grad:
        # Steps without the package's extensions free the arguments in the backward pass.
        first.register_hook(_releaser(state))


def _releaser(state: Fallback):
    def release(grad):
        if not _active_savefields():
            state.call, state.taken = None, True

    return release


def _active_savefields() -> List[str]:
    return [
        ext.savefield for ext in CTX.get_active_exts()
        if getattr(ext, "savefield", None) in _SAVEFIELDS
    ]


# Look-alikes: closed forms for modules that behave like a layer with a rule --------


@dataclass(frozen=True)
class ClosedForm:
    """Per-example contributions of a module recognized by its behaviour.

    Attributes:
        name: What it behaves like, for the checker.
        contributions: ``(module, x, G, eps) -> {name: x_i [N, *shape]}`` from
            the module's one input ``x`` and its output gradient ``G`` (a
            module-level function: the model stays picklable).
        eps: The layer norm's ``eps`` (``None`` for a layer scale).
    """

    name: str
    contributions: Callable
    eps: Optional[float] = None


def _positions(x: Tensor) -> Tuple[int, ...]:
    return tuple(range(1, x.dim() - 1))


def scale_contributions(module, x: Tensor, grad: Tensor, eps=None) -> Dict[str, Tensor]:
    """``y = x * gamma`` (``gamma [D]``, a layer scale): ``x_i = sum_p x_ip * G_ip``."""
    name = next(iter(direct_parameters(module)))
    return {name: (x * grad).sum(_positions(x)) if x.dim() > 2 else x * grad}


def layer_norm_contributions(module, x: Tensor, grad: Tensor, eps: float) -> Dict[str, Tensor]:
    """``y = F.layer_norm(x, (D,), weight, bias, eps)``: :mod:`.normalization`'s contributions."""
    from cockpit_gradnoise.extensions import normalization

    dims = _positions(x)
    normalized = normalization.layer_normalized(x, x.shape[-1:], eps)
    # x_hat * G in x_hat's buffer: it is needed no more.
    result = {"weight": normalization.sum_over(normalized.mul_(grad), dims)}
    if "bias" in direct_parameters(module):
        result["bias"] = normalization.shift_contributions(grad, dims)
    return result


def _probe(module: nn.Module, params: Dict[str, Tensor], x: Tensor, training: bool) -> Optional[Tensor]:
    """``module(x)`` in training mode or not, with ``params`` in place of its own; ``None`` if it fails.

    Both modes must match a closed form: a dropout that only acts in training
    mode must not make a look-alike.
    """
    modes = {m: m.training for m in module.modules()}
    try:
        module.train(training)
        with hooks_off(module), own_parameters(module, params), torch.no_grad():
            output = module.forward(x)
    except Exception:  # not a module of one input that runs in float64
        return None
    finally:
        for m, mode in modes.items():
            m.training = mode
    return output if isinstance(output, Tensor) and output.shape == x.shape else None


def look_alike(module: nn.Module) -> Optional[ClosedForm]:
    """A closed form if ``module`` computes a layer scale ``x * gamma`` or
    ``F.layer_norm(x, (D,), weight, bias, eps)`` (nanoGPT's ``LayerNorm``).

    Recognized by behaviour, once at installation: the module's forward on a
    random float64 input of shape ``(2, 3, D)``, with random float64 values in
    place of its parameters (vectors of size ``D``), in training and in
    evaluation mode, must agree with the closed form to ``1e-12`` relative,
    which tells ``eps`` values apart too. (A forward that branches on the
    input's values could pass the probe and differ elsewhere: the checker,
    :func:`cockpit_gradnoise.check_model`, compares on your own batch.)
    The closed forms are the native normalization rule's
    (:mod:`.normalization`), cheaper than the ``vmap``.
    """
    params = direct_parameters(module)
    shapes = {tuple(p.shape) for p in params.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1 or len(params) > 2:
        return None
    width = next(iter(shapes))[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, dtype=torch.float64, generator=generator)
    values = {n: torch.randn(width, dtype=torch.float64, generator=generator) for n in params}
    candidates = []
    if len(params) == 1:
        candidates.append((ClosedForm("layer scale x * gamma", scale_contributions), x * next(iter(values.values()))))
    if set(params) <= {"weight", "bias"} and "weight" in params:
        for eps in dict.fromkeys(e for e in (getattr(module, "eps", None), 1e-5, 1e-6, 1e-12)
                                 if isinstance(e, float)):
            expected = torch.nn.functional.layer_norm(x, (width,), values["weight"], values.get("bias"), eps)
            form = ClosedForm(f"F.layer_norm, eps={eps:g}", layer_norm_contributions, eps)
            candidates.append((form, expected))
    outputs = [_probe(module, values, x.clone(), training) for training in (True, False)]
    if any(output is None for output in outputs):
        return None
    for form, expected in candidates:
        if all((output - expected).abs().max() <= 1e-12 * expected.abs().max() for output in outputs):
            return form
    return None


# The computation -------------------------------------------------------------


@contextlib.contextmanager
def hooks_off(module: nn.Module):
    """Run ``module`` and its submodules without their hooks (restored afterwards).

    ``nn.Module.__call__`` skips every hook when these four dicts are empty:
    inside the recomputation BackPACK's forward hooks would overwrite the
    inputs stored for the real backward pass, its backward hooks are
    autograd Functions ``vmap`` cannot run, and a nested fallback's hook
    would replace its own saved call.
    """
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    # Through __dict__: nn.Module.__setattr__ costs a tenth of a small module's fallback.
    saved = [(m.__dict__, [m.__dict__[n] for n in names]) for m in module.modules()]
    try:
        for attributes, _ in saved:
            for n in names:
                attributes[n] = OrderedDict()
        yield
    finally:
        for attributes, hooks in saved:
            for n, hook in zip(names, hooks):
                attributes[n] = hook


def per_example_gradients(
    module: nn.Module, params: Dict[str, Tensor], call: Call, batched: Sequence[int],
    grads: Dict[int, Tensor], start: int, stop: int,
) -> Dict[str, Tensor]:
    """``{name: x_i}`` (``[stop - start, *shape]``) for examples ``start:stop``.

    The module's forward under ``vmap`` over the examples, with a copy of
    each direct parameter per example in place of its own (what
    ``torch.func.functional_call`` does, for these only, at a third of the
    cost under ``vmap``), then one ordinary backward pass to those copies: the
    gradient of example ``i``'s copy is ``x_i``, the vector-Jacobian product
    of the module's docstring. Its children are replayed (:class:`_Replay`):
    the recomputation runs the module's own operations only. ``batched`` are
    the indices of the leaves that lead with the batch dimension, ``grads``
    the output gradients by output position.
    """
    positions = list(grads)
    total = grads[positions[0]].shape[0]
    stop = min(stop, total)
    examples = tuple(call.leaves[k][start:stop] for k in batched)
    n = stop - start
    replay = _Replay(call.children, total, start, stop)
    copies = {name: p.expand(n, *p.shape).requires_grad_() for name, p in params.items()}
    recorded = replay.recorded_outputs()
    # vmap's arguments and results as flat tuples of tensors: its pytree work on dicts
    # was half of a small module's fallback.
    names, keys, own_end = list(copies), list(recorded), len(copies)
    examples_end = own_end + len(examples)

    def flat_forward(*flat):
        own = dict(zip(names, flat[:own_end]))
        outputs, sinks = forward(own, flat[own_end:examples_end], dict(zip(keys, flat[examples_end:])))
        return (*outputs, *sinks)

    def forward(own, examples, recorded):
        if call.one_input is not None:  # module(x): nothing to rebuild
            args, kwargs = (examples[0].unsqueeze(0),), {}
        else:
            leaves = list(call.leaves)
            for k, example in zip(batched, examples):
                leaves[k] = example.unsqueeze(0)
            args, kwargs = _pytree.tree_unflatten(leaves, call.spec)
        with own_parameters(module, own), replay.replacing(module, recorded):
            output = module.forward(*args, **kwargs)
        outputs = (output,) if call.outputs is None else tuple(output[call.outputs[p]] for p in positions)
        return outputs, tuple(sink for sink, _ in replay.sinks)

    biases = _LinearBiases([name for name, copy in copies.items()
                            if copy.dim() == 2 and name.endswith("bias")])

    def traced_forward(*flat):
        with biases.watching(dict(zip(names, flat[:own_end]))):
            results = flat_forward(*flat)
        biases.check_versions()
        return (*results, *biases.outputs)

    traced = traced_forward if biases.watched else flat_forward
    with hooks_off(module), _math_attention(), torch.enable_grad(), precision.autocast_as(call.autocast):
        results = torch.func.vmap(traced)(*copies.values(), *examples, *recorded.values())
    outputs, sinks = results[: len(positions)], results[len(positions) : len(results) - len(biases.names)]
    spread = results[len(results) - len(biases.names) :]  # F.linear's outputs, [n, ..., out]
    pairs = [(out, grads[p][start:stop].unsqueeze(1)) for out, p in zip(outputs, positions)]
    pairs += [(sink, cotangent) for sink, (_, cotangent) in zip(sinks, replay.sinks)]
    replay.check(any(_depends_on_copies(out) for out in outputs))
    pairs = [(out, g) for out, g in pairs if _depends_on_copies(out)]
    if not pairs:  # no output depends on the parameters: zero contributions
        return {name: torch.zeros_like(copy) for name, copy in copies.items() if "." not in name}, {}
    found = torch.autograd.grad([o for o, _ in pairs], [*copies.values(), *spread],
                                [g for _, g in pairs], allow_unused=True)
    # A direct parameter the forward did not use contributes exact zeros; a child's, nothing.
    contributions = {name: torch.zeros_like(copy) if x is None else x
                     for (name, copy), x in zip(copies.items(), found) if x is not None or "." not in name}
    return contributions, biases.terms(spread, found[len(copies) :], contributions)


class _LinearBiases(TorchFunctionMode):
    """In the recomputation: the outputs of the ``F.linear`` calls that add one of the
    ``watched`` copies (the examples' copies of 1-D parameters named ``*bias``: watching
    costs a Python call per operation, a quarter of a small layer scale's fallback) as
    their ``bias``.

    The gradient at such an output, ``[n, ..., out]``, holds the terms
    ``t_il`` (one per position ``l``) that the bias's contribution
    ``x_i = sum_l t_il`` adds up: with ``sum_l |t_il|`` at hand, its
    structural zeros (an attention key's bias: Swin's ``qkv`` bias) are told
    from rounding noise as the native Linear rule tells them
    (:func:`.sums.structural_zeros`). A copy any other operation uses is left
    out: not all its terms are known.
    """

    def __init__(self, watched: List[str]):
        super().__init__()
        self.watched = watched
        self.copies: Dict[int, str] = {}
        self.names: List[str] = []  # of each output, in order
        self.outputs: List[Tensor] = []
        self.versions: List[int] = []
        self.other_uses: set = set()

    @contextlib.contextmanager
    def watching(self, own: Dict[str, Tensor]):
        """Active, on ``own``'s copies (under ``vmap``: the examples' parts, as the module sees them)."""
        self.copies = {id(own[name]): name for name in self.watched}
        with self:
            yield

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):  # a size or a property: not a use
            return out
        bias = (kwargs.get("bias", args[2] if len(args) > 2 else None)
                if func is torch.nn.functional.linear else None)
        for leaf in _pytree.tree_leaves((args, kwargs)):
            name = self.copies.get(id(leaf)) if isinstance(leaf, Tensor) else None
            if name is None:
                continue
            if leaf is bias and out.dim() >= 2:
                self.names.append(name)
                self.outputs.append(out)
                self.versions.append(_version(out))
            else:
                self.other_uses.add(name)
        return out

    def check_versions(self):
        """After the forward: an output changed in place (``y.mul_(s)``, through a view too)
        holds no longer the gradient at ``F.linear``'s output; its bias is left out."""
        for name, out, version in zip(self.names, self.outputs, self.versions):
            if _version(out) != version:
                self.other_uses.add(name)

    def terms(self, outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]],
              contributions: Dict[str, Tensor]) -> Dict:
        """``{name: (sum_l |t_il| [n, out], number of terms)}`` of the copies used by these
        ``F.linear`` calls only, from ``vmap``'s results of their outputs and the gradients
        there; ``None`` for the other watched copies (so every chunk names the same)."""
        found: Dict[str, Optional[Tuple[Tensor, int]]] = {
            name: None for name in self.watched if name in contributions}
        for name, out, grad in zip(self.names, outputs, grads):
            if name in self.other_uses or name not in contributions:
                continue
            count = out[0].numel() // out.shape[-1]
            magnitudes = (torch.zeros_like(contributions[name]) if grad is None
                          else grad.abs().flatten(1, -2).sum(1))
            if found[name] is not None:
                magnitudes, count = found[name][0] + magnitudes, found[name][1] + count
            found[name] = (magnitudes, count)
        return found


def _version(tensor: Tensor) -> int:
    """The version counter of a tensor under ``vmap`` (its batched tensor's; the wrapper's
    stays 0), which in-place changes to it or to a view of it advance."""
    from torch._C import _functorch

    if _functorch.is_batchedtensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor._version


def _is_example(tensor) -> bool:
    """Whether a tensor under ``vmap`` is an example's part of a batch (``[1, ...]``)."""
    from torch._C import _functorch

    return (isinstance(tensor, Tensor) and _functorch.is_batchedtensor(tensor)
            and tensor.dim() > 0 and tensor.shape[0] == 1)


def _depends_on_copies(tensor) -> bool:
    """Whether a tensor computed under ``vmap`` depends on the parameters' copies."""
    from torch._C import _functorch

    if isinstance(tensor, Tensor) and _functorch.is_batchedtensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return isinstance(tensor, Tensor) and tensor.requires_grad


class _Replay:
    """The recomputation's stand-in for the module's children: their recorded calls.

    Each child's call returns the output it gave in the forward pass (a
    copy of example ``i``'s part) instead of running again: nothing below the
    module is recomputed, random operations inside a child (dropout,
    stochastic depth) give what they gave, and in-place changes to the
    returned value touch a copy. Where an input of the call depends on the
    module's own parameters, the output's dependence on them runs through
    that input only: the input becomes an output of the recomputation (a
    *sink*), with the gradient that flowed into the child through it in the
    backward pass as its cotangent (the child was given a view of it:
    :func:`_child_inputs`). So, with the sinks' cotangents, the
    vector-Jacobian product is the same as running the children.

    Run again instead: a child whose output was not one tensor, or one of
    whose parameter-dependent inputs did not lead with the batch dimension.
    Refused (:class:`_Refused`): calls in another order than recorded, and an
    output changed in place after its call (its recorded value is not what
    the child returned) if anything that depends on the parameters comes
    after it.
    """

    def __init__(self, children: List[ChildCall], examples: int, start: int, stop: int):
        self.children, self.examples, self.start, self.stop = children, examples, start, stop
        self.sinks: List[Tuple[Tensor, Tensor]] = []  # (input in the recomputation, cotangent)
        self.stale = False
        self._next = 0
        self._recorded: Dict[int, Tensor] = {}

    def _leads_with_batch(self, tensor: Optional[Tensor]) -> bool:
        return isinstance(tensor, Tensor) and tensor.dim() > 0 and tensor.shape[0] == self.examples

    def recorded_outputs(self) -> Dict[int, Tensor]:
        """``{call index: output of the examples}`` of the calls whose output leads with
        the batch dimension, for ``vmap``."""
        return {k: c.output[self.start : self.stop] for k, c in enumerate(self.children)
                if self._leads_with_batch(c.output)}

    @contextlib.contextmanager
    def replacing(self, module: nn.Module, recorded: Dict[int, Tensor]):
        self._recorded, self._next = recorded, 0
        saved = {}
        for child in module.children():
            if "forward" not in child.__dict__:
                saved[child] = child.forward
                child.forward = functools.partial(self._call, child, child.forward)
        try:
            yield
        finally:
            for child in saved:
                del child.forward

    def _call(self, child, forward, *args, **kwargs):
        k, self._next = self._next, self._next + 1
        if k >= len(self.children) or self.children[k].module is not child:
            raise _Refused("its children are called in another order than in the forward pass")
        record = self.children[k]
        leaves, _ = _pytree.tree_flatten((args, kwargs))
        # Replayed where the call's inputs are the examples' parts of batch-leading tensors
        # (never for a call on tensors without the batch, such as wpe(arange(T))).
        if k not in self._recorded or not any(_is_example(leaf) for leaf in leaves):
            return forward(*args, **kwargs)
        sinks = []
        for j, leaf in enumerate(leaves):
            if not _depends_on_copies(leaf):
                continue
            grad = record.grads.get(j)
            if not self._leads_with_batch(grad) or tuple(leaf.shape) != (1, *grad.shape[1:]):
                return forward(*args, **kwargs)  # no per-example gradient there: run it
            sinks.append((leaf, grad[self.start : self.stop].unsqueeze(1)))
        if sinks and self.stale:
            raise _Refused("a child's output that was changed in place is needed")
        self.sinks.extend(sinks)
        if record.output._version != record.version:
            self.stale = True
        return self._recorded[k].unsqueeze(0).clone()

    def check(self, outputs_depend: bool):
        """After the recomputation: refuse a stale output followed by parameter-dependent outputs."""
        if self.stale and outputs_depend:
            raise _Refused("a child's output that was changed in place is needed")


class _Refused(Exception):
    """The recomputation cannot replay the module's children exactly."""


@contextlib.contextmanager
def own_parameters(module: nn.Module, tensors: Dict[str, Tensor]):
    """``module``'s parameters named in ``tensors`` (``"child.name"`` for a child's) replaced
    by them (restored afterwards).

    Through ``_parameters``: ``setattr`` refuses a plain tensor under a parameter's name.
    """
    owners = {name: (module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
              for name in tensors}
    saved = {name: owner._parameters[attr] for name, (owner, attr) in owners.items()}
    try:
        for name, (owner, attr) in owners.items():
            owner._parameters[attr] = tensors[name]
        yield
    finally:
        for name, (owner, attr) in owners.items():
            owner._parameters[attr] = saved[name]


def _math_attention():
    """``scaled_dot_product_attention`` by its math form: the fused kernels' backward
    has no batching rule, and ``vmap`` would loop over the examples one by one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: the math form is what runs on CPU anyway
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


#: Bytes of contributions reduced at a time (:func:`norms_and_sums`): a block of columns
#: and its squares stay in a core's L2 cache, and the squares' buffer is reused. Reducing
#: the per-example gradients of HF ``Conv1D(384, 128)`` (``[32, 49152]`` float32, just
#: written) whole took 3 to 10 ms, in blocks of 512 KiB 1.5 ms (CPU, one thread).
BLOCK_BYTES = 2**19


def norms_and_sums(contributions: Tensor) -> Tuple[Tensor, Tensor]:
    """``(||x_i||^2 [N], [sum_i x_i, sum_i x_i**2])`` of contributions ``[N, *shape]``
    from one square of them.

    The results of :func:`._squares.squared_norms_of` and :func:`.sums.sums_of`
    (squares at a power-of-two scale where they could underflow, saved in
    float64 as theirs are), with the scale decided and the contributions
    squared once for both, a block of :data:`BLOCK_BYTES` at a time on the
    CPU. There the scale is decided after the fact: the unscaled squares are
    kept where the largest per-example norm shows a largest magnitude of at
    least :data:`._squares.SMALLEST_UNSCALED` (``max_i ||x_i||^2 >= numel *
    SMALLEST_UNSCALED**2``, numel per example), which spares the max-reduction
    of every layer but the tiny ones.
    """
    if needs_scale(contributions.dtype) and _device.on_host(contributions) and len(contributions):
        norms, sums = _blockwise(contributions)
        if float(norms.max()) >= contributions[0].numel() * SMALLEST_UNSCALED**2:
            return unscaled_norms(norms, None), sums
    scale = contributions_scale(contributions)
    norms, sums = _blockwise(contributions if scale is None else contributions * scale)
    return unscaled_norms(norms, scale), unscaled_sums(sums, scale)


def _blockwise(contributions: Tensor) -> Tuple[Tensor, Tensor]:
    """``(sum_k x_ik**2 [N], [sum_i x_i, sum_i x_i**2])`` over blocks of columns
    (:data:`BLOCK_BYTES`, on the CPU; whole elsewhere), in the contributions' dtype."""
    flat = contributions.reshape(len(contributions), -1)
    width = flat.shape[1]
    if contributions.requires_grad or not _device.on_host(contributions):
        squares = flat.square()
        sums = torch.stack([flat.sum(0), squares.sum(0)])
        return squares.sum(1), sums.view(2, *contributions.shape[1:])
    block = max(1, BLOCK_BYTES // max(1, len(flat) * flat.element_size()))
    sums = flat.new_empty(2, width)
    norms = flat.new_zeros(len(flat))
    for start in range(0, width, block):
        part = flat[:, start : start + block]
        squares = part.square()
        torch.sum(part, 0, out=sums[0, start : start + block])
        torch.sum(squares, 0, out=sums[1, start : start + block])
        norms += squares.sum(1)
    return norms, sums.view(2, *contributions.shape[1:])


def _reduced(chunk: Dict[str, Tensor]) -> Dict[str, Tuple[Tensor, Tensor]]:
    """``{name: (norms, sums)}`` of one chunk: :func:`norms_and_sums`, and on the CPU
    small contributions (:data:`BLOCK_BYTES`) of one shape and dtype together
    (:func:`norms_and_sums_together`: a layer norm's weight and bias)."""
    found, groups = {}, {}
    for name, x in chunk.items():
        if _device.on_host(x) and x.numel() * x.element_size() <= BLOCK_BYTES:
            groups.setdefault((x.shape, x.dtype), []).append(name)
        else:
            found[name] = norms_and_sums(x)
    for names in groups.values():
        together = torch.stack([chunk[n] for n in names])
        found.update(zip(names, norms_and_sums_together(together)))
    return found


def norms_and_sums_together(contributions: Tensor) -> List[Tuple[Tensor, Tensor]]:
    """``(||x_i||^2 [N], [sum_i x_i, sum_i x_i**2])`` of ``contributions[k]`` for each
    ``k`` (``[K, N, *shape]``: ``K`` small parameters of one shape), in a few operations
    for all, in :func:`._squares.saved_dtype` (float64).

    The results of :func:`norms_and_sums` without a scale: a float32 (or
    narrower) number's square is exact in float64 (48 bits of significand of
    53) and cannot underflow there, and the sums are saved in float64 anyway.
    Summed in float64 they are within float32's rounding bound, which the
    quantities take for the parameter's dtype.
    """
    wide = contributions.to(saved_dtype(contributions.dtype))
    squares = wide.square()
    norms = squares.flatten(start_dim=2).sum(2)  # [K, N]
    sums = torch.stack([wide, squares], 1).sum(2)  # [K, 2, *shape]
    return [(norms[k], sums[k]) for k in range(len(sums))]


def reduce_chunks(chunks: Iterator[Dict[str, Tensor]], savefields: Sequence[str]) -> Dict[str, Dict[str, Tensor]]:
    """``{savefield: {name: result}}`` from chunks of per-example contributions.

    ``||x_i||^2`` per example (:data:`BATCH_L2_SAVEFIELD`, ``[N]``, at a scale,
    saved in float64: no underflow, as every rule's, :mod:`._squares`),
    ``[sum_i x_i, sum_i x_i**2]`` (:data:`SUMS_SAVEFIELD`, ``[2, *shape]``,
    both from the same contributions, :mod:`.sums`) and ``sum_i x_i``
    (:data:`LOCAL_GRADIENT_SAVEFIELD`), all from one square of each chunk
    (:func:`norms_and_sums`); each chunk is freed once reduced.
    """
    norms: Dict[str, List[Tensor]] = {}
    totals: Dict[str, Tensor] = {}
    squares = BATCH_L2_SAVEFIELD in savefields or SUMS_SAVEFIELD in savefields
    for chunk in chunks:
        # Summed in float32 or wider (.precision).
        chunk = {name: precision.widened(x) for name, x in chunk.items()}
        if squares:
            parts = _reduced(chunk)
        else:  # the gradient alone
            parts = {name: (None, x.sum(0, keepdim=True)) for name, x in chunk.items()}
        for name, (part_norms, part) in parts.items():
            norms.setdefault(name, []).append(part_norms)
            totals[name] = part if name not in totals else totals[name] + part
    results: Dict[str, Dict[str, Tensor]] = {}
    if BATCH_L2_SAVEFIELD in savefields:  # (not None: the squares were formed)
        results[BATCH_L2_SAVEFIELD] = {
            name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in norms.items()}
    if SUMS_SAVEFIELD in savefields:
        results[SUMS_SAVEFIELD] = totals
    if LOCAL_GRADIENT_SAVEFIELD in savefields:
        results[LOCAL_GRADIENT_SAVEFIELD] = {name: sums[0] for name, sums in totals.items()}
    return results


def with_structural_zeros(chunks: Iterator[Tuple[Dict[str, Tensor], Dict]]) -> Iterator[Dict[str, Tensor]]:
    """The chunks' contributions, with those that come with their terms' magnitudes
    (:class:`_LinearBiases`) held back to a last chunk of all examples, where an element
    all of whose contributions are rounding noise (:func:`.sums.structural_zeros`) is set
    to exactly 0: gradient 0 and sd 0, as the native rules give (an attention key's bias)."""
    held: Dict[str, List[Tensor]] = {}
    found: Dict[str, List[Optional[tuple]]] = {}
    for contributions, terms in chunks:
        for name, magnitudes_and_count in terms.items():  # the same names in every chunk
            held.setdefault(name, []).append(contributions.pop(name))
            found.setdefault(name, []).append(magnitudes_and_count)
        yield contributions
    last = {}
    for name, parts in held.items():
        x = torch.cat(parts)
        counts = {None if part is None else part[1] for part in found[name]}
        if len(counts) != 1 or None in counts:  # terms unknown, or uses differing, somewhere
            last[name] = x
            continue
        magnitudes = torch.cat([part[0] for part in found[name]])
        eps = max(torch.finfo(x.dtype).eps, torch.finfo(magnitudes.dtype).eps)
        last[name] = x.masked_fill(structural_zeros(x, magnitudes, counts.pop(), eps), 0.0)
    if last:
        yield last


def refusal(module: nn.Module, call: Optional[Call], grads: Dict[int, Tensor]) -> Optional[str]:
    """Why ``module``'s per-example results cannot be computed from ``call`` (``None``: they can)."""
    if call is None:
        return "no call of the module was recorded in the forward pass (prepare the model first)"
    if 0 not in grads:  # the first output's gradient is where the batch is read from
        return "its (first) output received no gradient"
    sizes = {g.shape[0] if g.dim() else None for g in grads.values()}
    if len(sizes) != 1 or None in sizes:
        return f"its outputs lead with different sizes {sorted(map(str, sizes))}"
    for k, version in call.versions.items():
        if call.leaves[k]._version != version:
            return "an input was changed in place after the call"
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.training:
            return (f"its submodule {name!r} is a BatchNorm in training mode: examples "
                    "interact, so no per-example gradient of the module's parameters exists")
    if not batched_leaves(call, sizes.pop()):
        return "none of its inputs leads with the batch dimension of its output"
    return None


def batched_leaves(call: Call, examples: int) -> List[int]:
    """Indices of the tensor leaves that lead with the batch dimension (``examples``)."""
    return [
        k for k, leaf in enumerate(call.leaves)
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == examples
    ]


def output_gradients(call: Call, g_out) -> Dict[int, Tensor]:
    """``{output position: gradient}`` of the outputs that received one."""
    positions = (0,) if call.outputs is None else range(len(call.outputs))
    return {p: g_out[p] for p in positions if p < len(g_out) and g_out[p] is not None}


def compute(module: nn.Module, state: Fallback, g_out, savefields) -> Dict:
    """The results of ``savefields`` for ``module``'s direct parameters; ``{}`` if refused (warned)."""
    call = state.call
    grads = output_gradients(call, g_out) if call is not None else {}
    reason = refusal(module, call, grads)
    if reason is None and state.closed_form is not None and call.one_input is not None:
        form = state.closed_form
        contributions = form.contributions(module, call.one_input, grads[0], form.eps)
        return reduce_chunks(iter([contributions]), savefields)
    if reason is None:
        params = {n: p.detach() for n, p in computed_parameters(module, call).items()}
        examples = next(iter(grads.values())).shape[0]
        batched = batched_leaves(call, examples)
        numel = sum(p.numel() for p in params.values())
        size = _cost.examples_per_chunk(max(numel, 1), next(iter(params.values())).element_size())
        chunks = (
            per_example_gradients(module, params, call, batched, grads, start, start + size)
            for start in range(0, examples, size)
        )
        try:
            return reduce_chunks(with_structural_zeros(chunks), savefields)
        except _Refused as error:
            reason = str(error)
        except Exception as error:  # vmap cannot run this forward per example
            reason = f"torch.func.vmap cannot run its forward per example ({type(error).__name__}: {error})"
    _refuse(module, state, reason)
    return {}


def _refuse(module: nn.Module, state: Fallback, reason: str) -> None:
    state.refused = reason
    if reason not in state.warned:
        state.warned.add(reason)
        warnings.warn(
            f"cockpit-gradnoise: {type(module).__name__} ({', '.join(direct_parameters(module))}) "
            f"gets no per-example rows from the torch.func fallback: {reason}", stacklevel=3,
        )


def run(extension, module: nn.Module, g_inp, g_out) -> None:
    """Save ``extension``'s results on ``module``'s direct parameters, if it has the fallback.

    Called by the package's extensions on every module; does nothing for
    modules without the fallback. The first active extension to reach the
    module computes every active extension's results from the call its
    forward hook kept; each extension takes its own, and the last frees the
    call. A second backward hook of the module in the same backward pass (the
    module was called twice in one forward pass) finds the call taken: the
    uses would have to be summed per example, so the rows already saved are
    removed and the module refused.
    """
    state = getattr(module, ATTRIBUTE, None)
    if not isinstance(state, Fallback) or extension.savefield not in _SAVEFIELDS:
        return
    if state.results is None:
        if state.call is None:
            if state.taken:
                for param in direct_parameters(module).values():
                    if hasattr(param, extension.savefield):
                        delattr(param, extension.savefield)
                _refuse(module, state, "it was called more than once in one forward pass")
            return
        active = _active_savefields()
        if _after_backward(state):
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
    return not form and any(child.viewed for child in state.call.children)


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
