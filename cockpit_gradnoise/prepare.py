"""One entry point that makes a model ready for the per-example quantities.

BackPACK records each module's input and output with hooks, and its hooks turn
outputs into views: an in-place operation on one (``ReLU(inplace=True)``,
``out += identity`` in a ResNet block) then fails in the forward pass with
``Output 0 of BackwardHookFunction is a view and is being modified inplace``.
BackPACK's converter (``backpack.extend(model, use_converter=True)``) traces the
model with ``torch.fx`` and rewrites such operations out of place, keeping the
parameter names; it cannot trace models with data-dependent Python, and the
``GraphModule`` it returns has no custom methods of the original class, so it is
used only where it is needed.
"""

import operator
import sys
from typing import Optional

from cockpit_gradnoise.attention import convert_attention

import torch
from backpack import extend
from torch import nn

#: Functions that ``torch.fx`` records for in-place Python operators.
_IN_PLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
}

_IN_PLACE_ERROR = "is a view and is being modified inplace"


def needs_converter(model: nn.Module) -> bool:
    """Whether ``model`` has in-place operations that BackPACK's hooks reject.

    True if a submodule is configured ``inplace=True`` (``nn.ReLU(inplace=True)``)
    or, where ``torch.fx`` can trace the model, its graph calls an in-place
    method (``x.relu_()``), an in-place operator, or a function with
    ``inplace=True``. An in-place ``+=`` on a tensor is traced as ``add`` and
    cannot be seen here; :func:`prepare_model` still names the fix when the
    forward pass fails.
    """
    if any(getattr(module, "inplace", False) is True for module in model.modules()):
        return True
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # untraceable (data-dependent Python): the converter cannot help
        return False
    for node in graph.nodes:
        if node.op == "call_method" and str(node.target).endswith("_"):
            return True
        if node.op == "call_function" and (
            node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
        ):
            return True
    return False


def prepare_model(model: nn.Module, *, use_converter: Optional[bool] = None) -> nn.Module:
    """Extend ``model`` with BackPACK, converting it where in-place operations need it.

    Every ``nn.MultiheadAttention`` is first replaced, in place, by a
    :class:`~cockpit_gradnoise.LinearAttention` with the same parameters
    (:func:`~cockpit_gradnoise.convert_attention`).

    Train the returned model: it has the same parameters under the same names
    (``[n for n, _ in prepared.named_parameters()]`` equals the original's).
    Without conversion it is ``model`` itself, extended in place; with
    conversion a ``torch.fx.GraphModule`` that shares ``model``'s parameters.

    Example (torchvision's ResNets use ``ReLU(inplace=True)`` and
    ``out += identity``)::

        model = cgn.prepare_model(torchvision.models.resnet18(num_classes=10))

    Args:
        model: The network.
        use_converter: ``True`` to always use BackPACK's converter, ``False``
            never, ``None`` (default) where :func:`needs_converter` says so.

    Returns:
        The model to train.

    Raises:
        RuntimeError: If the converter changed parameter names. The returned
            model's forward pass, if it was not converted and an in-place
            operation fails inside BackPACK's hooks, raises BackPACK's error
            with the fix (``use_converter=True``) added to its message.
    """
    model = convert_attention(model)  # same parameters, same names (attention.py)
    if use_converter is None:
        use_converter = needs_converter(model)
    names = [name for name, _ in model.named_parameters()]
    if not use_converter:
        extended = extend(model)
        # A hook, not a wrapped forward: it survives copy.deepcopy and pickling.
        extended.register_forward_hook(_name_the_converter, always_call=True)
        return extended
    converted = extend(model, use_converter=True)
    converted_names = [name for name, _ in converted.named_parameters()]
    if converted_names != names:
        raise RuntimeError(
            "BackPACK's converter changed the parameter names "
            f"({sorted(set(names) ^ set(converted_names))[:4]}...): use "
            "prepare_model(model, use_converter=False) and remove in-place operations"
        )
    return converted


_HINT = (
    " -- an in-place operation failed inside BackPACK's hooks (e.g. ReLU(inplace=True) "
    "or `out += identity`): prepare the model with "
    "cockpit_gradnoise.prepare_model(model, use_converter=True) (or "
    "backpack.extend(model, use_converter=True)), or make the operation out of place"
)


def _name_the_converter(module, args, output):
    """Forward hook run also on failure: adds the fix to BackPACK's in-place error."""
    error = sys.exc_info()[1]
    if isinstance(error, RuntimeError) and error.args and _IN_PLACE_ERROR in str(error.args[0]):
        if _HINT not in error.args[0]:
            error.args = (error.args[0] + _HINT,) + error.args[1:]
