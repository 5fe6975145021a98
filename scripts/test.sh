#!/usr/bin/env bash
# The test suite: set up, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
