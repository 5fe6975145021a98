"""Tied parameters: one tensor used by several layers, its results summed over the uses.

A parameter used by layers ``u = 1..U`` (nanoGPT's and GPT-2's output layer
sharing the token embedding; T5's encoder embedding, decoder embedding and
head) has per-example contributions ``x_i = sum_u x_i^(u)``. BackPACK runs each
layer's module extension in turn and each one *overwrites* the parameter's
savefield (``ModuleExtension.__save_value_on_parameter`` is a ``setattr``), so
left alone only the use reached last survives. :func:`combine` runs after each
use and turns the savefield into the result of every use seen so far in this
backward pass:

- ``sum_i x_i`` and the gradient: sums of the uses' own results;
- ``sum_i x_i**2`` per element: ``sum_u S^(u) + 2 sum_{u<v} sum_i x_i^(u) * x_i^(v)``;
- ``||x_i||^2``: ``sum_u ||x_i^(u)||^2 + 2 sum_{u<v} <x_i^(u), x_i^(v)>``.

The cross terms need the uses' per-example contributions together. Where one
use is an ``nn.Embedding`` its ``x_i^(u)`` is nonzero only on the rows of the
tokens example ``i`` uses, ``x_i^(u)[v] = sum_{t: idx_it = v} e_it`` (``e`` the
embedding's output gradient), so the other use is needed only on those rows
(:meth:`_Use.rows_at`): for a Linear head with inputs ``h`` and output
gradients ``G``, ``x_i^(w)[idx_it] = sum_s G[i, s, idx_it] h_is``, ``T x S``
numbers per example instead of the ``V x d`` of a dense per-example gradient
of the vocabulary-sized matrix. Then ``<x_i^(u), x_i^(w)> = sum_t <e_it,
x_i^(w)[idx_it]>`` and the elementwise cross term lands on those rows only
(:func:`rows_cross_terms`). Two Linear uses (no embedding) form their
per-example contributions in chunks of examples of at most
:data:`.cost_model.CHUNK_BYTES` each (:func:`dense_cross_terms`).

Which parameters are tied is known before any backward pass:
:func:`~cockpit_gradnoise.extensions.uses.install` (run by ``prepare_model``)
finds them in ``model.named_parameters(remove_duplicate=False)`` and marks
each layer that holds one (:data:`.savefields.TIED_ATTR`).

Each *call* of such a layer is a use (under the package's hooks, which keep every
call's input): LED's shared embedding, called twice by its encoder (its tokens and
its padding) and once by its decoder, and tied to the head, has four uses, their
cross terms as above. A use by a layer of another class than ``Linear`` and
``Embedding`` (Zamba's RMSNorm weights shared by the two calls of its shared
transformer block, I-BERT's ``QuantEmbedding`` tied to its head, a LayerNorm's
weight tied to a Linear's bias) is recomputed per example (:class:`RecomputedUse`):
the layer's forward under ``vmap`` with a copy of the parameter per example, the
cross terms from dense per-example contributions in chunks. Refused with a warning
naming the parameter: a use by a layer called with more than one tensor (its
recomputation would need the others per example), a layer that got no result of its
own, and a layer applied twice under BackPACK's own hooks (which keep its last
input only).
"""

from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions import cost_model, scaled_embedding, subclasses
from cockpit_gradnoise.extensions.fallback.parameters import delegated_parameters
from cockpit_gradnoise.extensions.savefields import (
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
    TIED_ATTR,
)

import torch
from backpack.context import CTX
from torch import Tensor, nn

#: The savefields :func:`combine` sums over uses.
COMBINED_SAVEFIELDS = (SUMS_SAVEFIELD, BATCH_L2_SAVEFIELD, LOCAL_GRADIENT_SAVEFIELD)


class _Use:
    """One layer's use of a tied ``[V, d]`` weight in this backward pass."""

    def rows_at(self, idx: Tensor) -> Tensor:
        """``x_i[idx[i, p]]`` for every example ``i`` and position ``p``: ``[N, P, d]``."""
        raise NotImplementedError

    def formed(self, start: int, stop: int) -> Tensor:
        """``x_i`` of examples ``start..stop-1``, ``[n, V, d]``."""
        raise NotImplementedError


