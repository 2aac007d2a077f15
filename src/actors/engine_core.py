"""The engine core: one step as plan -> execute -> apply, and the actor that loops it.

:class:`~.core_steps.CoreSteps` is the synchronous step shared by every
driver (``core_steps``). :class:`EngineCore` is the scheduler actor around it. Each turn it drains its
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

The inbox is bounded: ``max_live_requests`` places for requests and
``CONTROL_ROOM`` beside them. Requests enter it only past the front end's
admission check (``has_room``: fewer than ``max_live_requests`` requests
queued; ``AsyncEngine`` refuses more with EngineBusyError), so ``submit`` never
finds it full for them; finishes and aborts queued beside them never count
against that bound. A control call waits for room (a checkpoint) in the rare
case it finds none. Finishes and aborts never wait and are never lost: once
they fill the control room they are kept aside, in order (at most one entry
per request), and applied right after the inbox's messages.

Speculative decoding: a request with a sample in flight (a placeholder) verifies
no drafts, since they were proposed before that sample. So while some running
request holds drafts the loop plans no step ahead: the next step is planned once
the one in flight is applied, and verifies them. When no request holds drafts
(prompt lookup found nothing) the loop overlaps steps again.

Aborts and stop-string finishes that arrive while a step is running take
effect before the next step is planned, so an aborted request's KV blocks are
free within one step (two with overlap: a step already sent still runs, and
its answer for the aborted request is dropped).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import trio

from ..metrics.records import StepStats
from ..protocol import messages as m
from ..protocol import wire
from ..protocol.errors import LegatoError
from ..scheduling.core_steps import (
    AbortRequests,
    AddRequests,
    CoreSteps,
    FinishRequests,
    PlannedStep,
)
from ..scheduling.pause_gate import PauseMode
from ..scheduling.scheduler import Scheduler
from .executor import Executor, StepAnswer, WorkerCallError

if TYPE_CHECKING:
    from ..structured.engine import EngineGrammars

logger = logging.getLogger("legato.engine")


T = TypeVar("T")

Reply = Callable[[T | BaseException], None]
"""Answers a control operation: its result, or the error its caller raises."""


@dataclass
class Control:
    """A control operation for the loop, carried out once no step is in flight; it
    answers its caller through the reply it holds."""

    run: Callable[[], Awaitable[None]]


class CoreStopped(LegatoError):
    """The scheduler loop stopped (the engine died or shut down) before answering a call."""


class _Call(Generic[T]):
    """One control call waiting for its answer (or for the loop to stop)."""

    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: T | BaseException | None = None

    def reply(self, value: T | BaseException) -> None:
        if not self.done.is_set():
            self.value = value
            self.done.set()


CoreMessage = AddRequests | AbortRequests | FinishRequests | Control

CONTROL_ROOM = 256
"""Inbox places beyond ``max_live_requests``: for control calls and finishes."""


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
    max_live_requests: int = 4096  # the requests the inbox holds at most (see ``has_room``)
    _inbox_send: trio.MemorySendChannel[CoreMessage] = field(init=False)
    _inbox: trio.MemoryReceiveChannel[CoreMessage] = field(init=False)
    # What WAIT-mode pauses and sleeps do once nothing is in flight.
    _waiters: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _resume_on_wake: bool = False  # a sleep(mode="keep") paused; wake_up resumes

    def __post_init__(self) -> None:
        # Room for every admitted request, and for the control calls and finishes beside.
        self._inbox_send, self._inbox = trio.open_memory_channel[CoreMessage](
            self.max_live_requests + CONTROL_ROOM
        )
        # Finishes and aborts that found the control room full, oldest first.
        self._overflow: list[FinishRequests | AbortRequests] = []
        self._queued_adds = 0  # AddRequests in the inbox: what ``has_room`` bounds
        self.steps = CoreSteps(self.scheduler, self.record_stats, self.grammars)
        # Steps sent to the executor and not applied yet, oldest first.
        self._sent: collections.deque[tuple[PlannedStep, StepAnswer]] = collections.deque()
        self._depth = 2 if self.async_scheduling else 1
        # Speculative decoding: while drafts wait to be verified, no step is planned ahead.
        self._drafts = self.scheduler.config.speculative_config is not None
        # That costs the overlap async scheduling gives a plain step: the worker waits while
        # this loop applies the drafted step and plans the next. The drafted step sent with
        # no step ahead (and when), then when the worker went idle after it, by this loop's
        # clock (sent + the worker's own time); the next send measures the wait for the draft
        # policy (StepCost.observe_overlap). Never measured without async scheduling.
        self._lone: tuple[PlannedStep, float] | None = None
        self._worker_idle_from: float | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._stats_dirty = False
        self._stopped = False
        self._calls: set[_Call[Any]] = set()

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

    def has_room(self) -> bool:
        """Whether the inbox has room for one more request (the admission check's part):
        fewer than ``max_live_requests`` requests queued, whatever else is queued."""
        stats = self._inbox_send.statistics()
        return (
            self._queued_adds < self.max_live_requests
            and stats.current_buffer_used < stats.max_buffer_size
        )

    def submit(self, message: AddRequests | FinishRequests | AbortRequests) -> None:
        """Queue a front-end message for the loop. Never blocks; safe from any trio task.

        Requests must have passed the admission check (``has_room``); one that finds
        the inbox full anyway raises ``trio.WouldBlock``. Finishes and aborts never
        fail: past a full control room they wait aside for the loop, in order after
        what it holds. Once the loop has stopped (the engine died or shut down) this
        does nothing.
        """
        sender = self._inbox_send
        if self._stopped:
            return
        if isinstance(message, AddRequests):
            try:
                sender.send_nowait(message)
            except trio.ClosedResourceError:  # the loop has stopped: nobody is left to tell
                return
            self._queued_adds += 1
            return
        used = sender.statistics().current_buffer_used
        if self._overflow or used - self._queued_adds >= CONTROL_ROOM:
            self._overflow.append(message)
            return
        try:
            sender.send_nowait(message)
        except trio.ClosedResourceError:
            pass

    async def pause(self, mode: PauseMode, clear_cache: bool = False) -> None:
        """Stop admitting: ABORT finishes what is in flight, WAIT returns once it has
        finished, KEEP freezes it until ``resume``. ``clear_cache`` (not KEEP) resets
        the prefix cache once nothing is in flight. A checkpoint (see ``_call``)."""
        await self._call(functools.partial(self._pause, mode, clear_cache))

    async def resume(self) -> None:
        """Leave any pause. A checkpoint (see ``_call``)."""
        await self._call(self._resume)

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """Abort (or, WAIT, first finish) what is in flight, then free the worker's KV
        cache (level 2: also its weights). WorkerCallError if the worker refused."""
        await self._call(functools.partial(self._sleep, level, mode))

    async def wake_up(self, tags: list[str] | None) -> None:
        """Restore what ``sleep`` freed (None: everything). WorkerCallError if refused."""
        await self._call(functools.partial(self._wake_up, tags))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; False if running requests hold blocks (unless
        ``reset_running_requests`` preempts them first)."""
        return await self._call(functools.partial(self._reset_prefix_cache, reset_running_requests))

    async def ping(self) -> None:
        """Return once the loop has come round to this call (the heartbeat's probe)."""
        await self._call(self._pong)

    async def _call(self, operation: Callable[[Reply[T]], Awaitable[None]]) -> T:
        """Queue ``operation`` for the loop and wait for its answer. A checkpoint.

        The operation is queued before the first checkpoint: a caller cancelled
        while waiting just stops waiting, and the loop still carries it out.
        Raises the answer if it is an exception, and CoreStopped if the loop
        stops (the engine died or shut down) before answering.
        """
        if self._stopped:
            raise CoreStopped("the scheduler loop has stopped")
        call: _Call[T] = _Call()
        self._calls.add(call)
        control = Control(functools.partial(operation, call.reply))
        try:
            try:
                self._inbox_send.send_nowait(control)
            except trio.WouldBlock:  # a full inbox: wait for room (cancellable until queued)
                await self._inbox_send.send(control)
            except trio.ClosedResourceError:  # the loop stopped since the check above
                raise CoreStopped("the scheduler loop has stopped") from None
            await call.done.wait()
        finally:
            self._calls.discard(call)
        if isinstance(call.value, BaseException):
            raise call.value
        return call.value  # type: ignore[return-value]  # set by reply: a T

    async def run(self) -> None:
        """The actor loop. Runs until cancelled; any exception kills the engine.

        When it ends, every call still waiting raises CoreStopped.
        """
        # The loop owns the outputs' send side and its inbox: closing them when it ends
        # ends the delivery actor's loop, and a late ``submit`` finds the inbox closed.
        # (``with``, not ``async with``: no checkpoint between the loop's end and the
        # supervisor's noting why it ended.)
        with self.outputs, self._inbox_send:
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
                self._worker_idle_from = None  # a wait for requests is no step's cost
                await self._handle(await self._inbox.receive())
            while True:
                try:
                    message = self._inbox.receive_nowait()
                except trio.WouldBlock:
                    break
                await self._handle(message)
            if self._overflow:  # finishes and aborts that found it full: after what it held
                overflow, self._overflow = self._overflow, []
                for message in overflow:
                    await self._handle(message)
            if self._stats_dirty:
                self._record(self.scheduler.make_stats())
            sent = False
            depth = self._depth
            if self._drafts and depth > 1 and self.scheduler.has_drafts_to_verify():
                depth = 1
            if self._has_work() and len(self._sent) < depth:
                sent = self._send_step(alone=depth < self._depth)
            if self._sent and (not sent or len(self._sent) >= depth):
                await self._apply_oldest()
            elif not sent and not self._sent and self._has_work():
                # Nothing can run (frozen, or waiting on blocks only an abort can free):
                # wait for news instead of spinning.
                self._worker_idle_from = None
                await self._handle(await self._inbox.receive())
            await self._answer_waiters()
            self._note_idle()
            await trio.lowlevel.checkpoint()

    def _has_work(self) -> bool:
        return not self.sleeping and self.scheduler.has_unfinished_requests()

    def _send_step(self, alone: bool = False) -> bool:
        """Plan a step and send it to the executor; False if nothing can run now.
        ``alone``: planned with no step ahead because it has drafts to verify (the worker's
        wait after it is measured).

        A constrained step's bitmask rows follow it: computed and sent at once when
        no earlier step is in flight (the worker's forward runs meanwhile), else
        right after the earlier step is applied (``_apply_oldest``).
        """
        planned = self.steps.plan(bitmask_follows=True)
        if planned is None:
            return False
        now = time.perf_counter()
        idle_from, self._worker_idle_from = self._worker_idle_from, None
        cost = self.scheduler.step_cost
        if idle_from is not None and cost is not None:
            cost.observe_overlap(now - idle_from)
        self._lone = (planned, now) if alone and not self._sent else None
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
        lone = self._lone is not None and self._lone[0] is planned and len(self._sent) == 1
        if lone and self._lone is not None and runner_out.step_seconds > 0:
            self._worker_idle_from = self._lone[1] + runner_out.step_seconds
        self._lone = None
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
            self._queued_adds -= 1
            self.steps.add_requests(message.requests, message.grammars)
        elif isinstance(message, FinishRequests):
            self.steps.finish(message.request_ids, message.reason)
        elif isinstance(message, Control):
            # A control sees (and may change) a quiet worker. The whole of its effect
            # happens here, in the loop, whatever its caller does: a caller cancelled
            # while waiting just never reads the answer. A WAIT-mode pause or sleep
            # is answered once nothing is in flight (``_answer_waiters``).
            await self._drain_sent()
            await message.run()
        else:
            self._emit(self.steps.abort(message.request_ids))

    # The control operations, each carried out by the loop (``_handle``).

    async def _pause(self, mode: PauseMode, clear_cache: bool, reply: Reply[None]) -> None:
        self._emit(self.scheduler.pause(mode))
        clear = clear_cache and mode != PauseMode.KEEP
        if mode == PauseMode.WAIT:
            self._waiters.append(functools.partial(self._paused, reply, clear))
        else:
            await self._paused(reply, clear)

    async def _paused(self, reply: Reply[None], clear_cache: bool) -> None:
        if clear_cache:
            self.scheduler.reset_prefix_cache(False)
        reply(None)
        await trio.lowlevel.checkpoint()

    async def _resume(self, reply: Reply[None]) -> None:
        self.scheduler.resume()
        reply(None)
        await trio.lowlevel.checkpoint()

    async def _reset_prefix_cache(self, reset_running_requests: bool, reply: Reply[bool]) -> None:
        reply(self.scheduler.reset_prefix_cache(reset_running_requests))
        await trio.lowlevel.checkpoint()

    async def _pong(self, reply: Reply[None]) -> None:
        reply(None)
        await trio.lowlevel.checkpoint()

    async def _sleep(self, level: int, mode: PauseMode, reply: Reply[None]) -> None:
        if mode == PauseMode.KEEP:
            await self._sleep_keeping(level, reply)
        elif mode == PauseMode.WAIT:
            resume = not self.scheduler.is_paused
            if self.scheduler.pause_mode in (None, PauseMode.KEEP):
                self.scheduler.pause(PauseMode.WAIT)  # a frozen request could never drain
            self._waiters.append(functools.partial(self._fall_asleep, level, reply, resume))
        else:
            await self._fall_asleep(level, reply, False)

    async def _fall_asleep(self, level: int, reply: Reply[None], resume: bool) -> None:
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

    async def _sleep_keeping(self, level: int, reply: Reply[None]) -> None:
        """vLLM's ``sleep(mode="keep")``: freeze every request (a KEEP pause), let the
        steps in flight land, then free the KV cache: running requests are preempted,
        to be recomputed from their tokens so far once ``wake_up`` brings the cache
        back (and ends the pause, unless one was set before)."""
        resume = not self.scheduler.is_paused
        self._emit(self.scheduler.pause(PauseMode.KEEP))
        await self._drain_sent()
        self.scheduler.reset_prefix_cache(True)
        self._resume_on_wake = self._resume_on_wake or resume
        self.sleeping = True
        try:
            await self.executor.call("sleep", level)
        except WorkerCallError as exc:
            reply(exc)
            return
        reply(None)

    async def _wake_up(self, tags: list[str] | None, reply: Reply[None]) -> None:
        try:
            await self.executor.call("wake_up", tags)
        except WorkerCallError as exc:
            reply(exc)
            return
        if tags is None or "kv_cache" in tags:
            self.sleeping = False
            if self._resume_on_wake:  # a sleep(mode="keep") froze the requests
                self._resume_on_wake = False
                self.scheduler.resume()
        reply(None)

    async def _answer_waiters(self) -> None:
        """Run the WAIT-mode pauses and sleeps once nothing is in flight."""
        if self._waiters and not self.scheduler.has_in_flight_requests():
            await self._drain_sent()
        while self._waiters and not self.scheduler.has_in_flight_requests():
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                await waiter()
