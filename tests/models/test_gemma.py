"""Gemma 2 and Gemma 3 (text): greedy tokens identical to transformers in fp32.

Tiny random checkpoints with random norm weights (Gemma's ``1 + w`` RMSNorm),
sliding layers interleaved with global ones (a window of 24, prompts and
generations several times longer), and soft caps small enough to matter (Gemma 2:
1.0 on the attention scores, which changes the tokens; 3.0 on the logits, which
cannot change a greedy token but changes the logprobs compared). Gemma 3 adds
q/k norms and rotates its sliding layers with their own base (10 000) while the
global ones use a linearly scaled 1 000 000. Whole prefill, chunked prefill, a
start from a cached prefix, and the reference and Triton kernels; TP=2 is in
``test_tensor_parallel.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from legato.models.config import load_model_config
from legato.models.gemma2 import Gemma2ForCausalLM
from legato.models.gemma3 import Gemma3ForCausalLM
from legato.models.registry import resolve_architecture

WINDOW = 24
NEW_TOKENS = 40
# Untied: a tiny random Gemma with its embedding (scaled by 8) as its head repeats a token.
GEMMA: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
    "gemma3": dict(
        sliding_window=WINDOW,
        tie_word_embeddings=False,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
}
CLASSES = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM}


def _checkpoint(make_checkpoint: Callable[..., Any], kind: str) -> Any:
    return make_checkpoint(kind, **GEMMA[kind])


@pytest.mark.parametrize("kind", list(GEMMA))
def test_config_and_registry(kind: str, make_checkpoint: Callable[..., Any]) -> None:
    cfg = load_model_config(_checkpoint(make_checkpoint, kind).path)
    model_class, cfg = resolve_architecture(cfg)
    assert model_class is CLASSES[kind]
    assert [cfg.window_of(i) for i in range(2)] == [WINDOW, None]  # sliding, then global
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.query_pre_attn_scalar == 24
    if kind == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.0, 3.0)
    else:
        assert cfg.qk_norm and cfg.local_rope is not None
        assert (cfg.rope.theta, cfg.rope.rope_type, cfg.local_rope.theta) == (1e6, "linear", 1e4)


@pytest.mark.parametrize("kind", list(GEMMA))
@pytest.mark.parametrize("chunk", [None, 7])
def test_batch_matches_transformers(
    kind: str,
    chunk: int | None,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """A prompt that decodes past the window, and prompts of 3x and 5x it; the sampled
    tokens' logprobs within 1e-4 of transformers' (the final soft cap shows there)."""
    ck = _checkpoint(make_checkpoint, kind)
    prompts = greedy.prompts([6, 3 * WINDOW, 5 * WINDOW], seed=51)
    greedy.assert_matches_transformers(
        ck, make_runner(ck), prompts, NEW_TOKENS, chunk=chunk, logprobs_abs=1e-4
    )


@pytest.mark.parametrize("kind", list(GEMMA))
def test_prefix_cache_hit_matches_transformers(
    kind: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """The first 64 tokens (four blocks, past the window) come from an earlier request."""
    ck = _checkpoint(make_checkpoint, kind)
    donor, tail = greedy.prompts([70, 15], seed=52)
    greedy.assert_prefix_hit_matches_transformers(
        ck, make_runner(ck), donor, donor[:64] + tail, 4, NEW_TOKENS
    )


@pytest.mark.parametrize(  # the interpreted Triton kernels are slow: the soft cap's family only
    ("kind", "backend"), [("gemma2", "reference"), ("gemma3", "reference"), ("gemma2", "triton")]
)
def test_kernel_backends_match_transformers(
    kind: str,
    backend: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
    triton_device: str,
) -> None:
    """The kernel contract (soft cap included) on the reference and Triton kernels."""
    from legato.kernels import triton_available

    if backend == "triton" and not triton_available():
        pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")
    ck = _checkpoint(make_checkpoint, kind)
    prompts = greedy.prompts([2 * WINDOW + 5, 9], seed=53)
    device = triton_device if backend == "triton" else "cpu"
    runner = make_runner(ck, attention_backend=backend, device=device)
    greedy.assert_matches_transformers(ck, runner, prompts, NEW_TOKENS, chunk=16)


@pytest.mark.parametrize("kind", list(GEMMA))
def test_gguf_file_matches_transformers(
    kind: str, make_checkpoint: Callable[..., Any], greedy: Any, tmp_path: Any
) -> None:
    """The checkpoint written as llama.cpp would (norms stored as ``1 + w``, Gemma's norm
    names, soft caps and window in the metadata): from an F32 file legato gives
    transformers' tokens on the checkpoint; from a Q8_0 file the matrices stay quantized
    and the tokens equal the dequantized path's. llama.cpp stores no
    ``query_pre_attn_scalar`` (it takes ``head_dim`` below 27B): here it is ``head_dim``."""
    from legato.testing.gguf_files import write_gguf

    ck = make_checkpoint(kind, **{**GEMMA[kind], "query_pre_attn_scalar": 16,
                                  "intermediate_size": 128})  # fmt: skip
    prompts = greedy.prompts([6, 2 * WINDOW + 3], seed=54)
    f32 = write_gguf(ck.path, tmp_path / f"{kind}-f32.gguf", tensor_type="F32")
    assert load_model_config(f32).architecture == CLASSES[kind].__name__
    tokens, _ = greedy.run_file(f32, prompts, NEW_TOKENS)
    assert tokens == greedy.transformers(ck, prompts, NEW_TOKENS)
    q8 = write_gguf(ck.path, tmp_path / f"{kind}-q8.gguf", tensor_type="Q8_0")
    kept, runner = greedy.run_file(q8, prompts, NEW_TOKENS)
    assert runner.model.quantized_bytes() > 0
    assert kept == greedy.run_file(q8, prompts, NEW_TOKENS, gguf_dequantize=True)[0]
