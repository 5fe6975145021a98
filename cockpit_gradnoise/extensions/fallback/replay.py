"""The per-example replay: a module's forward under ``vmap``, its children replayed.

:func:`per_example_gradients` gives the contributions ``x_i`` of a module's
parameters for a chunk of examples from the :class:`.capture.Call` its
forward hook kept; the children's calls are replayed (:class:`_Replay`)
instead of run, and the ``F.linear`` biases' terms kept for their structural
zeros (:class:`_LinearBiases`).
"""

import contextlib
import functools
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise.extensions import precision
from cockpit_gradnoise.extensions.fallback.capture import Call, ChildCall
from cockpit_gradnoise.extensions.fallback.padding import padding_kept
from cockpit_gradnoise.extensions.fallback.parameters import (
    attributes_as_called,
    caches_bypassed,
    hooks_off,
    own_parameters,
    variables_reached,
)

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree


def per_example_gradients(
    module: nn.Module, params: Dict[str, Tensor], call: Call, batched: Sequence[int],
    batched_children: Collection[int], grads: Dict[int, Tensor], start: int, stop: int,
    blind_outputs: Sequence[int] = (), blind: Optional[Dict[str, str]] = None,
) -> Dict[str, Tensor]:
    """``{name: x_i}`` (``[stop - start, *shape]``) for examples ``start:stop``.

    The module's forward under ``vmap`` over the examples, with a copy of
    each direct parameter per example in place of its own (what
    ``torch.func.functional_call`` does, for these only, at a third of the
    cost under ``vmap``), then one ordinary backward pass to those copies: the
    gradient of example ``i``'s copy is ``x_i``, the vector-Jacobian product
    of the module's docstring. Its children are replayed (:class:`_Replay`):
    the recomputation runs the module's own operations only. ``batched`` are
    the indices of the leaves that lead with the batch dimension and depend on the batch,
    ``batched_children`` the children's calls whose outputs depend on it (:mod:`.layout`),
    ``grads`` the output gradients by output position.

    ``blind_outputs`` are the positions of outputs that got a gradient but none per example
    (one without the batch dimension, whose gradient is the whole batch's sum: a bias
    returned for the parent to add) or may have (a parameter returned as it is): the
    parameters they depend on are left out of the result and named in ``blind`` (with
    why), never given their contributions through the other outputs only. An output in
    neither (no gradient: it did not reach the loss) contributes nothing.
    """
    positions = list(grads)
    total = grads[positions[0]].shape[0]
    stop = min(stop, total)
    examples = tuple(call.leaves[k][start:stop] for k in batched)
    n = stop - start
    replay = _Replay(call.children, total, start, stop, batched_children)
    copies = {name: p.expand(n, *p.shape).requires_grad_() for name, p in params.items()}
    recorded = replay.recorded_outputs()
    # vmap's arguments and results as flat tuples of tensors: its pytree work on dicts
    # was half of a small module's fallback.
    names, keys, own_end = list(copies), list(recorded), len(copies)
    examples_end = own_end + len(examples)

    def flat_forward(*flat):
        own = dict(zip(names, flat[:own_end]))
        outputs, sinks = forward(own, flat[own_end:examples_end], dict(zip(keys, flat[examples_end:])))
        return (*outputs, *sinks)

    def forward(own, examples, recorded):
        args, kwargs = _arguments(call, {k: example.unsqueeze(0) for k, example in zip(batched, examples)})
        with own_parameters(module, own), replay.replacing(module, recorded):
            output = module.forward(*args, **kwargs)
        ordered = [*positions, *blind_outputs]
        outputs = (output,) if call.outputs is None else tuple(output[call.outputs[p]] for p in ordered)
        return outputs, tuple(sink for sink, _ in replay.sinks)

    biases = _LinearBiases([name for name, copy in copies.items()
                            if copy.dim() == 2 and name.endswith("bias")])

    def traced_forward(*flat):
        with biases.watching(dict(zip(names, flat[:own_end]))):
            results = flat_forward(*flat)
        biases.check_versions()
        return (*results, *biases.outputs)

    traced = traced_forward if biases.watched else flat_forward
    with _recomputing(module, call):
        results = torch.func.vmap(traced)(*copies.values(), *examples, *recorded.values())
    count = len(positions) + len(blind_outputs)
    outputs, sinks = results[: len(positions)], results[count : len(results) - len(biases.names)]
    _refuse_blind(copies, results[len(positions) : count], blind)
    copies = {name: copy for name, copy in copies.items() if name not in (blind or {})}
    if not copies:
        return {}, {}
    spread = results[len(results) - len(biases.names) :]  # F.linear's outputs, [n, ..., out]
    pairs = [(out, grads[p][start:stop].unsqueeze(1)) for out, p in zip(outputs, positions)]
    pairs += [(sink, cotangent) for sink, (_, cotangent) in zip(sinks, replay.sinks)]
    replay.check(any(_depends_on_copies(out) for out in outputs))
    pairs = [(out, g) for out, g in pairs if _depends_on_copies(out)]
    if not pairs:  # no output depends on the parameters: zero contributions
        _check_unused(module, call, [name for name in copies if "." not in name])
        return {name: torch.zeros_like(copy) for name, copy in copies.items() if "." not in name}, {}
    found = torch.autograd.grad([o for o, _ in pairs], [*copies.values(), *spread],
                                [g for _, g in pairs], allow_unused=True)
    _check_unused(module, call, [name for name, x in zip(copies, found) if x is None and "." not in name])
    # A direct parameter the forward did not use contributes exact zeros; a child's, nothing.
    contributions = {name: torch.zeros_like(copy) if x is None else x
                     for (name, copy), x in zip(copies.items(), found) if x is not None or "." not in name}
    return contributions, biases.terms(spread, found[len(copies) :], contributions)


