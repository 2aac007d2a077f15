"""The header of a GGUF file: its metadata (key/value pairs) and its tensor directory,
parsed with ``struct`` from a read-only memory map of the file, by the format's constants
as the ``gguf`` package defines them (value types, tensor types and their block sizes).

Why not ``gguf.GGUFReader``: it builds numpy views of every part of every field, several per
token string of a tokenizer's vocabulary and merges (about 100,000 for SmolLM2's 49,152-token
vocabulary): seconds and about 160 MB of Python objects at every start of a worker that reads
none of them. Here an array of strings is only stepped over while parsing (its offset and
count are kept, :class:`StringArray`) and decoded when :meth:`GGUFHeader.field` asks for it;
a numeric array is a numpy view of the map; a tensor's data is a view made when it is read.
The values :meth:`GGUFHeader.field` returns are those of ``GGUFReader``'s
``fields[key].contents()``.

Little-endian files of GGUF versions 2 and 3 (what llama.cpp and the ``gguf`` package
write). Raises ValueError (naming neither the file nor the caller's context: the caller adds
them) for a file that is not GGUF, another version, a big-endian file, an unknown value or
tensor type, a duplicate key or tensor name, a bad alignment, or a header that runs past the
end of the file.

Never imports torch or trio.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # bytes; ``general.alignment`` overrides it

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY: dict[GGUFValueType, type[np.generic]] = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}
_UNQUANTIZED: dict[GGMLQuantizationType, type[np.generic]] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
"""Tensor types whose data is an array of numbers; every other type is raw bytes (as
``GGUFReader`` gives them: ``[..., bytes per row]`` uint8)."""


@dataclass(frozen=True, slots=True)
class StringArray:
    """An array of ``count`` strings in the header, starting at byte ``offset``, not decoded."""

    offset: int
    count: int


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One entry of the tensor directory.

    ``shape`` is in GGUF's order (a row's length first, as ``GGUFReader``'s ``shape``);
    ``data_offset`` counts from the start of the file; ``data`` is a view of the file's map:
    numbers for F32 / F16 / F64 / I8..I64 (shape reversed, numpy's order), else the raw
    blocks as ``[..., bytes per row]`` uint8.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_elements: int
    n_bytes: int
    _file: np.ndarray = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        raw = self._file[self.data_offset : self.data_offset + self.n_bytes]
        dims = tuple(reversed(self.shape))
        number = _UNQUANTIZED.get(self.tensor_type)
        if number is not None:
            return raw.view(number).reshape(dims)
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // block * size)


class GGUFHeader:
    """The metadata and tensor directory of the GGUF file at ``path`` (parsed at
    construction; blocks for the time that takes: tens of milliseconds for a 49k-token
    vocabulary). ``fields``: key -> its value as stored (a Python scalar or str, a numpy
    view for a numeric array, a :class:`StringArray`, a list for an array of arrays);
    ``tensors``: the directory in file order. The file stays mapped while this object or
    a view of its data lives."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: np.ndarray = np.memmap(path, mode="r")
        self._buffer = self._file.data  # a memoryview of the map
        self.fields: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except (struct.error, IndexError) as exc:
            raise ValueError(f"the header runs past the end of the file ({exc})") from None

    def field(self, key: str, default: Any = None) -> Any:
        """``key``'s value, decoded: a scalar, a str, or a list (strings decoded now);
        ``default`` when the file has no such key."""
        if key not in self.fields:
            return default
        return self._decoded(self.fields[key])

    def _decoded(self, value: Any) -> Any:
        if isinstance(value, StringArray):
            return self.strings(value)
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, list):
            return [self._decoded(v) for v in value]
        return value

    def strings(self, array: StringArray) -> list[str]:
        """The strings of ``array``, decoded (UTF-8)."""
        out, at = [], array.offset
        for _ in range(array.count):
            text, at = self._string(at)
            out.append(text)
        return out

    # ------------------------------------------------------------------ parsing

    def _parse(self) -> None:
        if bytes(self._buffer[:4]) != b"GGUF":
            raise ValueError("no GGUF magic bytes")
        (version,) = _U32.unpack_from(self._buffer, 4)
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        tensor_count, kv_count = struct.unpack_from("<QQ", self._buffer, 8)
        at = 24
        for _ in range(kv_count):
            key, at = self._string(at)
            (kind,) = _U32.unpack_from(self._buffer, at)
            value, at = self._value(at + 4, kind)
            if key in self.fields:
                raise ValueError(f"duplicate key {key!r}")
            self.fields[key] = value
        infos = []
        for _ in range(tensor_count):
            name, at = self._string(at)
            (n_dims,) = _U32.unpack_from(self._buffer, at)
            shape = struct.unpack_from(f"<{n_dims}Q", self._buffer, at + 4)
            at += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", self._buffer, at)
            at += 12
            infos.append((name, GGMLQuantizationType(kind), shape, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-at // alignment) * alignment
        names: set[str] = set()
        for name, tensor_type, shape, offset in infos:
            if name in names:
                raise ValueError(f"duplicate tensor {name!r}")
            names.add(name)
            elements = int(np.prod(shape, dtype=np.int64))
            block, size = GGML_QUANT_SIZES[tensor_type]
            self.tensors.append(
                GGUFTensor(
                    name,
                    tensor_type,
                    shape,
                    start + offset,
                    elements,
                    elements * size // block,
                    self._file,
                )  # fmt: skip
            )
        self.data_offset = start

    def _string(self, at: int) -> tuple[str, int]:
        (length,) = _U64.unpack_from(self._buffer, at)
        end = at + 8 + length
        if end > len(self._buffer):
            raise ValueError("a string runs past the end of the file")
        return str(self._buffer[at + 8 : end], "utf-8"), end

    def _value(self, at: int, kind: int) -> tuple[Any, int]:
        value_type = GGUFValueType(kind)
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            return scalar.unpack_from(self._buffer, at)[0], at + scalar.size
        if value_type == GGUFValueType.STRING:
            return self._string(at)
        # an array: item type, count, items
        item_kind, count = struct.unpack_from("<IQ", self._buffer, at)
        at += 12
        item_type = GGUFValueType(item_kind)
        number = _NUMPY.get(item_type)
        if number is not None:
            end = at + count * np.dtype(number).itemsize
            if end > len(self._buffer):
                raise ValueError("an array runs past the end of the file")
            return self._file[at:end].view(number), end
        if item_type == GGUFValueType.STRING:
            start = at
            for _ in range(count):
                (length,) = _U64.unpack_from(self._buffer, at)
                at += 8 + length
            if at > len(self._buffer):
                raise ValueError("an array of strings runs past the end of the file")
            return StringArray(start, count), at
        items = []
        for _ in range(count):  # an array of arrays
            item, at = self._value(at, item_kind)
            items.append(item)
        return items, at
