"""Sliding-window attention (Mistral, Qwen2): greedy tokens identical to transformers (fp32)
on prompts and generations several times longer than the window.

A Mistral config windows every layer; a Qwen2 config with ``use_sliding_window``
windows the layers from ``max_window_layers`` on and keeps full attention below
(transformers' ``layer_types``), so one model mixes both. Whole prefill, chunked
prefill, a start from a cached prefix, and the reference and Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from legato.models.config import load_model_config

WINDOW = 24
NEW_TOKENS = 48
WINDOWED: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


def test_config_layers(make_checkpoint: Callable[..., Any]) -> None:
    mistral = load_model_config(make_checkpoint("mistral", **WINDOWED["mistral"]).path)
    assert [mistral.window_of(i) for i in range(2)] == [WINDOW, WINDOW]
    qwen2 = load_model_config(make_checkpoint("qwen2", **WINDOWED["qwen2"]).path)
    assert [qwen2.window_of(i) for i in range(2)] == [None, WINDOW]
    plain = load_model_config(make_checkpoint("qwen2").path)  # use_sliding_window false
    assert plain.sliding_window is None and plain.window_of(1) is None


@pytest.mark.parametrize("kind", list(WINDOWED))
@pytest.mark.parametrize("chunk", [None, 7])
def test_longer_than_the_window_matches_transformers(
    kind: str,
    chunk: int | None,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """A prompt shorter than the window that decodes past it, and prompts of 3x and 5x it."""
    ck = make_checkpoint(kind, **WINDOWED[kind])
    prompts = greedy.prompts([10, 3 * WINDOW, 5 * WINDOW], seed=31)
    runner = make_runner(ck)
    assert runner.max_model_len == 512  # the window no longer caps the length
    greedy.assert_matches_transformers(ck, runner, prompts, NEW_TOKENS, chunk=chunk)


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_prefix_cache_hit_past_the_window_matches_transformers(
    kind: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """The first 64 tokens (four blocks, past the window) come from an earlier request."""
    ck = make_checkpoint(kind, **WINDOWED[kind])
    donor, tail = greedy.prompts([70, 15], seed=32)
    greedy.assert_prefix_hit_matches_transformers(
        ck, make_runner(ck), donor, donor[:64] + tail, 4, NEW_TOKENS
    )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_kernel_backends_match_transformers(
    backend: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
    triton_device: str,
) -> None:
    from legato.kernels import triton_available

    if backend == "triton" and not triton_available():
        pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")
    ck = make_checkpoint("qwen2", **WINDOWED["qwen2"])
    device = triton_device if backend == "triton" else "cpu"
    runner = make_runner(ck, attention_backend=backend, device=device)
    prompts = greedy.prompts([2 * WINDOW + 5, 9], seed=33)
    greedy.assert_matches_transformers(ck, runner, prompts, NEW_TOKENS, chunk=16)


def _serve(
    runner: Any, window: int | None, requests: list[tuple[str, list[int], int]]
) -> tuple[dict[str, list[int]], dict[str, int], int, dict[str, int]]:
    """Drive the real scheduler (``kv_sliding_window=window``) and ``runner``; each request
    is added once the one before it finished. Returns the tokens per request, the most
    blocks each held at once (null entries not counted), the pool's peak usage, and each
    request's prefix-cache hit in tokens."""
    from legato.protocol.messages import EngineRequest
    from legato.protocol.params import SamplingParams
    from legato.scheduling.scheduler import Scheduler

    config = runner.config.resolved(
        max_model_len=runner.max_model_len, num_kv_blocks=runner.num_kv_blocks
    )
    sched = Scheduler(config, kv_sliding_window=window)
    tokens: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    cached: dict[str, int] = {}
    peak = 0
    for arrival, (rid, prompt, n) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=n)
        sched.add_request(EngineRequest(rid, prompt, params, float(arrival)))
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            blocks = sched.kv.get_blocks(rid)
            held[rid] = max(held.get(rid, 0), sum(b is not sched.kv.null_block for b in blocks))
            if window is not None and rid in sched.requests:  # nothing still visible went
                computed = sched.requests[rid].num_computed_tokens
                first_needed = max(computed - window + 1, 0) // config.block_size
                assert sched.kv.null_block not in blocks[first_needed:], (rid, computed)
            peak = max(peak, sched.kv.num_used_blocks)
            result = sched.update_from_output(plan, runner.execute(plan))
            for out in result.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
    return tokens, held, peak, cached


def test_blocks_out_of_the_window_are_released(
    make_checkpoint: Callable[..., Any], make_runner: Callable[..., Any], greedy: Any
) -> None:
    """A 200-token generation on a window of 24 (every layer) holds at most three 16-token
    blocks at once, against fifteen without the release; the tokens equal transformers'.
    A second request that shares the first one's first 48 tokens still hits them in the
    prefix cache (released blocks stay cached until evicted) and matches too."""
    ck = make_checkpoint("mistral", **WINDOWED["mistral"])
    (first,) = greedy.prompts([40], seed=34)
    second = first + greedy.prompts([30], seed=35)[0]  # all of "long"'s prompt, and more
    requests = [("long", first, 200), ("hit", second, 24)]
    runner = make_runner(ck, num_kv_blocks=64, enable_prefix_caching=True)
    assert runner.kv_sliding_window == WINDOW
    tokens, held, peak, cached = _serve(runner, WINDOW, requests)
    for rid, prompt, n in requests:
        assert tokens[rid] == greedy.transformers(ck, [prompt], n)[0], rid
    assert held["long"] <= 3, held  # tokens p-23..p span at most 2 blocks, plus the next
    assert cached["hit"] >= 32  # blocks released by "long" came back as a prefix hit
    runner = make_runner(ck, num_kv_blocks=64, enable_prefix_caching=True)
    tokens_kept, held_kept, peak_kept, _ = _serve(runner, None, requests)
    assert tokens_kept == tokens
    assert held_kept["long"] == -(-(40 + 200) // 16) and peak_kept > peak


def test_no_release_when_any_layer_is_global(make_checkpoint: Callable[..., Any]) -> None:
    """Qwen2 here windows layer 1 only: layer 0 reads every block, none may go."""
    cfg = load_model_config(make_checkpoint("qwen2", **WINDOWED["qwen2"]).path)
    assert cfg.uniform_window is None
    cfg = load_model_config(make_checkpoint("mistral", **WINDOWED["mistral"]).path)
    assert cfg.uniform_window == WINDOW
