"""Look-alikes: closed forms for modules that behave like a layer with a rule.

A module that computes a layer scale ``x * gamma`` or
``F.layer_norm(x, (D,), weight, bias, eps)`` (nanoGPT's ``LayerNorm``) is
recognized by its behaviour once, at installation (:func:`look_alike`), and
gets the native normalization rule's contributions, cheaper than the
``vmap`` of :mod:`.replay`.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from cockpit_gradnoise.extensions import normalization
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters, hooks_off, own_parameters

import torch
from torch import Tensor, nn


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
