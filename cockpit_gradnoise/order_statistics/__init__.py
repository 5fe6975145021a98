"""Exact quantiles of tensors, and of the union of several, by selection.

One implementation serves every quantile the package reports (the
quantities, :mod:`cockpit_gradnoise.minibatch`): :func:`select` finds the
values at given ranks of all elements of one or several tensors, and
:func:`quantiles` interpolates between them exactly as ``numpy.quantile``
does with its default ``"linear"`` method, so the results equal
``numpy.quantile(values.astype(numpy.float64), levels)`` bit for bit.

How :func:`select` avoids sorting every element: the order of floats of one
sign is the order of their bit patterns read as integers, so the top 14
bits of each value as a float32 (sign, exponent, leading mantissa bits) name
a bucket, and the buckets are ordered like the values.
One ``torch.bincount`` over the buckets of every tensor, and a cumulative
sum, say which bucket holds each wanted rank; only the elements of those few
buckets are gathered and sorted (a few percent of them for a spread of values
like a layer's). A union of tensors is never concatenated, and the passes go
through pieces of :data:`~cockpit_gradnoise._device.CHUNK` elements, so the
extra memory is under 1 MiB whatever the size. The quantiles of each layer
and of the whole network (:func:`select_each_and_union`) share both passes:
the network's counts are the sum of the layers', and one gathering serves
both. Small unions (:data:`SORT_WHOLE_AT_MOST`) are sorted whole, which is
faster there.
``benchmarks/benchmark_order_statistics.py`` measures both against sorting
and partitioning.

Where the caller owns the values and may have them reordered (the arrays a
quantity formed for this step: :func:`select_in_place`,
:func:`quantile_summaries_in_place`), NumPy's partitions are cheaper still
where NumPy selects at SIMD speed: no bucket passes, nothing gathered; the union
is then one joined array. Where it does not (one AMD EPYC: four to six times
slower), the buckets take arrays and unions of
:data:`~cockpit_gradnoise.order_statistics.partition.BUCKETS_AT_LEAST` elements or
more; which way is cheaper is measured once per process
(:func:`~cockpit_gradnoise.order_statistics.partition.partitions_cheaper`). Arrays
and unions of a million elements or more (VGG-11's 103M-element classifier
weight) are selected by a sample's brackets first (Floyd and Rivest): one pass of
comparisons in pieces, the few candidates inside each bracket partitioned, exact
whatever the sample (a rank outside its bracket takes the other paths).

That is the CPU's path. On other devices (GPUs) the union is sorted with
``torch.sort``, and :func:`quantile_summary` (``defer=True``) and
:func:`kept_quantile_summary` leave their results there as tensors: no
result whose size depends on the data, nothing read back by the host until
the step's one transfer (``docs/quantities.md``).

The results are numbers: values at ranks, quantiles in level order, the mean
after them. The quantities' formulas name them
(:func:`cockpit_gradnoise.logs.schema.quantile_name`); nothing here knows a
statistic's name.

The modules: :mod:`~cockpit_gradnoise.order_statistics.ranks` (levels, ranks,
``numpy.quantile``'s interpolation, checks), :mod:`~cockpit_gradnoise.order_statistics.selection`
(the functions above, on any device), :mod:`~cockpit_gradnoise.order_statistics.buckets`
(the CPU's bucket selection), :mod:`~cockpit_gradnoise.order_statistics.partition`
(NumPy partitions of arrays the caller owns), :mod:`~cockpit_gradnoise.order_statistics.bracket`
(a sample's brackets, one pass, for large arrays), :mod:`~cockpit_gradnoise.order_statistics.on_device`
(``torch.sort`` on other devices), :mod:`~cockpit_gradnoise.order_statistics.distributed`
(elements spread over processes, FSDP2's shards: a bisection on the values' bits
with counts added across processes), :mod:`~cockpit_gradnoise.order_statistics.rows`
(every row of a table at once: many parameters' per-example norms in a few ops),
:mod:`~cockpit_gradnoise.order_statistics.segments` (tensors of different sizes in one
sort on other devices: many parameters' per-element statistics in a few ops).
"""

from cockpit_gradnoise.order_statistics.distributed import quantile_summaries_across
from cockpit_gradnoise.order_statistics.on_device import kept_quantile_summary, sorted_on_device
from cockpit_gradnoise.order_statistics.partition import (
    BRACKET_AT_LEAST,
    COUNT_PIECE,
    count_where,
    quantile_summaries_in_place,
    select_in_place,
)
from cockpit_gradnoise.order_statistics.ranks import (
    SORT_WHOLE_AT_MOST,
    Tensors,
    check_quantile_levels,
    flat_tensors,
    interpolate,
    quantile_ranks,
)
from cockpit_gradnoise.order_statistics.rows import quantiles_of_sorted_rows, sorted_rows
from cockpit_gradnoise.order_statistics.segments import Segments, segment_groups, segment_layout, segment_summaries
from cockpit_gradnoise.order_statistics.selection import (
    float64_sum,
    quantile_summaries,
    quantile_summary,
    quantiles,
    select,
    select_each_and_union,
)

__all__ = [
    "BRACKET_AT_LEAST",
    "COUNT_PIECE",
    "SORT_WHOLE_AT_MOST",
    "Segments",
    "Tensors",
    "check_quantile_levels",
    "count_where",
    "flat_tensors",
    "float64_sum",
    "interpolate",
    "kept_quantile_summary",
    "quantile_ranks",
    "quantile_summaries",
    "quantile_summaries_across",
    "quantile_summaries_in_place",
    "quantile_summary",
    "quantiles_of_sorted_rows",
    "quantiles",
    "select",
    "select_each_and_union",
    "segment_groups",
    "segment_layout",
    "segment_summaries",
    "select_in_place",
    "sorted_on_device",
    "sorted_rows",
]
