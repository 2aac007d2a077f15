"""Llama-family checkpoints in one GGUF file (llama.cpp's format): header read by
:mod:`.gguf_header`, tensors dequantized with the ``gguf`` package.

A GGUF file holds what a Hugging Face directory spreads over several files;
this module maps it onto what the rest of legato reads from a directory:

- :func:`gguf_hf_config`: config.json's fields, from the metadata
  (architecture, sizes, rotary base and scaling, BOS/EOS ids, tied embeddings);
- :func:`iter_gguf_weights`: ``(HF tensor name, weight)`` pairs, each tensor
  dequantized with ``gguf.quants.dequantize`` (the same numpy code
  transformers uses for its own GGUF loading), or kept quantized
  (:mod:`.quantized`), and, for the ``llama`` architecture, with llama.cpp's
  interleaving of the Q/K rows undone;
- the tokenizer and chat template, which transformers builds from the same
  file, are loaded by :func:`legato.tokenizer_loading.load_gguf_tokenizer`.

Architectures (``general.architecture``): ``llama`` (llama.cpp writes Llama,
Mistral and SmolLM2 under it, and Mixtral with an ``expert_count``), ``qwen2``,
``qwen3``, ``qwen2moe``, ``qwen3moe``, ``gemma2``, ``gemma3`` (text), ``phi3``
(Phi-3 and Phi-4: fused ``attn_qkv`` and ``ffn_up`` kept fused under their Hugging
Face names, LongRoPE's factors from the ``rope_factors_short`` / ``_long`` tensors,
a partial rotary from ``rope.dimension_count``, a ``sliding_window`` of 0 meaning
none). Gemma files hold every norm weight as llama.cpp's converter writes it, ``1 + w``; it is
read back as ``w`` (as transformers does), which the Gemma model shifts again.
llama.cpp stores no ``query_pre_attn_scalar``: like llama.cpp, the scale is
``head_dim`` except for the 27B models (46 or 62 layers), where it is
``hidden / heads``. A mixture of experts stores each layer's
experts as one 3-D tensor per projection (``ffn_gate_exps`` ``[E, I, H]``);
they come out one expert at a time under the Hugging Face per-expert names,
each a 2-D quantized slice when kept quantized (else dequantized). Tensor types: those in
:data:`SUPPORTED_TYPES`. Anything else, and any unreadable, truncated or corrupt
file, is a :class:`~legato.protocol.errors.ModelLoadError` whose one-line
message names the file (and the tensor, where one is at fault).

:func:`open_gguf` parses the header only (:class:`~.gguf_header.GGUFHeader`: the tokenizer's
string arrays are stepped over, not decoded) and keeps the last file it opened.

Never imports trio or transformers.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..protocol.errors import ModelLoadError
from .gguf_header import GGUFHeader
from .quantized import KEPT_TYPES, QuantizedWeight, from_gguf

logger = logging.getLogger("legato.models.gguf")

GGUF_MAGIC = b"GGUF"

SUPPORTED_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16",
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
"""The GGML tensor types legato dequantizes (names as in ``gguf.GGMLQuantizationType``)."""

ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_GEMMA = ("gemma2", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for the 27B scale
"""GGUF ``general.architecture`` -> the Hugging Face architecture legato serves it as."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",  # one 3-D tensor: every expert's
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
"""GGUF's standard tensor names (ggml's docs/gguf.md) -> Hugging Face Llama names
(``{}``: the expert index, for the 3-D expert tensors)."""
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
"""Gemma's sandwich norms: ``ffn_norm`` is the MLP's input norm there."""
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
"""Phi-3's fused projections: ``attn_qkv`` (query, key, value rows) and ``ffn_up`` (gate
rows, then up rows), split by :class:`~legato.models.phi3.Phi3ForCausalLM`."""

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

_LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_IGNORED_TENSORS = {"rope_freqs.weight", *_LONGROPE_TENSORS}
"""Not weights: Llama 3.1+ files' per-frequency rotary divisors (llama.cpp's way of storing
llama3 rope scaling), read into the config as ``rope_parameters.freq_factors`` instead;
Phi-3-128k's LongRoPE factors, read as ``short_factor`` / ``long_factor``."""

