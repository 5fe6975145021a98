"""The package's hooks (``extensions/hooks.py``): in-place operations, BERT's
``output`` submodules, memory, and BackPACK's dispatch as BackPACK runs it."""

import copy
import gc
import warnings
import weakref

import cockpit_gradnoise as cgn
from cockpit_gradnoise.extensions import PerExampleSquaredNorms, SumsOfContributions, facts
from cockpit_gradnoise.extensions.savefields import BATCH_L2_SAVEFIELD, SUMS_SAVEFIELD

import numpy
import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad, DiagGGNExact
from torch import nn

RTOL = 1e-10


def per_example_gradients(model, inputs, targets, forward=None):
    """``{name: [N, *shape]}`` by ``torch.func`` on ``model`` (not prepared), float64."""
    forward = forward or (lambda m, p, x: torch.func.functional_call(m, p, (x,)))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, x, y):
        return nn.functional.cross_entropy(forward(model, p, x[None]), y[None], reduction="sum")

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, inputs, targets)


def relative_error(got, expected):
    return ((got - expected).abs().max() / expected.abs().max()).item()


def row_errors(prepared, gradients, names):
    """Largest relative error of each parameter's sums and per-example squared norms."""
    by_name = dict(prepared.named_parameters())
    errors = {}
    for name in names:
        param, x = by_name[name], gradients[name]
        sums = getattr(param, SUMS_SAVEFIELD)
        errors[name] = max(
            relative_error(sums[0], x.sum(0)),
            relative_error(sums[1], x.square().sum(0)),
            relative_error(getattr(param, BATCH_L2_SAVEFIELD), x.flatten(1).square().sum(1)),
        )
    return errors


def tracked_backward(model, inputs, targets, forward=None, extensions=None):
    forward = forward or (lambda m, x: m(x))
    extensions = extensions or (PerExampleSquaredNorms(), SumsOfContributions())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unsupported layers: the quantities warn, not tested here
        with backpack(*extensions):
            loss = nn.functional.cross_entropy(forward(model, inputs), targets, reduction="sum")
            loss.backward()


def test_a_tensor_hook_receives_the_gradient_of_the_value_before_an_in_place_change():
    """What the hooks rely on (PyTorch's autograd notes: hooks registered before
    an in-place modification see the gradient w.r.t. the value before it)."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = x * 2
    got = []
    y.register_hook(got.append)
    y.mul_(3)  # after the hook, as `out += identity` after a layer
    y.square().sum().backward()
    # d/dy of sum((3 y)^2) = 18 y, y the value before the change; not 6 * (3 y).
    torch.testing.assert_close(got[0], 18 * (2 * x.detach()), rtol=1e-15, atol=0)


class InPlace(nn.Module):
    """In-place operations on layer outputs that BackPACK's own hooks reject."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 6)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        out = self.relu(self.first(x))
        skip = out
        out = self.second(out)
        out += skip
        return self.head(self.relu(out))


def make_in_place():
    torch.manual_seed(0)
    return InPlace().double()


def test_in_place_operations_on_layer_outputs_give_exact_rows():
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        extend(make_in_place())(torch.randn(2, 4, dtype=torch.float64))
    model = make_in_place()
    prepared = cgn.prepare_model(copy.deepcopy(model))
    assert prepared.__class__ is InPlace  # not rewritten
    inputs, targets = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    tracked_backward(prepared, inputs, targets)
    gradients = per_example_gradients(model, inputs, targets)
    errors = row_errors(prepared, gradients, [n for n, _ in model.named_parameters()])
    assert max(errors.values()) < RTOL, errors


