"""Phi-3 (``Phi3ForCausalLM``): greedy tokens identical to transformers in fp32.

Whole prefill of a batch, chunked prefill, a start from a cached prefix (on a
sliding window of 24 on every layer, as Phi-3-mini-4k has one); and a
Phi-3-128k-like config (LongRoPE over an original window of 64, a sliding window
of 48 on every layer) driven to 4x its original window, with a sequence that stays
within the original window beside it in the batch (transformers' Phi-3 recomputes
its cache when a sequence crosses that window, which legato does not: see
``legato.models.phi3``). TP=2 is in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from legato.config import EngineConfig
from legato.models.config import load_model_config
from legato.models.phi3 import Phi3ForCausalLM
from legato.models.registry import resolve_architecture
from legato.models.rotary import longrope_attention_factor
from legato.models.runner import ModelRunner

NEW_TOKENS = 48
LONG: dict[str, Any] = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=64,
    sliding_window=48,
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 0.7 * i for i in range(8)],
    },
)


@pytest.fixture(scope="module")
def phi3(make_checkpoint: Callable[..., Any]) -> Any:
    """Phi-3-mini-4k-like: every layer windowed (here 24), prompts and generations past it."""
    return make_checkpoint("phi3", sliding_window=24)


def test_registered_by_architecture(phi3: Any) -> None:
    raw = json.loads((phi3.path / "config.json").read_text())
    assert raw["architectures"] == ["Phi3ForCausalLM"]
    model_class, _ = resolve_architecture(load_model_config(phi3.path))
    assert model_class is Phi3ForCausalLM
    names = {n for n in phi3.hf_model.state_dict() if ".layers.0." in n}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names  # fused in the checkpoint
    assert "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.parametrize("chunk", [None, 7])
def test_batch_matches_transformers(
    chunk: int | None,
    phi3: Any,
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    prompts = greedy.prompts([5, 23, 40], seed=41)
    greedy.assert_matches_transformers(phi3, make_runner(phi3), prompts, NEW_TOKENS, chunk=chunk)


def test_prefix_cache_hit_matches_transformers(
    phi3: Any, make_runner: Callable[..., Any], greedy: Any
) -> None:
    donor, tail = greedy.prompts([37, 9], seed=42)
    greedy.assert_prefix_hit_matches_transformers(
        phi3, make_runner(phi3), donor, donor[:32] + tail, 2, NEW_TOKENS
    )


def test_longrope_and_sliding_window_past_the_original_window(
    make_checkpoint: Callable[..., Any], make_runner: Callable[..., Any], greedy: Any
) -> None:
    ck = make_checkpoint("phi3", **LONG)
    cfg = load_model_config(ck.path)
    assert cfg.rope.rope_type == "longrope" and cfg.window_of(0) == 48
    prompts = greedy.prompts([16, 200], seed=43)  # 16 + 48 stays within the 64 of the original
    greedy.assert_matches_transformers(ck, make_runner(ck, max_model_len=256), prompts, NEW_TOKENS)


@pytest.mark.parametrize("longrope", [False, True])
def test_partial_rotary_matches_transformers(
    longrope: bool,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """Phi-4-mini rotates part of each head (here half: 8 of 16 dims), with and without
    LongRoPE; without it in chunks, so that cached keys are read back too."""
    overrides: dict[str, Any] = dict(partial_rotary_factor=0.5)
    if longrope:
        overrides.update(
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.2, 1.4],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        )
    ck = make_checkpoint("phi3", **overrides)
    assert load_model_config(ck.path).rope.rotary_dim(16) == 8
    prompts = greedy.prompts([9, 150 if longrope else 40], seed=44)
    # chunks would cross LongRoPE's original window mid-prompt (see legato.models.rotary)
    runner = make_runner(ck, max_model_len=256)
    greedy.assert_matches_transformers(
        ck, runner, prompts, NEW_TOKENS, chunk=None if longrope else 16
    )


def test_partial_rotary_refused_for_other_architectures(tmp_path: Path, llama: Any) -> None:
    raw = json.loads((llama.path / "config.json").read_text())
    raw["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="partial_rotary_factor: 0.5 is not supported"):
        resolve_architecture(load_model_config(tmp_path))


def test_unsupported_architecture_fails_at_start_naming_it(tmp_path: Path, phi3: Any) -> None:
    raw = json.loads((phi3.path / "config.json").read_text())
    raw["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported model architecture FalconForCausalLM"):
        ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=8))


GGUF_CASES: dict[str, dict[str, Any]] = {
    "sliding": dict(sliding_window=24),  # prompts past the window
    "longrope_partial": dict(  # Phi-4-mini-like: LongRoPE over half of each head
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        partial_rotary_factor=0.5,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.2, 1.4],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
        },
    ),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_file_matches_transformers(
    case: str, make_checkpoint: Callable[..., Any], greedy: Any, tmp_path: Path
) -> None:
    """The checkpoint written as llama.cpp's converter writes Phi-3 (``attn_qkv`` and
    ``ffn_up`` fused, LongRoPE's factors as tensors, the rotary dims and window in the
    metadata): from an F32 file legato gives transformers' tokens on the checkpoint (one
    prompt past LongRoPE's original window, one that stays within it); from a Q8_0 file
    the fused matrices stay quantized and the tokens equal the dequantized path's."""
    from legato.testing.gguf_files import write_gguf

    ck = make_checkpoint("phi3", **GGUF_CASES[case])
    prompts = greedy.prompts([9, 100], seed=45)
    f32 = write_gguf(ck.path, tmp_path / f"phi3-{case}-f32.gguf", tensor_type="F32")
    from_file, source = load_model_config(f32), load_model_config(ck.path)
    assert from_file.architecture == "Phi3ForCausalLM"
    got, want = from_file.rope, source.rope
    assert from_file.sliding_window == source.sliding_window
    assert (got.rope_type, got.partial_rotary_factor, got.original_max_position_embeddings) == (
        want.rope_type, want.partial_rotary_factor, want.original_max_position_embeddings,
    )  # fmt: skip
    assert got.long_factor == pytest.approx(want.long_factor)  # stored as F32
    assert got.short_factor == pytest.approx(want.short_factor)
    assert longrope_attention_factor(got) == pytest.approx(longrope_attention_factor(want))
    tokens, _ = greedy.run_file(f32, prompts, NEW_TOKENS, max_model_len=256)
    assert tokens == greedy.transformers(ck, prompts, NEW_TOKENS)
    q8 = write_gguf(ck.path, tmp_path / f"phi3-{case}-q8.gguf", tensor_type="Q8_0")
    kept, runner = greedy.run_file(q8, prompts, NEW_TOKENS, max_model_len=256)
    layer = runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quantized is not None
    assert layer.mlp.gate_up_proj.quantized is not None
    dequantized = greedy.run_file(q8, prompts, NEW_TOKENS, max_model_len=256, gguf_dequantize=True)
    assert kept == dequantized[0]
    assert all(len(set(t)) > 2 for t in kept)
