"""The executor on its own: a real worker process (null-model runner), answers routed by id."""

from __future__ import annotations

import random
import signal
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from legato.actors.executor import WorkerCallError, WorkerDiedError
from legato.actors.process_executor import ProcessExecutor
from legato.config import EngineConfig
from legato.exception_groups import unwrap_single_error
from legato.protocol import messages as m

CONFIG = EngineConfig(runner="null", num_kv_blocks=64, max_model_len=128)


@pytest.fixture
async def executor(nursery: trio.Nursery) -> AsyncIterator[ProcessExecutor]:
    executor = ProcessExecutor(CONFIG)
    await nursery.start(executor.run)
    yield executor
    executor.begin_shutdown()
    nursery.cancel_scope.cancel()


async def pong_seq(executor: ProcessExecutor, seq: int) -> int:
    answer = await executor._request(m.HealthPing(seq, 0.0))
    assert isinstance(answer, m.HealthPong)
    return answer.seq


async def test_answers_reach_their_callers_whatever_others_are_cancelled(
    executor: ProcessExecutor,
) -> None:
    rng = random.Random(0)
    got: dict[int, int] = {}

    async def caller(seq: int) -> None:
        with trio.CancelScope() as scope:
            how = rng.choice(["before", "after queueing", "never"])
            if how == "before":
                scope.cancel()
            elif how == "after queueing":
                scope.deadline = trio.current_time()  # cancelled at its first checkpoint
            got[seq] = await pong_seq(executor, seq)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for seq in range(200):
                nursery.start_soon(caller, seq)
        assert all(seq == answer for seq, answer in got.items())
        for seq in range(1000, 1020):  # every later caller gets its own answer
            assert await pong_seq(executor, seq) == seq


async def test_a_frame_cancelled_while_being_written_is_still_written_whole(
    executor: ProcessExecutor,
) -> None:
    huge = "x" * (8 << 20)  # far more than a pipe holds: the write takes many turns
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                await executor.call("held_requests", huge)

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert await pong_seq(executor, 7) == 7
        assert await executor.call("held_requests") == []
        with pytest.raises(WorkerCallError, match="TypeError"):
            await executor.call("held_requests", 1)


async def test_callers_waiting_when_the_worker_dies_get_its_error() -> None:
    executor = ProcessExecutor(CONFIG)
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await executor.call("held_requests")
        except WorkerDiedError as exc:
            errors.append(exc)

    with trio.fail_after(20):
        with pytest.raises(WorkerDiedError, match="exited with code -9"), unwrap_single_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(executor.run)
                executor.kill(signal.SIGSTOP)  # frozen: the calls wait
                for _ in range(3):
                    nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()
                executor.kill(signal.SIGKILL)
    assert len(errors) == 3
    assert all("exited with code -9" in str(e) for e in errors)
    with pytest.raises(WorkerDiedError):  # and a call after the death fails at once
        await executor.call("held_requests")
