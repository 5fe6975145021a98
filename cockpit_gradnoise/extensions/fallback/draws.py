"""The batch's random draws, replayed where a module is run again on each example alone.

In training mode a module's forward may draw random numbers: dropout, drop path (timm's BEiT
and EVA-02 around their class token and position table, XLNet's dropout inside its
sequence-first block). Example ``i`` run alone draws other numbers than the batch's pass drew
for it, so its recomputed gradient is not its contribution to ``param.grad``. Replayed, it is:
with ``m`` the batch's draws and ``m_i`` example ``i``'s part of them,

.. math::

    x_i(\\theta) = \\Big(\\frac{\\partial f(a_i; \\theta, m_i)}{\\partial \\theta}\\Big)^{\\top} G_i ,

the per-example vector-Jacobian product of the module's docstring (:mod:`.blocks`) with the
masks the forward pass used.

How. The random state at the start of each call in training mode is kept (:func:`snapshot`, in
the modules' forward pre-hooks: a copy of the CPU generator's 5 kB state, and the CUDA
generators' of the devices its inputs are on). The batch's pass itself runs as it would without
the package: nothing is recorded there. Where the recomputation meets random numbers, the
module runs once more on the batch from that state (:func:`record`), under a dispatch mode that
keeps the result of every random ATen operation (the ones tagged ``nondeterministic_seeded``:
``bernoulli_`` of dropout on CPU and of timm's drop path, ``native_dropout`` on GPU, ``rand``,
...). Its output must equal the forward pass's (to rounding: :func:`.precision.rounding_bound`),
or the state did not give the batch's draws and the module is refused. Each draw is kept with
its place: the innermost module call running it and its ordinal there (:class:`_Where`). Then
each example alone, in order, runs under :class:`Replaying`: a random operation's result is
overwritten by the example's part of the batch's draw at the same place (:class:`Replay`): the
next rows along the one dimension whose size differs (XLNet's sequence-first masks ``[T, N, C]``
along their second; OPT's flattened tokens ``[N * T, C]`` a block of ``T``; the rows routed to
one of Switch Transformers' experts, as many as the example's tokens routed there; an example
skips the draws of an expert none of its tokens reached), and the example's output must equal
its row of the batch's (:func:`.blocks.per_example_gradients` checks it: a mask whose rows are
not the examples', ``rand(N).flip(0)`` or rows gathered token-major, fails there); after the
last example every draw of the batch must have been handed out, whole or to its last row.

Refused by name, never replayed approximately: a random tensor whose rows the examples alone
do not take exactly (``rand(N + 1, C)``), one whose sizes differ in more than one dimension,
random operations at another place or in another number alone than in the batch, a fused
kernel that draws inside (flash attention with dropout on a GPU: its draws are not its result),
a generator on another device than CPU and CUDA.

Under ``torch.func.vmap`` nothing is replayed: its random operations raise (randomness
``"error"``), and the per-example loop runs instead (one forward and backward pass per example:
the recomputation of a module with draws costs ``N`` passes of it, plus one on the batch).
"""

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from cockpit_gradnoise.extensions import precision

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode


class Unreplayable(Exception):
    """The batch's draws cannot be handed to each example (its message says why)."""


@dataclass
class Snapshot:
    """The random state at the start of a call: the CPU generator's and the CUDA ones'."""

    cpu: Tensor
    cuda: Dict[int, Tensor] = field(default_factory=dict)


def snapshot(values) -> Optional[Snapshot]:
    """The random state now, for the devices of the tensors among ``values`` (a call's
    arguments; ``None`` where one is on another device than CPU or CUDA: its generator is not
    restored). A CUDA generator not found there is not kept: a draw on it then makes the
    recording's output differ, and the module is refused (:func:`record`)."""
    cuda = set()
    for value in values:
        if isinstance(value, Tensor):
            kind = value.device.type
            if kind == "cuda":
                cuda.add(value.device.index or 0)
            elif kind != "cpu":
                return None
    return Snapshot(torch.get_rng_state(), {k: torch.cuda.get_rng_state(k) for k in sorted(cuda)})


@contextlib.contextmanager
def restored(state: Snapshot):
    """The random state of ``state`` inside the block; the one before it afterwards."""
    with torch.random.fork_rng(devices=list(state.cuda)):
        torch.set_rng_state(state.cpu)
        for device, value in state.cuda.items():
            torch.cuda.set_rng_state(value, device)
        yield


