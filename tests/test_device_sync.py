"""No host-device synchronisation inside a tracked step but the step's one transfer.

On a GPU, ``.item()``, ``float(tensor)``, ``bool(tensor)``, ``.tolist()``,
NumPy and shapes that depend on the data (boolean-mask indexing, ``nonzero``)
make the host wait for the device. The quantities keep everything on the
device and copy a step's statistics once (``_device.transfer``); with the
explicit API, telling a mean loss from a sum needs one more, shared by the
quantities that need it (the front door declares it).

The CUDA test checks this with ``torch.cuda.set_sync_debug_mode("error")``.
The CPU test runs the paths taken on other devices (forced on CPU tensors)
and records the operations that synchronise on a GPU.
"""

import contextlib
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import _device

import pytest
import torch
from cockpit.utils.schedules import linear
from torch.utils._python_dispatch import TorchDispatchMode

from tests.cases import build, case_named, run_step
from tests.helpers import rounding_bounds, rows

aten = torch.ops.aten

#: Operators that make the host wait on a GPU: a value read by the host
#: (``item``, ``bool``, ``float``), or an output whose size depends on the data.
SYNCING = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten.masked_scatter,
    aten.bincount,
    aten.unique_consecutive,
    aten._unique2,
    aten.unique_dim,
    aten.repeat_interleave,
    aten.equal,
    aten.is_nonzero,
}

QUANTITIES = [
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "ParamGradRatio",
    "GradientNoiseScale",
    "UpdateSize",
]


def all_quantities(names):
    return [getattr(cgn, name)(linear(1), param_names=names) for name in QUANTITIES]


class SyncRecorder(TorchDispatchMode):
    """Records each operator in :data:`SYNCING`, and indexing with a boolean mask."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if func.overloadpacket in SYNCING:
                self.calls.append(str(func))
            elif func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(i is not None and i.dtype == torch.bool for i in indices):
                    self.calls.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(monkeypatch, recorder):
    """Record syncing operators, ``.tolist()`` and ``.numpy()``, except inside transfers."""
    transfers = []
    transfer = _device.transfer

    def counted_transfer(tensors):
        transfers.append(len(tensors))
        recorder.paused = True
        try:
            return transfer(tensors)
        finally:
            recorder.paused = False

    def recorded(name):
        method = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            if not recorder.paused:
                recorder.calls.append(f"Tensor.{name}")
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(_device, "transfer", counted_transfer)
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, recorded(name))
    yield transfers
    monkeypatch.undo()


def tracked_steps(problem, quantities, check=contextlib.nullcontext, after_step=lambda: None):
    """Two tracked steps (UpdateSize ends at the second); ``check()`` around each
    step's backward pass (BackPACK and the package's extensions) and around each
    quantity's computation. Not around the rest of Cockpit's context, which
    reads ``loss.isnan().any()`` itself (Cockpit's own wait, once per step).

    ``after_step()`` runs at the end of each step. Returns the cockpit and,
    per step, the names of the quantities in the order they computed.
    """
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    optimizer = torch.optim.SGD(problem.params, lr=0.1)
    order = []
    for quantity in quantities:
        quantity.compute = _noting(quantity.compute, type(quantity).__name__, order, check)
    computed = []
    for step in range(2):
        order.clear()
        run_step(problem, quantities, step, cockpit, optimizer, around_backward=check)
        computed.append(list(order))
        optimizer.step()
        after_step()
    return cockpit, computed


def _noting(compute, name, order, check):
    def noted_compute(*args, **kwargs):
        order.append(name)
        with check():
            return compute(*args, **kwargs)

    return noted_compute


# Small models of the case matrix, one of each layer family (resnet18's
# whole-network sort on CPU takes long; its layers are covered here).
CASES = [
    "mlp",
    "cnn",
    "grouped-conv",
    "conv1d",
    "conv-one-position",
    "embedding",
    "unused-frozen",
    "layernorm-sequence",
    "groupnorm-cnn",
    "rmsnorm-mlp",
    "gpt",
]


def counting_steps(transfers):
    """``(after_step, counts)``: ``counts`` gets the number of ``transfers`` of each step."""
    counts, seen = [], [0]

    def after_step():
        counts.append(len(transfers) - seen[0])
        seen[0] = len(transfers)

    return after_step, counts


def expected_transfers(computed):
    """Per step: one per quantity that stored statistics (UpdateSize not at its
    start step), and one more for the loss's reduction, read by the first of
    PerExampleGradNorm and GradientNoiseScale to compute and reused by the other."""
    return [
        len([q for q in names if q != "UpdateSize" or step > 0]) + 1
        for step, names in enumerate(computed)
    ]


@pytest.mark.parametrize("case", CASES)
def test_other_devices_paths_read_nothing_back_but_one_transfer_per_quantity(
    case, monkeypatch, one_thread
):
    """Run on CPU tensors forced down the GPU paths; fails if the backward pass's
    extensions or a quantity read a value back, or select with a data-dependent shape."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    problem = build(case_named(case), 8, "mean", dtype=torch.float32)
    recorder = SyncRecorder()
    with recording(monkeypatch, recorder) as transfers:
        after_step, counts = counting_steps(transfers)
        _, computed = tracked_steps(
            problem, all_quantities(problem.names), lambda: recorder, after_step
        )
    assert recorder.calls == []
    assert counts == expected_transfers(computed)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES)
