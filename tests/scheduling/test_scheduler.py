"""Scheduler: continuous batching, prefix hits, chunked prefill, preemption, policy order."""

from __future__ import annotations

import pytest

from legato.protocol.messages import FinishReason, ModelRunnerOutput
from legato.scheduling.scheduler import Scheduler

from .harness import Harness, make_config, make_request


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
