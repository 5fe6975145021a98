"""A layer called several times in one forward pass: its calls' contributions summed per example.

ALBERT's encoder calls one ``AlbertLayerGroup`` ``num_hidden_layers`` times,
LayoutLM one position table for the left and the right edge of each box, a
T5-style model its shared embedding in the encoder and in the decoder. Each
call ``c`` of the layer gives example ``i`` a contribution ``x_i^(c)``, and
the example's contribution is their sum,

.. math::

    x_i = \\sum_c x_i^{(c)},

so ``||x_i||^2`` and ``[sum_i x_i, sum_i x_i**2]`` need the sum over calls
*before* squaring: the calls' own results (what each call's rule saves) do not
add up. The hooks record each call with its own input (:mod:`.hooks`) and mark
the calls of one module in one forward pass ``repeated``; here their rules do
not run. Each call's input and output gradient are kept as its backward pass
reaches it (:func:`defers`), and at the end of the backward pass (the layer's
last call reached) each such layer's results are computed (:func:`_save`):
for a chunk of examples at a time (:func:`.cost_model.examples_per_chunk`), each
call's per-example gradients, by the layer's own forward under ``vmap`` with a
copy of each parameter per example (the fallback's way, :mod:`.fallback.replay`)
and one backward pass to the copies at the call's output gradient, summed over
the calls, and reduced at once (:func:`.fallback.reduce.reduce_chunks`).

The choice, among three: (a) this; (b) weights expanded over the batch in the
forward pass itself (autograd sums the calls), which changes the model's
forward pass and costs ``N`` copies of every parameter in every step; (c) the
smallest batch-first block holding every call recomputed per example
(:mod:`.fallback.blocks`), which needs that block found (ALBERT's is the whole
encoder) and runs all of it ``N`` times. Here only the layers that ran more
than once pay, one layer at a time, a chunk of examples at a time; the
memory kept through the backward pass is each call's input and output
gradient (an activation's size each), and no rule per layer class is needed. A Linear's
bias, a sum over positions and calls, gets its structural zeros (an
attention key's bias) set to exact zeros as the native rule does
(:func:`.fallback.reduce.with_structural_zeros`).

Which calls are summed: those of one forward pass of the prepared model
(:func:`.hooks.new_forward`), their rows taken for the examples in order (as
every rule takes them). A layer whose parameters are all tied is not
deferred here: each call is one use of the tie, combined with the others
(:mod:`.tied`, :func:`summed_by_tie`). Refused, left out with a warning naming the
parameter and the reason (never a silently wrong number): a layer holding a
tied parameter beside untied ones (:mod:`.tied`), an embedding applied without the batch
dimension in one of its calls (:mod:`.batchless`), a BatchNorm in training
mode (examples interact), a recurrent layer, an embedding with ``max_norm``
or ``scale_grad_by_freq``, a call with another tensor than its input, calls
of several forward passes (two forward passes, one backward pass of both),
calls whose first dimensions differ, and a layer whose recomputation fails.
"""

from typing import Dict, Iterator, List, Optional, Tuple, Union

