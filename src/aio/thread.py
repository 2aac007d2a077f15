"""The trio engine's thread for asyncio: ``EngineThread`` with the way back to the event
loop (one outbox drained by one ``call_soon_threadsafe`` per batch), and the future
helpers the posted callbacks use. Never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import (
    Callable,
)
from typing import Any, TypeVar

import trio

from ..engine import AsyncEngine
from ..engine.thread import EngineThread
from ..protocol.outputs import PoolingRequestOutput, RequestOutput

logger = logging.getLogger("legato.aio")

T = TypeVar("T")
OutputT = TypeVar("OutputT", bound=RequestOutput | PoolingRequestOutput)

# How often an idle engine thread checks that its host event loop still exists.
_HOST_LOOP_CHECK_SECONDS = 1.0
# At interpreter exit, how long each engine still open may take to shut down.
_EXIT_JOIN_SECONDS = 30.0


class _EngineThread(EngineThread):
    """The trio engine's thread (``legato.engine.thread``), with the way back to the loop.

    Event loop -> engine: ``call_soon`` / ``spawn`` (``TrioToken.run_sync_soon``:
    never blocks, any thread). Engine -> event loop: ``post`` queues a callback in
    the outbox and, if no drain is pending, schedules one drain on the loop; the
    loop runs every queued callback in order. A closed loop makes the engine shut
    down.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, model: str | None, engine_args: dict[str, Any]
    ) -> None:
        super().__init__(model, engine_args)
        self.loop = loop
        self._outbox: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._drain_pending = False
        self.started: asyncio.Future[AsyncEngine] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()

    # ------------------------------------------------------- engine -> loop

    def post(self, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` on the event loop, after everything posted before. Never blocks."""
        self._outbox.append((callback, args))
        if not self._drain_pending:
            self._drain_pending = True
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read anything
                self._outbox.clear()
                if not self.done.is_set():
                    self.request_stop()

    def _drain(self) -> None:
        self._drain_pending = False  # before draining: a later post schedules another drain
        outbox = self._outbox
        while outbox:
            callback, args = outbox.popleft()
            callback(*args)

    # --------------------------------------------------------------- hooks

    def on_started(self, engine: AsyncEngine) -> None:
        self.post(_set_result, self.started, engine)

    def on_start_failed(self, error: BaseException) -> None:
        self.post(_set_exception, self.started, error)  # open_engine raises it

    def on_ended(self) -> None:
        self.post(_set_result, self.finished, None)

    async def watch(self) -> None:
        """Shut down once the event loop is closed (an app that never left ``open_engine``)."""
        # asyncio has no hook for a loop's closing: polled (cheap, and only while idle
        # matters: a closed loop with output pending is noticed by ``post`` at once).
        while not self.loop.is_closed():  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(_HOST_LOOP_CHECK_SECONDS)
        self.request_stop()


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
