"""What is stored: the schema of the numbers, the streamed log, the tidy frame.

No torch, Cockpit, BackPACK or matplotlib is imported here, and pandas only
where a frame is built: :func:`read_log`, :func:`write_log`, :func:`to_frame`
and :class:`LogStream` load their module when first used (PEP 562).
"""

import importlib

# Public name -> module.
_EXPORTS = {
    "read_log": "cockpit_gradnoise.logs.frame",
    "write_log": "cockpit_gradnoise.logs.frame",
    "to_frame": "cockpit_gradnoise.logs.frame",
    "LogStream": "cockpit_gradnoise.logs.stream",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    try:
        module_name = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'cockpit_gradnoise.logs' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
