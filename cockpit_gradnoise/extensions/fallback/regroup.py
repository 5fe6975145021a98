"""Layers on rows that are not examples, found before the first tracked step: their block takes over.

A layer with a rule computes one row per row of its output, and takes its
output's rows for the examples. Many models regroup the batch before a layer:
OPT's decoder layer flattens the tokens (``[N*T, C]``) before ``fc1``, ``fc2``
and ``final_layer_norm``; window attention (Swin, SwinV2, MobileViT, TinyViT)
runs on ``[N*W, tokens, C]`` windows; a mixture-of-experts router on the
flattened tokens; SwinV2's position-bias MLP on a table without the batch. No
shape tells such rows from examples: ``N*W`` equals ``N`` with one window, and
``T`` equals ``N`` where a sequence-first layer's length happens to.

What does tell is the model run on the batch and on the batch one example
larger (its first example repeated, as :mod:`.layout` learns its inputs):
a module's output whose leading size is ``N`` and then ``N + 1`` has one row
per example; any other (``N*T`` then ``(N+1)*T``; a size that stays) does not.
:func:`survey` runs both passes (``torch.no_grad``, every hook off, random
state and buffers restored) before the first recorded forward pass of each
new shape of the inputs (the batch size left out), and for each module with
direct trainable parameters whose rows are not examples (``nn.Embedding``s
without the batch excepted: :mod:`..batchless` gives them exact rows) hooks
the smallest enclosing *batch-first* module, called once, whose output and
one of whose inputs lead with ``N`` and ``N + 1``, as a block
(:mod:`.blocks`): in a tracked backward pass it takes over, runs again on each
example alone, with the same checks (one example alone gives its row of the
batch's output; the contributions add up to the gradient), and gives every
parameter inside it exact rows:

.. math::

    x_i(p) = \\Big(\\frac{\\partial f(a_i; \\theta)}{\\partial p}\\Big)^{\\top} G_i .

A layer with no such module around it (the model's output does not lead with
the batch) is refused by name at each tracked step (:func:`refuse_orphan`),
whatever its leading size: never rows taken for examples by coincidence.

Under dynamic padding every batch has a new length, and the survey (two passes,
one of them with the backward pass of :mod:`.mixing`'s check) would run at every
tracked step. A shape whose inputs have the structure of one surveyed before
(the same tree, ranks, dtypes and batch-led leaves, :func:`_structure`) runs one
pass without gradients instead, and is surveyed only where its
:func:`_signature` differs from every such survey's: for every module, the same calls,
each output and input led by the batch size exactly where it was then, the same
parameters read directly and returned. A leading size is the batch's ``N``
(rows per example), ``N * g`` or ``g`` with ``g`` a function of the other sizes
(flattened tokens, windows, a sequence-first layout, a table): a module with one
row per example at the surveyed shape has ``g = 1`` there, and still leads with
``N`` at the new shape only where ``g = 1`` again, rows per example; a module
that did not lead with ``N`` then (found regrouped, its block hooked) and does
now (``T = N``, the coincidence no shape tells) changes the signature, and the
shape is surveyed. The same calls with the same rows per example are the same
computation on longer or shorter rows: it mixes the examples where the surveyed
one did (:mod:`.mixing`; a model that branches on a length into another
computation with the same calls is not seen). Data-dependent sizes (the tokens
routed to an expert) are not of that form: the survey of the first shape hooks
their block (their size follows neither ``N`` nor ``N + 1``), or the signature
differs (a count equal to ``N`` by chance).
"""

from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions import facts
from cockpit_gradnoise.extensions.fallback import blocks, mixing, window_map
from cockpit_gradnoise.extensions.fallback.capture import ATTRIBUTE, BLOCK_ATTRIBUTE, Fallback, first_tensor
from cockpit_gradnoise.extensions.fallback.layout import Layout, state_kept
from cockpit_gradnoise.extensions.fallback.param_uses import is_metadata, note_parameters
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters, foreign, hooks_off
from cockpit_gradnoise.extensions.savefields import TIED_ATTR

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

