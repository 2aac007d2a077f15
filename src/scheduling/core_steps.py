"""The engine core's synchronous step, shared by every driver, and its messages.

:class:`CoreSteps` is one step as plan -> execute -> apply: ``plan`` asks the
``Scheduler`` for the next step, the caller executes it (on a worker through
an executor, or in this thread for ``LLMEngine``), ``apply`` takes the
runner's output back into the scheduler (failures and grammars included) and
returns the step's ``EngineCoreOutputs``. ``AddRequests``, ``AbortRequests``
and ``FinishRequests`` are what the front end sends it.

Plain synchronous code that never awaits; never imports torch (trio comes in only
with ``stats``, whose actor sits beside the figures it records).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..metrics.records import StepStats
from ..protocol import messages as m
from .scheduler import Scheduler

if TYPE_CHECKING:
    from ..structured.engine import EngineGrammars, GrammarFailure
    from ..structured.grammar import GrammarState


@dataclass
class AddRequests:
    """Rendered requests for the scheduler, and the grammar states of the constrained
    ones by request id (structured outputs)."""

    requests: list[m.EngineRequest]
    grammars: dict[str, GrammarState] = field(default_factory=dict)


@dataclass
class AbortRequests:
    """Abort live requests: free them, and report each as finished with ABORT."""

    request_ids: list[str]


@dataclass
class FinishRequests:
    """Requests the front end finished (a stop string, a user's abort): free them,
    report nothing."""

    request_ids: list[str]
    reason: m.FinishReason = m.FinishReason.STOP


FrontendMessage = AddRequests | FinishRequests
"""What the front end sends the engine core."""


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

    def add_requests(
        self, requests: list[m.EngineRequest], grammars: dict[str, GrammarState] | None = None
    ) -> None:
        """Queue requests with their grammar states (by id); ValueError (that request
        not queued) as ``Scheduler.add_request``."""
        grammars = grammars or {}
        for request in requests:
            self.scheduler.add_request(request, grammars.get(request.request_id))
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
