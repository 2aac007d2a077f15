"""Greedy generation on our runner is token-identical to transformers' generate().

Driven by the mini scheduler in conftest: several prompts of different lengths
share one batch; also chunked prefill, a start from a cached prefix, and the
torch and reference attention backends. bf16 is checked for a floor on the
rate of agreement (rounding makes exact identity too strong a claim).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.protocol.params import SamplingParams

NEW_TOKENS = 64


def test_greedy_batch_matches_transformers(
    checkpoint: Any,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
    greedy: Any,
) -> None:
    """Prompts of different lengths in one batch; sampled-token logprobs agree within 1e-4."""
    prompts = greedy.prompts([5, 23, 40], seed=0)
    sched = mini_scheduler(make_runner(checkpoint))
    params = SamplingParams(temperature=0.0, logprobs=2)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        expected, expected_lp = hf_greedy(checkpoint, prompt, NEW_TOKENS)
        assert outputs[f"r{i}"] == expected, f"{checkpoint.kind} prompt {i}"
        logprobs = sched.done[f"r{i}"].logprobs
        assert len(logprobs) == NEW_TOKENS
        for entry, token, lp in zip(logprobs, expected, expected_lp):
            assert entry.token_ids[0] == token and entry.ranks[0] == 1
            assert abs(entry.logprobs[0] - lp) < 1e-4
            assert len(entry.token_ids) == 3 and entry.token_ids[1] == token


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chunked_prefill_matches_transformers(
    kind: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """Prefills in 7-token chunks, interleaved with another request's decodes."""
    ck = make_checkpoint(kind)
    prompts = greedy.prompts([3, 30, 19], seed=1)
    greedy.assert_matches_transformers(ck, make_runner(ck), prompts, NEW_TOKENS, chunk=7)


@pytest.mark.parametrize("chunk", [None, 7])
def test_prefix_cache_hit_matches_transformers(
    chunk: int | None,
    llama: Any,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
    greedy: Any,
) -> None:
    """A request admitted with its first two blocks already written by an earlier one."""
    donor, tail = greedy.prompts([37, 9], seed=2)
    prompt = donor[:32] + tail
    sched = mini_scheduler(make_runner(llama), chunk=chunk)
    sched.add("donor", donor, max_tokens=4)
    sched.run()
    sched.add("hit", prompt, max_tokens=NEW_TOKENS, prefix_of="donor", prefix_blocks=2)
    first = sched.running["hit"]
    assert first.num_computed == 32
    assert sched.run()["hit"] == hf_greedy(llama, prompt, NEW_TOKENS)[0]


def test_reference_backend_agrees(
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
) -> None:
    """The reference kernels through the same model code give the same tokens."""
    ck = make_checkpoint("qwen2")
    prompts = greedy.prompts([6, 21], seed=3)
    runner = make_runner(ck, attention_backend="reference")
    greedy.assert_matches_transformers(ck, runner, prompts, 24, chunk=7)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_agreement_rate(
    kind: str,
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    greedy: Any,
) -> None:
    """bf16 vs transformers in bf16: the first 16 greedy tokens agree for most prompts."""
    ck = make_checkpoint(kind)
    hf = copy.deepcopy(ck.hf_model).to(torch.bfloat16)
    prompts = greedy.prompts([4, 7, 11, 16, 20, 25, 31, 40], seed=4)
    sched = mini_scheduler(make_runner(ck, dtype="bfloat16"))
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, max_tokens=16)
    outputs = sched.run()
    agree = 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
        agree += outputs[f"r{i}"] == expected[0, len(prompt) :].tolist()
    rate = agree / len(prompts)
    print(f"bf16 {kind}: first 16 greedy tokens identical for {agree}/{len(prompts)} = {rate:.0%}")
    assert rate >= 0.5


def test_triton_backend_agrees(
    make_checkpoint: Callable[..., Any],
    make_runner: Callable[..., Any],
    greedy: Any,
    triton_device: str,
) -> None:
    """The same model code on the Triton kernels (the interpreter on CPU-only machines)."""
    from legato.kernels import triton_available

    if not triton_available():
        pytest.skip("triton cannot run here (no CUDA device and no TRITON_INTERPRET)")
    ck = make_checkpoint("qwen3")
    prompts = greedy.prompts([5, 11], seed=5)
    runner = make_runner(ck, attention_backend="triton", device=triton_device)
    assert runner.backend.name == "triton"
    greedy.assert_matches_transformers(ck, runner, prompts, 6, chunk=7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("chunk", [None, 16])
def test_cuda_triton_engine_matches_torch_path_and_transformers(
    checkpoint: Any,
    chunk: int | None,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
    greedy: Any,
) -> None:
    """fp32 on the GPU: the Triton engine (decode steps replaying the CUDA graphs it
    captured at start-up) and the torch path on the same GPU give transformers' greedy
    tokens, with sampled-token logprobs within 1e-4 of each other; chunked prefill
    mixes prefill chunks with decodes."""
    prompts = greedy.prompts([5, 23, 40, 17], seed=6)
    params = SamplingParams(temperature=0.0, logprobs=1)
    runs: dict[str, Any] = {}
    for backend in ("triton", "torch"):
        runner = make_runner(checkpoint, attention_backend=backend, device="cuda")
        assert runner.backend.name == backend
        assert (runner.decode_graphs is not None) == (backend == "triton")
        sched = mini_scheduler(runner, chunk=chunk)
        for i, prompt in enumerate(prompts):
            sched.add(f"r{i}", prompt, params, max_tokens=NEW_TOKENS)
        sched.run()
        if runner.decode_graphs is not None:
            assert sum(runner.decode_graphs.replays.values()) >= NEW_TOKENS - 1
        runs[backend] = sched.done
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(checkpoint, prompt, NEW_TOKENS)[0]
        for backend, done in runs.items():
            assert done[f"r{i}"].outputs == expected, f"{checkpoint.kind} {backend} prompt {i}"
        triton_lp = [e.logprobs[0] for e in runs["triton"][f"r{i}"].logprobs]
        torch_lp = [e.logprobs[0] for e in runs["torch"][f"r{i}"].logprobs]
        torch.testing.assert_close(triton_lp, torch_lp, rtol=0, atol=1e-4)


def test_bf16_teacher_forced_agreement(
    checkpoint: Any,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    hf_greedy: Any,
    greedy: Any,
    triton_device: str,
) -> None:
    """bf16 on the device's default path (the Triton kernels on a GPU, torch on CPU), fed
    each prompt followed by transformers' fp32 greedy continuation: its argmax equals the
    next continuation token at >= 95% of the positions (ranks from prompt logprobs)."""
    n = 32
    prompts = greedy.prompts([4, 9, 16, 25, 40, 7], seed=7)
    runner = make_runner(checkpoint, dtype="bfloat16", device=triton_device)
    assert runner.dtype == torch.bfloat16
    sched = mini_scheduler(runner)
    continuations = [hf_greedy(checkpoint, prompt, n)[0] for prompt in prompts]
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
        sched.add(f"r{i}", prompt + cont, params, max_tokens=1)
    sched.run()
    ranks = []
    for i, prompt in enumerate(prompts):
        entries = sched.done[f"r{i}"].prompt_logprobs
        assert len(entries) == len(prompt) + n
        ranks += [entry.ranks[0] for entry in entries[len(prompt) :]]
    rate = sum(r == 1 for r in ranks) / len(ranks)
    print(f"bf16 {checkpoint.kind} on {triton_device}: teacher-forced argmax agreement {rate:.1%}")
    assert rate >= 0.95
