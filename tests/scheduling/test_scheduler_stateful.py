"""Stateful property test: random add / abort / finish / step / pause / resume / reset
sequences against the scheduler, with a fake runner sampling from a seeded RNG.

After every rule the block pool must be consistent (reference counts equal
holders, a block is shared only through equal prefix hashes, free + used =
total, nothing held when nothing runs); every step respects the token budget
and ``max_num_seqs``; the runner's mirror of each request matches the
scheduler's; and at teardown every request finishes within a bound.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from legato.config import EngineConfig
from legato.protocol.messages import (
    EngineCoreOutput,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from legato.protocol.params import SamplingParams
from legato.scheduling.pause_gate import PauseMode
from legato.scheduling.request_state import RequestStatus
from legato.scheduling.scheduler import Scheduler

EOS = 1
STOP = 2
PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 13, 14, 15, 16], [20, 21, 22, 23]]


@dataclass
class _Mirror:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """The runner's copy of each request, rebuilt from the scheduler's messages only."""

    block_size: int
    rng: random.Random
    reqs: dict[str, _Mirror] = field(default_factory=dict)

    def sample(self) -> int:
        roll = self.rng.random()
        if roll < 0.08:
            return EOS
        if roll < 0.16:
            return STOP
        return self.rng.randrange(3, 10)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.reqs.pop(request_id, None)
        for new in out.new_requests:
            assert new.request_id not in self.reqs, "sent as new while the runner holds it"
            self.reqs[new.request_id] = _Mirror(
                [*new.prompt_token_ids, *new.output_token_ids],
                new.num_computed_tokens,
                list(new.block_ids),
            )
        cached = out.cached_requests
        assert set(cached.new_token_ids) | set(cached.new_block_ids) <= set(cached.req_ids)
        for request_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            mirror = self.reqs[request_id]
            assert mirror.num_computed == num_computed
            mirror.tokens += cached.new_token_ids.get(request_id, [])
            mirror.block_ids += cached.new_block_ids.get(request_id, [])
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for request_id, n in out.num_scheduled_tokens.items():
            mirror = self.reqs[request_id]
            assert n > 0 and mirror.num_computed + n <= len(mirror.tokens)
            mirror.num_computed += n
            assert len(mirror.block_ids) * self.block_size >= mirror.num_computed
            req_ids.append(request_id)
            if mirror.num_computed == len(mirror.tokens):
                token = self.sample()
                mirror.tokens.append(token)  # a runner keeps its own samples
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput.from_lists(out.step_id, req_ids, sampled)


class SchedulerMachine(RuleBasedStateMachine):
    sched: Scheduler
    runner: FakeRunner
    config: EngineConfig

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, EngineRequest] = {}  # every request ever added
        self.streamed: dict[str, list[int]] = {}
        self.done: dict[str, FinishReason] = {}
        self.count = 0

    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(6, 20),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(3, 20),
        prefix_caching=st.booleans(),
        chunked=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        budget: int,
        prefix_caching: bool,
        chunked: bool,
        policy: str,
        seed: int,
    ) -> None:
        max_model_len = min(24, (num_blocks - 1) * block_size)
        if not chunked:
            budget = max(budget, max_model_len)
        self.config = EngineConfig(
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=prefix_caching,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,  # type: ignore[arg-type]
        )
        self.sched = Scheduler(self.config)
        self.runner = FakeRunner(block_size, random.Random(seed))

    # ------------------------------------------------------------- helpers

    def live(self) -> list[str]:
        return list(self.sched.requests)

    def record(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            request_id = out.request_id
            assert request_id not in self.done, f"output after the end of {request_id}"
            self.streamed.setdefault(request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.done[request_id] = out.finish_reason
                self.check_finish(request_id, out)

    def check_finish(self, request_id: str, out: EngineCoreOutput) -> None:
        request = self.params[request_id]
        params = request.sampling_params
        tokens = self.streamed[request_id]
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops.add(EOS)
        if out.finish_reason is FinishReason.LENGTH:
            total = len(request.prompt_token_ids) + len(tokens)
            limit = max(self.config.max_model_len, len(request.prompt_token_ids) + 1)
            assert len(tokens) == params.max_tokens or total == limit
        elif out.finish_reason is FinishReason.STOP:
            assert len(tokens) >= params.min_tokens
            last = tokens[-1]
            if out.stop_reason is None:
                assert last == EOS and not params.ignore_eos
            else:
                assert last == out.stop_reason and last in (params.stop_token_ids or ())
        # No stop was missed: before the last token, a stop token appears only
        # while min_tokens held it back.
        for count, token in enumerate(tokens[:-1], start=1):
            assert token not in stops or count < params.min_tokens

    def finish_externally(self, ids: list[str], reason: FinishReason) -> None:
        for request_id in ids:
            assert request_id not in self.done
            self.done[request_id] = reason

    # --------------------------------------------------------------- rules

    @rule(
        prefix=st.integers(0, len(PREFIXES)),
        prefix_len=st.sampled_from([0, 2, 4, 8, 8, 8]),
        suffix=st.lists(st.integers(3, 30), max_size=8),
        max_tokens=st.none() | st.integers(1, 8),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop=st.booleans(),
        priority=st.integers(0, 3),
        salt=st.sampled_from([None, None, "s"]),
        copies=st.integers(1, 3),
    )
    def add(
        self,
        prefix: int,
        prefix_len: int,
        suffix: list[int],
        max_tokens: int | None,
        min_tokens: int,
        ignore_eos: bool,
        stop: bool,
        priority: int,
        salt: str | None,
        copies: int,
    ) -> None:
        """Add ``copies`` requests sharing a prompt head (the copies differ at the end)."""
        head = PREFIXES[prefix][:prefix_len] if prefix < len(PREFIXES) else []
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)
        for copy in range(copies):
            prompt = (head + suffix + [3] * copy)[: self.config.max_model_len] or [3]
            self.count += 1
            request = EngineRequest(
                request_id=f"r{self.count}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(
                    max_tokens=max_tokens,
                    min_tokens=min_tokens,
                    ignore_eos=ignore_eos,
                    stop_token_ids=[STOP] if stop else None,
                ),
                arrival_time=float(self.count),
                priority=priority + copy,
                eos_token_id=EOS,
                cache_salt=salt,
            )
            self.params[request.request_id] = request
            self.sched.add_request(request)

    @precondition(lambda self: self.params)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from([*self.params, "unknown"]), max_size=3))
        expected = [i for i in dict.fromkeys(ids) if i in self.sched.requests]
        outputs = self.sched.abort(ids)
        assert [o.request_id for o in outputs] == expected
        assert all(o.finish_reason is FinishReason.ABORT and not o.new_token_ids for o in outputs)
        self.record(outputs)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def finish_by_stop_string(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self.live()))
        finished = self.sched.finish_requests([request_id], FinishReason.STOP)
        assert finished == [request_id]
        self.finish_externally(finished, FinishReason.STOP)

    @rule(
        times=st.integers(1, 4),
        between=st.sampled_from(["none", "none", "none", "abort", "reset", "keep"]),
    )
    def step(self, times: int, between: str) -> None:
        for i in range(times):
            self.do_step(between if i == times - 1 else "none")

    @rule(
        times=st.integers(1, 4),
        between=st.sampled_from(["none", "none", "abort", "reset", "keep", "stop"]),
    )
    def overlapped_steps(self, times: int, between: str) -> None:
        """Async scheduling: each step is planned (and run) before the previous one's
        answer is applied; ``between`` happens while two steps are in flight."""
        sched = self.sched
        in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        for i in range(times + 1):
            if i < times:
                plan = sched.schedule()
                self.check_plan(plan)
                in_flight.append((plan, self.runner.execute(plan)))
            if i == times - 1:
                self.between(between)
            if len(in_flight) == 2 or i == times:
                self.apply(*in_flight.pop(0))

    @rule(mode=st.sampled_from(list(PauseMode)))
    def pause(self, mode: PauseMode) -> None:
        before = self.live()
        outputs = self.sched.pause(mode)
        if mode is PauseMode.ABORT:
            assert sorted(o.request_id for o in outputs) == sorted(before)
            assert not self.sched.has_unfinished_requests()
        else:
            assert outputs == []
        self.record(outputs)
        assert self.sched.is_paused

    @rule()
    def resume(self) -> None:
        self.sched.resume()
        assert not self.sched.is_paused

    @rule(reset_running=st.booleans())
    def reset_prefix_cache(self, reset_running: bool) -> None:
        held = self.sched.kv.num_used_blocks > 0
        assert self.sched.reset_prefix_cache(reset_running) is (reset_running or not held)
        if reset_running:
            assert not self.sched.running and self.sched.kv.num_cached_free_blocks == 0

    def do_step(self, between: str = "none") -> None:
        plan = self.sched.schedule()
        self.check_plan(plan)
        runner_out = self.runner.execute(plan)
        self.between(between)
        self.apply(plan, runner_out)

    def check_plan(self, plan: SchedulerOutput) -> None:
        sched = self.sched
        config = self.config
        assert plan.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
        if plan.is_empty:
            assert not plan.finished_req_ids and not plan.preempted_req_ids
        for request_id in plan.num_scheduled_tokens:
            assert sched.requests[request_id].status is RequestStatus.RUNNING
        for request_id in plan.finished_req_ids:
            assert request_id not in sched.requests or request_id in [
                n.request_id for n in plan.new_requests
            ]

    def between(self, between: str) -> None:
        """Something that happens while a step is in flight."""
        sched = self.sched
        if between == "abort" and sched.requests:
            self.record(sched.abort(self.live()[:1]))
        elif between == "stop" and sched.requests:
            ids = self.live()[-1:]
            assert sched.finish_requests(ids, FinishReason.STOP) == ids
            self.finish_externally(ids, FinishReason.STOP)
        elif between == "reset":
            assert sched.reset_prefix_cache(reset_running_requests=True)
        elif between == "keep":
            sched.pause(PauseMode.KEEP)

    def apply(self, plan: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        sched = self.sched
        config = self.config
        result = sched.update_from_output(plan, runner_out)
        for out in result.outputs:
            assert out.request_id in plan.num_scheduled_tokens
        self.record(result.outputs)
        stats = result.scheduler_stats
        assert stats is not None
        assert stats.num_running == len(sched.running) <= config.max_num_seqs
        assert stats.num_blocks_used + sched.kv.num_free_blocks == stats.num_blocks_total

    # ---------------------------------------------------------- invariants

    @invariant()
    def block_pool_is_consistent(self) -> None:
        sched = self.sched
        kv = sched.kv
        size = kv.block_size
        holders: dict[int, list[tuple[str, int]]] = {}
        for request_id, blocks in kv.holders().items():
            req = sched.requests[request_id]
            assert req.status is RequestStatus.RUNNING
            assert len(blocks) * size >= req.num_computed_tokens
            # The figures the scheduler reads instead of asking the manager each step.
            assert req.num_kv_slots == len(blocks) * size
            assert req.num_cached_blocks <= req.num_computed_tokens // size
            for position, block in enumerate(blocks):
                holders.setdefault(block.block_id, []).append((request_id, position))
                if block.block_hash is not None:
                    assert block.block_hash == req.block_hashes[position]
        assert 0 not in holders and kv.blocks[0].ref_cnt == 0
        for block in kv.blocks:
            assert block.ref_cnt == len(holders.get(block.block_id, ()))
            if block.block_hash is not None:
                assert kv.lookup(block.block_hash) is block
        for block_id, held_by in holders.items():
            if len(held_by) > 1:
                block = kv.blocks[block_id]
                assert block.block_hash is not None, "shared block without a prefix hash"
                (first, position), *others = held_by
                end = (position + 1) * size
                prefix = sched.requests[first].all_token_ids[:end]
                for other, other_position in others:
                    assert other_position == position
                    assert sched.requests[other].all_token_ids[:end] == prefix
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_usable_blocks
        assert kv.num_used_blocks == len(holders)
        free_cached = [b for b in kv.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None]
        assert len(free_cached) == kv.num_cached_free_blocks
        assert sorted(kv.free_block_ids()) == sorted(
            b.block_id for b in kv.blocks[1:] if b.ref_cnt == 0
        )
        if not sched.running:
            assert all(b.ref_cnt == 0 for b in kv.blocks)

    @invariant()
    def queues_are_consistent(self) -> None:
        sched = self.sched
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
        assert running.isdisjoint(waiting)
        assert running | waiting == set(sched.requests)
        assert len(running) <= self.config.max_num_seqs
        assert set(sched.kv.holders()) == running
        for req in sched.running:
            assert req.num_computed_tokens < req.num_tokens
            mirror = self.runner.reqs.get(req.request_id)
            assert mirror is not None
            assert mirror.tokens == req.all_token_ids[: req.num_tokens_sent]
            assert mirror.block_ids == sched.kv.get_block_ids(req.request_id)
        for req in sched.waiting:
            assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0
        for request_id, req in sched.requests.items():
            assert self.streamed.get(request_id, []) == req.output_token_ids
            assert request_id not in self.done

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        self.sched.resume()
        for _ in range(1000):
            if not self.sched.has_unfinished_requests():
                break
            self.do_step()
            self.block_pool_is_consistent()
        assert not self.sched.has_unfinished_requests(), "requests did not drain"
        assert set(self.done) == set(self.params)
        assert self.sched.kv.num_used_blocks == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
