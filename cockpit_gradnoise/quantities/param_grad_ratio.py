"""Per-layer ratios of weights to gradients, from ``param.data`` and ``param.grad``."""

import math
from typing import NamedTuple

from cockpit_gradnoise import _device, functional, order_statistics
from cockpit_gradnoise.logs.schema import NORM_RATIO, RATIO_STATISTICS, ZERO_GRAD_FRACTION
from cockpit_gradnoise.quantities._base import ParameterQuantity

import torch
from torch import Tensor

#: The parameter types whose norms :meth:`ParamGradRatio.step_context` forms for all at once.
_PLAIN = (torch.nn.Parameter, torch.Tensor)


class ParamGradRatio(ParameterQuantity):
    """How large are gradients relative to the weights, layer by layer?

    Per parameter, over the elements with ``grad_j != 0`` where both values
    are finite, statistics of ``|theta_j| / |grad_j|``: ``mean``, ``median``
    (as ``numpy.median``), ``min`` and ``max``. Also ``zero_grad_fraction``,
    the fraction of elements whose gradient is exactly 0, and ``norm_ratio``
    ``= ||theta|| / ||grad||`` (the LARS trust ratio, You et al. 2017). For
    ``"all"``: ``norm_ratio`` and ``zero_grad_fraction`` of the whole network.

    ``grad`` is ``param.grad`` as the optimizer sees it (so it depends on the
    loss's reduction), rounding noise included: a structurally zero element (an
    attention key's bias) counts as nonzero, with a huge ratio
    (``docs/param-grad-ratio.md``). A parameter whose gradient is all zero has
    ``zero_grad_fraction`` 1, ``norm_ratio`` ``inf`` and no ratio statistics:
    never a NaN from 0/0 (:func:`~cockpit_gradnoise.logs.schema.ratio_or_inf`).

    Needs no BackPACK extension and no ``info`` beyond Cockpit's ``loss``. It
    reads the tensors a few times and partitions each layer's ratios for the
    median (NumPy's vectorized selection on CPU,
    :func:`~cockpit_gradnoise.order_statistics.select_in_place`): a few
    nanoseconds per element on one core, independent of the batch size.

    Args:
        track_schedule: Function from step to bool.
        param_names: Names of the Cockpit's parameters, in order.
        verbose: Print what is computed.
    """

    #: Under FSDP2 each parameter and its gradient are all-gathered in turn (one at a
    #: time, as FSDP2 unshards them), so the median is exact and the same everywhere.
    supports_fsdp2 = True
    supports_hsdp = True
    supports_tensor_parallel = True
    supports_fsdp2_tensor_parallel = True

    def step_context(self, step, params):
        """``{id(param): (param, its grad, ||theta||^2, ||grad||^2)}``: the squared norms of
        every parameter with a gradient and of its gradient, in one call for all
        (:func:`~cockpit_gradnoise.functional.squared_norms`). A gradient whose sum of
        squares is finite is known finite to the step (its check need not sum it)."""
        # Plain tensors: a DTensor's (tensor parallelism, FSDP2) are formed per parameter, as it is
        # gathered or collected for its value.
        with_grad = [(p, p.grad) for p in params if p.requires_grad and type(p) in _PLAIN
                     and type(p.grad) is torch.Tensor]
        found = functional.squared_norms([t for pair in with_grad for t in pair], defer=True)
        for i, (_, grad) in enumerate(with_grad):
            if isinstance(found[2 * i + 1], float) and math.isfinite(found[2 * i + 1]):
                step.note_finite(grad)  # NaN and inf propagate into the sum: the step's check is done
        return {id(p): (p, grad, found[2 * i], found[2 * i + 1]) for i, (p, grad) in enumerate(with_grad)}

    def parameter_value(self, param, context):
        theta, grad = param.detach(), param.grad.detach()
        known = context.get(id(param)) if isinstance(context, dict) else None  # a subclass's own context
        if known is not None and known[0] is param and known[1] is param.grad:
            theta_sq, grad_sq = known[2:]
        else:  # a parameter gathered for this call (FSDP2): its own
            # On a GPU, tensors left there until the step's one transfer.
            theta_sq = functional.squared_norm(theta, defer=True)
            grad_sq = functional.squared_norm(grad, defer=True)
        if known is not None and not _device.on_host(grad) and grad.numel():
            # On other devices the ratios' sorts of all parameters are shared: formed in
            # statistics_of_values (theta and grad are the parameter's own, held anyway).
            return theta_sq, grad_sq, functional.zero_count(grad), grad.numel(), _Ratios(theta, grad)
        # Floats on the CPU: finite sums of squares prove every element finite.
        all_finite = isinstance(theta_sq, float) and math.isfinite(theta_sq + grad_sq)
        if known is not None and 0 < grad.numel() <= order_statistics.SORT_WHOLE_AT_MOST:
            # Small parameters' ratios formed together, one table per size (statistics_of_values).
            return theta_sq, grad_sq, None, grad.numel(), _Small(theta, grad, all_finite)
        # The zeros counted by the ratios' own pass over grad == 0.
        ratios, zeros = functional.abs_ratio_statistics_and_zeros(
            theta, grad, defer=True, all_finite=all_finite)
        return theta_sq, grad_sq, zeros, grad.numel(), ratios

    def network_value(self, values):
        # Sums over parameters; per-element ratio statistics are per layer only.
        theta_sq, grad_sq, zeros, numel = (sum(value[k] for value in values) for k in range(4))
        return theta_sq, grad_sq, zeros, numel, {}

    def statistics_of_values(self, values, network):
        small = [k for k, value in enumerate(values) if isinstance(value[4], _Small)]
        if small:
            values = list(values)
            for k, (ratios, zeros) in zip(small, functional.abs_ratio_statistics_of_small(
                    [values[k][4] for k in small])):
                values[k] = values[k][:2] + (zeros, values[k][3], ratios)
        pending = [k for k, value in enumerate(values) if isinstance(value[4], _Ratios)]
        if pending:
            found = functional.abs_ratio_statistics_of_pairs([values[k][4] for k in pending])
            values = list(values)
            for k, ratios in zip(pending, found):
                values[k] = values[k][:4] + ({"ratio": ratios},)
        if _on_one_device(values):
            # On other devices the norm ratios and zero fractions of all parameters as vectors (the
            # same elementwise operations on the same numbers: a dozen launches, not seven a parameter).
            rows = _rows_together(values)
            return rows, self.statistics(self.network_value(values)) if network else None
        return super().statistics_of_values(values, network)

    def statistics(self, value):
        theta_sq, grad_sq, zeros, numel, ratio_statistics = value
        if isinstance(ratio_statistics, _Ratios):  # not formed with the others': alone
            ratio_statistics = {"ratio": functional.abs_ratio_statistics_of_pairs([ratio_statistics])[0]}
        if isinstance(ratio_statistics, _Small):
            ratio_statistics, zeros = functional.abs_ratio_statistics_of_small([ratio_statistics])[0]
        return {
            **ratio_statistics,
            ZERO_GRAD_FRACTION: zeros / numel,
            NORM_RATIO: functional.norm_ratio(theta_sq, grad_sq),
        }

    def statistic_names(self):
        return [*RATIO_STATISTICS, ZERO_GRAD_FRACTION, NORM_RATIO]


