"""One tracked step: what a cockpit call knows, built once and read by every quantity.

Cockpit calls its quantities one by one, so nothing in Cockpit represents "this
tracked backward pass". :class:`Step` is that object. The first quantity that
takes part in a cockpit call builds it; the others of the same call read it:

- the batch (:meth:`Step.examples`, :meth:`Step.loss_batch`): declared by
  the front door when it begins the step (it chose the reduction), else
  inferred from ``info`` by one rule for every quantity;
- which parameters have usable results, with the warnings about the others
  (:meth:`Step.usable`), each warning shown once per step for all quantities;
- whether tensors are finite (:meth:`Step.finite`), found once per tensor;
- what the backward pass revealed about the model (:attr:`Step.facts`);
- under gradient accumulation, which micro-batch of the optimizer step the
  call is (:meth:`Step.micro_batch`), and whether ``param.grad`` held
  gradients before the backward pass (:meth:`Step.check_earlier_gradients`);
- under distributed training, every quantity's declared sums reduced in one
  round of collectives (:meth:`Step.reduced_sums`).

Where it lives: in Cockpit's own storage of the call's ``info``
(``CockpitCTX.INFO``, a dict that Cockpit replaces when the call ends), under
a key no step number can take. So a Step lives exactly as long as its call,
and no module of this package holds one.
"""

import contextlib
import math
import numbers
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, accumulation, distributed, functional
from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.extensions import facts as backward_facts
from cockpit_gradnoise.schema import NETWORK

import torch

import_cockpit()
from cockpit.context import CockpitCTX  # noqa: E402

#: The key of the Step in ``CockpitCTX.INFO``, whose other keys are step numbers.
_KEY = ("cockpit_gradnoise", "Step")


@dataclass(frozen=True)
class Batch:
    """The examples a quantity's declared sums are over.

    Attributes:
        examples: Their number ``N``.
        loss_scale: ``c`` in ``x_i = c g_i`` (an example's contribution to
            ``param.grad`` is ``c`` times the gradient of its own loss):
            ``1/N`` for a mean, ``1`` for a sum (and for one example), NaN
            when the losses are not finite. Under distributed training the
            quantities divide their sums by it (sums of squares by its
            square), so that sums of different processes add, and get the
            global batch's ``N`` and ``c`` back (see ``docs/distributed.md``).
    """

    examples: int
    loss_scale: float

    def same_as(self, other: "Batch") -> bool:
        """Equal, with a NaN scale equal to a NaN scale."""
        return self.examples == other.examples and (
            self.loss_scale == other.loss_scale
            or math.isnan(self.loss_scale) and math.isnan(other.loss_scale)
        )


def backward_failed() -> bool:
    """Whether the cockpit's context is being left because of an exception.

    Cockpit runs its quantities in ``__exit__`` even when ``loss.backward()``
    raised; the exception is then the one being handled.
    """
    return sys.exc_info()[1] is not None


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
    """``step`` as the plain ``int`` that Cockpit keys the call's records by.

    A float step writes a log that cannot be read back, a NumPy integer or a
    tensor one that cannot be written, so a step is checked at the call.

    Args:
        step: The step handed to the cockpit call.
        convert: Also take NumPy integers and 0-dim integer tensors, as their
            ``int`` (the front door, :class:`~cockpit_gradnoise.Tracker`,
            converts before Cockpit stores anything under the step).

    Raises:
        TypeError: Anything else (a float, a bool, a string, a tensor with
            elements of another dtype or more than one), naming ``int(step)``.
    """
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if convert and isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)  # NumPy's integers are Integral; numpy.bool_ is not
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


