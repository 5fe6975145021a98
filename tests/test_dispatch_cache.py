"""What the hooks' dispatch decides once is never served stale, and what it reads per call follows each step.

Decided once (:mod:`cockpit_gradnoise.extensions`, :mod:`~cockpit_gradnoise.extensions.direct`):
the rule of a layer's class per extension instance, until a row of its table is replaced;
whether a rule class runs through BackPACK's generic ``ModuleExtension.__call__`` (then
its parameter methods are called directly, without the generic steps); the check that
the active extensions are first-order, once per ``backpack(...)``. Read at every call:
which parameters exist and require a gradient, the layer's mode, the dtypes and shapes of
its input and output gradient. Each test changes one of these between backward passes of
one prepared model, and compares with a float64 per-example loop on an un-extended copy.
"""

import copy

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import (
    BATCH_L2_SAVEFIELD,
    PerExampleSquaredNorms,
    facts,
    linear,
    override_module_extensions,
)

import pytest
import torch
from backpack import backpack
from backpack.extensions import DiagGGNExact
from backpack.extensions.module_extension import ModuleExtension
from torch import nn

#: float64 rules against a float64 loop: the same sums of a few dozen products in
#: another order, off by a few units of 2**-53 (1.1e-16) relative.
RTOL64 = 1e-10
#: float32 layers against the float64 loop: the float32 forward and backward pass the
#: rules read (activations and output gradients through 3 layers) carry a relative
#: error of some tens of float32 units (6e-8); 1e-4 is over 1000 of them.
RTOL32 = 1e-4


