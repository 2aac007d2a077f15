"""The executor actor: drives the model worker, one request frame per step.

Two implementations with one interface (``run``, ``execute``, ``submit_step``,
``submit_bitmask``, ``ping``, ``call``, ``begin_shutdown``, ``kill``), both serving frames with
``legato.worker.Worker.handle``:

- ``ProcessExecutor`` (the default) runs ``python -m legato.worker`` as a child
  process and talks to it over its stdin / stdout with length-prefixed msgpack
  frames. Every frame carries an id and every answer the id of the frame it
  answers, so answers are routed by id to whoever asked. Frames are encoded
  in the caller's task and queued without a checkpoint; one task (the
  writer) owns the pipe and writes each frame whole. So a caller cancelled
  at any point either sent nothing or sent a whole frame whose answer is
  dropped on arrival: no other caller's answer ever shifts. The actor task
  reads answers and watches the process: EOF, an exit, a fatal WorkerError
  or a malformed answer raise ``WorkerDiedError``, which the supervisor
  turns into engine death; every caller still waiting then gets that error.
  The child is always reaped.
- ``InprocExecutor`` runs the Worker in this process, one frame at a time in
  order, in a worker thread (for tests and small set-ups).

Both are started with ``await nursery.start(executor.run)``; ``started`` is
signalled once the model is loaded, with the worker's ``WorkerReady``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

from ..config import EngineConfig
from ..exception_groups import unwrap_single_error
from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import EngineStartupError, LegatoError, ValidationError


class WorkerDiedError(LegatoError):
    """The model worker exited, hung up, reported a fatal error or sent a malformed answer."""


class WorkerCallError(LegatoError):
    """A utility call on the worker raised; the worker is still healthy.

    ``validation`` is set when the worker raised a ValidationError: the same
    error (field and reason) on this side of the process boundary.
    """

    def __init__(self, message: str, validation: ValidationError | None = None) -> None:
        super().__init__(message)
        self.validation = validation

    @classmethod
    def of(cls, answer: m.UtilityResult) -> WorkerCallError:
        """The error a failed ``UtilityResult`` reports."""
        validation = None
        if answer.error_field is not None:
            validation = ValidationError(answer.error_field, answer.error_reason or "")
        return cls(answer.error or "", validation)


def check_runner_output(step: m.SchedulerOutput, output: object) -> m.ModelRunnerOutput:
    """``output`` if it answers ``step`` (one entry per scheduled request, in order);
    WorkerDiedError otherwise: a worker that drops or invents requests would hang them."""
    if not isinstance(output, m.ModelRunnerOutput):
        raise WorkerDiedError(f"expected ModelRunnerOutput, got {type(output).__name__}")
    if output.step_id != step.step_id:
        raise WorkerDiedError(
            f"the model worker answered step {step.step_id} with step {output.step_id}"
        )
    if (
        len(output.num_sampled) != len(output.req_ids)
        or sum(output.num_sampled) != len(output.sampled_token_ids)
        or output.req_ids != list(step.num_scheduled_tokens)
    ):
        raise WorkerDiedError(
            f"the model worker's answer to step {step.step_id} does not match its requests "
            f"({len(output.req_ids)} ids and {len(output.num_sampled)} sample counts "
            f"for {len(step.num_scheduled_tokens)} scheduled requests)"
        )
    return output


class _Answer:
    """A one-shot slot for the answer to one frame (or the error that ended the worker)."""

    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: object = None
        self.error: BaseException | None = None

    def set(self, value: object) -> None:
        self.value = value
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def wait(self) -> object:
        await self.event.wait()
        if self.error is not None:
            raise self.error
        return self.value


class StepAnswer:
    """The answer to a step sent ahead of time (async scheduling).

    ``wait`` returns the checked ``ModelRunnerOutput`` (WorkerDiedError for a
    wrong one, or the worker's failure); a checkpoint. Steps sent ahead run
    on the worker in the order they were sent.

    A step sent with ``grammar_bitmask_follows`` has no answer until
    ``submit_bitmask`` sent its rows (the worker answers that frame); waiting
    before then is a programming error (RuntimeError), never a hang.
    """

    __slots__ = ("step", "_answer")

    def __init__(self, step: m.SchedulerOutput, answer: _Answer | None) -> None:
        self.step = step
        self._answer = answer

    @property
    def awaits_bitmask(self) -> bool:
        """Whether the step's GrammarBitmask is still to be sent (``submit_bitmask``)."""
        return self._answer is None

    @classmethod
    def unsent(cls, step: m.SchedulerOutput, reason: str) -> StepAnswer:
        """The answer to a step that never reached the worker (its frame could not be
        encoded): every request in it failed with ``reason``, no token sampled."""
        req_ids = list(step.num_scheduled_tokens)
        answer = _Answer()
        answer.set(
            m.ModelRunnerOutput(
                step.step_id, req_ids, [0] * len(req_ids), [], failed=dict.fromkeys(req_ids, reason)
            )
        )
        return cls(step, answer)

    def _bitmask_sent(self, answer: _Answer) -> None:
        if self._answer is not None:
            raise RuntimeError(f"step {self.step.step_id}: its bitmask was already sent")
        self._answer = answer

    async def wait(self) -> m.ModelRunnerOutput:
        if self._answer is None:
            raise RuntimeError(f"step {self.step.step_id}: waited for before its bitmask was sent")
        return check_runner_output(self.step, await self._answer.wait())


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


class ProcessExecutor:
    """The model runner in a child process. See the module docstring."""

    worker_name = "model worker"  # how errors name the worker process

    def __init__(self, config: EngineConfig, *, inject_fault: dict[str, Any] | None = None):
        self._config = config
        self._inject_fault = inject_fault
        self._process: trio.Process | None = None
        self._outbox, self._outbox_recv = trio.open_memory_channel[bytes](math.inf)
        self._answers: dict[int, _Answer] = {}  # by frame id: callers still waiting
        self._last_id = 0  # frames are numbered 1, 2, ...
        self._failure: BaseException | None = None  # set once the worker is gone
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
        return [sys.executable, "-m", "legato.worker"]

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("LEGATO_WORKER_THREADS", str(max(1, _cpu_threads())))
        return env

    async def _start_worker(self, process: trio.Process, reader: _FrameReader) -> m.WorkerReady:
        """Send WorkerInit, read the answer; EngineStartupError unless it is WorkerReady."""
        assert process.stdin is not None
        init = m.WorkerInit(config=self._config.to_dict(), inject_fault=self._inject_fault)
        try:
            await process.stdin.send_all(self._frame(init)[1])
            first = await reader.read()
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
        await reap_process(process, graceful=graceful)
        if process.stdout is not None:
            await process.stdout.aclose()

    def _frame(self, message: object) -> tuple[int, bytes]:
        """A new frame id and the whole frame (header and payload) for ``message``."""
        self._last_id += 1
        payload = wire.encode(message)
        return self._last_id, wire.frame_header(len(payload), self._last_id) + payload

    def submit(self, message: object) -> _Answer:
        """Queue ``message`` for the worker; its answer arrives in the returned slot.

        Synchronous and never blocks: nothing can interrupt it half-way. Raises
        the worker's failure if it is already gone.
        """
        if self._failure is not None:
            raise self._failure
        frame_id, data = self._frame(message)
        answer = self._answers[frame_id] = _Answer()
        self._outbox.send_nowait(data)
        return answer

    async def _request(self, message: object) -> object:
        """Send ``message`` and wait for its answer. A checkpoint.

        If the caller is cancelled the frame still reaches the worker (whole)
        and its answer is dropped on arrival.
        """
        answer = self.submit(message)
        return await answer.wait()

    async def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        """Run one step on the worker. A checkpoint; waits for the answer."""
        return check_runner_output(step, await self._request(step))

    def submit_step(self, step: m.SchedulerOutput) -> StepAnswer:
        """Send a step now without waiting (never blocks); its answer comes in the slot
        (with ``grammar_bitmask_follows``: once ``submit_bitmask`` sent its rows)."""
        if step.grammar_bitmask_follows:
            if self._failure is not None:
                raise self._failure
            self._outbox.send_nowait(self._frame(step)[1])  # answered through its bitmask
            return StepAnswer(step, None)
        return StepAnswer(step, self.submit(step))

    def submit_bitmask(self, answer: StepAnswer, rows: dict[str, bytes]) -> None:
        """Send the bitmask rows of a step sent with ``grammar_bitmask_follows`` (never
        blocks); the worker then samples it, and its answer comes in ``answer``."""
        answer._bitmask_sent(self.submit(m.GrammarBitmask(answer.step.step_id, rows)))

    async def ping(self) -> float:
        """Round trip to the worker; returns the seconds it took."""
        sent = time.monotonic()
        answer = await self._request(m.HealthPing(seq=0, sent_time=sent))
        if not isinstance(answer, m.HealthPong):
            raise WorkerDiedError(f"expected HealthPong, got {type(answer).__name__}")
        return time.monotonic() - sent

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``ModelRunner.<method>`` on the worker; raises WorkerCallError if it raised."""
        answer = await self._request(m.UtilityCall(0, method, list(args), kwargs))
        if not isinstance(answer, m.UtilityResult):
            raise WorkerDiedError(f"expected UtilityResult, got {type(answer).__name__}")
        if answer.error is not None:
            raise WorkerCallError.of(answer)
        return answer.result

    def begin_shutdown(self) -> None:
        """Mark the coming stop as graceful: the worker gets time to exit by itself."""
        self._closing = True

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker (chaos testing)."""
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, sig)