def batch_gradients(module: nn.Module, params: Dict[str, Tensor], call: Call, batched_children: Collection[int],
                    grads: Dict[int, Tensor]) -> Tuple[Dict[str, Optional[Tensor]], float]:
    """``({name: G}, sum ||g|| ||y||)``: the gradient of each of ``params`` from the module run
    once more on the whole batch, at its output gradients ``grads`` (by output position), its
    children replayed as :func:`per_example_gradients` replays them (:class:`_Replay`: their
    recorded outputs, dropout's draws included, and the gradients that flowed into them through
    inputs that depend on the parameters), ``None`` for a parameter no output depends on; and
    the sum over the outputs ``y`` it differentiates (the children's inputs among them) of
    ``||y|| ||g||`` with their gradients ``g``, a scale in the units of ``<G, theta>`` (a loss).

    ``G = sum_i x_i`` where the module's examples are independent in its forward *and* its
    backward pass: the per-example recomputation's ``x_i`` (under ``vmap``, one example at a
    time) are checked against it (:func:`.running._not_summing_under_vmap`). Its own operations
    are the only ones run on the batch: what the check compares is the module's, not its
    children's.
    """
    positions = list(grads)
    total = grads[positions[0]].shape[0]
    replay = _Replay(call.children, total, 0, total, batched_children, whole=True)
    args, kwargs = _arguments(call)
    own = {name: p.detach().requires_grad_() for name, p in params.items()}
    with _recomputing(module, call), own_parameters(module, own), \
            replay.replacing(module, replay.recorded_outputs()):
        output = module.forward(*args, **kwargs)
    outputs = [output] if call.outputs is None else [output[call.outputs[p]] for p in positions]
    replay.check(any(out.requires_grad for out in outputs))
    pairs = [(out, grads[p].to(out.dtype)) for out, p in zip(outputs, positions)] + replay.sinks
    pairs = [(out, g) for out, g in pairs if out.requires_grad]
    if not pairs:
        return {name: None for name in own}, 0.0
    found = torch.autograd.grad([o for o, _ in pairs], list(own.values()), [g for _, g in pairs],
                                allow_unused=True)
    return dict(zip(own, found)), sum(float(o.detach().double().norm() * g.double().norm()) for o, g in pairs)


