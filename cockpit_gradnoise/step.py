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
- under distributed training, the quantities whose declared sums reduce in
  one round of collectives (:attr:`Step.members`,
  :func:`~cockpit_gradnoise.quantities._sums.reduced_sums`).

Which parameters have usable results is checked by its part
:class:`~cockpit_gradnoise.step_checks.ParameterChecks`.

Where it lives: in Cockpit's own storage of the call's ``info``
(``CockpitCTX.INFO``, a dict that Cockpit replaces when the call ends), under
a key no step number can take. So a Step lives exactly as long as its call,
and no module of this package holds one.
"""

import contextlib
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, accumulation, functional
from cockpit_gradnoise._compat import import_cockpit
from cockpit_gradnoise.extensions import facts as backward_facts
from cockpit_gradnoise.step_checks import (
    ParameterChecks,
    check_batch_size,
    check_individual_losses,
    version_of,
    whole_loss,
)

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


#: :meth:`Step.finite_each` on the CPU checks tensors of at most this many elements together
#: (joined, one sum): below it a tensor's own check costs more in calls than joining it.
FINITE_TOGETHER_AT_MOST = 1 << 14


def backward_failed() -> bool:
    """Whether the cockpit's context is being left because of an exception.

    Cockpit runs its quantities in ``__exit__`` even when ``loss.backward()``
    raised; the exception is then the one being handled.
    """
    return sys.exc_info()[1] is not None


def _name(owner) -> str:
    return owner if isinstance(owner, str) else type(owner).__name__


class Step(ParameterChecks):
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
        #: Quantities whose declared sums reduce together under distributed training.
        self.members: List[Any] = []
        #: ``{quantity: (global Batch, reduced sums)}`` once the members' sums are
        #: reduced (:func:`~cockpit_gradnoise.quantities._sums.reduced_sums`).
        self.reduced: Optional[Dict[Any, Any]] = None
        #: ``{savefield: [quantities]}``: which quantities of the call read each savefield
        #: (those that began it, :meth:`begin`); one alone may overwrite what it read.
        self.readers: Dict[str, List[Any]] = {}
        self._loss_batch: Optional[Batch] = None
        self._declared: Optional[Batch] = None  # the front door's (begin)
        # Whether the declared batch's losses are finite: a bool, or a 0-dim tensor not read yet.
        self._losses_finite: Any = True
        self._deferring = False
        self._finite: Dict[int, Tuple[torch.Tensor, int, Any]] = {}  # bool, or a device's witness
        self._finite_answers: Dict[Tuple[int, ...], Tuple[List[torch.Tensor], torch.Tensor]] = {}
        self._shown: set = set()
        self._micro: Any = self  # not read yet (None: no accumulation)
        self._checked_gradients = False
        self._held_before: Optional[list] = None  # (name, param, grad, version) held then
        #: Whether ``param.grad`` held gradients before this backward pass, outside
        #: accumulation or at its first micro-batch (:meth:`check_earlier_gradients`).
        self.earlier_gradients = False
        #: ``{savefield: {id of an FSDP2 sharded parameter: note}}``: the parameters whose
        #: savefield was reduce-scattered inside this backward pass, each process keeping its
        #: rows (``DeclaredSums.arm_reduction_in_backward``), with what was noted before.
        self.presharded: Dict[str, Dict[int, Any]] = {}
        #: Results of checks that several quantities make of the same tensors in this call
        #: (``quantities._shared_checks``: the underflow check of one savefield's sums).
        self.shared_checks: Dict[Any, Any] = {}

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
        if quantity is not None and quantity not in step.members:
            step.members.append(quantity)
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
        loss = whole_loss(self.info("loss", owner))  # loss_parallel()'s: a replicated DTensor
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
                              version_of(named[i][1].grad)) for i in held]

    def warn_earlier_gradients(self, quantity, names: Optional[Dict[int, str]] = None):
        """After the backward pass: warn once, naming the fix, if it added to gradients held before.

        Gradients held before that it left alone (a replaced module's
        parameters) are the stale gradients of :meth:`usable`, told apart there.
        ``names``: ``{id(param): name}`` for those checked before their names were known
        (the first call, :func:`~cockpit_gradnoise.accumulation.parameters_reached`).
        """
        if not self._held_before:
            return
        names = names or {}
        added = [name if name is not None else names.get(id(param))
                 for name, param, grad, version in self._held_before
                 if param.grad is not grad or version_of(grad) != version]
        added = [name for name in added if name is not None]
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
        if all(map(_device.on_host, tensors)):
            return all(map(self._finite_on_host, tensors))
        if not all(t.is_floating_point() for t in tensors):
            return torch.stack([torch.isfinite(t).all() for t in tensors]).all()
        witnesses = [self._finite_witness(t) for t in tensors]
        key = tuple(map(id, witnesses))  # the witnesses are kept alive with the answer
        known = self._finite_answers.get(key)
        if known is not None:  # another quantity asked about the same tensors, unchanged
            return known[1]
        # Witnesses are at most 2**128 times a tensor's size: their sum is finite iff each is.
        total = witnesses[0] if len(witnesses) == 1 else torch.stack(witnesses).sum()
        answer = total.sub(total).eq(0)  # x - x is 0 iff x is finite (NaN for inf and NaN)
        self._finite_answers[key] = (witnesses, answer)
        return answer

    def finite_each(self, groups: Sequence[Sequence[torch.Tensor]]) -> List:
        """:meth:`finite` of each group of tensors (a parameter's gradient and savefields).

        On other devices all groups at once: the witnesses of the tensors not asked
        about before by one ``torch._foreach_norm`` (fused on a GPU), and one sum per
        group of equal size, a few kernels for the whole network instead of a handful
        per parameter. The same answers as :meth:`finite`, and remembered as its are.
        """
        sizes = {len(group) for group in groups}
        devices = {t.device for group in groups for t in group}  # one stack: one device (not model parallel)
        # On the CPU one by one (a 0-dim op costs microseconds there, and a quantity may
        # have proved some finite already: Step.note_finite).
        if len(sizes) != 1 or len(devices) != 1 or _device.on_host(groups[0][0]) \
                or not all(t.is_floating_point() for group in groups for t in group):
            self._prove_small_finite_together([t for group in groups for t in group])
            return [self.finite(group) for group in groups]
        self._prefetch_witnesses([t for group in groups for t in group])
        witnesses = [[self._finite_witness(t) for t in group] for group in groups]
        keys = [tuple(map(id, group_witnesses)) for group_witnesses in witnesses]
        answers = [self._finite_answers.get(key, (None, None))[1] for key in keys]
        asked = [i for i, answer in enumerate(answers) if answer is None]
        if asked:
            # Witnesses are at most 2**128 times a tensor's size: their sum is finite iff each is.
            totals = torch.stack([w for i in asked for w in witnesses[i]]).reshape(len(asked), -1).sum(dim=1)
            for i, answer in zip(asked, totals.sub(totals).eq(0).unbind()):
                answers[i] = answer
                self._finite_answers[keys[i]] = (witnesses[i], answer)
        return answers

    def _prove_small_finite_together(self, tensors: Sequence[torch.Tensor]) -> None:
        """On the CPU, the tensors of at most :data:`FINITE_TOGETHER_AT_MOST` elements not known
        yet (a network's biases and norms' weights, the per-example norms), of each floating
        dtype, joined and summed once: where that sum is finite, each of them is (NaN and inf
        propagate into a sum), and is remembered so (:meth:`finite` does not sum it again);
        otherwise each is left to :meth:`_finite_on_host`, one by one. A few calls for all
        instead of a few per tensor."""
        fresh: Dict[torch.dtype, Dict[int, torch.Tensor]] = {}
        for tensor in tensors:
            if type(tensor) is not torch.Tensor or tensor.numel() > FINITE_TOGETHER_AT_MOST \
                    or not tensor.is_floating_point() or not _device.on_host(tensor):
                continue  # a subclass (DTensor) or a large tensor: checked alone
            known = self._finite.get(id(tensor))
            if known is None or known[0] is not tensor or known[1] != tensor._version:
                fresh.setdefault(tensor.dtype, {})[id(tensor)] = tensor
        for group in fresh.values():
            if len(group) > 1 and bool(torch.isfinite(torch.cat([t.reshape(-1) for t in group.values()]).sum())):
                for tensor in group.values():
                    self._finite[id(tensor)] = (tensor, tensor._version, True)

    def _prefetch_witnesses(self, tensors: Sequence[torch.Tensor]) -> None:
        """:meth:`_finite_witness` of each tensor not known yet, for all at once: one
        ``torch._foreach_norm`` (``sum_j |t_j|`` in float64, fused on a GPU) instead of a
        reduction per tensor. Finite iff every element is, as the float64 sum of
        :meth:`_finite_witness`: it cannot overflow below ``2**1024 / 2**128`` elements of
        float32 or narrower; float64 tensors are taken times 0 first (finite elements
        become 0, the others NaN). Float64 tensors over ``CHUNK`` elements are left to
        :meth:`_finite_witness`, one by one (no copy of all of them at once)."""
        narrow, wide, seen = [], [], set()
        for tensor in tensors:
            known = self._finite.get(id(tensor))
            if id(tensor) in seen or (tensor.dtype == torch.float64 and tensor.numel() > _device.CHUNK) or (
                    known is not None and known[0] is tensor and known[1] == tensor._version
                    and isinstance(known[2], torch.Tensor)):
                continue
            seen.add(id(tensor))
            (wide if tensor.dtype == torch.float64 else narrow).append(tensor)
        if not narrow and not wide:
            return
        zeros = list(torch._foreach_mul(wide, 0)) if wide else []
        for tensor, witness in zip(narrow + wide, torch._foreach_norm(narrow + zeros, 1, dtype=torch.float64)):
            self._finite[id(tensor)] = (tensor, tensor._version, witness)

    def _finite_witness(self, tensor) -> torch.Tensor:
        """A float64 0-dim tensor on ``tensor``'s device, finite iff every element of ``tensor`` is.

        For the paths of other devices, where each small op is a kernel launch:
        one reduction per tensor and step instead of ``isfinite(t).all()``'s five
        (``isfinite`` is ``t == t`` times ``t.abs() != inf``), and none again for a
        tensor another quantity asked about (unless changed in place: its version).
        Exact: NaN and inf propagate into a sum; a float64 sum of float32 (or
        narrower) values cannot overflow (below ``2**1024 / 2**128`` elements), and
        ``t * 0`` turns a float64 tensor's finite elements into zeros, whose sum is 0.
        """
        known = self._finite.get(id(tensor))
        if known is not None and known[0] is tensor and known[1] == tensor._version \
                and isinstance(known[2], torch.Tensor):
            return known[2]
        if tensor.dtype == torch.float64:
            witness = tensor.mul(0).sum()
        else:
            witness = tensor.sum(dtype=torch.float64)
        self._finite[id(tensor)] = (tensor, tensor._version, witness)
        return witness

    def _finite_on_host(self, tensor) -> bool:
        known = self._finite.get(id(tensor))
        if known is not None and known[0] is tensor and known[1] == tensor._version:
            return known[2]
        # NaN and inf propagate into a sum, so a finite sum proves every element
        # finite with one reduction; only a sum that overflowed needs the full test.
        finite = bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
        self._finite[id(tensor)] = (tensor, tensor._version, finite)
        return finite

    def note_finite(self, tensor: torch.Tensor) -> None:
        """Every element of ``tensor`` (on the host) is finite, as a quantity proved (a finite
        float64 sum of its squares): :meth:`finite` does not sum it again, unless it changes."""
        self._finite[id(tensor)] = (tensor, tensor._version, True)
