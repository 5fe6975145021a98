"""The statistics of :class:`~cockpit_gradnoise.GradientVarianceQuantiles`: quantiles of sd and SNR.

The selection (:mod:`cockpit_gradnoise.order_statistics`) returns numbers in
level order; they are named here, by
:func:`~cockpit_gradnoise.logs.schema.sd_statistic_names`.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from cockpit_gradnoise import _device, order_statistics
from cockpit_gradnoise.logs import schema
from cockpit_gradnoise.order_statistics import Tensors

from torch import Tensor

#: The SNR's one quantile level, its median (:data:`~cockpit_gradnoise.logs.schema.SNR_MEDIAN`).
SNR_LEVELS = (0.5,)


def sd_statistics(
    sd: Tensors, snr: Tensors, levels: Sequence[float], *, defer: bool = False
) -> Dict[str, float]:
    """The statistics of :class:`~cockpit_gradnoise.GradientVarianceQuantiles`.

    ``q<level>`` and ``mean`` of ``sd_j``; ``snr_q0.5`` and ``snr_mean`` of
    the signal-to-noise ratios (absent when there are none).

    Args:
        sd: Per-element standard deviations of the gradient: a tensor, or a
            sequence of tensors (the network's layers) whose union is meant.
        snr: :func:`signal_to_noise` of the same elements, likewise.
        levels: Quantile levels.
        defer: Leave the results on the device as 0-dim tensors (see
            :func:`~cockpit_gradnoise.order_statistics.quantile_summary`).
    """
    snrs = [snr] if isinstance(snr, Tensor) else list(snr)
    sds = [sd] if isinstance(sd, Tensor) else list(sd)
    if sds and not _device.on_host(sds[0]):
        # SNR's left-out elements are NaN here (signal_to_noise).
        sd_names, snr_names = _sd_names(levels)
        result = dict(zip(sd_names, order_statistics.quantile_summary(sds, levels, defer=True)))
        kept, snr_values = order_statistics.kept_quantile_summary(snrs, SNR_LEVELS)
        result[schema.SNR_PREFIX] = _device.PresentIfPositive(kept, dict(zip(snr_names, snr_values)))
        return result if defer else _device.resolve(result)
    has_snr = any(s.numel() > 0 for s in snrs)
    return _sd_row(levels, order_statistics.quantile_summary(sd, levels),
                   order_statistics.quantile_summary(snrs, SNR_LEVELS) if has_snr else [])


def _sd_names(levels: Sequence[float]) -> Tuple[List[str], List[str]]:
    """The names of sd's quantiles and mean, and of the SNR's median and mean
    (:func:`~cockpit_gradnoise.logs.schema.sd_statistic_names`, which lists them in that order)."""
    names = schema.sd_statistic_names(levels)
    return names[: len(levels) + 1], names[len(levels) + 1 :]


def _sd_row(levels: Sequence[float], sd_values: List[float], snr_values: List[float]) -> Dict[str, float]:
    """sd's quantiles and mean, then the SNR's median and mean (absent where
    ``snr_values`` is empty), named (:func:`_sd_names`)."""
    sd_names, snr_names = _sd_names(levels)
    row = dict(zip(sd_names, sd_values))
    row.update(zip(snr_names, snr_values))
    return row


def sd_statistics_of_layers(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], levels: Sequence[float], network: bool
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`sd_statistics` of each layer and, if ``network``, of their union.

    On the CPU the layers' and the network's quantiles share their passes
    over the elements (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries`);
    elsewhere the results stay on the device (``defer``).

    Args:
        sds: Per layer, :func:`gradient_sd` (a tensor with elements).
        snrs: Per layer, :func:`signal_to_noise` of the same elements.
        levels: Quantile levels.
        network: Whether to compute the union's statistics too.
    """
    if not _device.on_host(sds[0]):
        return _sd_rows_on_device(sds, snrs, levels), (
            sd_statistics(sds, snrs, levels, defer=True) if network else None)
    if not network:
        return [sd_statistics(sd, snr, levels) for sd, snr in zip(sds, snrs)], None
    rows, union = order_statistics.quantile_summaries(sds, levels)
    snr_rows, snr_union = [[] for _ in rows], []
    with_snr = [k for k, snr in enumerate(snrs) if snr.numel() > 0]
    if with_snr:
        found, snr_union = order_statistics.quantile_summaries(
            [snrs[k] for k in with_snr], SNR_LEVELS
        )
        for k, snr_row in zip(with_snr, found):
            snr_rows[k] = snr_row
    rows = [_sd_row(levels, row, snr_row) for row, snr_row in zip(rows, snr_rows)]
    return rows, _sd_row(levels, union, snr_union)


def _sd_rows_on_device(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], levels: Sequence[float]
) -> List[Dict[str, float]]:
    """:func:`sd_statistics` (``defer``) of each layer, the layers' sorts shared
    (:func:`~cockpit_gradnoise.order_statistics.segment_summaries`: a few sorts for all
    layers, not two per layer); the same numbers, left on the device."""
    sd_flats = [order_statistics.flat_tensors(sd) for sd in sds]
    snr_flats = [order_statistics.flat_tensors(snr) for snr in snrs]
    if not all(len(flats) == 1 for flats in sd_flats + snr_flats):  # an empty layer: one by one
        return [sd_statistics(sd, snr, levels, defer=True) for sd, snr in zip(sds, snrs)]
    sd_names, snr_names = _sd_names(levels)
    sd_found = order_statistics.segment_summaries([f for f, in sd_flats], levels)
    snr_found = order_statistics.segment_summaries([f for f, in snr_flats], SNR_LEVELS, kept=True)
    rows = []
    for (_, sd_values), (kept, snr_values) in zip(sd_found, snr_found):
        row = dict(zip(sd_names, sd_values))
        row[schema.SNR_PREFIX] = _device.PresentIfPositive(kept, dict(zip(snr_names, snr_values)))
        rows.append(row)
    return rows


