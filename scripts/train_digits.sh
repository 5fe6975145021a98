#!/usr/bin/env bash
# The main job: set up, then a short real training run on scikit-learn's digits.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
.venv/bin/python -m experiments.train_digits "$@"
