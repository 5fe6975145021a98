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
from typing import Callable, Dict, Tuple, Type

from cockpit_gradnoise.extensions import facts, tensor_parallel
from cockpit_gradnoise.extensions._squares import squared_norms_of, squared_norms_of_many

from backpack.extensions import BatchGrad, BatchL2Grad, SumGradSquared, Variance
from backpack.extensions.backprop_extension import BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderModuleExtension
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


def layer_normalized(input: Tensor, normalized_shape, eps: float) -> Tensor:
    """``x_hat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape``: ``F.layer_norm``
    with a weight of ones and a bias of zeros.

    The same numbers as without them (``x_hat * 1 + 0`` is ``x_hat``), in half
    the time: on the CPU torch's kernel without weight and bias takes a slower
    path (0.40 against 0.18 ms for ``[32, 64, 128]`` float32, one thread, torch 2.14).
    """
    key = (tuple(normalized_shape), input.dtype, input.device)
    if key not in _ONES_AND_ZEROS:  # made once: two launches per layer and step otherwise
        _ONES_AND_ZEROS[key] = (input.new_ones(normalized_shape), input.new_zeros(normalized_shape))
    ones, zeros = _ONES_AND_ZEROS[key]
    return F.layer_norm(input, normalized_shape, ones, zeros, eps)


#: ``{(normalized shape, dtype, device): (ones, zeros)}`` of :func:`layer_normalized`: constants,
#: never written (``F.layer_norm`` only reads its weight and bias).
_ONES_AND_ZEROS: Dict[tuple, Tuple[Tensor, Tensor]] = {}


# One function per layer: (module, input, grad_output, parameter name) -> the
# per-example contributions [N, *param.shape] to that parameter's gradient.


def _before_normalized_shape(module: nn.Module, input: Tensor) -> Tuple[int, ...]:
    """The positions (after the batch) before ``normalized_shape``: they share one element."""
    return tuple(range(1, input.dim() - len(module.normalized_shape)))


def layer_norm_contributions(module: nn.LayerNorm, input: Tensor, grad_output: Tensor, name: str) -> Tensor:
    """``nn.LayerNorm``: ``x_hat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape``."""
    dims = _before_normalized_shape(module, input)
    if name == "bias":
        return shift_contributions(grad_output, dims)
    normalized = layer_normalized(input, module.normalized_shape, module.eps)
    return scale_contributions(normalized, grad_output, dims)


def rms_norm_contributions(module: nn.Module, input: Tensor, grad_output: Tensor, name: str) -> Tensor:
    """``nn.RMSNorm`` (a scale, no shift): ``x_hat = x / sqrt(mean(x^2) + eps)`` over ``normalized_shape``.

    ``eps=None``: ``F.rms_norm`` applies its default. For bfloat16 and float16
    inputs, which the rules see widened to float32 (:mod:`.precision`), that is
    the same number: torch's kernels add float32's eps for them, computing in
    float32 (measured on torch 2.14, fused and composite; its documentation
    says ``torch.finfo(x.dtype).eps``).
    """
    normalized = F.rms_norm(input, module.normalized_shape, eps=module.eps)
    return scale_contributions(normalized, grad_output, _before_normalized_shape(module, input))


def group_norm_contributions(module: nn.GroupNorm, input: Tensor, grad_output: Tensor, name: str) -> Tensor:
    """``nn.GroupNorm``: ``x_hat = (x - mean) / sqrt(var + eps)`` per group of channels.

    Positions after the channels share one parameter element.
    """
    dims = tuple(range(2, input.dim()))
    if name == "bias":
        return shift_contributions(grad_output, dims)
    normalized = F.group_norm(input, module.num_groups, eps=module.eps)
    return scale_contributions(normalized, grad_output, dims)


