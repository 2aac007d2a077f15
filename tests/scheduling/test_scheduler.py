"""Scheduler: continuous batching, stop rules, prefix hits, chunked prefill, preemption, pause.

No model: a fake runner mirrors what the scheduler sends it (as a real runner
keeps its own copy of each request) and samples tokens from a function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from legato.config import EngineConfig
from legato.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from legato.protocol.params import SamplingParams
from legato.scheduling.pause_gate import PauseMode
from legato.scheduling.scheduler import Scheduler

EOS = 2
Sampler = Callable[[str, list[int]], int]


def default_sampler(request_id: str, tokens: list[int]) -> int:
    """Deterministic in (request, position), never EOS: preemption must not change outputs."""
    return 100 + (len(tokens) * 7 + sum(map(ord, request_id))) % 50


@dataclass
class _Mirror:
    tokens: list[int]
    num_computed: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Keeps the runner's copy of each request from the scheduler's messages and its own
    samples, and checks it, as ModelRunner does."""

    block_size: int
    sampler: Sampler = default_sampler
    reqs: dict[str, _Mirror] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            self.reqs.pop(request_id, None)
        for new in out.new_requests:
            assert new.request_id not in self.reqs
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
        sent = [n.request_id for n in out.new_requests] + cached.req_ids
        assert sorted(sent) == sorted(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for request_id, n in out.num_scheduled_tokens.items():
            mirror = self.reqs[request_id]
            assert n > 0 and mirror.num_computed + n <= len(mirror.tokens)
            mirror.num_computed += n
            assert len(mirror.block_ids) * self.block_size >= mirror.num_computed
            assert 0 not in mirror.block_ids
            req_ids.append(request_id)
            if mirror.num_computed == len(mirror.tokens):
                token = self.sampler(request_id, mirror.tokens)
                mirror.tokens.append(token)  # a runner keeps its own samples
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput.from_lists(out.step_id, req_ids, sampled)


def make_config(**kwargs: Any) -> EngineConfig:
    values: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, block_size=16)
    values.update(kwargs)
    return EngineConfig(**values)


_arrival = itertools.count()
_fresh_tokens = itertools.count(1000, 1000)


def make_request(
    request_id: str,
    prompt: list[int] | int,
    *,
    priority: int = 0,
    eos: int | None = EOS,
    **params: Any,
) -> EngineRequest:
    if isinstance(prompt, int):  # that many tokens shared with no other request
        base = next(_fresh_tokens)
        tokens = list(range(base, base + prompt))
    else:
        tokens = prompt
    params.setdefault("max_tokens", 4)
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(**params),
        arrival_time=float(next(_arrival)),
        priority=priority,
        eos_token_id=eos,
    )


