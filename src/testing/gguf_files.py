"""Write small GGUF files with the ``gguf`` package's writer, for tests and benchmarks.

:func:`write_gguf` turns a Hugging Face checkpoint directory (Llama, Mistral,
Qwen2, Qwen3, their MoE kin, Gemma 2 / 3, Phi-3) into a GGUF file the way
llama.cpp's converter lays it out:
standard tensor names, the ``llama`` architecture's Q/K rows permuted per
head, norms in F32 and every matrix in the one requested type. Types the
writer can quantize (F32 ... Q5_1) are quantized from the checkpoint; the
K-quants (Q2_K ... Q6_K), which gguf-py cannot quantize, are filled with
random blocks whose scales are small finite numbers, which is a valid
tensor of that type all the same. A tokenizer (``tokenizer.json`` in the
directory, byte-level BPE) is written as llama.cpp's ``gpt2`` vocabulary,
with the chat template.

Test support only: never imported by the engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.loader import iter_weights

_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # as llama.cpp writes Mistral
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",  # as llama.cpp writes Mixtral: llama with experts
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_GEMMA_NAMES = {  # Gemma's sandwich norms, as llama.cpp names them
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_EXPERT_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}  # fmt: skip

_K_QUANT_SCALES: dict[str, tuple[int, int | None, float]] = {
    "Q2_K": (80, 82, 1.5),
    "Q3_K": (108, None, 0.0),
    "Q4_K": (0, 2, 7.5),
    "Q5_K": (0, 2, 15.5),
    "Q6_K": (208, None, 0.0),
}
"""Per K-quant: byte offsets of the fp16 ``d`` and ``dmin`` in one block (gguf-py's
quants.py), and ``dmin / d`` that centres random blocks on zero: these types store
unsigned values and subtract ``dmin * min``, so random ``d`` alone biases every weight
upwards (the mean value times the mean sub-scale over the mean sub-minimum)."""

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections, kept fused
    "mlp.gate_up_proj": "ffn_up",
}


def write_gguf(
    checkpoint_dir: str | Path,
    out: str | Path,
    *,
    tensor_type: str = "F32",
    name: str = "tiny",
    seed: int = 0,
) -> Path:
    """Write the checkpoint in ``checkpoint_dir`` to the GGUF file ``out``; return ``out``.

    Every 2-D weight is stored as ``tensor_type`` (a ``gguf.GGMLQuantizationType``
    name); 1-D tensors (norms, biases) as F32. ``seed`` draws the K-quant blocks.
    """
    import gguf

    root = Path(checkpoint_dir)
    config = json.loads((root / "config.json").read_text())
    arch = _GGUF_ARCH[config["architectures"][0]]
    kind = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name)
    _write_config(writer, arch, config)
    tokenizer = root / "tokenizer.json"
    if tokenizer.exists():
        _write_tokenizer(writer, json.loads(tokenizer.read_text()), root, config)
    rng = np.random.default_rng(seed)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if (rope_freqs := _llama3_rope_freqs(config)) is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for factors_name, factors in _longrope_factors(config):
        writer.add_tensor(factors_name, factors)
    for gguf_name, array in _stack_experts(iter_weights(root), arch):
        if arch.startswith("gemma") and gguf_name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's norms as 1 + w
        if arch == "llama" and ".attn_q." in gguf_name:
            array = _permute_rows(array, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = _permute_rows(array, kv_heads)
        if array.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        elif tensor_type in _K_QUANT_SCALES:
            blocks = _random_k_blocks(tensor_type, array.shape, rng)
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            quantized = gguf.quants.quantize(np.ascontiguousarray(array), kind)
            writer.add_tensor(gguf_name, quantized, raw_shape=quantized.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _stack_experts(weights: Any, arch: str) -> Any:
    """``(GGUF name, fp32 array)``: per-expert tensors stacked into one ``[E, rows, cols]``
    tensor per layer and projection (``blk.N.ffn_gate_exps``), as llama.cpp stores them."""
    experts: dict[str, dict[int, Any]] = {}
    for hf_name, tensor in weights:
        assert isinstance(tensor, torch.Tensor)  # a directory holds no quantized weights
        match = _EXPERT_RE.match(hf_name)
        if match is None:
            yield _gguf_name(hf_name, arch), tensor.float().numpy()
            continue
        layer, expert, proj = match.groups()
        key = f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}_exps.weight"
        experts.setdefault(key, {})[int(expert)] = tensor.float().numpy()
    for key, parts in experts.items():
        yield key, np.stack([parts[e] for e in range(len(parts))])


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**_HF_TO_GGUF, **_GEMMA_NAMES} if arch.startswith("gemma") else _HF_TO_GGUF
    return f"blk.{layer}.{names[module]}.{kind}"


def _permute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): per head, interleave the two rotary halves."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _random_k_blocks(tensor_type: str, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
    import gguf

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]]
    rows, cols = shape
    if cols % block_elems:
        raise ValueError(f"{tensor_type}: rows of {cols} are not whole {block_elems}-blocks")
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    d_at, dmin_at, dmin_ratio = _K_QUANT_SCALES[tensor_type]
    d = rng.uniform(0.001, 0.004, size=blocks.shape[:2]).astype(np.float16)
    blocks[:, :, d_at : d_at + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if dmin_at is not None:
        dmin = (d.astype(np.float32) * dmin_ratio).astype(np.float16)
        blocks[:, :, dmin_at : dmin_at + 2] = dmin.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def _write_config(writer: Any, arch: str, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes it
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_vocab_size(config["vocab_size"])
    if arch.startswith("gemma"):
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        if config.get("layer_types"):
            writer.add_sliding_window_pattern(
                [t == "sliding_attention" for t in config["layer_types"]]
            )
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                getattr(writer, f"add_{key}")(config[key])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size") and arch != "llama":
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "phi3":  # as llama.cpp's converter: rotary dims, no key length
        _write_phi3_config(writer, config, head_dim)
    elif arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _phi3_rope(config: dict[str, Any]) -> dict[str, Any]:
    rope: dict[str, Any] = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope


def _write_phi3_config(writer: Any, config: dict[str, Any], head_dim: int) -> None:
    """Phi-3's keys as llama.cpp's converter (``Phi3MiniModel``) writes them: the rotary
    dims of a partial rotary, the original window, a sliding window (0: none) and, with
    LongRoPE, the attention factor transformers derives from the two windows."""
    import math

    rope = _phi3_rope(config)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
    writer.add_rope_dimension_count(int(partial * head_dim))
    original = int(
        config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    )
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(attn)


def _longrope_factors(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """LongRoPE's factors as llama.cpp stores them: two F32 tensors, else nothing."""
    rope = _phi3_rope(config)
    if not rope.get("long_factor"):
        return []
    return [
        (f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
        for kind in ("long", "short")
    ]


def _llama3_rope_freqs(config: dict[str, Any]) -> Any:
    """llama.cpp's ``rope_freqs`` for a llama3-scaled config (``convert_hf_to_gguf.py``,
    LlamaModel.generate_extra_tensors): each inverse frequency's divisor; else None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type")) != "llama3":
        return None
    import math

    heads = config["num_attention_heads"]
    dim = config.get("head_dim") or config["hidden_size"] // heads
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _write_tokenizer(writer: Any, spec: dict[str, Any], root: Path, config: dict[str, Any]) -> None:
    vocab: dict[str, int] = spec["model"]["vocab"]
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * config["vocab_size"]
    for token, token_id in vocab.items():
        tokens[token_id] = token
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_token_merges(merges)
    bos, eos, pad = (config.get(f"{key}_token_id") for key in ("bos", "eos", "pad"))
    if isinstance(bos, int):
        writer.add_bos_token_id(bos)
    if isinstance(eos, int):
        writer.add_eos_token_id(eos)
    if isinstance(pad, int):
        writer.add_pad_token_id(pad)
    template = root / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
    writer.add_add_bos_token(config.get("bos_token_id") is not None)
