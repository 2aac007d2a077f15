"""The msgpack codec for everything that crosses a process or network boundary, on msgspec.

A frame is one msgpack array::

    ["legato", WIRE_VERSION, tag, payload]

``tag`` is the type's number in :data:`WIRE_TYPES`, the explicit table of every
type that may cross; nothing else is ever looked up. A message Struct's
payload is the array of its field values in declared order (nested Structs
the same way); a dataclass's is the map of its fields; an enum's is its
value. Decoding goes through one msgspec decoder per type, which checks every
value against the annotations (an int is not a bool, a float field takes
ints, enums take members only, unions check their arms) and builds the objects
through their constructors, so ``__post_init__`` validation runs on the
receiving side too. Every failure, on either side, is a :class:`WireError`
naming the type, the tag and, for a bad value, its path (``$[2][0].field``).

Frames are bounded (``MAX_FRAME_SIZE`` unless a call says otherwise);
msgspec checks every declared length against the bytes actually present
before it allocates, and a nesting deeper than the interpreter's recursion
limit is refused, so a hostile frame cannot make us allocate much. Byte
streams carry each frame behind a 12-byte big-endian header, its length and
its id (:func:`frame_header`, :func:`read_frame_header`): the id lets a reader
route an answer to whoever asked, whatever the order.

Never unpickles; never imports torch or trio.
"""

from __future__ import annotations

import reprlib
import struct
import types
from collections.abc import Mapping
from typing import Any, Final, TypeVar, overload

import msgspec

from ..config import EngineConfig
from .messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    GrammarBitmask,
    HealthPing,
    HealthPong,
    ModelRunnerOutput,
    NewRequestData,
    RunnerSamplingParams,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
    WorkerError,
    WorkerInit,
    WorkerReady,
)
from .outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from .params import LoRARequest, PoolingParams, RequestOutputKind, SamplingParams
from .structured import StructuredOutputsParams

WIRE_MAGIC: Final = "legato"
WIRE_VERSION: Final = 1
MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
HEADER_SIZE: Final = 12

# Tag -> type: the only types that can cross. Never reuse a retired number.
WIRE_TYPES: Final[Mapping[int, type]] = types.MappingProxyType(
    {
        # params
        1: SamplingParams,
        2: PoolingParams,
        3: RequestOutputKind,
        4: LoRARequest,
        5: StructuredOutputsParams,
        # outputs
        10: Logprob,
        11: RequestMetrics,
        12: CompletionOutput,
        13: RequestOutput,
        14: PoolingOutput,
        15: PoolingRequestOutput,
        # requests and steps
        20: EngineRequest,
        21: NewRequestData,
        22: CachedRequestData,
        23: SchedulerOutput,
        24: TokenLogprobs,
        25: ModelRunnerOutput,
        26: SchedulerStats,
        27: EngineCoreOutput,
        28: EngineCoreOutputs,
        29: FinishReason,
        30: GrammarBitmask,
        31: RunnerSamplingParams,
        32: SpecDecodingStats,
        # control
        # 40-47: retired (engine-core controls, which never cross a process)
        48: HealthPing,
        49: HealthPong,
        50: UtilityCall,
        51: UtilityResult,
        # executor <-> worker
        55: WorkerInit,
        56: WorkerReady,
        57: WorkerError,
        # config
        60: EngineConfig,
    }
)
_TAGS: Final[dict[type, int]] = {cls: tag for tag, cls in WIRE_TYPES.items()}
_HEADER: Final = struct.Struct(">IQ")  # before each frame on a byte stream: length, id
MAX_FRAME_ID: Final = 2**64 - 1

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


class WireError(ValueError):
    """An object cannot be encoded, or bytes are not a valid frame; the message says where."""


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    magic: Any
    version: Any
    tag: Any
    payload: msgspec.Raw


def _no_ext(code: int, data: memoryview) -> object:
    raise ValueError(f"msgpack extension type {code} is not accepted")


_ENCODER: Final = msgspec.msgpack.Encoder()
_ENVELOPE: Final = msgspec.msgpack.Decoder(_Envelope, ext_hook=_no_ext)
# Built at import: a field type msgspec cannot carry fails here, not mid-run.
_DECODERS: Final[dict[int, msgspec.msgpack.Decoder[Any]]] = {
    tag: msgspec.msgpack.Decoder(cls, ext_hook=_no_ext) for tag, cls in WIRE_TYPES.items()
}


# ------------------------------------------------------------------ public API