#: Module class -> (its contribution function, its parameters).
LAYERS: Dict[Type[nn.Module], Tuple[Callable, Tuple[str, ...]]] = {
    nn.LayerNorm: (layer_norm_contributions, ("weight", "bias")),
    nn.GroupNorm: (group_norm_contributions, ("weight", "bias")),
}
if _RMS_NORM is not None:
    LAYERS[_RMS_NORM] = (rms_norm_contributions, ("weight",))


# One reducer per extension: contributions [N, *param.shape] -> its result.


def batch_grad(contributions: Tensor) -> Tensor:
    """``BatchGrad``: the contributions ``x_i``, shape ``[N, *param.shape]``."""
    return contributions


def squared_norms(contributions: Tensor) -> Tensor:
    """``BatchL2Grad`` (and ``PerExampleSquaredNorms``): ``||x_i||^2``, shape ``[N]``;
    squares at a power-of-two scale, float64 for float32 (:mod:`._squares`)."""
    return squared_norms_of(contributions)


def sum_of_squares(contributions: Tensor) -> Tensor:
    """``SumGradSquared``: ``sum_i x_i^2`` per element, shape ``param.shape``."""
    return contributions.pow(2).sum(0)


def variance(contributions: Tensor) -> Tensor:
    """``Variance`` as BackPACK defines it: ``sum_i x_i^2 / N - (sum_i x_i / N)^2``."""
    n = contributions.shape[0]
    return contributions.pow(2).sum(0) / n - (contributions.sum(0) / n) ** 2


def gradient(contributions: Tensor) -> Tensor:
    """The gradient ``sum_i x_i``, shape ``param.shape`` (``LocalGradient``)."""
    return contributions.sum(0)


