"""The scheduler's request book (scheduling/request_book.py): add, abort, finish, pause."""

from __future__ import annotations

import pytest

from legato.config import EngineConfig
from legato.protocol.messages import FinishReason
from legato.scheduling.pause_gate import PauseMode
from legato.scheduling.scheduler import Scheduler

from .harness import Harness, make_config, make_request


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
