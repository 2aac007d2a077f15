"""Control methods of the engine: sleep/wake, caches, rpc, profiling, metrics."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from legato import RequestOutput, SamplingParams
from legato.config import EngineConfig
from legato.engine import AsyncEngine, open_engine
from legato.metrics.logger_base import StatLoggerBase
from legato.metrics.records import StepStats


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def final(
    engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str
) -> RequestOutput:
    last = None
    async with engine.generate(prompt, params, rid) as stream:
        async for out in stream:
            last = out
    assert last is not None
    return last


@pytest.fixture
async def engine(toy_model_dir: Any, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    async with open_engine(
        str(toy_model_dir), max_model_len=256, num_kv_blocks=64, profile_dir=str(tmp_path / "prof")
    ) as eng:
        yield eng


async def test_sleep_and_wake_up_keep_outputs_identical(engine: AsyncEngine) -> None:
    before = await final(engine, "sleepy", greedy(12), "a")
    for level in (1, 2):
        await engine.sleep(level)
        assert await engine.is_sleeping()
        done = trio.Event()

        async def waiting_request(rid: str, done: trio.Event) -> None:
            out = await final(engine, "sleepy", greedy(12), rid)
            assert out.outputs[0].token_ids == before.outputs[0].token_ids
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiting_request, f"during-{level}", done)
            await trio.testing.wait_all_tasks_blocked()
            assert not done.is_set()  # new requests wait while asleep
            await engine.wake_up()
        assert done.is_set() and not await engine.is_sleeping()


async def test_reset_prefix_cache(engine: AsyncEngine) -> None:
    await final(engine, "shared prefix " * 4, greedy(4), "p1")
    assert await engine.reset_prefix_cache() is True
    out = await final(engine, "shared prefix " * 4, greedy(4), "p2")
    assert out.num_cached_tokens == 0
    again = await final(engine, "shared prefix " * 4, greedy(4), "p3")
    assert again.num_cached_tokens and again.num_cached_tokens > 0


async def test_rpc_profile_tasks_lora_and_noop_caches(
    engine: AsyncEngine, tmp_path: Path, caplog: Any
) -> None:
    assert await engine.get_supported_tasks() == ("generate", "embed")
    tokenizer = await engine.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)) == (
        "hello world"
    )
    results = await engine.collective_rpc("held_requests")
    assert results == [[]]
    with pytest.raises(Exception, match="unknown worker method"):
        await engine.collective_rpc("_private")
    with pytest.raises(ValueError, match="lora_request: must be a LoRARequest"):
        await engine.add_lora(object())
    await engine.reset_mm_cache()
    await engine.reset_encoder_cache()
    await engine.start_profile()
    await final(engine, "profiled", greedy(4), "prof")
    with caplog.at_level(logging.INFO, logger="legato.engine"):
        await engine.stop_profile()
    traces = list((tmp_path / "prof").glob("*.json"))
    assert traces and traces[0].stat().st_size > 0
    assert str(traces[0]) in caplog.text


async def test_metrics_and_log_line(engine: AsyncEngine, caplog: Any) -> None:
    await final(engine, "count me", greedy(7), "m")
    await engine.wait_until_idle()
    text = engine.stats.exposition().decode()
    assert 'legato:request_success_total{finished_reason="length"' in text
    assert "legato:generation_tokens_total" in text
    assert "legato:time_to_first_token_seconds_bucket" in text
    with caplog.at_level(logging.INFO, logger="legato.stats"):
        await engine.do_log_stats()
    assert "Avg generation throughput" in caplog.text


class TokenSink(StatLoggerBase):
    """A custom stat logger that counts generated tokens (or raises, when ``fail``)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.generated = self.logs = self.initialized = 0

    def record(self, step: StepStats) -> None:
        if self.fail:
            raise RuntimeError("metrics sink unreachable")
        self.generated += step.num_generation_tokens

    def log(self) -> None:
        self.logs += 1

    def log_engine_initialized(self) -> None:
        self.initialized += 1


