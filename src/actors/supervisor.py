"""The supervisor: runs the actors and turns the first failure into the engine's death.

Each actor runs under ``Supervisor.run_actor`` in the engine's nursery. Its
contract:

- The first actor that raises (or exits while the engine is not stopping)
  becomes the cause: ``dead_error`` is set to an ``EngineDeadError`` whose
  ``__cause__`` is that exception, the death callbacks run (they fail every open
  stream), and every actor is cancelled. Later failures are ignored.
- An actor's exception never propagates into the nursery, so the embedding
  app's own tasks are never cancelled by the engine's death.
- ``inject(name, error)`` makes an actor fail with ``error`` at its next
  checkpoint: the chaos hook (``legato.testing.chaos``), a real code path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..protocol.errors import EngineDeadError, LegatoError

logger = logging.getLogger("legato.engine")


class ActorExitedError(LegatoError):
    """An actor returned while the engine was still meant to be running."""


class InjectedFault(LegatoError):
    """A fault injected on purpose by a chaos test."""


class Supervisor:
    """Owns the engine's liveness. All methods are synchronous except run_actor."""

    def __init__(self) -> None:
        self.dead_error: EngineDeadError | None = None
        self.dead = trio.Event()
        self.stopping = False
        self._scopes: dict[str, trio.CancelScope] = {}
        self._injected: dict[str, BaseException] = {}
        self._on_death: list[Callable[[EngineDeadError], None]] = []

    @property
    def actor_names(self) -> list[str]:
        return list(self._scopes)

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(dead_error)`` once, synchronously, when the engine dies."""
        self._on_death.append(callback)

    def die(self, cause: BaseException) -> None:
        """Record ``cause`` as the engine's death (first call wins) and stop every actor.

        An injected fault already delivered wins over ``cause``: its actor failed
        first and is still unwinding (the executor reaping its worker, say), so
        ``cause`` is a consequence of it.
        """
        if self.dead_error is not None:
            return
        if self._injected and not any(cause is e for e in self._injected.values()):
            logger.debug("%r follows an injected fault; the injected fault is the cause", cause)
            cause = next(iter(self._injected.values()))
        error = EngineDeadError(f"the engine is dead: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        self.dead_error = error
        logger.error("engine died: %s: %s", type(cause).__name__, cause)
        for callback in self._on_death:
            try:
                callback(error)
            except Exception:  # a failing callback must not stop the others
                logger.exception("death callback failed")
        self.cancel_all()
        self.dead.set()

    def cancel_all(self) -> None:
        """Cancel every actor (used by death and by a graceful stop)."""
        for scope in self._scopes.values():
            scope.cancel()

    def inject(self, actor: str, error: BaseException | None = None) -> None:
        """Make ``actor`` fail with ``error`` at its next checkpoint."""
        if actor not in self._scopes:
            raise ValueError(f"actor: unknown actor {actor!r}; running: {', '.join(self._scopes)}")
        self._injected[actor] = error or InjectedFault(f"injected fault in the {actor} actor")
        self._scopes[actor].cancel()

    async def run_actor(
        self,
        name: str,
        actor: Callable[..., Awaitable[Any]],
        *args: Any,
        task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
        uses_task_status: bool = False,
    ) -> None:
        """Run ``actor(*args)`` supervised (see the module docstring).

        With ``uses_task_status`` the actor is started with ``nursery.start``
        and gets the task status; an error before it calls ``started`` is
        raised to the starter (a start-up failure), not turned into death.
        """
        scope = trio.CancelScope()
        if self.stopping or self.dead.is_set():
            # The engine stopped (or died) before this actor's task first ran: cancel_all
            # could not reach it, so it must not start waiting (open-then-close hung here).
            scope.cancel()
        self._scopes[name] = scope
        started = not uses_task_status

        class _Status:
            def started(self, value: Any = None) -> None:
                nonlocal started
                started = True
                task_status.started(value)

        try:
            with scope:
                if uses_task_status:
                    await actor(*args, task_status=_Status())
                else:
                    await actor(*args)
            if scope.cancelled_caught:
                injected = self._injected.pop(name, None)
                if injected is not None:
                    self.die(injected)
            elif not self.stopping:
                self.die(ActorExitedError(f"the {name} actor exited unexpectedly"))
        except Exception as exc:
            if not started:
                raise
            if self.stopping:
                logger.debug("the %s actor failed while the engine stopped: %r", name, exc)
                return
            self.die(exc)
        finally:
            self._scopes.pop(name, None)
