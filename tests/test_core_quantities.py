"""GradientVarianceQuantiles and PerExampleGradNorm against brute force.

Every statistic, every parameter and "all", over the case matrix, in float64.
"""

import functools
import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise import references
from cockpit_gradnoise.logs import schema

import numpy
import pytest
import torch
from cockpit.utils.configuration import configuration
from cockpit.utils.schedules import linear
from torch import nn

from tests.cases import MODELS, build, case_named, reference_gradients, run_step
from tests.helpers import assert_statistics_match, sd_rtol, snr_atol


def test_gradient_variance_quantiles_match_reference(model_case, reduction, batch_size):
    problem = build(model_case, batch_size, reduction)
    quantiles = (0.0, 0.05, 0.5, 0.95, 1.0)
    quantity = cgn.GradientVarianceQuantiles(
        linear(1), quantiles=quantiles, param_names=problem.names
    )
    with _expected_warnings(model_case):
        cockpit = run_step(problem, [quantity])
    got = cockpit.get_output()[0]["GradientVarianceQuantiles"]
    grads = reference_gradients(model_case, problem)
    expected = references.gradient_variance_quantiles(
        problem.model, None, problem.inputs, problem.targets, reduction=reduction,
        quantiles=quantiles, gradients=grads,
    )
    sd_tolerances = {
        name: sd_rtol(grads, batch_size, name, model_case.inner_terms) for name in expected
    }

    snr_tolerances = {
        name: snr_atol(grads, batch_size, name, model_case.inner_terms) for name in expected
    }

    def rtol_of(name, statistic):
        return sd_tolerances[name]

    def atol_of(name, statistic):
        return snr_tolerances[name] if statistic.startswith("snr") else 0.0

    assert_statistics_match(got, expected, rtol_of=rtol_of, atol_of=atol_of)


def test_per_example_grad_norm_matches_reference(model_case, reduction, batch_size):
    problem = build(model_case, batch_size, reduction)
    quantiles = (0.0, 0.05, 0.5, 0.95, 1.0)
    quantity = cgn.PerExampleGradNorm(linear(1), quantiles=quantiles, param_names=problem.names)
    with _expected_warnings(model_case):
        cockpit = run_step(problem, [quantity])
    got = cockpit.get_output()[0]["PerExampleGradNorm"]
    expected = references.per_example_grad_norm(
        None, None, problem.inputs, None, quantiles=quantiles,
        gradients=reference_gradients(model_case, problem),
    )
    assert_statistics_match(got, expected)


def test_unused_and_frozen_parameters_have_no_rows():
    problem = build(case_named("unused-frozen"), 7, "mean")
    quantity = cgn.PerExampleGradNorm(linear(1), param_names=problem.names)
    with pytest.warns(UserWarning, match=r"\['unused.weight', 'unused.bias'\] have no gradient"):
        cockpit = run_step(problem, [quantity])
    frame = cgn.to_frame(cockpit)
    assert set(frame.param) == {"body.1.weight", "body.1.bias", "body.3.weight", "body.3.bias", "all"}


def _expected_warnings(case):
    """The unused layer's warning, the warning that examples interact, or no warning."""
    if case.name == "unused-frozen":
        return pytest.warns(UserWarning)
    if case.examples_interact:
        return pytest.warns(UserWarning, match="examples interact")
    return _no_warning()


class _no_warning:
    """Context manager that fails on any warning of this package."""

    def __enter__(self):
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catcher.__exit__(*exc)
        ours = [str(r.message) for r in self._records if "Full backward hook" not in str(r.message)]
        assert not ours, ours


def _track_steps(problem, quantities, steps):
    cockpit = cgn.Cockpit(problem.params, quantities=quantities)
    opt = torch.optim.SGD(problem.params, lr=0.1)
    for step in range(steps):
        run_step(problem, quantities, step=step, cockpit=cockpit, optimizer=opt)
        opt.step()
    return cockpit


