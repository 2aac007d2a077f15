"""ModelConfig: what the model code needs from a checkpoint's config.json (or GGUF metadata).

Read straight from the JSON (no transformers import: it is slow to import and
not needed for a handful of fields). Both spellings of the rotary settings are
understood: transformers 5's ``rope_parameters`` and the older
``rope_theta`` + ``rope_scaling``. Also the dtype rule ("auto" = the config's
dtype, but fp32 on CPU when that is fp16) and the EOS ids from
generation_config.json / config.json.

Never imports trio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .gguf_checkpoint import gguf_hf_config, is_gguf_path, open_gguf

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings: ``rope_type`` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture figures of one decoder-only Llama-family checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    config_dtype: torch.dtype | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a clear error if it is missing or not an object."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: is this a Hugging Face model directory?"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )


def _eos_ids(*values: Any) -> tuple[int, ...]:
    out: list[int] = []
    for value in values:
        ids = value if isinstance(value, list) else [value]
        for token_id in ids:
            if isinstance(token_id, int) and token_id not in out:
                out.append(token_id)
    return tuple(out)


def load_model_config(model: str | Path) -> ModelConfig:
    """Parse ``model/config.json`` (and generation_config.json for EOS ids), or the
    metadata of ``model`` when it is a GGUF file."""
    if is_gguf_path(model):
        return model_config_from_dict(gguf_hf_config(open_gguf(model)), {})
    root = Path(model)
    raw = read_json(root / "config.json")
    gen_path = root / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else {}
    return model_config_from_dict(raw, gen)


def model_config_from_dict(raw: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from config.json's and generation_config.json's contents."""
    architectures = raw.get("architectures") or []
    model_type = str(raw.get("model_type", ""))
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = raw.get("head_dim") or hidden // num_heads
    dtype_name = raw.get("dtype") or raw.get("torch_dtype")
    sliding = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        architecture=str(architectures[0]) if architectures else "",
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope_from(raw),
        hidden_act=str(raw.get("hidden_act", "silu")),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        config_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
        eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        raw=raw,
    )


def resolve_dtype(
    requested: str, config_dtype: torch.dtype | None, device: torch.device
) -> torch.dtype:
    """``requested`` ("auto" or a dtype name) to a torch dtype.

    "auto" is the checkpoint's dtype (fp32 when it names none), except that
    fp16 becomes fp32 on CPU, where half precision is slow and inexact.
    """
    if requested != "auto":
        try:
            return _DTYPES[requested]
        except KeyError:
            raise ValueError(f"dtype: unknown dtype {requested!r}") from None
    dtype = config_dtype or torch.float32
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype


def resolve_device(requested: str) -> torch.device:
    """ "auto" → cuda when available, else cpu; "cuda" without a GPU is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch sees no CUDA device")
    return torch.device(requested)