class ModifiesInput(nn.Module):
    """Changes a layer's input in place after the layer has used it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, x):
        hidden = x * 1.0
        out = self.layer(hidden)
        hidden.add_(1.0)
        return out


def test_an_input_modified_in_place_after_the_forward_pass_is_refused_with_the_layer_named():
    model = cgn.prepare_model(ModifiesInput().double())
    inputs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"layer \(Linear\): its input 0 was modified in place"):
        tracked_backward(model, inputs, torch.tensor([0, 1, 0, 1]))


def test_second_order_extensions_are_refused_with_the_fix():
    model = cgn.prepare_model(nn.Sequential(nn.Linear(3, 2)).double())
    loss_fn = extend(nn.CrossEntropyLoss())
    with pytest.raises(RuntimeError, match=r"DiagGGNExact.*use_converter=True"):
        with backpack(DiagGGNExact()):
            loss_fn(model(torch.randn(4, 3, dtype=torch.float64)), torch.tensor([0, 1, 0, 1])).backward()


def test_prepare_model_hooks_only_modules_with_parameters_of_their_own_and_only_once():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    prepared = cgn.prepare_model(cgn.prepare_model(model))
    assert prepared is model
    counts = {name: len(module._forward_hooks) for name, module in model.named_modules()}
    # The root's one hook ends the forward pass's bookkeeping of tied uses (extensions.uses).
    assert counts == {"": 1, "0": 1, "1": 0, "2": 0, "2.0": 1}


def test_a_model_extended_by_backpack_is_returned_as_it_is():
    model = extend(nn.Sequential(nn.Linear(3, 2)))
    hooks_before = len(model[0]._forward_hooks)
    assert cgn.prepare_model(model) is model
    assert len(model[0]._forward_hooks) == hooks_before


class Recorder(BatchGrad):
    """BackPACK's BatchGrad that also records, per dispatch, what the rules saw."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self, module, g_inp, g_out):
        self.seen.append((module, module.input0.clone(), weakref.ref(module.input0), g_inp, g_out))
        super().__call__(module, g_inp, g_out)


def test_each_call_of_a_reused_layer_is_dispatched_with_its_own_input():
    layer = nn.Linear(3, 3).double()
    model = cgn.prepare_model(nn.Sequential(layer, nn.Tanh(), layer))
    inputs = torch.randn(2, 3, dtype=torch.float64)
    recorder = Recorder()
    with backpack(recorder):
        model(inputs).sum().backward()
    first_seen, second_seen = recorder.seen[1][1], recorder.seen[0][1]  # backward order
    torch.testing.assert_close(first_seen, inputs, rtol=0, atol=0)
    torch.testing.assert_close(second_seen, torch.tanh(layer(inputs)), rtol=0, atol=0)
    g_inp, g_out = recorder.seen[0][3:]
    assert g_inp == (None,) and g_out[0].shape == (2, 3)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x, *, scale):
        return x * self.weight * scale


class SeesCall(BatchGrad):
    def __call__(self, module, g_inp, g_out):
        self.call = facts.recording().call
        super().__call__(module, g_inp, g_out)


def test_rules_see_the_call_keywords_included_and_only_during_the_dispatch():
    model = cgn.prepare_model(Keywords())
    inputs = torch.randn(2, 3, dtype=torch.float64)
    extension = SeesCall()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchGrad has no rule for this module
        with backpack(extension):
            model(inputs, scale=2.0).sum().backward()
    assert extension.call.kwargs == {} and extension.call.inputs == ()  # cleared after the backward
    assert facts.recording().call is None


def test_what_the_rules_saw_is_released_after_the_backward_pass():
    """Even while the graph is kept (``retain_graph=True`` outside the backpack
    context), nothing the hooks stored stays alive."""
    model = cgn.prepare_model(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double())
    recorder = Recorder()
    loss = model(torch.randn(2, 3, dtype=torch.float64)).sum()
    with backpack(recorder):
        loss.backward(retain_graph=True)
    assert len(recorder.seen) == 2
    for module, _, stored, _, _ in recorder.seen:
        assert stored() is None
        assert not {"input0", "output"} & set(module.__dict__)
    recorder.seen.clear()
    loss.backward()  # untracked: the hooks do nothing
    assert recorder.seen == []


