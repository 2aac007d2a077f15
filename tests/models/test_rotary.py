"""Rope scaling past the original context: greedy tokens identical to transformers (fp32).

Each scaling gets a tiny Llama whose original window is 64 positions, driven to
256 (4x): a short prompt that grows past the window while decoding and a long
one that starts past it, in one batch. The scalings that depend only on the
position (linear, llama3, YaRN) are also run in prefill chunks and from a cached
prefix; LongRoPE and dynamic NTK choose their frequencies by the length reached
at each step, as transformers does, and are checked in the settings where
transformers defines them (whole prefill, then decode), with sequences of both
kinds in one batch so that one sequence's choice cannot leak into another's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.models.config import load_model_config, model_config_from_dict
from legato.models.rotary import dynamic_inv_freq, rope_inv_freq

ORIGINAL = 64
MAX_LEN = 4 * ORIGINAL
NEW_TOKENS = 56
HEAD_DIM = 16  # SMALL: hidden 64 over 4 heads

SCALINGS: dict[str, dict[str, Any]] = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "yarn": dict(
        max_position_embeddings=MAX_LEN,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "longrope": dict(
        max_position_embeddings=MAX_LEN,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)],
        },
    ),
    "dynamic": dict(
        max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "dynamic", "factor": 4.0}
    ),
}
POSITIONAL = ("linear", "llama3", "yarn")


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_past_the_original_window_matches_transformers(
    scaling: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    ck = make_checkpoint("llama", **SCALINGS[scaling])
    assert load_model_config(ck.path).rope.rope_type == scaling
    # 30 + 56 crosses the window while decoding; 200 + 56 ends at 4x the window
    prompts = greedy.prompts([30, 200], seed=11)
    runner = make_runner(ck, max_model_len=MAX_LEN)
    greedy.assert_matches_transformers(ck, runner, prompts, NEW_TOKENS)


@pytest.mark.parametrize("scaling", POSITIONAL)
def test_chunked_prefill_and_prefix_hit_past_the_window(
    scaling: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """Prefill in 48-token chunks; then a request whose first 160 tokens (ten blocks,
    well past the window) come from the cache."""
    ck = make_checkpoint("llama", **SCALINGS[scaling])
    (donor,) = greedy.prompts([190], seed=12)
    runner = make_runner(ck, max_model_len=MAX_LEN)
    greedy.assert_matches_transformers(ck, runner, [donor], NEW_TOKENS, chunk=48)
    hit = donor[:160] + greedy.prompts([20], seed=13)[0]
    runner = make_runner(ck, max_model_len=MAX_LEN)
    greedy.assert_prefix_hit_matches_transformers(ck, runner, donor, hit, 10, NEW_TOKENS)


def test_inverse_frequencies_equal_transformers() -> None:
    """The frequencies and cos/sin scale, bit for bit, for every scaling (and YaRN's
    mscale variant), from the config transformers itself writes."""
    import transformers as tf

    small = dict(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    variants = dict(SCALINGS)
    variants["yarn-mscale"] = dict(
        max_position_embeddings=MAX_LEN,
        rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
            "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0,
        },
    )  # fmt: skip
    for name, overrides in variants.items():
        config = tf.LlamaConfig(**small, **overrides)
        rotary = tf.LlamaForCausalLM(config).model.rotary_emb
        rope = model_config_from_dict(config.to_dict(), {}).rope
        inv_freq, attention_factor = rope_inv_freq(HEAD_DIM, rope)
        assert torch.equal(inv_freq, rotary.inv_freq), name
        assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12), name
        if name == "longrope":
            rotary(torch.zeros(1, 1, HEAD_DIM), torch.arange(ORIGINAL + 1)[None])
            assert torch.equal(rope_inv_freq(HEAD_DIM, rope, long=True)[0], rotary.inv_freq)
        if name == "dynamic":
            for length in (ORIGINAL + 1, MAX_LEN):
                rotary(torch.zeros(1, 1, HEAD_DIM), torch.arange(length)[None])
                ours = dynamic_inv_freq(HEAD_DIM, rope, torch.tensor([length]))[0]
                assert torch.equal(ours, rotary.inv_freq), (name, length)


def test_legacy_rope_scaling_spelling(tmp_path: Path, llama: Any) -> None:
    """transformers 4's top-level ``rope_scaling`` with ``type`` (and Phi-3's "su") reads
    as transformers 5's ``rope_parameters``; an unknown type is an error naming it."""
    raw = json.loads((llama.path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(
        rope_theta=10000.0,
        max_position_embeddings=MAX_LEN,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    new = {**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 64}}  # fmt: skip
    new.pop("rope_scaling")
    assert model_config_from_dict(raw, {}).rope == model_config_from_dict(new, {}).rope
    su = {**raw, "original_max_position_embeddings": ORIGINAL,
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}  # fmt: skip
    rope = model_config_from_dict(su, {}).rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == ORIGINAL
    assert rope.factor == MAX_LEN / ORIGINAL
    bad = {**raw, "rope_scaling": {"type": "mystery", "factor": 2.0}}
    with pytest.raises(ValueError, match="rope_type: 'mystery'"):
        model_config_from_dict(bad, {})
