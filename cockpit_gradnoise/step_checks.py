"""The checks of a cockpit call: what it hands in, and which parameters have results to read.

What the call hands in is checked before anything is computed: its step
number (:func:`step_number`), the batch keys of ``info``
(:func:`check_batch_size`, :func:`check_individual_losses`) and the
parameters' names (:func:`parameter_names`, :func:`check_names`).
:class:`ParameterChecks`, a part of the call's
:class:`~cockpit_gradnoise.step.Step`, tells which parameters have every
result a quantity reads, with one warning per fact about the others.
"""

import numbers
import operator
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.extensions import facts, sharded
from cockpit_gradnoise.logs.schema import NETWORK

import torch

import_cockpit()
from cockpit.context import CockpitCTX  # noqa: E402


def check_example_count(results: int, individual_losses: int):
    """Raise if BackPACK's per-example results and ``info["individual_losses"]`` disagree.

    Raises:
        ValueError: Naming both counts and the fix.
    """
    if results != individual_losses:
        raise ValueError(
            f"info['individual_losses'] has {individual_losses} values but the batch "
            f"has {results} examples: pass one loss per example of the batch that was "
            "differentiated, e.g. loss_fn_none(out, y) with reduction='none'"
        )


def step_number(step, convert: bool = False) -> int:
    """``step`` as the plain ``int`` that the quantities key the call's records by.

    A float step writes a log that cannot be read back, a tensor one that
    cannot be written, so a step is checked at the call. Any integral number
    (``numbers.Integral``: a NumPy integer, as steps taken from an array are)
    is its ``int``; the quantities store their records under that ``int``.

    Args:
        step: The step handed to the cockpit call.
        convert: Also take 0-dim integer tensors, as their ``int`` (the front
            door, :class:`~cockpit_gradnoise.Tracker`, converts before Cockpit
            stores anything under the step).

    Raises:
        TypeError: Anything else (a float, a bool, a string, a tensor with
            elements of another dtype or more than one), naming ``int(step)``.
    """
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return operator.index(step)  # NumPy's integers are Integral; numpy.bool_ is not
    if convert and isinstance(step, torch.Tensor) and step.dim() == 0 and _integer_dtype(step):
        return int(step)
    raise TypeError(
        f"the step must be an int (Cockpit keys its records by it), got "
        f"{type(step).__name__} {step!r}: pass int(step), counted by a Python int that "
        "grows at every step of the whole run"
    )


def _integer_dtype(tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool)


def check_call(global_step) -> int:
    """:func:`step_number` of a plain cockpit call, checked before anything is computed.

    Cockpit has stored the call's ``info`` under the step by then: a refused
    call leaves nothing behind.
    """
    try:
        return step_number(global_step)
    except TypeError:
        CockpitCTX.erase()
        raise


def repeated_step_message(global_step, last) -> str:
    """The warning when a call's step is not after the last one a quantity recorded."""
    return (
        f"step {global_step} comes after step {last} was recorded: records are never "
        f"overwritten, so the quantities that recorded step {last} or later skip this "
        "call and keep their first records. Pass a global step counter that grows over "
        "the whole run (one more per optimizer step, not the batch index of an epoch). "
        "To track gradient accumulation, give every micro-batch of a step the same step "
        "and say which micro-batch it is: tracker(step, losses, micro_batch=k, "
        "micro_batches=K), or info['micro_batch'] and info['micro_batches'] "
        "(docs/accumulation.md)"
    )


def check_batch_size(batch_size) -> int:
    """``info["batch_size"]`` as an int: a positive integer (Python, NumPy or a 0-dim tensor).

    Raises:
        TypeError: Not an integer (a float, a bool, a string, ...).
        ValueError: Not positive.
    """
    try:
        size = step_number(batch_size, convert=True)
    except TypeError:
        raise TypeError(
            f"info['batch_size'] must be the number of examples, a positive int, got "
            f"{type(batch_size).__name__} {batch_size!r}: pass len(x) of the batch, or "
            "leave batch_size out and pass info['individual_losses']"
        ) from None
    if size < 1:
        raise ValueError(
            f"info['batch_size'] must be positive, got {size}: pass len(x) of the batch "
            "that was differentiated, or leave batch_size out and pass "
            "info['individual_losses']"
        )
    return size