class EmbeddingUse(_Use):
    """``x_i[v] = sum_{p: idx_ip = v} e_ip``; positions at ``padding_idx`` contribute nothing."""

    def __init__(self, module: nn.Embedding, inputs: Tensor, grad_output: Tensor):
        n = grad_output.shape[0]
        self.idx = inputs.reshape(n, -1)
        self.grad = grad_output.reshape(n, self.idx.shape[1], -1)
        self.rows = module.num_embeddings
        if module.padding_idx is not None:  # (where, not a product: a NaN there reaches nothing)
            padding = module.padding_idx % module.num_embeddings
            self.grad = torch.where((self.idx != padding).unsqueeze(-1), self.grad, 0)

    def rows_at(self, idx):
        same = (self.idx.unsqueeze(2) == idx.unsqueeze(1)).to(self.grad.dtype)  # [N, P1, P]
        return torch.bmm(same.transpose(1, 2), self.grad)

    def formed(self, start, stop):
        n, width = stop - start, self.grad.shape[2]
        offsets = torch.arange(n, device=self.idx.device).unsqueeze(1) * self.rows
        flat = self.grad.new_zeros(n * self.rows, width)
        flat.index_add_(0, (self.idx[start:stop] + offsets).flatten(),
                        self.grad[start:stop].reshape(-1, width))
        return flat.reshape(n, self.rows, width)


class LinearUse(_Use):
    """``x_i = sum_s G_is h_is^T`` of a Linear's weight (``[out, in]``)."""

    def __init__(self, module: nn.Linear, inputs: Tensor, grad_output: Tensor):
        n = grad_output.shape[0]
        self.inputs = inputs.reshape(n, -1, inputs.shape[-1])
        self.grad = grad_output.reshape(n, -1, grad_output.shape[-1])

    def rows_at(self, idx):
        positions = self.grad.shape[1]
        chosen = self.grad.gather(2, idx.unsqueeze(1).expand(-1, positions, -1))  # [N, S, P]
        return torch.bmm(chosen.transpose(1, 2), self.inputs)

    def formed(self, start, stop):
        return torch.bmm(self.grad[start:stop].transpose(1, 2), self.inputs[start:stop])


class RecomputedUse(_Use):
    """``x_i`` of any layer's use of the parameter: the layer's forward under ``vmap`` with a
    copy of the parameter per example, and one backward pass to the copies at the call's
    output gradient (:func:`.repeated.call_contributions`, the fallback's way). A tied RMSNorm
    weight (Zamba's shared transformer), a ``QuantEmbedding`` (I-BERT's word embedding, tied to
    its head): ``x_i = (d f(a_i; theta) / d theta)^T G_i`` of that call."""

    def __init__(self, module: nn.Module, attribute: str, inputs: Tensor, options: dict,
                 grad_output: Tensor):
        self.module, self.attribute, self.inputs, self.options = module, attribute, inputs, options
        self.grad = grad_output

    def formed(self, start, stop):
        from cockpit_gradnoise.extensions.repeated import call_contributions  # (it imports the fallback)

        params = {self.attribute: getattr(self.module, self.attribute)}
        return call_contributions(self.module, params, self.inputs[start:stop],
                                  self.grad[start:stop], self.options)[self.attribute]


def recomputed_use(module: nn.Module, attribute: str, call, grad_output: Tensor
                   ) -> Optional[RecomputedUse]:
    """The :class:`RecomputedUse` of a call (:class:`.hooks.Call`) of ``module`` with one
    positional argument, a tensor leading with its output's batch dimension, and plain keyword
    arguments only (passed again as they are); ``None`` for any other call."""
    if call is None or len(call.inputs) != 1 or not isinstance(call.inputs[0], Tensor):
        return None
    x = call.inputs[0]
    if not all(_plain(v) for v in call.kwargs.values()) or x.dim() == 0 or grad_output.dim() == 0 \
            or x.shape[0] != grad_output.shape[0]:
        return None
    return RecomputedUse(module, attribute, x, dict(call.kwargs), grad_output)


def _plain(value) -> bool:
    """Whether a call's argument is a plain Python value the recomputation can pass as it is."""
    return value is None or isinstance(value, (bool, int, float, str))


