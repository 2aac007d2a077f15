"""The scheduler's waiting queue: policy order, a preempted request's place, removal."""

from __future__ import annotations

import pytest

from legato.protocol.messages import EngineRequest
from legato.protocol.params import SamplingParams
from legato.scheduling.request_queue import RequestQueue
from legato.scheduling.request_state import Request


def request(request_id: str, seq: int, *, priority: int = 0, arrival: float = 0.0) -> Request:
    engine_request = EngineRequest(
        request_id, [1, 2, 3], SamplingParams(max_tokens=4), arrival, priority
    )
    return Request(engine_request, seq)


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue.ordered()]


def test_fcfs_takes_arrivals_in_order_and_a_preempted_request_first() -> None:
    queue = RequestQueue("fcfs")
    a, b, c = (request(name, i) for i, name in enumerate("abc"))
    for r in (a, b, c):
        queue.push(r)
    assert queue.pop() is a and ids(queue) == ["b", "c"]
    queue.push_front(a)  # preempted: back at the front
    assert queue.peek() is a and ids(queue) == ["a", "b", "c"]
    queue.remove({"b"})
    assert ids(queue) == ["a", "c"] and len(queue) == 2


@pytest.mark.parametrize("requeue", [False, True])
def test_priority_orders_by_value_then_arrival_then_admission(requeue: bool) -> None:
    queue = RequestQueue("priority")
    late_urgent = request("late-urgent", 3, priority=-1, arrival=5.0)
    first, tie = request("first", 1, arrival=1.0), request("tie", 2, arrival=1.0)
    for r in (tie, late_urgent, first):
        queue.push(r)
    if requeue:  # a preempted request keeps its original key
        assert queue.pop() is late_urgent
        queue.push_front(late_urgent)
    assert ids(queue) == ["late-urgent", "first", "tie"]
    assert [queue.pop().request_id for _ in range(3)] == ["late-urgent", "first", "tie"]
    assert len(queue) == 0
