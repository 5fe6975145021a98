"""Checks that several quantities of one call make of the same per-element sums, made once.

:class:`~cockpit_gradnoise.GradientVarianceQuantiles` and
:class:`~cockpit_gradnoise.PreconditionedNoiseScale` read the same savefield of
:class:`~cockpit_gradnoise.extensions.SumsOfContributions` and check it for squares that
underflow lost (:func:`~cockpit_gradnoise.functional.unresolved_sums`) with the same floor:
the second takes the first's count (issue 34's cost: one pass over the network's sums).
"""

from typing import Any, Dict, Optional

from cockpit_gradnoise import functional
from cockpit_gradnoise.extensions import SUMS_SAVEFIELD

from torch import Tensor


def unresolved_sums_once(checks: Optional[Dict[Any, Any]], param: Tensor, squares: Tensor, total: Tensor,
                         n: int, loss_scale: float = 1.0, total_row: Optional[Tensor] = None) -> Any:
    """:func:`~cockpit_gradnoise.functional.unresolved_sums` of ``param``'s sums, computed once
    per call where both tensors are views of the savefield itself.

    A count depends only on the elements read and on ``n``, ``loss_scale`` and the dtype: the
    key is the views (address, shape, strides, dtype, version) and those numbers; for ``T``
    converted to its accumulation dtype (float64 sums of a float32 parameter, as the extensions
    keep them on other devices than the CPU), the row it was converted from and that dtype. The savefield lives
    until every quantity of the call has read it, and none alters it where two read it
    (GradientVarianceQuantiles forms sd over its sums only as their one reader; accumulation
    never adds into them in place): a view of it holds the same numbers for the whole call, and
    its address cannot be another tensor's. Sums that are not views of it (divided by a loss
    scale, a copy) are checked each time.

    Args:
        checks: The call's :attr:`Step.shared_checks <cockpit_gradnoise.step.Step.shared_checks>`
            (``None``: checked each time).
        param: The parameter whose savefield the sums come from.
        squares: ``S``, as :func:`~cockpit_gradnoise.functional.unresolved_sums` takes it.
        total: ``T``.
        n: ``N``.
        loss_scale: ``c`` where the sums are in units of ``g_i``.
        total_row: The savefield's row that ``total`` is converted from (``total =
            total_row.to(total.dtype)``, not divided), where ``total`` is not a view of it.
    """
    key = _key(checks, param, squares, total if total_row is None else total_row, total.dtype, n, loss_scale)
    if key is None:
        return functional.unresolved_sums(squares, total, n, loss_scale)
    if key not in checks:
        checks[key] = functional.unresolved_sums(squares, total, n, loss_scale)
    return checks[key]


def remember(checks: Optional[Dict[Any, Any]], param: Tensor, squares: Tensor, total_row: Tensor,
             total_dtype, n: int, count: Any) -> None:
    """Keep ``count``, :func:`~cockpit_gradnoise.functional.unresolved_sums` of ``param``'s sums
    found another way (several parameters' together), as :func:`unresolved_sums_once` would
    (``total = total_row.to(total_dtype)``, loss scale 1), for a later call's reader."""
    key = _key(checks, param, squares, total_row, total_dtype, n, 1.0)
    if key is not None:
        checks[key] = count


def _key(checks, param, squares, source, total_dtype, n, loss_scale) -> Optional[tuple]:
    """The count's key where ``squares`` and ``source`` are views of ``param``'s savefield
    and the call shares checks; else ``None``."""
    field = param.__dict__.get(SUMS_SAVEFIELD)
    if checks is None or not isinstance(field, Tensor) or not (_views(field, squares) and _views(field, source)):
        return None
    return (id(param), _where(squares), _where(source), total_dtype, n, float(loss_scale))


def _views(field: Tensor, tensor: Tensor) -> bool:
    """Whether ``tensor`` lies in ``field``'s memory (a view of it)."""
    return tensor.untyped_storage().data_ptr() == field.untyped_storage().data_ptr()


def _where(tensor: Tensor) -> tuple:
    """What a view reads: its address, shape, strides and dtype, and its version (bumped by
    every write in place into its memory, so a count never outlives the numbers it counted)."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor._version