from cockpit_gradnoise.extensions import cost_model, facts, subclasses
from cockpit_gradnoise.extensions.fallback import blocks
from cockpit_gradnoise.extensions.fallback.capture import first_tensor
from cockpit_gradnoise.extensions.fallback.padding import padding_kept
from cockpit_gradnoise.extensions.fallback.parameters import direct_parameters, hooks_off, own_parameters
from cockpit_gradnoise.extensions.fallback.reduce import reduce_chunks, with_structural_zeros
from cockpit_gradnoise.extensions.savefields import TIED_ATTR

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class Pending:
    """One layer's calls in this backward pass, kept until its end.

    Attributes:
        module: The layer.
        params: ``{name: parameter}`` as the layer held them at its first call reached.
        calls: ``[(input, output gradient)]``, one per call, as the rules would see them.
        extensions: ``{extension class: extension}`` of the extensions that reached it.
        count: How many calls were summed (once saved; 0 before).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.params = direct_parameters(module)
        self.calls: List[Tuple[Tensor, Tensor]] = []
        self.extensions: dict = {}
        self.seen: set = set()  # id of the hooks' calls kept
        self.forwards: set = set()  # the forward passes they belong to
        self.count = 0


def defers(extension, module: nn.Module, g_out, broadcast: bool) -> bool:
    """Whether ``extension``'s work on this call of ``module`` is left to the end of the
    backward pass (the call is one of several of ``module`` in its forward pass); a call of
    such a layer that cannot be summed refuses its parameters (``False``: the caller goes on
    as before, and its results are not used). ``broadcast``: one of the layer's calls in
    the forward pass was an embedding applied without the batch dimension (:mod:`.uses`)."""
    recorded = facts.recording()
    call = recorded.call
    if call is None or not getattr(call, "repeated", False) or blocks.covers(module) \
            or extension.rule_of(module) is None or summed_by_tie(module, call, broadcast):
        return False
    reason = refusal(module, call, g_out[0], broadcast)
    if reason is not None:
        for param in direct_parameters(module).values():
            recorded.refuse(param, f"its layer ({type(module).__name__}) ran several times in one "
                            f"forward pass, and {reason}")
        return False
    pending = recorded.repeated.get(id(module))
    if pending is None or pending.count:  # (saved: the facts of an earlier pass, backpack() alone)
        if all(earlier.count for earlier in recorded.repeated.values()):  # none queued yet
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: save_all(recorded))
        pending = recorded.repeated[id(module)] = Pending(module)
    if id(call) not in pending.seen:
        pending.seen.add(id(call))
        pending.forwards.add(call.forward)
        # As the rules see them (low-precision inputs widened, .precision), shown by .hooks.
        pending.calls.append((module.__dict__["input0"], g_out[0]))
    pending.extensions[type(extension)] = extension
    recorded.record_owner(module)
    return True


def summed_by_tie(module: nn.Module, call, broadcast: bool) -> bool:
    """Whether the calls of ``module`` are summed per example with the other uses of its tied
    parameters (:mod:`.tied`, each call one use) instead: every trainable parameter it holds
    is tied, each call is recorded with its own input (the package's hooks), and none of its
    calls is an embedding applied without the batch dimension (LED's shared embedding, called
    by its encoder and its decoder and tied to the head)."""
    tied = module.__dict__.get(TIED_ATTR)
    return (tied is not None and call is not None and getattr(call, "repeated", False)
            and not broadcast and all(name in tied for name in direct_parameters(module)))


def refusal(module: nn.Module, call, grad: Tensor, broadcast: bool) -> Optional[str]:
    """Why the calls of ``module`` cannot be summed per example (``None``: they can)."""
    if TIED_ATTR in module.__dict__:
        return ("it holds a tied parameter beside untied ones, or one of its calls was not read "
                "per example (the calls of a layer whose parameters are all tied are summed "
                "with the tie's other uses)")
    if broadcast:
        return "one of its calls is an embedding applied without the batch dimension (or not read per example)"
    if isinstance(module, _BatchNorm) and module.training:
        return "it is a BatchNorm in training mode (its examples interact)"
    if isinstance(module, nn.RNNBase):
        return "calls of a recurrent layer are not summed"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        return "an embedding with max_norm or scale_grad_by_freq is not recomputed per example"
    tensors = [x for x in (*call.inputs, *call.kwargs.values()) if isinstance(x, Tensor)]
    first = call.inputs[0] if call.inputs else None
    if len(tensors) != 1 or first is not tensors[0]:
        return "a call takes another tensor than its input (calls of one input only are summed)"
    if first.dim() == 0 or grad.dim() == 0 or first.shape[0] != grad.shape[0]:
        return "a call's input does not lead with its output's first dimension"
    return None


def save_all(recorded: facts.BackwardFacts) -> None:
    """End of the backward pass: every deferred layer's results saved, or refused."""
    for pending in recorded.repeated.values():
        if not pending.count:
            _save(pending, recorded)


def _save(pending: Pending, recorded: facts.BackwardFacts) -> None:
    module, savefields = pending.module, sorted({e.savefield for e in pending.extensions.values()})
    results = _results(pending, savefields)
    for name, param in pending.params.items():
        for savefield in savefields:
            if hasattr(param, savefield):
                delattr(param, savefield)
        if isinstance(results, str):
            recorded.refuse(param, f"its layer ({type(module).__name__}) ran several times in "
                            f"one forward pass, and {results}")
            continue
        for savefield in savefields:
            setattr(param, savefield, results[savefield][name])
    if not isinstance(results, str):
        last_grad = pending.calls[-1][1]
        for extension in pending.extensions.values():
            recorded.record(extension, module, (last_grad,))
    pending.count, pending.calls = len(pending.calls), []


def _results(pending: Pending, savefields) -> Union[Dict[str, Dict[str, Tensor]], str]:
    """``{savefield: {name: result}}`` of the layer's parameters, or why not (a string)."""
    if len(pending.forwards) > 1:
        return "its calls belong to several forward passes (their rows are other examples)"
    if len({grad.shape[0] for _, grad in pending.calls}) > 1:
        return "its calls' outputs lead with different sizes"
    if any(p.untyped_storage().nbytes() == 0 for p in pending.params.values()):
        return "its parameters were freed before the end of the backward pass (FSDP2)"
    try:
        return reduce_chunks(with_structural_zeros(contributions(pending)), savefields)
    except Exception as error:  # noqa: BLE001 - the layer cannot be recomputed: refused
        return f"it cannot be recomputed per example ({type(error).__name__}: {error})"


def contributions(pending: Pending) -> Iterator[Tuple[Dict[str, Tensor], Dict]]:
    """``({name: x_i}, terms)`` for a chunk of examples at a time, ``x_i`` summed over the
    calls; ``terms``: ``{name: (magnitudes, count)}`` of a Linear's bias, whose
    ``x_i = sum_c sum_t G^(c)_it`` (:func:`.fallback.reduce.with_structural_zeros`)."""
    params, calls = pending.params, pending.calls
    examples = calls[0][1].shape[0]
    numel = sum(p.numel() for p in params.values())
    itemsize = calls[0][1].element_size()
    size = min(examples, cost_model.examples_per_chunk(2 * max(numel, 1), itemsize))
    bias = isinstance(pending.module, nn.Linear) and subclasses.inherits_forward(
        type(pending.module), nn.Linear) and "bias" in params
    for start in range(0, examples, size):
        stop = min(start + size, examples)
        total: Dict[str, Tensor] = {}
        magnitudes, count = None, 0
        for x, grad in calls:
            found = call_contributions(pending.module, params, x[start:stop], grad[start:stop])
            for name, value in found.items():
                total[name] = value if name not in total else total[name].add_(value)
            if bias:
                per_position = grad[start:stop].reshape(stop - start, -1, grad.shape[-1])
                part = per_position.abs().sum(1)
                magnitudes = part if magnitudes is None else magnitudes + part
                count += per_position.shape[1]
        yield total, ({"bias": (magnitudes, count)} if bias else {})


def call_contributions(module: nn.Module, params: Dict[str, Tensor], x: Tensor,
                       grad: Tensor, options: Optional[dict] = None) -> Dict[str, Tensor]:
    """``{name: x_i^(c)}`` of one call of ``module`` for the examples of ``x`` (its input,
    ``[n, ...]``) at output gradient ``grad`` (``[n, ...]``, of its first output tensor):
    ``module``'s forward under ``vmap`` with a copy of each parameter per example, and one
    backward pass to the copies. ``options``: the call's keyword arguments (no tensors)."""
    n = x.shape[0]
    dtype = grad.dtype if grad.is_floating_point() else None
    copies = {name: (p.detach() if dtype is None else p.detach().to(dtype)).expand(n, *p.shape)
              .requires_grad_() for name, p in params.items()}
    names = list(copies)

    def forward(*flat):
        with own_parameters(module, dict(zip(names, flat[:-1]))):
            # The first tensor of a tuple (QuantEmbedding's ``(embedding, scale)``), as the hooks
            # hand over its gradient.
            return first_tensor(module.forward(flat[-1].unsqueeze(0), **(options or {})))

    # In the dtype of the inputs the rules see (.precision), whatever autocast is on now.
    with hooks_off(module), torch.enable_grad(), torch.autocast(x.device.type, enabled=False), \
            padding_kept(module):
        try:
            output = torch.func.vmap(forward)(*copies.values(), x)
        except RuntimeError:  # an operation vmap cannot batch (a boolean mask's assignment)
            return _looped_contributions(forward, copies, x, grad)
    found = torch.autograd.grad(output, list(copies.values()), grad.unsqueeze(1).to(output.dtype),
                                allow_unused=True)
    return {name: torch.zeros_like(copy) if g is None else g
            for (name, copy), g in zip(copies.items(), found)}


def _looped_contributions(forward, copies: Dict[str, Tensor], x: Tensor, grad: Tensor
                          ) -> Dict[str, Tensor]:
    """:func:`call_contributions` with the call run on each example alone, for a forward
    ``vmap`` cannot batch (T5Gemma2's embedding assigns its ``eoi_embedding`` by a boolean
    mask): the same function of each example as under ``vmap`` (``forward`` on
    ``x[i]`` alone), its own copy of each parameter, one backward pass each."""
    found = {name: [] for name in copies}
    for i in range(x.shape[0]):
        own = [copy[i].detach().clone().requires_grad_() for copy in copies.values()]
        output = forward(*own, x[i])
        gradients = torch.autograd.grad(output, own, grad[i].unsqueeze(0).to(output.dtype),
                                        allow_unused=True)
        for (name, mine), gradient in zip(zip(copies, own), gradients):
            found[name].append(torch.zeros_like(mine) if gradient is None else gradient)
    return {name: torch.stack(gradients) for name, gradients in found.items()}
