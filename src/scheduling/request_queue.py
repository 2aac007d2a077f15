"""The waiting queue of the scheduler, in policy order.

FCFS keeps a deque (arrival order; a preempted request goes back to the
front); priority keeps a heap on ``Request.sort_key`` (lower priority value
first, then earlier arrival, then admission order). Pure Python; never imports
torch or trio.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Literal

from .request_state import Request


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
