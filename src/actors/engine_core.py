"""The engine core: one step as plan -> execute -> apply, and the actor that loops it.

:class:`CoreSteps` is the synchronous step shared by every driver: ``plan``
asks the ``Scheduler`` for the next step, the caller executes it (on a worker,
or in this thread for ``LLMEngine``), ``apply`` takes the runner's output back
into the scheduler and returns the step's ``EngineCoreOutputs``.

:class:`EngineCore` is the scheduler actor around it. Each turn it drains its
inbox (new requests, aborts, control), plans a step and sends it to the
executor, applies the oldest answer and sends its outputs to the detokenizer
(which processes them while the next step runs). When there is nothing to
compute it waits on its inbox; it never spins.

With ``async_scheduling`` (overlap) the loop plans and sends step N+1 before
step N's answer arrives: the scheduler counts step N's samples as placeholder
tokens and the worker, which runs steps in order, fills them in. Without it,
each step is applied before the next is planned. Outputs are the same either
way (greedy tokens, stops, ``max_tokens``, aborts, structured outputs);
overlap only hides the control plane's time behind the worker's.

Structured outputs: a step with constrained requests is sent without its
grammar bitmask rows (``grammar_bitmask_follows``); the worker starts its
forward at once and samples when the rows come in a ``GrammarBitmask`` frame.
The loop computes them as soon as every earlier step is applied (each grammar
has then accepted the tokens before the one this step samples): at once
without overlap, else right after step N-1's answer, while step N's forward
runs. So constrained requests are planned ahead like any other.

Aborts and stop-string finishes that arrive while a step is running take
effect before the next step is planned, so an aborted request's KV blocks are
free within one step (two with overlap: a step already sent still runs, and
its answer for the aborted request is dropped).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import LegatoError
from .executor import Executor, StepAnswer, WorkerCallError
from .scheduler import Scheduler
from .stats import StepStats

if TYPE_CHECKING:
    from ..structured.engine import EngineGrammars, GrammarFailure

logger = logging.getLogger("legato.engine")


@dataclass
class AddRequests:
    requests: list[m.EngineRequest]


@dataclass
class FinishRequests:
    """Requests the front end finished (a stop string, a user's abort): free them,
    report nothing."""

    request_ids: list[str]
    reason: m.FinishReason = m.FinishReason.STOP


@dataclass
class Control:
    """A control message with its answer slot; ``reply`` is called with the result."""

    message: object
    reply: Callable[[object], None]


class CoreStopped(LegatoError):
    """The scheduler loop stopped (the engine died or shut down) before answering a call."""


class _Call:
    """One ``EngineCore.call`` waiting for its answer (or for the loop to stop)."""

    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: object = None

    def reply(self, value: object) -> None:
        if not self.done.is_set():
            self.value = value
            self.done.set()


CoreMessage = AddRequests | m.AbortRequests | FinishRequests | Control


class PlannedStep:
    """A step planned and not applied yet: the runner's message, and the queue times of
    the requests it starts."""

    __slots__ = ("grammar_failures", "plan", "queue_times")

    def __init__(
        self,
        plan: m.SchedulerOutput,
        queue_times: list[float],
        grammar_failures: dict[str, GrammarFailure] | None = None,
    ) -> None:
        self.plan = plan
        self.queue_times = queue_times
        # Constrained requests whose grammar failed while their bitmask row was built:
        # failed (alone) when the step is applied.
        self.grammar_failures = grammar_failures or {}


class CoreSteps:
    """The synchronous engine-core step: ``plan`` -> (the caller executes) -> ``apply``.

    Owns the scheduler's request bookkeeping for every driver (the async loop
    and ``LLMEngine``): adding, aborting and finishing requests, and the
    scheduler's figures (``record_stats`` gets one ``StepStats`` per applied
    step). Not thread-safe; never blocks.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        record_stats: Callable[[StepStats], None] | None = None,
        grammars: EngineGrammars | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.record_stats = record_stats
        self.grammars = grammars  # structured outputs: bitmask rows at plan, accept at apply
        self._arrivals: dict[str, float] = {}  # requests not yet scheduled

    def add_requests(self, requests: list[m.EngineRequest]) -> None:
        """Queue requests; ValueError (that request not queued) as ``Scheduler.add_request``."""
        for request in requests:
            self.scheduler.add_request(request)
            self._arrivals[request.request_id] = request.arrival_time

    def abort(self, request_ids: list[str]) -> list[m.EngineCoreOutput]:
        """Abort live requests; one ABORT output each (see ``Scheduler.abort``)."""
        outputs = self.scheduler.abort(request_ids)
        self.forget_finished(outputs)
        return outputs

    def finish(self, request_ids: list[str], reason: m.FinishReason) -> None:
        """Finish requests whose end the front end already knows; no output."""
        self.scheduler.finish_requests(request_ids, reason)
        for request_id in request_ids:
            self._arrivals.pop(request_id, None)

    def plan(self, *, bitmask_follows: bool = False) -> PlannedStep | None:
        """Plan the next step; None if nothing can run now (nothing to do, frozen by a
        pause, or every request waits for blocks or for steps in flight).

        A step with constrained requests needs their grammar bitmask rows. By default
        they are computed now, into the plan (the caller applied every earlier step).
        ``bitmask_follows``: the plan is marked ``grammar_bitmask_follows`` instead, and
        the caller sends ``bitmask(step)`` once every earlier step is applied.
        """
        scheduler = self.scheduler
        plan = scheduler.schedule()
        if plan.total_num_scheduled_tokens == 0:
            return None
        queue_times = []
        if plan.new_requests:
            now = time.monotonic()
            for new in plan.new_requests:  # also requests resumed after preemption: not queued
                arrival = self._arrivals.pop(new.request_id, None)
                if arrival is not None:
                    queue_times.append(now - arrival)
        planned = PlannedStep(plan, queue_times)
        if (
            self.grammars is not None
            and scheduler.has_constrained_requests
            and self.grammars.constrains(plan, scheduler.requests)
        ):
            if bitmask_follows:
                plan.grammar_bitmask_follows = True
            else:
                plan.grammar_bitmask = self.bitmask(planned)
        return planned

    def bitmask(self, step: PlannedStep) -> dict[str, bytes]:
        """``step``'s grammar bitmask rows, computed now. Call it once every step before
        ``step`` is applied: each grammar has then accepted every token before the one
        ``step`` samples (the row does not depend on what ``step`` computes). A request
        whose grammar fails here gets no row and fails, alone, when ``step`` is applied
        (its token from ``step`` is discarded)."""
        if self.grammars is None:
            return {}
        rows, failed = self.grammars.bitmasks(step.plan, self.scheduler.requests)
        step.grammar_failures.update(failed)
        return rows

    def apply(self, step: PlannedStep, runner_output: m.ModelRunnerOutput) -> m.EngineCoreOutputs:
        """Take a step's answer into the scheduler (steps in planning order); its outputs."""
        # Requests the runner could not compute finish first: the answer skips them.
        not_computed = self.scheduler.fail(runner_output.failed) if runner_output.failed else []
        core_out = self.scheduler.update_from_output(step.plan, runner_output)
        core_out.outputs += not_computed
        failed = step.grammar_failures
        if self.grammars is not None and self.scheduler.has_constrained_requests:
            failed.update(self.grammars.accept(core_out.outputs, self.scheduler.requests))
        if failed:  # those requests alone
            core_out.outputs += self.scheduler.fail({i: f.message for i, f in failed.items()})
            _fail_outputs(core_out.outputs, failed)
        self.forget_finished(core_out.outputs)
        self.record(core_out.scheduler_stats, step.queue_times)
        return core_out

    def record(
        self, stats: m.SchedulerStats | None, queue_times: list[float] | None = None
    ) -> None:
        """Publish the scheduler's figures (after a step, or after aborts freed blocks)."""
        if self.record_stats is not None:
            self.record_stats(
                StepStats(
                    timestamp=time.monotonic(),
                    scheduler=stats,
                    num_prompt_tokens=stats.num_prefill_tokens if stats is not None else 0,
                    queue_time=queue_times or [],
                )
            )

    def forget_finished(self, outputs: list[m.EngineCoreOutput]) -> None:
        """Drop the arrival times of requests that finished before they were scheduled."""
        if not self._arrivals:
            return  # every live request has been scheduled: nothing to forget
        for out in outputs:
            if out.finish_reason is not None:
                self._arrivals.pop(out.request_id, None)


