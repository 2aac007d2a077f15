"""The scheduler actor: the engine's step loop around the scheduler policy.

Each step it drains its inbox (new requests, aborts, control), asks the
``Scheduler`` for a plan, hands the plan to the executor, applies the runner's
output and sends the step's ``EngineCoreOutputs`` to the detokenizer. When
there is nothing to compute it waits on its inbox; it never spins.

Aborts and stop-string finishes that arrive while a step is running take
effect before the next step is planned, so an aborted request's KV blocks are
free within one step.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..protocol import messages as m
from ..protocol.errors import LegatoError
from .executor import Executor, WorkerCallError
from .scheduler import Scheduler
from .stats import StepStats

if TYPE_CHECKING:
    from ..structured.engine import EngineGrammars

logger = logging.getLogger("legato.engine")


@dataclass
class AddRequests:
    requests: list[m.EngineRequest]


@dataclass
class FinishRequests:
    """Requests the detokenizer finished (a stop string): free them, report nothing."""

    request_ids: list[str]


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


@dataclass
class EngineCore:
    """State of the scheduler actor; ``run`` is the actor."""

    scheduler: Scheduler
    executor: Executor
    outputs: trio.MemorySendChannel[m.EngineCoreOutputs]
    record_stats: Callable[[StepStats], None] | None = None
    grammars: EngineGrammars | None = None  # structured outputs (None: no request uses them)
    sleeping: bool = False
    _inbox_send: trio.MemorySendChannel[CoreMessage] = field(init=False)
    _inbox: trio.MemoryReceiveChannel[CoreMessage] = field(init=False)
    # What WAIT-mode pauses and sleeps do once nothing is in flight.
    _waiters: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    _arrivals: dict[str, float] = field(default_factory=dict)  # requests not yet scheduled

    def __post_init__(self) -> None:
        self._inbox_send, self._inbox = trio.open_memory_channel[CoreMessage](math.inf)
        self._idle = trio.Event()
        self._idle.set()
        self._stats_dirty = False
        self._stopped = False
        self._calls: set[_Call] = set()

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
            if not self._has_work():
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
            if self._has_work():
                await self._step()
            await self._answer_waiters()
            self._note_idle()
            await trio.lowlevel.checkpoint()

    def _has_work(self) -> bool:
        return not self.sleeping and self.scheduler.has_unfinished_requests()

    async def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.total_num_scheduled_tokens == 0 and not plan.finished_req_ids:
            # Nothing can run (frozen, or waiting on blocks only an abort can free):
            # wait for news instead of spinning.
            await self._handle(await self._inbox.receive())
            return
        now = time.monotonic()
        queue_times = []
        for new in plan.new_requests:  # also requests resumed after preemption: not queued
            arrival = self._arrivals.pop(new.request_id, None)
            if arrival is not None:
                queue_times.append(now - arrival)
        grammars = self.grammars
        failed: dict[str, str] = {}
        if grammars is not None:
            plan.grammar_bitmask, failed = grammars.bitmasks(plan, self.scheduler.requests)
        runner_out = await self.executor.execute(plan)
        core_out = self.scheduler.update_from_output(plan, runner_out)
        if grammars is not None:
            failed.update(grammars.accept(core_out.outputs, self.scheduler.requests))
            core_out.outputs += self.scheduler.fail(failed)  # those requests alone
        self._forget_finished(core_out.outputs)
        self.outputs.send_nowait(core_out)
        self._record(core_out.scheduler_stats, queue_times)

    def _record(
        self, stats: m.SchedulerStats | None, queue_times: list[float] | None = None
    ) -> None:
        """Publish the scheduler's figures (after a step, or after aborts freed blocks)."""
        self._stats_dirty = False
        if self.record_stats is not None:
            self.record_stats(
                StepStats(
                    timestamp=time.monotonic(),
                    scheduler=stats,
                    num_prompt_tokens=stats.num_prefill_tokens if stats is not None else 0,
                    queue_time=queue_times or [],
                )
            )

    def _forget_finished(self, outputs: list[m.EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self._arrivals.pop(out.request_id, None)

    def _emit(self, outputs: list[m.EngineCoreOutput]) -> None:
        if outputs:
            self._forget_finished(outputs)
            self.outputs.send_nowait(m.EngineCoreOutputs(outputs, time.monotonic(), None))

    async def _handle(self, message: CoreMessage) -> None:
        self._stats_dirty = True  # queues or blocks may have changed: publish before sleeping
        if isinstance(message, AddRequests):
            for request in message.requests:
                self._arrivals[request.request_id] = request.arrival_time
                self.scheduler.add_request(request)
        elif isinstance(message, m.AbortRequests):
            self._emit(self.scheduler.abort(message.request_ids))
        elif isinstance(message, FinishRequests):
            self.scheduler.finish_requests(message.request_ids, m.FinishReason.STOP)
            for request_id in message.request_ids:
                self._arrivals.pop(request_id, None)
        elif isinstance(message, Control):
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
        while self._waiters and not self.scheduler.has_in_flight_requests():
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                await waiter()