def test_a_forward_pass_without_backward_leaves_nothing_behind():
    """No reference cycle: the stored call goes with the graph, without the
    garbage collector, and a prepared model can be copied after any forward pass."""
    model = cgn.prepare_model(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    kept = []
    model[0].register_forward_hook(lambda module, args, output: kept.append(weakref.ref(output)))
    gc.disable()
    try:
        out = model(torch.randn(2, 3))
        copy.deepcopy(model)  # BackPACK's stored non-leaf tensors would refuse
        del out
        assert kept[0]() is None
    finally:
        gc.enable()
    assert all(not {"input0", "output"} & set(m.__dict__) for m in model.modules())


def test_a_forward_pass_inside_backpack_disable_stores_nothing():
    from backpack import disable

    model = cgn.prepare_model(nn.Sequential(nn.Linear(3, 2)).double())
    with disable():
        loss = model(torch.randn(2, 3, dtype=torch.float64)).sum()
    recorder = Recorder()
    with backpack(recorder):
        loss.backward()
    assert recorder.seen == [] and model[0].weight.grad is not None


# Hugging Face BERT: submodules called `output` -------------------------------------


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    # pad_token_id=None: nn.Embedding(padding_idx=...) is another layer's matter
    # (its rule); this test is about the hooks and the `output` submodules.
    config = BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=3, pad_token_id=None,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).double().eval()


def bert_logits(model, inputs, params=None):
    if params is None:
        return model(input_ids=inputs).logits
    return torch.func.functional_call(model, params, (), {"input_ids": inputs}).logits


def test_bert_with_output_submodules_gives_exact_rows_for_its_linear_layers():
    model = tiny_bert()
    prepared = cgn.prepare_model(copy.deepcopy(model))
    output_submodule = prepared.bert.encoder.layer[0].output
    assert isinstance(output_submodule, nn.Module)
    inputs, targets = torch.randint(0, 40, (4, 7)), torch.tensor([0, 1, 2, 1])
    tracked_backward(prepared, inputs, targets, forward=lambda m, x: bert_logits(m, x))
    assert prepared.bert.encoder.layer[0].output is output_submodule
    gradients = per_example_gradients(
        model, inputs, targets, forward=lambda m, p, x: bert_logits(m, x, p)
    )
    linear = [
        f"{prefix}.{name}" for prefix, module in model.named_modules()
        if isinstance(module, nn.Linear) for name, _ in module.named_parameters()
    ]
    assert len(linear) == 2 * (2 * 6 + 2)  # q, k, v, attention out, intermediate, out; pooler, head
    for name in linear:  # softmax ignores the key's bias: its gradient is zero by structure
        if name.endswith("attention.self.key.bias"):
            gradients[name] = torch.zeros_like(gradients[name])
    errors = row_errors(prepared, gradients, linear)
    assert max(errors.values()) < RTOL, errors


# Cockpit's own first-order quantities ---------------------------------------------


def assert_same_output(got, expected, path=""):
    """Nested Cockpit outputs equal to a bound (the same rules on the same numbers)."""
    if isinstance(expected, dict):
        assert set(got) == set(expected), path
        for key in expected:
            assert_same_output(got[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for k, (a, b) in enumerate(zip(got, expected)):
            assert_same_output(a, b, f"{path}[{k}]")
    elif expected is None or isinstance(expected, str):
        assert got == expected, path
    else:
        numpy.testing.assert_allclose(got, expected, rtol=1e-12, atol=0, err_msg=path)


def small_convnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)
    ).double()


def test_cockpits_first_order_quantities_give_what_they_give_with_backpacks_hooks():
    from tests.test_normalization_extensions import run_cockpit_full_first_order

    inputs = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = run_cockpit_full_first_order(extend(small_convnet()), inputs, targets)
        got = run_cockpit_full_first_order(cgn.prepare_model(small_convnet()), inputs, targets)
    for step in expected:  # {step: {quantity: output}}
        expected[step].pop("Time", None), got[step].pop("Time", None)
    assert {"GradHist1d", "GradHist2d", "NormTest", "InnerTest", "OrthoTest"} <= set(expected[0])
    assert_same_output(got, expected)
