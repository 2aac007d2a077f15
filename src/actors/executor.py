"""The executor actor: drives the model worker, one request frame per step.

Two implementations with one interface:

- ``ProcessExecutor`` (the default) runs ``python -m legato.worker`` as a child
  process and talks to it over its stdin / stdout with length-prefixed msgpack
  frames. Answers come back strictly in order, so calls are pipelined through
  a FIFO of pending replies. The actor task reads answers and watches the
  process: EOF, an exit or a fatal WorkerError raise ``WorkerDiedError``, which
  the supervisor turns into engine death. The child is always reaped.
- ``InprocExecutor`` runs the ModelRunner in this process, in a worker thread
  (for tests and small set-ups).

Both are started with ``await nursery.start(executor.run)``; ``started`` is
signalled once the model is loaded, with the worker's ``WorkerReady``.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

from ..config import EngineConfig
from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import EngineStartupError, LegatoError


class WorkerDiedError(LegatoError):
    """The model worker exited, hung up or reported a fatal error."""


class WorkerCallError(LegatoError):
    """A utility call on the worker raised; the worker is still healthy."""


class _Reply:
    """A one-shot answer slot for one request frame."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: object = None

    def set(self, value: object) -> None:
        self.value = value
        self.event.set()

    async def wait(self) -> object:
        await self.event.wait()
        return self.value


class _FrameReader:
    """Reads length-prefixed frames from a trio ReceiveStream."""

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

    async def read(self) -> object | None:
        """The next frame, or None at end of stream."""
        if not await self._fill(wire.HEADER_SIZE):
            return None
        size = wire.read_frame_length(bytes(self._buffer[: wire.HEADER_SIZE]))
        if not await self._fill(wire.HEADER_SIZE + size):
            return None
        payload = bytes(self._buffer[wire.HEADER_SIZE : wire.HEADER_SIZE + size])
        del self._buffer[: wire.HEADER_SIZE + size]
        return wire.decode(payload)


