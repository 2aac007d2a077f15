"""Tiny random Llama-family checkpoints, saved once per session into temp dirs.

Each checkpoint is made with transformers' own config and model classes and
``save_pretrained``; the transformers model (fp32, eval) is kept beside it as
the fidelity reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

SMALL: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,  # decisive logits: few near-ties in greedy decoding
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3")


@dataclass
class Checkpoint:
    """A saved tiny checkpoint and the transformers model it came from."""

    kind: str
    path: Path
    hf_model: Any


def _make(kind: str, path: Path, max_shard_size: str | None = None, **overrides: Any) -> Checkpoint:
    import transformers as tf

    kwargs = {**SMALL, **overrides}
    if kind == "llama":
        config = tf.LlamaConfig(**kwargs)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3":
        kwargs.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        kwargs.setdefault("rope_theta", 500000.0)
        config = tf.LlamaConfig(**kwargs)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**{**kwargs, "sliding_window": None})
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        config = tf.Qwen2Config(**kwargs)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**{"head_dim": 16, "tie_word_embeddings": True, **kwargs})
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(1234 + KINDS.index(kind) if kind in KINDS else 99)
    model = cls(config).eval()
    if kind == "qwen2":  # random biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.1)
    if max_shard_size is None:
        model.save_pretrained(path)
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)
    return Checkpoint(kind, path, model)


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., Checkpoint]:
    """``make_checkpoint(kind, **config_overrides)``: built once per distinct call."""
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Checkpoint] = {}

    def make(kind: str, **overrides: Any) -> Checkpoint:
        key = (kind, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = _make(kind, tmp_path_factory.mktemp(kind), **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=KINDS)
def checkpoint(
    request: pytest.FixtureRequest, make_checkpoint: Callable[..., Checkpoint]
) -> Checkpoint:
    """Each supported family in turn."""
    return make_checkpoint(request.param)


@pytest.fixture(scope="session")
def llama(make_checkpoint: Callable[..., Checkpoint]) -> Checkpoint:
    return make_checkpoint("llama")
