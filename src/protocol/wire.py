"""The msgpack codec for everything that crosses a process or network boundary.

A frame is one msgpack array (``use_bin_type=True``)::

    ["legato", WIRE_VERSION, tag, payload]

``tag`` is the type's number in :data:`WIRE_TYPES`, the explicit table of every
type that may cross; nothing else is ever looked up. A dataclass's payload is
the array of its field values in declared order (nested dataclasses the same
way, their class known from the field's annotation); an enum's is its value.
Decoding checks every value against the dataclass annotations and builds the
objects through their constructors, so ``__post_init__`` validation runs on
the receiving side too. Every failure, on either side, is a :class:`WireError`
naming the tag, the class and the field path.

Frames are bounded (``MAX_FRAME_SIZE`` unless a call says otherwise) and so
are msgpack's own length limits, so a hostile frame cannot make us allocate
much. Byte streams carry each frame behind a 12-byte big-endian header, its
length and its id (:func:`frame_header`, :func:`read_frame_header`): the id
lets a reader route an answer to whoever asked, whatever the order.

Never unpickles; never imports torch or trio.
"""

from __future__ import annotations

import dataclasses
import enum
import reprlib
import struct
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn, TypeVar, overload

import msgpack

from ..config import EngineConfig
from .messages import (
    AbortRequests,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineRequest,
    FinishReason,
    HealthPing,
    HealthPong,
    ModelRunnerOutput,
    NewRequestData,
    PauseGeneration,
    PauseMode,
    Profile,
    ResetPrefixCache,
    ResumeGeneration,
    SchedulerOutput,
    SchedulerStats,
    Sleep,
    TokenLogprobs,
    UtilityCall,
    UtilityResult,
    WakeUp,
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
from .params import PoolingParams, RequestOutputKind, SamplingParams
from .structured import StructuredOutputsParams

WIRE_MAGIC: Final = "legato"
WIRE_VERSION: Final = 1
MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
HEADER_SIZE: Final = 12
MAX_ANY_DEPTH: Final = 32  # how deeply an ``Any`` value (RPC arguments) may nest

# Tag -> type: the only types that can cross. Never reuse a retired number.
WIRE_TYPES: Final[Mapping[int, type]] = types.MappingProxyType(
    {
        # params
        1: SamplingParams,
        2: PoolingParams,
        3: RequestOutputKind,
        4: StructuredOutputsParams,
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
        # control
        40: PauseMode,
        41: AbortRequests,
        42: PauseGeneration,
        43: ResumeGeneration,
        44: Sleep,
        45: WakeUp,
        46: ResetPrefixCache,
        47: Profile,
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


# ------------------------------------------------------------------ public API


def encode(obj: object, *, max_size: int = MAX_FRAME_SIZE) -> bytes:
    """One frame holding ``obj``, an instance of a type in :data:`WIRE_TYPES`.

    Raises WireError if the type is not a wire type, a field does not fit its
    annotation (callables such as ``logits_processors`` included), or the
    frame would exceed ``max_size`` bytes.
    """
    cls = type(obj)
    tag = _TAGS.get(cls)
    if tag is None:
        raise WireError(f"cannot encode {cls.__name__}: not a wire type")
    try:
        payload = _CODECS[cls].encode(obj)
        data: bytes = msgpack.packb([WIRE_MAGIC, WIRE_VERSION, tag, payload], use_bin_type=True)
    except _Mismatch as e:
        raise WireError(f"cannot encode {_where(tag, cls, e)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        # msgpack: an integer outside 64 bits, nesting past its own limit.
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
        frame = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,  # int keys: logit_bias, logprobs
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,  # every element takes at least one byte
            max_map_len=size // 2,  # every entry takes at least two
            max_ext_len=size,
        )
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise WireError(f"malformed frame: {e}") from e
    if type(frame) is not list or len(frame) != 4 or frame[0] != WIRE_MAGIC:
        raise WireError(f"not a legato frame: {_short(frame)}")
    _, version, tag, payload = frame
    if type(version) is not int or version != WIRE_VERSION:
        raise WireError(
            f"unsupported wire version {_short(version)}; this side speaks {WIRE_VERSION}"
        )
    cls = WIRE_TYPES.get(tag) if type(tag) is int else None
    if cls is None:
        raise WireError(f"unknown type tag {_short(tag)}")
    if expected is not None and cls is not expected:
        raise WireError(f"expected a {expected.__name__} frame, got tag {tag} ({cls.__name__})")
    try:
        return _CODECS[cls].decode(payload)
    except _Mismatch as e:
        raise WireError(f"bad frame: {_where(tag, cls, e)}") from None
    except RecursionError as e:
        raise WireError(f"bad frame: {cls.__name__} (tag {tag}) nests too deeply") from e


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


# ------------------------------------------------------------------ codecs
#
# One _Codec per annotation, built once: ``encode`` turns a value into plain
# msgpack data, ``decode`` checks plain data and rebuilds the value. A value
# that does not fit raises _Mismatch; each container on the way out adds its
# step to ``path`` (innermost first), so the path costs nothing unless used.


class _Mismatch(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []


@dataclasses.dataclass(frozen=True, slots=True)
class _Codec:
    name: str  # the type as error messages spell it
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    exact: type | None = None  # a value of exactly this type passes both ways unchanged


def _where(tag: int, cls: type, e: _Mismatch) -> str:
    return f"{cls.__name__}{''.join(reversed(e.path))}: {e.message} (tag {tag})"


def _short(value: object) -> str:
    return reprlib.repr(value)


def _expected(name: str, value: object) -> NoReturn:
    raise _Mismatch(f"expected {name}, got {type(value).__name__}")


def _exact(tp: type) -> _Codec:
    """int, str, bytes, bool: the value's type must be exactly ``tp`` (so no bool for int)."""

    def check(v: Any) -> Any:
        if type(v) is tp:
            return v
        _expected(tp.__name__, v)

    def widen(v: Any) -> Any:
        # Subclasses (an IntEnum in an int field, a bytearray) go out as the plain type.
        if type(v) is tp:
            return v
        if (isinstance(v, tp) and not isinstance(v, bool)) or (
            tp is bytes and type(v) is bytearray
        ):
            return tp(v)
        _expected(tp.__name__, v)

    return _Codec(tp.__name__, widen, check, exact=tp)


def _float_encode(v: Any) -> float:
    if type(v) is float:
        return v
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            return float(v)
        except OverflowError:
            raise _Mismatch(f"integer {_short(v)} is too large for a float") from None
    _expected("float", v)


def _float_decode(v: Any) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)  # msgpack ints fit in 64 bits, so this cannot overflow
    _expected("float", v)


def _none(v: Any) -> None:
    if v is not None:
        _expected("None", v)


def _any(v: Any, depth: int = 0) -> Any:
    """Only msgpack-native values: None, bool, int, float, str, bytes, lists and dicts of them."""
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str or t is bytes:
        return v
    if depth >= MAX_ANY_DEPTH:
        raise _Mismatch(f"nested deeper than {MAX_ANY_DEPTH} levels")
    if t is list or t is tuple:
        return _each(lambda x: _any(x, depth + 1), v)
    if t is dict:
        return _items(_scalar_key, lambda x: _any(x, depth + 1), v)
    raise _Mismatch(f"expected a msgpack-native value, got {t.__name__}")


def _scalar_key(k: Any) -> Any:
    t = type(k)
    if k is None or t is bool or t is int or t is float or t is str or t is bytes:
        return k
    raise _Mismatch(f"expected a scalar dict key, got {t.__name__}")


def _refuse(name: str) -> _Codec:
    def refuse(v: Any) -> NoReturn:
        raise _Mismatch(f"{name} cannot cross the wire, got {type(v).__name__}")

    return _Codec(name, refuse, refuse)


def _each(fn: Callable[[Any], Any], values: list[Any] | tuple[Any, ...]) -> list[Any]:
    out = []
    for i, x in enumerate(values):
        try:
            out.append(fn(x))
        except _Mismatch as e:
            e.path.append(f"[{i}]")
            raise
    return out


def _items(
    key: Callable[[Any], Any], value: Callable[[Any], Any], d: dict[Any, Any]
) -> dict[Any, Any]:
    out = {}
    for k, x in d.items():
        try:
            out[key(k)] = value(x)
        except _Mismatch as e:
            e.path.append(f"[{_short(k)}]")
            raise
    return out


def _list(item: _Codec) -> _Codec:
    name = f"list[{item.name}]"
    exact = item.exact
    only_exact = {exact}

    def encode(v: Any) -> Any:
        if type(v) is not list and type(v) is not tuple:
            _expected(name, v)
        if exact is not None and only_exact.issuperset(map(type, v)):
            return v
        return _each(item.encode, v)

    def decode(v: Any) -> Any:
        if type(v) is not list:
            _expected(name, v)
        if exact is not None and only_exact.issuperset(map(type, v)):
            return v
        return _each(item.decode, v)

    return _Codec(name, encode, decode)


def _dict(key: _Codec, value: _Codec) -> _Codec:
    name = f"dict[{key.name}, {value.name}]"

    def encode(v: Any) -> Any:
        if type(v) is not dict:
            _expected(name, v)
        return _items(key.encode, value.encode, v)

    def decode(v: Any) -> Any:
        if type(v) is not dict:
            _expected(name, v)
        return _items(key.decode, value.decode, v)

    return _Codec(name, encode, decode)


def _union(arms: tuple[Any, ...]) -> _Codec:
    codecs = [_codec(arm) for arm in arms if arm is not types.NoneType]
    nullable = len(codecs) < len(arms)
    name = " | ".join([c.name for c in codecs] + ["None"] * nullable)
    if len(codecs) == 1:
        # X | None: errors inside X keep their path.
        (inner,) = codecs
        return _Codec(
            name,
            lambda v: None if v is None else inner.encode(v),
            lambda v: None if v is None else inner.decode(v),
        )

    def pick(v: Any, side: str) -> Any:
        if v is None and nullable:
            return None
        for codec in codecs:
            try:
                return getattr(codec, side)(v)
            except _Mismatch:
                pass
        _expected(name, v)

    return _Codec(name, lambda v: pick(v, "encode"), lambda v: pick(v, "decode"))


def _literal(values: tuple[Any, ...]) -> _Codec:
    name = "one of " + ", ".join(repr(v) for v in values)

    def check(v: Any) -> Any:
        for allowed in values:
            if type(v) is type(allowed) and v == allowed:
                return allowed
        raise _Mismatch(f"expected {name}, got {_short(v)}")

    return _Codec(name, check, check)


def _enum(cls: type[enum.Enum]) -> _Codec:
    members = {(type(m.value), m.value): m for m in cls}

    def encode(v: Any) -> Any:
        if not isinstance(v, cls):
            _expected(cls.__name__, v)
        return v.value

    def decode(v: Any) -> Any:
        try:
            return members[type(v), v]
        except (KeyError, TypeError):  # TypeError: an unhashable value
            raise _Mismatch(f"expected a {cls.__name__} value, got {_short(v)}") from None

    return _Codec(cls.__name__, encode, decode)


def _dataclass(cls: type) -> _Codec:
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    codecs = [_codec(hints[name]) for name in fields]
    steps = [(name, f".{name}", codec) for name, codec in zip(fields, codecs)]

    def encode(obj: Any) -> Any:
        if not isinstance(obj, cls):
            _expected(cls.__name__, obj)
        out = []
        for name, step, codec in steps:
            try:
                out.append(codec.encode(getattr(obj, name)))
            except _Mismatch as e:
                e.path.append(step)
                raise
        return out

    def decode(v: Any) -> Any:
        if type(v) is not list:
            _expected(f"{cls.__name__} (an array of {len(steps)} fields)", v)
        if len(v) != len(steps):
            raise _Mismatch(f"expected {len(steps)} fields for {cls.__name__}, got {len(v)}")
        args = []
        for (_, step, codec), x in zip(steps, v):
            try:
                args.append(codec.decode(x))
            except _Mismatch as e:
                e.path.append(step)
                raise
        try:
            return cls(*args)  # runs __post_init__ validation
        except (ValueError, TypeError, OverflowError) as e:
            raise _Mismatch(f"invalid {cls.__name__}: {e}") from None

    return _Codec(cls.__name__, encode, decode)


_SCALARS: Final[dict[object, _Codec]] = {
    int: _exact(int),
    str: _exact(str),
    bytes: _exact(bytes),
    bool: _exact(bool),
    float: _Codec("float", _float_encode, _float_decode),
    types.NoneType: _Codec("None", _none, _none),
    Any: _Codec("Any", _any, _any),
}
_built: dict[object, _Codec] = {}


def _codec(tp: Any) -> _Codec:
    codec = _SCALARS.get(tp) or _built.get(tp)
    if codec is None:
        codec = _built[tp] = _build(tp)
    return codec


def _build(tp: Any) -> _Codec:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return _union(args)
    if origin is list:
        return _list(_codec(args[0]))
    if origin is dict:
        return _dict(_codec(args[0]), _codec(args[1]))
    if origin is typing.Literal:
        return _literal(args)
    if origin is Callable or tp is Callable:
        return _refuse("a callable")
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and tp in _TAGS:
        return _enum(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp in _TAGS:
        return _dataclass(tp)
    raise TypeError(f"no wire codec for {tp!r}; register the type in WIRE_TYPES")


# Built at import: a field type the codec cannot carry fails here, not mid-run.
_CODECS: Final[dict[type, _Codec]] = {cls: _codec(cls) for cls in WIRE_TYPES.values()}
