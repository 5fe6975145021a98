"""Per-example BackPACK first-order extensions for normalization layers.

BackPACK 1.7 has no module extensions for ``nn.LayerNorm``, ``nn.GroupNorm``
and ``nn.RMSNorm``: its first-order extensions warn and leave nothing on their
parameters. This module adds them for the four extensions that give
per-example information: ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``
and ``Variance``. Importing it changes nothing; a caller opts in, either per
extension instance::

    ext = register_normalization_extensions(BatchGrad())
    with backpack(ext):
        loss.backward()

or for every instance of the four classes (and their subclasses) constructed
afterwards, including those that Cockpit's quantities construct::

    register_normalization_extensions_globally()
    ...
    unregister_normalization_extensions_globally()  # back to stock BackPACK

The maths. A normalization layer computes ``y = x_hat * w + b``, where
``x_hat`` is its input normalized within each example. With ``G`` the
gradient of the batch's loss with respect to ``y``, example ``i`` contributes

.. math::

    x_i(w) = \\sum_p \\hat{x}_{ip} G_{ip}, \\qquad x_i(b) = \\sum_p G_{ip}

to ``w.grad`` and ``b.grad``, where ``p`` runs over the positions of example
``i`` that share one element of ``w``: the dimensions between the batch and
``normalized_shape`` for LayerNorm and RMSNorm, the dimensions after the
channels for GroupNorm. ``x_hat`` is recomputed from the input BackPACK stores
(``module.input0``) with torch's own functional form. These layers keep no
running statistics, so training and evaluation mode compute the same thing.

First-order extensions backpropagate nothing through a layer (autograd does),
so a normalization layer between other layers needs no derivatives object:
the layers around it keep BackPACK's own results.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Dict, Tuple, Type

from cockpit_gradnoise.extensions.sums import sums_of

from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
from backpack.extensions.firstorder.variance.variance_base import VarianceBaseModule
from backpack.extensions.module_extension import ModuleExtension
from backpack.utils.subsampling import subsample
from torch import Tensor, nn
from torch.nn import functional as F

# nn.RMSNorm exists from torch 2.4 on; the package allows torch >= 2.2.
_RMS_NORM = getattr(nn, "RMSNorm", None)


def sum_over(tensor: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """``tensor`` summed over ``dims``; unchanged if ``dims`` is empty.

    ``Tensor.sum(())`` would sum over every dimension instead.
    """
    return tensor.sum(dims) if dims else tensor


def scale_contributions(normalized: Tensor, grad_output: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """Per-example contributions to the scale's gradient, ``sum_p x_hat_ip * G_ip``."""
    return sum_over(normalized * grad_output, dims)


def shift_contributions(grad_output: Tensor, dims: Tuple[int, ...]) -> Tensor:
    """Per-example contributions to the shift's gradient, ``sum_p G_ip``."""
    return sum_over(grad_output, dims)


#: ``{parameter name: (module, grad_output, key, contributions)}`` (weak references
#: to the first two): the contributions last computed for a normalization layer's
#: ``weight`` and ``bias``, for the other active extensions on the same layer in
#: the same backward call (BackPACK runs them one after the other). At most one
#: layer's ``[N, *param.shape]`` per name is kept.
_LAST_CONTRIBUTIONS: dict = {}


