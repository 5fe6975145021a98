"""The import structure: every module imports first, and no loop, not even through a package.

``.importlinter`` holds the rules between the package's rooms (``lint-imports`` runs them
in ``scripts/test.sh``); these tests check what its contracts cannot see: an import loop
that runs through a package's ``__init__`` (importing ``a.b`` runs ``a/__init__`` first),
and the failure such a loop causes, a module that cannot be imported first.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grimp
import networkx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cockpit_gradnoise"


def package_modules():
    """Every module of the package, by its files (packages by their ``__init__``)."""
    names = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def ancestors(module):
    parts = module.split(".")
    return {".".join(parts[:k]) for k in range(1, len(parts))}


def import_graph():
    """Direct imports (lazy ones included), plus the packages each import runs.

    ``import a.b.c`` from outside ``a`` runs ``a/__init__`` and ``a/b/__init__`` before
    ``c``: an edge to each of those packages that is not already an ancestor of the
    importer (whose own packages were initialized before it ran).
    """
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    edges = networkx.DiGraph()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            edges.add_edge(importer, imported)
            for package in ancestors(imported) - ancestors(importer) - {importer}:
                edges.add_edge(importer, package)
    return edges


def loops(edges):
    return [sorted(group) for group in networkx.strongly_connected_components(edges) if len(group) > 1]


def test_loop_detection_sees_a_loop_through_a_package():
    # The loop this repository once had: a package's __init__ imports a module of the
    # root, which imports another module of that package (so runs its __init__).
    edges = networkx.DiGraph()
    for importer, imported in [("p.q", "p.two"), ("p.two", "p.q.noise")]:
        edges.add_edge(importer, imported)
        for package in ancestors(imported) - ancestors(importer) - {importer}:
            edges.add_edge(importer, package)
    assert loops(edges) == [["p.q", "p.two"]]


def test_no_import_loop_anywhere():
    assert loops(import_graph()) == []


def test_the_graph_covers_the_package():
    # Guards the two tests above against an empty or partial graph.
    assert set(grimp.build_graph(PACKAGE, cache_dir=None).modules) == set(package_modules())
    assert import_graph().number_of_edges() > 100


def test_every_module_imports_first():
    modules = package_modules()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), MPLBACKEND="Agg")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fresh_imports.py"), *modules],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    failures = {module: error for module, error in json.loads(result.stdout).items() if error}
    assert set(json.loads(result.stdout)) == set(modules)
    assert not failures, "\n\n".join(f"{module}:\n{error}" for module, error in failures.items())


def test_the_architecture_page_names_every_contract_and_room():
    page = (ROOT / "docs" / "architecture.md").read_text()
    contracts = re.findall(r"^\[importlinter:contract:([\w-]+)\]$", (ROOT / ".importlinter").read_text(), re.M)
    assert len(contracts) >= 7
    assert [c for c in contracts if f"`{c}`" not in page] == []
    rooms = {path.stem for path in (ROOT / PACKAGE).iterdir()
             if path.name != "__init__.py" and (path.suffix == ".py" or (path / "__init__.py").exists())}
    assert [room for room in sorted(rooms) if room not in page] == []
