"""Load a Llama-family checkpoint from a local Hugging Face directory or GGUF file.

Weights stream from ``*.safetensors`` (a single file, or shards listed by
``model.safetensors.index.json``), or from a GGUF file dequantized tensor by
tensor or kept quantized (:mod:`.gguf_checkpoint`; a directory may name its GGUF
file in a :data:`~.gguf_checkpoint.GGUF_POINTER_FILE`), straight into our modules, one tensor at a
time, cast to the chosen dtype on the way. No transformers model is built.

A directory may instead declare random weights (vLLM's "dummy" load format):
:func:`write_random_model_dir` writes a ``config.json`` plus a
``legato-random-weights.json`` marker naming a seed, and loading it fills the
parameters on the target device, so benchmarks can run a model of any shape
(a Llama-3-8B-shaped one included) without a checkpoint on disk.

Never imports trio or transformers.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .attention_backend import Backend
from .config import ModelConfig, read_json
from .gguf_checkpoint import forget_gguf, gguf_weights_file, iter_gguf_quantized, open_gguf
from .layers import RMSNorm
from .llama import LlamaForCausalLM
from .quantized import QuantizedWeight
from .registry import resolve_architecture

RANDOM_WEIGHTS_FILE = "legato-random-weights.json"


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


def iter_weights(
    model_dir: str | Path, *, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``(name, tensor)`` for every tensor of the checkpoint, on CPU, in file dtype
    (fp32 for a GGUF file, dequantized: see :mod:`.gguf_checkpoint`; with
    ``keep_quantized`` its quantized matrices come as :class:`~.quantized.QuantizedWeight`)."""
    gguf = gguf_weights_file(model_dir)
    if gguf is not None:
        yield from iter_gguf_quantized(open_gguf(gguf), keep_quantized=keep_quantized)
        return
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def write_random_model_dir(
    out_dir: str | Path, config: dict[str, Any], *, seed: int = 0, std: float = 0.02
) -> Path:
    """Write a weightless model directory: ``config`` as config.json plus the random-weights marker.

    Loading it gives parameters drawn as :func:`init_random_weights` does
    (``seed``, ``std``). Returns the directory (created if needed).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": seed, "std": std}))
    return out


def init_random_weights(model: torch.nn.Module, *, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` in place: RMSNorm weights 1, biases 0, every other parameter N(0, std).

    Drawn on the parameters' device from one generator seeded ``seed`` (the
    values differ between CPU and CUDA); tied parameters are drawn once.
    """
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generator: torch.Generator | None = None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if id(param) in norms:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)


def fill_weights(
    model: LlamaForCausalLM, model_dir: str | Path, *, keep_quantized: bool = False
) -> None:
    """Fill ``model``'s parameters from ``model_dir``: its checkpoint, or random weights
    when the directory carries the :data:`RANDOM_WEIGHTS_FILE` marker. ``keep_quantized``:
    a GGUF file's quantized matrices stay quantized (see :mod:`.quantized`)."""
    marker = Path(model_dir) / RANDOM_WEIGHTS_FILE
    if marker.exists():
        spec = read_json(marker)
        init_random_weights(model, seed=int(spec.get("seed", 0)), std=float(spec.get("std", 0.02)))
        return
    with torch.no_grad():
        model.load_weights(iter_weights(model_dir, keep_quantized=keep_quantized))
    if gguf_weights_file(model_dir) is not None:
        forget_gguf()  # every tensor was copied out of the file's memory map
    return_freed_heap()


def return_freed_heap() -> None:
    """Hand the free pages of the C heap back to the kernel (glibc's ``malloc_trim``; a no-op
    where the C library has none). Loading frees many mid-sized temporaries (a checkpoint
    tensor before its cast, a GGUF tensor's blocks while they are repacked) that glibc keeps
    resident for reuse: about 50 MB after loading the default model."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


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
    *,
    keep_quantized: bool = False,
) -> LlamaForCausalLM:
    """Build the model and fill it from ``model_dir`` (see :func:`fill_weights`)."""
    model = build_model(cfg, backend, dtype, device, max_positions)
    fill_weights(model, model_dir, keep_quantized=keep_quantized)
    return model
