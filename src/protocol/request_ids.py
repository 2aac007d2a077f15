"""Every id a request takes inside the engine, in one place.

- The caller's request id names the request to the caller (``RequestOutput.request_id``).
- The engine id (``engine_id``: ``f"{request_id}-{n}"``, ``n`` counting up for the
  engine's life) names one submission inside the engine. A caller may reuse its id
  once the first request ended; outputs and aborts still meant for the old one are
  then told apart by the engine id.
- A child id (``child_id``: ``f"{index}_{engine_id}"``) names completion ``index`` of
  a request with ``n > 1`` in the scheduler; with ``n == 1`` the engine id serves.

Pure functions of strings; never imports trio or torch.
"""

from __future__ import annotations

import itertools


class EngineIds:
    """Hands out engine ids for one engine (or ``LLMEngine``): unique for its life."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def next(self, request_id: str) -> str:
        """A new engine id for a submission of ``request_id``."""
        return f"{request_id}-{next(self._counter)}"


def child_id(index: int, parent_id: str) -> str:
    """The scheduler-level id of completion ``index`` of a request with n>1."""
    return f"{index}_{parent_id}"
