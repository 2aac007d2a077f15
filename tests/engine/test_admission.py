"""Admission: the engine holds at most ``max_live_requests`` requests, and its core's inbox
is bounded behind that check (``AsyncEngine.check_admission``, ``EngineCore.has_room``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from legato import SamplingParams
from legato.actors.engine_core import CONTROL_ROOM
from legato.engine import AsyncEngine, RequestStream, open_engine
from legato.protocol.errors import EngineBusyError
from legato.scheduling.core_steps import AddRequests

BOUND = 8
ENGINE_ARGS: dict[str, Any] = dict(
    max_model_len=128, num_kv_blocks=64, disable_log_stats=True, max_live_requests=BOUND
)


@pytest.fixture
async def engine(toy_model_dir: Any) -> AsyncIterator[AsyncEngine]:
    async with open_engine(str(toy_model_dir), executor="inproc", **ENGINE_ARGS) as eng:
        yield eng


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def test_a_flood_of_submissions_never_grows_the_inbox_past_its_bound(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    """With the engine core stuck on a step (the gate holds it), nothing drains its inbox:
    a flood of 50 submissions fills it with at most BOUND requests, and every one past the
    bound is refused with EngineBusyError, holding nothing."""
    gate = gate_steps(engine)
    inbox = engine.core._inbox_send
    assert inbox.statistics().max_buffer_size == BOUND + CONTROL_ROOM  # bounded, not inf
    queued: list[int] = []  # the inbox's fill after each request the front end queued
    to_core = engine.frontend.core._to_core

    def watching(message: Any) -> None:
        to_core(message)
        if isinstance(message, AddRequests):
            queued.append(inbox.statistics().current_buffer_used)

    engine.frontend.core._to_core = watching
    async with AsyncExitStack() as streams:
        first = await streams.enter_async_context(engine.generate("first", greedy(50), "r0"))
        gate.close()
        with trio.fail_after(10):
            await gate.wait_held()  # the core now waits on this step's answer
        admitted: list[RequestStream] = [first]
        refused: list[str] = []

        async def submit(i: int) -> None:
            stream = engine.generate(f"prompt {i}", greedy(50), f"r{i}")
            try:
                admitted.append(await streams.enter_async_context(stream))
            except EngineBusyError:
                refused.append(stream.request_id)

        async with trio.open_nursery() as nursery:
            for i in range(1, 51):
                nursery.start_soon(submit, i)
        assert len(admitted) == BOUND and len(refused) == 50 - (BOUND - 1)
        assert engine.frontend.num_live == BOUND  # a refused request holds nothing
        assert max(queued) <= BOUND and inbox.statistics().current_buffer_used <= BOUND
        with pytest.raises(EngineBusyError, match="max_live_requests=8"):
            engine.check_admission()
        gate.open()
        for stream in admitted[1:]:
            await stream.aclose()
        with trio.fail_after(10):
            await engine.core.ping()  # the loop has handled everything queued before it
        engine.check_admission()  # room again: the engine keeps serving
        async with engine.generate("after", greedy(3), refused[0]) as again:
            outputs = [out async for out in again]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) <= 3


async def test_aborts_queued_beside_requests_never_refuse_one(
    engine: AsyncEngine, gate_steps: Any
) -> None:
    """With the core stuck, BOUND - 1 requests are queued and then aborted: the inbox
    holds their adds and their aborts (more messages than BOUND), yet only one request
    is live, so one more is admitted (the bound counts requests, not messages)."""
    gate = gate_steps(engine)
    async with engine.generate("first", greedy(50), "r0") as first:
        gate.close()
        with trio.fail_after(10):
            await gate.wait_held()
        for i in range(1, BOUND):
            async with engine.generate(f"prompt {i}", greedy(50), f"r{i}"):
                pass  # leaving the block aborts it: an abort queued behind its add
        inbox = engine.core._inbox_send.statistics()
        assert inbox.current_buffer_used >= BOUND  # adds and aborts, all still queued
        assert engine.frontend.num_live == 1
        engine.check_admission()  # was: EngineBusyError, counting the aborts
        async with engine.generate("one more", greedy(3), "late") as late:
            gate.open()
            outputs = [out async for out in late]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
        await first.aclose()
    with trio.fail_after(10):
        await engine.core.wait_idle()
