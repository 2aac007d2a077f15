"""Supervised restart: an engine that is replaced by a fresh one when it dies, within a limit.

``open_supervised_engine(model, max_restarts=3, window=300.0, **engine_args)``
is an async context manager. It opens an engine (``open_engine``), yields a
``SupervisedEngine`` whose ``.engine`` is always the current engine, and runs
the restart loop as a task of its own nursery: when the current engine dies
(an actor fails, its worker process exits, a heartbeat times out) its streams
end with ``EngineDeadError`` as always, the dead engine is shut down and
reaped, and a new one is opened with the same arguments. Callers pick up the
new engine from ``.engine`` (or ``await wait_running()``). The LoRA adapters
the dead engine had loaded (and not removed) are loaded into the new one
before it is installed, under the same names and ids; one that can no longer
be loaded (its files are gone) is left out with a warning.

More than ``max_restarts`` deaths within any ``window`` seconds end it: the
loop raises ``RestartLimitExceeded`` (``__cause__``: the last death), which
cancels the ``async with`` body and comes out of the ``async with``. Nothing
outlives the block: leaving it stops the loop and shuts the current engine
down, as leaving ``open_engine`` does.

Imports trio; never torch.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from .engine import AsyncEngine, open_engine
from .exception_groups import unwrap_single_error
from .protocol.errors import LegatoError, ValidationError

logger = logging.getLogger("legato.supervise")

EngineOpener = Callable[..., AbstractAsyncContextManager[AsyncEngine]]
"""``open_engine``'s signature: ``opener(model, **engine_args)`` yields a running engine."""


