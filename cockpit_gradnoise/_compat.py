"""Make ``import cockpit`` work where ``pkg_resources`` no longer exists.

Cockpit 1.0.2 imports ``pkg_resources`` (removed in setuptools 82) in its
``__init__`` only to read its own version string. :func:`install_cockpit_hook`
puts a finder on ``sys.meta_path`` that, when ``cockpit`` is first imported (by
anyone), runs Cockpit's ``__init__`` with a two-name stand-in for
``pkg_resources`` backed by ``importlib.metadata`` and removes the stand-in
right after, so no other package sees a fake ``pkg_resources``. Installing the
hook imports nothing; Cockpit is imported only when somebody asks for it.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


def _pkg_resources_stand_in():
    """Return a module providing the two names Cockpit's ``__init__`` uses."""
    module = types.ModuleType("pkg_resources")

    class DistributionNotFound(Exception):
        """Raised when a distribution is not installed."""

    def get_distribution(name):
        import importlib.metadata  # only here: importing it is a tenth of the CLI's start

        # "cockpit" is installed as the distribution "cockpit-for-pytorch".
        dists = importlib.metadata.packages_distributions().get(name, [name])
        try:
            version = importlib.metadata.version(dists[0])
        except importlib.metadata.PackageNotFoundError as error:
            raise DistributionNotFound(name) from error
        return types.SimpleNamespace(project_name=name, version=version)

    module.DistributionNotFound = DistributionNotFound
    module.get_distribution = get_distribution
    return module


class _CockpitLoader(importlib.abc.Loader):
    """Runs Cockpit's own loader with the stand-in ``pkg_resources`` in place."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if "pkg_resources" in sys.modules:
            return self._loader.exec_module(module)
        sys.modules["pkg_resources"] = _pkg_resources_stand_in()
        try:
            self._loader.exec_module(module)
        finally:
            del sys.modules["pkg_resources"]


class _CockpitFinder(importlib.abc.MetaPathFinder):
    """Finds ``cockpit`` as usual and wraps its loader in :class:`_CockpitLoader`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "cockpit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or _has_pkg_resources():
            return spec
        spec.loader = _CockpitLoader(spec.loader)
        return spec


def _has_pkg_resources() -> bool:
    return importlib.util.find_spec("pkg_resources") is not None


def install_cockpit_hook():
    """Let a later ``import cockpit`` succeed without ``pkg_resources`` (idempotent)."""
    if not any(isinstance(finder, _CockpitFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CockpitFinder())


def import_cockpit():
    """Import and return the ``cockpit`` package, with or without pkg_resources."""
    install_cockpit_hook()
    import cockpit

    return cockpit