def whole_loss(loss, name: str = "info['loss']"):
    """``loss`` as a plain tensor where it is a DTensor replicated over its mesh (the losses
    of ``loss_parallel()``, torch's vocabulary-parallel cross entropy: every process holds
    them whole; ``to_local()``, no communication, differentiable); anything else as it is.

    Raises:
        TypeError: A DTensor not replicated (sharded or partial): no process holds the losses.
    """
    if type(loss).__name__ != "DTensor":
        return loss
    if all(placement.is_replicate() for placement in loss.placements):
        return loss.to_local()
    raise TypeError(
        f"{name} is a DTensor placed {loss.placements}: the per-example losses must be whole on "
        "every process. Under loss_parallel() compute them with reduction='none' (torch gives "
        "them replicated), or gather the head's output whole (output_layouts=Replicate() on its "
        "ColwiseParallel) and compute the loss outside loss_parallel()"
    )


def check_individual_losses(losses, name: str = "info['individual_losses']") -> torch.Tensor:
    """``losses``, checked to be a 1-D tensor of at least one loss; ``name`` says whose.

    A DTensor replicated over its mesh (``loss_parallel()``'s) is taken as its local tensor,
    the whole losses (:func:`whole_loss`).

    ``info["individual_losses"]`` of a Cockpit call, or the ``losses`` of a
    tracker's call. Lists and NumPy arrays are refused rather than converted:
    the losses are the tensor a loss function gives with ``reduction='none'``,
    which Cockpit's own quantities read too.

    Raises:
        TypeError: Not a tensor.
        ValueError: Not of shape ``[N]``, ``N >= 1``.
    """
    fix = (
        "compute them with reduction='none', e.g. loss_fn(reduction='none')(outputs, targets): "
        "a 1-D tensor of one loss per example (shape [N], N >= 1)"
    )
    if not isinstance(losses, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(losses).__name__}: {fix}")
    losses = whole_loss(losses, name)
    if losses.dim() != 1 or losses.numel() == 0:
        raise ValueError(
            f"{name} must hold one loss per example, got shape {tuple(losses.shape)}: {fix}; "
            "for per-token losses reduce the other dimensions, e.g. losses.mean(dim=1)"
        )
    return losses


def parameter_names(param_names, params: Sequence[torch.Tensor], owner: str) -> List[str]:
    """The names of ``params``: looked up by identity, or checked by position.

    Args:
        param_names: ``None`` (``param0``, ``param1``, ...); a module or a
            mapping ``{name: parameter}`` such as
            ``dict(model.named_parameters())``, where each parameter's name is
            found by identity; or a sequence of names, one per parameter in
            the order they were given to the Cockpit (checked by count only:
            prefer the module).
        params: The parameters given to the Cockpit.
        owner: Who asks, for messages.

    Raises:
        ValueError: A parameter the mapping does not hold, or a count mismatch.
    """
    if param_names is None:
        return [f"param{i}" for i in range(len(params))]
    if isinstance(param_names, Mapping):
        by_id = {id(p): str(n) for n, p in param_names.items()}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(
                f"{owner}: the Cockpit's parameters {missing} (by position) are not in "
                "the model whose names were given: build the Cockpit from that "
                "model's parameters"
            )
        return [by_id[id(p)] for p in params]
    if len(param_names) != len(params):
        raise ValueError(
            f"{owner} got {len(param_names)} param_names for {len(params)} parameters: "
            "pass the names of exactly the parameters given to the Cockpit, in the same "
            "order, or pass the model (names are then found by identity)"
        )
    return list(param_names)