def _ours(problem, schedule=linear(1)):
    return [
        cgn.GradientVarianceQuantiles(schedule, param_names=problem.names),
        cgn.PerExampleGradNorm(schedule, param_names=problem.names),
    ]


@pytest.mark.parametrize("case", [MODELS[0], MODELS[2]], ids=lambda c: c.name)
def test_same_numbers_alone_together_and_with_cockpit_full_configuration(case, tmp_path):
    """Each quantity gives the same numbers alone and with the other: the same
    kernels run, bit for bit. Beside Cockpit's own quantities (float32:
    Cockpit's HessMaxEV fails in float64) the backward pass runs with
    ``create_graph`` and the package's sums through other BLAS kernels (last
    bits differ, depending on the CPU): there, as alone, every statistic lies
    within the rounding bounds of the contributions computed from the layers'
    own inputs and output gradients in that run (:func:`_statistic_bounds`).
    And Cockpit's plotter still renders that cockpit."""
    steps, n = 3, 16

    def frame_of(make_quantities, converter=False):
        problem = build(case, n, "mean", dtype=torch.float32, converter=converter)
        quantities = make_quantities(problem)
        layers = _LayerRecorder(problem.model)
        cockpit = _track_steps(problem, quantities, steps)
        return cgn.to_frame(cockpit), cockpit, layers.steps

    alone = [frame_of(lambda p, i=i: [_ours(p)[i]]) for i in range(2)]
    together, _, _ = frame_of(_ours)
    # Cockpit's second-order quantities need BackPACK's converter and its hooks.
    with_full, cockpit, full_layers = frame_of(lambda p: _ours(p) + configuration("full"),
                                               converter=True)
    expected = pandas_concat([frame for frame, _, _ in alone])
    assert len(expected) > 0
    assert together.equals(expected)
    keys = ["step", "quantity", "param", "statistic"]
    assert with_full[keys].equals(expected[keys])
    for frame, layers in [(frame, layers) for frame, _, layers in alone] + [(with_full, full_layers)]:
        assert len(layers) == steps
        _assert_within_bounds(frame, [_statistic_bounds(step, n) for step in layers])

    plotter = cgn.CockpitPlotter()
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=str(tmp_path), savename="cockpit")
    assert (tmp_path / "cockpit__primary.png").stat().st_size > 0


EPS32 = torch.finfo(torch.float32).eps


class _LayerRecorder:
    """Per backward pass, each Linear's and Conv2d's input and output gradient.

    The first gradient after each forward pass: Cockpit's curvature quantities
    differentiate the graph again afterwards.
    """

    def __init__(self, model):
        self.steps = []
        model.register_forward_pre_hook(lambda module, args: self.steps.append({}))
        for prefix, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.register_forward_hook(functools.partial(self._record, prefix))

    def _record(self, prefix, module, args, output):
        entry = self.steps[-1][prefix] = {"module": module, "input": args[0].detach()}

        def keep_first(grad):
            entry.setdefault("grad_output", grad.detach())  # returns None: grad unchanged

        output.register_hook(keep_first)


def _contributions(module, inputs, grad_output):
    """``{"weight": x_i, "bias": x_i}`` (``[N, *shape]``) of one example each, in float64."""
    a, g = inputs.double(), grad_output.double()
    if isinstance(module, nn.Linear):
        return {"weight": torch.einsum("no,ni->noi", g, a), "bias": g}
    weight = torch.stack([
        torch.nn.grad.conv2d_weight(a[i : i + 1], module.weight.shape, g[i : i + 1],
                                    module.stride, module.padding)
        for i in range(len(a))
    ])
    return {"weight": weight, "bias": g.sum((2, 3))}


