"""The dashboard's noisiest layers, ranked from the ranking's numbers alone.

`view_rows._noisiest` ranks a streamed log's layers without building the
frame of their 2 M numbers; it must choose the layers that
`default_layers(to_frame(log), k)` chooses on the full frame, also where the
choice is delicate: ties (broken by layer order), scores a rounding apart,
layers with no finite score, a network that is noisiest of all, and the
fallback statistics when the log has no signal-to-noise ratios.
"""

import math

import cockpit_gradnoise as cgn
from cockpit_gradnoise.logs import selective
from cockpit_gradnoise.logs.schema import GRADIENT_VARIANCE, NETWORK, SNR_MEDIAN, encode_float
from cockpit_gradnoise.views import reads as view_rows
from cockpit_gradnoise.views.common import default_layers, layer_order

import numpy
import pytest

from benchmarks import benchmark_log

STEPS = range(12)
TENSORS = 12


def _snr(layer: int, step: int, rng) -> float:
    """Median SNR of layer ``layer`` at ``step``: ties, near-ties and gaps among the layers."""
    if layer in (3, 5, 8):  # tied, identical at every step: the order breaks the tie
        return [0.25, 0.5, 0.125][step % 3]
    if layer == 6:  # a rounding above the tie's mean (0.875 / 3 after 12 steps)
        return math.nextafter([0.25, 0.5, 0.125][step % 3], 1.0)
    if layer == 9:  # no finite value: no score, after the scored layers
        return math.nan
    if layer == 10:  # finite at some steps only: the mean of those
        return 0.2 if step % 4 == 0 else math.inf if step % 4 == 1 else math.nan
    return float(rng.uniform(0.3, 2.0))


def write_log(path, *, with_snr=True, network_noisiest=False):
    """A streamed log of the five quantities, the median SNRs of :func:`_snr`."""
    cockpit, rng = benchmark_log.synthetic_cockpit(TENSORS), numpy.random.default_rng(3)
    if not with_snr:  # no GradientVarianceQuantiles: ranked by the median per-example norm
        cockpit.quantities = [q for q in cockpit.quantities
                              if type(q).__name__ != GRADIENT_VARIANCE]
    with cgn.LogStream(path) as stream:
        for step in STEPS:
            benchmark_log.fill(cockpit, step, rng)
            for quantity in cockpit.quantities:
                if type(quantity).__name__ == GRADIENT_VARIANCE:
                    rows = quantity.output[step]
                    for layer, name in enumerate(cockpit.names):
                        rows[name][SNR_MEDIAN] = encode_float(_snr(layer, step, rng))
                    rows[NETWORK][SNR_MEDIAN] = 0.01 if network_noisiest else 5.0
            stream.append(cockpit)
    return path


@pytest.mark.parametrize("options", [{}, {"network_noisiest": True}, {"with_snr": False}],
                         ids=["snr", "network noisiest", "no snr"])
def test_the_noisiest_layers_are_those_of_the_full_frame(tmp_path, options):
    path = write_log(tmp_path / "run.jsonl", **options)
    full = cgn.to_frame(path)
    order = layer_order(full)
    index = selective.index_log(path)
    assert index is not None
    for k in range(1, TENSORS + 2):
        assert view_rows._noisiest(index, k, order) == default_layers(full, k, order), k
    rows, drawn = view_rows.plot_rows(path, top_k=4)
    assert isinstance(drawn, list) and drawn == default_layers(full, 4, order)


def test_the_log_makes_the_choice_delicate(tmp_path):
    """The cases above occur: the tie is cut by top_k, the near-tie ranks after it."""
    full = cgn.to_frame(write_log(tmp_path / "run.jsonl"))
    names = layer_order(full)
    tied = [names[3], names[5], names[8]]
    from cockpit_gradnoise.views.common import noisiest_layers

    ranked = noisiest_layers(full, TENSORS)
    # Layer 10's mean (0.2) is lowest, then the three tied in layer order, then layer 6.
    assert ranked[:5] == [names[10], *tied, names[6]]
    assert ranked[-1] == names[9]  # no score: last
    assert default_layers(full, 3) == [names[3], names[5], names[10]]  # the tie cut