def check_names(param_names) -> Any:
    """``param_names`` as a quantity keeps it: a dict for a module, a list of str otherwise.

    Raises:
        ValueError: Repeated names, or the reserved name ``"all"``.
    """
    if param_names is None:
        return None
    if isinstance(param_names, torch.nn.Module):
        param_names = dict(param_names.named_parameters())
    if isinstance(param_names, Mapping):
        names = [str(n) for n in param_names]
    else:
        param_names = names = [str(n) for n in param_names]
    if len(set(names)) != len(names):
        raise ValueError("param_names must be unique")
    if NETWORK in names:
        raise ValueError(f"{NETWORK!r} is reserved for the whole network")
    return param_names


def _same_version(seen, grad) -> bool:
    """Whether ``grad`` is the tensor recorded in ``seen`` (a weak reference), at its version."""
    return seen is not None and seen[0]() is grad and seen[1] == version_of(grad)


def version_of(grad) -> int:
    """``grad._version``; for a DTensor, its own plus its local shard's: FSDP2 adds to the
    shard in place under accumulation without moving the DTensor's, autograd adds to a
    tensor-parallel DTensor gradient without moving its shard's."""
    if type(grad) is torch.Tensor:  # most gradients: no shard to look for
        return grad._version
    local = sharded.local_tensor(grad)
    return grad._version + (local._version if local is not grad else 0)


def unsupported_message(unsupported, with_grad, owners: Mapping[int, str], shown: int = 4) -> str:
    """The warning about parameters without per-example rules, a few hundred characters for any model.

    It names how many parameters, their share of the elements, the classes of
    the layers that own them (``owners``, ``{id(param): class name}`` as
    :class:`~cockpit_gradnoise.extensions.facts.BackwardFacts` records them) and
    where the fix is, with at most ``shown`` classes and two parameter names.

    Args:
        unsupported: ``(name, param)`` of the parameters without rules.
        with_grad: ``(name, param)`` of every parameter with a gradient.
        owners: Owning module class name per ``id(param)``.
        shown: How many classes to name.
    """
    total = max(1, sum(p.numel() for _, p in with_grad))
    # A parameter whose layer no hook saw in the backward pass (no owner recorded): read
    # directly by another module's forward (ProphetNet's ngram_embeddings.weight).
    unseen = [(n, p) for n, p in unsupported if id(p) not in owners]
    seen = [(n, p) for n, p in unsupported if id(p) in owners]
    parts = []
    if seen:
        classes = sorted({owners[id(p)] for _, p in seen})
        named = ", ".join(classes[:shown]) + (f" and {len(classes) - shown} more" if len(classes) > shown else "")
        parts.append(f"{_counted(seen, total)} in layers of class{'es' if len(classes) > 1 else ''} "
                     f"{named} {'have' if len(seen) > 1 else 'has'} no per-example rule ({_first(seen)})")
    if unseen:
        parts.append(f"{_counted(unseen, total)} of layers no hook saw in the backward pass "
                     f"({_first(unseen)}): each {facts.UNSEEN}")
    return (
        "; ".join(parts) + ": they have no rows in the quantities "
        f"that need per-example results and are left out of their {NETWORK!r}. Supported "
        "layers and what to do with others: docs/architectures.md"
    )


def _counted(named, total: int) -> str:
    """``"3 parameters (1.2% of the elements)"``."""
    share = 100 * sum(p.numel() for _, p in named) / total
    return f"{len(named)} parameter" + ("s" if len(named) > 1 else "") + f" ({share:.3g}% of the elements)"


def _first(named) -> str:
    return ", ".join(repr(n) for n, _ in named[:2]) + (", ..." if len(named) > 2 else "")


