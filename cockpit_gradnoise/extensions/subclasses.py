"""Subclasses of supported layers: their parent's rule, where it computes their function.

BackPACK looks a module's extension up by its exact class
(``module.__class__``), so timm's ``LayerNorm`` (a subclass of
``nn.LayerNorm``), ``nn.MultiheadAttention``'s ``out_proj`` (a subclass of
``nn.Linear``) and every other subclass of a supported layer gets no rows.
A rule computes a parameter's per-example contributions from the module's
input and the gradient of its output, assuming the parent's forward function
in between: that holds for a subclass only if its forward computes that
function. :func:`rule_for` decides, per class, in two ways:

- **Inherited forward**: no class between the subclass and its supported
  parent (in the method resolution order) defines ``forward`` or
  ``_conv_forward`` (what the parent's ``forward`` calls), nor ``weight`` or
  ``bias`` (a property there, as torch's parametrizations add, makes the
  parameter a computed tensor): the parent's rule.
- **Reviewed forward**: the subclass's ``forward`` is one of
  :data:`REVIEWED`, read here and tested against a float64 per-example
  reference (``tests/test_layers.py``): the rule named there.

Every other subclass gets no rule, so no rows, and the quantities' warning
names its class. The parent's rule would be wrong for all the reviewed ones
but timm's ``LayerNorm``: ``LayerNorm2d`` normalizes the channels of an
``(N, C, H, W)`` input, and timm's ``BatchNormAct2d`` applies batch
normalization, then dropout and an activation, so the output gradient BackPACK
hands a rule is taken after the activation; its rule first carries that
gradient back to the normalization's output
(:func:`~.batchnorm.batch_norm_act_contributions`), and leaves the layer
without rows where its dropout is random (training with a drop layer).
"""

from typing import Callable, Dict, NamedTuple, Optional

from cockpit_gradnoise.extensions import batchnorm, normalization

from backpack.extensions.module_extension import ModuleExtension
from torch import Tensor, nn

#: Names that, defined by a class between a subclass and its parent, change the forward function.
FORWARD_PATH = ("forward", "_conv_forward", "weight", "bias")


def channels_first_layer_norm_contributions(
    module: nn.LayerNorm, input: Tensor, grad_output: Tensor, name: str
) -> Tensor:
    """LayerNorm over the channels of an ``(N, C, *spatial)`` input (timm's and torchvision's ``LayerNorm2d``).

    Their forward permutes the channels last, applies ``F.layer_norm`` over
    ``normalized_shape = (C,)`` and permutes back, so with both tensors
    permuted alike the contributions are those of
    :func:`~.normalization.layer_norm_contributions`, ``sum_p x_hat_ip G_ip``
    over the spatial positions ``p``.
    """
    last = (0, *range(2, input.dim()), 1)
    return normalization.layer_norm_contributions(
        module, input.permute(last), grad_output.permute(last), name
    )


def always(module: nn.Module) -> bool:
    """A reviewed rule that applies to every instance."""
    return True


class Reviewed(NamedTuple):
    """How a reviewed forward is covered: a normalization rule's contributions function
    (:class:`~.normalization.NormalizationModuleExtension`), where ``applies(module)``."""

    contributions: Callable
    applies: Callable[[nn.Module], bool] = always


#: Reviewed forwards of subclasses (``module.qualname`` of the function) -> ``None`` if they
#: compute their parent's function (the parent's rule applies), else how they are covered.
REVIEWED: Dict[str, Optional[Reviewed]] = {
    # F.layer_norm of the input, as nn.LayerNorm (with timm's fast norm: the same
    # function, under autocast in autocast's dtype).
    "timm.layers.norm.LayerNorm.forward": None,
    "timm.layers.norm.LayerNorm2d.forward": Reviewed(channels_first_layer_norm_contributions),
    "torchvision.models.convnext.LayerNorm2d.forward": Reviewed(
        channels_first_layer_norm_contributions
    ),
    "timm.layers.norm_act.BatchNormAct2d.forward": Reviewed(
        batchnorm.batch_norm_act_contributions, batchnorm.batch_norm_act_applies
    ),
}


class ReviewedRule(normalization.NormalizationModuleExtension):
    """The rule of a :class:`Reviewed` forward; it leaves a module where ``applies`` is false
    without results (so without rows, and the quantities' warning names its class)."""

    def __init__(self, reviewed: Reviewed, reduce: Callable):
        super().__init__(reviewed.contributions, reduce, ("weight", "bias"))
        self._applies = reviewed.applies

    def __call__(self, ext, module, g_inp, g_out):
        if self._applies(module):
            super().__call__(ext, module, g_inp, g_out)


def qualified_name(function) -> str:
    """``module.qualname`` of a function, e.g. ``timm.layers.norm.LayerNorm.forward``."""
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}"


def inherits_forward(subclass: type, parent: type) -> bool:
    """Whether no class between ``subclass`` and ``parent`` defines a name of :data:`FORWARD_PATH`."""
    mro = subclass.__mro__
    return not any(name in vars(cls) for cls in mro[: mro.index(parent)] for name in FORWARD_PATH)


def rule_for(
    subclass: type,
    rules: Dict[type, ModuleExtension],
    reduce: Callable,
) -> Optional[ModuleExtension]:
    """The rule for ``subclass`` of a class of ``rules``, or ``None`` where none computes its function.

    Args:
        subclass: A module class that ``rules`` does not hold.
        rules: One extension's table, module class -> rule.
        reduce: That extension's reducer of a normalization layer's
            contributions (:func:`~.normalization.module_extensions`), for the
            rules of :data:`REVIEWED`.
    """
    parent = next((cls for cls in subclass.__mro__[1:] if rules.get(cls) is not None), None)
    if parent is None:
        return None
    if inherits_forward(subclass, parent):
        return rules[parent]
    # The reviewed forward is that of the first class defining one, and holds
    # only if no class before it changes what it calls.
    owner = next(cls for cls in subclass.__mro__ if "forward" in vars(cls))
    name = qualified_name(owner.forward)
    if name not in REVIEWED or not inherits_forward(subclass, owner):
        return None
    reviewed = REVIEWED[name]
    return rules[parent] if reviewed is None else ReviewedRule(reviewed, reduce)
