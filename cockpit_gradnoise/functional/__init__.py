"""Pure formulas on tensors: every statistic the package reports.

Nothing here knows about Cockpit or BackPACK. The quantities fetch what
BackPACK leaves on the parameters and call one of these functions; tests check
each function on its own against NumPy or a brute-force loop. Quantiles come
from :mod:`cockpit_gradnoise.order_statistics` as numbers in level order; the
statistics here name them (:func:`~cockpit_gradnoise.logs.schema.sd_statistic_names`,
:func:`~cockpit_gradnoise.logs.schema.norm_statistic_names`).

One module per family of formulas, every public formula re-exported here
(``functional.gradient_sd``, as ``torchmetrics.functional`` does):

- :mod:`~cockpit_gradnoise.functional.variance`: per-element sd and SNR, and
  their rounding bounds;
- :mod:`~cockpit_gradnoise.functional.fused`: sd and SNR of many layers at once
  on the CPU;
- :mod:`~cockpit_gradnoise.functional.variance_statistics`: the quantiles of sd
  and SNR that :class:`~cockpit_gradnoise.GradientVarianceQuantiles` reports;
- :mod:`~cockpit_gradnoise.functional.norms`, :mod:`~cockpit_gradnoise.functional.ratios`:
  norms, per-example norms, ``theta / grad`` ratios;
- :mod:`~cockpit_gradnoise.functional.noise_scale`: the gradient noise scale;
- :mod:`~cockpit_gradnoise.functional.preconditioner`: adaptive optimizers' diagonal
  preconditioners, and the noise-scale sums of preconditioned gradients;
- :mod:`~cockpit_gradnoise.functional.reduction`: the loss's reduction;
- :mod:`~cockpit_gradnoise.functional.welford`: running means and variances;
- :mod:`~cockpit_gradnoise.functional.underflow`: which sums of squares underflow lost.

Notation (see ``DESIGN.md``): a mini-batch has ``N`` examples, ``x_i`` is
example ``i``'s contribution to ``param.grad`` (``param.grad = sum_i x_i``),
and ``g_i`` is the gradient of example ``i``'s own loss. For a loss that is
``c * sum_i loss_i`` (``c = 1/N`` for a mean, ``c = 1`` for a sum),
``x_i = c * g_i``.
"""

from cockpit_gradnoise.functional.fused import sd_and_signal_to_noise
from cockpit_gradnoise.functional.noise_scale import (
    exponential_moving_average,
    noise_scale_estimates,
    scale_free_smoothed_noise_scale,
    two_batch_noise_scale_estimates,
    two_batch_noise_scale_terms,
)
from cockpit_gradnoise.functional.norms import (
    divided_squared_norms,
    norm_ratio,
    norm_tensor,
    per_example_norm_statistics,
    per_example_norm_statistics_of_rows,
    rows_of_columns,
    scalar,
    squared_norm,
    squared_norm_tensors,
    squared_norms,
    stacked_by_dtype,
)
from cockpit_gradnoise.functional.preconditioner import (
    adagrad_preconditioner,
    adam_preconditioner,
    preconditioned_noise_sums,
    rmsprop_preconditioner,
)
from cockpit_gradnoise.functional.ratios import (
    abs_ratio_statistics,
    abs_ratio_statistics_and_zeros,
    abs_ratio_statistics_of_pairs,
    abs_ratio_statistics_of_small,
    zero_count,
)
from cockpit_gradnoise.functional.reduction import loss_scale, loss_tolerance, matching_loss_scale
from cockpit_gradnoise.functional.underflow import (
    counts_of_rows,
    floors_of,
    unresolved_norm_sum,
    unresolved_norm_sums_of_rows,
    unresolved_norms,
    unresolved_norms_of_rows,
    unresolved_sums,
    unresolved_sums_of_segments,
)
from cockpit_gradnoise.functional.variance import (
    centred_sum_of_squares,
    expansion_rounding_bound,
    gradient_sd,
    gradient_sd_of_many,
    resolvable_snr,
    signal_to_noise,
    variance_rounding_bound,
)
from cockpit_gradnoise.functional.variance_statistics import (
    sd_statistics,
    sd_statistics_across,
    sd_statistics_in_place,
    sd_statistics_of_layers,
)
from cockpit_gradnoise.functional.welford import welford_sd, welford_update_

__all__ = [
    "counts_of_rows",
    "floors_of",
    "abs_ratio_statistics",
    "adagrad_preconditioner",
    "adam_preconditioner",
    "abs_ratio_statistics_and_zeros",
    "abs_ratio_statistics_of_pairs",
    "abs_ratio_statistics_of_small",
    "centred_sum_of_squares",
    "divided_squared_norms",
    "expansion_rounding_bound",
    "exponential_moving_average",
    "gradient_sd",
    "gradient_sd_of_many",
    "loss_scale",
    "loss_tolerance",
    "matching_loss_scale",
    "noise_scale_estimates",
    "norm_ratio",
    "per_example_norm_statistics",
    "per_example_norm_statistics_of_rows",
    "preconditioned_noise_sums",
    "resolvable_snr",
    "rmsprop_preconditioner",
    "rows_of_columns",
    "scalar",
    "scale_free_smoothed_noise_scale",
    "sd_and_signal_to_noise",
    "sd_statistics",
    "sd_statistics_across",
    "sd_statistics_in_place",
    "sd_statistics_of_layers",
    "signal_to_noise",
    "norm_tensor",
    "squared_norm",
    "squared_norm_tensors",
    "squared_norms",
    "stacked_by_dtype",
    "two_batch_noise_scale_estimates",
    "two_batch_noise_scale_terms",
    "unresolved_norm_sum",
    "unresolved_norms",
    "unresolved_norms_of_rows",
    "unresolved_norm_sums_of_rows",
    "unresolved_sums",
    "unresolved_sums_of_segments",
    "variance_rounding_bound",
    "welford_sd",
    "welford_update_",
    "zero_count",
]