_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
_YARN_UNSUPPORTED = ("attn_factor", "yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor")


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file by its suffix (it need not exist)."""
    return str(path).lower().endswith(".gguf")


GGUF_POINTER_FILE = "legato-gguf-weights.json"
"""In a model directory without weights of its own: ``{"gguf": PATH}`` names the GGUF file
its weights are read from (the default model's directory holds config and tokenizer only)."""


def gguf_weights_file(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file whose tensors are ``path``'s weights: ``path`` itself when it names one,
    the file a :data:`GGUF_POINTER_FILE` in the directory ``path`` names, else None."""
    if is_gguf_path(path):
        return Path(path)
    pointer = Path(path) / GGUF_POINTER_FILE
    if not pointer.is_file():
        return None
    import json

    return Path(json.loads(pointer.read_text())["gguf"])


def open_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file ``path``, checked: magic, metadata, tensor extents,
    architecture, tensor names and types.

    Raises ModelLoadError (one line naming the file) for a missing, empty,
    truncated or corrupt file, an unsupported architecture or tensor type. The
    last file opened is kept (keyed on its path, size and mtime). Blocks while
    the header is parsed (tens of milliseconds for a 49k-token vocabulary).
    """
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"model: {path}: no such GGUF file") from None
    except OSError as exc:
        raise ModelLoadError(f"model: {path}: cannot read it ({exc.strerror})") from None
    return _open_checked(str(resolved), stat.st_size, stat.st_mtime_ns)


def forget_gguf() -> None:
    """Drop the file :func:`open_gguf` keeps (its memory map and parsed header): a worker
    calls it once the weights are loaded."""
    _open_checked.cache_clear()


@functools.lru_cache(maxsize=1)
def _open_checked(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    if size == 0:
        raise ModelLoadError(f"model: {path}: the file is empty, not a GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"model: {path}: not a GGUF file (no GGUF magic bytes)")
    try:
        reader = GGUFHeader(path)
    except (ValueError, OverflowError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelLoadError(
            f"model: {path}: truncated or corrupt GGUF file ({type(exc).__name__}: {exc})"
        ) from None
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)  # data_offset: from the file start
        if end > size:
            raise ModelLoadError(
                f"model: {path}: truncated GGUF file (tensor {tensor.name!r} ends at byte"
                f" {end}, the file has {size})"
            )
    _check_contents(path, reader)
    return reader


def _check_contents(path: str, reader: GGUFHeader) -> None:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"model: {path}: unsupported GGUF architecture {arch!r}"
            f" (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"model: {path}: tensor {tensor.name!r} has type {kind}, which legato cannot"
                f" dequantize (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        if tensor.name not in _IGNORED_TENSORS and hf_tensor_name(tensor.name, arch) is None:
            raise ModelLoadError(
                f"model: {path}: tensor {tensor.name!r} has no place in a {arch} model"
            )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); None for a name we do not map. An
    experts tensor's name keeps a ``{}`` for the expert index."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = (
        _GEMMA_LAYER_NAMES if arch in _GEMMA else _PHI3_LAYER_NAMES if arch == "phi3"
        else _LAYER_NAMES
    )  # fmt: skip
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.field(key, default)


def _tensor_shapes(reader: GGUFHeader) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(reversed(t.shape)) for t in reader.tensors}