def encode(obj: object, *, max_size: int = MAX_FRAME_SIZE) -> bytes:
    """One frame holding ``obj``, an instance of a type in :data:`WIRE_TYPES`.

    Raises WireError if the type is not a wire type, a value cannot be
    encoded (a callable such as a logits processor, an object of no wire
    type, an integer past 64 bits) or the frame would exceed ``max_size``
    bytes. Field types are checked by the receiving side's decoder.
    """
    cls = type(obj)
    tag = _TAGS.get(cls)
    if tag is None:
        raise WireError(f"cannot encode {cls.__name__}: not a wire type")
    try:
        data = _ENCODER.encode((WIRE_MAGIC, WIRE_VERSION, tag, obj))
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise WireError(f"cannot encode {cls.__name__} (tag {tag}): {e}") from e
    if len(data) > max_size:
        raise WireError(
            f"{cls.__name__} (tag {tag}) frame is {len(data)} bytes, over the limit of {max_size}"
        )
    return data


@overload
def decode(data: Buffer, *, max_size: int = ..., expected: type[T]) -> T: ...
@overload
def decode(data: Buffer, *, max_size: int = ..., expected: None = None) -> object: ...
def decode(
    data: Buffer, *, max_size: int = MAX_FRAME_SIZE, expected: type[Any] | None = None
) -> object:
    """The object in one frame; with ``expected``, the frame must hold that type.

    Raises WireError, and nothing else, for any bytes that are not a valid
    frame: malformed, truncated, over ``max_size``, another wire version, an
    unknown tag, the wrong number of fields, a field of the wrong type, or
    values the type's own validation rejects.
    """
    size = len(data)
    if size > max_size:
        raise WireError(f"frame is {size} bytes, over the limit of {max_size}")
    try:
        frame = _ENVELOPE.decode(data)
    except msgspec.ValidationError:
        raise WireError(f"not a legato frame: {_short(_peek(data))}") from None
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise WireError(f"malformed frame: {e}") from e
    if frame.magic != WIRE_MAGIC or type(frame.magic) is not str:
        raise WireError(f"not a legato frame: {_short(frame.magic)}")
    version, tag = frame.version, frame.tag
    if type(version) is not int or version != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {_short(version)}; this side speaks {WIRE_VERSION}"
        )
    decoder = _DECODERS.get(tag) if type(tag) is int else None
    if decoder is None:
        raise WireError(f"unknown type tag {_short(tag)}")
    cls = WIRE_TYPES[tag]
    if expected is not None and cls is not expected:
        raise WireError(f"expected a {expected.__name__} frame, got tag {tag} ({cls.__name__})")
    try:
        return decoder.decode(frame.payload)
    except msgspec.ValidationError as e:
        raise WireError(f"bad frame: {cls.__name__} (tag {tag}): {e}") from None
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError) as e:
        raise WireError(f"malformed frame: {cls.__name__} (tag {tag}): {e}") from e


def frame_header(size: int, frame_id: int = 0, *, max_size: int = MAX_FRAME_SIZE) -> bytes:
    """The 12-byte header that goes before a frame of ``size`` bytes on a stream.

    ``frame_id`` (0 .. 2**64-1) is the frame's number: an answer carries the
    id of the frame it answers, so a reader can route it by id.
    """
    if size < 0:
        raise WireError(f"frame size must not be negative, got {size}")
    if size > min(max_size, 0xFFFF_FFFF):
        raise WireError(f"frame of {size} bytes is over the limit of {min(max_size, 0xFFFF_FFFF)}")
    if not 0 <= frame_id <= MAX_FRAME_ID:
        raise WireError(f"frame id must be in 0 .. 2**64-1, got {frame_id}")
    return _HEADER.pack(size, frame_id)


def frame(message: object, frame_id: int = 0, *, max_size: int = MAX_FRAME_SIZE) -> bytes:
    """``message`` as one whole frame on a stream: its header (:func:`frame_header`), then
    its payload (:func:`encode`). Raises :class:`WireError` as those do."""
    payload = encode(message, max_size=max_size)
    return frame_header(len(payload), frame_id, max_size=max_size) + payload


def read_frame_header(
    header: bytes | bytearray | memoryview, *, max_size: int = MAX_FRAME_SIZE
) -> tuple[int, int]:
    """The length and id of the frame that follows ``header``; WireError if over ``max_size``.

    Check the length before reading the frame, so a hostile peer cannot make
    the reader buffer more than ``max_size`` bytes.
    """
    if len(header) != HEADER_SIZE:
        raise WireError(f"frame header must be {HEADER_SIZE} bytes, got {len(header)}")
    size, frame_id = _HEADER.unpack(header)
    if size > max_size:
        raise WireError(f"incoming frame of {size} bytes is over the limit of {max_size}")
    return int(size), int(frame_id)


def _peek(data: Buffer) -> object:
    """What a frame that is not a legato envelope holds, for the error message."""
    try:
        return msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001 - only for a message
        return bytes(data[:16])


def _short(value: object) -> str:
    return reprlib.repr(value)