@contextlib.contextmanager
def _recomputing(module: nn.Module, call: Call):
    """What a recomputation of ``module``'s recorded ``call`` runs under, per example
    (:func:`per_example_gradients`) or on the batch (:func:`batch_gradients`) alike: no hooks,
    no caches, math attention (a batching rule for every op), gradients on, the call's autocast,
    padding rows kept, and the attributes the call found on the module."""
    with hooks_off(module), caches_bypassed(module), math_attention(), torch.enable_grad(), \
            precision.autocast_as(call.autocast), padding_kept(module), \
            attributes_as_called(module, call.attributes):
        yield


def _arguments(call: Call, replaced: Optional[Dict[int, Tensor]] = None) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of the recorded ``call``, the caches it filled from empty
    (:mod:`.caches`) none; ``replaced``: ``{leaf index: tensor}`` (an example's parts), else
    the call's own leaves. ``module(x)`` (``call.one_input``): nothing to rebuild."""
    if call.one_input is not None:
        return (call.one_input if replaced is None else replaced[0],), {}
    leaves = list(call.leaves)
    for k in call.fresh_caches:
        leaves[k] = None
    for k, leaf in (replaced or {}).items():
        leaves[k] = leaf
    return _pytree.tree_unflatten(leaves, call.spec)


def _refuse_blind(copies: Dict[str, Tensor], outputs: Sequence[Tensor],
                  blind: Optional[Dict[str, str]]) -> None:
    """Name in ``blind`` the copies the ``outputs`` without a gradient per example depend on:
    their contributions through those outputs cannot be had from the output gradients."""
    outputs = [out for out in outputs if _depends_on_copies(out)]
    if not outputs:
        return
    if blind is None:
        raise Refused("an output without a gradient per example depends on its parameters")
    reached = torch.autograd.grad(outputs, list(copies.values()), [torch.ones_like(o) for o in outputs],
                                  retain_graph=True, allow_unused=True)
    for name, grad in zip(copies, reached):
        if grad is not None:
            blind.setdefault(name, (
                "it reaches an output of its module that has no gradient per example (one "
                "without the batch dimension, such as a bias returned for the parent to add: its "
                "gradient is the batch's sum), so its contributions through it are unknown"))


def used_by_forward(call: Call, params: Dict[str, Tensor]) -> List[str]:
    """The names of ``params`` the call's own part of the forward graph accumulates into:
    from its output's node down to its arguments' nodes (not below them)."""
    wanted = {id(p): name for name, p in params.items()}
    reached = variables_reached(call.nodes.output, call.nodes.inputs)
    return [wanted[id(v)] for v in reached if id(v) in wanted]


def _check_unused(module: nn.Module, call: Call, unused: List[str]) -> None:
    """Refuse where a direct parameter the recomputation did not use was used by the
    forward pass: it read a tensor computed from the parameter and kept (a cache the
    module keeps otherwise than :func:`.parameters.parameter_caches` finds), and its rows
    would be zeros. Walks the graph only then (no cost otherwise)."""
    if not unused:
        return
    used = used_by_forward(call, {name: module._parameters[name] for name in unused})
    if used:
        raise Refused(
            f"the forward pass used {sorted(used)} but its recomputation with other tensors "
            "in their place did not (a tensor computed from them and kept, a cache?): clear "
            "the module's cache before each tracked step, or train it in training mode")


class _LinearBiases(TorchFunctionMode):
    """In the recomputation: the outputs of the ``F.linear`` calls that add one of the
    ``watched`` copies (the examples' copies of 1-D parameters named ``*bias``: watching
    costs a Python call per operation, a quarter of a small layer scale's fallback) as
    their ``bias``.

    The gradient at such an output, ``[n, ..., out]``, holds the terms
    ``t_il`` (one per position ``l``) that the bias's contribution
    ``x_i = sum_l t_il`` adds up: with ``sum_l |t_il|`` at hand, its
    structural zeros (an attention key's bias: Swin's ``qkv`` bias) are told
    from rounding noise as the native Linear rule tells them
    (:func:`.sums.structural_zeros`). A copy any other operation uses is left
    out: not all its terms are known.
    """

    def __init__(self, watched: List[str]):
        super().__init__()
        self.watched = watched
        self.copies: Dict[int, str] = {}
        self.names: List[str] = []  # of each output, in order
        self.outputs: List[Tensor] = []
        self.versions: List[int] = []
        self.other_uses: set = set()

    @contextlib.contextmanager
    def watching(self, own: Dict[str, Tensor]):
        """Active, on ``own``'s copies (under ``vmap``: the examples' parts, as the module sees them)."""
        self.copies = {id(own[name]): name for name in self.watched}
        with self:
            yield

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):  # a size or a property: not a use
            return out
        bias = (kwargs.get("bias", args[2] if len(args) > 2 else None)
                if func is torch.nn.functional.linear else None)
        for leaf in _pytree.tree_leaves((args, kwargs)):
            name = self.copies.get(id(leaf)) if isinstance(leaf, Tensor) else None
            if name is None:
                continue
            if leaf is bias and out.dim() >= 2:
                self.names.append(name)
                self.outputs.append(out)
                self.versions.append(_version(out))
            else:
                self.other_uses.add(name)
        return out

    def check_versions(self):
        """After the forward: an output changed in place (``y.mul_(s)``, through a view too)
        holds no longer the gradient at ``F.linear``'s output; its bias is left out."""
        for name, out, version in zip(self.names, self.outputs, self.versions):
            if _version(out) != version:
                self.other_uses.add(name)

    def terms(self, outputs: Sequence[Tensor], grads: Sequence[Optional[Tensor]],
              contributions: Dict[str, Tensor]) -> Dict:
        """``{name: (sum_l |t_il| [n, out], number of terms)}`` of the copies used by these
        ``F.linear`` calls only, from ``vmap``'s results of their outputs and the gradients
        there; ``None`` for the other watched copies (so every chunk names the same)."""
        found: Dict[str, Optional[Tuple[Tensor, int]]] = {
            name: None for name in self.watched if name in contributions}
        for name, out, grad in zip(self.names, outputs, grads):
            if name in self.other_uses or name not in contributions:
                continue
            count = out[0].numel() // out.shape[-1]
            magnitudes = (torch.zeros_like(contributions[name]) if grad is None
                          else grad.abs().flatten(1, -2).sum(1))
            if found[name] is not None:
                magnitudes, count = found[name][0] + magnitudes, found[name][1] + count
            found[name] = (magnitudes, count)
        return found


