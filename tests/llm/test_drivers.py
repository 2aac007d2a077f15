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


def folded(latest: dict[int, Any], out: RequestOutput) -> RequestOutput:
    """``out`` with every completion seen so far (CUMULATIVE n>1 streams, as vLLM's, only
    the completions that advanced; a consumer keeps the latest of each index)."""
    latest.update((c.index, c) for c in out.outputs)
    return RequestOutput(out.request_id, None, None, None, list(latest.values()), out.finished)


def with_llm_engine(
    model: Path, requests: dict[str, Any]
) -> tuple[dict[str, Outcome], list[float]]:
    engine = LLMEngine(EngineConfig(model=str(model), **ENGINE_ARGS))
    for name, (prompt, params, lora) in requests.items():
        engine.add_request(name, {"prompt_token_ids": prompt}, params, lora_request=lora)
    engine.add_request("embed", {"prompt_token_ids": PROMPTS[2]}, PoolingParams(task="embed"))
    finals: dict[str, Outcome] = {}
    vector: list[float] = []
    latest: dict[str, dict[int, Any]] = {name: {} for name in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, PoolingRequestOutput):
                vector = out.outputs.data
            else:
                whole = folded(latest[out.request_id], out)
                if out.finished:
                    finals[out.request_id] = outcome(whole)
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
                    latest: dict[int, Any] = {}
                    async for out in stream:
                        whole = folded(latest, out)
                        if out.finished:
                            finals[name] = outcome(whole)

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


def test_llm_engine_takes_vllms_calls_unchanged(toy_model_dir: Path) -> None:
    """vLLM's positional ``add_request``, an EngineCoreRequest from ``input_processor``,
    n>1 as one output per child, ``get_metrics`` as ``list[Metric]``, ``collective_rpc``
    with a callable, ``apply_model``, the DP members at one engine, the constructor."""
    from legato.metrics.reader import Counter, Gauge, Metric
    from legato.protocol.outputs import RequestOutput as Out
    from legato.vllm_config import VllmConfig

    config = EngineConfig(model=str(toy_model_dir), max_model_len=128, num_kv_blocks=64)
    engine = LLMEngine(VllmConfig.of(config), None, False)  # vllm_config, executor_class, log_stats
    assert engine.log_stats is False and engine.dp_group is None
    assert engine.has_unfinished_requests_dp(True) and not engine.should_execute_dummy_batch
    with pytest.raises(ValueError, match="executor_class"):
        LLMEngine(config, object())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # (request_id, prompt, params, arrival_time, lora_request, tokenization_kwargs,
    #  trace_headers, priority), by position.
    engine.add_request("pos", "hello", params, None, None, {"add_special_tokens": False}, {}, 0)
    with pytest.raises(TypeError, match="request_id"):
        engine.add_request(7, "hello", params)  # type: ignore[arg-type]
    request = engine.input_processor.process_inputs("core", "hello there", params)
    engine.input_processor.assign_request_id(request)
    assert engine.add_request("ignored", request) == "core"  # the request's own id
    n2 = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, n=2, seed=1)
    engine.add_request("pair", [5, 6, 7], n2)
    outs: list[Out] = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if isinstance(o, Out)]
    pair = [o for o in outs if o.request_id == "pair"]
    assert pair and all(len(o.outputs) == 1 for o in pair)  # one per child, as vLLM's
    assert {o.outputs[0].index for o in pair} == {0, 1}
    assert [o.finished for o in pair].count(True) == 1 and pair[-1].finished
    finals = {o.request_id: o for o in outs if o.finished}
    assert len(finals["pos"].outputs[0].token_ids) == 4 and "core" in finals
    metrics = engine.get_metrics()
    assert all(isinstance(one, Metric) for one in metrics)
    by_name = {one.name: one for one in metrics}
    assert isinstance(by_name["legato:num_requests_running"], Gauge)
    generated = by_name["legato:generation_tokens"]
    assert isinstance(generated, Counter) and generated.value == 4 + 4 + 3 * 2
    (size,) = engine.collective_rpc(lambda worker, k: k * worker.model_runner.vocab_size, args=(2,))
    assert size == 2 * engine.renderer.vocab_size
    (params_count,) = engine.apply_model(lambda model: sum(p.numel() for p in model.parameters()))
    assert isinstance(params_count, int) and params_count > 0
    assert isinstance(engine.apply_model(lambda model: model)[0], torch.nn.Module)
    # model_executor, as vLLM's in-process executor: driver_worker.worker.model_runner.model
    # (the wrapper forwards too), collective_rpc by name or callable, one result per worker
    executor = engine.model_executor
    model = executor.driver_worker.worker.model_runner.model
    assert isinstance(model, torch.nn.Module) and executor.driver_worker.get_model() is model
    held = executor.collective_rpc("held_requests")  # a runner method, by name
    assert held == [model_runner_held(engine)] and held[0] is not None
    assert executor.collective_rpc(lambda w: w.worker is engine.worker, single_value=True)
    executor.check_health()


def model_runner_held(engine: LLMEngine) -> list[str]:
    held: list[str] = engine.worker.runner.held_requests()  # type: ignore[attr-defined]
    return held


def test_llm_engine_logger_manager_takes_vllms_record(toy_model_dir: Path) -> None:
    """``logger_manager.record(scheduler_stats, iteration_stats, mm_cache_stats,
    engine_idx)`` reaches every logger, as vLLM's StatLoggerManager."""
    from legato.metrics.logger_base import StatLoggerBase
    from legato.metrics.records import StepStats
    from legato.protocol.messages import SchedulerStats

    seen: list[tuple[int, int]] = []

    class Sink(StatLoggerBase):
        def record(self, scheduler_stats: Any, iteration_stats: Any, mm: Any = None,
                   engine_idx: int = 0) -> None:  # fmt: skip
            seen.append((scheduler_stats.num_running_reqs, iteration_stats.num_generation_tokens))

    engine = LLMEngine.from_engine_args(
        str(toy_model_dir), max_model_len=128, num_kv_blocks=64, stat_loggers=[Sink()]
    )
    manager = engine.logger_manager
    manager.record(SchedulerStats(num_running=2), StepStats(0.0, num_generation_tokens=5), None, 0)
    manager.record(SchedulerStats(num_running=1), None)
    assert seen == [(2, 5), (1, 0)]
    assert any(isinstance(one, Sink) for one in manager.stat_loggers)
    manager.log_engine_initialized()
    manager.log()


def test_llm_engine_sleep_keep_continues_requests_after_waking(toy_model_dir: Path) -> None:
    """``sleep(mode="keep")`` freezes the live requests (step() runs nothing) and after
    ``wake_up`` they finish with the tokens they would have had; "abort" forgets them."""
    engine = LLMEngine.from_engine_args(
        str(toy_model_dir), max_model_len=128, num_kv_blocks=64, disable_log_stats=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(rid: str, sleep_mode: str | None) -> list[int]:
        engine.add_request(rid, PROMPTS[0], params)
        engine.step()
        if sleep_mode is not None:
            engine.sleep(1, mode=sleep_mode)
            assert engine.step() == [] and engine.is_sleeping()
            engine.wake_up()
        last: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert isinstance(out, RequestOutput)
                last = list(out.outputs[0].token_ids)
        return last

    reference = run("plain", None)
    assert len(reference) == 12
    assert run("kept", "keep") == reference
    assert run("aborted", "abort") == []  # forgotten: no output after the abort
