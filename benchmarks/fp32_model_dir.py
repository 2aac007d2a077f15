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

import shutil

import common  # noqa: F401  (the offline environment)

from legato.default_model import DEFAULT_MODEL_NAME, default_model_gguf
from legato.model_cache import legato_home
from legato.models.gguf_convert import convert_gguf


def main() -> None:
    out = legato_home() / f"{DEFAULT_MODEL_NAME}-fp32"
    if not (out / "model.safetensors").exists():
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        convert_gguf(default_model_gguf(), partial, label=DEFAULT_MODEL_NAME)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    print(out)


if __name__ == "__main__":
    main()