def _on_one_device(values) -> bool:
    """Whether every value's squared norms and zero count are 0-dim tensors of one dtype on one
    device other than the CPU, and its ratio statistics formed."""
    scalars = [t for value in values for t in value[:3]]
    return bool(values) and all(isinstance(t, Tensor) and t.dim() == 0 for t in scalars) \
        and len({(t.dtype, t.device) for t in scalars}) == 1 and not _device.on_host(scalars[0]) \
        and all(isinstance(value[4], dict) for value in values)


def _rows_together(values) -> list:
    """:meth:`ParamGradRatio.statistics` of each of ``values`` (:func:`_on_one_device`), the norm
    ratios and zero fractions of all together."""
    theta_sq, grad_sq, zeros = (torch.stack([value[k] for value in values]) for k in range(3))
    numels = _device.copied_without_waiting(torch.tensor([float(value[3]) for value in values], dtype=zeros.dtype),
                                            zeros.device)
    fractions, ratios = (zeros / numels).unbind(), functional.norm_ratio(theta_sq, grad_sq).unbind()
    return [{**value[4], ZERO_GRAD_FRACTION: fraction, NORM_RATIO: ratio}
            for value, fraction, ratio in zip(values, fractions, ratios)]


class _Ratios(NamedTuple):
    """A parameter whose ratio statistics are formed with the other parameters'
    (:func:`~cockpit_gradnoise.functional.abs_ratio_statistics_of_pairs`)."""

    theta: Tensor
    grad: Tensor


class _Small(NamedTuple):
    """A parameter of at most ``SORT_WHOLE_AT_MOST`` elements on the CPU whose ratio statistics
    and zero count are formed with the other small ones'
    (:func:`~cockpit_gradnoise.functional.abs_ratio_statistics_of_small`)."""

    theta: Tensor
    grad: Tensor
    all_finite: bool