def gguf_hf_config(reader: GGUFHeader) -> dict[str, Any]:
    """The config.json (transformers 5 spelling) that describes the model in ``reader``.

    ``dtype`` is the type the weights are stored in once dequantized: float16 or
    bfloat16 when every matrix is stored so, else float32. Raises ModelLoadError
    for rotary settings legato cannot honour (partial rotary, YaRN with llama.cpp's own
    attention-factor keys).
    """
    arch = str(_field(reader, "general.architecture"))
    path = reader.path

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    shapes = _tensor_shapes(reader)
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # a per-layer list in some files: one value is all we serve
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"model: {path}: layers with different KV head counts")
        kv_heads = kv_heads[0]
    head_dim = int(meta("attention.key_length", 0)) or hidden // heads
    rotary_dims = meta("rope.dimension_count")
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta("rope.freq_base", 1e4)),
    }
    if rotary_dims is not None and int(rotary_dims) != head_dim:
        if arch != "phi3":  # Phi-4-mini rotates part of each head, as transformers does
            partial = f"partial rotary ({rotary_dims} of {head_dim} dims)"
            raise ModelLoadError(f"model: {path}: {partial} is not supported")
        rope["partial_rotary_factor"] = int(rotary_dims) / head_dim
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta("rope.scaling.factor", 1.0)))
    elif scaling == "yarn":
        unsupported = [k for k in _YARN_UNSUPPORTED if meta(f"rope.scaling.{k}") is not None]
        if unsupported:
            raise ModelLoadError(
                f"model: {path}: YaRN with rope.scaling.{unsupported[0]} is not supported"
            )
        original = meta("rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(
                f"model: {path}: YaRN without rope.scaling.original_context_length"
            )
        rope.update(
            rope_type="yarn",
            factor=float(meta("rope.scaling.factor", 1.0)),
            original_max_position_embeddings=int(original),
        )
        for key, name in _YARN_KEYS.items():
            if (value := meta(f"rope.scaling.{key}")) is not None:
                rope[name] = float(value)
    elif scaling != "none":
        raise ModelLoadError(f"model: {path}: rotary scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in shapes:
        rope["freq_factors"] = _tensor_values(reader, "rope_freqs.weight")
    if all(name in shapes for name in _LONGROPE_TENSORS):  # Phi-3-128k, as llama.cpp writes it
        short, long = (_tensor_values(reader, name) for name in _LONGROPE_TENSORS)
        rope.update(rope_type="longrope", short_factor=short, long_factor=long)
        if (attn_factor := meta("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attn_factor)
    vocab = meta("vocab_size") or shapes["token_embd.weight"][0]
    eos_ids = [
        int(v)
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (v := _field(reader, f"tokenizer.ggml.{key}")) is not None
    ]
    matrix_types = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
    dtype = "float32"
    if len(matrix_types) == 1:
        dtype = {"F16": "float16", "BF16": "bfloat16"}.get(matrix_types.pop(), "float32")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos_ids)) or None,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
    }
    if arch == "qwen2":
        config["use_sliding_window"] = False
    if (experts := meta("expert_count")) is not None:  # a mixture of experts
        config.update(
            num_experts=int(experts),
            num_local_experts=int(experts),
            num_experts_per_tok=int(meta("expert_used_count")),
            # llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE, not Qwen2-MoE
            norm_topk_prob=arch != "qwen2moe",
        )
        if arch == "llama":
            config["architectures"] = ["MixtralForCausalLM"]
        else:
            config["moe_intermediate_size"] = int(meta("expert_feed_forward_length"))
        if (shared := meta("expert_shared_feed_forward_length")) is not None:
            config["shared_expert_intermediate_size"] = int(shared)
    if arch in _GEMMA:
        layers = config["num_hidden_layers"]
        big = layers == _GEMMA_27B_LAYERS[arch]
        config.update(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=hidden // heads if big else head_dim,
            sliding_window=meta("attention.sliding_window"),
            attn_logit_softcapping=meta("attn_logit_softcapping"),
            final_logit_softcapping=meta("final_logit_softcapping"),
        )
        if (pattern := meta("attention.sliding_window_pattern")) is not None:
            if isinstance(pattern, list):  # per layer: True = sliding
                config["layer_types"] = [
                    "sliding_attention" if p else "full_attention" for p in pattern
                ]
            else:
                config["sliding_window_pattern"] = int(pattern)
        if arch == "gemma3":
            config["rope_local_base_freq"] = 10_000.0  # llama.cpp's fixed local base
    if arch == "phi3":
        config["sliding_window"] = meta("attention.sliding_window") or None  # 0: none (Phi-4)
        if (original := meta("rope.scaling.original_context_length")) is not None:
            config["original_max_position_embeddings"] = int(original)
    return config


def _tensor_values(reader: GGUFHeader, name: str) -> list[float]:
    """The values of the 1-D tensor ``name`` that is not a weight: ``rope_freqs`` (llama.cpp
    divides each inverse frequency by one), ``rope_factors_short`` / ``_long`` (LongRoPE's)."""
    from gguf.quants import dequantize

    (tensor,) = (t for t in reader.tensors if t.name == name)
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return [float(v) for v in values.reshape(-1)]


