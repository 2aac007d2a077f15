"""``OutputSink``: where the output processor leaves one request's outputs.

The producer side only, which is synchronous and never blocks; how a consumer
waits (a trio task, an asyncio task, a polling loop) is the sink's own business.
``legato.actors.output_slot.OutputSlot`` is the trio one. Never imports trio or torch.
"""

from __future__ import annotations

from typing import Protocol

from ..protocol.outputs import RequestOutput
from ..protocol.params import RequestOutputKind


class OutputSink(Protocol):
    """One request's outputs go in here; ``put`` merges per ``output_kind``."""

    @property
    def output_kind(self) -> RequestOutputKind:
        """How pending outputs merge (DELTA joins deltas, else the newest wins)."""
        ...

    def put(self, output: RequestOutput) -> None:
        """Leave ``output`` for the consumer. Never blocks."""
        ...

    def put_error(self, exc: BaseException) -> None:
        """Fail the consumer with ``exc`` (the first error wins). Never blocks."""
        ...
