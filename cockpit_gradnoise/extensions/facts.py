"""One backward pass: what it revealed about the model, and what its rules share while it runs.

Cockpit runs one instance of each extension class for all the quantities that
request it, and BackPACK hands module extensions no per-pass object, so what
a backward pass records cannot live on an extension instance. As BackPACK
keeps its own pass in one ``backpack.context.CTX``, this package keeps it in
one :class:`BackwardFacts`: the facts the quantities check, the buffer plan
of the sums being served (:mod:`.arena`), the layer cache (:mod:`._layer_cache`)
and the call being dispatched (:mod:`.hooks`). The
:class:`~cockpit_gradnoise.step.Step` of a cockpit call starts a new one
before the backward pass (:func:`begin`) and keeps it; the extensions and
their rules reach the one started last through :func:`recording`, the one
accessor. During a pass only that object changes.
"""

import re
from collections import Counter
from typing import Dict, Mapping, Optional, Set

from cockpit_gradnoise.extensions._layer_cache import LayerCache
from cockpit_gradnoise.extensions.deferred_norms import DeferredNorms
from cockpit_gradnoise.extensions.deferred_sums import DeferredSums
from cockpit_gradnoise.extensions.savefields import TIED_ATTR

import torch
from torch import nn

_SEQUENCE_FIRST = (nn.RNN, nn.LSTM)
#: Why a parameter with a gradient whose layer no hook saw in the backward pass (no owner
#: recorded) has no rows: ProphetNet's decoder reads ``ngram_embeddings.weight`` directly.
UNSEEN = ("got a gradient another way than through its layer's output (read directly by "
          "another module's forward, as layer.weight), a use no rule sees: call the layer "
          "itself, or use the parameter in a module of its own, to give it rows")