class Harness:
    """A scheduler, a fake runner, and everything each request was told."""

    def __init__(self, config: EngineConfig, sampler: Sampler = default_sampler) -> None:
        self.sched = Scheduler(config)
        self.runner = FakeRunner(config.block_size, sampler)
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, EngineCoreOutput] = {}
        self.plans: list[SchedulerOutput] = []
        self.results: list[EngineCoreOutputs] = []

    def add(self, *requests: EngineRequest) -> None:
        for request in requests:
            self.sched.add_request(request)

    def record(self, outputs: Iterable[EngineCoreOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.final
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.final[out.request_id] = out

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule()
        self.plans.append(plan)
        result = self.sched.update_from_output(plan, self.runner.execute(plan))
        self.results.append(result)
        self.record(result.outputs)
        return plan

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def sampler_from(sequences: dict[str, list[int]]) -> Sampler:
    """Each request samples its listed tokens in order."""
    iters = {rid: iter(seq) for rid, seq in sequences.items()}
    return lambda request_id, tokens: next(iters[request_id])


# ------------------------------------------------------------------ stop rules


def test_stop_token_ids_cut_the_output_and_name_the_stop() -> None:
    h = Harness(make_config(), sampler_from({"r": [10, 42, 12]}))
    h.add(make_request("r", 8, stop_token_ids=[42, 43], max_tokens=10))
    h.run()
    assert h.tokens["r"] == [10, 42]
    assert h.final["r"].finish_reason is FinishReason.STOP
    assert h.final["r"].stop_reason == 42


def test_max_tokens_gives_length() -> None:
    h = Harness(make_config(), sampler_from({"r": [5, 6, 7]}))
    h.add(make_request("r", 8, max_tokens=2))
    h.run()
    assert h.tokens["r"] == [5, 6]
    assert str(h.final["r"].finish_reason) == "length"
    assert h.final["r"].stop_reason is None


def test_eos_stops_unless_ignore_eos() -> None:
    h = Harness(make_config(), sampler_from({"a": [5, EOS, 7], "b": [5, EOS, 7]}))
    h.add(make_request("a", 8, max_tokens=3), make_request("b", 8, max_tokens=3, ignore_eos=True))
    h.run()
    assert h.tokens["a"] == [5, EOS]
    assert h.final["a"].finish_reason is FinishReason.STOP and h.final["a"].stop_reason is None
    assert h.tokens["b"] == [5, EOS, 7]
    assert h.final["b"].finish_reason is FinishReason.LENGTH


def test_ignore_eos_still_honours_stop_token_ids() -> None:
    h = Harness(make_config(), sampler_from({"r": [EOS, 9, 11]}))
    h.add(make_request("r", 8, max_tokens=5, ignore_eos=True, stop_token_ids=[9]))
    h.run()
    assert h.tokens["r"] == [EOS, 9] and h.final["r"].stop_reason == 9


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    h = Harness(make_config(), sampler_from({"r": [EOS, 42, EOS, 8]}))
    h.add(make_request("r", 8, max_tokens=10, min_tokens=3, stop_token_ids=[42]))
    h.run()
    assert h.tokens["r"] == [EOS, 42, EOS]
    assert h.final["r"].finish_reason is FinishReason.STOP


def test_stop_token_on_the_last_allowed_token_is_a_stop() -> None:
    h = Harness(make_config(), sampler_from({"r": [5, 42]}))
    h.add(make_request("r", 8, max_tokens=2, stop_token_ids=[42]))
    h.run()
    assert h.final["r"].finish_reason is FinishReason.STOP


def test_max_model_len_caps_max_tokens_none() -> None:
    h = Harness(make_config(max_model_len=32, num_kv_blocks=8))
    h.add(make_request("r", 20, max_tokens=None), make_request("full", 32, max_tokens=None))
    h.run()
    assert len(h.tokens["r"]) == 12
    assert h.final["r"].finish_reason is FinishReason.LENGTH
    # A prompt of exactly max_model_len still yields its one token.
    assert len(h.tokens["full"]) == 1 and h.final["full"].finish_reason is FinishReason.LENGTH


def test_multi_token_output_is_truncated_at_the_stop_with_its_logprobs() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("r", 4, max_tokens=10, stop_token_ids=[42]))
    plan = sched.schedule()
    lp = [TokenLogprobs([t], [-0.5], [1]) for t in (10, 42, 12)]
    result = sched.update_from_output(
        plan, ModelRunnerOutput.from_lists(plan.step_id, ["r"], [[10, 42, 12]], logprobs={"r": lp})
    )
    (out,) = result.outputs
    assert out.new_token_ids == [10, 42] and out.new_logprobs == lp[:2]
    assert out.finished and not sched.has_unfinished_requests()


# ----------------------------------------------------------- runner protocol


def test_first_step_sends_new_request_then_cached_without_the_runners_own_samples() -> None:
    h = Harness(make_config())
    h.add(make_request("r", 20, max_tokens=3))
    first = h.step()
    (new,) = first.new_requests
    assert new.num_computed_tokens == 0 and new.block_ids == [1, 2]
    assert new.output_token_ids == [] and first.num_scheduled_tokens == {"r": 20}
    second = h.step()
    cached = second.cached_requests
    assert cached.req_ids == ["r"]
    assert h.tokens["r"][:1] and cached.new_token_ids == {}  # the runner has it already
    assert cached.num_computed_tokens == [20] and cached.new_block_ids == {}
    assert second.num_scheduled_tokens == {"r": 1}
    h.run()
    # Finished ids wait for the next step that computes tokens (an empty step
    # carries none), and are sent once.
    assert h.sched.schedule().finished_req_ids == []
    h.add(make_request("s", 4, max_tokens=2))
    assert h.step().finished_req_ids == ["r"]
    assert h.step().finished_req_ids == []


def test_runner_that_drops_a_request_is_an_error() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("r", 4))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="returned 0 sample counts for 0 ids; step 1 scheduled 1"):
        sched.update_from_output(plan, ModelRunnerOutput.from_lists(plan.step_id, [], []))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(plan, ModelRunnerOutput.from_lists(plan.step_id, ["r"], [[]]))