#: ``{operation: None (draws nothing), -1 (draws) or the position of its dropout_p}``.
_KINDS: Dict[object, Optional[int]] = {}


def _kind(func) -> Optional[int]:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    return next((k for k, argument in enumerate(func._schema.arguments) if argument.name == "dropout_p"), -1)


def _random(func, args, kwargs) -> bool:
    """Whether the operation draws random numbers: tagged so, and not given a ``dropout_p`` of
    0 (the attention kernels are tagged whatever their rate). Looked up once per operation:
    it is asked for every operation of the forward passes it watches."""
    kind = _KINDS.get(func, False)
    if kind is False:
        kind = _KINDS[func] = _kind(func)
    if kind is None or kind < 0:
        return kind is not None
    default = func._schema.arguments[kind].default_value
    return kwargs.get("dropout_p", args[kind] if kind < len(args) else default) != 0


def _drawn(func, args, result) -> Tensor:
    """The random tensor of one random operation: ``self`` of an in-place one, the mask of
    ``native_dropout``, the result of another with one tensor result."""
    if func._schema.name == "aten::native_dropout":
        return result[1]
    if func._schema.is_mutable and args and isinstance(args[0], Tensor):
        return args[0]
    if isinstance(result, Tensor):
        return result
    raise Unreplayable(f"its forward calls {func}, which draws inside (its draws are not its result)")


class _Where:
    """Where each random operation runs: the innermost module call (the module, its call's
    ordinal in this forward pass) and the operation's ordinal in that call, kept by global
    forward hooks while the forward runs. An example alone skips the draws of a module its
    rows do not reach (an expert no token of it was routed to), so its draws are matched to
    the batch's by this place, not by their order."""

    def __init__(self):
        self.stack: List[list] = []
        self.calls: Dict[int, int] = {}
        self.handles: list = []

    def __enter__(self):
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                        nn.modules.module.register_module_forward_hook(self._leave)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args):
        ordinal = self.calls.get(id(module), 0)
        self.calls[id(module)] = ordinal + 1
        self.stack.append([id(module), ordinal, 0])

    def _leave(self, module, args, output):
        self.stack.pop()

    def place(self) -> Tuple[int, int, int]:
        """The place of the random operation running now (the next one in its call)."""
        if not self.stack:
            self.stack.append([0, 0, 0])  # outside any module call
        top = self.stack[-1]
        top[2] += 1
        return top[0], top[1], top[2] - 1


