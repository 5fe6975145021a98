#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the package with its test extras.
# torch is pinned here, not in setup.cfg: 2.14.1 installs from local files.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=82" wheel
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q -e ".[test,experiments]"
