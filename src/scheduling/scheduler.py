"""Continuous batching over the paged KV cache: the scheduler's policy, as a plain class.

:class:`Scheduler` decides, step by step, which requests compute how many
tokens, within the per-step budgets ``max_num_batched_tokens`` and
``max_num_seqs``. It holds the requests (:mod:`.request_state`) and drives the
block pool (:mod:`.kv_cache`); it never touches tensors. The engine core
calls it synchronously::

    out = scheduler.schedule()                     # SchedulerOutput for the runner
    runner_out = <model runner runs out>           # ModelRunnerOutput
    core_outs = scheduler.update_from_output(out, runner_out)

A step may be planned before the one in flight has answered (async
scheduling): a request whose planned tokens will sample counts that sample as
a *placeholder* token, so the next step can already compute it (the runner
fills it in with its own sample); when the answer comes, the placeholder
becomes the real token. Answers must be applied in step order, one per
planned step. :meth:`~Scheduler.add_request`, :meth:`~Scheduler.abort`,
:meth:`~Scheduler.finish_requests`, :meth:`~Scheduler.pause` /
:meth:`~Scheduler.resume` and :meth:`~Scheduler.reset_prefix_cache` are
allowed at any point between those calls (answers for requests finished or
preempted in between are dropped). A request whose in-flight samples could
already reach its ``max_tokens`` or ``max_model_len`` is not scheduled ahead.

Policy, as in vLLM v1:

* Running requests are scheduled first (decodes and unfinished prefill chunks),
  then waiting ones in policy order (FCFS: arrival; priority: lower value
  first, then arrival) while budget, ``max_num_seqs`` and free blocks allow. A
  waiting request that cannot be admitted blocks those behind it.
* A waiting request starts at its prefix-cache hit. With chunked prefill a
  prompt larger than the remaining budget is computed over several steps;
  without it, the prompt waits for a step with room for all of it.
* When a running request needs a block and none is free, the lowest-priority
  running request (FCFS: latest arrival; priority: highest value, then latest
  arrival) is preempted by recompute: its blocks are freed, its computed tokens
  reset to 0, and it goes back to the front of the waiting queue; when it runs
  again it is sent as ``NewRequestData`` with the tokens it had generated. A
  step that preempted admits no waiting request.

* At most ``max_loras`` distinct LoRA adapters run in one step (when
  ``enable_lora``): a waiting request whose adapter would be one too many
  waits like one that does not fit (:mod:`.lora_admission`).
* A pooling (embedding) request never starts from a prefix-cache hit (its
  pooler needs every prompt position) and finishes in the step that
  computes the end of its prompt, with the runner's pooled vector.

Ids the runner must drop ride in ``finished_req_ids`` / ``preempted_req_ids``
of the next step that schedules tokens (an empty step carries none, so the
caller may skip the runner for an empty step). The runner applies them before
``new_requests``: an id may be dropped and sent anew in the same step.

Pure Python, driven synchronously: never imports torch or trio.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..config import EngineConfig
from ..protocol import wire
from ..protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
    SchedulerStats,
)
from .kv_cache import KVCacheManager
from .lora_admission import AdapterLimit
from .pause_gate import PauseGate, PauseMode
from .request_queue import RequestQueue
from .request_state import Request, RequestStatus
from .scheduler_counters import SchedulerCounters
from .step_plan import InFlightStep, StepPlan

if TYPE_CHECKING:
    from ..structured.grammar import GrammarState

__all__ = ["STEP_FRAME_BUDGET", "Scheduler"]

# What the requests admitted in one step may add to its frame, in bytes (a quarter of
# the wire's limit): a step admits new requests until the next would pass it, and at
# least one. A request's own share is bounded by its prompt and the vocabulary.
STEP_FRAME_BUDGET = wire.MAX_FRAME_SIZE // 4


def _new_request_bytes(req: Request, plan: StepPlan) -> int:
    """An upper bound on the bytes ``req`` adds to a step frame as a new request."""
    size = 64 + 9 * (2 * len(req.all_token_ids) + 8)  # its tokens and block ids
    if all(other.runner_params is not req.runner_params for other in plan.new[-16:]):
        size += req.runner_params.estimated_size()  # a parent's children share one copy
    return size


class Scheduler:
    """Continuous batching, prefix caching, chunked prefill and preemption by recompute.

    Needs a resolved config (``max_model_len`` and ``num_kv_blocks`` set) in
    which one request of ``max_model_len`` tokens fits in the KV cache alone, so
    that preemption always lets the oldest request finish.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.max_model_len is None or config.num_kv_blocks is None:
            raise ValueError("config: max_model_len and num_kv_blocks must be resolved")
        usable_tokens = (config.num_kv_blocks - 1) * config.block_size
        if config.max_model_len > usable_tokens:
            raise ValueError(
                f"max_model_len: {config.max_model_len} tokens do not fit in "
                f"{config.num_kv_blocks - 1} usable KV blocks of {config.block_size}"
            )
        self.config = config
        self.max_model_len: int = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.adapter_limit = AdapterLimit(config.max_loras if config.enable_lora else None)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # for the runner, with the next non-empty step
        self._preempted_ids: list[str] = []
        self.pause_gate = PauseGate()
        self._step_id = 0
        self._seq = 0
        self._in_flight: dict[int, InFlightStep] = {}  # planned steps not answered yet
        self._num_constrained = 0  # unfinished requests with a grammar (structured outputs)
        self.counters = SchedulerCounters()  # figures since the last make_stats()

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest, grammar: GrammarState | None = None) -> None:
        """Queue a request (``grammar``: its structured outputs' state). Raises
        ValueError (and queues nothing) for an id already in flight, an empty prompt,
        or a prompt longer than ``max_model_len``."""
        request_id = request.request_id
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt_token_ids: must not be empty")
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {num_prompt} tokens exceed max_model_len={self.max_model_len}"
            )
        self._seq += 1
        req = Request(request, self._seq, self.max_model_len, grammar)
        self.requests[request_id] = req
        if req.grammar is not None:
            self._num_constrained += 1
        self.waiting.push(req)
        self.pause_gate.arrived()

    def has_drafts_to_verify(self) -> bool:
        """Whether a running request holds drafts (speculative decoding) for its next step.
        The engine core then plans no step ahead of the one in flight: a request with a
        sample in flight verifies no drafts. O(running)."""
        return any(req.spec_token_ids for req in self.running)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, running or paused (held ones included)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def has_constrained_requests(self) -> bool:
        """Whether any unfinished request has a grammar (structured outputs): when none
        does, the engine core skips the per-step grammar hooks."""
        return self._num_constrained > 0

    def has_in_flight_requests(self) -> bool:
        """Whether any unfinished request is not held by a pause.

        A pause in WAIT mode is complete when this turns False: everything added
        before the pause has finished, and what arrived since waits for resume().
        """
        return len(self.requests) > self.pause_gate.num_held

    def finish_requests(
        self, request_ids: str | Iterable[str], finish_reason: FinishReason
    ) -> list[str]:
        """Finish live requests at once (e.g. a stop string the detokenizer found).

        Frees their blocks now; the runner hears of them in the next step's
        ``finished_req_ids``. Unknown or already finished ids are ignored.
        Returns the ids actually finished. Produces no output: the caller
        already knows.
        """
        return [r.request_id for r in self._finish_many(request_ids, finish_reason)]

    def abort(self, request_ids: str | Iterable[str]) -> list[EngineCoreOutput]:
        """Abort requests: like :meth:`finish_requests` with ``FinishReason.ABORT``.

        Idempotent. Returns one output (no tokens, ``finish_reason=ABORT``) per
        request that was live, so the engine can end the streams still listening.
        """
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ABORT,
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in self._finish_many(request_ids, FinishReason.ABORT)
        ]

    def fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish live requests with ``FinishReason.ERROR`` and their message (one request's
        grammar failed, say); one output each. Unknown or finished ids are ignored."""
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ERROR,
                num_cached_tokens=max(r.num_cached_tokens, 0),
                error=errors[r.request_id],
            )
            for r in self._finish_many(list(errors), FinishReason.ERROR)
        ]

    def _finish_many(
        self, request_ids: str | Iterable[str], finish_reason: FinishReason
    ) -> list[Request]:
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        finished: list[Request] = []
        waiting_ids: set[str] = set()
        any_running = False
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                any_running = True
            else:
                waiting_ids.add(request_id)
            self._release(req, finish_reason)
            finished.append(req)
        if any_running:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if waiting_ids:
            self.waiting.remove(waiting_ids)
        return finished

    def _release(
        self, req: Request, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Mark finished and free the blocks; the caller removes it from its queue."""
        if req.status is RequestStatus.RUNNING:
            self._finished_ids.append(req.request_id)
        else:
            self.pause_gate.left(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        if req.grammar is not None:
            self._num_constrained -= 1

    # ---------------------------------------------------------- pausing

    def pause(self, mode: PauseMode) -> list[EngineCoreOutput]:
        """Pause generation until :meth:`resume`. Returns the abort outputs (ABORT mode).

        * ``ABORT``: abort every unfinished request now (returned as by :meth:`abort`).
        * ``WAIT``: requests added before the pause run to completion (waiting
          ones are still started); requests added during it are held.
        * ``KEEP``: freeze: :meth:`schedule` returns empty steps; nothing is lost.

        Requests added during a pause are *held*: queued, not started until
        :meth:`resume` (see :meth:`has_in_flight_requests`). Pausing again while
        paused changes the mode and keeps the first pause's boundary.
        """
        outputs = self.abort(list(self.requests)) if mode is PauseMode.ABORT else []
        self.pause_gate.pause(mode, self._seq)
        return outputs

    def abort_in_flight(self) -> list[EngineCoreOutput]:
        """Abort every unfinished request that a pause does not hold (as :meth:`abort` does).

        Held requests stay queued; they hold no blocks.
        """
        held = self.pause_gate.is_held
        return self.abort([rid for rid, req in self.requests.items() if not held(req)])

    def resume(self) -> None:
        """Leave any pause; held requests start on the next step, in policy order."""
        self.pause_gate.resume()

    @property
    def is_paused(self) -> bool:
        return self.pause_gate.mode is not None

    @property
    def pause_mode(self) -> PauseMode | None:
        return self.pause_gate.mode

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix. Returns whether the cache was reset.

        Refuses (False) while a request holds blocks, unless
        ``reset_running_requests``: then every running request is first
        preempted (its blocks freed, recomputed later from scratch, so nothing
        reads stale cache) and the reset always succeeds.
        """
        if reset_running_requests and self.running:
            for req in reversed(self.running):
                self._preempt(req)
            self.running = []
        return self.kv.reset_prefix_cache(reset_running_requests)

    # --------------------------------------------------------- scheduling

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Never blocks; O(running + admitted) apart from preemptions.

        Every scheduled request's ``num_computed_tokens`` is advanced by its
        scheduled tokens here, in anticipation of the step.
        """
        self._step_id += 1
        if self.pause_gate.mode is PauseMode.KEEP or not self.requests:
            return SchedulerOutput(self._step_id, [], CachedRequestData(), {}, 0)
        plan = StepPlan(self.max_num_batched_tokens)
        preempted = self._schedule_running(plan)
        if not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            self._schedule_waiting(plan)
        return self._emit(plan)

    def _schedule_running(self, plan: StepPlan) -> bool:
        """Give each running request its next tokens, advancing its computed tokens (and
        placeholders) at once; preempt when blocks run out. Returns whether anything
        was preempted.
        """
        running = self.running
        kv = self.kv
        chunked_prefill = self.chunked_prefill
        planned, computed_at, samples = plan.running, plan.computed, plan.samples
        num_scheduled = plan.num_scheduled
        budget = plan.budget
        num_decode = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            placeholders = req.num_output_placeholders
            num_tokens = len(req.all_token_ids)
            num_known = num_tokens + placeholders  # with the samples in flight
            if placeholders and num_known >= req.token_limit:
                # The samples already on their way may reach its length limit (a pooling
                # request is done once its prompt is computed). A request with a grammar
                # does not wait: its bitmask row is only needed at sampling time, and the
                # engine core sends it once the token in flight is known.
                continue
            computed = req.num_computed_tokens
            num_new = num_known - computed
            if num_new > budget:
                if not chunked_prefill:
                    continue
                num_new = budget
            if num_new <= 0:
                continue
            drafts = req.spec_token_ids
            num_drafts = 0
            if drafts:  # speculative decoding: a plain decode verifies its drafts
                req.spec_token_ids = []
                if num_new == 1 and not placeholders and req.grammar is None:
                    num_drafts = max(
                        0, min(len(drafts), budget - 1, req.token_limit - num_tokens - 1)
                    )
                    num_new += num_drafts
            if computed + num_new > req.num_kv_slots:  # its blocks are full: it needs more
                new_ids = kv.allocate_slots(req, num_new)
                while new_ids is None:
                    j = self._victim_index()
                    victim = running.pop(j)
                    preempted = True
                    if victim.request_id in num_scheduled:  # planned earlier this step
                        budget += plan.drop(victim)
                    self._preempt(victim)
                    if victim is req:
                        break
                    if j < i:
                        i -= 1
                    new_ids = kv.allocate_slots(req, num_new)
                if new_ids is None:
                    break  # it was preempted itself
                if new_ids:
                    plan.new_block_ids[req.request_id] = new_ids
            planned.append(req)
            if num_drafts:
                plan.spec_tokens[req.request_id] = drafts[:num_drafts]
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            computed_at.append(computed)
            sent = req.num_tokens_sent
            if sent < num_tokens:
                plan.new_token_ids[req.request_id] = req.all_token_ids[sent:]
                req.num_tokens_sent = num_tokens
            req.num_computed_tokens = computed + num_new
            sampling = computed + num_new >= num_known
            if sampling:
                req.num_output_placeholders = placeholders + 1
                if num_new - num_drafts == 1 and (placeholders or req.output_token_ids):
                    num_decode += num_new
            samples.append(sampling)
        plan.budget = budget
        plan.num_decode += num_decode  # less those dropped since
        return preempted

    def _victim_index(self) -> int:
        """Index in ``running`` of the request to preempt: the lowest priority."""
        running = self.running
        if self.waiting.policy == "priority":
            return max(range(len(running)), key=lambda k: running[k].sort_key)
        return max(range(len(running)), key=lambda k: running[k].sort_key[1:])

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and requeue it for recompute.

        The caller removes it from ``running``.
        """
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_tokens_sent = 0
        req.num_output_placeholders = 0
        req.spec_token_ids = []
        req.reset_step = self._step_id  # answers of steps planned up to now are stale
        req.num_preemptions += 1
        self.waiting.push_front(req)
        self._preempted_ids.append(req.request_id)
        self.counters.preempted += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in policy order until one does not fit."""
        gate = self.pause_gate
        if gate.mode is None:
            waiting = self.waiting
            while waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
                if not self._admit(waiting.peek(), plan):
                    return
                waiting.pop()
            return
        # Paused (WAIT / ABORT): requests that arrived during the pause are held.
        if len(self.waiting) == gate.num_held:
            return  # every waiting request is held
        for req in [r for r in self.waiting.ordered() if not gate.is_held(r)]:
            if plan.budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not self._admit(req, plan):
                return
            self.waiting.remove({req.request_id})

    def _admit(self, req: Request, plan: StepPlan) -> bool:
        """Start (or resume) a waiting request from its prefix-cache hit, if it fits."""
        if not self.adapter_limit.admits(req, self.running):
            return False
        if req.pooling_params is None:
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        else:
            hit_blocks, num_hit = [], 0
        num_new = req.num_tokens - num_hit
        frame_bytes = _new_request_bytes(req, plan)
        if plan.new and plan.frame_bytes + frame_bytes > STEP_FRAME_BUDGET:
            return False  # the step's frame is full: it starts in the next step
        if num_new > plan.budget:
            if not self.chunked_prefill:
                return False
            num_new = plan.budget
        if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
            return False
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        self.running.append(req)
        plan.frame_bytes += frame_bytes
        plan.new.append(req)
        plan.num_scheduled[req.request_id] = num_new
        plan.budget -= num_new
        return True

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        """Turn the plan into the runner's message; advance the admitted requests' computed
        tokens (the running ones were advanced as they were planned)."""
        step_id = self._step_id
        num_scheduled = plan.num_scheduled
        total = sum(num_scheduled.values())
        if total == 0:
            return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0)
        samples = plan.samples
        new_data: list[NewRequestData] = []
        running = plan.running
        cached_ids = [req.request_id for req in running]
        # Each distinct RunnerSamplingParams once (n children share one), named by the
        # first request that uses it.
        params_keys: dict[int, str] = {}
        params_table: dict[str, RunnerSamplingParams] = {}
        for req in plan.new:  # admitted (or resumed) this step: after the running ones
            n = num_scheduled[req.request_id]
            params_key = params_keys.get(id(req.runner_params))
            if params_key is None:
                params_key = params_keys[id(req.runner_params)] = req.request_id
                params_table[params_key] = req.runner_params
            new_data.append(
                NewRequestData(
                    req.request_id,
                    req.prompt_token_ids,
                    params_key,
                    self.kv.get_block_ids(req.request_id),
                    req.num_computed_tokens,
                    list(req.output_token_ids),
                    req.lora_request,
                    req.pooling_params,
                    req.seed,
                )
            )
            req.num_tokens_sent = req.num_tokens
            req.num_computed_tokens += n
            sampling = req.num_computed_tokens >= req.num_tokens
            if sampling:
                req.num_output_placeholders = 1
            samples.append(sampling)
        counters = self.counters
        counters.prefill_tokens += total - plan.num_decode
        counters.decode_tokens += plan.num_decode
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        spec_tokens = plan.spec_tokens
        self._in_flight[step_id] = InFlightStep(
            running + plan.new, samples, {rid: len(d) for rid, d in spec_tokens.items()}
        )
        cached = CachedRequestData(
            cached_ids, plan.computed, plan.new_block_ids, plan.new_token_ids
        )
        return SchedulerOutput(
            step_id,
            new_data,
            cached,
            num_scheduled,
            total,
            finished,
            preempted,
            sampling_params=params_table,
            scheduled_spec_decode_tokens=spec_tokens,
        )

    # ----------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Accept a step's sampled tokens; finish requests that stopped.

        Answers must come in step order, one per non-empty step planned (an
        empty step's answer is accepted and changes nothing).
        ``runner_output`` must hold one entry per scheduled request, and one
        token for every request whose scheduled tokens reached the end of its
        tokens (a ValueError otherwise: a runner that drops requests would hang
        them); tokens for a partial prefill chunk are ignored. Requests
        finished, aborted or preempted since that step was planned are
        skipped. Returns one output per request that got tokens, prompt
        logprobs or finished, and the stats.
        """
        step_id = scheduler_output.step_id
        in_flight = self._in_flight.pop(step_id, None)
        if in_flight is None:
            if scheduler_output.is_empty:  # nothing was planned: nothing to accept
                return EngineCoreOutputs([], time.monotonic(), self.make_stats())
            raise ValueError(f"step {step_id} was not planned, or was answered already")
        num_sampled = runner_output.num_sampled
        sampled = runner_output.sampled_token_ids
        if len(num_sampled) != len(in_flight.requests) or len(runner_output.req_ids) != len(
            num_sampled
        ):
            raise ValueError(
                f"model runner returned {len(num_sampled)} sample counts for "
                f"{len(runner_output.req_ids)} ids; step {step_id} scheduled "
                f"{len(in_flight.requests)} requests"
            )
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        num_drafts_of = in_flight.num_drafts
        proposed = runner_output.spec_token_ids
        kv = self.kv
        prefix_caching = kv.enable_prefix_caching
        block_size = kv.block_size
        running = RequestStatus.RUNNING
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        append_output = outputs.append
        # The requests' tokens follow each other in ``sampled``: each one's start.
        starts = itertools.accumulate(num_sampled, initial=0)
        for req, sampling, count, start in zip(
            in_flight.requests, in_flight.samples, num_sampled, starts
        ):
            if step_id <= req.reset_step:
                continue  # preempted since: its placeholders are gone already
            if sampling:
                req.num_output_placeholders -= 1
            if req.status is not running:
                continue  # finished or aborted since this step was planned
            request_id = req.request_id
            reason: FinishReason | None = None
            pooled: list[float] | None = None
            if num_drafts_of:
                self._settle_drafts(req, num_drafts_of.get(request_id, 0), count)
            if proposed or req.spec_token_ids:  # the latest proposal replaces older ones
                req.spec_token_ids = proposed.get(request_id, [])
            if count == 1 and sampling and req.pooling_params is None:  # the common case
                token_id = sampled[start]
                all_ids = req.all_token_ids
                all_ids.append(token_id)
                req.output_token_ids.append(token_id)
                req.num_tokens_sent += 1  # the runner appended its own sample
                new_ids = [token_id]
                if token_id in req.stopping_token_ids or len(all_ids) >= req.token_limit:
                    reason = self._check_stop(req, token_id)
            else:
                new_ids, reason, pooled = self._accept_other(
                    req, sampling, sampled[start : start + count], runner_output
                )
            # Publish the blocks whose KV is computed (or being computed), if a block filled.
            if (
                prefix_caching
                and req.num_computed_tokens >= (req.num_cached_blocks + 1) * block_size
            ):
                kv.cache_full_blocks(req)
            plp = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if new_ids or reason is not None or plp:
                lp = logprobs.get(request_id) if logprobs else None
                if lp is not None and len(lp) > len(new_ids):
                    lp = lp[: len(new_ids)]
                append_output(
                    EngineCoreOutput(
                        request_id,
                        new_ids,
                        lp,
                        plp,
                        reason,
                        req.stop_reason,
                        req.num_cached_tokens,
                        pooled=pooled,
                    )
                )
            if reason is not None:
                self._release(req, reason, req.stop_reason)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        return EngineCoreOutputs(outputs, time.monotonic(), self.make_stats())

    def _settle_drafts(self, req: Request, num_drafts: int, count: int) -> None:
        """A verified request's answer: ``count - 1`` of its ``num_drafts`` drafts were
        accepted; its computed tokens come back past the rejected ones (their KV slots
        are rewritten by its next step), and the figures count them."""
        if not num_drafts:
            return
        if not 1 <= count <= num_drafts + 1:
            raise ValueError(
                f"model runner returned {count} tokens for {req.request_id!r}, "
                f"which verified {num_drafts} drafts"
            )
        req.num_computed_tokens -= num_drafts - (count - 1)
        self.counters.verified(num_drafts, count - 1)

    def _accept_other(
        self, req: Request, sampling: bool, tokens: list[int], runner_output: ModelRunnerOutput
    ) -> tuple[list[int], FinishReason | None, list[float] | None]:
        """A live request's answer other than one sampled token: a partial prefill chunk
        (nothing), a pooling request's vector (it finishes), or several tokens. Returns the
        accepted tokens, why it stops (if it does) and the pooled vector."""
        request_id = req.request_id
        if not sampling:
            return [], None, None  # a partial prefill chunk samples nothing
        if req.pooling_params is not None:
            pooled = runner_output.pooled.get(request_id)
            if pooled is None:
                raise ValueError(f"model runner returned no pooled vector for {request_id!r}")
            return [], FinishReason.STOP, pooled
        if not tokens:
            raise ValueError(f"model runner returned no sampled token for {request_id!r}")
        new_ids, reason = self._append_tokens(req, tokens)
        req.num_tokens_sent += len(new_ids)
        return new_ids, reason, None

    def _append_tokens(
        self, req: Request, tokens: list[int]
    ) -> tuple[list[int], FinishReason | None]:
        """Accept several sampled tokens, up to the first that stops the request."""
        new_ids: list[int] = []
        for token_id in tokens:
            req.append_output_token(token_id)
            new_ids.append(token_id)
            reason = self._check_stop(req, token_id)
            if reason is not None:
                return new_ids, reason
        return new_ids, None

    def _check_stop(self, req: Request, token_id: int) -> FinishReason | None:
        """Why the request stops after accepting ``token_id``, if it does.

        EOS (unless ``ignore_eos``) and stop token ids count only once
        ``min_tokens`` outputs exist; they win over a length limit reached by the
        same token. Sets ``req.stop_reason`` to a matched stop token id. Only a token in
        ``req.stopping_token_ids`` or reaching ``req.token_limit`` can stop it.
        """
        num_output = len(req.output_token_ids)
        if num_output >= req.min_tokens:
            if token_id == req.eos_token_id and not req.ignore_eos:
                return FinishReason.STOP
            if token_id in req.stop_token_ids:
                req.stop_reason = token_id
                return FinishReason.STOP
        if len(req.all_token_ids) >= req.token_limit:  # max_tokens, or max_model_len reached
            return FinishReason.LENGTH
        return None

    # -------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        """Current queue and cache figures, plus counts since the previous call.

        ``update_from_output`` calls it once per step, so the counts
        (prefix-cache queries / hits in tokens, preemptions, scheduled tokens)
        are normally one step's.
        """
        stats = self.counters.report(len(self.running), len(self.waiting), self.kv)
        if self.config.enable_lora:
            stats.running_lora_adapters = _requests_per_adapter(self.running)
            stats.waiting_lora_adapters = _requests_per_adapter(self.waiting)
        return stats


def _requests_per_adapter(requests: Iterable[Request]) -> dict[str, int]:
    """How many of ``requests`` run through each LoRA adapter, by adapter name."""
    counts: dict[str, int] = {}
    for req in requests:
        if req.lora_request is not None:
            name = req.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