class _NormalizationModuleExtension(FirstOrderModuleExtension):
    """Per-example contributions of a normalization layer's ``weight`` and ``bias``.

    A layer rule (a mixin) says how the layer normalizes (``_normalized_input``)
    and which dimensions share a parameter element (``_shared_dims``); an
    extension base says how the contributions ``[N, *param.shape]`` are reduced
    (``_reduce``). One layer's contributions are formed at a time.
    """

    PARAMS = ("weight", "bias")

    def __init__(self):
        super().__init__(params=list(self.PARAMS))

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        return self._reduce(self._contributions(ext, module, g_out, "weight"))

    def bias(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        return self._reduce(self._contributions(ext, module, g_out, "bias"))

    def _contributions(self, ext, module, g_out, name: str) -> Tensor:
        """Per-example contributions to ``module``'s parameter ``name``, ``[N, *param.shape]``.

        Computed once per layer and backward pass for all active extensions
        (GradientVarianceQuantiles' sums and the per-example norms both read
        them): recomputing ``x_hat`` cost as much as the layer's forward pass
        per extension.
        """
        subsampling = ext.get_subsampling()
        key = None if subsampling is None else tuple(subsampling)
        found = _LAST_CONTRIBUTIONS.get(name)
        if (found is not None and found[0]() is module and found[1]() is g_out[0]
                and found[2] == key):
            return found[3]
        input, grad_output = self._active_examples(ext, module, g_out)
        dims = self._shared_dims(module, input)
        if name == "weight":
            normalized = self._normalized_input(module, input)
            contributions = scale_contributions(normalized, grad_output, dims)
        else:
            contributions = shift_contributions(grad_output, dims)
        _LAST_CONTRIBUTIONS[name] = (weakref.ref(module), weakref.ref(g_out[0]), key, contributions)
        return contributions

    @staticmethod
    def _active_examples(ext, module, g_out) -> Tuple[Tensor, Tensor]:
        subsampling = ext.get_subsampling()
        return (
            subsample(module.input0, subsampling=subsampling),
            subsample(g_out[0], subsampling=subsampling),
        )

    def _reduce(self, contributions: Tensor) -> Tensor:
        raise NotImplementedError


class _OverNormalizedShapeRule:
    """Layers that normalize each example over its last ``normalized_shape`` dimensions.

    Positions before those dimensions (after the batch) share one parameter element.
    """

    @staticmethod
    def _shared_dims(module: nn.Module, input: Tensor) -> Tuple[int, ...]:
        return tuple(range(1, input.dim() - len(module.normalized_shape)))

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out) -> None:
        # Without a batch dimension BackPACK would take the first normalized
        # dimension for the batch and return contributions of the wrong shape.
        # Layers without trainable parameters compute nothing: let them pass.
        shape = tuple(module.input0.shape)
        trainable = any(param.requires_grad for param in module.parameters())
        if trainable and len(shape) <= len(module.normalized_shape):
            raise ValueError(
                f"{module} got an input of shape {shape} without a batch dimension; "
                f"per-example results need inputs shaped "
                f"(N, ..., *{tuple(module.normalized_shape)}): add a batch dimension."
            )


class _LayerNormRule(_OverNormalizedShapeRule):
    """``nn.LayerNorm``: ``(x - mean) / sqrt(var + eps)`` over ``normalized_shape``."""

    @staticmethod
    def _normalized_input(module: nn.LayerNorm, input: Tensor) -> Tensor:
        return F.layer_norm(input, module.normalized_shape, eps=module.eps)


class _RMSNormRule(_OverNormalizedShapeRule):
    """``nn.RMSNorm``: ``x / sqrt(mean(x^2) + eps)`` over ``normalized_shape``.

    ``eps=None`` means ``torch.finfo(input.dtype).eps``; ``F.rms_norm`` applies it.
    RMSNorm has no shift parameter.
    """

    PARAMS = ("weight",)

    @staticmethod
    def _normalized_input(module: nn.Module, input: Tensor) -> Tensor:
        return F.rms_norm(input, module.normalized_shape, eps=module.eps)


class _GroupNormRule:
    """``nn.GroupNorm``: ``(x - mean) / sqrt(var + eps)`` per group of channels.

    Positions after the channels share one parameter element.
    """

    @staticmethod
    def _normalized_input(module: nn.GroupNorm, input: Tensor) -> Tensor:
        return F.group_norm(input, module.num_groups, eps=module.eps)

    @staticmethod
    def _shared_dims(module: nn.GroupNorm, input: Tensor) -> Tuple[int, ...]:
        return tuple(range(2, input.dim()))


class _BatchGradNormalization(_NormalizationModuleExtension):
    """``BatchGrad``: the contributions ``x_i``, shape ``[N, *param.shape]``."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return contributions


class _BatchL2Normalization(_NormalizationModuleExtension):
    """``BatchL2Grad``: ``||x_i||^2``, shape ``[N]``."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return contributions.pow(2).flatten(start_dim=1).sum(1)