def use_of(module: nn.Module, attribute: str, inputs: Tensor, grad_output: Tensor,
           call=None) -> Optional[_Use]:
    """The :class:`_Use` of ``module``'s ``attribute`` (its layer's input and output
    gradient): for the weight of a layer that computes a Linear's or an Embedding's function
    (a subclass that overrides ``forward`` does not, but for a scaled embedding, whose use is
    read at its lookup: :mod:`.scaled_embedding`), read from them; for any other, recomputed
    per example from ``call`` (:func:`recomputed_use`; ``None`` where it cannot be)."""
    if attribute == "weight" and isinstance(module, nn.Embedding):
        lookup = scaled_embedding.lookup_gradient(module, grad_output)
        if lookup is not None:
            return EmbeddingUse(module, inputs, lookup)
    if attribute == "weight" and isinstance(module, nn.Linear) and subclasses.inherits_forward(
            type(module), nn.Linear):
        return LinearUse(module, inputs, grad_output)
    return recomputed_use(module, attribute, call, grad_output)


def rows_cross_terms(embedding: EmbeddingUse, other: _Use, rows: int) -> Tuple[Tensor, Tensor]:
    """``(<x_i^(e), x_i^(o)> [N], sum_i x_i^(e) * x_i^(o) [V, d])`` on the embedding's rows.

    ``<x_i^(e), x_i^(o)> = sum_p <e_ip, x_i^(o)[idx_ip]>``; the elementwise
    product is ``sum_p e_ip * x_i^(o)[idx_ip]`` added into row ``idx_ip``.
    """
    products = embedding.grad * other.rows_at(embedding.idx)  # [N, P, d]
    width = products.shape[2]
    elementwise = products.new_zeros(rows, width)
    elementwise.index_add_(0, embedding.idx.flatten(), products.reshape(-1, width))
    return products.sum((1, 2)), elementwise


def dense_cross_terms(first: _Use, second: _Use, examples: int, shape) -> Tuple[Tensor, Tensor]:
    """The same two cross terms from per-example contributions formed in chunks.

    Memory: two ``[n, *shape]`` tensors at a time, ``n`` examples of at most
    :data:`.cost_model.CHUNK_BYTES` each (one example at least).
    """
    numel = torch.Size(shape).numel()
    size = cost_model.examples_per_chunk(2 * numel, first.grad.element_size())
    norms, elementwise = [], None
    for start in range(0, examples, size):
        stop = min(start + size, examples)
        product = first.formed(start, stop).mul_(second.formed(start, stop))
        norms.append(product.flatten(1).sum(1))
        part = product.sum(0)
        elementwise = part if elementwise is None else elementwise.add_(part)
    return torch.cat(norms), elementwise


def cross_terms(new: _Use, old: _Use, examples: int, shape) -> Tuple[Tensor, Tensor]:
    """``(<x_i^(new), x_i^(old)>, sum_i x_i^(new) * x_i^(old))`` by the cheapest form."""
    recomputed = isinstance(new, RecomputedUse) or isinstance(old, RecomputedUse)
    if isinstance(new, EmbeddingUse) and not recomputed:
        return rows_cross_terms(new, old, shape[0])
    if isinstance(old, EmbeddingUse) and not recomputed:
        return rows_cross_terms(old, new, shape[0])
    return dense_cross_terms(new, old, examples, shape)