def test_other_devices_paths_give_the_cpu_results(case, reduction, monkeypatch, one_thread):
    """The same statistics as the CPU paths: order statistics exactly, float64
    sums (means, norms) to their rounding in another order: at most
    ``(n - 1) eps64`` relative for ``n`` terms of one sign, below ``1e-12``
    for these models' at most 2000 elements. GradientNoiseScale's estimates are
    differences of two such sums, ``S`` and ``M``: within what both paths' rounding
    of them gives (:func:`_noise_scale_tolerances`)."""
    results = {}
    for forced in (False, True):
        with monkeypatch.context() as patch:
            if forced:
                patch.setattr(_device, "on_host", lambda tensor: False)
            problem = build(case_named(case), 8, reduction, dtype=torch.float32)
            cockpit, _ = tracked_steps(problem, all_quantities(problem.names))
            results[forced] = {q: rows(cockpit, q) for q in QUANTITIES}
    numels = {name: param.numel() for name, param in zip(problem.names, problem.params)}
    _assert_same(results[True], results[False], {**numels, "all": sum(numels.values())})


def _assert_same(forced, host, numels, examples=8):
    for quantity, expected in host.items():
        got = forced[quantity]
        assert set(got) == set(expected), quantity
        for name, stats in expected.items():
            assert set(got[name]) == set(stats), (quantity, name)
            bounds = (_noise_scale_tolerances(stats, examples, numels[name])
                      if quantity == "GradientNoiseScale" else {})
            for statistic, value in stats.items():
                exact = statistic.startswith(("q", "snr_q")) or statistic in (
                    "median",
                    "min",
                    "max",
                )
                tolerance = 0 if exact else 1e-12
                assert got[name][statistic] == pytest.approx(value, rel=tolerance, abs=bounds.get(statistic, 0)), (
                    quantity,
                    name,
                    statistic,
                )


