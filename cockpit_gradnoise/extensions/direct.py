"""A first-order rule's work on a layer, without BackPACK's generic steps around it.

BackPACK runs a module extension through ``ModuleExtension.__call__``, written
for every extension, second-order ones included: it checks the module's
hyperparameters, fetches (and deletes) the quantity backpropagated to the
module's output, and for each parameter the rule names asks three times for it
(``getattr(module, name)`` through ``nn.Module.__getattr__``) before calling the
rule's method for it and saving the result; last it backpropagates to the
inputs. For a first-order extension (every extension of this package, and
BackPACK's own ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``, ``Variance``)
nothing is ever backpropagated: ``__get_inputs_for_backpropagation`` is empty when
``extension.expects_backpropagation_quantities()`` is ``False``, so nothing is
saved and the quantity fetched is always ``None``. What is left is
:func:`run`: the hyperparameter check where the rule overrides it, and for each
parameter that exists and requires a gradient, ``setattr(param, savefield,
rule.<name>(extension, module, g_inp, g_out, None))``, the same calls in the same
order, so the same numbers. A rule whose class overrides ``__call__`` (the
fallback's, :mod:`.scaled_embedding`'s) is called as before; :func:`generic`
decides that once per rule class.
"""

from typing import Dict, Tuple

from backpack.extensions.module_extension import ModuleExtension
from torch import nn

#: Rule class -> ``(generic, checks)``: whether its ``__call__`` is BackPACK's own, and
#: whether it overrides the hyperparameter check (decided once per class: classes do not change).
_KINDS: Dict[type, Tuple[bool, bool]] = {}


def _kind(rule: ModuleExtension) -> Tuple[bool, bool]:
    cls = type(rule)
    kind = _KINDS.get(cls)
    if kind is None:
        # A rule may be any callable (.scaled_embedding's is no ModuleExtension at all).
        generic_call = cls.__call__ is ModuleExtension.__call__
        kind = _KINDS[cls] = (generic_call, generic_call and (
            cls.check_hyperparameters_module_extension
            is not ModuleExtension.check_hyperparameters_module_extension))
    return kind


def generic(rule: ModuleExtension) -> bool:
    """Whether ``rule`` runs through BackPACK's own ``ModuleExtension.__call__``."""
    return _kind(rule)[0]


def run(rule: ModuleExtension, extension, module: nn.Module, g_inp, g_out) -> None:
    """``rule(extension, module, g_inp, g_out)``: for a first-order ``extension`` and a
    :func:`generic` rule, its work without the generic steps (the module's docstring);
    otherwise the call itself."""
    generic_call, checks = _kind(rule)
    if not generic_call or extension.expects_backpropagation_quantities():
        rule(extension, module, g_inp, g_out)
        return
    if checks:
        rule.check_hyperparameters_module_extension(extension, module, g_inp, g_out)
    savefield = extension.savefield
    for name in rule._ModuleExtension__params:
        # One lookup where BackPACK makes three (exists, requires grad, save): the same object.
        param = getattr(module, name)
        if param is not None and param.requires_grad:
            setattr(param, savefield, getattr(rule, name)(extension, module, g_inp, g_out, None))
