"""The default model as an fp32 Hugging Face directory, for the serving figures.

``legato serve`` reads the default model's weights from its GGUF file, kept quantized; its
converted directory in ``$LEGATO_HOME`` holds only the config, the tokenizer and the file's
name, which vLLM cannot load. The serving comparison (``serve_compare.sh`` of the vLLM anchor,
and ``serve_profile.sh`` here) runs both engines on one ordinary fp32 checkpoint instead: this
writes it once (the shipped file dequantized, :func:`legato.models.gguf_convert.convert_gguf`)
into ``$LEGATO_HOME/SmolLM2-135M-Instruct-fp32`` and prints its path; later runs print it at
once.

    ../shared/anchors/vllm-cpu/serve_compare.sh .venv/bin/legato "$(.venv/bin/python benchmarks/fp32_model_dir.py)"
"""

from __future__ import annotations

from pathlib import Path

import common  # noqa: F401  (the offline environment)

from legato.default_model import DEFAULT_MODEL_NAME, default_model_gguf
from legato.model_cache import build_atomically, legato_home
from legato.models.gguf_convert import convert_gguf

MARKER_FILE = "legato-fp32-conversion.json"


def fp32_model_dir() -> Path:
    """The directory, converted on the first call (seconds) and again when the shipped file
    changes (its path and size are the build's marker)."""
    gguf = default_model_gguf()
    marker = {"source_path": str(gguf.resolve()), "source_bytes": gguf.stat().st_size}
    out = legato_home() / f"{DEFAULT_MODEL_NAME}-fp32"
    return build_atomically(
        out,
        MARKER_FILE,
        marker,
        lambda tmp: convert_gguf(gguf, tmp, label=DEFAULT_MODEL_NAME),
        f"{out} exists but is not this script's conversion of {gguf.name}; remove it",
    )


if __name__ == "__main__":
    print(fp32_model_dir())
