"""Sphinx configuration of the cockpit-gradnoise documentation.

Build: ``scripts/docs.sh`` (warnings are errors). The markdown pages are read
by myst-parser; the API reference comes from the docstrings (Google style,
napoleon). The package is imported from this source tree, not from an
installed copy, so the reference describes the code beside it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

project = "cockpit-gradnoise"
author = "the cockpit-gradnoise authors"
copyright = "the cockpit-gradnoise authors, MIT license"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "cgn_docs",  # docs/_ext: the command line's help and the benchmark's rows, read at build time
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# Markdown: $...$ and $$...$$ for maths, anchors for links to sections.
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# Docstrings are Google style.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Cross-references to names outside this documentation (torch, pandas, Cockpit)
# stay plain text instead of failing the build: there is no intersphinx
# inventory to resolve them (the build runs without network).
nitpicky = False

html_theme = "furo"
html_title = "cockpit-gradnoise"