class TiedGroup:
    """A parameter held by several layers, and what this backward pass has seen of it.

    Attributes:
        names: Every name of the parameter in the model (the first is the
            one ``named_parameters()`` gives).
        layers: How many layers hold it.
    """

    def __init__(self, names: Tuple[str, ...], layers: int):
        self.names, self.layers = names, layers
        self.new_pass()

    def new_pass(self):
        """Forget the uses seen: a new forward or backward pass begins."""
        self.uses: Dict[nn.Module, Optional[_Use]] = {}
        self.done: Dict[str, List[nn.Module]] = {}  # savefield -> layers combined, in order
        self.cross: Dict[Tuple[int, int], Tuple[Tensor, Tensor]] = {}
        self.refusal: Optional[str] = None
        self.param: Optional[Tensor] = None  # what the first use of the pass held
        self.forwards: set = set()  # the forward passes (.hooks) of the calls combined

    # Per-pass tensors and layers never travel with a copy or a pickle of the model.
    def __getstate__(self):
        return {"names": self.names, "layers": self.layers}

    def __setstate__(self, state):
        self.__init__(state["names"], state["layers"])

    def combined(self, savefield: str, module: nn.Module, attribute: str, inputs: Tensor,
                 grad_output: Tensor, own: Optional[Tensor], before: Optional[Tensor],
                 call=None) -> Optional[Tensor]:
        """The savefield's value over every use so far, ``own`` being this use's; ``None``: refused.

        Args:
            savefield: The extension's savefield.
            module: The layer of this use.
            attribute: The parameter's name in it.
            inputs: Its input in the forward pass.
            grad_output: Its output gradient.
            own: The value its module extension saved (``None``: it saved none).
            before: The savefield's value before this use (the previous uses' result).
            call: The layer's call (:class:`.hooks.Call`; ``None``: BackPACK's hooks): each
                call of a layer called several times is a use of its own.
        """
        use = module if call is None else call
        done = self.done.setdefault(savefield, [])
        if use in done:  # the same call again: a new backward pass (retain_graph)
            self.new_pass()
            done = self.done.setdefault(savefield, [])
        param = getattr(module, attribute)
        self.param = param if self.param is None else self.param
        if use not in self.uses:
            self.uses[use] = use_of(module, attribute, inputs, grad_output, call)
        previous = list(done)
        done.append(use)
        self.refusal = self.refusal or self._why_not(module, attribute, use, call, param, own, previous)
        if self.refusal is not None:
            return None
        if not previous:
            return own
        if savefield == LOCAL_GRADIENT_SAVEFIELD:
            return before + own
        try:
            cross = [self._cross(use, other, param.shape) for other in previous]
        except Exception as error:  # noqa: BLE001 - a recomputed use that cannot run: refused, the step kept
            self.refusal = (f"it is tied and its use by a {type(module).__name__} or another layer "
                            f"cannot be recomputed per example ({type(error).__name__}: {error})")
            return None
        if savefield == BATCH_L2_SAVEFIELD:
            return before + own + 2 * sum(norms for norms, _ in cross)
        elementwise = [elementwise for _, elementwise in cross]
        if len(elementwise) == 1 and not torch.is_grad_enabled() and len(own) == 2 \
                and own.shape == before.shape and own.dtype == before.dtype == elementwise[0].dtype:
            return summed_pair(before, own, elementwise[0])
        squares = before[1] + own[1] + 2 * sum(elementwise)
        return torch.stack([before[0] + own[0], squares])

    def _why_not(self, module, attribute, use, call, param, own, previous) -> Optional[str]:
        """Why this use cannot be combined with the ``previous`` ones (``None``: it can)."""
        if call is not None:
            self.forwards.add(call.forward)
        if len(self.forwards) > 1:
            return ("its layers' calls belong to several forward passes (their rows are other "
                    "examples): one forward pass per backward pass to give it rows")
        if param is not self.param:
            return ("the layers that held it when the model was prepared no longer share one "
                    "tensor: prepare the model (cgn.prepare_model) after tying or untying")
        if own is None or self.uses[use] is None:
            return (f"it is tied and used as the {attribute} of a {type(module).__name__} whose "
                    "call has no rows or cannot be run again per example (tied parameters are "
                    "combined over a Linear's or an Embedding's weight, and over any layer called "
                    "with one tensor, recomputed per example): to give it rows, tie it between "
                    "such layers only, or untie it (tie_word_embeddings=False in transformers), "
                    "and prepare the model (cgn.prepare_model) again")
        if any(self.uses.get(other) is None for other in previous):
            return ("more of its uses reached the backward pass than its layers' calls in the "
                    "last forward pass (the earlier uses were let go)")
        return None

    def release_when_done(self, savefields, calls: int = 0):
        """Drop the uses' tensors once every layer (every one of the ``calls`` of the layers
        that hold it, if more) is combined in each of ``savefields``.

        Until then each use keeps its layer's output gradient (the head's: as
        large as the logits) and input; a layer the forward pass did not run
        keeps them until the next forward pass.
        """
        expected = max(self.layers, calls)
        if self.uses and all(len(self.done.get(f, ())) >= expected for f in savefields):
            self.uses = dict.fromkeys(self.uses)
            self.cross = {}

    def _cross(self, use, other, shape):
        """The cross terms of two uses (layers, or calls), computed once for all extensions."""
        layers = list(self.uses)
        key = (layers.index(use), layers.index(other))
        if key not in self.cross:
            new, old = self.uses[use], self.uses[other]
            self.cross[key] = cross_terms(new, old, new.grad.shape[0], shape)
        return self.cross[key]