def iter_gguf_weights(reader: GGUFHeader) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, fp32 tensor)`` for every weight in ``reader``, dequantized one at a time.

    For the ``llama`` architecture, the Q and K rows (weights and biases) get
    llama.cpp's per-head interleaving undone, so they are as in the HF checkpoint.
    """
    for name, weight in iter_gguf_quantized(reader, keep_quantized=False):
        assert isinstance(weight, torch.Tensor)
        yield name, weight


def iter_gguf_quantized(
    reader: GGUFHeader, *, keep_quantized: bool = True
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """As :func:`iter_gguf_weights`, but each matrix of a type in
    :data:`~.quantized.KEPT_TYPES` comes as a :class:`~.quantized.QuantizedWeight`
    (rows unpermuted likewise); matrices of other quantized types are dequantized,
    with one log line naming their types."""
    from gguf.quants import dequantize

    config = gguf_hf_config(reader)
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    unpermute = arch == "llama"
    gemma = arch in _GEMMA
    widened: dict[str, int] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            continue  # checked by open_gguf: only _IGNORED_TENSORS get here
        if gemma and name.endswith("norm.weight"):  # stored as 1 + w: give back w
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            yield name, torch.from_numpy(array - 1.0)
            continue
        kind = tensor.tensor_type.name
        if "{}" in name:  # every expert's projection in one [E, rows, cols] tensor
            if keep_quantized and kind in KEPT_TYPES:  # one 2-D quantized slice per expert
                cols, rows, count = tensor.shape
                raw = np.asarray(tensor.data).reshape(count, rows, -1)
                for expert in range(count):
                    yield name.format(expert), from_gguf(raw[expert], kind, rows, cols)
                continue
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            for expert in range(array.shape[0]):
                yield name.format(expert), torch.from_numpy(np.array(array[expert], copy=True))
            continue
        if keep_quantized and len(tensor.shape) == 2:
            if kind in KEPT_TYPES:
                in_features, out_features = tensor.shape
                weight = from_gguf(tensor.data, kind, out_features, in_features)
                if unpermute and ".attn_q." in tensor.name:
                    weight = weight.take_rows(_unpermute_index(out_features, heads))
                elif unpermute and ".attn_k." in tensor.name:
                    weight = weight.take_rows(_unpermute_index(out_features, kv_heads))
                yield name, weight
                continue
            if kind not in ("F32", "F16", "BF16"):
                widened[kind] = widened.get(kind, 0) + 1
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if unpermute and ".attn_q." in tensor.name:
            array = _unpermute_rows(array, heads)
        elif unpermute and ".attn_k." in tensor.name:
            array = _unpermute_rows(array, kv_heads)
        yield name, torch.from_numpy(np.array(array, copy=True))  # owned, writable
    if widened:
        logger.info(
            "%s: tensors of types legato does not keep quantized were dequantized to fp32: %s",
            reader.path,
            ", ".join(f"{count} {kind}" for kind, count in sorted(widened.items())),
        )


def _unpermute_index(rows: int, n_heads: int) -> torch.Tensor:
    """The row order :func:`_unpermute_rows` produces, as an index (for quantized rows)."""
    return torch.from_numpy(_unpermute_rows(np.arange(rows), n_heads).astype(np.int64))


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, its two rotary halves were interleaved
    row by row (``convert_hf_to_gguf.py``: reshape(heads, 2, dim/2, ...), swap axes 1, 2)."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def stored_dtypes(reader: GGUFHeader) -> dict[str, torch.dtype]:
    """HF name -> the torch dtype that holds that tensor without loss once dequantized:
    fp16 / bf16 for tensors stored so, fp32 for the rest (quantized ones included)."""
    exact = {"F16": torch.float16, "BF16": torch.bfloat16}
    arch = str(_field(reader, "general.architecture"))
    return {
        name: exact.get(t.tensor_type.name, torch.float32)
        for t in reader.tensors
        if (name := hf_tensor_name(t.name, arch)) is not None
    }
