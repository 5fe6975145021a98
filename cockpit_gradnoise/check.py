"""Check the package on your own model: which parameters get rows, how, and how exact.

In the spirit of Opacus' validators and ``GradSampleModule`` checks: one call
runs, on float64 copies of the model and a small batch of yours,

- a per-example reference on an un-extended copy: the contributions
  ``x_i = (d out_i / d theta)^T G_i`` with ``G = dL/d out`` of the batch's
  loss, one backward pass per example (whatever the loss's reduction, so
  ``x_i`` sums to ``param.grad``);
- the package's three extensions on a prepared copy (``prepare_model``);

and reports per parameter whether it has rows, how they are computed (a
native rule, the ``torch.func`` fallback, contributions through the batch
when a BatchNorm trains) and the largest relative error of its results::

    table = cgn.check_model(model, x, y, torch.nn.CrossEntropyLoss())

Models whose examples interact (BatchNorm in training mode) have no
per-example gradients: their rows are contributions through the batch, and
the per-example reference does not apply (the error column is then empty).
"""

import contextlib
import copy
import math
from typing import Callable, Dict, Optional, Sequence, Union

from cockpit_gradnoise.extensions import (
    LocalGradient,
    PerExampleSquaredNorms,
    SumsOfContributions,
    facts,
    fallback,
    has_rule,
    hf,
    own_index,
)
from cockpit_gradnoise.extensions.fallback.parameters import caches_bypassed
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)
from cockpit_gradnoise.prepare import prepare_model

import torch
from backpack import backpack
from torch import Tensor, nn
from torch.utils import _pytree

Inputs = Union[Tensor, Sequence[Tensor]]


def _as(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, Tensor) and value.is_floating_point() else value


def _tuple(inputs: Inputs) -> tuple:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _output_leaves(outputs):
    return [leaf for leaf in _pytree.tree_leaves(outputs)
            if isinstance(leaf, Tensor) and leaf.requires_grad]


