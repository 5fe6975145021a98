#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the package with its test extras.
# torch is pinned here (scripts/constraints.txt), not in setup.cfg: 2.14.1
# installs from local files, and the constraints keep the test extras
# (transformers, timm) from pulling another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=82" wheel
.venv/bin/python -m pip install -q -c scripts/constraints.txt torch torchvision
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test,experiments]"
