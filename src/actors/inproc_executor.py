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

_STOPPED = "the in-process worker has stopped"


class InprocExecutor(WorkerFrames):
    """The Worker in this process: one task serves frames in order, each in a worker thread.

    A frame whose handling raises ends the worker: that caller and every later
    one get the WorkerDiedError, and ``on_failure`` is told it once. ``run`` owns
    the frames channel: once it ends (cancelled, or failed), frames still queued
    and any submitted later fail with WorkerDiedError instead of waiting forever.
    The channel is unbounded in type, bounded in use: the core waits on each
    step's answer, so at most a step and a few control calls are queued.
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
        try:
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
        finally:
            # This loop owns the frames: once it ends, nothing waits on an answer forever.
            self._frames_send.close()
            stopped = failure or WorkerDiedError(_STOPPED)
            while True:
                try:
                    _, answer = self._frames.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                answer.fail(stopped)

    def _submit(self, message: object) -> FrameAnswer:
        answer = FrameAnswer()
        try:
            self._frames_send.send_nowait((message, answer))
        except trio.ClosedResourceError:  # run() has ended
            raise WorkerDiedError(_STOPPED) from None
        return answer

    def _send_unanswered(self, message: object) -> None:
        self._submit(message)

    def begin_shutdown(self, grace: float | None = None) -> None:
        pass  # no process to give time to

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise WorkerCallError("the in-process executor has no worker process to signal")