class BackwardFacts:
    """One backward pass: the facts it revealed, and what its rules share while it runs.

    Attributes:
        examples_interact: A layer mixed the examples of the batch (BatchNorm
            in training mode).
        uses: ``{(extension class, id(param)): count}``, how many layers wrote
            one extension's result on a parameter: more than one for a
            parameter shared by several layers (tied weights).
        unmarked_uses: The same count of the layers not marked by
            ``prepare_model`` as holding a tied parameter (whose uses are not
            combined, :mod:`.tied`).
        writers: ``{(extension class, id(param)): {id(module)}}``, the layers that
            wrote it (one layer twice: a layer run several times, refused).
        shared_ids: ``{id(param)}`` of the parameters some extension wrote on
            more than once from several layers, one at least unmarked (what
            :meth:`shared` asks; a set, as it is asked for every parameter by
            every quantity).
        refusals: ``{id(param): reason}``, parameters whose results this
            backward pass could not compute (removed): the quantities leave them
            out with a warning naming them and the reason.
        setup_refusals: ``{id(param)}`` of those refused because of how the
            model was set up (the reason names the fix): the quantities raise.
        reasons: ``{id(param): reason}``, why a rule gave a parameter no results
            (the fallback refused its module): the quantities name the reason when
            it has none (a parameter that got results elsewhere keeps them).
        mixed: ``{id(param): "Class.attribute: reason"}``, parameters of layers whose output
            rows the gradient of one example's loss reaches on other examples
            (:mod:`.fallback.mixing`): left out with the reason, whatever results they got.
        leading_sizes: ``{id(param): size}``, the size of the batch dimension
            of the output of the layer that owns the parameter: not the batch
            size for a layer applied without the batch dimension
            (``wpe(torch.arange(T))``).
        owners: ``{id(param): class name}`` of the module that owns each
            parameter, also where no rule covered it (for the warning that
            names the layers without rows).
        arena: Where this backward pass's sums are written side by side
            (:mod:`.arena`), from the first layer it reaches; ``None`` before.
        layer_cache: One layer's work shared between the extensions that run
            on it (:mod:`._layer_cache`).
        call: The call of a hooked module whose rules are running
            (:class:`.hooks.Call`), ``None`` outside a dispatch; a rule's own
            forward call stores nothing while it is set.
        inside_blocks: ``{id(module)}`` of the modules inside a block that computes their
            parameters' results itself in this pass (:mod:`.fallback.blocks`): they get none
            of their own.
        graph_task: The autograd graph task (:data:`_CURRENT_GRAPH_TASK`) of the backward pass
            these facts are of, from the first fact recorded in it; ``None`` before.
        finished: That backward pass is over (its end reached, :func:`recording`).
        block_rows: ``{id(param): class name}`` of the block that computed a parameter's
            results (for the checker's "how").
        repeated: ``{id(module): calls}`` of the layers run several times in one forward
            pass, whose calls' contributions are summed per example at the end of this
            backward pass (:mod:`.repeated`).
        deferring: Whether the rule running now may hand its squared norms and sums over to
            be unscaled at the end of the pass (:mod:`.deferred_norms`, :mod:`.deferred_sums`):
            set by :func:`.uses.run` where nothing reads them in the pass, for the time of the rule.
        deferred: The norms handed over, settled when the pass ends (:func:`_end`).
        deferred_sums: The sums handed over, settled after the norms.
    """

    def __init__(self):
        self.examples_interact = False
        self.uses: Counter = Counter()
        self.unmarked_uses: Counter = Counter()
        self.refusals: Dict[int, str] = {}
        self.setup_refusals: Set[int] = set()
        self.reasons: Dict[int, str] = {}
        self.mixed: Dict[int, str] = {}
        self.shared_ids: Set[int] = set()
        self.writers: Dict[tuple, Set[int]] = {}
        self.leading_sizes: Dict[int, int] = {}
        self.owners: Dict[int, str] = {}
        self.arena = None
        self.layer_cache = LayerCache()
        self.call = None
        self.inside_blocks: Set[int] = set()
        self.block_rows: Dict[int, str] = {}
        self.repeated: Dict[int, object] = {}
        self.graph_task: Optional[int] = None
        self.finished = False
        self.deferring = False
        self.deferred = DeferredNorms()
        self.deferred_sums = DeferredSums()

    def may_defer(self) -> bool:
        """Whether a rule run now may hand its norms over (:mod:`.deferred_norms`): inside
        the backward pass these facts are of, whose end (:func:`_end`) is queued.

        The graph task running now must be that pass's: a pass that raised never reaches
        its end (torch drops its queued callbacks), so its facts stay unfinished, and a later
        pass that :func:`recording` finds them in would hand its norms over to no end (and a
        pass run inside a rule is another task). Its rules then give their results at once."""
        return self.graph_task is not None and not self.finished and _CURRENT_GRAPH_TASK() == self.graph_task

    def record(self, extension, module: nn.Module, grad_output):
        """Record the parameters of ``module`` that ``extension`` wrote a result on."""
        batch_axis = 1 if isinstance(module, _SEQUENCE_FIRST) and not module.batch_first else 0
        marked = module.__dict__.get(TIED_ATTR, {})
        savefield, kind, uses, unmarked = extension.savefield, type(extension), self.uses, self.unmarked_uses
        for attribute, param in module._parameters.items():
            if param is not None and param.requires_grad and hasattr(param, savefield):
                key = (kind, id(param))
                # Counter's own += calls its Python __missing__ for a new key: get() does not.
                count = uses[key] = uses.get(key, 0) + 1
                unmarked[key] = unmarked.get(key, 0) + (attribute not in marked)
                self.writers.setdefault(key, set()).add(id(module))
                if count > 1 and unmarked[key]:
                    self._shared_or_run_again(key, module, param)
                self.leading_sizes[id(param)] = grad_output[0].shape[batch_axis]

    def _shared_or_run_again(self, key, module: nn.Module, param):
        """A second result on ``param``: from another layer, a tie ``prepare_model`` did not
        mark (:meth:`shared`, the quantities raise naming the fix); from the same layer, a
        layer run several times in one forward pass, whose first call BackPACK computed from
        the last call's input: refused for the model's structure (left out with a warning)."""
        if len(self.writers[key]) > 1:
            self.shared_ids.add(id(param))
        else:
            self.refuse(param, f"its layer ({type(module).__name__}) ran several times in one "
                        "forward pass, and BackPACK keeps the last input of a layer only")

    def record_owner(self, module: nn.Module):
        """Record ``module``'s class as the owner of its own parameters (the first module
        seen holding one: in the backward pass, a child before its parent)."""
        for param in module._parameters.values():  # parameters(recurse=False), without its generators
            if param is not None:
                self.owners.setdefault(id(param), type(module).__name__)

    def alias(self, source, target):
        """Record ``source``'s facts for ``target`` too (FSDP2's unsharded and sharded
        parameter: :func:`.sharded.collect`)."""
        old, new = id(source), id(target)
        for (extension, key), count in list(self.uses.items()):
            if key == old:
                self.uses[(extension, new)] = count
                self.unmarked_uses[(extension, new)] = self.unmarked_uses[(extension, old)]
        for ids in (self.shared_ids, self.setup_refusals):
            if old in ids:
                ids.add(new)
        for table in (self.refusals, self.reasons, self.mixed, self.leading_sizes, self.owners):
            if old in table:
                table.setdefault(new, table[old])

    def shared(self, param) -> bool:
        """Whether several layers wrote one extension's result on ``param``, not all marked."""
        return id(param) in self.shared_ids

    def refuse(self, param, reason: str, *, setup: bool = False):
        """Record that ``param``'s results could not be computed, and why.

        ``setup``: the cause is how the model was set up, and the reason names the fix
        (the quantities raise); otherwise the model's structure (they leave it out, warning).
        """
        self.refusals.setdefault(id(param), reason)
        if setup:
            self.setup_refusals.add(id(param))


