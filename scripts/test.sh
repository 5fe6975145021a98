#!/usr/bin/env bash
# The test suite: set up, lint, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/ruff check .   # the linter, configured in pyproject.toml
.venv/bin/lint-imports --no-cache   # the import rules between the package's rooms, in .importlinter
.venv/bin/python -m pytest -q "$@"
