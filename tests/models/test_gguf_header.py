"""The GGUF header reader gives what ``gguf.GGUFReader`` gives: every field's value, every
tensor's name, type, shape, extent and data, on the default model's file and on a file
holding every value type; a header cut short is a ValueError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from legato.models.gguf_header import GGUFHeader, StringArray


def _assert_same_as_gguf_reader(path: Path) -> GGUFHeader:
    from gguf import GGUFReader

    theirs = GGUFReader(str(path))
    ours = GGUFHeader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own entries
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.field(key) == theirs.fields[key].contents(), key
    assert ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape) == (
            their.name, their.tensor_type, tuple(their.shape.tolist()),
        )  # fmt: skip
        assert (mine.data_offset, mine.n_bytes, mine.n_elements) == (
            their.data_offset, their.n_bytes, their.n_elements,
        )  # fmt: skip
        assert mine.data.dtype == their.data.dtype and mine.data.shape == their.data.shape
        assert np.array_equal(mine.data, their.data, equal_nan=True), mine.name
    return ours


def test_default_model_file(smollm2_gguf: Path) -> None:
    ours = _assert_same_as_gguf_reader(smollm2_gguf)
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and tokens.count == 49152  # kept undecoded


def test_every_value_type(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    kinds = gguf.GGUFValueType
    scalars: dict[str, tuple[Any, gguf.GGUFValueType]] = {
        "u8": (200, kinds.UINT8), "i8": (-100, kinds.INT8), "u16": (60000, kinds.UINT16),
        "i16": (-30000, kinds.INT16), "u32": (4_000_000_000, kinds.UINT32),
        "i32": (-2_000_000_000, kinds.INT32), "f32": (0.1, kinds.FLOAT32),
        "bool": (True, kinds.BOOL), "u64": (2**63 + 5, kinds.UINT64),
        "i64": (-(2**62), kinds.INT64), "f64": (1 / 3, kinds.FLOAT64),
        "text": ("grüße, 世界", kinds.STRING),
    }  # fmt: skip
    for key, (value, kind) in scalars.items():
        writer.add_key_value(f"test.{key}", value, kind)
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.flags", [True, False, True])
    writer.add_array("test.words", ["", "a", "ünïcode", "x" * 300])
    writer.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(
        rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = _assert_same_as_gguf_reader(path)
    assert ours.field("test.text") == "grüße, 世界"
    assert ours.field("test.words") == ["", "a", "ünïcode", "x" * 300]
    assert ours.field("test.absent", "default") == "default"


def test_header_cut_short(smollm2_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        cut.write_bytes(f.read(1_000_000))  # inside the tokenizer's arrays
    with pytest.raises(ValueError, match="past the end"):
        GGUFHeader(str(cut))
