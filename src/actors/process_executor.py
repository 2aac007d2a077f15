"""The process executor: the model worker in a child process.

``ProcessExecutor`` runs ``python -m legato.workers.worker`` as a child process and
talks to it over its stdin / stdout with length-prefixed msgpack frames. Every
frame carries an id and every answer the id of the frame it answers, so answers
are routed by id to whoever asked. Frames are encoded in the caller's task and
queued without a checkpoint; one task (the writer) owns the pipe and writes
each frame whole. So a caller cancelled at any point either sent nothing or
sent a whole frame whose answer is dropped on arrival: no other caller's answer
ever shifts. The actor task reads answers and watches the process: EOF, an
exit, a fatal WorkerError or a malformed answer raise ``WorkerDiedError``,
which the supervisor turns into engine death; every caller still waiting then
gets that error. The child is always reaped.

Imports trio and the protocol; runs the worker as a command, never imports it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from typing import Any

import trio

from ..config import EngineConfig
from ..exception_groups import unwrap_single_error
from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import EngineStartupError, EngineStartupTimeout
from .executor import SHUTDOWN_GRACE, FrameAnswer, OnFailure, WorkerDiedError, WorkerFrames


class _FrameReader:
    """Reads id-carrying, length-prefixed frames from a trio ReceiveStream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def _fill(self, size: int) -> bool:
        while len(self._buffer) < size:
            chunk = await self._stream.receive_some(1 << 20)
            if not chunk:
                return False
            self._buffer += chunk
        return True

    async def read(self) -> tuple[int, object] | None:
        """The next frame's id and message, or None at end of stream. WireError if malformed."""
        if not await self._fill(wire.HEADER_SIZE):
            return None
        size, frame_id = wire.read_frame_header(bytes(self._buffer[: wire.HEADER_SIZE]))
        if not await self._fill(wire.HEADER_SIZE + size):
            return None
        payload = bytes(self._buffer[wire.HEADER_SIZE : wire.HEADER_SIZE + size])
        del self._buffer[: wire.HEADER_SIZE + size]
        return frame_id, wire.decode(payload)


