"""What a ``model`` argument names (default, toy, directory, GGUF file) and its served name."""

from __future__ import annotations

from pathlib import Path

import pytest

from legato.config import EngineConfig
from legato.engine import resolve_model
from legato.model_source import resolve_model_source, served_name
from legato.protocol.errors import ModelLoadError


def test_served_names() -> None:
    assert served_name(None) == "SmolLM2-135M-Instruct"
    assert served_name("toy") == "legato-toy"
    assert served_name("some/dir") == "some/dir"


def test_each_kind_of_argument(smollm2_dir: Path, toy_model_dir: Path, smollm2_gguf: Path) -> None:
    assert resolve_model_source(None).path == str(smollm2_dir)
    assert resolve_model_source("toy").path == str(toy_model_dir)
    assert resolve_model_source(str(toy_model_dir)).name == str(toy_model_dir)
    assert resolve_model_source(str(smollm2_gguf)).path == str(smollm2_gguf)


def test_resolve_model_fills_the_served_name(smollm2_dir: Path) -> None:
    resolved = resolve_model(EngineConfig())
    assert (resolved.model, resolved.served_model_name) == (
        str(smollm2_dir),
        "SmolLM2-135M-Instruct",
    )
    named = resolve_model(EngineConfig(model="toy", served_model_name="mine"))
    assert named.served_model_name == "mine"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda tmp: tmp / "absent", "neither a local model directory nor a GGUF file"),
        (lambda tmp: tmp, "config.json not found"),
        (lambda tmp: tmp / "weights.bin", "not a GGUF file"),
        (lambda tmp: tmp / "model.gguf", "not a GGUF file"),
    ],
)
def test_bad_arguments_fail_in_one_line(make: object, match: str, tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    (tmp_path / "model.gguf").write_bytes(b"GGML" + b"\0" * 60)
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelLoadError, match=match) as info:
        resolve_model_source(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


async def test_open_engine_refuses_a_corrupt_file_before_starting_anything(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    import psutil

    from legato.engine import open_engine
    from legato.testing.gguf_files import write_gguf

    good = write_gguf(toy_model_dir, tmp_path / "toy.gguf", tensor_type="F16")
    data = bytearray(good.read_bytes())
    data[8:16] = (10**9).to_bytes(8, "little")  # the tensor count: far more than the file holds
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"{bad}: truncated or corrupt"):
        async with open_engine(str(bad)):
            pass
    assert psutil.Process().children(recursive=True) == []
