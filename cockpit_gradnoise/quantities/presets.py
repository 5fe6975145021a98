"""Presets and options: which quantities a label or a list names, built with their options.

As Cockpit's ``configuration("full")`` turns a label into quantities:
:func:`configuration` gives the quantity instances of a preset of
:data:`PRESETS` or a list, named after a model's parameters; the front door
(:func:`~cockpit_gradnoise.track`) builds its quantities the same way.
"""

import inspect
import numbers
from typing import Callable, Mapping, Optional, Sequence, Union

from cockpit_gradnoise import quantities as package_quantities

import cockpit.quantities
from cockpit.utils.schedules import linear
from torch import nn

#: The package's quantities, in the order of the explicit API's documentation.
ALL = (
    "GradientVarianceQuantiles",
    "PerExampleGradNorm",
    "ParamGradRatio",
    "UpdateSize",
    "GradientNoiseScale",
)

#: Preset label -> quantity class names. ``"cheap"`` leaves out
#: GradientVarianceQuantiles, the most expensive of the five (a second
#: parameter-sized sum per parameter and a sort of every gradient element,
#: ``docs/benchmark.md``): what stays needs one BackPACK extension, the
#: per-example squared norms, shared by PerExampleGradNorm and
#: GradientNoiseScale, and ParamGradRatio and UpdateSize read only ``param``
#: and ``param.grad``.
#: ``"norms"``: no per-example gradient, no BackPACK extension, for large runs:
#: the noise scale from micro-batch and process gradient norms
#: (:class:`~cockpit_gradnoise.TwoBatchNoiseScale`, needs gradient accumulation
#: or several processes), and the two quantities that read ``param``,
#: ``param.grad`` and the update.
#: ``"adaptive"``: the five and the noise scale Adam sees
#: (:class:`~cockpit_gradnoise.PreconditionedNoiseScale`, which reads the optimizer's
#: state: pass ``optimizer=`` to the tracker), for Adam, AdamW, RMSprop or Adagrad.
PRESETS = {"all": ALL, "cheap": ALL[1:],
           "norms": ("TwoBatchNoiseScale", "ParamGradRatio", "UpdateSize"),
           "adaptive": (*ALL, "PreconditionedNoiseScale")}

#: A preset's own options per class when the tracker tracks every step (``every=1``), under
#: the user's ``options`` (which override them). ``"norms"``: ParamGradRatio and UpdateSize at
#: every :data:`NORMS_DETAIL_EVERY`-th step (``"every"``, :func:`build_quantities`): the noise
#: scale a batch schedule reads stays at every step, and the two quantities that describe the
#: weights cost a tenth (``docs/gradient-noise-scale.md``, "Cadence"). With a sparser ``every``
#: they run at the tracker's steps. ``options={"ParamGradRatio": {"every": 1}}`` puts one back
#: at every step.
NORMS_DETAIL_EVERY = 10
PRESET_OPTIONS = {"norms": {"ParamGradRatio": {"every": NORMS_DETAIL_EVERY},
                            "UpdateSize": {"every": NORMS_DETAIL_EVERY}}}


def schedule_of(every: Union[int, Callable[[int], bool]]) -> Callable[[int], bool]:
    """The track schedule of ``every``: an int ``k`` is Cockpit's ``linear(k)``, a function itself.

    Raises:
        ValueError: If ``every`` is neither a positive int nor a function of the step.
    """
    if callable(every):
        return every
    if isinstance(every, bool) or not isinstance(every, numbers.Integral) or every < 1:
        raise ValueError(
            f"every must be a positive int (track every k-th step) or a schedule "
            f"function step -> bool (cockpit.utils.schedules), got {every!r}"
        )
    return linear(int(every))


def trainable_names(model: nn.Module) -> list:
    """Names of ``model``'s parameters that require gradients, in model order.

    They are the names, in the order, of the parameters a :class:`~cockpit_gradnoise.Tracker`
    gives its ``Cockpit`` (``[p for p in model.parameters() if p.requires_grad]``).

    Raises:
        ValueError: If no parameter requires gradients.
    """
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no parameter that requires gradients: "
            "unfreeze the ones to track (param.requires_grad_(True)) before tracking"
        )
    return names


