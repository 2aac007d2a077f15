"""The heartbeat actor: liveness of the scheduler loop and the worker process.

Every ``interval`` seconds it pings each probe in turn; a probe that does not
answer within ``timeout`` seconds raises ``HeartbeatTimeout``, which the
supervisor turns into engine death. A worker that exits is seen sooner by the
executor itself; the heartbeat is what catches a hang (a stopped process, a
stuck step).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from ..protocol.errors import LegatoError

Probe = tuple[str, Callable[[], Awaitable[object]]]


class HeartbeatTimeout(LegatoError):
    """A part of the engine stopped answering health pings."""


async def run_heartbeat(probes: Sequence[Probe], *, interval: float, silence: float) -> None:
    """Ping forever; raise HeartbeatTimeout on the first probe silent for ``silence`` seconds."""
    while True:
        await trio.sleep(interval)
        for name, probe in probes:
            with trio.move_on_after(silence):
                await probe()
                continue
            raise HeartbeatTimeout(f"the {name} did not answer a health ping within {silence:g} s")
