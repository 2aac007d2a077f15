"""Write a GGUF checkpoint out as a Hugging Face model directory.

:func:`convert_gguf` writes config.json, generation_config.json, one
model.safetensors and the tokenizer files (chat template included) that
transformers builds from the GGUF. Every tensor is stored in the dtype that
holds it exactly once dequantized (fp32 for quantized ones, fp16 / bf16 as
stored), so loading the directory gives the same weights as loading the file,
and the directory is an ordinary checkpoint that transformers loads as well.

All tensors are held in memory until the single file is written: meant for
small models (the embedded default is 135M parameters, 0.5 GiB in fp32).

Never imports trio.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..tokenizer_loading import load_gguf_tokenizer
from .gguf_checkpoint import (
    GGUF_POINTER_FILE,
    gguf_hf_config,
    iter_gguf_weights,
    open_gguf,
    stored_dtypes,
)


def convert_gguf(
    gguf_path: str | os.PathLike[str], out_dir: Path, *, label: str, weights: bool = True
) -> None:
    """Convert ``gguf_path`` into the existing, empty directory ``out_dir``.

    ``weights`` False: no model.safetensors; a :data:`~.gguf_checkpoint.GGUF_POINTER_FILE`
    names ``gguf_path`` instead, so the weights are read from the GGUF file (kept
    quantized on the CPU) and only the config and the tokenizer are converted (they
    load in a fraction of a second from the directory, against seconds from the file).
    Shows a progress bar (``label``, tensors done) on stderr while converting weights.
    Raises ModelLoadError for a file :func:`~.gguf_checkpoint.open_gguf` refuses.
    Blocks: seconds for a small model, most of it dequantizing.
    """
    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    if weights:
        _write_weights(reader, out_dir, label)
    else:
        pointer = {"gguf": str(Path(gguf_path).resolve())}
        (out_dir / GGUF_POINTER_FILE).write_text(json.dumps(pointer, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[key] is not None
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    load_gguf_tokenizer(gguf_path).save_pretrained(str(out_dir))


def _write_weights(reader: Any, out_dir: Path, label: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    dtypes = stored_dtypes(reader)
    tensors: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=len(dtypes),
        desc=f"converting {label}",
        unit="tensor",
        file=sys.stderr,
        mininterval=0.5,
    )
    with bar:
        for name, tensor in iter_gguf_weights(reader):
            tensors[name] = tensor.to(dtypes[name]).contiguous()
            bar.update(1)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
