"""AsyncEngine where vLLM's engines define the behaviour: errors, shutdown, getters, arguments."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest
import trio

from legato import EngineArgs, EngineDeadError, LoRARequest, SamplingParams
from legato.engine import AsyncEngine, open_engine
from legato.protocol.errors import ValidationError

ENGINE_ARGS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, disable_log_stats=True)


@pytest.fixture
async def engine(toy_model_dir: Any) -> AsyncIterator[AsyncEngine]:
    args = EngineArgs(
        model=str(toy_model_dir),
        max_model_len=256,
        num_gpu_blocks_override=64,
        disable_log_stats=True,
        legato_options={"executor": "inproc"},
    )
    async with open_engine(args) as eng:  # vLLM's EngineArgs
        yield eng


async def test_config_attributes_and_getters_under_vllms_names(engine: AsyncEngine) -> None:
    vllm_config = await engine.get_vllm_config()
    model_config = await engine.get_model_config()
    assert engine.model_config == model_config == vllm_config.model_config
    assert model_config.max_model_len == engine.config.max_model_len == 256
    assert model_config.dtype == engine.ready.dtype != "auto"  # as loaded
    assert model_config.served_model_name == engine.model_name
    assert vllm_config.cache_config.num_gpu_blocks == 64
    assert (await engine.get_decoding_config()).backend == "guidance"
    assert engine.vllm_config.engine_config is engine.config
    assert engine.decoding_config == await engine.get_decoding_config()
    await engine.do_log_stats(None, None)  # vLLM's older parameters, accepted
    with pytest.raises(TypeError, match="max_num_seqs"):
        async with open_engine(EngineArgs(model="toy"), max_num_seqs=4):
            pass


async def test_check_health_raises_a_runtime_error_carrying_the_cause(
    engine: AsyncEngine,
) -> None:
    await engine.check_health()
    cause = KeyError("injected")
    engine.inject_fault("scheduler", cause)
    with trio.fail_after(10):
        await engine.supervisor.dead.wait()
    # vLLM's AsyncLLM raises EngineDeadError; its multiprocess client a RuntimeError.
    with pytest.raises(RuntimeError) as info:
        await engine.check_health()
    assert isinstance(info.value, EngineDeadError) and info.value.__cause__ is cause


async def test_get_tokenizer_takes_a_lora_request(engine: AsyncEngine) -> None:
    base = await engine.get_tokenizer()
    adapter = LoRARequest("adapter", 1, "/nonexistent")
    assert await engine.get_tokenizer(adapter) is base
    assert await engine.get_tokenizer(lora_request=None) is base
    with pytest.raises(ValidationError, match="lora_request"):
        await engine.get_tokenizer("adapter")


async def test_shutdown_timeout_bounds_the_wait_for_a_stuck_worker(toy_model_dir: Any) -> None:
    # A worker that stops answering (SIGSTOP: it never reads its closed stdin) would
    # otherwise get the executor's full grace of 5 s before it is killed.
    with trio.CancelScope() as bound:
        async with open_engine(str(toy_model_dir), **ENGINE_ARGS) as engine:
            pid = engine.executor.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            bound.deadline = trio.current_time() + 3  # timeout + kill and reap, short of 5 s
            engine.shutdown(timeout=0.2)
    assert not bound.cancelled_caught, "shutdown(timeout=0.2) waited out the 5 s grace"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_generate_checks_vllms_extra_arguments(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0)
    # vLLM's ValueError for a priority under fcfs scheduling; 0 is fine.
    with pytest.raises(ValidationError, match="priority scheduling is not enabled") as info:
        engine.generate("hi", params, "p", priority=1)
    assert info.value.field == "priority"
    # A multimodal prompt is refused, not silently run as text.
    image = {"prompt": "<image> what is this?", "multi_modal_data": {"image": b"png"}}
    with pytest.raises(ValidationError, match="multimodal") as info:
        engine.generate(image, params, "mm")
    assert info.value.field == "prompt.multi_modal_data"
    with pytest.raises(ValidationError, match="reasoning_ended"):
        engine.generate("hi", params, "r", reasoning_ended="yes")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="prompt_adapter_request"):
        engine.generate("hi", params, "pa", prompt_adapter_request=object())  # type: ignore[arg-type]
    # vLLM's AsyncLLM order, by position: lora_request, trace_headers,
    # prompt_adapter_request, priority.
    async with engine.generate("hi", params, "v0", None, {"traceparent": "x"}, None, 0) as v0:
        assert [out async for out in v0][-1].finished
    assert engine.log_stats is False and engine.log_requests is False  # disable_log_stats
    # reasoning_ended / reasoning_parser_kwargs are accepted (no engine-side parser).
    async with engine.generate(
        "hi", params, "ok", priority=0, reasoning_ended=True, reasoning_parser_kwargs={}
    ) as stream:
        outputs = [out async for out in stream]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2


async def test_priority_is_accepted_under_priority_scheduling(toy_model_dir: Any) -> None:
    args = dict(ENGINE_ARGS, scheduling_policy="priority")
    async with open_engine(str(toy_model_dir), executor="inproc", **args) as engine:
        params = SamplingParams(max_tokens=1)
        async with engine.generate("hi", params, "p", priority=3) as stream:
            assert [out async for out in stream][-1].finished


async def test_from_engine_args_is_an_async_context_manager(toy_model_dir: Any) -> None:
    args = EngineArgs(
        model=str(toy_model_dir), max_model_len=128, legato_options={"executor": "inproc"}
    )
    async with AsyncEngine.from_engine_args(args) as engine:
        assert engine.model_config.max_model_len == 128
        async with engine.generate("hi", SamplingParams(max_tokens=1), "r") as stream:
            assert [out async for out in stream][-1].finished
    assert engine.is_stopped


async def test_collective_rpc_raises_vllms_error_types(engine: AsyncEngine) -> None:
    assert await engine.collective_rpc("held_requests") == [[]]
    with pytest.raises(RuntimeError, match="unknown worker method '_private'"):
        await engine.collective_rpc("_private")
    with pytest.raises(TimeoutError, match="held_requests"):
        await engine.collective_rpc("held_requests", timeout=0)
    await engine.check_health()  # neither failure hurts the engine