def sd_statistics_in_place(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], left_out: Sequence[int],
    levels: Sequence[float], network: bool, joined: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`sd_statistics_of_layers` of :func:`sd_and_signal_to_noise`'s results, on the CPU.

    ``snrs`` hold ``left_out`` placeholder zeros each; the tensors are
    reordered (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries_in_place`:
    each layer's quantiles by nested partitions of its own values, the
    network's of ``joined``, the buffers of all layers' sd and SNR, or of a
    copy).

    Returns:
        ``(statistics of each layer, of the network or None)``.
    """
    unions = [None, None] if joined is None else [buffer.numpy() for buffer in joined]
    rows, union = order_statistics.quantile_summaries_in_place(
        [sd.reshape(-1).numpy() for sd in sds], levels, union=network, joined=unions[0]
    )
    snr_rows, snr_union = order_statistics.quantile_summaries_in_place(
        [snr.numpy() for snr in snrs], SNR_LEVELS, left_out, union=network, joined=unions[1],
    )
    rows = [_sd_row(levels, row, snr_row) for row, snr_row in zip(rows, snr_rows)]
    return rows, _sd_row(levels, union, snr_union) if network else None


def sd_statistics_across(
    sds: Sequence[Tensor], snrs: Sequence[Tensor], levels: Sequence[float], network: bool
) -> Tuple[List[Dict[str, float]], Optional[Dict[str, float]]]:
    """:func:`sd_statistics_of_layers` where each process holds some elements of each layer.

    Under FSDP2 every element of a layer's ``sd`` and SNR lives on one process
    (its shard, possibly empty); the statistics are those of all processes'
    elements together, identical on every process
    (:func:`~cockpit_gradnoise.order_statistics.quantile_summaries_across`:
    exact quantiles by a distributed selection, nothing gathered). Collective:
    every process passes the same layers, in order.

    Args:
        sds: Per layer, this process's elements of :func:`gradient_sd`.
        snrs: Per layer, this process's :func:`signal_to_noise` (NaN, left out
            on devices other than the CPU, is dropped here).
        levels: Quantile levels.
        network: Whether to compute the union's statistics too.
    """
    snrs = [snr[~snr.isnan()] for snr in snrs]
    union = [[list(sds)], [list(snrs)]] if network else [[], []]
    sd_groups, snr_groups = list(sds) + union[0], list(snrs) + union[1]
    # One search for both: its rounds of collectives are shared.
    found = order_statistics.quantile_summaries_across(
        sd_groups + snr_groups, levels,
        group_levels=[levels] * len(sd_groups) + [SNR_LEVELS] * len(snr_groups),
    )
    sd_rows, snr_rows = found[: len(sd_groups)], found[len(sd_groups) :]
    rows = [_sd_row(levels, sd, snr or []) for sd, snr in zip(sd_rows, snr_rows)]
    return rows[: len(sds)], rows[-1] if network else None