def test_logprobs_and_num_cached_tokens_pass_through() -> None:
    h = Harness(make_config())
    shared = list(range(500, 548))
    h.add(make_request("a", [*shared, 1, 2, 3], max_tokens=1))
    h.run()
    h.add(make_request("b", [*shared, 7, 8], max_tokens=2))
    plan = h.step()
    assert plan.new_requests[0].num_computed_tokens == 48
    assert plan.num_scheduled_tokens == {"b": 2}
    assert h.results[-1].outputs[0].num_cached_tokens == 48
    stats = h.results[-1].scheduler_stats
    assert stats is not None
    assert stats.prefix_cache_queries == 50 and stats.prefix_cache_hits == 48
    assert stats.num_prefill_tokens == 2 and stats.num_decode_tokens == 0
    h.step()
    stats = h.results[-1].scheduler_stats
    assert stats is not None and stats.num_decode_tokens == 1 and stats.prefix_cache_queries == 0
    assert h.final["b"].num_cached_tokens == 48


# ---------------------------------------------------------------- batching


def test_decodes_first_then_prefill_within_the_remaining_budget() -> None:
    h = Harness(make_config(max_num_batched_tokens=32))
    h.add(make_request("a", 10, max_tokens=5))
    h.step()
    h.add(make_request("b", 40, max_tokens=5))
    plan = h.step()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 31}
    assert plan.cached_requests.req_ids == ["a"]
    assert [n.request_id for n in plan.new_requests] == ["b"]
    assert "b" not in h.tokens  # a partial chunk samples nothing
    plan = h.step()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 9}
    assert len(h.tokens["b"]) == 1  # the last chunk samples the first token


def test_chunked_prefill_of_a_long_prompt() -> None:
    h = Harness(make_config(max_num_batched_tokens=32))
    h.add(make_request("r", 100, max_tokens=2))
    chunks = [h.step().num_scheduled_tokens["r"] for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert [len(r.outputs) for r in h.results] == [0, 0, 0, 1]
    assert all(p.total_num_scheduled_tokens <= 32 for p in h.plans)
    assert h.plans[1].cached_requests.new_token_ids == {}
    h.run()
    assert len(h.tokens["r"]) == 2


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    config = make_config(max_model_len=64, max_num_batched_tokens=64, enable_chunked_prefill=False)
    h = Harness(config)
    h.add(make_request("a", 40, max_tokens=3), make_request("b", 40, max_tokens=3))
    assert h.step().num_scheduled_tokens == {"a": 40}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 40}
    h.run()
    assert len(h.tokens["b"]) == 3


def test_max_num_seqs_is_respected() -> None:
    h = Harness(make_config(max_num_seqs=2))
    h.add(*(make_request(f"r{i}", 5, max_tokens=3) for i in range(5)))
    h.run()
    assert max(len(p.num_scheduled_tokens) for p in h.plans) == 2
    assert all(len(t) == 3 for t in h.tokens.values()) and len(h.final) == 5


def test_fcfs_order() -> None:
    h = Harness(make_config(max_num_seqs=1))
    h.add(*(make_request(f"r{i}", 5, max_tokens=1, priority=5 - i) for i in range(3)))
    h.run()
    assert [p.new_requests[0].request_id for p in h.plans if p.new_requests] == [
        "r0",
        "r1",
        "r2",
    ]


