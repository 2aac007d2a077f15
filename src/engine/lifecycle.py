"""``EngineLifecycle``: whether the engine lives, and how it stops.

Liveness (``is_running``, ``errored``, ``dead_error``, ``check_health`` and the
``_check_alive`` every call makes) and ``shutdown``. A mixin of ``AsyncEngine``,
which sets the attributes declared here.

Never imports models, the worker side or torch.
"""

from __future__ import annotations

import trio

from ..actors.executor import Executor
from ..actors.frontend import Frontend
from ..actors.supervisor import Supervisor
from ..protocol.errors import EngineDeadError, MQClientClosedError


class EngineLifecycle:
    """Mixin: liveness and shutdown over the engine's supervisor and executor."""

    supervisor: Supervisor
    executor: Executor
    _stopped: bool

    def _check_alive(self) -> None:
        """Raise the engine's EngineDeadError if it died or was shut down."""
        if self.supervisor.dead_error is not None:
            raise self.supervisor.dead_error
        if self._stopped:
            raise MQClientClosedError()

    @property
    def is_running(self) -> bool:
        return not self._stopped and self.supervisor.dead_error is None

    @property
    def is_stopped(self) -> bool:
        return self._stopped or self.supervisor.dead_error is not None

    @property
    def errored(self) -> bool:
        return self.supervisor.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError:
        if self.supervisor.dead_error is not None:
            return self.supervisor.dead_error
        return EngineDeadError("the engine is not dead (dead_error read while running)")

    async def setup(self) -> None:
        """vLLM's multiprocess client's two-phase start: here ``open_engine`` has started
        the engine already, so this only checks it is alive. A checkpoint."""
        await trio.lowlevel.checkpoint()
        self._check_alive()

    def close(self) -> None:
        """vLLM's multiprocess client's name for ``shutdown()``."""
        self.shutdown()

    async def check_health(self) -> None:
        """Raise the engine's EngineDeadError if it is dead; return otherwise. A checkpoint."""
        await trio.lowlevel.checkpoint()
        self._check_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine: open streams end with EngineDeadError, the worker is reaped.

        Synchronous and idempotent; the actors finish within the nursery's exit.
        The worker gets ``timeout`` seconds to exit by itself before it is
        killed (vLLM's parameter), shorter or longer than the executor's default
        grace of ``SHUTDOWN_GRACE`` (5 s; None: that grace). The executor's one
        reaping path applies it (``begin_shutdown(grace)``). With the in-process
        executor there is no process to kill, so ``timeout`` bounds nothing there.
        Only the first call's ``timeout`` counts. Later calls raise
        ``MQClientClosedError`` (an EngineDeadError), as vLLM's multiprocess client
        once closed.
        """
        if self._stopped:
            return
        self._stopped = True
        self.supervisor.stopping = True
        frontend: Frontend | None = getattr(self, "frontend", None)  # None: never started
        if frontend is not None:
            frontend.fail_all(MQClientClosedError())
        self.executor.begin_shutdown(timeout)
        self.supervisor.cancel_all()
