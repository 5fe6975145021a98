"""Which diagonal preconditioner ``P`` an optimizer's next step applies, read from its own state.

:class:`OptimizerPreconditioner` reads ``torch.optim``'s ``Adam``, ``AdamW``,
``RMSprop`` (plain and centered), ``Adagrad`` and ``SGD`` (``P = I``, with or
without momentum) exactly: the formulas are those of torch's own
``_single_tensor_*`` functions (``foreach``, ``fused``, ``capturable`` and
``differentiable`` compute the same numbers), in
:mod:`cockpit_gradnoise.functional.preconditioner`. Any other class, a
subclass of these included (it may change ``step``), is refused: never an
approximation.
"""

from typing import Dict, Iterator, Optional

from cockpit_gradnoise.extensions import tensor_parallel
from cockpit_gradnoise.functional import preconditioner as formulas

import torch
from torch import Tensor

#: Wrappers that hold the optimizer itself: class name -> attribute (Accelerate's,
#: which the Hugging Face Trainer steps, and Lightning's).
_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "LightningOptimizer": "_optimizer"}


class UnsupportedOptimizer(ValueError):
    """An optimizer (or a parameter's gradient) whose preconditioner cannot be read exactly."""


def unwrapped(optimizer):
    """The ``torch.optim`` optimizer inside Accelerate's or Lightning's wrapper (else ``optimizer``)."""
    while type(optimizer).__name__ in _WRAPPERS:
        optimizer = getattr(optimizer, _WRAPPERS[type(optimizer).__name__])
    return optimizer


class OptimizerPreconditioner:
    """``P``'s diagonal of the next ``optimizer.step()``, per parameter.

    Read when the backward pass of the step has ended: ``param.grad`` is the
    gradient the step adds to the optimizer's moment (averaged across
    processes under DDP, summed over micro-batches under accumulation,
    unscaled by the tracker under a ``GradScaler``), and the state is that of
    the step before. A gradient clipped after the backward pass is not seen.

    Raises:
        UnsupportedOptimizer: For a class not read exactly, naming it.
    """

    def __init__(self, optimizer):
        self.optimizer = unwrapped(optimizer)
        kind = type(self.optimizer)
        if kind not in _RULES:
            raise UnsupportedOptimizer(
                f"{kind.__module__}.{kind.__qualname__} is not an optimizer whose preconditioner "
                f"is read exactly (those are torch.optim's {', '.join(c.__name__ for c in _RULES)}, "
                "not their subclasses)"
            )
        self._rule = _RULES[kind]
        self._groups: Dict[int, dict] = {
            id(param): group for group in self.optimizer.param_groups for param in group["params"]
        }

    @property
    def identity(self) -> bool:
        """Whether ``P = I`` for every parameter (``SGD``)."""
        return self._rule is None

    def updates(self, param: Tensor) -> bool:
        """Whether the optimizer updates ``param`` (it is in one of its groups)."""
        return id(param) in self._groups

    def check(self, param: Tensor) -> None:
        """Raise :class:`UnsupportedOptimizer` where ``param``'s ``P`` cannot be read exactly."""
        if self.identity:
            return
        if param.grad is not None and param.grad.is_sparse:
            raise UnsupportedOptimizer(
                f"{type(self.optimizer).__name__}'s update of a sparse gradient (Embedding(sparse=True))"
            )
        if torch.is_complex(param):
            raise UnsupportedOptimizer(f"{type(self.optimizer).__name__}'s update of a complex parameter")

    def preconditioner(self, param: Tensor) -> Optional[Tensor]:
        """``P``'s diagonal for ``param`` (shaped as it), ``None`` for ``P = I``."""
        if self._rule is None:
            return None
        grad = tensor_parallel.completed(param.grad.detach())  # a SequenceParallel norm's: Partial
        return self._rule(self._groups[id(param)], self.optimizer.state.get(param, {}), grad, param.detach())

    def pieces(self, param: Tensor, size: int) -> Optional[Iterator[Tensor]]:
        """``P``'s diagonal for ``param``, flattened, in consecutive pieces of ``size``
        elements; ``None`` for ``P = I``.

        Each piece is formed when it is asked for, by the formula of
        :meth:`preconditioner` on the same pieces of the state, the gradient and the
        parameter (every operation of those formulas is elementwise, so a piece's
        numbers are those of the whole ``P``'s elements): never the whole ``P``, and
        each piece's half-dozen passes run while it is in the cache, beside the
        weighted sums of :func:`~cockpit_gradnoise.functional.preconditioned_noise_sums`
        that take it (issue 34's speed; ``benchmarks/README.md``, "The noise scale
        Adam sees"). For local tensors (not sharded: those take :meth:`preconditioner`).
        """
        if self._rule is None:
            return None
        group, state = self._groups[id(param)], self.optimizer.state.get(param, {})
        # Every piece's views made at once (one split per tensor, not a slice per piece and tensor).
        moments = {key: moment.reshape(-1).split(size) for key, moment in state.items()
                   if key in _PER_ELEMENT_STATE and isinstance(moment, Tensor)}
        grads = tensor_parallel.completed(param.grad.detach()).reshape(-1).split(size)
        values = param.detach().reshape(-1).split(size)

        def piece(k):
            return self._rule(group, {**state, **{key: moment[k] for key, moment in moments.items()}},
                              grads[k], values[k])

        return (piece(k) for k in range(len(grads)))