class ProcessExecutor(WorkerFrames):
    """The model runner in a child process. See the module docstring."""

    worker_name = "model worker"  # how errors name the worker process

    def __init__(
        self,
        config: EngineConfig,
        *,
        on_failure: OnFailure | None = None,
        inject_fault: dict[str, Any] | None = None,
    ):
        self._config = config
        self._inject_fault = inject_fault
        self._process: trio.Process | None = None
        self._outbox, self._outbox_recv = trio.open_memory_channel[bytes](math.inf)
        self._answers: dict[int, FrameAnswer] = {}  # by frame id: callers still waiting
        self._last_id = 0  # frames are numbered 1, 2, ...
        self._failure: BaseException | None = None  # set once the worker is gone
        self._closing = False
        self._grace = SHUTDOWN_GRACE  # seconds a gracefully stopped worker gets to exit
        self.ready: m.WorkerReady | None = None
        self.on_failure = on_failure

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the worker, report its WorkerReady, then serve answers until shutdown.

        Raises EngineStartupError if the model fails to load (before started),
        WorkerDiedError if the worker dies afterwards. Always reaps the child,
        also when cancelled; callers still waiting for an answer then raise
        that WorkerDiedError (or one saying the worker was stopped).
        """
        process = await trio.lowlevel.open_process(
            self._worker_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self._worker_env(),
            start_new_session=True,  # a Ctrl-C to the app is the engine's to handle
        )
        self._process = process
        assert process.stdin is not None and process.stdout is not None
        reader = _FrameReader(process.stdout)
        try:
            self.ready = await self._start_worker(process, reader)
            task_status.started(self.ready)
            try:
                with unwrap_single_error():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._write_frames, process)
                        await self._read_answers(reader, process)
                        nursery.cancel_scope.cancel()
            except Exception as exc:
                # Report before reaping: closing the worker's pipes makes other actors
                # fail too, and the engine's cause must be this error, not theirs.
                self._fail_waiting(exc)
                if self.on_failure is not None:
                    self.on_failure(exc)
                raise
        finally:
            self._fail_waiting(WorkerDiedError("the model worker has been stopped"))
            with trio.CancelScope(shield=True):
                await self._reap(process)

    def _worker_command(self) -> list[str]:
        """The worker process's command line (the tensor-parallel executor runs rank 0)."""
        return [sys.executable, "-m", "legato.workers.worker"]

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("LEGATO_WORKER_THREADS", str(max(1, _cpu_threads())))
        return env

    async def _start_worker(self, process: trio.Process, reader: _FrameReader) -> m.WorkerReady:
        """Send WorkerInit, read the answer; EngineStartupError unless it is WorkerReady,
        EngineStartupTimeout (a TimeoutError too) without one in ``engine_ready_timeout``."""
        assert process.stdin is not None
        init = m.WorkerInit(config=self._config.to_dict(), inject_fault=self._inject_fault)
        timeout = self._config.engine_ready_timeout
        try:
            with trio.fail_after(timeout):
                await process.stdin.send_all(self._frame(init)[1])
                first = await reader.read()
        except trio.TooSlowError:
            raise EngineStartupTimeout(
                f"Timed out waiting for the model worker to start: not ready within {timeout} s "
                "(engine_ready_timeout). This is often caused by slow weight loading for "
                "large models."
            ) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, wire.WireError) as exc:
            code = await _wait_exit(process)
            raise EngineStartupError(
                f"model worker failed during start-up (exit code {code}): {exc}"
            ) from exc
        answer = first[1] if first is not None else None
        if isinstance(answer, m.WorkerError):
            raise EngineStartupError(
                f"model worker failed to start: {answer.error_type}: {answer.message}"
            )
        if not isinstance(answer, m.WorkerReady):
            code = await _wait_exit(process)
            raise EngineStartupError(f"model worker exited during start-up (exit code {code})")
        return answer

    async def _write_frames(self, process: trio.Process) -> None:
        """The writer: the only task that writes the pipe, one whole frame at a time.

        Never raises: if the pipe breaks, the worker is gone or going; the
        reader sees its end (the writer kills a worker that lingers).
        """
        assert process.stdin is not None
        async for data in self._outbox_recv:
            try:
                await process.stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                if await _wait_exit(process, 5.0) is None:
                    process.kill()
                return

    async def _read_answers(self, reader: _FrameReader, process: trio.Process) -> None:
        """Route each answer to its caller by frame id until the worker's stdout ends."""
        while True:
            try:
                frame = await reader.read()
            except wire.WireError as exc:
                raise WorkerDiedError(f"{self.worker_name} (pid {process.pid}) sent {exc}") from exc
            if frame is None:
                if self._closing:
                    return
                code = await _wait_exit(process)
                raise WorkerDiedError(
                    f"{self.worker_name} (pid {process.pid}) exited with code {code}"
                )
            frame_id, answer = frame
            if isinstance(answer, m.WorkerError) and answer.fatal:
                raise WorkerDiedError(
                    f"{self.worker_name} (pid {process.pid}) failed: {answer.error_type}: "
                    f"{answer.message}"
                )
            waiting = self._answers.pop(frame_id, None)
            if waiting is not None:
                waiting.set(answer)
            elif not 0 < frame_id <= self._last_id:
                raise WorkerDiedError(
                    f"model worker sent an answer to frame {frame_id}, which was never sent"
                )
            # else: the caller stopped waiting; its answer is dropped.

    def _fail_waiting(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
        waiting, self._answers = self._answers, {}
        for answer in waiting.values():
            answer.fail(self._failure)

    async def _reap(self, process: trio.Process) -> None:
        """Close stdin, give the child a moment if this is a graceful stop, then kill it.

        Bounded; never raises.
        """
        graceful = self._closing
        self._closing = True
        self._outbox.close()
        try:
            if process.stdin is not None:
                await process.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        await reap_process(process, grace=self._grace if graceful else FORCED_GRACE)
        if process.stdout is not None:
            await process.stdout.aclose()

    def _frame(self, message: object) -> tuple[int, bytes]:
        """A new frame id and the whole frame (header and payload) for ``message``."""
        self._last_id += 1
        return self._last_id, wire.frame(message, self._last_id)

    def _submit(self, message: object) -> FrameAnswer:
        """Queue ``message`` for the worker; its answer arrives in the returned slot.

        Synchronous and never blocks: nothing can interrupt it half-way. Raises
        the worker's failure if it is already gone.
        """
        if self._failure is not None:
            raise self._failure
        frame_id, data = self._frame(message)
        answer = self._answers[frame_id] = FrameAnswer()
        self._outbox.send_nowait(data)
        return answer

    def _send_unanswered(self, message: object) -> None:
        if self._failure is not None:
            raise self._failure
        self._outbox.send_nowait(self._frame(message)[1])

    def begin_shutdown(self, grace: float | None = None) -> None:
        """Mark the coming stop as graceful: the worker gets ``grace`` seconds (None:
        ``SHUTDOWN_GRACE``; longer is honoured, as vLLM's ``shutdown(timeout)``) to exit
        by itself once the executor is cancelled."""
        self._closing = True
        self._grace = SHUTDOWN_GRACE if grace is None else max(0.0, grace)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker (chaos testing)."""
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, sig)


FORCED_GRACE = 0.2
"""Seconds a worker gets to exit by itself when the stop is not graceful (death)."""


async def reap_process(process: trio.Process, *, grace: float) -> None:
    """Give a worker process ``grace`` seconds to exit by itself, then SIGKILL its process
    group. Bounded; a checkpoint."""
    with trio.move_on_after(grace):
        await process.wait()
    if process.returncode is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.kill()
        with trio.move_on_after(5):
            await process.wait()


async def _wait_exit(process: trio.Process, seconds: float = 2.0) -> int | None:
    with trio.move_on_after(seconds):
        await process.wait()
    return process.returncode


def _cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
