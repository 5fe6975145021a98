#!/usr/bin/env bash
# The documentation: set up, install the docs extra, build docs/_build/html
# with warnings as errors (open docs/_build/html/index.html).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/python -m pip install -q -e ".[docs]"
.venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html "$@"
