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
import torch

from legato.models.config import load_model_config
from legato.models.gemma2 import Gemma2ForCausalLM
from legato.models.gemma3 import Gemma3ForCausalLM
from legato.models.registry import resolve_architecture
from legato.protocol.params import SamplingParams

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


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in lengths]


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
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    """A prompt that decodes past the window, and prompts of 3x and 5x it; the sampled
    tokens' logprobs within 1e-4 of transformers' (the final soft cap shows there)."""
    ck = _checkpoint(make_checkpoint, kind)
    prompts = _prompts([6, 3 * WINDOW, 5 * WINDOW], seed=51)
    sched = mini_scheduler(make_runner(ck), chunk=chunk)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, SamplingParams(temperature=0.0, logprobs=0), NEW_TOKENS)
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        expected, expected_lp = hf_greedy(ck, prompt, NEW_TOKENS)
        assert len(set(expected)) > 2, "a degenerate reference proves little"
        assert outputs[f"r{i}"] == expected, f"{kind} chunk={chunk} prompt {i}"
        got_lp = [entry.logprobs[0] for entry in sched.done[f"r{i}"].logprobs]
        assert got_lp == pytest.approx(expected_lp, abs=1e-4)


@pytest.mark.parametrize("kind", list(GEMMA))
def test_prefix_cache_hit_matches_transformers(
    kind: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
) -> None:
    """The first 64 tokens (four blocks, past the window) come from an earlier request."""
    ck = _checkpoint(make_checkpoint, kind)
    donor, tail = _prompts([70, 15], seed=52)
    prompt = donor[:64] + tail
    sched = mini_scheduler(make_runner(ck))
    sched.add("donor", donor, max_tokens=2)
    sched.run()
    sched.add("hit", prompt, max_tokens=NEW_TOKENS, prefix_of="donor", prefix_blocks=4)
    assert sched.running["hit"].num_computed == 64
    assert sched.run()["hit"] == hf_greedy(ck, prompt, NEW_TOKENS)[0]


@pytest.mark.parametrize(  # the interpreted Triton kernels are slow: the soft cap's family only
    ("kind", "backend"), [("gemma2", "reference"), ("gemma3", "reference"), ("gemma2", "triton")]
)
def test_kernel_backends_match_transformers(
    kind: str,
    backend: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
    triton_device: str,
) -> None:
    """The kernel contract (soft cap included) on the reference and Triton kernels."""
    from legato.kernels import triton_available

    if backend == "triton" and not triton_available():
        pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")
    ck = _checkpoint(make_checkpoint, kind)
    prompts = _prompts([2 * WINDOW + 5, 9], seed=53)
    device = triton_device if backend == "triton" else "cpu"
    runner = make_runner(ck, attention_backend=backend, device=device)
    sched = mini_scheduler(runner, chunk=16)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, max_tokens=NEW_TOKENS)
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(ck, prompt, NEW_TOKENS)[0], f"{kind} prompt {i}"


@pytest.mark.parametrize("kind", list(GEMMA))
def test_gguf_file_matches_transformers(
    kind: str, make_checkpoint: Callable[..., Any], mini_scheduler: Any, hf_greedy: Any,
    tmp_path: Any,
) -> None:  # fmt: skip
    """The checkpoint written as llama.cpp would (norms stored as ``1 + w``, Gemma's norm
    names, soft caps and window in the metadata): from an F32 file legato gives
    transformers' tokens on the checkpoint; from a Q8_0 file the matrices stay quantized
    and the tokens equal the dequantized path's. llama.cpp stores no
    ``query_pre_attn_scalar`` (it takes ``head_dim`` below 27B): here it is ``head_dim``."""
    from legato.config import EngineConfig
    from legato.models.runner import ModelRunner
    from legato.testing.gguf_files import write_gguf

    ck = make_checkpoint(kind, **{**GEMMA[kind], "query_pre_attn_scalar": 16,
                                  "intermediate_size": 128})  # fmt: skip
    prompts = _prompts([6, 2 * WINDOW + 3], seed=54)

    def generate(path: Any, **engine: Any) -> tuple[list[list[int]], ModelRunner]:
        config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                              **engine)  # fmt: skip
        runner = ModelRunner(config)
        sched = mini_scheduler(runner)
        for i, prompt in enumerate(prompts):
            sched.add(f"r{i}", prompt, max_tokens=NEW_TOKENS)
        out = sched.run()
        return [out[f"r{i}"] for i in range(len(prompts))], runner

    f32 = write_gguf(ck.path, tmp_path / f"{kind}-f32.gguf", tensor_type="F32")
    assert load_model_config(f32).architecture == CLASSES[kind].__name__
    tokens, _ = generate(f32)
    assert tokens == [hf_greedy(ck, prompt, NEW_TOKENS)[0] for prompt in prompts]
    q8 = write_gguf(ck.path, tmp_path / f"{kind}-q8.gguf", tensor_type="Q8_0")
    kept, runner = generate(q8)
    assert runner.model.quantized_bytes() > 0
    assert kept == generate(q8, gguf_dequantize=True)[0]
