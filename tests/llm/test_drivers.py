"""Every driver gives the same outputs: ``LLMEngine`` (synchronous, in this thread),
``AsyncEngine`` (the actors) and ``LLM`` (``AsyncEngine`` on a thread of its own).

The same requests go through each: greedy, n>1 with a seed, stop strings, a
grammar (structured outputs), a LoRA adapter and an embedding. Generated
tokens, texts and finish reasons must be identical; embeddings equal within
float rounding (the batch around them may differ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from legato import SamplingParams, open_engine
from legato.config import EngineConfig
from legato.llm import LLM, LLMEngine
from legato.protocol.outputs import PoolingRequestOutput, RequestOutput
from legato.protocol.params import LoRARequest, PoolingParams

ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=256,
    num_kv_blocks=200,
    disable_log_stats=True,
    dtype="float32",
    enable_lora=True,
    max_loras=2,
    max_lora_rank=8,
)
PROMPTS = [
    [5, 300, 71, 1200, 9, 44, 803, 17, 650, 1000, 23, 88, 400, 12, 90, 1500, 2000, 7],
    [40, 41, 42, 900, 901, 33],
    [1777, 3, 250, 251, 252, 253, 640, 641, 99, 100, 101, 102, 103],
]
Outcome = list[tuple[int, list[int], str, str | None, Any]]  # per completion


@pytest.fixture(scope="module")
def requests(make_toy_adapter: Any) -> dict[str, tuple[list[int], SamplingParams, Any]]:
    """name -> (prompt, params, adapter or None)."""
    adapter = make_toy_adapter(r=4, targets=("q_proj", "v_proj"), seed=1)
    lora = LoRARequest("a", 1, str(adapter.path))
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    return {
        "greedy": (PROMPTS[0], SamplingParams(**greedy), None),
        "n=3 seeded": (
            PROMPTS[1],
            SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
            None,
        ),
        "stop strings": (
            PROMPTS[2],
            SamplingParams(temperature=0.0, max_tokens=40, stop=["e", "a"], ignore_eos=True),
            None,
        ),
        "grammar": (
            PROMPTS[0],
            SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "[ab]{5}"}),
            None,
        ),
        "lora": (PROMPTS[0], SamplingParams(**greedy), lora),  # as "greedy", with an adapter
    }


def outcome(out: RequestOutput) -> Outcome:
    return [
        (c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason)
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]


def with_llm_engine(
    model: Path, requests: dict[str, Any]
) -> tuple[dict[str, Outcome], list[float]]:
    engine = LLMEngine(EngineConfig(model=str(model), **ENGINE_ARGS))
    for name, (prompt, params, lora) in requests.items():
        engine.add_request(name, {"prompt_token_ids": prompt}, params, lora_request=lora)
    engine.add_request("embed", {"prompt_token_ids": PROMPTS[2]}, PoolingParams(task="embed"))
    finals: dict[str, Outcome] = {}
    vector: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, PoolingRequestOutput):
                vector = out.outputs.data
            elif out.finished:
                finals[out.request_id] = outcome(out)
    return finals, vector


def with_async_engine(
    model: Path, requests: dict[str, Any]
) -> tuple[dict[str, Outcome], list[float]]:
    finals: dict[str, Outcome] = {}
    vector: list[float] = []

    async def main() -> None:
        nonlocal vector
        async with open_engine(str(model), **ENGINE_ARGS) as engine:

            async def one(name: str, prompt: list[int], params: SamplingParams, lora: Any) -> None:
                async with engine.generate(
                    {"prompt_token_ids": prompt}, params, name, lora_request=lora
                ) as stream:
                    async for out in stream:
                        if out.finished:
                            finals[name] = outcome(out)

            async def embed() -> None:
                nonlocal vector
                params = PoolingParams(task="embed")
                async for out in engine.encode({"prompt_token_ids": PROMPTS[2]}, params, "embed"):
                    vector = out.outputs.data

            async with trio.open_nursery() as nursery:
                for name, (prompt, params, lora) in requests.items():
                    nursery.start_soon(one, name, prompt, params, lora)
                nursery.start_soon(embed)

    trio.run(main)
    return finals, vector


def with_llm(model: Path, requests: dict[str, Any]) -> tuple[dict[str, Outcome], list[float]]:
    names = list(requests)
    with LLM(str(model), **ENGINE_ARGS) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": requests[n][0]} for n in names],
            [requests[n][1] for n in names],
            lora_request=[requests[n][2] for n in names],
        )
        (embedded,) = llm.embed([{"prompt_token_ids": PROMPTS[2]}])
    return {n: outcome(o) for n, o in zip(names, outs, strict=True)}, embedded.outputs.data


def test_llm_engine_async_engine_and_llm_give_the_same_outputs(
    toy_model_dir: Path, requests: dict[str, Any]
) -> None:
    reference, reference_vector = with_llm_engine(toy_model_dir, requests)
    assert set(reference) == set(requests)
    # The cases do what they say (so agreeing on them means something).
    assert len(reference["n=3 seeded"]) == 3
    assert len({tuple(c[1]) for c in reference["n=3 seeded"]}) > 1  # the seeds differ
    assert reference["stop strings"][0][3] == "stop"
    grammar_text = reference["grammar"][0][2]
    assert len(grammar_text) == 5 and set(grammar_text) <= {"a", "b"}
    assert reference["lora"] != reference["greedy"]  # the adapter changes the tokens
    for driver in (with_async_engine, with_llm):
        finals, vector = driver(toy_model_dir, requests)
        assert finals == reference, driver.__name__
        torch.testing.assert_close(torch.tensor(vector), torch.tensor(reference_vector))


def test_llm_engine_reports_a_failed_request_once_and_forgets_it(toy_model_dir: Path) -> None:
    """vLLM's rule: a request that fails is reported once and removed; the engine goes
    on with the others (it used to raise from every later step())."""
    engine = LLMEngine.from_engine_args(
        str(toy_model_dir), max_model_len=128, num_kv_blocks=64, disable_log_stats=True
    )
    real_handle = engine.worker.handle

    def fail_bad(step: Any) -> Any:  # an injected fault: the runner fails request "bad"
        answer = real_handle(step)
        bad = engine.frontend.live.get("bad")
        if bad is not None and bad.engine_id in getattr(answer, "req_ids", ()):
            answer.failed = {bad.engine_id: "injected fault"}
        return answer

    engine.worker.handle = fail_bad  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("good", PROMPTS[0], params)
    engine.add_request("bad", PROMPTS[1], params)
    errors: list[Exception] = []
    finished: list[str] = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except Exception as exc:
            errors.append(exc)
            continue
        finished += [o.request_id for o in outputs if o.finished]
    assert not engine.has_unfinished_requests()
    assert finished == ["good"]
    assert len(errors) == 1 and "injected fault" in str(errors[0])
    assert engine.step() == []  # nothing left to raise
    engine.add_request("bad", PROMPTS[2], params)  # the id is free again
    assert "bad" in engine.frontend.live


def test_llm_engine_follows_vllms_constructors_and_refuses_tensor_parallelism(
    toy_model_dir: Path,
) -> None:
    from legato.vllm_config import EngineArgs

    args = EngineArgs(model=str(toy_model_dir), max_model_len=128, num_gpu_blocks_override=64)
    engine = LLMEngine.from_engine_args(args)
    assert engine.vllm_config.model_config.max_model_len == 128
    assert engine.model_config.model == str(toy_model_dir)
    again = LLMEngine.from_vllm_config(engine.vllm_config)
    assert again.config.num_kv_blocks == 64
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine(EngineConfig(model=str(toy_model_dir), tensor_parallel_size=2))


def test_an_llm_dropped_without_shutdown_releases_its_worker(toy_model_dir: Path) -> None:
    """As vLLM's engines: a finalizer stops the engine and reaps its worker process."""
    import gc

    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = LLM(str(toy_model_dir), max_model_len=128, num_kv_blocks=64, disable_log_stats=True)
    workers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert workers, "the LLM's engine runs its worker in a child process"
    del llm
    gc.collect()
    gone, alive = psutil.wait_procs(workers, timeout=60)
    assert not alive, f"worker processes still alive: {alive}"