def summed_pair(before: Tensor, own: Tensor, elementwise: Tensor) -> Tensor:
    """``[T, S]`` of two uses' ``[T, S]`` (``before``, ``own``) and their cross term
    ``C = sum_i x_i^(b) * x_i^(o)``: ``T = T_b + T_o``, ``S = (S_b + S_o) + 2 C``.

    The numbers of ``stack([T_b + T_o, (S_b + S_o) + 2 C])``, bit for bit: the same sums, and
    ``2 C`` is exact (a power of two), so ``s + 2 C``, fused or not, rounds once, as
    ``s + fl(2 C)`` does. One new ``[2, V, d]`` tensor where that wrote five (GPT-2's tied
    head: ``stack`` alone took 0.38 s a step, ``benchmarks/README.md``); neither use's tensor
    is written (another savefield may hold a view of it: a rule's local gradient ``T``).
    """
    result = torch.add(before, own)
    result[1].add_(elementwise, alpha=2)
    return result


def mark(model: nn.Module) -> List[TiedGroup]:
    """Mark every layer of ``model`` that holds a tied parameter; return the groups.

    A parameter is tied if ``model.named_parameters(remove_duplicate=False)``
    gives it several names. Each layer (module object) that holds it gets
    ``{attribute: group}`` in :data:`TIED_ATTR`.
    """
    names: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    holders: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for module in model.modules():  # each module object once
        # A parameter a submodule holds too is that layer's (.fallback.parameters).
        delegated = delegated_parameters(module)
        for attribute, param in module._parameters.items():
            if param is not None and len(names.get(id(param), ())) > 1 \
                    and id(param) not in delegated:
                holders.setdefault(id(param), []).append((module, attribute))
    groups = []
    for key, layers in holders.items():
        if len(layers) < 2:  # its other names are a container's that hands it on
            continue
        group = TiedGroup(tuple(names[key]), len(layers))
        groups.append(group)
        for module, attribute in layers:
            module.__dict__.setdefault(TIED_ATTR, {})[attribute] = group
    return groups


def combine(extension, module: nn.Module, inputs: Tensor, grad_output: Tensor,
            before: Dict[str, Optional[Tensor]], call=None, calls: Optional[Dict[int, int]] = None):
    """After ``module``'s extension ran: its tied parameters' savefields over every use so far.

    ``inputs`` and ``grad_output`` are the layer's input (in the forward pass)
    and output gradient; ``before`` holds each tied attribute's savefield value
    before the extension ran; ``call`` the call (:class:`.hooks.Call`, ``None`` under
    BackPACK's hooks), ``calls`` ``{id(group): calls of its layers in the forward pass}``.
    Returns ``{attribute: reason}`` of the parameters refused.
    """
    savefield = extension.savefield
    refused = {}
    for attribute, group in getattr(module, TIED_ATTR, {}).items():
        param = getattr(module, attribute)
        if savefield not in COMBINED_SAVEFIELDS or not param.requires_grad:
            continue
        own = getattr(param, savefield, None)
        own = None if own is before[attribute] else own
        value = group.combined(savefield, module, attribute, inputs, grad_output, own,
                               before[attribute], call)
        if value is None:
            if hasattr(param, savefield):
                delattr(param, savefield)
            refused[attribute] = group.refusal
        else:
            setattr(param, savefield, value)
        group.release_when_done(active_savefields(), (calls or {}).get(id(group), 0))
    return refused


def active_savefields():
    """The savefields of :data:`COMBINED_SAVEFIELDS` whose extensions run in this backward pass."""
    return {getattr(ext, "savefield", None) for ext in CTX.get_active_exts()}.intersection(
        COMBINED_SAVEFIELDS)


def values_before(extension, module: nn.Module) -> Dict[str, Optional[Tensor]]:
    """``{attribute: savefield value}`` of ``module``'s tied parameters, before its extension runs."""
    return {attribute: getattr(getattr(module, attribute), extension.savefield, None)
            for attribute in getattr(module, TIED_ATTR, {})}
