"""Models whose examples meet in the backward pass: their layers found by one gradient, and left out.

Every rule (and every block, :mod:`.blocks`) gives example ``i`` the rows ``i`` of its
layer's output gradient ``G``: exact only where those rows come from example ``i``'s
loss alone. A model that mixes the examples of the batch breaks that, and one that
mixes them in a way its forward outputs cannot show breaks it silently. timm's
``csatv2``: its ``SpatialTransformerBlock`` attends over the *batch* (``(B, N)``
queries and keys, ``(B, B)`` scores) behind a ``LayerNorm(1)`` whose output is its
bias for every example, so one example alone gives its row of the batch's output,
but the gradient of each example's loss reaches every other example's rows of
``norm1``, the position convolution and ``qkv`` (``norm1.bias`` off by 83% to 99.9%).

So the assumption is checked itself, by one gradient, where the layers on rows
that are not examples are found (:mod:`.regroup`'s survey: before the first
recorded forward pass of each new shape of the inputs, on a pass with every hook
off). With ``e`` one example, ``y`` the model's outputs that lead with the batch
and ``c`` a random cotangent on ``y``'s rows of ``e`` only (zero elsewhere), and
``o`` the output of each layer with trainable parameters of its own, or of each
block, whose rows are examples:

.. math::

    \\Big(\\frac{\\partial y}{\\partial o}\\Big)^{\\top} c \\;=\\; 0
    \\quad\\text{on every row of } o \\text{ but } e .

A model whose examples are independent gives exact zeros there (zero times a
finite number sums to zero, whatever the order). A layer with a finite entry on
another example's rows above ``sqrt(eps)`` of that gradient's largest magnitude
is given to the smallest module around it that takes and returns the batch first and
whose own output the same gradient reaches on the example's rows only (:mod:`.regroup`,
``_block_mixed``; the model itself excepted): run again on each example alone, as every
block (:mod:`.blocks`), with its checks (the output of one example alone is its row of the
batch's; the contributions add up to the gradient), which refuse it by name where the examples
interact in its forward or backward pass. csatv2's ``SpatialTransformerBlock``: exact, since
each example's ``q``, ``k``, ``v`` are its own function of its input alone, whatever the batch.
With no such module, the layer's parameters are left out by name at each tracked step, with
a warning (never rows taken from other examples' losses); inside a block that fails, every layer.
The margin is for the rounding residue of a mixing layer behind a ``LayerNorm(1)``,
whose exact gradient is zero (about ``eps`` of the gradient in csatv2's earlier
stages, against 1 where it mixes). Non-finite entries tell nothing (``0 * inf``)
and are passed over. BatchNorm layers in training mode run in evaluation mode
for the check: their mixing is told apart (``examples_interact``: the rows are
contributions through the batch). One example is tried: a model that mixes only
other pairs of examples is not seen. A model whose outputs have no rows per
example (a loss only) is not checked; nor is a batch of one example (checked
again at the first larger batch of the same shape).

The one gradient is taken with respect to a zero added to every output of the pass
(:class:`Probe`), so that a hook on each checks its gradient as it passes and lets
it go: the outputs' gradients are never all held at once, and no parameter's
gradient is computed (no hook on a parameter runs). Its cost, once per new shape
of the inputs: that pass with gradients instead of without, and one backward pass
to the layers' outputs, before the real forward pass (not on top of its memory).
"""

import functools
from typing import Dict, List, Optional, Sequence, Set, Tuple

from cockpit_gradnoise.extensions import facts
from cockpit_gradnoise.extensions.fallback.capture import BLOCK_ATTRIBUTE
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters
from cockpit_gradnoise.extensions.precision import rounding_bound

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree

#: The attribute (in a layer's ``__dict__``) of why its rows are not its examples' own:
#: its parameters are left out at each tracked step.
MIXED = "_cgn_examples_mixed"
#: The attribute (in the model's ``__dict__``) of the input shapes checked (the survey's keys).
CHECKED = "_cgn_mixing_checked"
#: Why a layer's parameters are left out (one text for every such layer: one group in
#: the warning, :func:`~cockpit_gradnoise.step_checks.explained_message`).
REASON = ("the gradient of one example's loss reaches other examples' rows of their layer's "
          "output: the model mixes the examples of the batch (attention over the batch "
          "dimension, say), so no per-example row of theirs is that example's own; make the "
          "examples independent, or take per-example gradients by a loop (cgn.check_model "
          "shows which layers)")