def reference_contributions(model: nn.Module, inputs: tuple, targets, loss_fn) -> Dict[str, Tensor]:
    """``{name: x_i}`` (``[N, *shape]``): each example's contribution to ``param.grad``.

    ``x_i = (d out_i / d theta)^T G_i`` with ``G`` the gradient of
    ``loss_fn(model(*inputs), targets)`` with respect to the outputs, by one
    backward pass per example through one forward pass of the batch (any
    reduction), so that random draws (dropout, stochastic depth) are the
    batch's; examples must not interact. Parameters without a gradient are
    left out. A gradient that a custom ``autograd.Function`` accumulates by a
    backward pass of its own (Reformer's reversible layers recompute their
    forward and call ``.backward()``) reaches ``param.grad`` but not
    ``torch.autograd.grad``: where one does, every row is taken from
    ``param.grad`` instead (:func:`_accumulated_contributions`).
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    state = torch.get_rng_state()
    outputs = model(*inputs)
    # The loss's own derivatives by each output, on detached copies: an output computed
    # from another (T5's encoder_last_hidden_state, from which the logits follow) would
    # otherwise be counted once directly and once through the other.
    detached = _pytree.tree_map(
        lambda leaf: leaf.detach().requires_grad_() if isinstance(leaf, Tensor)
        and leaf.requires_grad else leaf, outputs)
    grads = torch.autograd.grad(loss_fn(detached, targets), _output_leaves(detached),
                                allow_unused=True)
    pairs = [(o, g) for o, g in zip(_output_leaves(outputs), grads) if g is not None]
    rows = []
    for i in range(inputs[0].shape[0]):
        rows.append(torch.autograd.grad(
            [o for o, _ in pairs], [p for _, p in named], [_only_example(g, i) for _, g in pairs],
            retain_graph=True, allow_unused=True,
        ))
    missing = [p for k, (_, p) in enumerate(named) if rows[0][k] is None]
    if missing and _accumulated_elsewhere(model, inputs, grads, missing, state):
        return _accumulated_contributions(model, inputs, grads, named, state)
    return {
        name: torch.stack([row[k] for row in rows])
        for k, (name, _) in enumerate(named) if rows[0][k] is not None
    }


def _backward_of(model: nn.Module, inputs: tuple, grads: Sequence[Optional[Tensor]], state: Tensor):
    """``param.grad`` of a fresh forward pass (random draws from ``state``, the first
    pass's) after ``.backward()`` of ``grads`` (one per output leaf, ``None`` for none)."""
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(state)
    pairs = [(o, g) for o, g in zip(_output_leaves(model(*inputs)), grads, strict=True) if g is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _accumulated_elsewhere(model: nn.Module, inputs: tuple, grads: Sequence[Optional[Tensor]],
                           missing: list, state: Tensor) -> bool:
    """Whether a parameter of ``missing`` (no gradient by ``torch.autograd.grad``) gets one
    from the batch's ``.backward()``: a backward pass run inside a custom
    ``autograd.Function``'s own backward. The random state is left as it was."""
    resume = torch.get_rng_state()
    _backward_of(model, inputs, grads, state)
    found = any(p.grad is not None for p in missing)
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(resume)
    return found


def _accumulated_contributions(model: nn.Module, inputs: tuple, grads: Sequence[Optional[Tensor]],
                               named: list, state: Tensor) -> Dict[str, Tensor]:
    """:func:`reference_contributions` read from ``param.grad``: per example, a forward pass
    with the batch's random draws and ``.backward()`` of that example's output gradient."""
    rows = []
    for i in range(inputs[0].shape[0]):
        _backward_of(model, inputs, [None if g is None else _only_example(g, i) for g in grads], state)
        rows.append([None if p.grad is None else p.grad.detach().clone() for _, p in named])
    model.zero_grad(set_to_none=True)
    return {
        name: torch.stack([row[k] for row in rows])
        for k, (name, _) in enumerate(named) if rows[0][k] is not None
    }


def _only_example(grad: Tensor, i: int) -> Tensor:
    """``grad`` with every example but ``i`` set to zero."""
    only = torch.zeros_like(grad)
    only[i] = grad[i]
    return only


def _relative_error(got: Tensor, expected: Tensor) -> float:
    if not expected.numel():  # a parameter without elements (MobileBERT's [0, V] dense.weight)
        return 0.0 if got.shape == expected.shape else math.inf
    scale = _largest_magnitude(expected)
    # One difference in the wider of the two dtypes, no other copy (VGG's 103M-element layer:
    # each copy of its sums is 0.8 GB in float32)
    error = torch.sub(got, expected).abs_().max().item()
    return error / scale if scale > 0 else error


def _largest_magnitude(tensor: Tensor) -> float:
    """``max |tensor|`` without a copy of ``|tensor|``."""
    return torch.linalg.vector_norm(tensor, ord=math.inf).item()


def _errors(param, x: Tensor) -> float:
    """Largest relative error of ``param``'s three results against contributions ``x``."""
    squares = x.square()
    norms, sums = squares.flatten(1).sum(1), torch.stack([x.sum(0), squares.sum(0)])
    del squares  # one copy of the contributions at a time (VGG's classifier: 0.8 GB each)
    expected = {BATCH_L2_SAVEFIELD: norms, SUMS_SAVEFIELD: sums, LOCAL_GRADIENT_SAVEFIELD: sums[0]}
    # The sums' third row, where there is one, is a rounding magnitude, not a sum of x.
    got = {field: getattr(param, field) for field in expected}
    got[SUMS_SAVEFIELD] = got[SUMS_SAVEFIELD][:2]
    return max(_relative_error(got[field], value) for field, value in expected.items())


def how_computed(module: nn.Module, param: Optional[nn.Parameter] = None) -> str:
    """How the package computes the rows of ``module``'s direct parameters (of ``param``)."""
    name = type(module).__name__
    parent = getattr(module, fallback.PARENT_ATTRIBUTE, None)
    if param is not None and parent is not None and id(param) in parent.borrowed:
        return f"fallback (torch.func: {name} not run, its parameters used by its parent)"
    if hf.has_rule(module):
        return f"native ({name}, transformers rule)"
    if has_rule(module):
        return f"native ({name})"
    if own_index.builds_index(module):
        return f"native (Embedding, the index {name}'s forward builds)"
    state = getattr(module, fallback.ATTRIBUTE, None)
    if isinstance(state, fallback.Fallback) and state.closed_form is not None:
        return f"native ({name} behaves as {state.closed_form.name})"
    if isinstance(state, fallback.Fallback):
        return f"fallback (torch.func, {name})"
    return f"none ({name}: no rule)"


def _copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model``, its caches of tensors computed from its parameters empty
    (timm's eval-mode ``attention_bias_cache``: tensors with a graph, which ``copy.deepcopy``
    refuses), as its own ``train()`` leaves them; ``model``'s are kept."""
    with contextlib.ExitStack() as stack:
        for module in model.modules():
            stack.enter_context(caches_bypassed(module))
        return copy.deepcopy(model)


def _owners(model: nn.Module) -> Dict[int, nn.Module]:
    return {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}


def _why_no_rows(param, module, recorded: facts.BackwardFacts, examples: int) -> str:
    """The reason ``param`` has no rows ('' if it has)."""
    if param.grad is None:
        return "no gradient (unused in the forward pass)"
    state = getattr(module, fallback.ATTRIBUTE, None)
    if isinstance(state, fallback.Fallback) and state.refused:
        return f"fallback refused: {state.refused}"
    if id(param) in recorded.mixed:  # its rows mix the examples (extensions/fallback/mixing.py)
        return recorded.mixed[id(param)].partition(": ")[2]
    if id(param) in recorded.refusals:  # refused by name (the fallback: an output without the batch)
        return recorded.refusals[id(param)]
    if not all(hasattr(param, f) for f in (BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)):
        if id(param) not in recorded.owners:  # no hook saw its layer in the backward pass
            return f"{type(module).__name__}: it {facts.UNSEEN}"
        return f"no rule for {type(module).__name__}"
    if recorded.shared(param):
        return "used by several layers (tied weights)"
    leading = recorded.leading_sizes.get(id(param), examples)
    if leading != examples:
        return f"applied without the batch dimension (output leads with {leading}, batch {examples})"
    return ""


def check_model(
    model: nn.Module, inputs: Inputs, targets, loss_fn: Callable, *, verbose: bool = True,
    dtype: torch.dtype = torch.float64,
):
    """Which parameters of ``model`` get rows, how, and their largest relative error.

    Runs on float64 copies (``dtype``; ``model`` is not changed): a per-example
    reference (:func:`reference_contributions`) on one, the package's
    extensions on a :func:`~cockpit_gradnoise.prepare_model` copy of another;
    compares per parameter the per-example squared norms, the sums of the
    contributions and of their squares, and the gradient.

    Args:
        model: Your network, as you train it (its mode is kept: in training
            mode a BatchNorm makes the rows contributions through the batch).
        inputs: One batch: a tensor, or a tuple of the forward's positional
            arguments, each with the examples first. Keep it small (the
            reference runs one backward pass per example).
        targets: Its targets.
        loss_fn: ``loss_fn(model(*inputs), targets)``, the scalar loss you train with.
        verbose: Print the table and the coverage.
        dtype: Of the copies: float64, unless the model's own code cannot run in float64
            (a mask filled with float64's least value in float32); then ``torch.float32``,
            and the errors are float32 rounding (about 1e-7 relative, not 1e-15).

    Returns:
        A ``pandas.DataFrame``, one row per trainable parameter: ``param``,
        ``elements``, ``rows`` (bool), ``how`` (native rule, fallback,
        contributions), ``max_rel_error`` (NaN without rows or reference) and
        ``note`` (why there are no rows). ``frame.attrs["coverage"]`` is the
        fraction of trainable elements with rows.
    """
    import pandas

    inputs = tuple(_as(x, dtype) for x in _tuple(inputs))
    targets = _as(targets, dtype)
    interact = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())
    state = torch.get_rng_state()  # both passes draw the same dropout, stochastic depth
    # One copy of the model at a time besides yours (VGG's 133M parameters: 0.5 GB each in float32)
    reference = {} if interact else reference_contributions(_copy(model).to(dtype), inputs, targets, loss_fn)
    prepared = prepare_model(_copy(model).to(dtype))

    torch.set_rng_state(state)
    prepared.zero_grad(set_to_none=True)
    recorded = facts.begin()
    with backpack(PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient()):
        loss_fn(prepared(*inputs), targets).backward()
    owners = _owners(prepared)
    examples = inputs[0].shape[0]
    coincident = facts.batch_by_coincidence(
        {name: recorded.leading_sizes[id(param)] for name, param in prepared.named_parameters()
         if id(param) in recorded.leading_sizes}, examples)
    records = []
    for name, param in prepared.named_parameters():
        if not param.requires_grad:
            continue
        module = owners[id(param)]
        note = _why_no_rows(param, module, recorded, examples)
        if not note and name in coincident:
            note = (f"leads with the batch size ({examples}) by coincidence: layers of its kind "
                    "run on rows that are not examples")
        how = how_computed(module, param)
        if id(param) in recorded.block_rows:  # (extensions/fallback/blocks.py)
            how = f"per example (its block {recorded.block_rows[id(param)]} run on each example)"
        elif id(module) in recorded.repeated:  # (extensions/repeated.py)
            how = (f"per example ({type(module).__name__}: its {recorded.repeated[id(module)].count} "
                   "calls recomputed and summed)")
        if interact or recorded.examples_interact:
            how += ", contributions through the batch"
        error = scale = math.nan
        if name in reference:
            scale = _largest_magnitude(reference[name]) if reference[name].numel() else 0.0
            if not note:
                error = _errors(param, reference[name])
        records.append({"param": name, "elements": param.numel(), "rows": not note, "how": how,
                        "max_rel_error": error, "reference_scale": scale, "note": note})
    frame = pandas.DataFrame.from_records(records)
    total = frame.elements.sum()
    frame.attrs["coverage"] = float(frame.elements[frame.rows].sum() / total) if total else 0.0
    if verbose:
        print(format_check(frame))
    return frame


def format_check(frame) -> str:
    """The table of :func:`check_model` as text, with the coverage last."""
    lines = []
    for record in frame.itertuples():
        error = "-" if math.isnan(record.max_rel_error) else f"{record.max_rel_error:.1e}"
        rows = "yes" if record.rows else "NO "
        line = f"{rows} {error:>8}  {record.param} [{record.elements}]  {record.how}"
        lines.append(line + (f"  -- {record.note}" if record.note else ""))
    with_rows = int(frame.elements[frame.rows].sum())
    lines.append(f"elements with rows: {with_rows} of {int(frame.elements.sum())} "
                 f"({100 * frame.attrs['coverage']:.1f}%)")
    return "\n".join(lines)
