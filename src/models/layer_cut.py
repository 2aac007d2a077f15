"""``cut_layers``: a draft checkpoint made from a model by keeping its first layers.

A draft model must share the target's tokenizer; where no smaller model of the same
family is at hand, the target's embeddings, some of its decoder layers, final norm
and LM head make one. Without training, such a cut predicts the whole model's
next token poorly (SmolLM2-135M's first 8 of 30 layers: a few percent of drafts
accepted); a full copy predicts it exactly, which tests use. Reads and writes safetensors directly (no model class is built, so it
takes a second and little memory beyond the kept tensors); a GGUF-backed directory
is refused: convert it with weights first (:func:`~.gguf_convert.convert_gguf`).

Never imports trio.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .loader import safetensors_files

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_COPIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def cut_layers(src_dir: str | Path, out_dir: str | Path, layers: int | Sequence[int]) -> Path:
    """Write into ``out_dir`` (created) ``src_dir``'s checkpoint with only some of its
    decoder layers (``layers``: the first that many, or their indices, in order),
    renumbered from 0, its config saying so, and its tokenizer files. ValueError when
    ``src_dir`` has no safetensors or not those layers. Blocks."""
    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    have = int(config["num_hidden_layers"])
    kept_layers = list(range(layers)) if isinstance(layers, int) else list(layers)
    if not kept_layers or not all(0 <= i < have for i in kept_layers):
        raise ValueError(f"layers: {src} has {have} layers, asked to keep {layers}")
    new_index = {old: new for new, old in enumerate(kept_layers)}
    try:
        files = safetensors_files(src)
    except FileNotFoundError as exc:
        raise ValueError(f"{exc} (convert a GGUF model with its weights first)") from exc
    out.mkdir(parents=True, exist_ok=True)
    kept: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            m = _LAYER_RE.match(name)
            if m is None:
                kept[name] = tensor.contiguous()
            elif int(m.group(1)) in new_index:
                renamed = f"model.layers.{new_index[int(m.group(1))]}.{name[m.end() :]}"
                kept[renamed] = tensor.contiguous()
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = len(kept_layers)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in kept_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).exists():
            shutil.copy2(src / name, out / name)
    return out