class BatchNormEval:
    """Every BatchNorm layer in training mode in evaluation mode inside the ``with``."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training]

    def __enter__(self):
        for layer in self.layers:
            layer.training = False

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.training = True


class Probe:
    """A zero added to every output of the survey's pass with gradients (:meth:`through`): one
    gradient with respect to it reaches every output, and a hook on each checks its gradient
    as it passes, with no parameter's gradient computed (their hooks, the model's own or
    a quantity's, never run) and no output's kept."""

    def __init__(self):
        self.zero = torch.zeros((), requires_grad=True)

    def through(self, output):
        """``output`` with the zero added to each floating tensor that requires gradients."""
        def add(leaf):
            if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.requires_grad:
                return leaf + self.zero.to(device=leaf.device, dtype=leaf.dtype)
            return leaf

        return _pytree.tree_map(add, output)


def _per_example(tensors: Sequence, real: Sequence, larger: Sequence, examples: int) -> List[Tensor]:
    """The tensors of one call's outputs led by ``examples`` rows in the batch and by one
    more in the batch one example larger, that require gradients."""
    if len(real) != len(larger):
        return []
    return [t for t, a, b in zip(tensors, real, larger)
            if a == examples and b == examples + 1 and t.requires_grad]


def _outputs(calls, larger, examples: int, module: nn.Module) -> List[Tensor]:
    """The per-example output tensors of every call of ``module`` in the checked pass."""
    kept = calls.tensors.get(module, [])
    real, more = calls.outputs.get(module, []), larger.outputs.get(module, [])
    if not (len(kept) == len(real) == len(more)):
        return []
    return [t for call, a, b in zip(kept, real, more) for t in _per_example(call, a, b, examples)]


def mixes(grad: Optional[Tensor], example: int) -> bool:
    """Whether ``grad`` has, on a row other than ``example``'s, a finite entry above
    ``sqrt(eps)`` of its largest finite magnitude (:func:`.precision.rounding_bound`; module
    docstring)."""
    if grad is None or not grad.is_floating_point():
        return False
    magnitudes = grad.abs().nan_to_num_(nan=0.0, posinf=0.0)  # non-finite: tells nothing
    bound = rounding_bound(magnitudes)
    magnitudes[example] = 0
    others = float(magnitudes.amax())
    return others > 0 and others > bound


def check(model: nn.Module, calls, larger, examples: int,
          around: Sequence[nn.Module] = ()) -> Tuple[Set[nn.Module], Set[nn.Module]]:
    """The modules whose output rows the gradient of one example's outputs reaches on other
    examples (module docstring), and those whose outputs were checked, from ``calls``, the
    survey's pass with gradients that kept its modules' outputs, and ``larger``, its pass one
    example larger: every layer with parameters of its own, every block, and the modules
    ``around`` (those a block could be made of, :mod:`.regroup`)."""
    if examples < 2:
        return set(), set()
    cotangents = {}
    generator = torch.Generator().manual_seed(0)  # the model's own random state untouched
    example = examples - 1
    for output in _outputs(calls, larger, examples, getattr(model, "_orig_mod", model)):
        only = torch.zeros_like(output)
        row = torch.rand(output[example].shape, generator=generator, dtype=torch.float64) + 0.5
        only[example] = row.to(output.dtype).to(output.device)
        cotangents[output] = only
    checked: Dict[nn.Module, List[Tensor]] = {}
    for module in (*model.modules(), *around):
        if module is not model and (direct_parameters(module) or BLOCK_ATTRIBUTE in module.__dict__
                                    or module in around):
            checked[module] = _outputs(calls, larger, examples, module)
    if not cotangents:
        return set(), set()
    # Each output's gradient checked by a hook as it passes, and let go: never every layer's at
    # once (as large as the activations); no parameter's gradient asked for (their hooks run not).
    found: set = set()
    handles = [t.register_hook(functools.partial(_note, module, example, found))
               for module, outputs in checked.items() for t in outputs]
    try:
        torch.autograd.grad(list(cotangents), calls.probe.zero, list(cotangents.values()),
                            allow_unused=True)
    except RuntimeError:  # a pass that cannot be differentiated tells nothing
        return set(), set()
    finally:
        for handle in handles:
            handle.remove()
    return found, {module for module, outputs in checked.items() if outputs}


def leave_out(module: nn.Module) -> None:
    """Mark ``module``'s parameters left out at each tracked step (every layer's inside it,
    where it is a block): its rows mix the examples and no block around it gives them."""
    inside = module.modules() if BLOCK_ATTRIBUTE in module.__dict__ else (module,)
    for layer in inside:
        if direct_parameters(layer):
            layer.__dict__[MIXED] = REASON


def _note(module: nn.Module, example: int, found: set, grad: Tensor) -> None:
    if mixes(grad, example):
        found.add(module)


def refuse_mixed(module: nn.Module) -> bool:
    """Whether the check found ``module``'s rows mixed: then its parameters are recorded
    as left out in this backward pass (:attr:`.facts.BackwardFacts.mixed`, with the reason
    the warning gives), and no rule runs on it."""
    why = module.__dict__.get(MIXED)
    if why is None:
        return False
    recorded = facts.recording()
    for name, param in direct_parameters(module).items():
        recorded.mixed[id(param)] = f"{type(module).__name__}.{name}: {why}"
    return True
