#!/usr/bin/env bash
# Set up (if needed) and run legato's main job, `legato serve` on the embedded toy model
# (or any legato command given as arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${LEGATO_VENV:-.venv}/bin/legato" "${@:-serve}"
