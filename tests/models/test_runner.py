"""ModelRunner mechanics: sizing, step deltas, prompt logprobs, preemption, sleep, reset."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from legato.config import EngineConfig
from legato.models.layers import Linear
from legato.models.runner import ModelRunner
from legato.protocol.messages import (
    CachedRequestData,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _step(step_id: int, new: list[NewRequestData], cached: CachedRequestData | None, sched: dict[str, int], **kw: Any) -> SchedulerOutput:  # fmt: skip
    cached = CachedRequestData() if cached is None else cached
    params = {r.params_key: RunnerSamplingParams.of(GREEDY) for r in new}
    return SchedulerOutput(
        step_id, new, cached, sched, sum(sched.values()), **kw, sampling_params=params
    )


def _generate(runner: ModelRunner, mini_scheduler: Any, n: int = 12) -> dict[str, list[int]]:
    sched = mini_scheduler(runner)
    sched.add("a", _prompt(9, 1), max_tokens=n)
    sched.add("b", _prompt(21, 2), SamplingParams(temperature=0.8, seed=5), max_tokens=n)
    return dict(sched.run())


def test_attributes_and_sizing(llama: Any) -> None:
    runner = ModelRunner(EngineConfig(model=str(llama.path), device="cpu", max_num_seqs=4))
    # default CPU budget: what max_model_len x max_num_seqs needs (under 1 GiB here)
    assert runner.max_model_len == 512
    assert runner.num_kv_blocks == 512 // 16 * 4
    assert runner.vocab_size == 384 and runner.dtype == torch.float32
    assert runner.device == torch.device("cpu") and runner.eos_token_ids == []
    assert runner.kv_caches[0][0].shape == (runner.num_kv_blocks, 16, 2, 16)

    block_bytes = runner.kv_block_bytes
    capped = ModelRunner(
        EngineConfig(model=str(llama.path), device="cpu", kv_cache_memory=10 * block_bytes)
    )
    assert capped.num_kv_blocks == 10 and capped.max_model_len == 160
    explicit = ModelRunner(
        EngineConfig(model=str(llama.path), device="cpu", num_kv_blocks=7, max_model_len=100)
    )
    assert explicit.num_kv_blocks == 7 and explicit.max_model_len == 100


def test_eos_ids_from_generation_config(make_checkpoint: Callable[..., Any]) -> None:
    ck = make_checkpoint("qwen2", eos_token_id=[5, 6])
    runner = ModelRunner(EngineConfig(model=str(ck.path), device="cpu", num_kv_blocks=8))
    assert runner.eos_token_ids == [5, 6] and runner.eos_token_id == 5


def test_partial_prefill_samples_nothing(llama: Any, make_runner: Callable[..., Any]) -> None:
    runner = make_runner(llama)
    prompt = _prompt(20)
    new = NewRequestData("a", prompt, "a", [0, 1], 0)
    out = runner.execute(_step(0, [new], None, {"a": 12}))
    assert out.req_ids == ["a"] and out.num_sampled == [0] and out.sampled_token_ids == []
    out = runner.execute(_step(1, [], CachedRequestData(["a"], [12]), {"a": 8}))
    assert out.num_sampled == [1] and len(out.sampled_token_ids) == 1


def test_inconsistent_steps_are_clear_errors(llama: Any, make_runner: Callable[..., Any]) -> None:
    runner = make_runner(llama)
    new = NewRequestData("a", _prompt(20), "a", [0], 0)
    with pytest.raises(ValueError, match="blocks hold 16 tokens, 20 scheduled"):
        runner.execute(_step(0, [new], None, {"a": 20}))
    new = NewRequestData("b", _prompt(5), "b", [1], 0)
    with pytest.raises(ValueError, match="only 5 tokens are known"):
        runner.execute(_step(1, [new], None, {"b": 6}))
    with pytest.raises(KeyError, match="nope"):
        runner.execute(_step(2, [], None, {"nope": 1}))


def test_finished_and_preempted_state_is_dropped(
    llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    runner = make_runner(llama)
    sched = mini_scheduler(runner)
    sched.add("a", _prompt(5), max_tokens=2)
    sched.add("b", _prompt(6), max_tokens=6)
    sched.step()
    sched.step()
    assert sorted(runner.held_requests()) == ["a", "b"]
    sched.step()  # tells the runner that "a" finished
    assert runner.held_requests() == ["b"]
    runner.execute(_step(9, [], None, {}, preempted_req_ids=["b"]))
    assert runner.held_requests() == []


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, seed=11)])
def test_preempted_request_resumes_identically(
    params: SamplingParams, llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    """Recomputed from prompt + outputs, it continues as if never interrupted (seeded too)."""
    prompt = _prompt(13, 3)
    plain = mini_scheduler(make_runner(llama))
    plain.add("a", prompt, params, max_tokens=20)
    expected = plain.run()["a"]
    sched = mini_scheduler(make_runner(llama), chunk=8)
    sched.add("a", prompt, params, max_tokens=20)
    sched.add("other", _prompt(7, 4), SamplingParams(temperature=1.0), max_tokens=20)
    for _ in range(8):
        sched.step()
    sched.preempt("a")
    assert sched.run()["a"] == expected


def test_seeded_request_independent_of_companions(
    llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    results = []
    for companions in (0, 3):
        sched = mini_scheduler(make_runner(llama, seed=companions))
        for i in range(companions):
            sched.add(f"c{i}", _prompt(4 + i, 10 + i), SamplingParams(temperature=1.0))
        sched.add("s", _prompt(10, 5), seeded, max_tokens=16)
        results.append(sched.run()["s"])
    assert results[0] == results[1]


@pytest.mark.parametrize("chunk", [None, 7])
def test_prompt_logprobs_match_transformers(
    chunk: int | None, llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    prompt = _prompt(18, 6)
    with torch.no_grad():
        logits = llama.hf_model(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    sched = mini_scheduler(make_runner(llama), chunk=chunk)
    sched.add("a", prompt, SamplingParams(temperature=0.0, prompt_logprobs=2), max_tokens=2)
    sched.run()
    entries = sched.done["a"].prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry = entries[pos]
        assert entry is not None and entry.token_ids[0] == prompt[pos]
        assert abs(entry.logprobs[0] - expected[pos - 1, prompt[pos]].item()) < 1e-4
        top = expected[pos - 1].topk(2)
        assert entry.token_ids[1:] == top.indices.tolist()
        rank = int((expected[pos - 1] > expected[pos - 1, prompt[pos]]).sum()) + 1
        assert entry.ranks == [rank, 1, 2]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_round_trip(
    level: int, llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    runner = make_runner(llama)
    before = _generate(runner, mini_scheduler)
    runner.sleep(level)
    assert runner.sleeping and runner.kv_caches == []
    with pytest.raises(RuntimeError, match="asleep"):
        runner.execute(_step(0, [], None, {}))
    if level == 2:
        assert all(p.numel() == 0 for p in runner.model.parameters())
        runner.wake_up(["kv_cache"])
        assert runner.sleeping
    runner.wake_up()
    assert not runner.sleeping
    fresh = make_runner(llama)
    assert _generate(runner, mini_scheduler) == before == _generate(fresh, mini_scheduler)


def test_reset_kv_cache(llama: Any, make_runner: Callable[..., Any], mini_scheduler: Any) -> None:
    runner = make_runner(llama)
    before = _generate(runner, mini_scheduler)
    assert any(bool(k.any()) for k, _ in runner.kv_caches)
    runner.reset_kv_cache()
    assert not any(bool(k.any()) or bool(v.any()) for k, v in runner.kv_caches)
    assert _generate(runner, mini_scheduler) == before


def test_profile_run(llama: Any, make_runner: Callable[..., Any]) -> None:
    runner = make_runner(llama, max_num_batched_tokens=256, max_num_seqs=4)
    snapshot = [k.clone() for k, _ in runner.kv_caches]
    figures = runner.profile_run()
    assert figures["num_tokens"] == 256 and figures["num_seqs"] == 4
    assert figures["seconds"] > 0
    # Packed weights count as held: a panel copy holds its padding too, never less than the weight.
    params = sum(p.numel() for p in llama.hf_model.parameters())
    packed = [m for m in runner.model.modules() if isinstance(m, Linear) and m.packed is not None]
    held = sum(p.numel() * 4 for p in runner.model.parameters())
    held += sum(m.packed.nbytes for m in packed)  # type: ignore[attr-defined]
    assert figures["weights_bytes"] == held >= params * 4
    assert figures["kv_cache_bytes"] == runner.num_kv_blocks * runner.kv_block_bytes
    assert figures["activation_bytes"] > 0 and figures["peak_memory_bytes"] > 0
    assert all(torch.equal(a, k) for a, (k, _) in zip(snapshot, runner.kv_caches))


def test_runs_the_embedded_toy_model(
    toy_model_dir: Any, make_runner: Callable[..., Any], mini_scheduler: Any
) -> None:
    """The project's own toy checkpoint loads and matches transformers greedily.

    Both mask EOS for all 12 tokens (min_tokens / min_new_tokens).
    """
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    runner = make_runner(SimpleNamespace(path=toy_model_dir))
    assert runner.eos_token_ids and runner.vocab_size > 256
    prompt = list(range(3, 20))
    sched = mini_scheduler(runner)
    params = SamplingParams(temperature=0.0, min_tokens=12, max_tokens=12)
    sched.add("a", prompt, params, max_tokens=12)
    hf = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12
        )[0, len(prompt) :].tolist()
    assert sched.run()["a"] == expected


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=3.0),
        SamplingParams(temperature=0.0, logit_bias={7: 1.5}),
    ],
)
def test_plain_greedy_rows_skip_the_sampler_with_its_tokens(
    params: SamplingParams,
    llama: Any,
    make_runner: Callable[..., Any],
    mini_scheduler: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A greedy request that needs nothing but the argmax (no logprobs, penalties, bias,
    bans) takes it right after the LM head; its tokens are the sampler's. One that needs
    more still goes through the sampler."""
    import legato.models.runner as runner_module

    prompt = _prompt(11, 6)
    # logprobs change no token, but only the sampler computes them
    reference = mini_scheduler(make_runner(llama))
    reference.add("a", prompt, params.clone(logprobs=0), max_tokens=16)
    expected = reference.run()["a"]
    assert len(set(expected)) > 1, "a degenerate reference proves nothing"

    calls: list[int] = []
    real = runner_module.sample
    monkeypatch.setattr(runner_module, "sample", lambda *a: calls.append(1) or real(*a))
    sched = mini_scheduler(make_runner(llama))
    sched.add("a", prompt, params, max_tokens=16)
    assert sched.run()["a"] == expected
    plain = params.repetition_penalty == 1.0 and not params.logit_bias
    assert (calls == []) == plain