def configuration(
    quantities: Union[str, Sequence] = "all",
    every: Union[int, Callable[[int], bool]] = 10,
    model: Optional[nn.Module] = None,
    *,
    param_names: Optional[Sequence[str]] = None,
    quantiles: Optional[Sequence[float]] = None,
    options: Optional[Mapping[str, Mapping]] = None,
    verbose: bool = False,
) -> list:
    """Quantity instances for a preset or a list, as Cockpit's ``configuration`` builds them.

    Args:
        quantities: A preset of :data:`PRESETS` (``"all"``: the five;
            ``"cheap"``: all but GradientVarianceQuantiles; ``"norms"``: TwoBatchNoiseScale,
            ParamGradRatio and UpdateSize; ``"adaptive"``: the five
            and PreconditionedNoiseScale), or a list of
            quantity classes, their names (this package's five, or Cockpit's
            own such as ``"GradNorm"``) and instances (used as they are).
        every: Track every ``every``-th step (Cockpit's ``linear(every)``), or
            a schedule function ``step -> bool``.
        model: The model whose trainable parameters the quantities describe:
            each quantity that takes ``param_names`` gets
            :func:`trainable_names` of it.
        param_names: The names to give instead (not with ``model``): those
            of the parameters handed to the ``Cockpit``, in its order.
        quantiles: The quantile levels of GradientVarianceQuantiles.
        options: Keyword arguments per class name, e.g.
            ``{"GradientNoiseScale": {"smoothing": 0.9}}``; ``"every"`` (an int or
            a schedule, as ``every``) runs that quantity only at the steps both
            it and ``every`` track. Over the preset's own (:data:`PRESET_OPTIONS`:
            with ``every=1``, ``"norms"`` runs ParamGradRatio and UpdateSize at every
            10th step).
        verbose: Cockpit's ``verbose`` for every quantity built here.

    Returns:
        The quantities, one per class.

    Raises:
        ValueError: For an unknown preset or name, two quantities of one class
            (Cockpit keys results by class name), ``quantiles``/``options``
            for a class that is not built here, or both ``model`` and
            ``param_names``.
    """
    if model is not None and param_names is not None:
        raise ValueError("give model= or param_names=, not both: names come from the model")
    plan = quantity_plan(quantities, quantiles, options, every)
    names = param_names
    if model is not None:
        trainable_names(model)  # refuses a model without trainable parameters
        names = {name: param for name, param in model.named_parameters() if param.requires_grad}
    return build_quantities(plan, schedule_of(every), names, verbose)


def quantity_plan(quantities, quantiles, options, every=None):
    """``[(class or instance, keyword arguments)]``, checked before anything is built; with
    ``every=1``, over the preset's :data:`PRESET_OPTIONS`."""
    given = options or {}
    preset = PRESET_OPTIONS.get(quantities, {}) if isinstance(quantities, str) and every == 1 else {}
    options = {name: dict(kwargs) for name, kwargs in preset.items()}
    for name, kwargs in given.items():  # the user's over the preset's
        options.setdefault(name, {}).update(kwargs)
    for kwargs in options.values():
        if "every" in kwargs:  # refused before anything is built
            schedule_of(kwargs["every"])
    if quantiles is not None:
        options.setdefault("GradientVarianceQuantiles", {})["quantiles"] = quantiles
    plan = [(entry, options.pop(entry.__name__, {}) if inspect.isclass(entry) else None)
            for entry in _entries(quantities)]
    classes = [entry.__name__ if kwargs is not None else type(entry).__name__
               for entry, kwargs in plan]
    if options:
        raise ValueError(
            f"options or quantiles given for {sorted(options)}, which are not built here "
            f"(built: {classes}): add them to quantities="
        )
    repeated = sorted({name for name in classes if classes.count(name) > 1})
    if repeated:
        raise ValueError(
            f"two quantities of class {repeated}: Cockpit keys results by class name, so "
            "one would overwrite the other; track one of each"
        )
    return plan


def build_quantities(plan, schedule, names, verbose):
    """The quantities of a :func:`quantity_plan`, on ``schedule``, named by ``names``."""
    built = []
    for entry, kwargs in plan:
        if kwargs is None:  # an instance
            built.append(entry)
            continue
        kwargs = {"verbose": verbose, **kwargs}
        own = schedule if "every" not in kwargs else both(schedule, schedule_of(kwargs.pop("every")))
        if getattr(entry, "needs_parameters", False):  # TwoBatchNoiseScale: hooks on them
            built.append(entry(track_schedule=own, param_names=names, **kwargs))
            continue
        if names is not None and "param_names" in inspect.signature(entry).parameters:
            kwargs.setdefault("param_names", names)
        built.append(entry(own, **kwargs))
    return built


def both(schedule: Callable[[int], bool], own: Callable[[int], bool]) -> Callable[[int], bool]:
    """The schedule of a quantity with an ``"every"`` option: the steps that the tracker's
    ``schedule`` and its ``own`` both track (never more often than the tracker's)."""
    def tracks(step: int) -> bool:
        return bool(schedule(step)) and bool(own(step))

    return tracks


def _entries(quantities):
    """The classes and instances that ``quantities`` (a preset or a list) names."""
    if isinstance(quantities, str):
        if quantities not in PRESETS:
            raise ValueError(
                f"unknown preset {quantities!r}: use one of {sorted(PRESETS)} or a list of "
                "quantity classes, names or instances"
            )
        quantities = PRESETS[quantities]
    return [_quantity_class(q) if isinstance(q, str) else q for q in quantities]


def _quantity_class(name):
    for home in (package_quantities, cockpit.quantities):
        found = getattr(home, name, None)
        if inspect.isclass(found) and issubclass(found, cockpit.quantities.quantity.Quantity):
            return found
    raise ValueError(
        f"unknown quantity {name!r}: use one of {list(ALL)} or a class of "
        "cockpit.quantities (e.g. 'GradNorm')"
    )


__all__ = ["configuration", "PRESETS", "PRESET_OPTIONS", "NORMS_DETAIL_EVERY", "ALL", "trainable_names",
           "schedule_of", "both"]