class InprocExecutor:
    """The Worker in this process: one task serves frames in order, each in a worker thread."""

    def __init__(self, config: EngineConfig, *, inject_fault: dict[str, Any] | None = None):
        self._config = config
        self._inject_fault = inject_fault
        self._worker: Any = None
        self._frames_send, self._frames = trio.open_memory_channel[tuple[object, _Answer]](math.inf)
        self.ready: m.WorkerReady | None = None
        self.pid: int | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the model, report ready, then serve frames in order until cancelled."""
        from ..worker import Worker

        init = m.WorkerInit(config=self._config.to_dict(), inject_fault=self._inject_fault)
        try:
            self._worker = await trio.to_thread.run_sync(Worker.start, init)
        except Exception as exc:
            raise EngineStartupError(f"model failed to load: {type(exc).__name__}: {exc}") from exc
        self.ready = self._worker.ready()
        task_status.started(self.ready)
        failure: WorkerDiedError | None = None  # the worker is not used after a failure
        async for message, answer in self._frames:
            if failure is not None:
                answer.fail(failure)
                continue
            try:
                answer.set(await trio.to_thread.run_sync(self._worker.handle, message))
            except Exception as exc:
                failure = WorkerDiedError(f"model runner failed: {type(exc).__name__}: {exc}")
                answer.fail(failure)

    def _submit(self, message: object) -> _Answer:
        answer = _Answer()
        self._frames_send.send_nowait((message, answer))
        return answer

    async def _request(self, message: object) -> object:
        """``Worker.handle(message)`` in turn; WorkerDiedError if it raised (fatal)."""
        return await self._submit(message).wait()

    async def execute(self, step: m.SchedulerOutput) -> m.ModelRunnerOutput:
        return check_runner_output(step, await self._request(step))

    def submit_step(self, step: m.SchedulerOutput) -> StepAnswer:
        if step.grammar_bitmask_follows:
            self._submit(step)  # answered through its bitmask
            return StepAnswer(step, None)
        return StepAnswer(step, self._submit(step))

    def submit_bitmask(self, answer: StepAnswer, rows: dict[str, bytes]) -> None:
        answer._bitmask_sent(self._submit(m.GrammarBitmask(answer.step.step_id, rows)))

    async def ping(self) -> float:
        sent = time.monotonic()
        await self._request(m.HealthPing(seq=0, sent_time=sent))
        return time.monotonic() - sent

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        answer = await self._request(m.UtilityCall(0, method, list(args), kwargs))
        assert isinstance(answer, m.UtilityResult)
        if answer.error is not None:
            raise WorkerCallError.of(answer)
        return answer.result

    def begin_shutdown(self) -> None:
        pass

    def kill(self, sig: int = signal.SIGKILL) -> None:
        raise WorkerCallError("the in-process executor has no worker process to signal")


Executor = ProcessExecutor | InprocExecutor


def make_executor(config: EngineConfig, *, inject_fault: dict[str, Any] | None = None) -> Executor:
    if config.tensor_parallel_size > 1:
        from .tensor_parallel_executor import TensorParallelExecutor

        return TensorParallelExecutor(config, inject_fault=inject_fault)
    if config.executor == "inproc":
        return InprocExecutor(config, inject_fault=inject_fault)
    return ProcessExecutor(config, inject_fault=inject_fault)


async def reap_process(process: trio.Process, *, graceful: bool) -> None:
    """Give a worker process a moment to exit by itself (5 s after a graceful stop, else
    0.2 s), then SIGKILL its process group. Bounded; a checkpoint."""
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


async def _wait_exit(process: trio.Process, seconds: float = 2.0) -> int | None:
    with trio.move_on_after(seconds):
        await process.wait()
    return process.returncode


def _cpu_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
