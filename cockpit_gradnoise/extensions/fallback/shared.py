"""A mixture-of-experts block's other linear layers (shared experts, a shared expert's gate):
per-example results from one pass of the block on the whole batch.

Beside the routed experts (:mod:`.experts`), Qwen2-MoE runs a shared expert (an MLP of
``nn.Linear``) and its sigmoid ``shared_expert_gate`` on the flattened tokens ``[N*T, C]``,
and DeepSeek-V3 (GLM-4-MoE, AFMoE, ERNIE-4.5-MoE, EXAONE-MoE alike) its shared experts on
the block's ``[N, T, C]`` input. Example ``i``'s contribution to a linear layer's weight
is the sum over its rows of outer products, as any ``nn.Linear`` on sequences:

.. math::

    x_i(W) = \\sum_{r \\text{ of } i} \\delta_r a_r^{\\top}, \\qquad x_i(b) = \\sum_{r \\text{ of } i} \\delta_r,

``a_r`` the layer's input row and ``\\delta_r`` the gradient at its output row *through the
block's output only*: the block is run once more on the whole batch (its inputs as the
batch's call had them, hooks off) and ``torch.autograd.grad`` of its output at ``G`` (the
gradient the batch's pass brought there) gives each layer's ``\\delta``. A term of the loss
that reaches a layer otherwise (an auxiliary loss on its output) is then not in the rows, so
the check that they add up to the gradient (:func:`.blocks.reached_otherwise`) leaves the
parameter out, as the per-example recomputation does: never split per token.

Which row is whose: a layer's input, ``[..., in]`` flattened to ``[M, in]``, in example-major
order, ``M = N P`` (``P`` rows per example: ``[N*T, C]`` or ``[N, T, C]``). Never a silently
wrong number: the block's output again must equal the batch's (to
:func:`.precision.rounding_bound`), each layer is called once, and the block's first tracked
step also recomputes it per example and compares the per-example squared norms
(:func:`.experts.confirmed`, which these rows join): a layer whose rows are not example-major
(a block that regroups its tokens before it) fails there and the block is recomputed per
example for good. Only where the experts' fast way serves the block (:func:`.experts.results`);
a parameter of any other module stays with the recomputation. Tests:
``tests/test_moe_shared.py``.
"""

import contextlib
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions.fallback.capture import first_tensor
from cockpit_gradnoise.extensions.fallback.experts import ATTRIBUTE
from cockpit_gradnoise.extensions.fallback.reduce import linear_on_rows
from cockpit_gradnoise.extensions.precision import NarrowestResult, rounding_bound
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD, SUMS_SAVEFIELD

import torch
from torch import Tensor, nn
from torch.utils import _pytree

#: Whether the shared layers' rows come from the batch (module docstring); ``False``: from the
#: per-example recomputation, as before. A setting for measurements, not per-pass state.
FROM_THE_BATCH = True


def shared_linears(block: nn.Module, params: Dict[str, nn.Parameter]) -> Dict[nn.Linear, Dict[str, str]]:
    """``{layer: {"weight": name, "bias": name}}`` of the ``nn.Linear`` layers (the class itself)
    inside ``block`` whose trainable parameters are all in ``params`` (``{name: param}``: those
    the experts' fast way did not serve, a router it served among them), outside its experts;
    empty where the experts' fast way has no capture on it. (A router it did not serve, an
    ``nn.Linear``, is one of them: its rows through the block's output are as exact)."""
    capture = block.__dict__.get(ATTRIBUTE)
    if capture is None:
        return {}
    outside = {id(sub) for sub in capture.experts.modules()}
    names = {id(p): name for name, p in params.items()}
    found = {}
    for _, layer in block.named_modules():
        if id(layer) in outside:
            continue
        if type(layer) is nn.Linear:
            own = {role: p for role, p in layer.named_parameters(recurse=False) if p.requires_grad}
            if own and all(id(p) in names for p in own.values()):
                found[layer] = {role: names[id(p)] for role, p in own.items()}
    return found


def _ancestors(tensors: List[Tensor]) -> set:
    """The autograd nodes ``tensors`` were computed through (their graph, walked back)."""
    seen, stack = set(), [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(following for following, _ in node.next_functions)
    return seen


@contextlib.contextmanager
def _experts_replayed(experts: nn.Module, kept, feeding: List[Tensor]):
    """``experts`` giving their output of the batch's pass (``kept``: inputs and output) where
    called on those very inputs, instead of running again (their routed products are most of
    the block's cost); otherwise run. ``feeding``: their inputs that require grad, for
    :func:`_ancestors`."""
    inputs, output = kept

    def replay(*args, **kwargs):
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor)]
        feeding.extend(t for t in tensors if t.requires_grad)
        if len(tensors) == len(inputs) and all(
                t.shape == k.shape and t.dtype == k.dtype and torch.equal(t.detach(), k)
                for t, k in zip(tensors, inputs)):
            return output
        return run(*args, **kwargs)

    run = experts.forward
    experts.forward = replay
    try:
        yield
    finally:
        del experts.forward  # (the instance attribute: the class's forward again)