class RestartLimitExceeded(LegatoError):
    """The engine died more than ``max_restarts`` times within ``window`` seconds.

    ``__cause__`` is the last death (an ``EngineDeadError`` whose own cause is
    the failure, or the error a restarted engine failed to start with).
    """

    def __init__(self, message: str, *, deaths: int) -> None:
        super().__init__(message)
        self.deaths = deaths


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts within any ``window`` seconds (0: never restart)."""

    max_restarts: int = 3
    window: float = 300.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_restarts, bool)
            or not isinstance(self.max_restarts, int)
            or self.max_restarts < 0
        ):
            raise ValueError(f"max_restarts: must be an integer >= 0, got {self.max_restarts!r}")
        if not self.window > 0:
            raise ValueError(f"window: must be > 0 seconds, got {self.window!r}")


class SupervisedEngine:
    """The handle ``open_supervised_engine`` yields: the current engine, and restart counts.

    ``engine`` is the engine to use now. Between a death and the end of the
    restart it is the dead engine (every call raises ``EngineDeadError``) and
    ``restarting`` is True. Do not keep an engine across awaits if you want
    the live one: read ``engine`` again, or ``await wait_running()``.
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.restarts = 0
        """Engines started after the first one."""
        self.last_death: BaseException | None = None
        """Why the last engine died (its ``EngineDeadError``) or failed to start."""
        self._engine: AsyncEngine | None = None
        self._installed = trio.Event()  # set (and replaced) each time an engine is installed
        self._deaths: collections.deque[float] = collections.deque()
        self._gave_up = False

    @property
    def engine(self) -> AsyncEngine:
        """The current engine: running, or dead while a restart is under way."""
        assert self._engine is not None, "read before the first engine started"
        return self._engine

    @property
    def restarting(self) -> bool:
        """Whether the current engine is dead and a new one is on its way (limit not passed)."""
        return self._engine is not None and self._engine.errored and not self._gave_up

    async def wait_running(self) -> AsyncEngine:
        """Return the current engine once it is running: at once, or after the restart.

        A checkpoint. Never returns after the limit is passed: the ``async with``
        body is cancelled then.
        """
        while True:
            engine = self.engine
            if engine.is_running:
                await trio.lowlevel.checkpoint()
                return engine
            await self._installed.wait()

    def _install(self, engine: AsyncEngine) -> None:
        self._engine = engine
        installed, self._installed = self._installed, trio.Event()
        installed.set()

    def _count_death(self, cause: BaseException) -> None:
        """Record a death; raise ``RestartLimitExceeded`` if it passes the limit."""
        now = trio.current_time()
        self.last_death = cause
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - self.policy.window:
            self._deaths.popleft()
        if len(self._deaths) > self.policy.max_restarts:
            self._gave_up = True
            message = (
                f"the engine died {len(self._deaths)} times within {self.policy.window:g} s "
                f"(at most {self.policy.max_restarts} restart(s) allowed); last cause: {cause}"
            )
            logger.error("giving up: %s", message)
            raise RestartLimitExceeded(message, deaths=len(self._deaths)) from cause
        logger.warning(
            "%s; restarting it (%d of at most %d restart(s) within %g s)",
            cause,
            len(self._deaths),
            self.policy.max_restarts,
            self.policy.window,
        )

    async def _run(
        self,
        opener: EngineOpener,
        model: str | None,
        engine_args: dict[str, Any],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The restart loop. Reports started once the first engine runs; its start-up
        errors go to the starter. Raises ``RestartLimitExceeded``; otherwise runs
        until cancelled."""
        first = True
        while True:
            started = trio.current_time()
            try:
                async with opener(model, **engine_args) as engine:
                    if self._engine is not None:
                        await _reload_adapters(self._engine, engine)
                    self._install(engine)
                    if first:
                        first = False
                        task_status.started()
                    else:
                        logger.info(
                            "engine restarted in %.1f s (restart %d)",
                            trio.current_time() - started,
                            self.restarts,
                        )
                    await engine.supervisor.dead.wait()
                    cause: BaseException = engine.dead_error
            except Exception as exc:
                if first:
                    raise  # the first start-up failed: the caller's error, not a death
                cause = exc  # a restarted engine failed to start: counts as a death
                logger.error(
                    "the restarted engine failed to start: %s: %s", type(exc).__name__, exc
                )
            self._count_death(cause)
            self.restarts += 1


async def _reload_adapters(dead: AsyncEngine, engine: AsyncEngine) -> None:
    """Load into ``engine`` every adapter ``dead`` had loaded (``--lora-modules``, and
    ``add_lora`` / ``/v1/load_lora_adapter`` since), in id order; skip (and log) one
    that fails. Pins are not carried over. A checkpoint per adapter."""
    for lora in dead.adapters.loaded():
        try:
            await engine.add_lora(lora)
        except ValidationError as exc:
            logger.warning(
                "LoRA adapter %r (id %d) not reloaded after the restart: %s",
                lora.lora_name,
                lora.lora_int_id,
                exc,
            )


@asynccontextmanager
async def open_supervised_engine(
    model: str | None = None,
    *,
    max_restarts: int = 3,
    window: float = 300.0,
    opener: EngineOpener = open_engine,
    **engine_args: Any,
) -> AsyncIterator[SupervisedEngine]:
    """Open an engine that is restarted when it dies, at most ``max_restarts`` times per ``window`` s.

    ``engine_args`` are ``open_engine``'s. Yields once the first engine runs
    (its start-up errors raise here, unwrapped). Past the limit the body is
    cancelled and ``RestartLimitExceeded`` comes out of the ``async with``.
    Leaving the block stops the restart loop and shuts the current engine
    down. ``opener`` replaces ``open_engine`` (to wrap start-up, or in tests).
    """
    handle = SupervisedEngine(RestartPolicy(max_restarts, window))
    with unwrap_single_error():
        async with trio.open_nursery() as nursery:
            await nursery.start(handle._run, opener, model, engine_args)
            try:
                yield handle
            finally:
                nursery.cancel_scope.cancel()


__all__ = [
    "RestartLimitExceeded",
    "RestartPolicy",
    "SupervisedEngine",
    "open_supervised_engine",
]
