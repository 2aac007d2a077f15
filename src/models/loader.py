"""Load a Llama-family checkpoint from a local Hugging Face directory.

Weights stream from ``*.safetensors`` (a single file, or shards listed by
``model.safetensors.index.json``) straight into our modules, one tensor at a
time, cast to the chosen dtype on the way. No transformers model is built.

Never imports trio or transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .attention_backend import Backend
from .config import ModelConfig, read_json
from .llama import LlamaForCausalLM
from .registry import resolve_architecture


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards, else every ``*.safetensors``."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map") or {}
        files = sorted({root / str(name) for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    for path in files:
        if not path.exists():
            raise FileNotFoundError(f"weight shard {path} named by the index is missing")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the checkpoint, on CPU, in file dtype."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def build_model(
    cfg: ModelConfig,
    backend: Backend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """An empty model of ``cfg``'s architecture (weights uninitialised)."""
    model_class, cfg = resolve_architecture(cfg)
    model = model_class(cfg, backend, dtype, device, max_positions)
    model.eval()
    return model


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    backend: Backend,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaForCausalLM:
    """Build the model and fill it from the checkpoint in ``model_dir``."""
    model = build_model(cfg, backend, dtype, device, max_positions)
    with torch.no_grad():
        model.load_weights(iter_weights(model_dir))
    return model
