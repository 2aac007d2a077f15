"""Pausing generation: the modes, and the gate that says which requests a pause holds.

A pause has a boundary: the admission number (``Request.arrival_seq``) of the
last request added before it. Requests added after it are *held*: queued, never
started until the pause ends. The scheduler asks the gate, and keeps
``num_held`` current as held requests arrive and leave.

Pure bookkeeping; never imports trio or torch.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request_state import Request


class PauseMode(enum.IntEnum):
    ABORT = 0  # finish every in-flight request with reason abort
    WAIT = 1  # admit nothing new, let in-flight requests finish
    KEEP = 2  # freeze everything until resume


class PauseGate:
    """The scheduler's pause: its mode (None: not paused), boundary and held count."""

    __slots__ = ("mode", "num_held", "_boundary")

    def __init__(self) -> None:
        self.mode: PauseMode | None = None
        self.num_held = 0  # unfinished requests the pause holds
        self._boundary = 0

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    def pause(self, mode: PauseMode, last_seq: int) -> None:
        """Enter (or change the mode of) a pause. The first pause's boundary stays:
        ``last_seq`` is the admission number of the last request added before it."""
        if self.mode is None:
            self._boundary = last_seq
            self.num_held = 0
        self.mode = mode

    def resume(self) -> None:
        """Leave the pause; nothing is held any more."""
        self.mode = None
        self.num_held = 0

    def is_held(self, req: Request) -> bool:
        """Whether ``req`` arrived during the pause (and so waits for ``resume``)."""
        return self.mode is not None and req.arrival_seq > self._boundary

    def arrived(self) -> None:
        """A request was added: during a pause it is held."""
        if self.mode is not None:
            self.num_held += 1

    def left(self, req: Request) -> None:
        """A request that never started finished (aborted, say): one fewer held."""
        if self.is_held(req):
            self.num_held -= 1
