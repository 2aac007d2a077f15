"""The in-process executor owns its frames: once its loop ends, no caller waits forever."""

from __future__ import annotations

import pytest
import trio

from legato.actors.executor import WorkerDiedError
from legato.actors.inproc_executor import InprocExecutor
from legato.config import EngineConfig
from legato.protocol import messages as m

CONFIG = EngineConfig(runner="null", num_kv_blocks=64, max_model_len=128)


async def test_a_frame_sent_after_the_loop_ended_fails_instead_of_hanging() -> None:
    executor = InprocExecutor(CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(executor.run)
        answer = await executor._request(m.HealthPing(1, 0.0))
        assert isinstance(answer, m.HealthPong) and answer.seq == 1
        nursery.cancel_scope.cancel()
    with trio.fail_after(5):  # before: queued on an unbounded channel nobody reads
        with pytest.raises(WorkerDiedError, match="stopped"):
            await executor._request(m.HealthPing(2, 0.0))