#: The attribute (in the model's ``__dict__``) of the input shapes already surveyed.
SURVEYED = "_cgn_regroup_surveyed"
#: The attribute (in the model's ``__dict__``): ``{structure: {signature}}`` of the shapes
#: surveyed in full, by their inputs' structure (:func:`_structure`, :func:`_signature`).
SIGNATURES = "_cgn_regroup_signatures"
#: The attribute (in an embedding's ``__dict__``): whether every survey saw each of its calls
#: return one row per example (:func:`embedding_rows_are_examples`).
EXAMPLE_ROWS = "_cgn_embedding_rows_are_examples"
#: The attribute (in a layer's ``__dict__``) of why its rows are not examples and no block
#: around it can give them: its parameters are refused at each tracked step.
ORPHAN = "_cgn_rows_not_examples"


_LINEAR = torch.nn.functional.linear


def _leading(value) -> Optional[int]:
    return value.shape[0] if isinstance(value, Tensor) and value.dim() > 0 else None


class _Calls(TorchFunctionMode):
    """Each module's calls in one pass: ``(leading size of its first output tensor,
    leading sizes of its tensor inputs)``, and the leading sizes of all its output tensors
    (``outputs``; where ``keep``, the tensors themselves in ``tensors``, each through
    :class:`.mixing.Probe`); the whole shape of an embedding's first output tensor per
    call (``shapes``: :func:`_regrouped`); and ``used``, the
    ``id`` of each tensor an operation of the pass took (a parameter read directly,
    ``self.decoder.weight.t()``)."""

    def __init__(self, model: nn.Module, keep: bool = False):
        super().__init__()
        self.calls: Dict[nn.Module, List[Tuple[Optional[int], Tuple[Optional[int], ...]]]] = {}
        self.outputs: Dict[nn.Module, List[Tuple[Optional[int], ...]]] = {}
        self.tensors: Dict[nn.Module, List[List[Tensor]]] = {}
        self.shapes: Dict[nn.Module, List[Optional[torch.Size]]] = {}
        self.keep, self.probe = keep, mixing.Probe()
        self.used: set = set()
        #: The modules that returned one of their own parameters as it is (GPT-NeoX-Japanese's
        #: attention returns its ``dense_bias`` for its parent to add).
        self.returned: set = set()
        #: ``{id(weight): [leading size of the input of each F.linear call that took it]}``.
        self.linear_rows: Dict[int, List[Optional[int]]] = {}
        self.specs: Dict[nn.Module, str] = {}  # of the last call (.layout.structure)
        #: ``{id(param): calls running of modules that hold it}``: an operation inside a call of
        #: a module holding the parameter is that module's use, not a direct one. A tied weight
        #: (T5's ``shared``, never called) is taken by its called holders (``embed_tokens``,
        #: ``lm_head``), whose rules give its rows; only a use outside them (MobileBERT's head
        #: multiplying by its ``decoder``'s weight) makes it ``used``.
        self.inside: Dict[int, int] = {}
        #: ``{id(param): modules}``: the innermost module running where an operation that
        #: computes with the parameter (not one that reads its shape or dtype) took it outside
        #: its holders' calls (Perceiver's decoder: ``embedding_layer.weight.transpose(0, 1)``).
        self.users: Dict[int, set] = {}
        #: ``{id(param): modules}``: as ``users``, where the operation's result requires grad
        #: (in a pass with gradients): a use that carries the parameter's gradient.
        self.carrying: Dict[int, set] = {}
        #: ``{id(layer): modules}``: the modules that were given the layer as an argument.
        self.passed: Dict[int, set] = {}
        self.running: List[nn.Module] = []
        # (ids listed here, outside the mode: reading a parameter's attributes inside it is an
        # operation that takes the parameter)
        self.holds = {m: [id(p) for p in direct_parameters(m).values()] for m in model.modules()}
        self.handles = [m.register_forward_hook(self._record, with_kwargs=True) for m in model.modules()]
        self.handles += [m.register_forward_pre_hook(self._enter) for m in model.modules()]

    def _enter(self, module, args):
        self.running.append(module)
        for key in self.holds.get(module, ()):
            self.inside[key] = self.inside.get(key, 0) + 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        taken: set = set()
        note_parameters(args, taken)
        if kwargs:
            note_parameters(kwargs, taken)
        outside = [key for key in taken if not self.inside.get(key)]
        self.used.update(outside)
        if outside and self.running and not is_metadata(func):
            for key in outside:
                self.users.setdefault(key, set()).add(self.running[-1])
        if func is _LINEAR:
            weight = args[1] if len(args) > 1 else (kwargs or {}).get("weight")
            if isinstance(weight, nn.Parameter):
                x = args[0] if args else (kwargs or {}).get("input")
                self.linear_rows.setdefault(id(weight), []).append(_leading(x))
        result = func(*args, **(kwargs or {}))
        if outside and self.running and isinstance(result, Tensor) and result.requires_grad:
            for key in outside:
                self.carrying.setdefault(key, set()).add(self.running[-1])
        return result

    def _record(self, module, args, kwargs, output):
        if self.running and self.running[-1] is module:
            self.running.pop()
        for key in self.holds.get(module, ()):
            if self.inside.get(key):
                self.inside[key] -= 1
        leaves, spec = _pytree.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, nn.Module):
                self.passed.setdefault(id(leaf), set()).add(module)
        inputs = tuple(_leading(leaf) for leaf in leaves)
        first = first_tensor(output)
        self.calls.setdefault(module, []).append((_leading(first), inputs))
        if isinstance(module, nn.Embedding):
            self.shapes.setdefault(module, []).append(None if first is None else first.shape)
        own = {id(p) for p in module.parameters(recurse=False)}
        if own and any(id(leaf) in own for leaf in _pytree.tree_leaves(output)):
            self.returned.add(module)
        self.specs[module] = spec  # (its text when used: a repr per call is slow)
        if self.keep:
            output = self.probe.through(output)
        tensors = [leaf for leaf in _pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
        self.outputs.setdefault(module, []).append(tuple(_leading(t) for t in tensors))
        if self.keep:
            self.tensors.setdefault(module, []).append(tensors)
            return output
        return None

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _run(model: nn.Module, args: tuple, kwargs: dict, grad: bool = False) -> Optional[_Calls]:
    """The calls of one no-grad pass of ``model`` without hooks (with its own, where it needs
    them); ``None`` where it fails (a model that takes one batch size only). ``grad``: with
    gradients, its modules' outputs kept, its BatchNorm layers in evaluation mode (the
    check of :mod:`.mixing`)."""
    devices = sorted({leaf.device.index or 0 for leaf in _pytree.tree_leaves((args, kwargs))
                      if isinstance(leaf, Tensor) and leaf.device.type == "cuda"})
    for keep in (None, foreign):
        try:
            with hooks_off(model, keep=keep), state_kept(model, devices), \
                    torch.set_grad_enabled(grad), mixing.BatchNormEval(model if grad else nn.Module()):
                calls = _Calls(model, keep=grad)
                try:
                    with calls:
                        getattr(model, "_orig_mod", model)(*args, **kwargs)
                finally:
                    calls.remove()
            return calls
        except Exception:  # noqa: BLE001,S112 - tried again with the model's own hooks
            continue
    return None


def rows_are_examples(real: Optional[int], larger: Optional[int], examples: int) -> bool:
    """Whether an output led by ``real`` rows in the batch and ``larger`` in the batch one
    example larger has one row per example."""
    return real == examples and larger == examples + 1


def _batch_first(real, larger, examples: int) -> bool:
    """Whether a module was called once in each pass, its output and one input per example,
    and each other input per example too or without the batch (its size unchanged): an
    input of rows that are not examples (DBRX's experts take the routing of the tokens,
    ``[N*T, k]``) cannot be cut to one example."""
    if len(real) != 1 or len(larger) != 1:
        return False
    (out, ins), (out_larger, ins_larger) = real[0], larger[0]
    pairs = list(zip(ins, ins_larger))
    return rows_are_examples(out, out_larger, examples) and len(ins) == len(ins_larger) \
        and any(rows_are_examples(a, b, examples) for a, b in pairs) \
        and all(a == b or rows_are_examples(a, b, examples) for a, b in pairs)


def _regrouped(module: nn.Module, real: _Calls, larger: _Calls, examples: int) -> bool:
    """Whether ``module``'s calls ran on rows that are not examples (an embedding without
    the batch excepted); a call count that changes with the batch counts as such.

    An embedding is without the batch where its output's whole shape stays in the pass one
    example larger (``wpe(torch.arange(T))``: :mod:`..batchless` gives it exact rows); one
    whose leading size stays but another grows takes indices of the batch laid out otherwise
    (XLNet's ``word_embedding`` on ``input_ids.transpose(0, 1)``, ``[T, N]``): its rows are
    not examples, and its block computes it."""
    calls, calls_larger = real.calls.get(module, []), larger.calls.get(module, [])
    if len(calls) != len(calls_larger):
        return True
    for k, ((out, _), (out_larger, _)) in enumerate(zip(calls, calls_larger)):
        if out is None or rows_are_examples(out, out_larger, examples):
            continue
        if isinstance(module, nn.Embedding) and real.shapes[module][k] == larger.shapes[module][k]:
            continue  # without the batch: .batchless's
        return True
    return False


def _key(args: tuple, kwargs: dict, examples: int, training: bool) -> tuple:
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    shapes = tuple(tuple(leaf.shape[1:]) if _leading(leaf) == examples else tuple(leaf.shape)
                   for leaf in leaves if isinstance(leaf, Tensor))
    return str(spec), shapes, training


def _new_shape(model: nn.Module, args: tuple, kwargs: dict, examples: int) -> bool:
    """Whether the shape of the inputs is new (recorded now), or was seen with one example
    only, all there was for :mod:`.mixing` to check."""
    surveyed = model.__dict__.setdefault(SURVEYED, set())
    checked = model.__dict__.setdefault(mixing.CHECKED, set())
    key = _key(args, kwargs, examples, model.training)
    if key in surveyed and (examples < 2 or key in checked):
        return False
    surveyed.add(key)
    if examples > 1:
        checked.add(key)
    return True


def survey(model: nn.Module, args: tuple, kwargs: dict, examples: Optional[int]) -> None:
    """Before a recorded forward pass of ``model``: for a new shape of its inputs, find the
    layers on rows that are not examples and hook their blocks (module docstring)."""
    if not examples:
        return
    if not _new_shape(model, args, kwargs, examples):
        return
    if any(c.__name__ == "DTensor" for p in model.parameters() for c in type(p).__mro__):
        return  # sharded parameters (FSDP2, tensor parallel): no pass outside the wrapper's own
    signatures = model.__dict__.setdefault(SIGNATURES, {})
    structure = _structure(args, kwargs, examples, model.training)
    if examples > 1 and structure in signatures:  # a new length of a known structure
        cheap = _run(model, args, kwargs)
        if cheap is not None and _signature(model, cheap, examples) in signatures[structure]:
            return  # the same calls with the same rows per example as a surveyed shape (docstring)
    real = _run(model, args, kwargs, grad=True)
    if real is None:  # a pass with gradients fails where one without would not: no .mixing check
        real = _run(model, args, kwargs)
    larger = _run(model, *_pytree.tree_map(
        lambda v: torch.cat([v, v[:1]]) if _leading(v) == examples else v, (args, kwargs)))
    if real is None or larger is None:
        return  # the model's other checks (.layout, the rules' leading sizes) stand
    _hook_blocks(model, real, larger, examples)
    _block_mixed(model, real, larger, examples)
    if examples > 1:
        signatures.setdefault(structure, set()).add(_signature(model, real, examples))


def _structure(args: tuple, kwargs: dict, examples: int, training: bool) -> tuple:
    """The inputs' structure, their sizes left out: the tree, and each tensor's rank, dtype
    and whether it leads with the batch."""
    leaves, spec = _pytree.tree_flatten((args, kwargs))
    return str(spec), training, tuple((leaf.dim(), leaf.dtype, _leading(leaf) == examples)
                                      for leaf in leaves if isinstance(leaf, Tensor))


def _signature(model: nn.Module, calls: _Calls, examples: int) -> tuple:
    """What a pass's survey depends on, its sizes left out: each module's calls, whether
    each output and input of each led with the batch size, the parameters read directly,
    the modules that returned one of theirs, and whether each ``F.linear`` call's input led
    with the batch size, by weight."""
    def rows(size: Optional[int]) -> Optional[bool]:
        return None if size is None else size == examples

    return (
        tuple(tuple((rows(out), tuple(map(rows, ins))) for out, ins in calls.calls.get(m, ()))
              for m in model.modules()),
        tuple(tuple(tuple(map(rows, outs)) for outs in calls.outputs.get(m, ())) for m in model.modules()),
        frozenset(calls.used), frozenset(id(m) for m in calls.returned),
        frozenset((key, tuple(map(rows, sizes))) for key, sizes in calls.linear_rows.items()))


def _hook_blocks(model: nn.Module, real: _Calls, larger: _Calls, examples: int) -> None:
    """Hook the block around each layer whose parameters need one (:func:`_needs_block`),
    and note which embeddings return one row per example."""
    parents = {child: module for module in model.modules() for child in module.children()}
    holders: Dict[int, List[nn.Module]] = {}  # the survey's holds, by parameter
    for module, keys in real.holds.items():
        for key in keys:
            holders.setdefault(key, []).append(module)
    for module in model.modules():  # (every module: .running's expanded parameters read it too)
        _note_embedding_rows(module, real.calls.get(module, []), larger.calls.get(module, []), examples)
        params = direct_parameters(module)
        if not params or module.__dict__.get(ORPHAN) is not None:
            continue
        why = _needs_block(module, params, parents, real, larger, examples)
        if why is None:
            continue
        block = _block_around(module, parents, real, larger, examples)
        # A tied parameter's block holds every layer that holds it where one does (XLNet's
        # word embedding and its head): a use outside the block would reach its gradient
        # otherwise than through the block's output, and leave it out (.blocks.reached_otherwise).
        tied = [holder for param in params.values() for holder in holders[id(param)]]
        receivers = _receivers(module, params, real) if why == "passed" else []
        tied += receivers + (_ancestor_users(module, params, parents, real) if why == "around" else [])
        around = block
        while around is not None and not _holds(around, tied):
            around = _block_around(around, parents, real, larger, examples)
        block = around or block
        if why == "functional":
            if block is not None:  # (else the fallback computes it, as where its rows are examples)
                _hook_functional(module, parents[module], block, real, larger, examples)
        elif block is not None or why not in ("returned", "passed", "around"):  # else its refusal names it
            _hook(module, block, real, larger, examples)
            for receiver in receivers:  # (its own fallback would refuse the layer it was given)
                _hook(receiver, block, real, larger, examples)
    _hook_one_window(model, parents, real, larger, examples)


def _block_mixed(model: nn.Module, real: _Calls, larger: _Calls, examples: int) -> None:
    """Each layer whose rows :mod:`.mixing`'s check found mixed a member of the smallest
    batch-first module around it (the model excepted) whose own rows the check found not mixed
    (timm's csatv2: its ``SpatialTransformerBlock`` around ``norm1``, ``pos_embed`` and ``qkv``):
    run again on each example alone, with the checks of every block (:mod:`.blocks`); left out
    by name where there is none (:func:`.mixing.leave_out`)."""
    parents = {child: module for module in model.modules() for child in module.children()}
    root = getattr(model, "_orig_mod", model)
    around = [m for m in model.modules() if m is not model and m is not root and not direct_parameters(m)
              and _batch_first(real.calls.get(m, []), larger.calls.get(m, []), examples)
              and any(p.requires_grad for p in m.parameters())]
    found, seen = mixing.check(model, real, larger, examples, around)
    for module in found:
        if not direct_parameters(module) and BLOCK_ATTRIBUTE not in module.__dict__:
            continue  # (a module around layers: theirs are found too)
        block = None if BLOCK_ATTRIBUTE in module.__dict__ else _block_around(module, parents, real, larger, examples)
        while block is not None and block in found:
            block = _block_around(block, parents, real, larger, examples)
        if block is None or block is model or block is root or block not in seen:
            mixing.leave_out(module)
        else:
            _hook(module, block, real, larger, examples)


def _block_around(module: nn.Module, parents: dict, real: _Calls, larger: _Calls,
                  examples: int) -> Optional[nn.Module]:
    """The smallest module around ``module`` (not itself) that is batch-first (:func:`_batch_first`)."""
    block = parents.get(module)
    while block is not None and not _batch_first(
            real.calls.get(block, []), larger.calls.get(block, []), examples):
        block = parents.get(block)
    return block


def _holds(block: nn.Module, modules: List[nn.Module]) -> bool:
    """Whether every module of ``modules`` is ``block`` or inside it."""
    inside = {id(sub) for sub in block.modules()}
    return all(id(module) in inside for module in modules)


def _needs_block(module: nn.Module, params: dict, parents: dict, real: _Calls, larger: _Calls,
                 examples: int) -> Optional[str]:
    """Why ``module``'s parameters need a block around it, or ``None``: its calls ran on rows
    that are not examples (``"regrouped"``); it was not called and its parent's own forward
    pass used its parameters (``"used"``); it returned a parameter as it is for its parent
    to use (``"returned"``)."""
    calls = real.calls.get(module, [])
    if calls and _regrouped(module, real, larger, examples):
        return "regrouped"
    if calls and module in real.returned and module in larger.returned:
        return "returned"
    if not calls and _linear_on_rows(module, parents, real, larger, examples):
        return "functional"
    if calls and _receivers(module, params, real) and _receivers(module, params, larger):
        return "passed"
    if calls and _ancestor_users(module, params, parents, real):
        return "around"
    return "used" if not calls and _used_by_parent(module, params, parents, real) else None


def _ancestor_users(module: nn.Module, params: dict, parents: dict, calls: _Calls) -> List[nn.Module]:
    """The modules around the called layer ``module``, not tied, whose own forward took one of
    its parameters outside its calls in an operation that carries its gradient (ProphetNet's
    decoder looks its positions up again through ``position_embeddings._forward``): a use no
    rule sees. The smallest batch-first module around the layer and them is run again on each
    example alone (:func:`_hook_blocks`); a tied parameter's direct uses are :mod:`..tied`'s."""
    if TIED_ATTR in module.__dict__:
        return []
    ancestors, parent = [], parents.get(module)
    while parent is not None:
        ancestors.append(parent)
        parent = parents.get(parent)
    return [m for m in ancestors if any(m in calls.carrying.get(id(p), ()) for p in params.values())]


def _receivers(module: nn.Module, params: dict, calls: _Calls) -> List[nn.Module]:
    """The modules that were given the layer ``module`` as an argument and whose own forward
    computed with one of its parameters (Perceiver's ``PerceiverEmbeddingDecoder``, given the
    input embedding: ``hidden @ embedding_layer.weight.T``): a use of the parameter that no
    rule sees, beside its layer's own calls. The smallest batch-first module around both is
    run again on each example alone (:func:`_hook_blocks`)."""
    given = calls.passed.get(id(module), set())
    return [user for user in given if any(user in calls.users.get(id(p), ()) for p in params.values())]


def _linear_on_rows(module: nn.Module, parents: dict, real: _Calls, larger: _Calls, examples: int) -> bool:
    """Whether ``module``, a plain ``nn.Linear`` never called, had its weight passed to ``F.linear``
    by its parent, which has the fallback, on rows that are not examples (torchvision's
    ``ShiftedWindowAttention``: ``F.linear(x, self.qkv.weight, ...)`` on ``[N*W, t, C]`` windows; timm's
    SwinV2 ``WindowAttention`` on its ``qkv``), the same number of calls in both passes. Where the rows
    are examples, the fallback computes it, as before."""
    if window_map.kind(module) != window_map.LINEAR \
            or not isinstance(getattr(parents.get(module), ATTRIBUTE, None), Fallback):
        return False
    rows, rows_larger = real.linear_rows.get(id(module.weight), []), larger.linear_rows.get(id(module.weight), [])
    return bool(rows) and len(rows) == len(rows_larger) \
        and not all(rows_are_examples(a, b, examples) for a, b in zip(rows, rows_larger))


def _note_embedding_rows(module: nn.Embedding, real, larger, examples: int) -> None:
    """Keep whether each call of ``module`` returned one row per example in this survey, and
    in every earlier one (once not, never: a shape surveyed before is not surveyed again)."""
    if not real:
        return
    rows = len(real) == len(larger) and all(
        rows_are_examples(out, out_larger, examples) for (out, _), (out_larger, _) in zip(real, larger))
    module.__dict__[EXAMPLE_ROWS] = module.__dict__.get(EXAMPLE_ROWS, True) and rows


def embedding_rows_are_examples(module: nn.Module) -> bool:
    """Whether the surveys saw every call of the embedding ``module`` return one row per
    example: an output led by ``N`` rows for a batch of ``N`` and ``N + 1`` for one more.
    Its index is then read per example where it is not a model input: MarkupLM's XPath
    indices and RoCBERT's shape and pronunciation indices, built by the forward from the
    input's shape (``torch.full((N, T, depth), pad)``), whose outputs are concatenated
    with the batch's (no shape tells their ``N`` from a ``T`` equal to it; the larger
    batch does)."""
    return bool(module.__dict__.get(EXAMPLE_ROWS, False))


def rows_were_examples(module: nn.Module) -> bool:
    """Whether the surveys saw every call of ``module`` return one row per example (as
    :func:`embedding_rows_are_examples`, for any module)."""
    return bool(module.__dict__.get(EXAMPLE_ROWS, False))


def _hook(module: nn.Module, block: Optional[nn.Module], real: _Calls, larger: _Calls, examples: int):
    """``module`` a member of ``block``'s :class:`.blocks.Block`, or an orphan (no block)."""
    calls, calls_larger = real.calls.get(module, []), larger.calls.get(module, [])
    if block is None:
        rows = (f"runs on rows that are not examples (its output leads with {calls[0][0]} "
                f"for a batch of {examples}, with {calls_larger[0][0] if calls_larger else None}"
                " for one more)") if calls else "is used directly by its parent's forward pass"
        module.__dict__[ORPHAN] = (
            f"its layer ({type(module).__name__}) {rows} and no module around it, called "
            "once, takes and returns the batch first to be run again on each example alone")
        return
    state = blocks.hook_block(block)
    if module not in state.members:
        state.members.append(module)
    # Its outputs with rows per example (those whose gradients it follows besides the first).
    outs, outs_larger = real.outputs.get(block, []), larger.outputs.get(block, [])
    if len(outs) == len(outs_larger) == 1 and len(outs[0]) == len(outs_larger[0]):
        state.example_outputs = frozenset(t for t, (a, b) in enumerate(zip(outs[0], outs_larger[0]))
                                          if rows_are_examples(a, b, examples))
    # Which inputs are per example, as .layout.learn would (the model's own block
    # records its call after the model's hook that learns: it would never learn).
    (_, ins), (_, ins_larger) = real.calls[block][0], larger.calls[block][0]
    state.layouts.setdefault(str(real.specs[block]), Layout(frozenset(
        k for k, (a, b) in enumerate(zip(ins, ins_larger)) if a is not None and a != b)))


def _hook_functional(module: nn.Module, parent: nn.Module, block: nn.Module, real: _Calls, larger: _Calls,
                     examples: int) -> None:
    """``module`` (:func:`_linear_on_rows`) a member of ``block``'s :class:`.blocks.Block` whose call is
    its parent's ``F.linear`` (:data:`.window_map.FUNCTIONAL`), and its parent, which uses it, a member
    too (its own parameters, its tables: the block itself in torchvision's Swin)."""
    module.__dict__[window_map.FUNCTIONAL] = True
    _hook(module, block, real, larger, examples)
    members = blocks.hook_block(block).members
    if all(parent is not member for member in members):
        members.append(parent)


def _hook_one_window(model: nn.Module, parents: dict, real: _Calls, larger: _Calls, examples: int) -> None:
    """A module of a class that passed a layer's weight to ``F.linear`` on windows elsewhere in the
    model (:func:`_hook_functional`), where its own ``F.linear`` rows are examples (a stage with one
    window per example: torchvision's Swin's last; timm's SwinV2's, whose ``proj`` is called on
    those rows): its own block too, its layers members as there, where it is batch-first and every
    layer with parameters inside it is then a member (a plain ``nn.Linear`` called once on its rows
    is one: the windows' way at one window per example); otherwise the fallback computes it, as
    before."""
    classes = {type(parents[m]) for m in model.modules() if m.__dict__.get(window_map.FUNCTIONAL) and m in parents}
    for module in model.modules():
        if type(module) not in classes or not isinstance(getattr(module, ATTRIBUTE, None), Fallback) \
                or not _batch_first(real.calls.get(module, []), larger.calls.get(module, []), examples):
            continue
        layers = [child for child in module.children() if window_map.kind(child) == window_map.LINEAR
                  and not real.calls.get(child) and real.linear_rows.get(id(child.weight))
                  and len(real.linear_rows[id(child.weight)]) == len(larger.linear_rows.get(id(child.weight), []))]
        block = module.__dict__.get(BLOCK_ATTRIBUTE)
        members = block.members if block is not None else []
        inside = [sub for sub in module.modules() if sub is not module and direct_parameters(sub)]
        called = [sub for sub in inside if window_map.kind(sub) == window_map.LINEAR
                  and _batch_first(real.calls.get(sub, []), larger.calls.get(sub, []), examples)]
        if layers and all(any(sub is m for m in layers + members + called) for sub in inside):
            for layer in layers:
                _hook_functional(layer, module, module, real, larger, examples)
            for layer in called:
                _hook(layer, module, real, larger, examples)


def _used_by_parent(module: nn.Module, params: dict, parents: dict, calls: _Calls) -> bool:
    """Whether ``module`` was not called but an operation took its parameters directly, in a
    pass where its parent was called without the fallback (which would compute them):
    MobileBERT's head multiplies by its ``decoder``'s weight, tied to the word embeddings,
    without calling the ``decoder``."""
    parent = parents.get(module)
    return parent is not None and parent in calls.calls \
        and not isinstance(getattr(parent, ATTRIBUTE, None), Fallback) \
        and any(id(p) in calls.used for p in params.values())


def refuse_orphan(module: nn.Module) -> bool:
    """Whether ``module`` is a layer on rows that are not examples with no block around it:
    then its parameters are refused in this backward pass (left out, warning), and no rule
    runs on it."""
    reason = module.__dict__.get(ORPHAN)
    if reason is None:
        return False
    recorded = facts.recording()
    for param in direct_parameters(module).values():
        recorded.refuse(param, reason)
    return True
