"""The in-process executor: the model worker in this process (tests, small set-ups).

One task serves frames in order, each in a worker thread, through the same
``Worker.handle`` the worker process uses. Imports trio, the protocol and
``legato.workers.worker`` (its whole job); never torch itself.
"""

from __future__ import annotations

import math
import signal
from typing import Any

import trio

from ..config import EngineConfig
from ..protocol import messages as m
from ..protocol.errors import EngineStartupError
from .executor import (
    FrameAnswer,
    OnFailure,
    WorkerCallError,
    WorkerDiedError,
    WorkerFrames,
)


class InprocExecutor(WorkerFrames):
    """The Worker in this process: one task serves frames in order, each in a worker thread.

    A frame whose handling raises ends the worker: that caller and every later
    one get the WorkerDiedError, and ``on_failure`` is told it once.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_failure: OnFailure | None = None,
        inject_fault: dict[str, Any] | None = None,
    ):
        self._config = config
        self._inject_fault = inject_fault
        self.on_failure = on_failure
        self._frames_send, self._frames = trio.open_memory_channel[tuple[object, FrameAnswer]](
            math.inf
        )
        self.ready: m.WorkerReady | None = None

    @property
    def pid(self) -> int | None:
        return None

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the model, report ready, then serve frames in order until cancelled."""
        from ..workers.worker import Worker

        init = m.WorkerInit(config=self._config.to_dict(), inject_fault=self._inject_fault)
        try:
            worker = await trio.to_thread.run_sync(Worker.start, init)
        except Exception as exc:
            raise EngineStartupError(f"model failed to load: {type(exc).__name__}: {exc}") from exc
        self.ready = worker.ready()
        task_status.started(self.ready)
        failure: WorkerDiedError | None = None  # the worker is not used after a failure
        async for message, answer in self._frames:
            if failure is not None:
                answer.fail(failure)
                continue
            try:
                answer.set(await trio.to_thread.run_sync(worker.handle, message))
            except Exception as exc:
                failure = WorkerDiedError(f"model runner failed: {type(exc).__name__}: {exc}")
                answer.fail(failure)
                if self.on_failure is not None:
                    self.on_failure(failure)

    def _submit(self, message: object) -> FrameAnswer:
        answer = FrameAnswer()
        self._frames_send.send_nowait((message, answer))
        return answer

    def _send_unanswered(self, message: object) -> None:
        self._submit(message)

    def begin_shutdown(self, grace: float | None = None) -> None:
        pass  # no process to give time to

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise WorkerCallError("the in-process executor has no worker process to signal")