class _SumGradSquaredNormalization(_NormalizationModuleExtension):
    """``SumGradSquared``: ``sum_i x_i^2`` per element, shape ``param.shape``."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return contributions.pow(2).sum(0)


class _VarianceNormalization(_NormalizationModuleExtension):
    """``Variance`` as BackPACK defines it: ``sum_i x_i^2 / N - (sum_i x_i / N)^2``."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return VarianceBaseModule._variance_from(
            contributions.sum(0), contributions.pow(2).sum(0), contributions.shape[0]
        )


class _GradientNormalization(_NormalizationModuleExtension):
    """The gradient ``sum_i x_i``, shape ``param.shape`` (for :class:`~cockpit_gradnoise.extensions.LocalGradient`)."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return contributions.sum(0)


class _SumsNormalization(_NormalizationModuleExtension):
    """``[sum_i x_i, sum_i x_i^2]`` from the same contributions, shape ``[2, *param.shape]`` (:mod:`.sums`)."""

    def _reduce(self, contributions: Tensor) -> Tensor:
        return sums_of(contributions)


class BatchGradLayerNorm(_LayerNormRule, _BatchGradNormalization):
    """``BatchGrad`` for ``nn.LayerNorm``."""


class BatchGradGroupNorm(_GroupNormRule, _BatchGradNormalization):
    """``BatchGrad`` for ``nn.GroupNorm``."""


class BatchGradRMSNorm(_RMSNormRule, _BatchGradNormalization):
    """``BatchGrad`` for ``nn.RMSNorm``."""


class BatchL2LayerNorm(_LayerNormRule, _BatchL2Normalization):
    """``BatchL2Grad`` for ``nn.LayerNorm``."""


class BatchL2GroupNorm(_GroupNormRule, _BatchL2Normalization):
    """``BatchL2Grad`` for ``nn.GroupNorm``."""


class BatchL2RMSNorm(_RMSNormRule, _BatchL2Normalization):
    """``BatchL2Grad`` for ``nn.RMSNorm``."""


class SGSLayerNorm(_LayerNormRule, _SumGradSquaredNormalization):
    """``SumGradSquared`` for ``nn.LayerNorm``."""


class SGSGroupNorm(_GroupNormRule, _SumGradSquaredNormalization):
    """``SumGradSquared`` for ``nn.GroupNorm``."""


class SGSRMSNorm(_RMSNormRule, _SumGradSquaredNormalization):
    """``SumGradSquared`` for ``nn.RMSNorm``."""


class VarianceLayerNorm(_LayerNormRule, _VarianceNormalization):
    """``Variance`` for ``nn.LayerNorm``."""


class VarianceGroupNorm(_GroupNormRule, _VarianceNormalization):
    """``Variance`` for ``nn.GroupNorm``."""


class VarianceRMSNorm(_RMSNormRule, _VarianceNormalization):
    """``Variance`` for ``nn.RMSNorm``."""


class GradLayerNorm(_LayerNormRule, _GradientNormalization):
    """The gradient for ``nn.LayerNorm``."""


class GradGroupNorm(_GroupNormRule, _GradientNormalization):
    """The gradient for ``nn.GroupNorm``."""


class GradRMSNorm(_RMSNormRule, _GradientNormalization):
    """The gradient for ``nn.RMSNorm``."""


class SumsLayerNorm(_LayerNormRule, _SumsNormalization):
    """Both sums for ``nn.LayerNorm``."""


class SumsGroupNorm(_GroupNormRule, _SumsNormalization):
    """Both sums for ``nn.GroupNorm``."""


class SumsRMSNorm(_RMSNormRule, _SumsNormalization):
    """Both sums for ``nn.RMSNorm``."""


def _rows(layer_norm, group_norm, rms_norm) -> Dict[Type[nn.Module], Type[ModuleExtension]]:
    rows = {nn.LayerNorm: layer_norm, nn.GroupNorm: group_norm}
    if _RMS_NORM is not None:
        rows[_RMS_NORM] = rms_norm
    return rows


#: BackPACK extension class -> {module class -> module extension class}.
NORMALIZATION_MODULE_EXTENSIONS: Dict[
    Type[BackpropExtension], Dict[Type[nn.Module], Type[ModuleExtension]]
] = {
    BatchGrad: _rows(BatchGradLayerNorm, BatchGradGroupNorm, BatchGradRMSNorm),
    BatchL2Grad: _rows(BatchL2LayerNorm, BatchL2GroupNorm, BatchL2RMSNorm),
    SumGradSquared: _rows(SGSLayerNorm, SGSGroupNorm, SGSRMSNorm),
    Variance: _rows(VarianceLayerNorm, VarianceGroupNorm, VarianceRMSNorm),
}

#: The same rows for this package's gradient extension (``LocalGradient``).
GRADIENT_MODULE_EXTENSIONS = _rows(GradLayerNorm, GradGroupNorm, GradRMSNorm)

#: The same rows for this package's :class:`~cockpit_gradnoise.extensions.SumsOfContributions`.
SUMS_MODULE_EXTENSIONS = _rows(SumsLayerNorm, SumsGroupNorm, SumsRMSNorm)


def register_normalization_extensions(
    extension: BackpropExtension, overwrite: bool = False
) -> BackpropExtension:
    """Give one BackPACK extension instance the normalization layers' rows.

    The rows are those of ``NORMALIZATION_MODULE_EXTENSIONS`` for the class
    ``extension`` is an instance of, so subclasses (with their own savefields)
    get them too. They are added through BackPACK's ``set_module_extension``.

    Args:
        extension: An instance of ``BatchGrad``, ``BatchL2Grad``,
            ``SumGradSquared`` or ``Variance`` (or of a subclass).
        overwrite: Replace rows the instance already has for these module
            classes. If ``False`` (default), those rows are kept, so calling
            this twice is harmless.

    Returns:
        ``extension``, to write ``backpack(register_normalization_extensions(BatchGrad()))``.

    Raises:
        TypeError: If ``extension`` is a class, or an instance of none (or
            more than one) of the four classes.
    """
    rows = _rows_for(extension)
    for module_class, module_extension_class in rows.items():
        try:
            extension.set_module_extension(
                module_class, module_extension_class(), overwrite=overwrite
            )
        except ValueError:
            # BackPACK refuses to replace an existing row without overwrite.
            pass
    return extension


def _rows_for(extension) -> Dict[Type[nn.Module], Type[ModuleExtension]]:
    supported = ", ".join(cls.__name__ for cls in NORMALIZATION_MODULE_EXTENSIONS)
    if isinstance(extension, type):
        raise TypeError(
            f"Pass an extension instance, e.g. {extension.__name__}(), not the class "
            f"{extension.__name__}."
        )
    matches = [
        rows
        for extension_class, rows in NORMALIZATION_MODULE_EXTENSIONS.items()
        if isinstance(extension, extension_class)
    ]
    if len(matches) != 1:
        raise TypeError(
            f"{type(extension).__name__} is not an instance of exactly one of "
            f"{supported}; only these have normalization-layer extensions."
        )
    return matches[0]


# Each patched class -> its own __init__, as it was before patching.
_STOCK_INITS: Dict[type, Callable] = {}


def register_normalization_extensions_globally() -> None:
    """Make every ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared`` and ``Variance``
    constructed from now on carry the normalization layers' rows.

    BackPACK builds each instance's rows in ``__init__`` and has no global
    registry, so this wraps the four classes' ``__init__`` to call
    :func:`register_normalization_extensions` (keeping rows an instance already
    has). Subclasses that call ``super().__init__()`` (the package's own,
    Cockpit's quantities' ``BatchGrad()``) get them too. Instances that exist
    already are unchanged. Calling it again does nothing; undo with
    :func:`unregister_normalization_extensions_globally`.
    """
    for extension_class in NORMALIZATION_MODULE_EXTENSIONS:
        if extension_class not in _STOCK_INITS:
            stock_init = extension_class.__dict__["__init__"]
            _STOCK_INITS[extension_class] = stock_init
            extension_class.__init__ = _init_with_normalization_rows(stock_init)


def unregister_normalization_extensions_globally() -> None:
    """Restore the stock ``__init__`` of the classes patched by
    :func:`register_normalization_extensions_globally`.

    Instances constructed while the patch was on keep their rows.
    """
    for extension_class, stock_init in list(_STOCK_INITS.items()):
        extension_class.__init__ = stock_init
        del _STOCK_INITS[extension_class]


def _init_with_normalization_rows(stock_init: Callable) -> Callable:
    @functools.wraps(stock_init)
    def __init__(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        register_normalization_extensions(self)

    return __init__
