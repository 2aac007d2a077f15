"""``EngineLifecycle``: whether the engine lives, and how it stops.

Liveness (``is_running``, ``errored``, ``dead_error``, ``check_health`` and the
``_check_alive`` every call makes), the executor actor that marks its worker
reaped, and ``shutdown``. A mixin of ``AsyncEngine``, which sets the
attributes declared here.

Never imports models, the worker side or torch.
"""

from __future__ import annotations

import trio

from ..actors.executor import Executor, WorkerCallError
from ..actors.frontend import Frontend
from ..actors.supervisor import Supervisor
from ..protocol import messages as m
from ..protocol.errors import EngineDeadError


class EngineLifecycle:
    """Mixin: liveness and shutdown over the engine's supervisor and executor."""

    supervisor: Supervisor
    executor: Executor
    _nursery: trio.Nursery
    _stopped: bool
    _worker_started: bool  # the executor actor has begun (a worker may exist)
    _worker_gone: trio.Event  # ...and has ended: its worker is reaped

    def _check_alive(self) -> None:
        """Raise the engine's EngineDeadError if it died or was shut down."""
        if self.supervisor.dead_error is not None:
            raise self.supervisor.dead_error
        if self._stopped:
            raise EngineDeadError("the engine has been shut down")

    async def _run_executor(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The executor actor; ``_worker_gone`` is set once it has ended (worker reaped)."""
        self._worker_started = True
        try:
            await self.executor.run(task_status=task_status)
        finally:
            self._worker_gone.set()

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

    async def check_health(self) -> None:
        """Raise the engine's EngineDeadError if it is dead; return otherwise. A checkpoint."""
        await trio.lowlevel.checkpoint()
        self._check_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine: open streams end with EngineDeadError, the worker is reaped.

        Synchronous and idempotent; the actors finish within the nursery's exit.
        The worker gets ``timeout`` seconds to exit by itself before it is
        killed (vLLM's parameter), at most the executor's own grace of 5 s; None:
        that grace. With the in-process executor there is no process to kill,
        so ``timeout`` bounds nothing there. Only the first call's ``timeout``
        counts.
        """
        if self._stopped:
            return
        self._stopped = True
        if timeout is not None and self._worker_started and not self._worker_gone.is_set():
            try:
                self._nursery.start_soon(self._kill_worker_after, max(0.0, timeout))
            except RuntimeError:  # the nursery has closed: the worker is long gone
                pass
        self.supervisor.stopping = True
        frontend: Frontend | None = getattr(self, "frontend", None)  # None: never started
        if frontend is not None:
            frontend.fail_all(EngineDeadError("the engine has been shut down"))
        self.executor.begin_shutdown()
        self.supervisor.cancel_all()

    async def _kill_worker_after(self, timeout: float) -> None:  # noqa: ASYNC109 - a deadline
        """Kill the worker if it has not been reaped ``timeout`` seconds from now."""
        with trio.move_on_after(timeout):
            await self._worker_gone.wait()
            return
        try:
            self.executor.kill()
        except (WorkerCallError, ProcessLookupError):  # in-process; or it has just gone
            pass
