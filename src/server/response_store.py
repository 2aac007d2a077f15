"""The Responses API's memory: stored responses, their conversations, background runs.

vLLM keeps three dicts on ``OpenAIServingResponses`` (``response_store``,
``msg_store``, ``background_tasks``) behind ``VLLM_ENABLE_RESPONSES_API_STORE``
(off by default: ``store`` is then silently ignored) and never removes an entry
(its own FIXME: "this may cause a memory leak"). :class:`ResponseStore` keeps the
same three things in one entry per response, stores by default (as OpenAI does:
a request's ``store`` defaults to true), and is bounded, because every client
can add to it:

- by count: at most ``max_entries``; one more evicts the oldest (a background
  response that is still running is cancelled when it is evicted: nobody can
  reach it any more);
- by age: an entry older than ``max_age`` seconds is gone (swept on every put
  and lookup, so memory never waits on a timer).

A lookup of an id that was never stored, was evicted or has expired finds
nothing: the server answers 404 naming the field. Each conversation is bounded
by the request limits that made it (the body size and the model's context).

Imports trio; never torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

RUNNING = frozenset({"queued", "in_progress"})
"""The statuses of a background response that can still be cancelled."""


@dataclass
class StoredResponse:
    """One stored response: its body (``status`` updated while it runs in the background),
    the conversation a later ``previous_response_id`` continues (its input and output as chat
    messages, without its ``instructions``), and, for a background run, how to stop it."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]] = field(default_factory=list)
    stored_at: float = field(default_factory=time.monotonic)
    scope: trio.CancelScope | None = None
    done: trio.Event = field(default_factory=trio.Event)

    @property
    def status(self) -> str:
        return str(self.body.get("status"))

    @property
    def running(self) -> bool:
        return self.status in RUNNING


class ResponseStore:
    """Responses by id, oldest first, bounded by ``max_entries`` and ``max_age`` seconds.

    Not thread-safe; used from the server's trio thread only. ``clock`` is
    ``time.monotonic`` (a parameter for the age bound's tests).
    """

    def __init__(
        self,
        max_entries: int,
        max_age: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nursery: trio.Nursery | None = None
        """Where background responses run; the server sets it (None: no background runs)."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Store (or replace) ``entry``, the newest; evict what is past either bound."""
        entry.stored_at = self._clock()
        self._entries.pop(response_id, None)
        self._entries[response_id] = entry
        self._sweep()
        while len(self._entries) > self.max_entries:
            _, oldest = self._entries.popitem(last=False)
            self._forget(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None (never stored, evicted, or expired)."""
        self._sweep()
        return self._entries.get(response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        """Forget an entry (a running background response is cancelled); the entry or None."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._forget(entry)
        return entry

    def _sweep(self) -> None:
        deadline = self._clock() - self.max_age
        while self._entries:
            response_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > deadline:
                return
            del self._entries[response_id]
            self._forget(oldest)

    @staticmethod
    def _forget(entry: StoredResponse) -> None:
        if entry.scope is not None and entry.running:
            entry.scope.cancel()