class Sub(nn.Linear):
    """A subclass of a table's class (its rule derived once, :mod:`.subclasses`)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), Sub(5, 3)).double()


def _loss(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="sum")


def _brute_force(model: nn.Module, x, y) -> dict:
    """``{name: ||g_i||^2}`` of the trainable parameters, one example at a time, float64."""
    model = copy.deepcopy(model).double()
    norms = {name: [] for name, p in model.named_parameters() if p.requires_grad}
    for i in range(len(x)):
        model.zero_grad()
        _loss(model(x[i : i + 1].double()), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                norms[name].append(p.grad.pow(2).sum())
    return {name: torch.stack(values) for name, values in norms.items()}


def _backward(prepared: nn.Module, extension, x, y) -> dict:
    """``{name: saved squared norms}`` of one backward pass (none kept from earlier ones)."""
    for p in prepared.parameters():
        if hasattr(p, BATCH_L2_SAVEFIELD):
            delattr(p, BATCH_L2_SAVEFIELD)
    facts.begin()
    with backpack(extension):
        _loss(prepared(x), y).backward()
    return {name: getattr(p, BATCH_L2_SAVEFIELD) for name, p in prepared.named_parameters()
            if hasattr(p, BATCH_L2_SAVEFIELD)}


def _assert_exact(got: dict, expected: dict, rtol: float):
    assert set(got) == set(expected)
    for name, norms in expected.items():
        torch.testing.assert_close(got[name].double(), norms, rtol=rtol, atol=0, msg=name)


def _data(batch: int, positions=None, dtype=torch.float64):
    shape = (batch, 4) if positions is None else (batch, positions, 4)
    return torch.randn(*shape, dtype=dtype), torch.randint(0, 3, shape[:-1])


def test_frozen_unfrozen_parameters_shapes_and_dtypes_changing_between_steps():
    torch.manual_seed(1)
    plain = _model()
    prepared = cgn.prepare_model(copy.deepcopy(plain))
    extension = PerExampleSquaredNorms()  # one instance for all steps, as a cockpit keeps it

    def first_bias_trainable(flag: bool):
        for model in (plain, prepared):
            model[0].bias.requires_grad_(flag)

    steps = [
        ("all trainable", lambda: None, _data(6), RTOL64),
        ("bias of the first layer frozen", lambda: first_bias_trainable(False), _data(6), RTOL64),
        ("unfrozen", lambda: first_bias_trainable(True), _data(6), RTOL64),
        ("sequences", lambda: None, _data(3, positions=5), RTOL64),  # the Linear rules' other path
        ("another batch size", lambda: None, _data(2), RTOL64),
        ("float32", lambda: (plain.float(), prepared.float()), _data(5, dtype=torch.float32), RTOL32),
        ("float64 again", lambda: (plain.double(), prepared.double()), _data(4), RTOL64),
    ]
    for what, change, (x, y), rtol in steps:
        change()
        got = _backward(prepared, extension, x, y)
        assert ("0.bias" in got) is (what != "bias of the first layer frozen"), what
        _assert_exact(got, _brute_force(plain, x, y), rtol)


def test_the_mode_is_read_at_every_call():
    """A BatchNorm in training mode mixes the examples: recorded at each pass it runs so."""
    prepared = cgn.prepare_model(nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), Sub(5, 3)).double())
    extension = PerExampleSquaredNorms()
    for training in (False, True, False, True):
        prepared.train(training)
        _backward(prepared, extension, *_data(6))
        assert facts.recording().examples_interact is training


class CountingRule(linear.SquaredNormsLinear):
    """The Linear rule, counting the weights it computed (BackPACK's generic ``__call__``:
    the dispatch calls its ``weight`` directly)."""

    def __init__(self):
        super().__init__()
        self.weights = 0

    def weight(self, *args):
        self.weights += 1
        return super().weight(*args)


def test_a_rule_replaced_between_steps_runs_from_the_next_step():
    """The rule of a class found once per extension instance (also a subclass's, derived
    from its parent's row) is found again once a row of the table is replaced."""
    plain = _model()
    prepared = cgn.prepare_model(copy.deepcopy(plain))
    extension = PerExampleSquaredNorms()
    x, y = _data(6)
    _assert_exact(_backward(prepared, extension, x, y), _brute_force(plain, x, y), RTOL64)
    table, derived = CountingRule(), CountingRule()
    override_module_extensions([extension], {PerExampleSquaredNorms: {nn.Linear: table}})
    _assert_exact(_backward(prepared, extension, x, y), _brute_force(plain, x, y), RTOL64)
    assert (table.weights, derived.weights) == (2, 0), "nn.Linear's and Sub's rows derived from it"
    override_module_extensions([extension], {PerExampleSquaredNorms: {Sub: derived}})
    _assert_exact(_backward(prepared, extension, x, y), _brute_force(plain, x, y), RTOL64)
    assert (table.weights, derived.weights) == (3, 1)


class GenericCallRule(linear.SquaredNormsLinear):
    """The same rule run through BackPACK's ``ModuleExtension.__call__`` itself."""

    def __call__(self, *args):
        return ModuleExtension.__call__(self, *args)


def test_a_rule_called_directly_gives_what_backpacks_call_gives():
    """The same parameter methods with the same arguments in the same order: the same
    kernels, so the same numbers bit for bit (which a change of arguments would break)."""
    prepared = cgn.prepare_model(_model())
    x, y = _data(6, positions=3)
    direct = _backward(prepared, PerExampleSquaredNorms(), x, y)
    through_backpack = PerExampleSquaredNorms()
    override_module_extensions([through_backpack], {PerExampleSquaredNorms: {
        nn.Linear: GenericCallRule(), Sub: GenericCallRule()}})
    generic = _backward(prepared, through_backpack, x, y)
    assert set(direct) == set(generic) == {name for name, _ in prepared.named_parameters()}
    for name, norms in direct.items():
        assert torch.equal(norms, generic[name]), name


def test_a_second_order_extension_is_refused_after_first_order_passes():
    """The first-order check is made once per ``backpack(...)`` (its tuple of extensions),
    never carried over to the next one."""
    prepared = cgn.prepare_model(_model())
    x, y = _data(4)
    _backward(prepared, PerExampleSquaredNorms(), x, y)
    with pytest.raises(RuntimeError, match="DiagGGNExact is a second-order"):
        with backpack(DiagGGNExact()):
            _loss(prepared(x), y).backward()
    _backward(prepared, PerExampleSquaredNorms(), x, y)  # and first-order again