class ProcessExecutor:
    """The model runner in a child process. See the module docstring."""

    def __init__(self, config: EngineConfig, *, inject_fault: dict[str, Any] | None = None):
        self._config = config
        self._inject_fault = inject_fault
        self._process: trio.Process | None = None
        self._pending: collections.deque[_Reply] = collections.deque()
        self._send_lock = trio.StrictFIFOLock()
        self._call_ids = 0
        self._closing = False
        self.ready: m.WorkerReady | None = None
        # Called with the error when the worker dies after start-up, before it is reaped.
        self.on_failure: Callable[[BaseException], None] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the worker, report its WorkerReady, then serve answers until shutdown.

        Raises EngineStartupError if the model fails to load (before started),
        WorkerDiedError if the worker dies afterwards. Always reaps the child,
        also when cancelled.
        """
        env = dict(os.environ)
        env.setdefault("LEGATO_WORKER_THREADS", str(max(1, _cpu_threads())))
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "legato.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C to the app is the engine's to handle
        )
        self._process = process
        assert process.stdin is not None and process.stdout is not None
        reader = _FrameReader(process.stdout)
        try:
            init = m.WorkerInit(config=self._config.to_dict(), inject_fault=self._inject_fault)
            await self._send(init)
            first = await reader.read()
            if isinstance(first, m.WorkerError):
                raise EngineStartupError(
                    f"model worker failed to start: {first.error_type}: {first.message}"
                )
            if not isinstance(first, m.WorkerReady):
                code = await _wait_exit(process)
                raise EngineStartupError(f"model worker exited during start-up (exit code {code})")
            self.ready = first
            task_status.started(first)
            try:
                await self._serve(reader, process)
            except Exception as exc:
                # Report before reaping: closing the worker's pipes makes other actors
                # fail too, and the engine's cause must be this error, not theirs.
                if self.on_failure is not None:
                    self.on_failure(exc)
                raise
        finally:
            with trio.CancelScope(shield=True):
                await self._reap(process)

    async def _serve(self, reader: _FrameReader, process: trio.Process) -> None:
        while True:
            frame = await reader.read()
            if frame is None:
                if self._closing:
                    return
                code = await _wait_exit(process)
                raise WorkerDiedError(f"model worker (pid {process.pid}) exited with code {code}")
            if isinstance(frame, m.WorkerError) and frame.fatal:
                raise WorkerDiedError(
                    f"model worker (pid {process.pid}) failed: {frame.error_type}: {frame.message}"
                )
            if not self._pending:
                raise WorkerDiedError(
                    f"model worker sent an unexpected frame {type(frame).__name__}"
                )
            self._pending.popleft().set(frame)

    async def _reap(self, process: trio.Process) -> None:
        """Close stdin, give the child a moment if this is a graceful stop, then kill it.

        Bounded; never raises.
        """
        graceful = self._closing
        self._closing = True
        try:
            if process.stdin is not None:
                await process.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        with trio.move_on_after(5 if graceful else 0.2):
            await process.wait()
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.kill()
            with trio.move_on_after(5):
                await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()

    async def _send(self, message: object) -> None:
        assert self._process is not None and self._process.stdin is not None
        payload = wire.encode(message)
        async with self._send_lock:
            try:
                await self._process.stdin.send_all(wire.frame_header(len(payload)) + payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise WorkerDiedError("the model worker's input pipe is closed") from exc

    async def _request(self, message: object) -> object:
        reply = _Reply()
        self._pending.append(reply)
        await self._send(message)
        return await reply.wait()

    async def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        """Run one step on the worker. A checkpoint; waits for the answer."""
        answer = await self._request(step)
        if not isinstance(answer, m.ModelRunnerOutput):
            raise WorkerDiedError(f"expected ModelRunnerOutput, got {type(answer).__name__}")
        return answer

    async def ping(self) -> float:
        """Round trip to the worker; returns the seconds it took."""
        sent = time.monotonic()
        answer = await self._request(m.HealthPing(seq=0, sent_time=sent))
        if not isinstance(answer, m.HealthPong):
            raise WorkerDiedError(f"expected HealthPong, got {type(answer).__name__}")
        return time.monotonic() - sent

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``ModelRunner.<method>`` on the worker; raises WorkerCallError if it raised."""
        self._call_ids += 1
        answer = await self._request(m.UtilityCall(self._call_ids, method, list(args), kwargs))
        if not isinstance(answer, m.UtilityResult):
            raise WorkerDiedError(f"expected UtilityResult, got {type(answer).__name__}")
        if answer.error is not None:
            raise WorkerCallError(answer.error)
        return answer.result

    def begin_shutdown(self) -> None:
        """Mark the coming stop as graceful: the worker gets time to exit by itself."""
        self._closing = True

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker (chaos testing)."""
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, sig)


class InprocExecutor:
    """The model runner in this process, stepping in a worker thread."""

    def __init__(self, config: EngineConfig, *, inject_fault: dict[str, Any] | None = None):
        from ..worker import _FaultPlan

        self._config = config
        self._faults = _FaultPlan(inject_fault)
        self._runner: Any = None
        self._limiter = trio.CapacityLimiter(1)
        self.ready: m.WorkerReady | None = None
        self.pid: int | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        from ..worker import _build_runner, _ready

        init = m.WorkerInit(config=self._config.to_dict())
        try:
            self._runner = await trio.to_thread.run_sync(_build_runner, init, self._faults)
        except Exception as exc:
            raise EngineStartupError(f"model failed to load: {type(exc).__name__}: {exc}") from exc
        self.ready = _ready(self._runner)
        task_status.started(self.ready)
        await trio.sleep_forever()

    async def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        def work() -> m.ModelRunnerOutput:
            self._faults.before_step()
            return self._runner.execute(step)  # type: ignore[no-any-return]

        try:
            return await trio.to_thread.run_sync(work, limiter=self._limiter)
        except Exception as exc:
            raise WorkerDiedError(f"model runner failed: {type(exc).__name__}: {exc}") from exc

    async def ping(self) -> float:
        sent = time.monotonic()
        await trio.to_thread.run_sync(lambda: None, limiter=self._limiter)
        return time.monotonic() - sent

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from ..worker import call_utility

        request = m.UtilityCall(0, method, list(args), kwargs)
        answer = await trio.to_thread.run_sync(
            call_utility, self._runner, request, limiter=self._limiter
        )
        if answer.error is not None:
            raise WorkerCallError(answer.error)
        return answer.result

    def begin_shutdown(self) -> None:
        pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise WorkerCallError("the in-process executor has no worker process to signal")


Executor = ProcessExecutor | InprocExecutor


def make_executor(config: EngineConfig, *, inject_fault: dict[str, Any] | None = None) -> Executor:
    if config.executor == "inproc":
        return InprocExecutor(config, inject_fault=inject_fault)
    return ProcessExecutor(config, inject_fault=inject_fault)


async def _wait_exit(process: trio.Process) -> int | None:
    with trio.move_on_after(2):
        await process.wait()
    return process.returncode


def _cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
