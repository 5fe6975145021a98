"""The parameters the fallback computes, and a module run with others in their place.

Direct parameters only: a parameter a module hands to a submodule is that
layer's (:func:`delegated_parameters`). The recomputation runs the module with
the examples' copies in place of them (:func:`own_parameters`) and without
its hooks or its submodules' (:func:`hooks_off`).
"""

import contextlib
from collections import OrderedDict
from typing import Callable, Dict, Optional

from cockpit_gradnoise.extensions.hooks import eager_under_compile

from torch import Tensor, nn


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


def delegated_parameters(module: nn.Module) -> set:
    """``{id(param)}`` of the parameters ``module`` holds that a submodule holds too."""
    own = {id(p) for p in module._parameters.values() if p is not None}
    if not own:
        return set()
    below = {id(p) for child in module.children() for p in child.parameters()}
    return own & below


@contextlib.contextmanager
def hooks_off(module: nn.Module, keep: Optional[Callable[[Callable], bool]] = None):
    """Run ``module`` and its submodules without their hooks (restored afterwards); ``keep``:
    which hooks stay (:func:`foreign`), none by default.

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
        for attributes, hooks in saved:
            for n, table in zip(names, hooks):
                attributes[n] = OrderedDict(
                    (key, hook) for key, hook in table.items() if keep is not None and keep(hook))
        yield
    finally:
        for attributes, hooks in saved:
            for n, hook in zip(names, hooks):
                attributes[n] = hook


def foreign(hook: Callable) -> bool:
    """Whether ``hook`` is neither the package's nor BackPACK's: a model's own (the output
    recorders of ``transformers``, which collect the routers' logits for the auxiliary loss)."""
    module = getattr(getattr(hook, "func", hook), "__module__", None) or ""
    return not isinstance(hook, eager_under_compile) and not module.startswith("backpack")


@contextlib.contextmanager
def own_parameters(module: nn.Module, tensors: Dict[str, Tensor]):
    """``module``'s parameters named in ``tensors`` (``"child.name"`` for a child's) replaced
    by them (restored afterwards).

    Through ``_parameters``: ``setattr`` refuses a plain tensor under a parameter's name.
    Every module inside ``module`` that holds the same parameter (a tied weight: XLNet's
    LM head shares its word embedding's) gets the tensor too, or its use would not be
    differentiated.
    """
    replaced = {}
    for name, tensor in tensors.items():
        owner, _, attr = name.rpartition(".")
        replaced[id(module.get_submodule(owner)._parameters[attr])] = tensor
    saved = [(sub, attr, param) for sub in module.modules() for attr, param in sub._parameters.items()
             if param is not None and id(param) in replaced]
    try:
        for sub, attr, param in saved:
            sub._parameters[attr] = replaced[id(param)]
        yield
    finally:
        for sub, attr, param in saved:
            sub._parameters[attr] = param


def parameter_caches(module: nn.Module) -> Dict[str, dict]:
    """``{attribute: dict}`` of ``module``'s caches of tensors computed from its parameters.

    timm's LeViT, EfficientFormer and EfficientViT keep ``attention_bias_cache``:
    in evaluation mode ``attention_biases[:, idxs]`` is computed once and read
    back from the dict at every call, so a recomputation with other tensors in
    place of the parameter would read the cache and not depend on them (rows of
    zeros). A cache here: a non-empty dict attribute of tensors whose name holds
    ``cache`` or one of whose tensors has a ``grad_fn`` (computed with grad).
    """
    found = {}
    for name, value in module.__dict__.items():
        if isinstance(value, dict) and value and all(isinstance(v, Tensor) for v in value.values()) \
                and ("cache" in name or any(v.grad_fn is not None for v in value.values())):
            found[name] = value
    return found


def clear_parameter_caches(module: nn.Module) -> None:
    """Empty ``module``'s :func:`parameter_caches` (a new dict each, as timm's ``train()``
    does): the call computes them again from its parameters, with this forward pass's graph."""
    for name in parameter_caches(module):
        module.__dict__[name] = {}


@contextlib.contextmanager
def caches_bypassed(module: nn.Module):
    """``module`` with empty :func:`parameter_caches` (restored afterwards): a recomputation
    computes from the tensors in place of its parameters, and leaves nothing in the caches."""
    saved = parameter_caches(module)
    try:
        for name in saved:
            module.__dict__[name] = {}
        yield
    finally:
        module.__dict__.update(saved)


def variables_reached(node, stop=frozenset()) -> list:
    """The tensors a backward pass from the autograd ``node`` accumulates into (the variables
    of the ``AccumulateGrad`` nodes it reaches), not going past the nodes of ``stop``."""
    found, seen, stack = [], set(stop), [node]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            found.append(variable)
        else:
            stack.extend(child for child, _ in node.next_functions)
    return found


#: The value of an attribute a call added (absent before it).
ABSENT = object()

#: The entries of a module's ``__dict__`` that ``nn.Module`` keeps itself (its parameters,
#: buffers, submodules, hooks, mode): not state its forward sets.
_MODULE_ENTRIES = frozenset(nn.Module().__dict__)


def attributes_before(module: nn.Module) -> dict:
    """A shallow copy of ``module``'s own attributes (not ``nn.Module``'s entries), taken
    before a call: :func:`attributes_set` compares the attributes after it with them."""
    return {name: value for name, value in module.__dict__.items() if name not in _MODULE_ENTRIES}


def attributes_set(module: nn.Module, before: dict) -> dict:
    """``{name: value before the call}`` of the attributes ``module``'s call set (another
    object than before) or added (:data:`ABSENT`): state its forward keeps on itself for its
    next call (RecurrentGemma's RG-LRU: ``self.recurrent_states``, its scan's last state)."""
    now = module.__dict__
    changed = {name: value for name, value in before.items() if now.get(name, ABSENT) is not value}
    changed.update((name, ABSENT) for name in now if name not in before and name not in _MODULE_ENTRIES)
    return changed


@contextlib.contextmanager
def attributes_as_called(module: nn.Module, attributes: dict):
    """``module`` run with the attributes its call set (:func:`attributes_set`) as the call
    found them, at every call of it inside (one example after another: each would find the
    last one's), the attributes it has now put back afterwards.

    A recomputation in the backward pass runs after the call set them: a forward reading its
    own last state (a scan's ``self.recurrent_states``, ``None`` at the call and its batch's
    last state after it) would start from the batch's end instead of where the call started.
    """
    if not attributes:
        yield
        return
    now = module.__dict__
    kept = {name: now.get(name, ABSENT) for name in attributes}

    def put(values: dict) -> None:
        for name, value in values.items():
            if value is ABSENT:
                now.pop(name, None)
            else:
                now[name] = value

    handle = module.register_forward_pre_hook(lambda *_: put(attributes))
    try:
        put(attributes)
        yield
    finally:
        handle.remove()
        put(kept)