class _Recording(TorchDispatchMode):
    """Keeps a copy of the random tensor of each random operation, in order (a copy: drop
    path divides its mask in place afterwards), with its place (:class:`_Where`)."""

    def __init__(self, where: _Where):
        super().__init__()
        self.where = where
        self.draws: List[Tuple[object, Tensor, Tuple[int, int, int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _random(func, args, kwargs):
            self.draws.append((func, _drawn(func, args, result).clone(), self.where.place()))
        return result


def record(module: nn.Module, args: tuple, kwargs: dict, state: Snapshot, output: Tensor,
           first_tensor, autocast) -> List[Tuple[object, Tensor, Tuple[int, int, int]]]:
    """The batch's draws in ``module``'s forward on ``(args, kwargs)`` from ``state``, in
    order: ``(operation, random tensor, place)``; empty where it draws none. Call it with the
    module's hooks off and its buffers kept (:func:`.layout.state_kept`).

    Raises:
        Unreplayable: Its output from ``state`` is not ``output``, the forward pass's.
    """
    where = _Where()
    recording = _Recording(where)
    with restored(state), torch.enable_grad(), precision.autocast_as(autocast), where, recording:
        again = first_tensor(module(*args, **kwargs))
    if recording.draws and (again is None or again.shape != output.shape or not float(
            (again.detach() - output).abs().max()) <= precision.rounding_bound(output)):
        raise Unreplayable(
            "its forward pass run again from the random state of its call drew other numbers "
            "than the batch's pass (its output differs), so the batch's draws are not known")
    return recording.draws


class Replay:
    """The batch's draws handed to its examples, run alone one after another (``0, 1, ...``).

    Example ``i``'s part of the batch's random tensor, where the example alone draws one of
    shape ``alone`` at the same place (:class:`_Where`):

    - The whole tensor where both shapes are equal: its size does not depend on the batch, so
      the batch drew it once and every example used all of it (timm's relative-position MLP
      dropout). Each example alone is handed the same tensor.
    - Else the one dimension ``d`` where the sizes differ (all others equal): the next
      ``alone[d]`` rows along it, after those the examples before it took. That is the slice
      along a dimension of size ``N`` in the batch and 1 alone, the rows of a batch flattened
      example-major (``[N * T, C]``, OPT's dropout on its flattened tokens: block ``i`` of
      ``T`` rows), and the rows routed to one expert (Switch Transformers' experts' dropout:
      each example's tokens routed to it, in the batch's token order, example after example).

    Each example's output alone is then checked against its row of the batch's
    (:func:`.blocks.per_example_gradients`): another map of rows to examples (flattened
    token-major, rows handed to other examples) changes the output and is refused there; and
    after the last example every random tensor the batch drew must have been handed out
    (:meth:`finished`): whole, or its rows taken exactly to the end.
    """

    def __init__(self, draws: List[Tuple[object, Tensor, Tuple[int, int, int]]], examples: int):
        self.draws, self.examples = draws, examples
        self.at = {place: k for k, (_, _, place) in enumerate(draws)}
        self.taken: Dict[int, Tuple[int, int]] = {}  # k -> (dimension, rows taken so far)
        self.whole: set = set()

    def part(self, k: int, alone: torch.Size) -> Tensor:
        """The next example's part of the ``k``-th draw, where it draws one of shape ``alone``."""
        drawn = self.draws[k][1]
        if tuple(drawn.shape) == tuple(alone):
            self.whole.add(k)
            return drawn
        differ = [d for d, (n, one) in enumerate(zip(drawn.shape, alone)) if n != one]
        dimension, start = self.taken.get(k, (differ[0] if differ else 0, 0))
        if drawn.dim() != len(alone) or differ != [dimension] \
                or start + alone[dimension] > drawn.shape[dimension]:
            raise Unreplayable(
                f"a random tensor ({list(drawn.shape)} for {self.examples} examples, {list(alone)} "
                "for one) has no dimension of the examples (nor a flattened one)")
        self.taken[k] = (dimension, start + alone[dimension])
        return drawn.narrow(dimension, start, alone[dimension])

    def finished(self):
        """After the last example: every draw handed out, whole or to its last row.

        Raises:
            Unreplayable: One was not, or was both.
        """
        for k, (_, drawn, _) in enumerate(self.draws):
            dimension, rows = self.taken.get(k, (0, 0))
            if (k in self.whole) == (k in self.taken) or (k in self.taken and rows != drawn.shape[dimension]):
                raise Unreplayable(
                    f"a random tensor ({list(drawn.shape)} for {self.examples} examples) is not "
                    "the examples' draws alone put together (another order or number alone than "
                    "in the batch, or rows no example drew)")


class Replaying(TorchDispatchMode):
    """An example alone: each random operation's result overwritten by the example's part of
    the batch's at the same place (:meth:`Replay.part`)."""

    def __init__(self, replay: Replay):
        super().__init__()
        self.replay, self.where = replay, _Where()

    def __enter__(self):
        self.where.__enter__()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not _random(func, args, kwargs):
            return result
        k = self.replay.at.get(self.where.place())
        if k is None or self.replay.draws[k][0] is not func:
            raise Unreplayable("its forward alone draws random numbers in another order or number "
                               "than in the batch")
        drawn = _drawn(func, args, result)
        drawn.copy_(self.replay.part(k, drawn.shape))
        if func._schema.name == "aten::native_dropout":  # its output from the mask, as it computes it
            p = float(args[1])
            result[0].copy_(args[0] * drawn * (1.0 / (1.0 - p) if p < 1 else 0.0))
        return result

    def __exit__(self, *exc):
        try:
            super().__exit__(*exc)
        finally:
            self.where.__exit__(*exc)


def replaying(replay: Optional[Replay]):
    """:class:`Replaying` of the next example (nothing where the batch drew nothing)."""
    return Replaying(replay) if replay is not None else contextlib.nullcontext()