def _noise_scale_tolerances(row, examples, elements):
    """Absolute bounds of GradientNoiseScale's estimates between two paths: ``grad_sq`` and
    ``trace_cov`` are differences of ``S`` and ``M`` (:func:`~tests.helpers.rounding_bounds`,
    of each path's rounding, so twice), ``b_simple`` their ratio (``b_simple_smoothed`` is it
    at the first step). Cancellation in ``N M - S`` multiplies ``M``'s last bit by ``N M /
    grad_sq`` (65,000 on one layer here): one rounding of ``M`` more or less is not within
    ``1e-12`` of ``grad_sq`` there. ``b_simple``'s only where ``|grad_sq|`` exceeds its bound
    (elsewhere it is compared within ``1e-12`` relative, as before)."""
    grad_sq, trace_cov = row["grad_sq"], row["trace_cov"]
    if not (math.isfinite(grad_sq) and math.isfinite(trace_cov)):
        return {}
    bound_g, bound_t = (2 * bound for bound in rounding_bounds(examples, elements, grad_sq, trace_cov))
    bounds = {"grad_sq": bound_g, "trace_cov": bound_t}
    if abs(grad_sq) > bound_g:  # (t + dt) / (g + dg) - t / g = (dt - b dg) / (g + dg)
        b_bound = (bound_t + abs(trace_cov / grad_sq) * bound_g) / (abs(grad_sq) - bound_g)
        bounds.update(b_simple=b_bound, b_simple_smoothed=b_bound)
    return bounds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ["cnn", "embedding"])
def test_no_synchronisation_on_cuda_but_the_transfers(case, monkeypatch):
    """The backward pass and the quantities under ``set_sync_debug_mode("error")``;
    the transfers (counted) are the only place allowed to wait."""
    problem = build(case_named(case), 8, "mean", dtype=torch.float32)
    problem.model.cuda()
    problem.inputs, problem.targets = problem.inputs.cuda(), problem.targets.cuda()
    transfers = []
    transfer = _device.transfer

    def counted_transfer(tensors):
        transfers.append(len(tensors))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return transfer(tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    @contextlib.contextmanager
    def check():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(_device, "transfer", counted_transfer)
    after_step, counts = counting_steps(transfers)
    cockpit, computed = tracked_steps(problem, all_quantities(problem.names), check, after_step)
    assert counts == expected_transfers(computed)
    assert all(rows(cockpit, q) for q in QUANTITIES)


def test_the_front_door_spares_the_transfer_of_the_loss_reduction(monkeypatch, one_thread):
    """The tracker declares the batch (issue 36): per step one transfer per quantity that
    stored statistics, none for the loss's reduction; the backward pass and the
    quantities read nothing else back."""
    monkeypatch.setattr(_device, "on_host", lambda tensor: False)
    torch.manual_seed(0)
    model, tracker = cgn.track(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(),
                                                   torch.nn.Linear(4, 3)), every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    order = []
    recorder = SyncRecorder()
    for quantity in tracker.cockpit.quantities:
        quantity.compute = _noting(quantity.compute, type(quantity).__name__, order, lambda: recorder)
    counts, computed = [], []
    with recording(monkeypatch, recorder) as transfers:
        for step in range(2):
            order.clear()
            optimizer.zero_grad()
            x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
            seen = len(transfers)
            losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            with tracker(step, losses, optimizer=optimizer) as loss:
                with recorder:
                    loss.backward()
            counts.append(len(transfers) - seen)
            computed.append(list(order))
            optimizer.step()
    assert recorder.calls == []
    assert counts == [n - 1 for n in expected_transfers(computed)]
    assert all(rows(tracker.cockpit, q) for q in QUANTITIES)


def test_a_transfer_of_several_dtypes_gives_each_value_in_its_place():
    """One stack and one float64 conversion per dtype, then back in the callers' order:
    each value exactly (float64 holds every value of the narrower dtypes)."""
    tensors = [torch.tensor(0.1), torch.tensor(True), torch.tensor(0.1, dtype=torch.float64),
               torch.tensor([2**40 + 1]), torch.tensor(False), torch.tensor(-3.5, dtype=torch.float16),
               torch.tensor(float("nan")), torch.tensor(1 / 3, dtype=torch.float64)]
    expected = [float(t.reshape(()).to(torch.float64)) for t in tensors]
    got = _device.transfer(tensors)
    assert [type(v) for v in got] == [float] * len(tensors)
    assert got[:6] == expected[:6] and got[7] == expected[7] and got[6] != got[6]  # NaN in its place