#: The optimizers' state read per element (shaped as the parameter); the rest (``step``) is whole.
_PER_ELEMENT_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "grad_avg", "sum"})


def _gradient(grad: Tensor, param: Tensor, group: dict, decoupled: bool = False) -> Tensor:
    """The gradient the step adds to the moment: ``-grad`` under ``maximize``, plus
    ``weight_decay * param`` unless the decay is decoupled (AdamW)."""
    if group.get("maximize", False):
        grad = -grad
    decay = group.get("weight_decay", 0)
    if decay != 0 and not (decoupled or group.get("decoupled_weight_decay", False)):
        grad = grad.add(param, alpha=decay)
    return grad


def _number(value):
    """A hyperparameter as a float (a tensor hyperparameter on the CPU is read there)."""
    return float(value) if isinstance(value, Tensor) and value.numel() == 1 else value


def _steps(state: dict):
    """The steps taken: a float, or under ``capturable`` the device tensor itself."""
    step = state.get("step", 0)
    if isinstance(step, Tensor) and step.device.type == "cpu":
        return float(step)
    return step


def _adam(group, state, grad, param, decoupled=False):
    return formulas.adam_preconditioner(
        state.get("exp_avg_sq", 0.0), _gradient(grad, param, group, decoupled),
        beta2=_number(group["betas"][1]), step=_steps(state), eps=group["eps"],
        max_exp_avg_sq=state.get("max_exp_avg_sq", 0.0) if group["amsgrad"] else None,
    )


def _rmsprop(group, state, grad, param):
    return formulas.rmsprop_preconditioner(
        state.get("square_avg", 0.0), _gradient(grad, param, group), alpha=group["alpha"], eps=group["eps"],
        grad_avg=state.get("grad_avg", 0.0) if group["centered"] else None,
    )


def _adagrad(group, state, grad, param):
    initial = group["initial_accumulator_value"]
    return formulas.adagrad_preconditioner(
        state.get("sum", initial), _gradient(grad, param, group), eps=group["eps"]
    )


def _adamw(group, state, grad, param):
    return _adam(group, state, grad, param, decoupled=True)


_RULES = {
    torch.optim.Adam: _adam,
    # torch >= 2.4 gives AdamW's groups decoupled_weight_decay=True; earlier ones no key.
    torch.optim.AdamW: _adamw,
    torch.optim.RMSprop: _rmsprop,
    torch.optim.Adagrad: _adagrad,
    torch.optim.SGD: None,
}
