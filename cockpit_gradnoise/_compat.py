"""Make ``import cockpit`` work where ``pkg_resources`` no longer exists.

Cockpit 1.0.2 imports ``pkg_resources`` (removed in setuptools 82) in its
``__init__`` only to read its own version string. Before importing Cockpit we
install a two-name stand-in for that module backed by ``importlib.metadata``,
and remove it again right after, so no other package sees a fake
``pkg_resources``.
"""

import importlib.metadata
import sys
import types


def _pkg_resources_stand_in():
    """Return a module providing the two names Cockpit's ``__init__`` uses."""
    module = types.ModuleType("pkg_resources")

    class DistributionNotFound(Exception):
        """Raised when a distribution is not installed."""

    def get_distribution(name):
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


def import_cockpit():
    """Import and return the ``cockpit`` package, with or without pkg_resources."""
    if "cockpit" in sys.modules:
        return sys.modules["cockpit"]
    try:
        import pkg_resources  # noqa: F401

        has_pkg_resources = True
    except ImportError:
        has_pkg_resources = False
    if has_pkg_resources:
        import cockpit

        return cockpit
    sys.modules["pkg_resources"] = _pkg_resources_stand_in()
    try:
        import cockpit
    finally:
        del sys.modules["pkg_resources"]
    return cockpit