def _fail_outputs(outputs: list[m.EngineCoreOutput], failed: dict[str, GrammarFailure]) -> None:
    """Drop the step's tokens of requests whose grammar failed (sampled without a row, or
    refused by their grammar); each ends with its error, naming its constraint's field
    (also one the step finished before its failure was known)."""
    for out in outputs:
        failure = failed.get(out.request_id)
        if failure is None:
            continue
        out.new_token_ids = []
        out.new_logprobs = None
        if out.finish_reason is not None:
            out.finish_reason, out.stop_reason = m.FinishReason.ERROR, None
            out.error, out.error_field = failure.message, failure.field or None


@dataclass
class EngineCore:
    """State of the scheduler actor; ``run`` is the actor.

    ``async_scheduling``: plan step N+1 while the worker computes step N
    (see the module docstring); False applies each step before planning the next.
    """

    scheduler: Scheduler
    executor: Executor
    outputs: trio.MemorySendChannel[m.EngineCoreOutputs]
    record_stats: Callable[[StepStats], None] | None = None
    async_scheduling: bool = False
    grammars: EngineGrammars | None = None  # structured outputs (None: no request uses them)
    sleeping: bool = False
    _inbox_send: trio.MemorySendChannel[CoreMessage] = field(init=False)
    _inbox: trio.MemoryReceiveChannel[CoreMessage] = field(init=False)
    # What WAIT-mode pauses and sleeps do once nothing is in flight.
    _waiters: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._inbox_send, self._inbox = trio.open_memory_channel[CoreMessage](math.inf)
        self.steps = CoreSteps(self.scheduler, self.record_stats, self.grammars)
        # Steps sent to the executor and not applied yet, oldest first.
        self._sent: collections.deque[tuple[PlannedStep, StepAnswer]] = collections.deque()
        self._depth = 2 if self.async_scheduling else 1
        self._idle = trio.Event()
        self._idle.set()
        self._stats_dirty = False
        self._stopped = False
        self._calls: set[_Call] = set()

    @property
    def num_steps_in_flight(self) -> int:
        """Steps sent to the executor and not applied yet (at most 2 with overlap, else 1)."""
        return len(self._sent)

    async def wait_idle(self) -> None:
        """Return once no request is left in the scheduler (all KV blocks free).

        A checkpoint; waits as long as requests keep running.
        """
        while True:
            await self._idle.wait()
            if not self.scheduler.has_unfinished_requests():
                return

    def _note_idle(self) -> None:
        if not self.scheduler.has_unfinished_requests():
            self._idle.set()
        elif self._idle.is_set():
            self._idle = trio.Event()

    def submit(self, message: CoreMessage) -> None:
        """Queue a message for the loop. Never blocks; safe from any trio task."""
        self._inbox_send.send_nowait(message)

    async def call(self, message: object) -> object:
        """Send a control message and wait for its answer. A checkpoint.

        The message is queued before the first checkpoint: a caller cancelled
        while waiting just stops waiting, and the loop still carries it out.
        Raises the answer if it is an exception, and CoreStopped if the loop
        stops (the engine died or shut down) before answering.
        """
        if self._stopped:
            raise CoreStopped("the scheduler loop has stopped")
        call = _Call()
        self._calls.add(call)
        try:
            self.submit(Control(message, call.reply))
            await call.done.wait()
        finally:
            self._calls.discard(call)
        if isinstance(call.value, BaseException):
            raise call.value
        return call.value

    async def run(self) -> None:
        """The actor loop. Runs until cancelled; any exception kills the engine.

        When it ends, every call still waiting raises CoreStopped.
        """
        try:
            await self._loop()
        finally:
            self._stopped = True
            for call in list(self._calls):
                call.reply(CoreStopped("the scheduler loop has stopped"))

    async def _loop(self) -> None:
        while True:
            if not self._has_work() and not self._sent:
                self._note_idle()
                await self._handle(await self._inbox.receive())
            while True:
                try:
                    message = self._inbox.receive_nowait()
                except trio.WouldBlock:
                    break
                await self._handle(message)
            if self._stats_dirty:
                self._record(self.scheduler.make_stats())
            sent = False
            if self._has_work() and len(self._sent) < self._depth:
                sent = self._send_step()
            if self._sent and (not sent or len(self._sent) >= self._depth):
                await self._apply_oldest()
            elif not sent and not self._sent and self._has_work():
                # Nothing can run (frozen, or waiting on blocks only an abort can free):
                # wait for news instead of spinning.
                await self._handle(await self._inbox.receive())
            await self._answer_waiters()
            self._note_idle()
            await trio.lowlevel.checkpoint()

    def _has_work(self) -> bool:
        return not self.sleeping and self.scheduler.has_unfinished_requests()

    def _send_step(self) -> bool:
        """Plan a step and send it to the executor; False if nothing can run now.

        A constrained step's bitmask rows follow it: computed and sent at once when
        no earlier step is in flight (the worker's forward runs meanwhile), else
        right after the earlier step is applied (``_apply_oldest``).
        """
        planned = self.steps.plan(bitmask_follows=True)
        if planned is None:
            return False
        try:
            answer = self.executor.submit_step(planned.plan)
        except wire.WireError as exc:  # a frame that cannot be encoded fails its requests
            answer = self._unsendable(planned.plan, exc)
        self._sent.append((planned, answer))
        if answer.awaits_bitmask and len(self._sent) == 1:
            self.executor.submit_bitmask(answer, self.steps.bitmask(planned))
        return True

    def _unsendable(self, step: m.SchedulerOutput, exc: wire.WireError) -> StepAnswer:
        """Fail the requests of a step whose frame cannot be encoded, now (before a later
        step plans them), and stand in for its answer; the engine keeps serving."""
        logger.error("step %d could not be sent to the model worker: %s", step.step_id, exc)
        reason = "this request's step could not be sent to the model worker"
        failed = self.steps.scheduler.fail(dict.fromkeys(step.num_scheduled_tokens, reason))
        self.steps.forget_finished(failed)
        self._emit(failed)
        return StepAnswer.unsent(step, reason)

    async def _apply_oldest(self) -> None:
        """Wait for the oldest step's answer, apply it, pass its outputs on; then send the
        next step's bitmask rows if they wait for this step. A checkpoint."""
        planned, answer = self._sent[0]
        runner_out = await answer.wait()
        self._sent.popleft()
        self._stats_dirty = False
        self.outputs.send_nowait(self.steps.apply(planned, runner_out))
        if self._sent and self._sent[0][1].awaits_bitmask:
            following, following_answer = self._sent[0]
            self.executor.submit_bitmask(following_answer, self.steps.bitmask(following))

    async def _drain_sent(self) -> None:
        """Apply every step in flight (before a control that needs a quiet worker)."""
        while self._sent:
            await self._apply_oldest()

    def _record(self, stats: m.SchedulerStats | None) -> None:
        """Publish the scheduler's figures after aborts or arrivals changed them."""
        self._stats_dirty = False
        self.steps.record(stats)

    def _emit(self, outputs: list[m.EngineCoreOutput]) -> None:
        if outputs:
            self.outputs.send_nowait(m.EngineCoreOutputs(outputs, time.monotonic(), None))

    async def _handle(self, message: CoreMessage) -> None:
        self._stats_dirty = True  # queues or blocks may have changed: publish before sleeping
        if isinstance(message, AddRequests):
            self.steps.add_requests(message.requests)
        elif isinstance(message, m.AbortRequests):
            self._emit(self.steps.abort(message.request_ids))
        elif isinstance(message, FinishRequests):
            self.steps.finish(message.request_ids, message.reason)
        elif isinstance(message, Control):
            await self._drain_sent()  # a control sees (and may change) a quiet worker
            await self._control(message)
        else:  # pragma: no cover - a programming error
            raise TypeError(f"unexpected message {message!r}")

    async def _control(self, control: Control) -> None:
        """Carry out a control message and answer it.

        The whole of a control's effect happens here, in the loop, whatever
        its caller does: a caller cancelled while waiting for the answer
        just never reads it. A WAIT-mode pause or sleep is answered once
        nothing is in flight (``_answer_waiters``).
        """
        message = control.message
        if isinstance(message, m.PauseGeneration):
            self._emit(self.scheduler.pause(message.mode))
            clear = message.clear_cache and message.mode != m.PauseMode.KEEP
            if message.mode == m.PauseMode.WAIT:
                self._waiters.append(functools.partial(self._paused, control.reply, clear))
            else:
                await self._paused(control.reply, clear)
        elif isinstance(message, m.ResumeGeneration):
            self.scheduler.resume()
            control.reply(None)
        elif isinstance(message, m.ResetPrefixCache):
            control.reply(self.scheduler.reset_prefix_cache(message.reset_running_requests))
        elif isinstance(message, m.HealthPing):
            control.reply(m.HealthPong(message.seq, message.sent_time))
        elif isinstance(message, m.Sleep):
            if message.mode == m.PauseMode.WAIT:
                resume = not self.scheduler.is_paused
                if self.scheduler.pause_mode in (None, m.PauseMode.KEEP):
                    self.scheduler.pause(m.PauseMode.WAIT)  # a frozen request could never drain
                after = functools.partial(self._sleep, message.level, control.reply, resume)
                self._waiters.append(after)
            else:
                await self._sleep(message.level, control.reply, False)
        elif isinstance(message, m.WakeUp):
            await self._wake_up(message.tags, control.reply)
        else:
            control.reply(TypeError(f"unknown control message {type(message).__name__}"))

    async def _paused(self, reply: Callable[[object], None], clear_cache: bool) -> None:
        if clear_cache:
            self.scheduler.reset_prefix_cache(False)
        reply(None)
        await trio.lowlevel.checkpoint()

    async def _sleep(self, level: int, reply: Callable[[object], None], resume: bool) -> None:
        """Abort what is in flight, forget the prefix cache, put the worker to sleep.

        Requests held by a pause stay queued (they hold no blocks) and run
        after ``wake_up``; so do requests that arrive while asleep.
        """
        # Nothing may run on a worker without its KV cache: finish what is in flight first.
        self._emit(self.scheduler.abort_in_flight())
        self.scheduler.reset_prefix_cache(True)
        if resume:
            self.scheduler.resume()
        self.sleeping = True
        try:
            await self.executor.call("sleep", level)
        except WorkerCallError as exc:
            reply(exc)
            return
        reply(None)

    async def _wake_up(self, tags: list[str] | None, reply: Callable[[object], None]) -> None:
        try:
            await self.executor.call("wake_up", tags)
        except WorkerCallError as exc:
            reply(exc)
            return
        if tags is None or "kv_cache" in tags:
            self.sleeping = False
        reply(None)

    async def _answer_waiters(self) -> None:
        """Run the WAIT-mode pauses and sleeps once nothing is in flight."""
        if self._waiters and not self.scheduler.has_in_flight_requests():
            await self._drain_sent()
        while self._waiters and not self.scheduler.has_in_flight_requests():
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                await waiter()
