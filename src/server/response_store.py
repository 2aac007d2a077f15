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
- by size: the entries' text (bodies and conversations, counted in characters)
  stays under ``max_chars``; past it the oldest go, as for the count (one chained
  conversation can be as long as the model's context, so a count alone would let
  a thousand long chains hold gigabytes);
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
    size: int = 0  # characters of text in body and conversation, counted by the store
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
        max_chars: int = 256 << 20,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_age = max_age
        self.max_chars = max_chars
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self.nursery: trio.Nursery | None = None
        """Where background responses run; the server sets it (None: no background runs)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        """The characters of text the entries hold (what ``max_chars`` bounds)."""
        return self._chars

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Store (or replace) ``entry``, the newest; evict what is past a bound (``entry``
        itself too, when it alone is larger than ``max_chars``)."""
        self.pop(response_id)
        entry.stored_at = self._clock()
        entry.size = _text_size(entry.body) + _text_size(entry.conversation)
        self._entries[response_id] = entry
        self._chars += entry.size
        self._sweep()
        self._evict()

    def update(
        self,
        response_id: str,
        entry: StoredResponse,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
    ) -> None:
        """A stored entry's new body and conversation (a background run that ended); evict
        what is then past a bound. An entry no longer stored is updated alone."""
        entry.body, entry.conversation = body, conversation
        size = _text_size(body) + _text_size(conversation)
        if self._entries.get(response_id) is entry:
            self._chars += size - entry.size
        entry.size = size
        self._evict()

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries or self._chars > self.max_chars
        ):
            _, oldest = self._entries.popitem(last=False)
            self._chars -= oldest.size
            self._forget(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None (never stored, evicted, or expired)."""
        self._sweep()
        return self._entries.get(response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        """Forget an entry (a running background response is cancelled); the entry or None."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.size
            self._forget(entry)
        return entry

    def _sweep(self) -> None:
        deadline = self._clock() - self.max_age
        while self._entries:
            response_id, oldest = next(iter(self._entries.items()))
            if oldest.stored_at > deadline:
                return
            del self._entries[response_id]
            self._chars -= oldest.size
            self._forget(oldest)

    @staticmethod
    def _forget(entry: StoredResponse) -> None:
        if entry.scope is not None and entry.running:
            entry.scope.cancel()


def _text_size(value: Any) -> int:
    """The characters of text in a JSON-like value (strings and keys; 8 per other scalar).
    Iterative: a client's deeply nested tool arguments cannot exhaust the stack."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(str(key)) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            total += 8
    return total
