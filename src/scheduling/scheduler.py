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

from ..config import EngineConfig
from ..protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from .draft_policy import DraftLength, StepCost
from .pause_gate import PauseMode
from .request_book import RequestBook
from .request_state import Request, RequestStatus
from .step_assembly import STEP_FRAME_BUDGET, assemble_step, new_request_bytes
from .step_plan import InFlightStep, StepPlan
from .token_acceptance import accept_other, check_stop

__all__ = ["Scheduler"]


def _acceptance(req: Request, prior: float) -> float:
    """``req``'s recent share of drafts accepted (``prior`` before its first verification)."""
    return req.draft_length.acceptance(prior) if req.draft_length is not None else prior


class Scheduler(RequestBook):
    """Continuous batching, prefix caching, chunked prefill and preemption by recompute.

    Needs a resolved config (``max_model_len`` and ``num_kv_blocks`` set) in
    which one request of ``max_model_len`` tokens fits in the KV cache alone, so
    that preemption always lets the oldest request finish. The requests it holds,
    and adding, finishing, aborting and pausing them, are its ``RequestBook``'s.
    """

    def __init__(self, config: EngineConfig, kv_sliding_window: int | None = None) -> None:
        """``kv_sliding_window``: the window every layer of the model attends through,
        when all share one; blocks out of it are then released (see ``kv_cache``)."""
        super().__init__(config, kv_sliding_window)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.token_budget()
        self.chunked_prefill = config.enable_chunked_prefill
        self._in_flight: dict[int, InFlightStep] = {}  # planned steps not answered yet
        spec = config.speculative_config
        self.spec_config = spec
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        # A draft model's proposal costs a draft forward per draft: a request whose drafts
        # the latest decision left out gets none proposed (_proposal_limit), and still
        # counts in the next decision as holding its draft length's drafts (_next_drafts),
        # so that a probe brings its proposals back; failed probes back off. An n-gram
        # lookup costs next to nothing: its proposals are always made.
        self._costly_proposals = spec is not None and spec.method == "draft_model"
        # Without vLLM's batch-size settings, drafts are verified only while measured step
        # times say they pay (.draft_policy.StepCost), as many of each request's as its
        # allowance says (None: all); decided once per answered step.
        self.step_cost: StepCost | None = (
            StepCost(probes_back_off=self._costly_proposals)
            if spec is not None
            and spec.disable_by_batch_size is None
            and spec.num_speculative_tokens_per_batch_size is None
            else None
        )
        self._draft_allowance: dict[str, int] | None = None

    def has_drafts_to_verify(self) -> bool:
        """Whether a running request holds drafts (speculative decoding) for its next step.
        The engine core then plans no step ahead of the one in flight: a request with a
        sample in flight verifies no drafts. O(running)."""
        return self._max_drafts() > 0 and any(
            req.spec_token_ids and self._verifies_drafts(req) for req in self.running
        )

    def _verifies_drafts(self, req: Request) -> bool:
        """Whether measured step times let ``req`` verify drafts next step
        (:meth:`StepCost.allowances`; always, without them)."""
        allowance = self._draft_allowance
        return allowance is None or allowance.get(req.request_id, 0) > 0

    def _max_drafts(self) -> int:
        """The most drafts a request verifies at the current batch size (vLLM's
        ``disable_by_batch_size`` and ``num_speculative_tokens_per_batch_size``: at larger
        batches each draft costs more of a step)."""
        spec = self.spec_config
        if spec is None:
            return 0
        return spec.drafts_at(len(self.running))

    def _learn_step_cost(self, step: SchedulerOutput, seconds: float) -> None:
        """Record a decode step's measured time, then decide how many of each request's
        drafts the next step verifies (:class:`StepCost`), from each request's recent share
        of drafts accepted (the engine's recent share before its first verification)."""
        cost = self.step_cost
        if cost is None:
            return
        drafts = step.scheduled_spec_decode_tokens
        rows = step.total_num_scheduled_tokens
        if rows == len(step.num_scheduled_tokens) + sum(len(d) for d in drafts.values()):
            # decode rows only: no prefill chunk in the step
            cost.observe(len(step.num_scheduled_tokens), rows, seconds)
        holders = [(req, n) for req in self.running if (n := self._next_drafts(req))]
        prior = cost.prior()
        allowed = cost.allowances(
            len(self.running), [(n, _acceptance(req, prior)) for req, n in holders]
        )
        self._draft_allowance = (
            None
            if allowed is None
            else {req.request_id: n for (req, _), n in zip(holders, allowed, strict=True)}
        )

    def _next_drafts(self, req: Request) -> int:
        """The drafts ``req`` holds for its next step; with a draft model, also those its
        withheld proposal would have held (its draft length's limit; none while it backs
        off or before its first proposal)."""
        if req.spec_token_ids:
            return min(len(req.spec_token_ids), self.num_speculative_tokens)
        policy = req.draft_length
        if not self._costly_proposals or policy is None or policy.skip:
            return 0
        return policy.limit

    def _cap_proposal(
        self, plan: StepPlan, req: Request, samples_ahead: int, num_drafts: int
    ) -> None:
        """Put ``req``'s proposal limit (:meth:`_proposal_limit`) in ``plan.draft_limits``
        where it is below ``num_speculative_tokens``, the runner's default for a request not
        listed; nothing without speculative decoding."""
        k = self.num_speculative_tokens
        if k:
            limit = self._proposal_limit(req, samples_ahead, num_drafts)
            if limit < k:
                plan.draft_limits[req.request_id] = limit

    def _proposal_limit(self, req: Request, samples_ahead: int, num_drafts: int) -> int:
        """The most drafts ``req``'s draft length can admit of the proposal the runner
        makes after the sample being planned (``SchedulerOutput.draft_limits``): 0 while
        that sample still falls in a back-off (the ``samples_ahead`` samples in flight
        before it count the back-off down first), else its limit, one more when the step
        verifies ``num_drafts`` drafts (all of them accepted raises the limit). 0 while the
        running batch verifies no drafts (vLLM's ``disable_by_batch_size``); with a draft
        model, also while the latest decision leaves its drafts out (measured step times
        say they do not pay; a request not decided on yet, while that decision let none
        verify), one draft where it lets a request verify that this step verifies none
        (a probe, or drafts paying again: one draft says whether they are accepted), and
        at most one more than the step verifies (a probe's one draft, accepted, is followed
        by two, not by the draft length the request had before it was left out): a draft
        model's proposal costs a forward and a pass of its LM head per draft."""
        policy = req.draft_length
        k = self.num_speculative_tokens
        if not self._max_drafts():
            return 0
        allowance = self._draft_allowance
        cap = k
        if self._costly_proposals and allowance is not None:
            if req.request_id in allowance:
                if not allowance[req.request_id]:
                    return 0
                cap = min(k, num_drafts + 1)
            elif policy is not None or not any(allowance.values()):
                return 0
        if policy is None:
            return cap
        if policy.skip > samples_ahead:
            return 0
        return min(cap, policy.limit + (1 if num_drafts else 0))

    def _take_proposal(self, req: Request, proposal: list[int]) -> None:
        """Keep the drafts ``req`` verifies next out of the runner's ``proposal`` (made with
        its latest sample; it replaces older ones), as its draft length admits."""
        policy = req.draft_length
        if policy is None:
            policy = req.draft_length = DraftLength(self.num_speculative_tokens)
        req.spec_token_ids = policy.admit(proposal)

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
        if req.draft_length is not None:
            req.draft_length.settle(num_drafts, count - 1)
        if self.step_cost is not None:
            self.step_cost.settle(num_drafts, count - 1)

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
        max_drafts = self._max_drafts()
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
                if num_new == 1 and not placeholders:
                    room = min(budget, req.token_limit - num_tokens) - 1
                    num_drafts = max(0, min(len(drafts), room, max_drafts))
                    if num_drafts and self._draft_allowance is not None:
                        num_drafts = min(num_drafts, self._draft_allowance.get(req.request_id, 0))
                    if num_drafts and req.grammar is not None:
                        # Drafts its grammar refuses would be rejected: verify up to the first.
                        num_drafts = req.grammar.validate(drafts[:num_drafts])
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
                self._cap_proposal(plan, req, placeholders, num_drafts)
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
        frame_bytes = new_request_bytes(req, plan)
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
        if num_hit + num_new >= req.num_tokens:  # it samples
            self._cap_proposal(plan, req, 0, 0)
        return True

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        """Turn the plan into the runner's message (``assemble_step``) and remember the
        step until its answer comes."""
        step_id = self._step_id
        total = sum(plan.num_scheduled.values())
        if total == 0:
            return SchedulerOutput(step_id, [], CachedRequestData(), {}, 0)
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        output = assemble_step(step_id, plan, self.kv, finished, preempted)
        self.counters.prefill_tokens += total - plan.num_decode
        self.counters.decode_tokens += plan.num_decode
        self._in_flight[step_id] = InFlightStep(
            plan.running + plan.new,
            plan.samples,
            {rid: len(d) for rid, d in plan.spec_tokens.items()},
        )
        return output

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
            if sampling and self.num_speculative_tokens:
                self._take_proposal(req, proposed.get(request_id, []))
            if count == 1 and sampling and req.pooling_params is None:  # the common case
                token_id = sampled[start]
                all_ids = req.all_token_ids
                all_ids.append(token_id)
                req.output_token_ids.append(token_id)
                req.num_tokens_sent += 1  # the runner appended its own sample
                new_ids = [token_id]
                if token_id in req.stopping_token_ids or len(all_ids) >= req.token_limit:
                    reason = check_stop(req, token_id)
            else:
                new_ids, reason, pooled = accept_other(
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
        self._learn_step_cost(scheduler_output, runner_output.step_seconds)
        return EngineCoreOutputs(outputs, time.monotonic(), self.make_stats())
