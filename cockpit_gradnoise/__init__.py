"""cockpit-gradnoise: is my batch too noisy for my learning rate, layer by layer?

Importing this package makes ``import cockpit`` work on setuptools >= 82 and
imports nothing heavy: torch, Cockpit and matplotlib load when a name that
needs them is first used (PEP 562), so the command line starts fast.
"""

import importlib

from cockpit_gradnoise._compat import install_cockpit_hook

install_cockpit_hook()

# Public name -> (module, attribute); attribute None means the module itself.
_EXPORTS = {
    "Cockpit": ("cockpit", "Cockpit"),
    "CockpitPlotter": ("cockpit", "CockpitPlotter"),
    "functional": ("cockpit_gradnoise.functional", None),
    "references": ("cockpit_gradnoise.references", None),
    "schema": ("cockpit_gradnoise.logs.schema", None),
    "distributed": ("cockpit_gradnoise.distributed", None),
    "read_log": ("cockpit_gradnoise.logs.frame", "read_log"),
    "to_frame": ("cockpit_gradnoise.logs.frame", "to_frame"),
    "write_log": ("cockpit_gradnoise.logs.frame", "write_log"),
    "LogStream": ("cockpit_gradnoise.logs.stream", "LogStream"),
    "plot": ("cockpit_gradnoise.views.sources", "plot"),
    "panels": ("cockpit_gradnoise.views.panels", None),
    "report": ("cockpit_gradnoise.views.sources", "report"),
    "advice": ("cockpit_gradnoise.views.sources", "advice"),
    "BatchSchedule": ("cockpit_gradnoise.schedule.batch_schedule", "BatchSchedule"),
    "track": ("cockpit_gradnoise.tracking", "track"),
    "configuration": ("cockpit_gradnoise.quantities.presets", "configuration"),
    "Tracker": ("cockpit_gradnoise.tracking", "Tracker"),
    "minibatch_gradient_stats": ("cockpit_gradnoise.minibatch", "minibatch_gradient_stats"),
    "dataset_gradient": ("cockpit_gradnoise.minibatch", "dataset_gradient"),
    "NETWORK": ("cockpit_gradnoise.logs.schema", "NETWORK"),
    "prepare_model": ("cockpit_gradnoise.prepare", "prepare_model"),
    "sequence_losses": ("cockpit_gradnoise.losses", "sequence_losses"),
    "check_model": ("cockpit_gradnoise.check", "check_model"),
    "convert_attention": ("cockpit_gradnoise.attention", "convert_attention"),
    "restore_attention": ("cockpit_gradnoise.attention", "restore_attention"),
    "LinearAttention": ("cockpit_gradnoise.attention", "LinearAttention"),
    "register_extensions": ("cockpit_gradnoise.extensions", "register_extensions"),
    "unregister_extensions": ("cockpit_gradnoise.extensions", "unregister_extensions"),
    "ParameterQuantity": ("cockpit_gradnoise.quantities", "ParameterQuantity"),
    "TwoStepParameterQuantity": ("cockpit_gradnoise.quantities", "TwoStepParameterQuantity"),
    "Step": ("cockpit_gradnoise.step", "Step"),
    "Batch": ("cockpit_gradnoise.step", "Batch"),
    "GradientVarianceQuantiles": ("cockpit_gradnoise.quantities", "GradientVarianceQuantiles"),
    "PerExampleGradNorm": ("cockpit_gradnoise.quantities", "PerExampleGradNorm"),
    "ParamGradRatio": ("cockpit_gradnoise.quantities", "ParamGradRatio"),
    "UpdateSize": ("cockpit_gradnoise.quantities", "UpdateSize"),
    "GradientNoiseScale": ("cockpit_gradnoise.quantities", "GradientNoiseScale"),
    "TwoBatchNoiseScale": ("cockpit_gradnoise.quantities", "TwoBatchNoiseScale"),
    "PreconditionedNoiseScale": ("cockpit_gradnoise.quantities", "PreconditionedNoiseScale"),
}

__all__ = ["__version__", *_EXPORTS]

def _version() -> str:
    """The installed version (importlib.metadata: 60 ms to import, so only when asked)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cockpit-gradnoise")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


def __getattr__(name):
    if name == "__version__":
        globals()[name] = _version()
        return globals()[name]
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'cockpit_gradnoise' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
