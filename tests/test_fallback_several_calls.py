"""A module with the fallback called several times in one forward pass: its calls summed per
example (``extensions/fallback/several.py``), against float64 per-example references.

Per example, the calls' contributions add before they are squared: ``||x_i||^2`` with
``x_i = sum_c x_i^(c)``, not ``sum_c ||x_i^(c)||^2``. Each test checks that the two differ
on its model, so that a sum of the calls' own results would fail it.
"""

import copy
import warnings

import cockpit_gradnoise as cgn
from cockpit_gradnoise.check import reference_contributions
from cockpit_gradnoise.extensions import LocalGradient, PerExampleSquaredNorms, SumsOfContributions, cost_model

import pytest
import torch
from backpack import backpack
from torch import nn

from tests.helpers import rows
from tests.test_fallback import Scaled

RTOL = 1e-12


def results(model, x, y, loss_fn=None):
    """The package's three results on a prepared copy: ``{name: (norms, sums, grad)}``."""
    prepared = cgn.prepare_model(copy.deepcopy(model))
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    with backpack(PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient()):
        loss_fn(prepared(x), y).backward()
    return {name: tuple(getattr(p, f, None) for f in ("cgn_batch_l2", "cgn_sums_of_contributions",
                                                       "cgn_local_grad"))
            for name, p in prepared.named_parameters()}


def assert_exact(got, expected, rtol=RTOL):
    """Each parameter's three results against the reference contributions ``[N, *shape]``."""
    assert set(got) == set(expected)
    for name, c in expected.items():
        norms, sums, grad = got[name]
        assert norms is not None, name
        for value, want in ((norms, c.square().flatten(1).sum(1)),
                            (sums, torch.stack([c.sum(0), c.square().sum(0)])), (grad, c.sum(0))):
            assert (value - want).abs().max() <= rtol * want.abs().max(), name


class ThreeCalls(nn.Module):
    """A layer scale (a keyword argument without the batch dimension, a tuple out) called three
    times, once on a sequence: the calls see the batch with different shapes."""

    def __init__(self, width=4):
        super().__init__()
        self.scale, self.mix = Scaled(width), nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):  # x: [N, T, width]
        shift = torch.full((x.shape[-1],), 0.1, dtype=x.dtype)
        h = self.scale(torch.tanh(self.mix(x)), shift=shift)[0].mean(1)
        h = self.scale(torch.tanh(self.mix(h)), shift=shift)[0]
        return self.head(self.scale(h, shift=shift)[0])


def per_call_sum_of_squares_differs(model, x, y, name):
    """Whether ``sum_c ||x_i^(c)||^2`` differs from ``||sum_c x_i^(c)||^2`` (by 1e-3 relative):
    the calls' contributions do not simply add their squares here."""
    refs = reference_contributions(model, (x,), y, nn.CrossEntropyLoss())
    summed = refs[name].flatten(1).square().sum(1)
    module = model.get_submodule(name.rsplit(".", 1)[0])
    outputs = []
    handle = module.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    try:
        loss = nn.CrossEntropyLoss(reduction="sum")(model(x), y)
    finally:
        handle.remove()
    param = dict(model.named_parameters())[name]
    own = torch.zeros(len(x), dtype=x.dtype)
    for out in outputs:  # each call alone, per example: the gradient of loss_i through this call
        for i in range(len(x)):
            grad_out = torch.autograd.grad(loss, out, retain_graph=True)[0]
            mask = torch.zeros_like(grad_out)
            mask[i] = grad_out[i]
            g = torch.autograd.grad(out, param, mask, retain_graph=True)[0]
            own[i] += g.square().sum() / len(x) ** 2
    return bool(((own - summed).abs() > 1e-3 * summed.abs()).any())


@pytest.mark.parametrize("chunk", [None, 2], ids=["one-chunk", "chunks-of-2"])
def test_a_module_called_three_times_gets_its_calls_summed_per_example(chunk, monkeypatch):
    if chunk is not None:  # 5 examples = 2 + 2 + 1: the calls' chunks must line up
        monkeypatch.setattr(cost_model, "examples_per_chunk", lambda *args: chunk)
    torch.manual_seed(0)
    model = ThreeCalls().double()
    x, y = torch.randn(5, 3, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="cockpit-gradnoise")
        got = results(model, x, y)
    assert_exact(got, reference_contributions(model, (x,), y, nn.CrossEntropyLoss()))
    assert per_call_sum_of_squares_differs(model, x, y, "scale.gamma")


def test_calls_of_two_forward_passes_in_one_backward_pass_are_refused():
    """Two batches' losses backpropagated together: rows ``i`` of the two passes are other
    examples, so no per-example sum exists over them: refused, never a wrong number."""
    torch.manual_seed(0)
    prepared = cgn.prepare_model(ThreeCalls().double())
    x, y = torch.randn(4, 3, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with pytest.warns(UserWarning, match="another forward pass"):
        with backpack(PerExampleSquaredNorms()):
            (nn.functional.cross_entropy(prepared(x), y)
             + nn.functional.cross_entropy(prepared(x.flip(0)), y)).backward()
    assert getattr(prepared.scale.gamma, "cgn_batch_l2", None) is None
    assert prepared.head.weight.cgn_batch_l2 is not None


def test_the_tracker_gives_the_calls_summed_every_step():
    """Through ``cgn.track``: the norms of a module called three times equal the reference's at
    each of two steps (the calls of a step are not mixed with the last step's)."""
    torch.manual_seed(0)
    model = ThreeCalls().double()
    reference = copy.deepcopy(model)
    tracked, tracker = cgn.track(model, every=1, quantities=["PerExampleGradNorm"])
    optimizer = torch.optim.SGD(tracked.parameters(), lr=0.1)
    for step in range(2):
        x, y = torch.randn(4, 3, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
        reference.load_state_dict(tracked.state_dict())
        expected = reference_contributions(reference, (x,), y, nn.CrossEntropyLoss())
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="cockpit-gradnoise")
            losses = nn.functional.cross_entropy(tracked(x), y, reduction="none")
            with tracker(step, losses) as loss:
                loss.backward()
        optimizer.step()
        got = rows(tracker.cockpit, "PerExampleGradNorm", step)["scale.gamma"]
        norms = len(x) * expected["scale.gamma"].flatten(1).norm(dim=1)  # ||g_i|| = N ||x_i||
        assert abs(got["max"] - float(norms.max())) <= RTOL * float(norms.max()), got


def test_t5gemma2s_key_norm_called_on_its_own_and_the_encoders_keys_is_exact():
    """The real class: T5Gemma2's merged attention normalizes its own keys and the encoder's
    with one ``k_norm`` (two calls). ``T5Gemma2RMSNorm`` computes in float32 (``x.float()``)
    inside the float64 model, so the rows agree with the float64 reference to float32
    rounding of sums of a few dozen terms (measured: 1e-7 relative), 1e-5 allowed; a module
    given one call's rows, or the calls' squares summed, is off by order 1."""
    pytest.importorskip("transformers.models.t5gemma2")
    from experiments import sweep_models

    case = sweep_models.build("transformers", "t5gemma2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        frame = cgn.check_model(case.model, case.inputs, case.targets, case.loss_fn, verbose=False)
    norms = frame[frame.param.str.contains(r"decoder\.layers\.\d+\.self_attn\.k_norm")]
    assert len(norms) == 2 and norms.rows.all(), norms.note.tolist()
    assert (norms.max_rel_error < 1e-5).all(), norms.max_rel_error.tolist()
    assert frame[frame.rows].max_rel_error.max() < 1e-5