def _version(tensor: Tensor) -> int:
    """The version counter of a tensor under ``vmap`` (its batched tensor's; the wrapper's
    stays 0), which in-place changes to it or to a view of it advance."""
    from torch._C import _functorch

    if _functorch.is_batchedtensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor._version


def _is_example(tensor) -> bool:
    """Whether a tensor under ``vmap`` is an example's part of a batch (``[1, ...]``)."""
    from torch._C import _functorch

    return (isinstance(tensor, Tensor) and _functorch.is_batchedtensor(tensor)
            and tensor.dim() > 0 and tensor.shape[0] == 1)


def _depends_on_copies(tensor) -> bool:
    """Whether a tensor computed under ``vmap`` depends on the parameters' copies."""
    from torch._C import _functorch

    if isinstance(tensor, Tensor) and _functorch.is_batchedtensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return isinstance(tensor, Tensor) and tensor.requires_grad


#: Layers whose output for an example is a function of that example's input alone, with
#: no random numbers and no state (their exact classes: a subclass may override
#: ``forward``): a child of these whose recorded output was changed in place is run
#: again on the example instead of refusing the module.
ROW_WISE = tuple(layer for layer in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding,
                                      nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", None),
                                      nn.Identity) if layer is not None)  # RMSNorm: torch >= 2.4


