"""Import each given module first, each in a process that has imported none of the package.

Run as a script by ``tests/test_imports.py``: ``python tests/fresh_imports.py MODULE ...``.
Starting one interpreter per module costs seconds each (torch's import); instead this
process imports the heavy third-party libraries once, never the package, and forks one
child per module: each child's first import of the package is that module. What an
import loop inside the package breaks (a name taken from a partially initialized
module) depends only on the package's own order, which the children see fresh.

Prints one JSON object, ``{module: null or the child's traceback}``.
"""

import json
import os
import sys
import traceback

#: Libraries the package uses, imported once before forking (none imports the package).
PRELOAD = ("numpy", "torch", "pandas", "matplotlib", "backpack", "lightning", "transformers")


def start_child(module: str):
    """Fork; the child imports ``module`` and writes its traceback (or nothing) to a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        message = b""
        try:
            __import__(module)
        except BaseException:  # noqa: BLE001 - every failure is the answer
            message = traceback.format_exc().encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    return pid, read


def finish_child(pid: int, read: int) -> "str | None":
    """The child's traceback, ``None`` if its import succeeded."""
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message or None


def import_each(modules, at_once: int):
    """``{module: traceback or None}``, ``at_once`` children at a time."""
    results, running = {}, []
    for module in modules:
        running.append((module, start_child(module)))
        if len(running) >= at_once:
            name, child = running.pop(0)
            results[name] = finish_child(*child)
    for name, child in running:
        results[name] = finish_child(*child)
    return results


def main(modules):
    assert not any(name.startswith("cockpit_gradnoise") for name in sys.modules)
    import matplotlib

    for name in PRELOAD:
        __import__(name)
    matplotlib.use("Agg")
    assert not any(name.startswith("cockpit_gradnoise") for name in sys.modules)
    print(json.dumps(import_each(modules, at_once=os.cpu_count() or 1)))


if __name__ == "__main__":
    main(sys.argv[1:])