#: The backward pass being run: replaced, never reset, by :func:`begin` (between passes),
#: so facts a Step holds are never changed by a later backward pass. The one module-level
#: cell of the pass (BackPACK's ``CTX`` is one too); during a pass only its object changes.
#: Not per pass, and kept where they are: the sums' plans per model (``arena._PLANS``),
#: the patched BackPACK ``__init__``s (``normalization._STOCK_INITS``) and the tests'
#: setting ``cost_model.FORCE_METHOD``.
_RECORDING = [BackwardFacts()]


def batch_by_coincidence(leading: Mapping[str, int], examples: int) -> Set[str]:
    """The parameters whose layer's rows number the batch by coincidence.

    Layers of one kind (the same name up to the numbers in it: the experts of a
    mixture-of-experts block, ``experts.expert_0.wo`` to ``experts.expert_3.wo``) run
    on rows of one kind. Where some of them lead with another size than the batch
    (the tokens routed to an expert), those leading with the batch size have rows
    that are not examples too (4 tokens routed to an expert of a batch of 4): they
    are left out with the others, never taken for per-example rows.

    Args:
        leading: ``{parameter name: leading size of its layer's output}``.
        examples: The batch size.
    """
    kind = {name: re.sub(r"\d+", "#", name) for name in leading}
    other = {kind[name] for name, size in leading.items() if size != examples}
    return {name for name, size in leading.items() if size == examples and kind[name] in other}


def begin() -> BackwardFacts:
    """A new backward pass, into which the extensions record from now on."""
    # The layer cache serves one pass only (its keys are the pass's tensors): let it go.
    _RECORDING[0].layer_cache = LayerCache()
    _RECORDING[0] = BackwardFacts()
    return _RECORDING[0]


#: The id of the autograd graph task running now (one per ``backward()`` or ``autograd.grad``
#: call), ``-1`` outside a backward pass: torch's ``_current_graph_task_id`` (torch >= 2.1;
#: before, always ``-1``), looked up once: :func:`recording` runs several times per layer.
_CURRENT_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def recording() -> BackwardFacts:
    """The backward pass the extensions record into: that of the last :func:`begin`, or
    a new one where a backward pass nobody began reaches here.

    A cockpit's :class:`~cockpit_gradnoise.step.Step` begins each tracked backward pass;
    BackPACK's ``with backpack(...)`` alone (the extensions used directly) does not. Such
    a pass must not record into the facts of an earlier one: their keys are ``id()`` of
    parameters and layers, which a new model may reuse once the old one is freed (a new
    layer would then count as a second use of a freed one, and lose its results). So
    the first fact a backward pass records ties the facts to its graph task, and ends
    them with it (``queue_callback``: at the end of the outermost pass, so that a
    backward pass a rule runs inside it keeps recording there); a later pass that
    finds them ended begins its own.
    """
    facts, task = _RECORDING[0], _CURRENT_GRAPH_TASK()
    if task == -1 or task == facts.graph_task:  # outside a backward pass (a forward hook, a
        return facts  # quantity reading the facts), or inside the one they are of
    if facts.graph_task is None:
        facts.graph_task = task
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _end(facts))
    elif facts.finished and facts.graph_task != task:
        facts = begin()
        facts.graph_task = task
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _end(facts))
    return facts


def _end(facts: BackwardFacts) -> None:
    """The end of the backward pass of ``facts`` (queued when its first fact was recorded:
    the first of the pass's end callbacks): the norms and sums handed over are unscaled and marked."""
    facts.finished = True
    facts.deferred.settle()
    facts.deferred_sums.settle()