def _statistic_bounds(layers, n):
    """``{(quantity, param, statistic): (low, high)}`` for one step, from the
    exact contributions ``x_ilj = sum_l t_ilj`` (``l`` over a layer's ``L``
    output positions) of the recorded inputs and output gradients.

    To first order in ``eps`` (float32's), each result of a sum of ``m``
    products of ``k`` factors, in any order, is off by at most ``(m + k) eps``
    times the sum of the terms' magnitudes (Higham 2002, ch. 3-4), which the
    absolute values ``|t_ilj|`` give (``XA_ij = sum_l |t_ilj|``). Per element,
    with ``A = sum_i XA_ij**2`` and ``B = sum_i XA_ij``:

    - ``T = sum_i x_ij`` (``N L`` products): off by ``N L eps B``;
    - ``S = sum_i x_ij**2`` (formed ``x_ij``, squared, summed; or for ``L = 1``
      the product of squares): off by ``(N + 2L + 2) eps A``;
    - the centred ``C = S - T**2 / N`` (three more roundings): off by
      ``eps ((N + 2L + 2) A + 2 L |T| B + 3 (S + T**2 / N))``; where it may
      fall under the zeroing threshold ``(3N + 4) eps S``, ``sd_j`` may be 0;
      ``sd_j = sqrt(N C / (N - 1))`` and ``|T| / sd_j`` round twice and once more;
    - ``||x_i||^2`` of ``P`` elements by any of the package's methods (BackPACK's
      identity for a Linear, formation, Gram matrices over ``L**2`` position
      pairs): off by ``(P + L**2 + 2L + 4) eps sum_j XA_ij**2``; the network's
      adds the layers' (one rounding per layer); ``||g_i|| = ||x_i|| N``
      (``x_i = g_i / N`` for the mean loss) rounds twice.

    Every statistic (quantiles, mean, max) grows with each element, so it lies
    between the statistic of the elements' lower bounds and that of their
    upper bounds. The float64 references round below ``1e-13`` of these bounds.
    """
    sd, snr, norms = {}, {}, {}
    for prefix, layer in layers.items():
        module = layer["module"]
        exact = _contributions(module, layer["input"], layer["grad_output"])
        absolute = _contributions(module, layer["input"].abs(), layer["grad_output"].abs())
        positions = layer["grad_output"][0, 0].numel() if isinstance(module, nn.Conv2d) else 1
        for name in ("weight", "bias"):
            x = exact[name].reshape(n, -1).numpy()
            xa = absolute[name].reshape(n, -1).numpy()
            sd[f"{prefix}.{name}"], snr[f"{prefix}.{name}"] = _sd_intervals(x, xa, n, positions)
            elements = x.shape[1]
            error = (elements + positions**2 + 2 * positions + 4) * EPS32 * (xa**2).sum(1)
            norms[f"{prefix}.{name}"] = ((x**2).sum(1), error)
    squared = sum(value for value, _ in norms.values())
    error = sum(e for _, e in norms.values()) + len(norms) * EPS32 * sum(
        value + e for value, e in norms.values()
    )
    norms[cgn.NETWORK] = (squared, error)
    sd[cgn.NETWORK] = tuple(numpy.concatenate(parts) for parts in zip(*sd.values()))
    snr[cgn.NETWORK] = tuple(numpy.concatenate(parts) for parts in zip(*snr.values()))
    bounds = {}
    for param in norms:
        squared, error = norms[param]
        low = numpy.sqrt(numpy.maximum(squared - error, 0)) * n * (1 - 2 * EPS32)
        high = numpy.sqrt(squared + error) * n * (1 + 2 * EPS32)
        groups = {"PerExampleGradNorm": {"": (low, high)},
                  "GradientVarianceQuantiles": {"": sd[param], "snr_": snr[param]}}
        for quantity, prefixes in groups.items():
            for prefix, (low, high) in prefixes.items():
                for statistic, of in _STATISTICS.items():
                    bounds[quantity, param, prefix + statistic] = (of(low), of(high))
    return bounds


_STATISTICS = {"mean": numpy.mean, "max": numpy.max,
               **{f"q{q:g}": functools.partial(numpy.quantile, q=q) for q in (0.05, 0.25, 0.5, 0.75, 0.95)}}