class NormalizationModuleExtension(FirstOrderModuleExtension):
    """``reduce`` of a normalization layer's per-example contributions, for each parameter.

    The contributions are formed once per layer, parameter and backward pass
    for all active extensions (GradientVarianceQuantiles' sums and the
    per-example norms both read them) and kept in
    :mod:`._layer_cache` of the backward pass: recomputing ``x_hat`` cost as much as
    the layer's forward pass per extension.
    """

    def __init__(self, contributions: Callable, reduce: Callable, params: Tuple[str, ...]):
        self._contributions_of = contributions
        self._reduce = reduce
        super().__init__(params=list(params))

    def weight(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        if self._reduce is squared_norms and self._both_trained(module):
            return self._both_squared_norms(ext, module, g_out)
        return self._reduce(self._contributions(ext, module, g_out, "weight"))

    def bias(self, ext, module, g_inp, g_out, bp_quantities) -> Tensor:
        if self._reduce is squared_norms and self._both_trained(module):
            # Reduced with the weight's, just before (BackPACK calls the rule's parameters in
            # order): taken, so that the next extension's weight forms its own.
            found = facts.recording().layer_cache.take(_BIAS_NORMS, *self._sources(ext, module, g_out))
            if found is not None:
                return found
        return self._reduce(self._contributions(ext, module, g_out, "bias"))

    def _both_trained(self, module) -> bool:
        """Whether the rule covers the layer's weight and bias and both require a gradient."""
        if self._ModuleExtension__params != ["weight", "bias"]:
            return False
        # From the module's own table: nn.Module.__getattr__ costs a Python call per look-up.
        weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
        return weight is not None and bias is not None and weight.requires_grad and bias.requires_grad

    def _both_squared_norms(self, ext, module, g_out) -> Tensor:
        """The weight's squared norms, reduced with the bias's (one pass for both on other
        devices, :func:`._squares.squared_norms_of_many`); the bias's kept for :meth:`bias`."""
        weight, bias = squared_norms_of_many([self._contributions(ext, module, g_out, name)
                                              for name in ("weight", "bias")])
        sources, key = self._sources(ext, module, g_out)
        facts.recording().layer_cache.put(_BIAS_NORMS, sources, bias, key)
        return weight

    @staticmethod
    def _sources(ext, module, g_out):
        """``(sources, extra)`` of the layer cache's entries of this call (:mod:`._layer_cache`)."""
        subsampling = ext.get_subsampling()
        return (module, module.input0, g_out[0]), (None if subsampling is None else tuple(subsampling))

    def check_hyperparameters_module_extension(self, ext, module, g_inp, g_out) -> None:
        # Without a batch dimension BackPACK would take the first normalized
        # dimension for the batch and return contributions of the wrong shape.
        # Layers without trainable parameters compute nothing: let them pass.
        if not hasattr(module, "normalized_shape"):
            return
        shape = tuple(module.input0.shape)
        trainable = any(param.requires_grad for param in module.parameters())
        if trainable and len(shape) <= len(module.normalized_shape):
            raise ValueError(
                f"{module} got an input of shape {shape} without a batch dimension; "
                f"per-example results need inputs shaped "
                f"(N, ..., *{tuple(module.normalized_shape)}): add a batch dimension."
            )

    def _contributions(self, ext, module, g_out, name: str) -> Tensor:
        """Per-example contributions to ``module``'s parameter ``name``, ``[N, *param.shape]``."""
        subsampling = ext.get_subsampling()
        (sources, key), slot = self._sources(ext, module, g_out), ("normalization", name)
        found = facts.recording().layer_cache.get(slot, sources, key)
        if found is not None:
            return found
        input = subsample(module.input0, subsampling=subsampling)
        grad_output = subsample(g_out[0], subsampling=subsampling)
        contributions = self._contributions_of(module, input, grad_output, name)
        # SequenceParallel: this process's positions' part, added over the mesh (.tensor_parallel).
        contributions = tensor_parallel.whole_contributions(module, contributions)
        facts.recording().layer_cache.put(slot, sources, contributions, key)
        return contributions


#: The layer cache's slot of a normalization layer's bias norms, reduced with its weight's.
_BIAS_NORMS = "normalization bias squared norms"


def module_extensions(reduce: Callable) -> Dict[Type[nn.Module], ModuleExtension]:
    """``{module class: module extension}`` of the normalization layers for one reducer."""
    return {
        module_class: NormalizationModuleExtension(contributions, reduce, params)
        for module_class, (contributions, params) in LAYERS.items()
    }


#: BackPACK extension class -> the reducer its results are.
BACKPACK_REDUCERS: Dict[Type[BackpropExtension], Callable] = {
    BatchGrad: batch_grad,
    BatchL2Grad: squared_norms,
    SumGradSquared: sum_of_squares,
    Variance: variance,
}


def register_normalization_extensions(
    extension: BackpropExtension, overwrite: bool = False
) -> BackpropExtension:
    """Give one BackPACK extension instance the normalization layers' rows.

    The rows are :func:`module_extensions` of the reducer in
    ``BACKPACK_REDUCERS`` for the class ``extension`` is an instance of, so
    subclasses (with their own savefields) get them too. They are added
    through BackPACK's ``set_module_extension``.

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
    for module_class, module_extension in module_extensions(_reducer_for(extension)).items():
        try:
            extension.set_module_extension(module_class, module_extension, overwrite=overwrite)
        except ValueError:
            # BackPACK refuses to replace an existing row without overwrite.
            pass
    return extension


def _reducer_for(extension) -> Callable:
    supported = ", ".join(cls.__name__ for cls in BACKPACK_REDUCERS)
    if isinstance(extension, type):
        raise TypeError(
            f"Pass an extension instance, e.g. {extension.__name__}(), not the class "
            f"{extension.__name__}."
        )
    matches = [
        reducer
        for extension_class, reducer in BACKPACK_REDUCERS.items()
        if isinstance(extension, extension_class)
    ]
    if len(matches) != 1:
        raise TypeError(
            f"{type(extension).__name__} is not an instance of exactly one of "
            f"{supported}; only these have normalization-layer extensions."
        )
    return matches[0]


# Each patched class -> its own __init__, as it was before patching: the record
# of the one global change this module makes, on request (not a cache, and not
# per backward pass: it lasts from register_extensions to unregister_extensions).
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
    for extension_class in BACKPACK_REDUCERS:
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
