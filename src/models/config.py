"""ModelConfig: what the model code needs from a checkpoint's config.json (or GGUF metadata).

Read straight from the JSON (no transformers import: it is slow to import and
not needed for a handful of fields). Both spellings of the rotary settings are
understood: transformers 5's ``rope_parameters`` and the older
``rope_theta`` + ``rope_scaling``. Also the dtype rule ("auto" = the config's
dtype; on CPU bf16 only where the CPU computes it natively, else fp32) and the EOS ids from
generation_config.json / config.json.

Never imports trio.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .gguf_checkpoint import gguf_hf_config, is_gguf_path, open_gguf

logger = logging.getLogger(__name__)

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


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
"""Rotary scalings legato computes (:mod:`legato.models.rotary`), named as transformers does."""

_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs


@dataclass(frozen=True)
class RopeConfig:
    """Rotary settings, as transformers' ``rope_parameters`` names them.

    ``rope_type`` is one of :data:`ROPE_TYPES`. ``original_max_position_embeddings``
    is the pre-training window (llama3, yarn, longrope); ``max_position_embeddings``
    the config's, which dynamic NTK scales past and which yarn / longrope derive
    their factor from when the config gives none. ``freq_factors`` divide the
    inverse frequencies one by one (a GGUF file's ``rope_freqs`` tensor, which is
    how llama.cpp stores Llama 3's scaling).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's ``head_dim`` dims rotate (the first ones, as transformers)."""
        return int(head_dim * self.partial_rotary_factor)


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
    layer_types: tuple[str, ...] = ()  # per layer: "sliding_attention" or "full_attention"
    local_rope: RopeConfig | None = None  # the sliding layers' own rotary (Gemma 3), else None
    query_pre_attn_scalar: float | None = None  # attention scale = its -1/2 power (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # mixture of experts (Mixtral, Qwen2/3-MoE); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP
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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` routes to experts (as transformers' Qwen2/3-MoE decide)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer has it (then KV blocks that fall out of
        it can be released), else None."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return self.sliding_window if windows == {self.sliding_window} else None

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (it attends to its last that many positions,
        its own included), or None for full attention."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


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


def _local_rope_from(raw: dict[str, Any]) -> RopeConfig | None:
    """The sliding layers' own rotary settings where the config gives them (Gemma 3:
    ``rope_parameters["sliding_attention"]``, or the older ``rope_local_base_freq``)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return _rope_from(raw, "sliding_attention")
    if raw.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return None


def _rope_from(raw: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    """The rotary settings in ``raw`` (config.json): ``rope_parameters`` (transformers 5,
    possibly per layer type: ``layer_type``'s) or the older ``rope_theta`` + ``rope_scaling``
    (``type`` or ``rope_type``). Raises ``ValueError`` naming an unknown rope type or a
    missing field."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if raw.get("model_type") == "phi3" and rope_type == "yarn":
        rope_type = "longrope"  # early Phi-3 configs, as transformers reads them
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type: {rope_type!r} is not supported "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    max_pos = int(raw.get("max_position_embeddings", 2048))
    # Phi-3 keeps the pre-training window at top level, and it wins (as in transformers)
    orig = raw.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    if orig is None and rope_type in ("llama3", "yarn", "longrope"):
        orig = max_pos
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and orig:
        factor = max_pos / int(orig)
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0)
    if rope_type == "longrope" and not (params.get("short_factor") and params.get("long_factor")):
        raise ValueError("rope_parameters: longrope needs short_factor and long_factor")

    def optional(key: str) -> float | None:
        value = params.get(key)
        return float(value) if value is not None else None

    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        max_position_embeddings=max_pos,
        attention_factor=optional("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        freq_factors=tuple(float(f) for f in params.get("freq_factors") or ()),
        partial_rotary_factor=partial,
    )


def _optional_float(value: Any) -> float | None:
    return float(value) if value is not None else None


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


# Gemma configs without ``layer_types``: every n-th layer is global (transformers' default n)
_SLIDING_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def _layer_types(
    raw: dict[str, Any], model_type: str, num_layers: int, sliding: Any
) -> tuple[str, ...]:
    """Which layers use the sliding window, as transformers decides: ``layer_types``
    where the config lists them; Gemma's older configs by their pattern; Qwen2/Qwen3
    from ``max_window_layers`` on; else (Mistral) every layer once a window is set."""
    if not sliding:
        return ("full_attention",) * num_layers
    listed = raw.get("layer_types")
    if isinstance(listed, list) and len(listed) == num_layers:
        return tuple(str(t) for t in listed)
    if model_type in _SLIDING_PATTERNS:  # Gemma: every n-th layer global, the others sliding
        every = int(raw.get("sliding_window_pattern") or _SLIDING_PATTERNS[model_type])
        return tuple(
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    if model_type in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        )
    return ("sliding_attention",) * num_layers


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
    num_layers = int(raw["num_hidden_layers"])
    layer_types = _layer_types(raw, model_type, num_layers, sliding)
    return ModelConfig(
        architecture=str(architectures[0]) if architectures else "",
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=_rope_from(raw),
        hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or "silu"),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        layer_types=layer_types,
        local_rope=_local_rope_from(raw),
        query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
        attn_logit_softcapping=_optional_float(raw.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
        num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(
            raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0
        ),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        config_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
        eos_token_ids=_eos_ids(gen.get("eos_token_id"), raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
        raw=raw,
    )


def cpu_native_bf16() -> str | None:
    """The feature by which this CPU computes bf16 natively ("AMX" or "AVX512_BF16"), or None."""
    for name, feature in (
        ("_is_amx_tile_supported", "AMX"),
        ("_is_avx512_bf16_supported", "AVX512_BF16"),
    ):
        check = getattr(torch.cpu, name, None)
        if check is not None and check():
            return feature
    return None


def resolve_dtype(
    requested: str, config_dtype: torch.dtype | None, device: torch.device
) -> torch.dtype:
    """``requested`` ("auto" or a dtype name) to a torch dtype.

    "auto" is the checkpoint's dtype (fp32 when it names none), except on CPU,
    where a half-precision checkpoint (bf16 or fp16) runs in bf16 only if the
    CPU computes bf16 natively (:func:`cpu_native_bf16`), else in fp32: without
    AVX512_BF16 or AMX, bf16 is emulated and slower than fp32, and fp16 is slow
    and inexact everywhere on CPU. On CPU the choice and its reason are logged.
    """
    if requested != "auto":
        try:
            return _DTYPES[requested]
        except KeyError:
            raise ValueError(f"dtype: unknown dtype {requested!r}") from None
    dtype = config_dtype or torch.float32
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    feature = cpu_native_bf16()
    capability = torch.backends.cpu.get_cpu_capability()
    named = str(dtype).removeprefix("torch.")
    if feature is not None:
        logger.info(
            "dtype auto: bfloat16 (checkpoint %s; this CPU computes bf16 natively with %s)",
            named,
            feature,
        )
        return torch.bfloat16
    logger.info(
        "dtype auto: float32 (checkpoint %s; this CPU (%s) has no AVX512_BF16 or AMX, "
        "so bf16 would be emulated and slower than fp32)",
        named,
        capability,
    )
    return torch.float32


def resolve_device(requested: str) -> torch.device:
    """ "auto" → cuda when available, else cpu; "cuda" without a GPU is a clear error."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch sees no CUDA device")
    return torch.device(requested)