def test_priority_order() -> None:
    h = Harness(make_config(max_num_seqs=1, scheduling_policy="priority"))
    h.add(
        make_request("low", 5, max_tokens=1, priority=2),
        make_request("high", 5, max_tokens=1, priority=0),
        make_request("mid-early", 5, max_tokens=1, priority=1),
        make_request("mid-late", 5, max_tokens=1, priority=1),
    )
    h.run()
    assert [p.new_requests[0].request_id for p in h.plans if p.new_requests] == [
        "high",
        "mid-early",
        "mid-late",
        "low",
    ]


# -------------------------------------------------------------- preemption


def test_too_few_blocks_preempts_the_later_request_which_still_completes() -> None:
    # 11 usable blocks of 16: two 80-token prompts take 5 each, decode needs more.
    h = Harness(make_config(max_model_len=160, num_kv_blocks=12))
    h.add(make_request("a", 80, max_tokens=20), make_request("b", 80, max_tokens=20))
    h.run()
    stats = [r.scheduler_stats for r in h.results]
    assert sum(s.num_preempted for s in stats if s is not None) >= 1
    preempting = next(p for p in h.plans if p.preempted_req_ids)
    assert preempting.preempted_req_ids == ["b"]
    resumed = next(
        n for p in h.plans for n in p.new_requests if n.request_id == "b" and n.output_token_ids
    )
    assert resumed.output_token_ids == h.tokens["b"][: len(resumed.output_token_ids)]
    # Recompute changed nothing: the same outputs as an unconstrained run.
    free = Harness(make_config())
    free.add(make_request("a", 80, max_tokens=20), make_request("b", 80, max_tokens=20))
    free.run()
    assert h.tokens == free.tokens
    assert all(f.finish_reason is FinishReason.LENGTH for f in h.final.values())
    assert h.sched.kv.num_used_blocks == 0


def test_priority_preemption_takes_the_lowest_priority_even_if_scheduled_earlier() -> None:
    config = make_config(
        max_model_len=24, num_kv_blocks=7, block_size=4, scheduling_policy="priority"
    )
    h = Harness(config)
    h.add(make_request("lo", 8, max_tokens=10, priority=5))
    h.step()
    h.add(make_request("hi", 12, max_tokens=10, priority=0))
    h.step()  # lo decodes into a third block, hi prefills three: all six used
    assert h.sched.kv.num_free_blocks == 0
    # lo (first in running) fits its decode; hi needs a block: lo, already
    # planned this step, is the lowest priority and gives way.
    plan = h.step()
    assert plan.num_scheduled_tokens == {"hi": 1}
    assert plan.cached_requests.req_ids == ["hi"] and plan.cached_requests.new_block_ids["hi"]
    h.run()
    victims = [rid for p in h.plans for rid in p.preempted_req_ids]
    assert victims and set(victims) == {"lo"}
    assert len(h.tokens["lo"]) == 10 and len(h.tokens["hi"]) == 10


def test_has_constrained_requests_while_a_request_with_a_grammar_is_live() -> None:
    h = Harness(make_config())
    h.sched.add_request(make_request("g", 4, max_tokens=2), object())  # it only carries it
    h.add(make_request("plain", 4, max_tokens=6))
    assert h.sched.has_constrained_requests
    while "g" not in h.final:
        h.step()
    assert not h.sched.has_constrained_requests and "plain" not in h.final
    h.sched.add_request(make_request("g2", 4), object())
    assert h.sched.has_constrained_requests
    h.sched.abort("g2")
    assert not h.sched.has_constrained_requests


# ---------------------------------------------------------- abort / finish