def _sd_intervals(x, xa, n, positions):
    """Per element, ``(sd low, sd high)`` and ``(SNR low, SNR high)`` where ``sd_j > 0``."""
    total, squares = x.sum(0), (x**2).sum(0)
    a, b = (xa**2).sum(0), xa.sum(0)
    centred = ((x - x.mean(0)) ** 2).sum(0)
    sum_error = (n + 2 * positions + 2) * a
    error = EPS32 * (sum_error + 2 * positions * abs(total) * b + 3 * (squares + total**2 / n))
    threshold = (3 * n + 4) * EPS32 * (squares + EPS32 * sum_error) * (1 + EPS32)
    factor = n / (n - 1)
    high = numpy.sqrt(factor * (centred + error)) * (1 + 2 * EPS32)
    low = numpy.where(centred - error <= threshold, 0.0,
                      numpy.sqrt(factor * numpy.maximum(centred - error, 0)) * (1 - 2 * EPS32))
    # Each element's sd is surely 0 or surely positive (else its SNR may be left out or not).
    kept, left_out = low > 0, high == 0
    assert (kept | left_out).all()
    total_error = n * positions * EPS32 * b[kept]
    snr_low = numpy.maximum(abs(total[kept]) - total_error, 0) / high[kept] * (1 - EPS32)
    snr_high = (abs(total[kept]) + total_error) / low[kept] * (1 + EPS32)
    return (low, high), (snr_low, snr_high)


def _assert_within_bounds(frame, bounds):
    """Every row of ``frame`` within its step's bounds (float64 interpolation: ``1e-14``)."""
    checked = 0
    for step, quantity, param, statistic, value in frame.itertuples(index=False):
        if statistic in schema.COVERAGE_STATISTICS:
            continue
        low, high = bounds[step][quantity, param, statistic]
        assert low * (1 - 1e-14) <= value <= high * (1 + 1e-14), (step, quantity, param, statistic)
        checked += 1
    assert checked > 0


def pandas_concat(frames):
    import pandas

    # As to_frame: by step and quantity, each quantity's rows in stored order,
    # names categorical with the names present sorted (concat of differing
    # categories gives plain objects).
    frame = pandas.concat(frames).sort_values(["step", "quantity"], kind="stable",
                                              ignore_index=True)
    return frame.astype({
        column: pandas.CategoricalDtype(pandas.Index(sorted(set(frame[column].astype(str))), dtype=str))
        for column in ["quantity", "param", "statistic"]
    })


def test_output_steps_equal_schedule_steps():
    problem = build(MODELS[0], 7, "mean")
    schedule = lambda step: step in (0, 3, 4, 9)  # noqa: E731
    cockpit = _track_steps(problem, _ours(problem, schedule), 10)
    frame = cgn.to_frame(cockpit)
    for quantity in ("GradientVarianceQuantiles", "PerExampleGradNorm"):
        assert sorted(set(frame[frame.quantity == quantity].step)) == [0, 3, 4, 9]


def test_per_example_norms_do_not_depend_on_reduction():
    frames = {}
    for reduction in ("mean", "sum"):
        problem = build(MODELS[2], 7, reduction)
        cockpit = run_step(problem, [cgn.PerExampleGradNorm(linear(1), param_names=problem.names)])
        frames[reduction] = cgn.to_frame(cockpit)
    numpy.testing.assert_allclose(frames["mean"].value, frames["sum"].value, rtol=1e-12)
    assert not math.isnan(frames["mean"].value.sum())


def test_both_per_example_norm_paths_for_convolutions_are_in_the_case_matrix():
    """Convolutions contract Gram matrices or form per-example gradients,
    whichever is cheaper; the matrix covers both."""
    from cockpit_gradnoise.extensions import conv_math, cost_model

    chosen = {}
    for name in ("cnn", "conv-one-position"):
        case = next(c for c in MODELS if c.name == name)
        conv, inputs = case.make()[0], case.inputs(2)
        _, c_b, c_a, positions = conv_math.layer_shape(conv, inputs, conv(inputs))
        chosen[name] = cost_model.formation_is_cheaper(cost_model.gram_cost, c_b, c_a, positions)
    assert chosen == {"cnn": True, "conv-one-position": False}
