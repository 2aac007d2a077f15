"""``EngineThread``: the trio engine in a daemon thread of its own.

One ``trio.run`` per engine: it opens the engine (``open_engine``), keeps a
nursery for work that other threads start in it, and runs until it is asked
to stop; then the engine shuts down and its worker is reaped. Both ways of
driving the trio engine from outside trio use it: ``legato.LLM`` (a
synchronous caller, through ``trio.from_thread`` with ``token``) and
``legato.aio`` (an asyncio event loop, which adds its own way back).

Other threads reach it through ``call_soon`` (never blocks) and ``spawn`` (a
task of the engine thread, cancellable through a ``Crossing``).
``request_stop`` works from any thread, also while the engine is starting.
The thread holds no reference to its users, so an ``LLM`` dropped without
``shutdown()`` is collected and its finalizer stops the thread.

Never imports asyncio or torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..protocol.errors import EngineDeadError
from .async_engine import AsyncEngine, open_engine

logger = logging.getLogger("legato.engine")

SHUT_DOWN = "the engine has been shut down"


class Crossing:
    """One piece of work another thread started in the engine thread (a task).
    ``cancel`` (engine thread) cancels it, also before it has started."""

    __slots__ = ("cancel_requested", "scope")

    def __init__(self) -> None:
        self.cancel_requested = False
        self.scope: trio.CancelScope | None = None

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()


class EngineThread:
    """An engine for ``model`` and ``engine_args`` (``open_engine``'s), run in a thread.

    ``start()`` starts the thread; ``wait_ready()`` blocks until the engine is
    up and raises its start-up error. Subclasses may override the hooks, which
    run in the engine thread: ``on_started(engine)``, ``on_start_failed(error)``,
    ``on_ended()`` (the last thing the thread does) and ``watch()`` (a task
    beside the engine while it runs).
    """

    def __init__(
        self, model: str | None, engine_args: dict[str, Any], *, name: str = "legato-engine"
    ) -> None:
        self._model = model
        self._engine_args = engine_args
        self.engine: AsyncEngine | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop_requested = False
        self._stop: trio.Event | None = None
        self.ready = threading.Event()  # set once started, or once start-up failed
        self.startup_error: BaseException | None = None
        self.done = threading.Event()  # set when trio.run has returned
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---------------------------------------------------------------- hooks

    def on_started(self, engine: AsyncEngine) -> None:
        """The engine is up (engine thread)."""

    def on_start_failed(self, error: BaseException) -> None:
        """The engine failed to start with ``error`` (engine thread)."""

    def on_ended(self) -> None:
        """The trio run has ended (engine thread, its last act)."""

    async def watch(self) -> None:
        """A task beside the running engine; cancelled when it stops."""

    # --------------------------------------------------------- other threads

    def start(self) -> None:
        """Start the thread; returns at once."""
        self.thread.start()

    def wait_ready(self) -> AsyncEngine:
        """Block until the engine is up; raise its start-up error if it failed."""
        self.ready.wait()
        if self.startup_error is not None:
            raise self.startup_error
        assert self.engine is not None
        return self.engine

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in the engine thread. Never blocks; any thread. Raises
        EngineDeadError once the thread's run has ended."""
        if self.token is None:
            raise EngineDeadError(SHUT_DOWN)
        try:
            self.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise EngineDeadError(SHUT_DOWN) from None

    def spawn(self, crossing: Crossing, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Start ``fn(*args)`` as a task of the engine thread, cancellable through ``crossing``."""
        self.call_soon(self._spawn, crossing, fn, args)

    def request_stop(self) -> None:
        """Shut the engine down and end the thread. Idempotent; any thread; never blocks."""
        self._stop_requested = True  # seen by _main if the engine is still starting
        if threading.current_thread() is self.thread:
            self._stop_now()
        else:
            with contextlib.suppress(EngineDeadError):
                self.call_soon(self._stop_now)

    def stop(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109 - a thread join
        """``request_stop``, then join the thread (at most ``timeout`` s; not from the
        engine thread itself). Idempotent."""
        self.request_stop()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    # ---------------------------------------------------------- the thread

    def _spawn(
        self, crossing: Crossing, fn: Callable[..., Awaitable[object]], args: tuple[Any, ...]
    ) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._in_scope, crossing, fn, args)

    async def _in_scope(
        self, crossing: Crossing, fn: Callable[..., Awaitable[object]], args: tuple[Any, ...]
    ) -> None:
        with trio.CancelScope() as crossing.scope:
            if crossing.cancel_requested:
                crossing.scope.cancel()
            await fn(*args)

    def _stop_now(self) -> None:
        self._stop_requested = True
        if self.engine is not None:
            self.engine.shutdown()
        if self._stop is not None:
            self._stop.set()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self.ready.is_set():  # after start-up: nobody waits for it any more
                logger.exception("the engine thread failed while shutting down")
            else:  # start-up failed: wait_ready raises it
                self.startup_error = exc
                self.on_start_failed(exc)
        finally:
            self.done.set()
            self.ready.set()
            self.on_ended()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_engine(self._model, **self._engine_args) as engine:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.engine = engine
                if self._stop_requested:  # stopped while starting
                    engine.shutdown()
                    self._stop.set()
                self.ready.set()
                self.on_started(engine)
                nursery.start_soon(self.watch)
                await self._stop.wait()
                nursery.cancel_scope.cancel()