def test_abort_is_idempotent_and_frees_blocks_at_once() -> None:
    h = Harness(make_config())
    h.add(make_request("r", 40, max_tokens=10))
    h.step()
    assert h.sched.kv.num_used_blocks > 0
    outs = h.sched.abort(["r", "r", "unknown"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [
        ("r", FinishReason.ABORT, [])
    ]
    assert h.sched.kv.get_block_ids("r") == []
    assert h.sched.abort("r") == [] and h.sched.abort([]) == []
    assert h.sched.schedule().is_empty  # an empty step carries no ids
    h.add(make_request("w", 4))
    assert h.step().finished_req_ids == ["r"]


def test_abort_of_a_waiting_request_is_not_sent_to_the_runner() -> None:
    h = Harness(make_config(max_num_seqs=1))
    h.add(make_request("a", 4, max_tokens=3), make_request("b", 4))
    h.step()
    assert [o.request_id for o in h.sched.abort("b")] == ["b"]
    assert len(h.sched.waiting) == 0
    h.run()
    assert all("b" not in p.finished_req_ids for p in h.plans)


def test_abort_between_schedule_and_update_drops_the_result() -> None:
    h = Harness(make_config())
    h.add(make_request("r", 4, max_tokens=10))
    plan = h.sched.schedule()
    runner_out = h.runner.execute(plan)
    h.sched.abort("r")
    assert h.sched.update_from_output(plan, runner_out).outputs == []


def test_finish_requests_reports_ids_not_outputs() -> None:
    h = Harness(make_config())
    h.add(make_request("r", 4, max_tokens=10))
    h.step()
    assert h.sched.finish_requests(["r", "nope"], FinishReason.STOP) == ["r"]
    assert h.sched.finish_requests("r", FinishReason.STOP) == []
    assert not h.sched.has_unfinished_requests()
    assert h.sched.kv.num_used_blocks == 0


def test_add_request_validation() -> None:
    sched = Scheduler(make_config(max_model_len=32, num_kv_blocks=8))
    sched.add_request(make_request("r", 4))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request(make_request("r", 4))
    with pytest.raises(ValueError, match="must not be empty"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="exceed max_model_len"):
        sched.add_request(make_request("long", 33))
    assert sched.get_num_unfinished_requests() == 1


def test_config_must_be_resolved_and_fit() -> None:
    with pytest.raises(ValueError, match="resolved"):
        Scheduler(EngineConfig())
    with pytest.raises(ValueError, match="do not fit"):
        Scheduler(make_config(max_model_len=65, num_kv_blocks=5))


# ------------------------------------------------------------------- pause


def test_pause_abort_finishes_everything_and_holds_new_requests() -> None:
    h = Harness(make_config(max_num_seqs=1))
    h.add(make_request("a", 4, max_tokens=10), make_request("b", 4))
    h.step()
    outs = h.sched.pause(PauseMode.ABORT)
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finish_reason is FinishReason.ABORT for o in outs)
    assert h.sched.is_paused and not h.sched.has_unfinished_requests()
    h.add(make_request("c", 4, max_tokens=2))
    assert h.sched.schedule().is_empty
    assert h.sched.has_unfinished_requests() and not h.sched.has_in_flight_requests()
    h.sched.resume()
    h.run()
    assert len(h.tokens["c"]) == 2


def test_pause_wait_lets_requests_from_before_finish() -> None:
    h = Harness(make_config(max_num_seqs=1))
    h.add(make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=3))
    h.step()
    assert h.sched.pause(PauseMode.WAIT) == []
    h.add(make_request("late", 4, max_tokens=3))
    for _ in range(20):
        if not h.sched.has_in_flight_requests():
            break
        h.step()
    assert set(h.final) == {"a", "b"} and "late" not in h.tokens
    assert h.sched.schedule().is_empty
    h.sched.resume()
    h.run()
    assert len(h.tokens["late"]) == 3


def test_pause_keep_freezes_until_resume() -> None:
    h = Harness(make_config())
    h.add(make_request("a", 4, max_tokens=5))
    h.step()
    before = list(h.tokens["a"])
    assert h.sched.pause(PauseMode.KEEP) == []
    for _ in range(3):
        assert h.step().is_empty
    assert h.tokens["a"] == before and h.sched.has_unfinished_requests()
    assert h.sched.kv.num_used_blocks == 1
    h.sched.resume()
    assert not h.sched.is_paused
    h.run()
    assert len(h.tokens["a"]) == 5