def check_individual_losses(losses, name: str = "info['individual_losses']") -> torch.Tensor:
    """``losses``, checked to be a 1-D tensor of at least one loss; ``name`` says whose.

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
    return seen is not None and seen[0]() is grad and seen[1] == grad._version


def _name(owner) -> str:
    return owner if isinstance(owner, str) else type(owner).__name__


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
    elements = sum(p.numel() for _, p in unsupported)
    share = 100 * elements / max(1, sum(p.numel() for _, p in with_grad))
    classes = sorted({owners.get(id(p), "unknown") for _, p in unsupported})
    named = ", ".join(classes[:shown]) + (f" and {len(classes) - shown} more" if len(classes) > shown else "")
    examples = ", ".join(repr(n) for n, _ in unsupported[:2]) + (", ..." if len(unsupported) > 2 else "")
    count = f"{len(unsupported)} parameter" + ("s" if len(unsupported) > 1 else "")
    return (
        f"{count} ({share:.3g}% of the elements) in layers of class{'es' if len(classes) > 1 else ''} "
        f"{named} {'have' if len(unsupported) > 1 else 'has'} no per-example rule ({examples}): "
        "they have no rows in the quantities "
        f"that need per-example results and are left out of their {NETWORK!r}. Supported "
        "layers and what to do with others: docs/architectures.md"
    )


class Step:
    """What one cockpit call knows, shared by the quantities it computes.

    Built by :meth:`begin` (when Cockpit asks a quantity what to protect, once
    per call, before the backward pass) or by :meth:`of` (when a quantity
    computes in a call that did not begin that way).

    Attributes:
        global_step: The step number of the call.
        facts: What the backward pass revealed about the model
            (:class:`~cockpit_gradnoise.extensions.facts.BackwardFacts`).
    """

    def __init__(self, global_step: int, facts: Optional[backward_facts.BackwardFacts] = None):
        self.global_step = global_step
        self.facts = backward_facts.begin() if facts is None else facts
        self._computed: Dict[type, Any] = {}  # quantity class -> the instance that computed
        self._members: List[Any] = []  # quantities whose sums reduce together
        self._reduced: Optional[Dict[Any, Any]] = None
        self._loss_batch: Optional[Batch] = None
        self._declared: Optional[Batch] = None  # the front door's (begin)
        # Whether the declared batch's losses are finite: a bool, or a 0-dim tensor not read yet.
        self._losses_finite: Any = True
        self._deferring = False
        self._finite: Dict[int, Tuple[torch.Tensor, int, bool]] = {}
        self._shown: set = set()
        self._micro: Any = self  # not read yet (None: no accumulation)
        self._checked_gradients = False
        self._held_before: Optional[list] = None  # (name, param, grad, version) held then
        #: Whether ``param.grad`` held gradients before this backward pass, outside
        #: accumulation or at its first micro-batch (:meth:`check_earlier_gradients`).
        self.earlier_gradients = False

    # Finding the call's Step ----------------------------------------------------

    @classmethod
    def begin(cls, global_step: int, quantity=None, *, batch: Optional[Batch] = None,
              losses_finite: Any = True) -> "Step":
        """The Step of the call that is beginning; ``quantity`` joins its reduction.

        A Step in which a quantity already computed belongs to an earlier call
        (Cockpit keeps its storage when a quantity raised): a new one replaces it.

        Args:
            global_step: The call's step.
            quantity: A quantity whose declared sums reduce with the others'.
            batch: The batch the front door differentiates, declared as
                Opacus' ``loss_reduction`` is (the tracker chose the loss, so
                it knows ``N`` and ``c``): the quantities then read it, and
                nothing is inferred from ``info``.
            losses_finite: With ``batch``, whether the losses are finite (the
                scale is NaN otherwise, as inferred): a bool, or on other
                devices than the CPU a 0-dim tensor, read with the step's one
                transfer where the values allow (:meth:`loss_known`).
        """
        step = cls._stored(global_step)
        if step is None or step._computed:
            step = cls._store(cls(global_step))  # new facts for the coming backward pass
        if quantity is not None and quantity not in step._members:
            step._members.append(quantity)
        if batch is not None:
            step._declared, step._losses_finite, step._loss_batch = batch, losses_finite, None
        return step

    @classmethod
    def of(cls, quantity, global_step: int) -> "Step":
        """The Step in which ``quantity`` computes now; raises for a second instance of its class.

        Raises:
            RuntimeError: Another instance of the class computed in this call:
                Cockpit keys results by class name, so one would overwrite the other.
        """
        step = cls._stored(global_step)
        if step is None or step._computed.get(type(quantity)) is quantity:
            # Outside a cockpit, or called again: the backward pass has run, and
            # its facts are those recorded last.
            step = cls._store(cls(global_step, backward_facts.recording()))
        other = step._computed.setdefault(type(quantity), quantity)
        if other is not quantity:
            raise RuntimeError(
                f"two {type(quantity).__name__} quantities in one Cockpit: Cockpit keys "
                "results by class name, so one would overwrite the other. Track one "
                "instance of each quantity class (one with all the quantiles you need, say)."
            )
        return step

    @staticmethod
    def _stored(global_step) -> Optional["Step"]:
        step = CockpitCTX.INFO.get(_KEY)
        return step if step is not None and step.global_step == global_step else None

    @staticmethod
    def _store(step) -> "Step":
        CockpitCTX.INFO[_KEY] = step
        return step

    # What info says -------------------------------------------------------------

    def info(self, key: str, owner) -> Any:
        """``info[key]`` as handed to ``cockpit(step, info=...)``; ``owner`` (who asks) names the error.

        Raises:
            KeyError: Naming the missing key and how to pass it.
        """
        try:
            return CockpitCTX.INFO[self.global_step][key]
        except KeyError:
            raise KeyError(
                f"{_name(owner)} needs info[{key!r}]: pass it as "
                f"`with cockpit(step, info={{{key!r}: ..., ...}})`"
            ) from None

    def examples(self, owner) -> int:
        """The batch's number of examples: declared (:meth:`begin`), else from ``info``.

        From ``info``: ``len(info["individual_losses"])``, else ``info["batch_size"]``.

        Raises:
            KeyError: Neither is in ``info``.
            TypeError / ValueError: Either is malformed (see
                :func:`check_individual_losses`, :func:`check_batch_size`), or
                both are given and disagree.
        """
        if self._declared is not None:
            return self._declared.examples
        info = CockpitCTX.INFO.get(self.global_step, {})
        size = check_batch_size(info["batch_size"]) if "batch_size" in info else None
        if "individual_losses" in info:
            examples = check_individual_losses(info["individual_losses"]).shape[0]
            if size is not None and size != examples:
                raise ValueError(
                    f"info['batch_size'] is {size} but info['individual_losses'] "
                    f"has {examples} values: pass one loss per example, and the batch size "
                    "of the batch that was differentiated (or leave batch_size out)"
                )
            return examples
        if size is not None:
            return size
        raise KeyError(
            f"{_name(owner)} needs info['individual_losses'] (one loss per example) or "
            "info['batch_size']: pass it as `with cockpit(step, info={'individual_losses': "
            "..., ...})`"
        )

    def examples_if_known(self) -> Optional[int]:
        """As :meth:`examples`, ``None`` where ``info`` holds neither key."""
        if self._declared is not None:
            return self._declared.examples
        info = CockpitCTX.INFO.get(self.global_step, {})
        known = "individual_losses" in info or "batch_size" in info
        return self.examples("") if known else None

    def loss_batch(self, owner) -> Batch:
        """The :class:`Batch` declared by the front door, else inferred from ``info``.

        Declared (:meth:`begin`): its ``N`` and ``c``, with a NaN scale where
        the losses are not finite. Inferred (the explicit API): from
        ``info["individual_losses"]`` and ``info["loss"]``; telling a mean
        from a sum needs the losses' values on the host, one transfer per
        step, shared by every quantity.
        """
        if self._deferring and self._declared is not None and not isinstance(self._losses_finite, bool):
            return self._declared  # its finiteness is read with the values (loss_known)
        if self._loss_batch is None:
            self._loss_batch = self._inferred(owner) if self._declared is None else self._settled()
        return self._loss_batch

    def _settled(self) -> Batch:
        """The declared batch, its scale NaN where the losses are not finite."""
        if not isinstance(self._losses_finite, bool):
            self._losses_finite = bool(_device.transfer([self._losses_finite])[0])
        declared = self._declared
        return declared if self._losses_finite else Batch(declared.examples, math.nan)

    def _inferred(self, owner) -> Batch:
        individual_losses = check_individual_losses(self.info("individual_losses", owner))
        loss = self.info("loss", owner)
        examples = self.examples(owner)
        micro = self.micro_batch()
        if micro is None:
            scale = functional.loss_scale(loss, individual_losses)
        else:  # losses.mean() / K or losses.sum()
            scale = accumulation.micro_batch_loss_scale(loss, individual_losses, micro.count)
        return Batch(examples, scale)

    @contextlib.contextmanager
    def deferred_loss_check(self):
        """Within it, :meth:`loss_batch` gives a declared batch before its losses' finiteness is read.

        For a quantity that forms its values on the device and reads
        :meth:`loss_known` with them, so that the host does not wait.
        """
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def loss_known(self, context) -> Any:
        """Whether the loss scale of ``context`` (a quantity's context) is known.

        ``False`` for a :class:`Batch` with a NaN scale; for the declared batch
        handed out within :meth:`deferred_loss_check`, whether its losses are
        finite, a 0-dim tensor where not read yet; ``True`` otherwise.
        """
        if not isinstance(context, Batch):
            return True
        if math.isnan(context.loss_scale):
            return False
        if context is self._declared and not isinstance(self._losses_finite, bool):
            return self._losses_finite
        return True

    def micro_batch(self) -> Optional[accumulation.MicroBatch]:
        """Which micro-batch of the optimizer step this call is; ``None`` without accumulation.

        From ``info["micro_batch"]`` and ``info["micro_batches"]``
        (:func:`~cockpit_gradnoise.accumulation.micro_batch_of`).
        """
        if self._micro is self:
            self._micro = accumulation.micro_batch_of(CockpitCTX.INFO.get(self.global_step, {}))
        return self._micro

    def check_earlier_gradients(self, quantity, named: Optional[Sequence[Tuple[str, torch.Tensor]]]):
        """Before the backward pass: whether ``param.grad`` already holds gradients.

        Once per call, where the parameters are known (``named``: the
        Cockpit's ``(name, param)``). Outside accumulation, or at its first
        micro-batch, gradients held then come from an earlier backward pass
        (accumulation tracked at its last micro-batch only, or a missing
        ``zero_grad``): :attr:`earlier_gradients` is set, so that quantities
        that read the batch's gradient take this backward pass's own
        (BackPACK's ``LocalGradient``); :meth:`warn_earlier_gradients`
        names those the backward pass added to.
        """
        if self._checked_gradients or named is None:
            return
        self._checked_gradients = True
        micro = self.micro_batch()
        if micro is not None and micro.index > 0:
            return  # the earlier micro-batches' gradients, expected
        held = accumulation.gradients_held([p for _, p in named])
        if not held:
            return
        self.earlier_gradients = True
        self._held_before = [(named[i][0], named[i][1], named[i][1].grad,
                              named[i][1].grad._version) for i in held]

    def warn_earlier_gradients(self, quantity):
        """After the backward pass: warn once, naming the fix, if it added to gradients held before.

        Gradients held before that it left alone (a replaced module's
        parameters) are the stale gradients of :meth:`usable`, told apart there.
        """
        if not self._held_before:
            return
        added = [name for name, param, grad, version in self._held_before
                 if param.grad is not grad or grad._version != version]
        if added:
            self.warn("earlier-gradients", accumulation.earlier_gradients_message(
                self.global_step, added, self.micro_batch()), quantity)

    # Warnings -------------------------------------------------------------------

    def warn(self, key, message: str, quantity):
        """Warn ``message`` once per step, and never again to a quantity that was told.

        Args:
            key: What the warning is about; one key, one warning per step for all
                quantities.
            message: The text.
            quantity: The quantity asking; it keeps the keys it was told (its
                ``warned`` set), so that a fact that holds at every step is told
                once per run.
        """
        told = quantity.warned
        new = key not in self._shown and key not in told
        self._shown.add(key)
        told.add(key)
        if new:
            warnings.warn(f"cockpit-gradnoise: {message}", stacklevel=4)

    def warn_names(self, kind: str, names: Sequence[str], message: Callable[[List[str]], str], quantity):
        """:meth:`warn` about each of ``names`` once: ``message(names not told yet)``, if any.

        For facts about parameters that can change during a run (a parameter
        frozen, or replaced, at some step): a parameter that joins them is told
        about, one that was told is not told again.
        """
        keys = [(kind, name) for name in names]
        told = quantity.warned
        fresh = [n for n, key in zip(names, keys) if key not in self._shown and key not in told]
        self._shown.update(keys)
        told.update(keys)
        if fresh:
            warnings.warn(f"cockpit-gradnoise: {message(fresh)}", stacklevel=4)

    # Finiteness -----------------------------------------------------------------

    def finite(self, tensors: Sequence[torch.Tensor]):
        """Whether every element of ``tensors`` is finite: a bool on the host, else a 0-dim tensor.

        Every quantity of a step asks about the same ``param.grad`` (and shared
        savefields): each tensor is summed once per step, again only if changed
        in place (its version).
        """
        if all(_device.on_host(t) for t in tensors):
            return all(map(self._finite_on_host, tensors))
        return torch.stack([torch.isfinite(t).all() for t in tensors]).all()

    def _finite_on_host(self, tensor) -> bool:
        known = self._finite.get(id(tensor))
        if known is not None and known[0] is tensor and known[1] == tensor._version:
            return known[2]
        # NaN and inf propagate into a sum, so a finite sum proves every element
        # finite with one reduction; only a sum that overflowed needs the full test.
        finite = bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
        self._finite[id(tensor)] = (tensor, tensor._version, finite)
        return finite

    # Usable parameters ----------------------------------------------------------

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
                model not prepared by ``prepare_model``, or one whose results
                could not be computed.
        """
        if has_results is None:
            def has_results(param):
                return all(hasattr(param, field) for field in savefields)

        owner = type(quantity).__name__
        trainable = [(n, p) for n, p in named if p.requires_grad]
        no_grad = [n for n, p in trainable if p.grad is None]
        with_grad = self._without_stale([(n, p) for n, p in trainable if p.grad is not None], quantity)
        usable = [(n, p) for n, p in with_grad if has_results(p)]
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
        unsupported = [(n, p) for n, p in with_grad if n not in supported]
        if savefields:
            self._refuse_shared(owner, with_grad)
            usable = self._without_batchless(quantity, usable, examples)
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
            seen[name] = (weakref.ref(param.grad), param.grad._version)
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

    def _refuse_shared(self, owner, named):
        """Raise for parameters whose uses by several layers were not combined.

        ``prepare_model`` (and ``cgn.track``) marks the layers that hold a tied
        parameter, and their results are then summed over the uses
        (:mod:`~cockpit_gradnoise.extensions.tied`); a model extended by
        ``backpack.extend`` alone keeps the result of the use reached last.

        Raises:
            ValueError: For such parameters, and for those whose results the
                backward pass could not compute (``facts.refusals``: an
                embedding applied without the batch dimension whose output
                meets the batch elsewhere than in an addition, a tied
                parameter used by an unsupported layer), naming them.
        """
        refused = {n: self.facts.refusals[id(p)] for n, p in named if id(p) in self.facts.refusals}
        if refused:
            reasons = "; ".join(f"{n!r}: {why}" for n, why in refused.items())
            raise ValueError(
                f"{owner}: no exact per-example results for parameters "
                f"{sorted(refused)}: {reasons} (see docs/architectures.md)"
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

    def _without_batchless(self, quantity, named, examples):
        """``named`` without parameters of layers applied without the batch dimension."""
        leading = self.facts.leading_sizes
        sizes = [leading[id(p)] for _, p in named if id(p) in leading]
        if examples is None or not sizes:
            return named
        # Most layers see the batch: a count in info that disagrees with them is wrong.
        check_example_count(max(set(sizes), key=sizes.count), examples)
        batchless = {n: leading[id(p)] for n, p in named if leading.get(id(p), examples) != examples}
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
        return [(n, p) for n, p in named if n not in batchless]

    # Distributed training -------------------------------------------------------

    def reduced_sums(self, quantity, params):
        """``(global Batch, {name: reduced sums})`` of ``quantity``, or ``None`` (skipped).

        The first quantity of the call to ask forms the local sums of every
        quantity that joined the call (:meth:`begin`) and reduces them all in
        one round of collectives
        (:func:`~cockpit_gradnoise.distributed.reduce_step`); the others take
        their results, so no collective runs after the first quantity. A
        quantity that did not join reduces alone.
        """
        if quantity not in self._members:
            return self._reduce([quantity], params)[quantity]
        if self._reduced is None:
            self._reduced = {}  # taken, also if the reduction raises
            self._reduced = self._reduce(self._members, params)
        return self._reduced.pop(quantity, None)

    def _reduce(self, quantities, params):
        # Fixed by the model and the quantities, so the header has one length everywhere.
        slots = [(q, name) for q in quantities for name, _ in q.trainable(params)]
        contribution = distributed.Contribution(
            slots=[f"{type(q).__name__}:{name}" for q, name in slots]
        )
        parts = {}
        try:
            for q in quantities:
                parts[q] = q.step_sums(self, params)
            batches = [part[0] for part in parts.values() if part is not None]
            if any(not b.same_as(batches[0]) for b in batches):
                raise ValueError(
                    f"the quantities read different batches from info at step "
                    f"{self.global_step}: {batches}; pass consistent 'batch_size', "
                    "'individual_losses' and 'loss'"
                )
            if batches:
                contribution.examples = batches[0].examples
                contribution.scale = batches[0].loss_scale
            contribution.sums = [
                (sums[sum_name], how)
                for q, part in parts.items()
                if part is not None
                for sums in part[1].values()
                for sum_name, how in q.sums.items()
            ]
        except Exception as error:  # every process must still take part, to raise together
            contribution.error, contribution.sums = error, []
        contribution.available = [
            parts.get(q) is not None and name in parts[q][1] for q, name in slots
        ]
        device = params[0].device if params else torch.device("cpu")
        reduced = distributed.reduce_step(contribution, device, self.global_step)
        batch = Batch(reduced.examples, reduced.scale)
        values = iter(reduced.sums)
        results = {}
        for q, part in parts.items():
            if part is None:
                results[q] = None
                continue
            sums = {name: {sum_name: next(values) for sum_name in q.sums} for name in part[1]}
            results[q] = (batch, sums)
        return results
