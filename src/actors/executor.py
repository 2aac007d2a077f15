"""The executor seam: what the engine needs of whatever drives the model worker.

:class:`Executor` is the protocol (``run``, ``submit_step``, ``submit_bitmask``,
``ping``, ``call``, ``begin_shutdown``, ``kill``). Three implement it, each in its
own module and each serving frames with ``legato.workers.worker.Worker.handle``:

- ``process_executor.ProcessExecutor`` (the default): the worker in a child
  process, id-carrying frames over its stdin / stdout;
- ``inproc_executor.InprocExecutor``: the worker in this process, one frame at
  a time in a worker thread (tests and small set-ups);
- ``tensor_parallel_executor.TensorParallelExecutor``: the process executor
  whose worker is rank 0 of a tensor-parallel group.

Each takes ``on_failure`` at construction: it is told the error when the worker
dies after start-up, before it is reaped (the supervisor's ``die``, so the
engine's cause is the worker's own error). Each is started with
``await nursery.start(executor.run)``; ``started`` is signalled once the model
is loaded, with the worker's ``WorkerReady``.

The calls every executor makes of its worker (steps, bitmasks, pings, utility
calls and the checks of their answers) live once, here, in ``WorkerFrames``.

Imports trio and the protocol; never the worker, torch or ``legato.models``,
so the engine core can hold an executor without importing any of them.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from ..protocol import messages as m
from ..protocol.errors import LegatoError, ValidationError

SHUTDOWN_GRACE = 5.0
"""Seconds a worker gets to exit by itself after a graceful stop, unless the stop
names fewer (``begin_shutdown(grace)``; ``AsyncEngine.shutdown(timeout)``)."""


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


class FrameAnswer:
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

    def __init__(self, step: m.SchedulerOutput, answer: FrameAnswer | None) -> None:
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
        answer = FrameAnswer()
        answer.set(
            m.ModelRunnerOutput(
                step.step_id, req_ids, [0] * len(req_ids), [], failed=dict.fromkeys(req_ids, reason)
            )
        )
        return cls(step, answer)

    def _bitmask_sent(self, answer: FrameAnswer) -> None:
        if self._answer is not None:
            raise RuntimeError(f"step {self.step.step_id}: its bitmask was already sent")
        self._answer = answer

    async def wait(self) -> m.ModelRunnerOutput:
        if self._answer is None:
            raise RuntimeError(f"step {self.step.step_id}: waited for before its bitmask was sent")
        return check_runner_output(self.step, await self._answer.wait())


OnFailure = Callable[[BaseException], None]
"""Told the error when the worker dies after start-up (before it is reaped)."""


class Executor(Protocol):
    """The engine's view of an executor. Started with ``await nursery.start(run)``,
    which reports the worker's ``WorkerReady``; see the module docstring."""

    ready: m.WorkerReady | None

    @property
    def pid(self) -> int | None:
        """The worker process's id (None in process or before start)."""
        ...

    async def run(
        self, *, task_status: trio.TaskStatus[m.WorkerReady] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    def submit_step(self, step: m.SchedulerOutput) -> StepAnswer: ...

    def submit_bitmask(self, answer: StepAnswer, rows: dict[str, bytes]) -> None: ...

    async def ping(self) -> float: ...

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    async def call_every_rank(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...

    def begin_shutdown(self, grace: float | None = None) -> None:
        """Mark the coming stop as graceful: the worker gets ``grace`` seconds (None:
        ``SHUTDOWN_GRACE``) to exit by itself once the executor is cancelled, then it
        is killed."""
        ...

    def kill(self, sig: int = signal.SIGKILL) -> None: ...


class WorkerFrames:
    """The calls every executor makes of its worker, over ``_submit`` (a frame whose
    answer comes in the returned slot) and ``_send_unanswered`` (a step answered
    through its bitmask frame). Both are synchronous and never block; they raise
    the worker's failure if it is already gone."""

    def _submit(self, message: object) -> FrameAnswer:
        raise NotImplementedError

    def _send_unanswered(self, message: object) -> None:
        raise NotImplementedError

    async def _request(self, message: object) -> object:
        """Send ``message`` and wait for its answer. A checkpoint.

        If the caller is cancelled the frame still reaches the worker (whole)
        and its answer is dropped on arrival.
        """
        return await self._submit(message).wait()

    def submit_step(self, step: m.SchedulerOutput) -> StepAnswer:
        """Send a step now without waiting (never blocks); its answer comes in the slot
        (with ``grammar_bitmask_follows``: once ``submit_bitmask`` sent its rows)."""
        if step.grammar_bitmask_follows:
            self._send_unanswered(step)  # answered through its bitmask
            return StepAnswer(step, None)
        return StepAnswer(step, self._submit(step))

    def submit_bitmask(self, answer: StepAnswer, rows: dict[str, bytes]) -> None:
        """Send the bitmask rows of a step sent with ``grammar_bitmask_follows`` (never
        blocks); the worker then samples it, and its answer comes in ``answer``."""
        answer._bitmask_sent(self._submit(m.GrammarBitmask(answer.step.step_id, rows)))

    async def ping(self) -> float:
        """Round trip to the worker; returns the seconds it took. A checkpoint."""
        sent = time.monotonic()
        answer = await self._request(m.HealthPing(seq=0, sent_time=sent))
        if not isinstance(answer, m.HealthPong):
            raise WorkerDiedError(f"expected HealthPong, got {type(answer).__name__}")
        return time.monotonic() - sent

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``ModelRunner.<method>`` on the worker; raises WorkerCallError if it raised
        (on any rank: the worker is still healthy), WorkerDiedError for an answer of
        another kind. Under tensor parallelism every rank runs it; rank 0's result."""
        return (await self._utility(method, args, kwargs)).result

    async def call_every_rank(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """As :meth:`call`, but every rank's result, in rank order (one for one worker)."""
        answer = await self._utility(method, args, kwargs)
        return [answer.result] if answer.rank_results is None else answer.rank_results

    async def _utility(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> m.UtilityResult:
        answer = await self._request(m.UtilityCall(0, method, list(args), kwargs))
        if not isinstance(answer, m.UtilityResult):
            raise WorkerDiedError(f"expected UtilityResult, got {type(answer).__name__}")
        if answer.error is not None:
            raise WorkerCallError.of(answer)
        return answer
