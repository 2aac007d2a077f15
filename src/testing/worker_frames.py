"""A worker's input as the engine sends it, for tests that drive the worker's serve loop
(:func:`legato.workers.worker.serve`) on a byte stream: the first frame that starts the
named null-model runner, and messages framed with ids 1, 2, ..."""

from __future__ import annotations

from ..config import EngineConfig
from ..protocol import messages as m
from ..protocol import wire

NULL_INIT = m.WorkerInit(config=EngineConfig(runner="null", num_kv_blocks=64).to_dict())


def framed(*messages: object) -> bytes:
    """The messages as whole frames (:func:`legato.protocol.wire.frame`), ids 1, 2, ..."""
    return b"".join(wire.frame(message, frame_id) for frame_id, message in enumerate(messages, 1))