def _rows_again(block: nn.Module, call, grad: Tensor, expected: Tensor, layers: List[nn.Linear],
                narrowest: NarrowestResult, kept=None) -> Optional[Dict[nn.Linear, Tuple[Tensor, Tensor]]]:
    """``{layer: (inputs [M, in], output gradients [M, out])}`` of one pass of ``block`` on the
    whole batch (hooks off: the caller's context), ``None`` where its output is not
    ``expected`` or a layer is not called exactly once; ``narrowest`` sees its forward pass.

    ``kept``: the experts' inputs and output in the batch's pass (:func:`.experts.batch_call`),
    replayed instead of run where no layer's output leads to their inputs (the autograd graph,
    walked back): the layers' gradients through the block's output are then the same with
    the experts' output a constant (a function of inputs that do not depend on the layers,
    and of the experts' parameters, none of the layers'); otherwise ``None``.
    """
    seen: Dict[nn.Linear, List[Tuple[Tensor, Tensor]]] = {layer: [] for layer in layers}

    def keep(layer, args, output):
        seen[layer].append((args[0].detach() if args else None, output))

    capture = block.__dict__.get(ATTRIBUTE)
    feeding: List[Tensor] = []
    replayed = _experts_replayed(capture.experts, kept, feeding) if kept is not None and capture is not None \
        and "forward" not in capture.experts.__dict__ else contextlib.nullcontext()
    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        args, kwargs = _pytree.tree_unflatten(call.leaves, call.spec)
        with torch.enable_grad(), narrowest, replayed:
            output = block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    first = first_tensor(output)
    if first is None or first.shape != expected.shape or not expected.numel() \
            or not float((first.detach() - expected).abs().max()) <= rounding_bound(expected):
        return None
    if any(len(calls) != 1 or calls[0][0] is None or not calls[0][1].requires_grad for calls in seen.values()):
        return None
    outputs = [seen[layer][0][1] for layer in layers]
    if feeding and not _ancestors(feeding).isdisjoint(o.grad_fn for o in outputs):
        return None  # a layer feeds the experts: their output is no constant of the layers
    deltas = torch.autograd.grad(first, outputs, grad.to(first.dtype), allow_unused=True)
    found = {}
    for layer, delta in zip(layers, deltas):
        if delta is not None:
            rows = seen[layer][0][0]
            found[layer] = (rows.reshape(-1, rows.shape[-1]), delta.reshape(-1, delta.shape[-1]))
    return found


def layer_results(rows: Tensor, deltas: Tensor, examples: int, bias: bool,
                  squares: bool) -> Optional[Dict[str, Tuple[Tensor, Tensor]]]:
    """``{"weight": (||x_i||^2 [N], [sum_i x_i(, sum_i x_i**2)]), "bias": ...}`` of one linear
    layer from its rows in example-major order (module docstring), by
    :func:`.reduce.linear_on_rows`; ``None`` where their count is not a multiple of ``examples``."""
    count = rows.shape[0]
    if not count or count % examples or deltas.shape[0] != count:
        return None
    return linear_on_rows(rows.reshape(examples, count // examples, -1),
                          deltas.reshape(examples, count // examples, -1), bias, squares)


def results(block: nn.Module, call, grad: Tensor, expected: Tensor, params: Dict[str, nn.Parameter],
            savefields, kept=None) -> Tuple[Dict[str, Dict[str, Tensor]], Optional[torch.dtype]]:
    """``({savefield: {name: result}}, dtype)``: the results of the parameters of ``params`` held
    by the block's shared linear layers (:func:`shared_linears`), from one pass on the batch
    (module docstring), empty where it covers none; and the narrowest floating dtype that pass
    computed in (:class:`.precision.NarrowestResult`: a float64 block whose router computes in
    float32 rounds there; ``None`` where it did not run). ``call``: the block's call in the
    batch's pass, ``expected`` its output there, ``grad`` the gradient at it. Run inside the
    caller's ``hooks_off``, ``caches_bypassed`` and ``state_kept``. ``kept``: the experts' call in
    the batch's pass (:func:`.experts.batch_call`), replayed rather than run again."""
    layers = shared_linears(block, params) if FROM_THE_BATCH else {}
    if not layers:
        return {}, None
    narrowest = NarrowestResult(expected.dtype)
    try:
        found = _rows_again(block, call, grad, expected, list(layers), narrowest, kept)
    except Exception:  # noqa: BLE001 - a block that cannot run so: the recomputation computes them
        return {}, None
    if found is None:
        return {}, None
    squares = SUMS_SAVEFIELD in savefields
    out = {savefield: {} for savefield in savefields}
    for layer, (rows, deltas) in found.items():
        roles = layers[layer]
        reduced = layer_results(rows, deltas, grad.shape[0], "bias" in roles, squares)
        for role, (norms, sums) in (reduced or {}).items():
            here = {BATCH_L2_SAVEFIELD: norms, SUMS_SAVEFIELD: sums, LOCAL_GRADIENT_SAVEFIELD: sums[0]}
            for savefield in savefields:
                out[savefield][roles[role]] = here[savefield]
    return out, narrowest.dtype
