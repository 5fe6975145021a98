"""``torch.compile`` through the front door: a compiled model has the numbers of the uncompiled
one, graphs compiled without the package's hooks are never reused, and the hooks stay in Python."""

import copy

import cockpit_gradnoise as cgn

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn


def test_a_compiled_model_is_tracked_through_the_module_it_wraps():
    """The recipe of docs/training-setups.md."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    twin = copy.deepcopy(plain)
    # The eager backend: dynamo's graphs and breaks, without compiling kernels.
    compiled = torch.compile(plain, backend="eager")
    model, tracker = cgn.track(compiled, every=1, quantities=["PerExampleGradNorm"])
    assert model is compiled
    assert tracker.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    _, by_hand = cgn.track(twin, every=1, quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for tracked, net in ((tracker, model), (by_hand, twin)):
        with tracked(0, F.cross_entropy(net(x), y, reduction="none")) as loss:
            loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert list(got["param"].astype(str)) == list(expected["param"].astype(str))
    # The eager backend runs the same operations: equal up to float64 rounding of
    # norms of at most 25 products (2 N eps relative bounds it).
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=2 * 25 * 2.0**-52, atol=0)


@pytest.mark.parametrize("order", ["compiled untracked copy first", "tracked, then compiled"])
def test_a_graph_compiled_without_the_hooks_is_never_reused_for_the_tracked_model(order):
    """TorchDynamo does not guard on module hooks by default: a graph compiled for
    another instance of the class (an untracked copy, an EMA model) would run the
    tracked one without its hooks; ``prepare_model`` makes it guard on them."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    twin, untracked = copy.deepcopy(plain), copy.deepcopy(plain)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    other = torch.compile(untracked, backend="eager")
    if order == "compiled untracked copy first":
        F.cross_entropy(other(x), y).backward()
        model, tracker = cgn.track(torch.compile(plain, backend="eager"), every=1,
                                   quantities=["PerExampleGradNorm"])
    else:
        model, tracker = cgn.track(plain, every=1, quantities=["PerExampleGradNorm"])
        F.cross_entropy(other(x), y).backward()
        model = torch.compile(model, backend="eager")
    _, by_hand = cgn.track(twin, every=1, quantities=["PerExampleGradNorm"])
    for step in range(2):
        for tracked, net in ((tracker, model), (by_hand, twin)):
            net.zero_grad()
            with tracked(step, F.cross_entropy(net(x), y, reduction="none")) as loss:
                loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=2 * 25 * 2.0**-52, atol=0)


def _compiled_gpt_step(model, tracker, tokens, targets):
    from experiments.models import TokenCrossEntropy

    model.zero_grad()
    with tracker(0, TokenCrossEntropy("none")(model(tokens), targets)) as loss:
        loss.backward()


def test_a_compiled_gpt_with_expanded_positions_has_the_numbers_of_the_uncompiled_one():
    """``aot_eager``: TorchDynamo's graphs with AOT autograd's backward (its
    ``CompiledFunctionBackward`` hides each graph's additions from the autograd walk),
    no kernels compiled. Positions ``arange(T).expand(B, T)`` are per example by their
    stride-0 batch dimension. The package's hooks run eagerly (no recompilation per module).

    AOT autograd decomposes operations (layer_norm, softmax) into others: float64
    results may differ by the rounding of the O(100) operations on a path, a few
    hundred ulps; 1e-10 relative is far above that and far below any real error."""
    from experiments.models import GPT

    torch.manual_seed(0)
    plain = GPT(11, 4, width=8, heads=2, layers=1).double()
    twin = copy.deepcopy(plain)
    tokens, targets = torch.randint(0, 11, (4, 4)), torch.randint(0, 11, (4, 4))  # B = T
    model, tracker = cgn.track(torch.compile(plain, backend="aot_eager"), every=1)
    _compiled_gpt_step(model, tracker, tokens, targets)
    _, by_hand = cgn.track(twin, every=1)
    _compiled_gpt_step(twin, by_hand, tokens, targets)
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=1e-10, atol=0)


def test_a_compiled_nanogpt_has_the_numbers_of_the_uncompiled_one():
    """nanoGPT's ``wpe(arange(T))`` (no batch dimension) under ``aot_eager``: the addition
    to the batch is found in the autograd graph as without compile; bound as above."""
    from tests.cases import nanogpt

    torch.manual_seed(0)
    plain = nanogpt().double()
    twin = copy.deepcopy(plain)
    model, tracker = cgn.track(torch.compile(plain, backend="aot_eager"), every=1)
    _, by_hand = cgn.track(twin, every=1)
    tokens = torch.randint(0, 11, (3, 4))
    for net, tracked in ((model, tracker), (twin, by_hand)):
        with tracked(0, F.cross_entropy(net(tokens).transpose(1, 2), tokens,
                                        reduction="none").mean(1)) as loss:
            loss.backward()
    got, expected = tracker.frame(), by_hand.frame()
    assert len(got) == len(expected) > 0
    numpy.testing.assert_allclose(got["value"], expected["value"], rtol=1e-10, atol=0)


def test_torch_compile_leaves_the_package_s_hooks_to_python():
    """TorchDynamo would compile a hook's frame once per module (its name and module are
    constants there) until its cache limit; the hooks' frames get no compiled entry."""
    from cockpit_gradnoise.extensions import hooks

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model, tracker = cgn.track(torch.compile(net, backend="eager"), every=1,
                               quantities=["PerExampleGradNorm"])
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    with tracker(0, F.cross_entropy(model(x), y, reduction="none")) as loss:
        loss.backward()
    assert len(tracker.frame()) > 0
    for code in (hooks._store_call.__code__, hooks.eager_under_compile._call.__code__):
        assert _debug_get_cache_entry_list(code) == []