class _Replay:
    """The recomputation's stand-in for the module's children: their recorded calls.

    Each child's call returns the output it gave in the forward pass (a
    copy of example ``i``'s part) instead of running again: nothing below the
    module is recomputed, random operations inside a child (dropout,
    stochastic depth) give what they gave, and in-place changes to the
    returned value touch a copy. Where an input of the call depends on the
    module's own parameters, the output's dependence on them runs through
    that input only: the input becomes an output of the recomputation (a
    *sink*), with the gradient that flowed into the child through it in the
    backward pass as its cotangent (the child was given a view of it:
    :func:`.capture._child_inputs`). So, with the sinks' cotangents, the
    vector-Jacobian product is the same as running the children.

    Run again instead: a child whose output was not one tensor, or one of
    whose parameter-dependent inputs did not lead with the batch dimension.
    Run again too: a child of :data:`ROW_WISE` whose output was changed in place
    after its call (its recorded value is not what it returned), on the example's
    inputs. Refused (:class:`Refused`): calls in another order than recorded, and
    another child's output changed in place after its call if anything that
    depends on the parameters comes after it.

    ``whole``: the module runs on the whole batch, not under ``vmap`` (:func:`batch_gradients`):
    the same calls are replayed, with the batch's recorded outputs and gradients whole.
    """

    def __init__(self, children: List[ChildCall], examples: int, start: int, stop: int,
                 batched: Collection[int], whole: bool = False):
        self.children, self.examples, self.start, self.stop = children, examples, start, stop
        self.batched = batched  # the calls whose outputs depend on the batch
        self.whole = whole
        self.sinks: List[Tuple[Tensor, Tensor]] = []  # (input in the recomputation, cotangent)
        self.stale = False
        self._next = 0
        self._recorded: Dict[int, Tensor] = {}

    def _leads_with_batch(self, tensor: Optional[Tensor]) -> bool:
        return isinstance(tensor, Tensor) and tensor.dim() > 0 and tensor.shape[0] == self.examples

    def recorded_outputs(self) -> Dict[int, Tensor]:
        """``{call index: output of the examples}`` of the calls whose output leads with
        the batch dimension, for ``vmap``."""
        return {k: c.output[self.start : self.stop] for k, c in enumerate(self.children)
                if k in self.batched and self._leads_with_batch(c.output)}

    @contextlib.contextmanager
    def replacing(self, module: nn.Module, recorded: Dict[int, Tensor]):
        self._recorded, self._next = recorded, 0
        saved = {}
        for child in module.children():
            if "forward" not in child.__dict__:
                saved[child] = child.forward
                child.forward = functools.partial(self._call, child, child.forward)
        try:
            yield
        finally:
            for child in saved:
                del child.forward

    def _call(self, child, forward, *args, **kwargs):
        k, self._next = self._next, self._next + 1
        if k >= len(self.children) or self.children[k].module is not child:
            raise Refused("its children are called in another order than in the forward pass")
        record = self.children[k]
        leaves, _ = _pytree.tree_flatten((args, kwargs))
        # Replayed where the call's inputs are the examples' parts of batch-leading tensors
        # (never for a call on tensors without the batch, such as wpe(arange(T))).
        of_examples = self._leads_with_batch if self.whole else _is_example
        if k not in self._recorded or not any(of_examples(leaf) for leaf in leaves):
            return forward(*args, **kwargs)
        if record.output._version != record.version and type(child) in ROW_WISE:
            # Changed in place after its call (ConvBERT's ``x += bias`` on its pointwise
            # convolution): a row-wise layer's output for the example, computed again.
            return forward(*args, **kwargs)
        sinks = []
        for j, leaf in enumerate(leaves):
            if not _depends_on_copies(leaf):
                continue
            grad = record.grads.get(j)
            if not self._leads_with_batch(grad) or tuple(leaf.shape) != (
                    tuple(grad.shape) if self.whole else (1, *grad.shape[1:])):
                return forward(*args, **kwargs)  # no per-example gradient there: run it
            sinks.append((leaf, grad if self.whole else grad[self.start : self.stop].unsqueeze(1)))
        if sinks and self.stale:
            raise Refused("a child's output that was changed in place is needed")
        self.sinks.extend(sinks)
        if record.output._version != record.version:
            self.stale = True
        return self._recorded[k].clone() if self.whole else self._recorded[k].unsqueeze(0).clone()

    def check(self, outputs_depend: bool):
        """After the recomputation: refuse a stale output followed by parameter-dependent outputs."""
        if self.stale and outputs_depend:
            raise Refused("a child's output that was changed in place is needed")


class Refused(Exception):
    """The recomputation cannot replay the module's children exactly (:func:`.running.compute`
    refuses the module with its message)."""


def math_attention():
    """``scaled_dot_product_attention`` by its math form: the fused kernels' backward
    has no batching rule, and ``vmap`` would loop over the examples one by one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: the math form is what runs on CPU anyway
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)