async def test_custom_stat_loggers_and_one_that_raises(
    toy_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``stat_loggers=`` takes vLLM-style factories; ``add_logger`` / ``remove_logger`` at run
    time; a logger that raises is logged and removed, and the engine keeps serving."""
    made: list[tuple[EngineConfig, int, TokenSink]] = []

    def factory(config: EngineConfig, engine_index: int) -> TokenSink:
        made.append((config, engine_index, TokenSink()))
        return made[-1][2]

    async with open_engine(
        str(toy_model_dir), executor="inproc", max_model_len=256, num_kv_blocks=64,
        stat_loggers=[factory],
    ) as engine:  # fmt: skip
        ((config, index, sink),) = made
        assert (config.max_model_len, index, sink.initialized) == (256, 0, 1)
        await final(engine, "count me", greedy(5), "a")
        assert sink.generated == 5
        await engine.do_log_stats()
        assert sink.logs == 1
        faulty = TokenSink(fail=True)
        engine.add_logger(faulty)
        with caplog.at_level(logging.ERROR, logger="legato.stats"):
            out = await final(engine, "still serving", greedy(3), "b")
        assert len(out.outputs[0].token_ids) == 3 and not engine.errored
        assert faulty not in engine.stats.loggers and sink in engine.stats.loggers
        assert "metrics sink unreachable" in caplog.text
        assert sink.generated == 8
        engine.remove_logger(sink)
        await final(engine, "unseen", greedy(2), "c")
        assert sink.generated == 8
        text = engine.stats.exposition().decode()
        assert f'legato:generation_tokens_total{{model_name="{toy_model_dir}"}} 10.0' in text


async def test_control_calls_from_a_cancelled_scope_leave_the_engine_serving(
    engine: AsyncEngine,
) -> None:
    calls = [
        lambda: engine.collective_rpc("held_requests"),
        lambda: engine.reset_prefix_cache(),
        lambda: engine.collective_rpc("reset_kv_cache"),
        lambda: engine.pause_generation(mode="keep"),
        lambda: engine.resume_generation(),
        lambda: engine.collective_rpc("held_requests"),
    ]
    for call in calls:
        with trio.CancelScope() as scope:
            scope.cancel()
            await call()
        assert scope.cancelled_caught
    with trio.fail_after(20):
        out = await final(engine, "still serving", greedy(4), "after")
        assert len(out.outputs[0].token_ids) == 4
        assert len(await engine.collective_rpc("held_requests")) == 1
    assert not engine.errored and not await engine.is_paused()


async def test_a_sleep_whose_caller_is_cancelled_still_completes(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    first_token = trio.Event()
    got: list[RequestOutput] = []

    async def long() -> None:
        async with engine.generate("in flight", greedy(20), "long") as stream:
            async for out in stream:
                got.append(out)
                first_token.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long)
            await first_token.wait()
            gate.close()  # the request cannot finish: sleep(mode="wait") waits for it
            async with trio.open_nursery() as sleeper:
                sleeper.start_soon(functools.partial(engine.sleep, mode="wait"))
                await gate.wait_held()
                await trio.testing.wait_all_tasks_blocked()
                sleeper.cancel_scope.cancel()
            gate.open()
        assert got[-1].outputs[0].finish_reason == "length"
        assert len(got[-1].outputs[0].token_ids) == 20
        await engine.wake_up()
        assert not await engine.is_sleeping()
        out = await final(engine, "awake again", greedy(4), "after")
    assert len(out.outputs[0].token_ids) == 4 and not engine.errored


async def test_reading_blocks_in_use_leaves_the_metrics_alone(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    gate = gate_steps(engine)
    gate.close()
    async with trio.open_nursery() as nursery:
        outputs: list[RequestOutput] = []

        async def one() -> None:
            outputs.append(await final(engine, "count my prompt tokens", greedy(3), "m"))

        nursery.start_soon(one)
        await gate.wait_held()  # the first step is planned: its prefix lookups are counted
        for _ in range(3):
            assert engine.num_kv_blocks_used > 0
        gate.open()
    prompt_tokens = len(outputs[0].prompt_token_ids or [])
    text = engine.stats.exposition().decode()
    queries = [line for line in text.splitlines() if line.startswith("legato:prefix_cache_queries")]
    assert queries and float(queries[0].split()[-1]) == prompt_tokens
