#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV=${LEGATO_VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/mypy" --strict src
"$VENV/bin/lint-imports"
"$VENV/bin/python" -m pytest "$@"