def explained_message(explained: Mapping[str, str], shown: int = 2) -> str:
    """The warning about parameters a rule gave no results, with its reason (the fallback's
    refusal of their module), a few hundred characters per distinct reason for any model:
    the parameters grouped by reason, each group's classes, first ``shown`` names and count.

    Args:
        explained: ``{name: "Class.attribute: reason"}`` (as the fallback records it).
        shown: How many names to give per reason.
    """
    groups: Dict[str, Tuple[List[str], set]] = {}
    for name in sorted(explained):
        owner, _, reason = explained[name].partition(": ")
        names, classes = groups.setdefault(reason or owner, ([], set()))
        names.append(name)
        classes.add(owner.split(".")[0] if reason else "unknown")
    parts = []
    for reason, (names, classes) in groups.items():
        listed = ", ".join(repr(n) for n in names[:shown])
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{listed}{more} (in {', '.join(sorted(classes))}): {reason}")
    count = f"{len(explained)} parameter" + ("s" if len(explained) > 1 else "")
    return (f"no exact per-example results for {count}, left out (they have no rows and are left "
            f"out of {NETWORK!r}): " + "; ".join(parts) + " (see docs/architectures.md)")


class ParameterChecks:
    """Which parameters have usable results: the part of :class:`~cockpit_gradnoise.step.Step` that checks them.

    It reads the Step's ``global_step`` and ``facts`` and warns through its
    ``warn`` and ``warn_names``, once per step for all quantities.
    """

    def usable(
        self,
        quantity,
        named: Sequence[Tuple[str, torch.Tensor]],
        savefields: Sequence[str],
        has_results: Optional[Callable[[torch.Tensor], bool]] = None,
        examples: Optional[int] = None,
    ) -> List[Tuple[str, torch.Tensor]]:
        """``(name, param)`` pairs that have every result needed; warn about the rest.

        Args:
            quantity: Who asks (its class name goes into errors).
            named: ``(name, param)`` of the Cockpit's parameters.
            savefields: The BackPACK results it reads.
            has_results: Whether a parameter has them; by default, whether
                BackPACK left every savefield on it.
            examples: The batch's number of examples, to find layers applied
                without the batch dimension; ``None`` skips that check.

        Raises:
            RuntimeError: No parameter got BackPACK's results (the model was not extended).
            ValueError: A parameter used by several layers (tied weights) in a
                model not prepared by ``prepare_model``, or one refused because
                of how the model was set up (the others whose results could not
                be computed are left out with a warning).
        """
        if has_results is None:
            def has_results(param):
                return all(hasattr(param, field) for field in savefields)

        owner = type(quantity).__name__
        trainable = [(n, p) for n, p in named if p.requires_grad]
        # A parameter of no elements (a size 0 in a configuration: MobileBERT's tiny head) has no
        # statistics; its ratios and fractions would be 0 / 0.
        empty = [n for n, p in trainable if p.numel() == 0]
        trainable = [(n, p) for n, p in trainable if p.numel() > 0]
        no_grad = [n for n, p in trainable if p.grad is None]
        with_grad = self._without_stale([(n, p) for n, p in trainable if p.grad is not None], quantity)
        mixed = self.facts.mixed  # whatever results they got: their rows mix the examples
        usable = [(n, p) for n, p in with_grad if has_results(p) and id(p) not in mixed]
        supported = {n for n, _ in usable}
        if with_grad and not usable:
            raise RuntimeError(
                f"{owner}: no parameter received BackPACK's results "
                f"({', '.join(savefields)}). Extend the model and the loss function with "
                "`cgn.prepare_model(model)` (or `backpack.extend(model)`) and "
                "`backpack.extend(loss_fn)` before training, or use `cgn.track(model)`, and "
                "make sure the model has layers this package supports (see "
                "docs/architectures.md)."
            )
        refused = self._refused(owner, with_grad) if savefields else {}
        reasons = {**self.facts.reasons, **mixed}  # a rule's reason for no results: named, not "no rule"
        explained = {n: reasons[id(p)] for n, p in with_grad
                     if n not in supported and n not in refused and id(p) in reasons}
        unsupported = [(n, p) for n, p in with_grad
                       if n not in supported and n not in refused and n not in explained]
        if explained:
            self.warn_names("explained", sorted(explained),
                            lambda names: explained_message({n: explained[n] for n in names}), quantity)
        if refused:
            usable = [(n, p) for n, p in usable if n not in refused]
            self.warn_names(
                "refused", sorted(refused),
                lambda names: f"no exact per-example results for parameters {names}: "
                + "; ".join(f"{n!r}: {refused[n]}" for n in names)
                + f" (see docs/architectures.md); they have no rows and are left out of {NETWORK!r}",
                quantity,
            )
        if savefields:
            usable = self._without_batchless(quantity, usable, examples)
        self.warn_names(
            "empty", empty,
            lambda names: f"parameters {names} have no elements (a size of 0 in the model's "
            f"configuration), so no statistics; they have no rows and are left out of {NETWORK!r}",
            quantity,
        )
        self.warn_names(
            "no-grad",
            no_grad,
            lambda names: f"parameters {names} have no gradient at step {self.global_step} "
            "(unused in the forward pass, or their module replaced by a new one: then "
            "rebuild the cockpit, or cgn.track the model again); they have no rows and "
            f"are left out of {NETWORK!r}",
            quantity,
        )
        if unsupported:
            self.warn("unsupported", unsupported_message(unsupported, with_grad, self.facts.owners),
                      quantity)
        return usable

    def _without_stale(self, named, quantity):
        """``named`` without parameters whose ``.grad`` this backward pass left unchanged.

        A backward pass that reaches a parameter creates its ``.grad`` or adds
        to it in place (a new tensor, or a new version of the old one). The same
        tensor at the same version as at the quantity's last tracked step is
        left from an earlier backward pass: the parameter is no longer part of
        the model's computation, typically because its module was replaced
        (a new ``nn.Linear`` put in place of the old one), and its statistics
        would repeat stale numbers.
        """
        seen = quantity.seen_gradients
        stale = [n for n, p in named if _same_version(seen.get(n), p.grad)]
        for name, param in named:
            seen[name] = (weakref.ref(param.grad), version_of(param.grad))
        self.warn_names(
            "stale-grad",
            stale,
            lambda names: f"parameters {names} got no gradient from the backward pass of "
            f"step {self.global_step}: their .grad is left, unchanged, from an earlier "
            "step. Was their module replaced by a new one? The cockpit tracks the "
            "parameter tensors it was built with: after replacing a module, rebuild the "
            "cockpit and its quantities (or cgn.track the model again) and the optimizer. "
            "Else clear gradients before each backward pass (optimizer.zero_grad() over "
            f"every parameter). They have no rows and are left out of {NETWORK!r}",
            quantity,
        )
        return [(n, p) for n, p in named if n not in stale]

    def warn_frozen(self, quantity, named: Sequence[Tuple[str, torch.Tensor]]):
        """Warn once about each of the cockpit's parameters that no longer requires gradients.

        Cockpit refuses frozen parameters when it is built, so one found here
        was frozen during training; the quantities leave it out from then on.
        """
        self.warn_names(
            "frozen",
            [n for n, p in named if not p.requires_grad],
            lambda names: f"parameters {names} no longer require gradients at step "
            f"{self.global_step} (frozen with requires_grad_(False) after the cockpit was "
            f"built): from now on they have no rows and are left out of {NETWORK!r}. "
            "Unfreeze them, or rebuild the cockpit over the trainable parameters (or "
            "cgn.track the model again) if that is meant",
            quantity,
        )

    def _refused(self, owner, named) -> Dict[str, str]:
        """``{name: reason}`` of parameters whose results the backward pass could not compute.

        Those refused for the model's structure (``facts.refusals``: an embedding
        applied without the batch dimension whose output meets the batch
        elsewhere than in an addition, a layer run several times in one forward
        pass, a tied parameter used by an unsupported layer) are returned, to be
        left out with a warning: the step keeps every other parameter's rows.

        ``prepare_model`` (and ``cgn.track``) marks the layers that hold a tied
        parameter, and their results are then summed over the uses
        (:mod:`~cockpit_gradnoise.extensions.tied`); a model extended by
        ``backpack.extend`` alone keeps the result of the use reached last.

        Raises:
            ValueError: For parameters used by several layers in a model not
                prepared by ``prepare_model``, and for those refused because of
                how the model was set up (``facts.setup_refusals``), naming them
                and the fix.
        """
        refused = {n: self.facts.refusals[id(p)] for n, p in named if id(p) in self.facts.refusals}
        ids = {n: id(p) for n, p in named}
        setup = {n: why for n, why in refused.items() if ids[n] in self.facts.setup_refusals}
        if setup:
            reasons = "; ".join(f"{n!r}: {why}" for n, why in setup.items())
            raise ValueError(
                f"{owner}: no exact per-example results for parameters "
                f"{sorted(setup)}: {reasons} (see docs/architectures.md)"
            )
        shared = [n for n, p in named if self.facts.shared(p)]
        if shared:
            raise ValueError(
                f"{owner}: parameters {shared} are used by several layers (tied weights, "
                "e.g. an output layer sharing the embedding matrix), and BackPACK's "
                "per-example results of one use overwrote the other's: prepare the model "
                "with `cgn.prepare_model(model)` (or `cgn.track(model)`) instead of "
                "`backpack.extend(model)`, after tying, so that the uses are combined"
            )
        return refused

    def _without_batchless(self, quantity, named, examples):
        """``named`` without parameters of layers applied without the batch dimension."""
        leading = self.facts.leading_sizes
        sizes = [leading[id(p)] for _, p in named if id(p) in leading]
        if examples is None or not sizes:
            return named
        # Most layers see the batch: a count in info that disagrees with them is wrong. Layers
        # on rows that are not examples (sequence-first [T, B, C]: XLNet's, FSMT's) lead with
        # the batch too, their rows given by a block run on each example (.fallback.regroup);
        # where no block could be found their T reaches here, which the error says too.
        most = max(set(sizes), key=sizes.count)
        if most != examples:
            first = sorted(n for n, p in named if leading.get(id(p)) == most)[:3]
            raise ValueError(
                f"info['individual_losses'] has {examples} values but the batch has {most} examples "
                f"by most layers' outputs (e.g. {first}): pass one loss per example of the batch that was "
                "differentiated, e.g. loss_fn_none(out, y) with reduction='none'; if that is "
                "what was passed, those layers run on rows that are not examples (a sequence-first "
                "[T, B, C] layout) and no module around them that takes and returns the batch first "
                "could be run again on each example (the model's run on one example more before the "
                "first tracked step failed, or found none: docs/architectures.md): make them "
                "batch-first, or track quantities that read only param and param.grad "
                "(quantities=['ParamGradRatio', 'UpdateSize'])"
            )
        batchless = {n: leading[id(p)] for n, p in named if leading.get(id(p), examples) != examples}
        # Only where some layer leads with another size may others lead with the batch by
        # coincidence (no name's kind formed otherwise: a regular expression per parameter).
        coincident = facts.batch_by_coincidence(
            {n: leading[id(p)] for n, p in named if id(p) in leading}, examples) if batchless else set()
        if coincident:
            self.warn(
                "coincident",
                f"parameters {sorted(coincident)} belong to layers whose output leads with "
                f"the batch size ({examples}) while layers of their kind (the same name up "
                "to its numbers, e.g. other experts of a mixture-of-experts block) run on "
                "rows that are not examples: their rows are taken for the same, and left "
                f"out of {NETWORK!r} with those (never counted as examples by coincidence)",
                quantity,
            )
        if batchless:
            self.warn(
                "batchless",
                f"parameters {sorted(batchless)} belong to layers applied without the "
                f"batch dimension (their output leads with {sorted(set(batchless.values()))}, "
                f"the batch has {examples} examples), e.g. wpe(torch.arange(T)) "
                "broadcast over the batch: prepare the model with `cgn.prepare_model` "
                "(embeddings added to the batch then get exact rows) or apply them to "
                "every example, wpe(pos.expand(B, T)); they have no rows and are "
                f"left out of {NETWORK!r}",
                quantity,
            )
        return [(n, p) for n, p in named if n not in batchless and n not in coincident]
