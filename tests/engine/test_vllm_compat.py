"""AsyncEngine where vLLM's engines define the behaviour: errors, shutdown, getters, arguments."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
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
    with pytest.raises(RuntimeError, match="Worker failed with error .*unknown worker method '_private'"):
        await engine.collective_rpc("_private")
    with pytest.raises(TimeoutError, match="RPC call to held_requests timed out"):
        await engine.collective_rpc("held_requests", timeout=0)
    await engine.check_health()  # neither failure hurts the engine


async def test_calls_after_shutdown_raise_vllms_client_closed_error(toy_model_dir: Any) -> None:
    """vLLM's multiprocess client raises MQClientClosedError once closed; here it is an
    EngineDeadError too, so either ``except`` holds. ``abort`` stays silent."""
    from legato.protocol.errors import MQClientClosedError

    async with open_engine(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as engine:
        engine.shutdown()
        with pytest.raises(MQClientClosedError) as info:
            async with engine.generate("hi", SamplingParams(max_tokens=1), "late") as stream:
                await stream.__anext__()
        assert isinstance(info.value, EngineDeadError)
        with pytest.raises(MQClientClosedError):
            await engine.check_health()
        await engine.abort("late")


async def test_input_processor_add_request_and_vllms_other_members(engine: AsyncEngine) -> None:
    """``input_processor`` (and the older ``get_input_preprocessor``) builds an
    EngineCoreRequest that ``generate`` runs with its own params and id, as vLLM's;
    ``add_request`` submits at once; ``stat_loggers`` by name; ``is_unsupported_config``."""
    from legato.vllm_config import ParallelConfig

    assert await engine.get_input_preprocessor() is engine.input_processor
    assert engine.input_preprocessor is engine.input_processor
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request = engine.input_processor.process_inputs("from-core", "hello there", params)
    engine.input_processor.assign_request_id(request)
    async with engine.generate(request, SamplingParams(max_tokens=9), "ignored") as stream:
        outs = [out async for out in stream]
    assert outs[-1].request_id == "from-core"  # the request's own id...
    assert len(outs[-1].outputs[0].token_ids) == 3  # ...and its own sampling params
    assert outs[-1].prompt_token_ids == request.prompt_token_ids
    # vLLM's AsyncLLM.add_request: positional, submitted before the first read.
    stream = await engine.add_request("added", "hi", params, None, None, None, None, 0)
    assert "added" in engine.frontend.core.live
    assert [out async for out in stream][-1].finished
    with pytest.raises(TypeError, match="request_id"):
        await engine.add_request(3, "hi", params)  # type: ignore[arg-type]
    loggers = engine.stat_loggers
    assert loggers["prometheus"] is engine.stats.prometheus and "logging" not in loggers
    vllm_config = engine.vllm_config
    assert not AsyncEngine.is_unsupported_config(vllm_config)
    pp2 = dataclasses.replace(
        vllm_config,
        parallel_config=ParallelConfig(1, 1, 0, "127.0.0.1", 0, pipeline_parallel_size=2),
    )
    assert AsyncEngine.is_unsupported_config(pp2)


async def test_a_shutdown_timeout_past_the_default_grace_is_honoured() -> None:
    """``shutdown(timeout)`` gives the worker that long to exit by itself, also past the
    executor's default 5 s: ``begin_shutdown`` keeps the longer grace (it was capped at
    5 s), and the one reaping path waits it out, so a process that exits on its own
    after 5.5 s is reaped with its own exit status, not killed."""
    from legato.actors.executor import SHUTDOWN_GRACE
    from legato.actors.process_executor import ProcessExecutor, reap_process
    from legato.config import EngineConfig

    executor = ProcessExecutor(EngineConfig(runner="null"))
    executor.begin_shutdown(SHUTDOWN_GRACE + 3)
    grace = executor._grace
    assert grace == SHUTDOWN_GRACE + 3
    code = "import time; time.sleep(5.5)"
    process = await trio.lowlevel.open_process([sys.executable, "-c", code], start_new_session=True)
    await reap_process(process, grace=grace)
    assert process.returncode == 0


async def test_vllms_remaining_names_on_the_async_engine(engine: AsyncEngine) -> None:
    """The early AsyncLLM's ``processor``; the multiprocess client's ``setup`` / ``close``;
    the ``AsyncLLMEngine`` / ``AsyncLLM`` names; ``encode`` refusing a pooling task the
    engine does not list in ``get_supported_tasks``, with a ValueError, as vLLM's."""
    import legato
    from legato import PoolingParams

    assert engine.processor is engine.input_processor
    assert legato.AsyncLLMEngine is legato.AsyncLLM is AsyncEngine
    await engine.setup()  # started already: returns
    tasks = await engine.get_supported_tasks()
    assert "classify" not in tasks and "embed" in tasks
    with pytest.raises(ValueError) as info:
        async for _ in engine.encode("hi", PoolingParams(task="classify"), "c"):
            pass
    assert isinstance(info.value, ValidationError) and info.value.field == "task"
    engine.close()  # vLLM's name for shutdown()
    assert engine.is_stopped
    with pytest.raises(EngineDeadError):
        await engine.setup()


async def test_a_streaming_input_session_as_vllms(engine: AsyncEngine) -> None:
    """``generate`` takes an async generator of StreamingInput chunks (vLLM's sessions):
    each chunk runs as a request whose prompt is the session so far (chunks and the
    tokens generated for them, each request's last sampled token left out), every
    generated token reaches the one stream, and it finishes when the input ends."""
    from legato import RequestOutputKind
    from legato.protocol.client import StreamingInput

    tokenizer = engine.tokenizer
    first = tokenizer.encode("The cat")
    second = tokenizer.encode(" and the dog", add_special_tokens=False)
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    arrived = trio.Event()

    async def chunks() -> Any:
        yield StreamingInput({"prompt_token_ids": first})
        await arrived.wait()  # the second chunk comes once the first has answered
        yield StreamingInput(" and the dog", SamplingParams(max_tokens=2, temperature=0.0,
                                                            ignore_eos=True))  # fmt: skip

    async def plain(ids: list[int], n: int) -> list[int]:
        greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        async with engine.generate({"prompt_token_ids": ids}, greedy, f"ref{n}") as stream:
            return list([out async for out in stream][-1].outputs[0].token_ids)

    got: list[int] = []
    finished: list[bool] = []
    async with engine.generate(chunks(), params, "session") as session:
        async for out in session:
            got += out.outputs[0].token_ids
            finished.append(out.finished)
            if len(got) == 3:
                arrived.set()
    one = await plain(first, 3)
    two = await plain(first + one[:-1] + second, 2)
    assert got == one + two
    assert finished[-1] and not any(finished[:-1])
    with pytest.raises(ValidationError, match="n"):
        engine.generate(chunks(), SamplingParams(n=2), "pair")