# ----------------------------------------------------------- prefix cache


def test_reset_prefix_cache() -> None:
    h = Harness(make_config())
    h.add(make_request("a", 40, max_tokens=3))
    h.step()
    assert h.sched.reset_prefix_cache() is False  # a is running
    assert h.sched.kv.lookup(h.sched.requests["a"].block_hashes[0]) is not None
    assert h.sched.reset_prefix_cache(reset_running_requests=True) is True
    assert h.sched.kv.num_used_blocks == 0 and not h.sched.running
    plan = h.step()
    # Restarted from scratch: no stale hit, all tokens recomputed.
    assert plan.preempted_req_ids == ["a"]
    assert plan.new_requests[0].num_computed_tokens == 0
    assert plan.new_requests[0].output_token_ids == h.tokens["a"][:1]
    h.run()
    assert len(h.tokens["a"]) == 3
    assert h.sched.kv.num_cached_free_blocks > 0
    assert h.sched.reset_prefix_cache() is True
    assert h.sched.kv.num_cached_free_blocks == 0
    h.add(make_request("b", 40, max_tokens=1))
    assert h.step().new_requests[0].num_computed_tokens == 0


def test_outputs_filled_by_decode_are_cached_for_a_follow_up_turn() -> None:
    h = Harness(make_config(block_size=4, max_model_len=64))
    prompt = list(range(10, 16))
    h.add(make_request("turn1", prompt, max_tokens=7))
    h.run()
    # 6 prompt + 7 output = 13 tokens; 12 computed: 3 full blocks, 2 of them decoded.
    assert h.sched.kv.num_used_blocks == 0 and h.sched.kv.num_cached_free_blocks == 3
    h.add(make_request("turn2", prompt + h.tokens["turn1"] + [1, 2, 3], max_tokens=1))
    plan = h.step()
    assert plan.new_requests[0].num_computed_tokens == 12


def test_a_step_frame_carries_each_shared_runner_params_once() -> None:
    """n children of one request share one RunnerSamplingParams, and the step's frame holds
    it once; stop strings and other detokenizer-only fields never reach it."""
    from legato.protocol import wire
    from legato.protocol.messages import RunnerSamplingParams

    sched = Scheduler(make_config(max_num_seqs=64, num_kv_blocks=256))
    big = SamplingParams(
        max_tokens=2, stop=["Z" * 128] * 16, allowed_token_ids=list(range(100, 20_100))
    )
    shared = RunnerSamplingParams.of(big)
    for i in range(32):
        child = make_request(f"{i}_p", [5, 6], max_tokens=2, stop=["Z" * 128] * 16)
        child.parent_id, child.runner_params = "p", shared
        sched.add_request(child)
    out = sched.schedule()
    assert len(out.new_requests) == 32
    assert list(out.sampling_params.values()) == [shared]
    assert {r.params_key for r in out.new_requests} == set(out.sampling_params)
    frame = wire.encode(out)
    assert len(frame) < 100_000  # one copy of 20k allowed ids (~60 KB); no stop string
    assert b"ZZZZ" not in frame


def test_new_requests_wait_for_a_step_whose_frame_has_room() -> None:
    """Each request's own large parameters count against the step's frame budget: the
    step admits requests until the next would pass it (and at least one)."""
    from legato.protocol.messages import RunnerSamplingParams
    from legato.scheduling.scheduler import STEP_FRAME_BUDGET

    sched = Scheduler(make_config(max_num_seqs=64, num_kv_blocks=256))
    bias = dict.fromkeys(range(500_000), 1.0)
    per_request = 9 * 2 * len(bias)  # logit_bias: an id and a float each
    for i in range(8):
        request = make_request(f"r{i}", [5, 6])
        request.runner_params = RunnerSamplingParams(logit_bias=bias)  # each its own
        sched.add_request(request)
    first = sched.schedule()
    assert 1 <= len(first.new_requests) <= STEP_FRAME_BUDGET // per_request
    assert len(first.new_requests) < 8
