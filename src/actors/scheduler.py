"""Continuous batching over the paged KV cache: the scheduler's policy, as a plain class.

:class:`Scheduler` decides, step by step, which requests compute how many
tokens, within the per-step budgets ``max_num_batched_tokens`` and
``max_num_seqs``. It holds the requests (:mod:`.request_state`) and drives the
block pool (:mod:`.kv_cache`); it never touches tensors. The scheduler actor
calls it synchronously, strictly alternating::

    out = scheduler.schedule()                     # SchedulerOutput for the runner
    runner_out = <model runner runs out>           # ModelRunnerOutput
    core_outs = scheduler.update_from_output(out, runner_out)

with :meth:`~Scheduler.add_request`, :meth:`~Scheduler.abort`,
:meth:`~Scheduler.finish_requests`, :meth:`~Scheduler.pause` /
:meth:`~Scheduler.resume` and :meth:`~Scheduler.reset_prefix_cache` allowed at
any point between those calls, including between ``schedule`` and
``update_from_output`` (results for requests finished or preempted in between
are dropped).

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

Ids the runner must drop ride in ``finished_req_ids`` / ``preempted_req_ids``
of the next step that schedules tokens (an empty step carries none, so the
caller may skip the runner for an empty step). The runner applies them before
``new_requests``: an id may be dropped and sent anew in the same step.

Pure Python, driven synchronously: never imports torch or trio.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal

from ..config import EngineConfig
from ..protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    PauseMode,
    SchedulerOutput,
    SchedulerStats,
)
from .kv_cache import KVCacheManager
from .request_state import Request, RequestStatus

__all__ = ["RequestQueue", "Scheduler"]


class RequestQueue:
    """Waiting requests in policy order: FCFS (a deque) or priority (a heap on ``sort_key``)."""

    def __init__(self, policy: Literal["fcfs", "priority"]) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def push(self, request: Request) -> None:
        """Queue a new arrival at its place in policy order."""
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (request.sort_key, request))

    def push_front(self, request: Request) -> None:
        """Requeue a preempted request: FCFS at the front; priority by its original key."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            heapq.heappush(self._heap, (request.sort_key, request))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][1]

    def pop(self) -> Request:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        return heapq.heappop(self._heap)[1]

    def remove(self, request_ids: set[str]) -> None:
        """Drop these requests (one pass over the queue)."""
        if self.policy == "fcfs":
            self._fifo = deque(r for r in self._fifo if r.request_id not in request_ids)
        else:
            self._heap = [item for item in self._heap if item[1].request_id not in request_ids]
            heapq.heapify(self._heap)

    def ordered(self) -> list[Request]:
        """A snapshot in the order requests would be taken. O(n log n) for priority."""
        if self.policy == "fcfs":
            return list(self._fifo)
        return [item[1] for item in sorted(self._heap)]

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Every queued request, in no particular order for the priority policy."""
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (item[1] for item in self._heap)


class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    __slots__ = ("budget", "new", "running", "num_scheduled", "new_block_ids")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.new: list[Request] = []
        self.running: list[Request] = []
        self.num_scheduled: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}


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
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # for the runner, with the next non-empty step
        self._preempted_ids: list[str] = []
        self._pause_mode: PauseMode | None = None
        self._pause_seq = 0  # requests with a later seq arrived during the pause: held
        self._num_held = 0
        self._step_id = 0
        self._seq = 0
        # Figures since the last make_stats().
        self._stat_preempted = 0
        self._stat_prefill_tokens = 0
        self._stat_decode_tokens = 0
        self._stat_queries_base = 0
        self._stat_hits_base = 0

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for an id already
        in flight, an empty prompt, or a prompt longer than ``max_model_len``."""
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
        req = Request(request, self._seq)
        self.requests[request_id] = req
        self.waiting.push(req)
        if self._pause_mode is not None:
            self._num_held += 1

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, running or paused (held ones included)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_in_flight_requests(self) -> bool:
        """Whether any unfinished request is not held by a pause.

        A pause in WAIT mode is complete when this turns False: everything added
        before the pause has finished, and what arrived since waits for resume().
        """
        return len(self.requests) > self._num_held

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
        elif self._is_held(req):
            self._num_held -= 1
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]

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
        if self._pause_mode is None:
            self._pause_seq = self._seq
            self._num_held = 0
        self._pause_mode = mode
        return outputs

    def abort_in_flight(self) -> list[EngineCoreOutput]:
        """Abort every unfinished request that a pause does not hold (as :meth:`abort` does).

        Held requests stay queued; they hold no blocks.
        """
        return self.abort([rid for rid, req in self.requests.items() if not self._is_held(req)])

    def resume(self) -> None:
        """Leave any pause; held requests start on the next step, in policy order."""
        self._pause_mode = None
        self._num_held = 0

    def _is_held(self, req: Request) -> bool:
        return self._pause_mode is not None and req.sort_key[2] > self._pause_seq

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def pause_mode(self) -> PauseMode | None:
        return self._pause_mode

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
        if self._pause_mode is PauseMode.KEEP or not self.requests:
            return SchedulerOutput(self._step_id, [], [], {}, 0)
        plan = _StepPlan(self.max_num_batched_tokens)
        preempted = self._schedule_running(plan)
        if not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            self._schedule_waiting(plan)
        return self._emit(plan)

    def _schedule_running(self, plan: _StepPlan) -> bool:
        """Give each running request its next tokens; preempt when blocks run out.

        Returns whether anything was preempted.
        """
        running = self.running
        kv = self.kv
        preempted = False
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            if num_new > plan.budget:
                if not self.chunked_prefill:
                    i += 1
                    continue
                num_new = plan.budget
            if num_new <= 0:
                i += 1
                continue
            new_ids = kv.allocate_slots(req, num_new)
            while new_ids is None:
                j = self._victim_index()
                victim = running.pop(j)
                preempted = True
                if victim.request_id in plan.num_scheduled:  # planned earlier this step
                    plan.budget += plan.num_scheduled.pop(victim.request_id)
                    plan.running.remove(victim)
                    del plan.new_block_ids[victim.request_id]
                self._preempt(victim)
                if victim is req:
                    return True
                if j < i:
                    i -= 1
                new_ids = kv.allocate_slots(req, num_new)
            plan.running.append(req)
            plan.num_scheduled[req.request_id] = num_new
            plan.new_block_ids[req.request_id] = new_ids
            plan.budget -= num_new
            i += 1
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
        req.num_preemptions += 1
        self.waiting.push_front(req)
        self._preempted_ids.append(req.request_id)
        self._stat_preempted += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in policy order until one does not fit."""
        if self._pause_mode is None:
            waiting = self.waiting
            while waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
                if not self._admit(waiting.peek(), plan):
                    return
                waiting.pop()
            return
        # Paused (WAIT / ABORT): requests that arrived during the pause are held.
        if len(self.waiting) == self._num_held:
            return  # every waiting request is held
        for req in [r for r in self.waiting.ordered() if not self._is_held(r)]:
            if plan.budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not self._admit(req, plan):
                return
            self.waiting.remove({req.request_id})

    def _admit(self, req: Request, plan: _StepPlan) -> bool:
        """Start (or resume) a waiting request from its prefix-cache hit, if it fits."""
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        num_new = req.num_tokens - num_hit
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
        plan.new.append(req)
        plan.num_scheduled[req.request_id] = num_new
        plan.budget -= num_new
        return True

    def _emit(self, plan: _StepPlan) -> SchedulerOutput:
        """Turn the plan into the runner's message and advance computed tokens."""
        step_id = self._step_id
        num_scheduled = plan.num_scheduled
        prefill = decode = 0
        new_data: list[NewRequestData] = []
        for req in plan.new:
            n = num_scheduled[req.request_id]
            new_data.append(
                NewRequestData(
                    req.request_id,
                    req.prompt_token_ids,
                    req.sampling_params,
                    self.kv.get_block_ids(req.request_id),
                    req.num_computed_tokens,
                    list(req.output_token_ids),
                )
            )
            req.num_tokens_sent = req.num_tokens
            req.num_computed_tokens += n
            req.scheduled_step = step_id
            prefill += n
        cached_data: list[CachedRequestData] = []
        new_block_ids = plan.new_block_ids
        for req in plan.running:
            request_id = req.request_id
            n = num_scheduled[request_id]
            sent = req.num_tokens_sent
            num_tokens = len(req.all_token_ids)
            cached_data.append(
                CachedRequestData(
                    request_id,
                    req.all_token_ids[sent:] if sent < num_tokens else [],
                    new_block_ids[request_id],
                    req.num_computed_tokens,
                )
            )
            req.num_tokens_sent = num_tokens
            if n == 1 and req.output_token_ids and req.num_computed_tokens == num_tokens - 1:
                decode += 1
            else:
                prefill += n
            req.num_computed_tokens += n
            req.scheduled_step = step_id
        total = prefill + decode
        if total == 0:
            return SchedulerOutput(step_id, [], [], {}, 0)
        self._stat_prefill_tokens += prefill
        self._stat_decode_tokens += decode
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        return SchedulerOutput(
            step_id, new_data, cached_data, num_scheduled, total, finished, preempted
        )

    # ----------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Accept the step's sampled tokens; finish requests that stopped.

        ``runner_output`` must hold one token for every scheduled request whose
        scheduled tokens reached the end of its known tokens (a ValueError
        otherwise: a runner that drops requests would hang them); tokens for a
        partial prefill chunk are ignored. Requests finished, aborted or
        preempted since ``schedule()`` are skipped. Returns one output per
        request that got tokens, prompt logprobs or finished, and the stats.
        """
        step_id = scheduler_output.step_id
        num_scheduled = scheduler_output.num_scheduled_tokens
        req_ids = runner_output.req_ids
        if len(req_ids) != len(runner_output.sampled_token_ids):
            raise ValueError(
                f"model runner returned {len(runner_output.sampled_token_ids)} samples "
                f"for {len(req_ids)} requests"
            )
        if len(req_ids) < len(num_scheduled):
            self._check_all_sampled(scheduler_output, runner_output)
        requests = self.requests
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        kv = self.kv
        block_size = kv.block_size
        prefix_caching = kv.enable_prefix_caching
        running = RequestStatus.RUNNING
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for request_id, tokens in zip(req_ids, runner_output.sampled_token_ids):
            req = requests.get(request_id)
            if req is None or req.status is not running or req.scheduled_step != step_id:
                continue  # finished, aborted or preempted since schedule()
            computed = req.num_computed_tokens
            reason: FinishReason | None = None
            if computed < len(req.all_token_ids):
                new_ids: list[int] = []  # a partial prefill chunk samples nothing
            elif len(tokens) == 1:
                token_id = tokens[0]
                req.output_token_ids.append(token_id)
                req.all_token_ids.append(token_id)
                new_ids = [token_id]
                reason = self._check_stop(req, token_id)
            elif tokens:
                new_ids, reason = self._append_tokens(req, tokens)
            else:
                raise ValueError(f"model runner returned no sampled token for {request_id!r}")
            # Publish blocks this step filled (a chunk of n tokens crossed a boundary).
            if prefix_caching and computed % block_size < num_scheduled[request_id]:
                kv.cache_full_blocks(req)
            plp = prompt_logprobs.get(request_id) if prompt_logprobs else None
            if new_ids or reason is not None or plp:
                lp = logprobs.get(request_id) if logprobs else None
                if lp is not None and len(lp) > len(new_ids):
                    lp = lp[: len(new_ids)]
                outputs.append(
                    EngineCoreOutput(
                        request_id,
                        new_ids,
                        lp,
                        plp,
                        reason,
                        req.stop_reason,
                        req.num_cached_tokens,
                    )
                )
            if reason is not None:
                self._release(req, reason, req.stop_reason)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        return EngineCoreOutputs(outputs, time.monotonic(), self.make_stats())

    def _check_all_sampled(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> None:
        """Raise ValueError if a scheduled request that must sample is missing."""
        returned = set(runner_output.req_ids)
        for request_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(request_id)
            if (
                request_id not in returned
                and req is not None
                and req.status is RequestStatus.RUNNING
                and req.scheduled_step == scheduler_output.step_id
                and req.num_computed_tokens >= len(req.all_token_ids)
            ):
                raise ValueError(f"model runner returned no sampled token for {request_id!r}")

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
        same token. Sets ``req.stop_reason`` to a matched stop token id.
        """
        num_output = len(req.output_token_ids)
        if num_output >= req.min_tokens:
            if token_id == req.eos_token_id and not req.ignore_eos:
                return FinishReason.STOP
            if token_id in req.stop_token_ids:
                req.stop_reason = token_id
                return FinishReason.STOP
        if len(req.all_token_ids) >= self.max_model_len or (
            req.max_tokens is not None and num_output >= req.max_tokens
        ):
            return FinishReason.LENGTH
        return None

    # -------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        """Current queue and cache figures, plus counts since the previous call.

        ``update_from_output`` calls it once per step, so the counts
        (prefix-cache queries / hits in tokens, preemptions, scheduled tokens)
        are normally one step's.
        """
        kv = self.kv
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_blocks_total=kv.num_usable_blocks,
            num_blocks_used=kv.num_used_blocks,
            prefix_cache_queries=kv.prefix_cache_queries - self._stat_queries_base,
            prefix_cache_hits=kv.prefix_cache_hits - self._stat_hits_base,
            num_preempted=self._stat_preempted,
            num_scheduled_tokens=self._stat_prefill_tokens + self._stat_decode_tokens,
            num_prefill_tokens=self._stat_prefill_tokens,
            num_decode_tokens=self._stat_decode_tokens,
        )
        self._stat_queries_base = kv.prefix_cache_queries
        self._stat_hits_base = kv.prefix_cache_hits
        self._stat_preempted = 0
        self._stat_prefill_tokens = 0
        self._stat_decode_tokens = 0
        return stats
