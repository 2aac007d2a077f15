"""Checkpoint config parsing, architecture registry and safetensors loading."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.models.attention_backend import select_backend
from legato.models.config import load_model_config, resolve_dtype
from legato.models.loader import load_model, safetensors_files
from legato.models.registry import resolve_architecture, supported_architectures
from legato.models.step_metadata import build_metadata

CPU = torch.device("cpu")


def _logits(path: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of a fixed 12-token prefill through our model loaded from ``path``."""
    import numpy as np

    cfg = load_model_config(path)
    model = load_model(path, cfg, select_backend("torch", CPU), dtype, CPU, 64)
    kv = [(torch.zeros(4, 16, 2, 16, dtype=dtype), torch.zeros(4, 16, 2, 16, dtype=dtype))] * 2
    meta, _, _ = build_metadata(
        np.array([0]), np.array([12]), np.array([[0, 1]], dtype=np.int32), 16, CPU
    )
    ids = torch.arange(3, 15)
    with torch.inference_mode():
        return model.compute_logits(model(ids, kv, meta)).float()


def test_sharded_checkpoint_loads_identically(make_checkpoint: Callable[..., Any]) -> None:
    single = make_checkpoint("llama")
    sharded = make_checkpoint("llama", max_shard_size="60KB")
    assert len(safetensors_files(single.path)) == 1
    assert len(safetensors_files(sharded.path)) >= 2
    assert (sharded.path / "model.safetensors.index.json").exists()
    assert torch.equal(_logits(single.path), _logits(sharded.path))


def test_logits_match_transformers_prefill(checkpoint: Any) -> None:
    with torch.no_grad():
        expected = checkpoint.hf_model(torch.arange(3, 15)[None]).logits[0].float()
    torch.testing.assert_close(_logits(checkpoint.path), expected, atol=1e-4, rtol=1e-4)


def test_config_flags(make_checkpoint: Callable[..., Any]) -> None:
    _, qwen2 = resolve_architecture(load_model_config(make_checkpoint("qwen2").path))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    _, qwen3 = resolve_architecture(load_model_config(make_checkpoint("qwen3").path))
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim == 16
    llama3 = load_model_config(make_checkpoint("llama3").path)
    assert llama3.rope.rope_type == "llama3" and llama3.rope.theta == 500000.0
    assert llama3.rope.original_max_position_embeddings == 64


def test_legacy_rope_spelling_and_eos(tmp_path: Path, llama: Any, cpu_bf16: str | None) -> None:
    """transformers 4 wrote rope_theta / rope_scaling at top level; EOS may be a list.
    The fp16 checkpoint's "auto" dtype on CPU depends on native bf16: checked both ways."""
    raw = json.loads((llama.path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 1234.0
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    raw["eos_token_id"] = [7, 9]
    raw["torch_dtype"] = "float16"
    raw.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    cfg = load_model_config(tmp_path)
    assert cfg.rope.theta == 1234.0 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0
    assert cfg.eos_token_ids == (9, 7)
    assert cfg.config_dtype == torch.float16
    auto_on_cpu = torch.bfloat16 if cpu_bf16 else torch.float32
    assert resolve_dtype("auto", cfg.config_dtype, CPU) == auto_on_cpu
    assert resolve_dtype("auto", cfg.config_dtype, torch.device("cuda")) == torch.float16
    assert resolve_dtype("bfloat16", cfg.config_dtype, CPU) == torch.bfloat16


@pytest.mark.parametrize("cpu_bf16", [None, "AMX", "AVX512_BF16"], indirect=True)
def test_auto_dtype_on_cpu_is_bf16_only_with_native_bf16(
    cpu_bf16: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A half-precision checkpoint runs in bf16 on a CPU with AMX / AVX512_BF16, else in
    fp32; the log says which and why. An fp32 checkpoint stays fp32, CUDA keeps the
    checkpoint's dtype."""
    feature = cpu_bf16
    caplog.set_level("INFO", logger="legato.models.config")
    want = torch.bfloat16 if feature else torch.float32
    for checkpoint in (torch.bfloat16, torch.float16):
        assert resolve_dtype("auto", checkpoint, CPU) == want
    assert f"dtype auto: {str(want).removeprefix('torch.')}" in caplog.text
    assert (feature or "has no AVX512_BF16 or AMX") in caplog.text
    assert resolve_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_dtype("auto", None, CPU) == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_unsupported_architecture_lists_supported(tmp_path: Path, llama: Any) -> None:
    raw = json.loads((llama.path / "config.json").read_text())
    raw["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as info:
        resolve_architecture(load_model_config(tmp_path))
    for name in supported_architectures():
        assert name in str(info.value)
    assert "Qwen3ForCausalLM" in supported_architectures()


def test_missing_weights_are_named(tmp_path: Path, llama: Any) -> None:
    from safetensors.torch import load_file, save_file

    for f in llama.path.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(llama.path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        _logits(tmp_path)


def test_no_weights_is_a_clear_error(tmp_path: Path, llama: Any) -> None:
    shutil.copy(llama.path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        _logits(tmp_path)


def test_random_weights_directory(tmp_path: Path, make_checkpoint: Callable[..., Any]) -> None:
    """A config.json plus the marker loads as seeded random weights: no safetensors needed."""
    from legato.config import EngineConfig
    from legato.models.loader import write_random_model_dir
    from legato.models.runner import ModelRunner

    raw = json.loads((make_checkpoint("qwen3").path / "config.json").read_text())
    path = write_random_model_dir(tmp_path / "random", raw, seed=3, std=0.05)
    assert not list(path.glob("*.safetensors"))
    runners = [
        ModelRunner(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8)) for _ in range(2)
    ]
    params = [dict(r.model.named_parameters()) for r in runners]
    assert params[0].keys() == params[1].keys()
    for name, value in params[0].items():
        assert torch.equal(value, params[1][name]), name
    norm = params[0]["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    embed = params[0]["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.05) < 0.005
    assert runners[0].model.lm_head.weight is embed  # tied, drawn once
    runners[0].sleep(2)
    runners[0].wake_up()  # level 2 reloads: the same draw again
    assert torch.equal(
        runners[0].model.model.embed_tokens.weight, params[1]["model.embed_tokens.weight"]
    )
