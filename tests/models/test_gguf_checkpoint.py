"""GGUF checkpoints: greedy tokens identical to transformers' own GGUF loading, for every
supported tensor type and architecture; config from the metadata; clear errors for bad files.

The GGUF files are written here, with the ``gguf`` package's writer
(``legato.testing.gguf_files``), from the tiny checkpoints in conftest. The
transformers reference loads each file with ``from_pretrained(gguf_file=...)``
in fp32, which dequantizes and un-permutes on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from legato.models.config import load_model_config
from legato.models.gguf_checkpoint import SUPPORTED_TYPES, open_gguf
from legato.protocol.errors import ModelLoadError
from legato.testing.gguf_files import write_gguf

PROMPTS = [[5, 77, 300, 12, 9, 201, 33], [100, 3, 250, 17]]
NEW_TOKENS = 24
K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512)  # K-quant rows: whole 256-blocks


def _gguf(ck: Any, tmp_path: Path, tensor_type: str) -> Path:
    folder = tmp_path / tensor_type
    folder.mkdir()
    return write_gguf(ck.path, folder / f"{ck.kind}-{tensor_type}.gguf", tensor_type=tensor_type)


def _transformers_greedy(gguf_file: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # the file names none; LlamaConfig's default is 2
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("tensor_type", SUPPORTED_TYPES)
def test_every_tensor_type_matches_transformers(
    tensor_type: str,
    make_checkpoint: Callable[..., Any],
    greedy: Any,
    tmp_path: Path,
) -> None:
    ck = make_checkpoint("llama", **K_QUANT_SIZES)
    gguf_file = _gguf(ck, tmp_path, tensor_type)
    kinds = {t.tensor_type.name for t in open_gguf(gguf_file).tensors if len(t.shape) == 2}
    assert kinds == {tensor_type}
    ours, _ = greedy.run_file(gguf_file, PROMPTS, NEW_TOKENS, max_num_seqs=4)
    assert ours == _transformers_greedy(gguf_file)
    assert all(len(set(tokens)) > 3 for tokens in ours)  # not a degenerate repetition


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_match_transformers(
    kind: str, make_checkpoint: Callable[..., Any], greedy: Any, tmp_path: Path
) -> None:
    # transformers reads no head_dim from a qwen3 file (attention.key_length) and takes
    # Qwen3Config's default, 128: only a checkpoint with that head_dim loads right there.
    ck = make_checkpoint(kind, **({"head_dim": 128} if kind == "qwen3" else {}))
    gguf_file = _gguf(ck, tmp_path, "Q8_0")
    ours, _ = greedy.run_file(gguf_file, PROMPTS, NEW_TOKENS, max_num_seqs=4)
    assert ours == _transformers_greedy(gguf_file)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_f32_file_is_the_checkpoint_it_came_from(
    kind: str,
    make_checkpoint: Callable[..., Any],
    greedy: Any,
    tmp_path: Path,
) -> None:
    """Independent of transformers' GGUF code: written with llama.cpp's Q/K permutation,
    read back un-permuted, the F32 file generates what the original checkpoint does."""
    ck = make_checkpoint(kind)
    gguf_file = _gguf(ck, tmp_path, "F32")
    ours, _ = greedy.run_file(gguf_file, PROMPTS, NEW_TOKENS, max_num_seqs=4)
    assert ours == greedy.transformers(ck, PROMPTS, NEW_TOKENS)


SCALED_ROPE: dict[str, dict[str, Any]] = {
    "llama3": {},  # conftest's llama3: factor 8 over an original window of 64
    "yarn": dict(
        max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("scaling", list(SCALED_ROPE))
def test_scaled_rope_file_matches_its_checkpoint_past_the_window(
    scaling: str,
    make_checkpoint: Callable[..., Any],
    greedy: Any,
    tmp_path: Path,
) -> None:
    """Llama 3.1's ``rope_freqs`` tensor and YaRN's metadata, written as llama.cpp's converter
    writes them, rotate as the checkpoint's rope scaling does, up to 4x the original window
    (transformers' own GGUF loading ignores both, so the checkpoint is the reference)."""
    kind = "llama3" if scaling == "llama3" else "llama"
    ck = make_checkpoint(kind, **SCALED_ROPE[scaling])
    gguf_file = _gguf(ck, tmp_path, "F32")
    rope = load_model_config(gguf_file).rope
    if scaling == "llama3":
        assert len(rope.freq_factors) == 8 and max(rope.freq_factors) == 8.0
    else:
        assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == (
            "yarn", 4.0, 64,
        )  # fmt: skip
    prompts = greedy.prompts([30, 200], seed=21)
    tokens, _ = greedy.run_file(gguf_file, prompts, 56, max_num_seqs=4, max_model_len=256)
    assert tokens == greedy.transformers(ck, prompts, 56)


def test_config_from_metadata(make_checkpoint: Callable[..., Any], tmp_path: Path) -> None:
    ck = make_checkpoint("qwen3")
    from_dir = load_model_config(ck.path)
    from_file = load_model_config(_gguf(ck, tmp_path, "F16"))
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings", "rope"):  # fmt: skip
        assert getattr(from_file, field) == getattr(from_dir, field), field
    assert from_file.rms_norm_eps == pytest.approx(from_dir.rms_norm_eps)
    assert from_file.config_dtype == torch.float16  # all matrices F16: "auto" follows the file


# ------------------------------------------------------------------ bad files


@pytest.fixture
def good_file(make_checkpoint: Callable[..., Any], tmp_path: Path) -> Path:
    return _gguf(make_checkpoint("llama"), tmp_path, "Q8_0")


def _one_line_error(path: Path, match: str) -> str:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model_config(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file(good_file: Path, keep: float) -> None:
    data = good_file.read_bytes()
    good_file.write_bytes(data[: int(len(data) * keep)])
    _one_line_error(good_file, "truncated")


def test_truncated_metadata_and_corrupt_files(good_file: Path, tmp_path: Path) -> None:
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])  # inside the metadata
    _one_line_error(cut, "truncated or corrupt")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 64)
    _one_line_error(garbage, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _one_line_error(empty, "empty")
    _one_line_error(tmp_path / "absent.gguf", "no such GGUF file")


def test_unsupported_tensor_type_names_the_tensor(
    make_checkpoint: Callable[..., Any], tmp_path: Path
) -> None:
    import gguf

    path = _gguf(make_checkpoint("llama"), tmp_path, "Q4_0")
    data = bytearray(path.read_bytes())
    # Retype one tensor in its info record (name, n_dims, dims, type, offset) as IQ4_NL,
    # a type legato does not dequantize, whose blocks have Q4_0's size.
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name)
    at += 4 + 8 * int.from_bytes(data[at : at + 4], "little")
    data[at : at + 4] = int(gguf.GGMLQuantizationType.IQ4_NL).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    message = _one_line_error(path, "blk.1.ffn_up.weight")
    assert "IQ4_NL" in message and all(t in message for t in SUPPORTED_TYPES)


def test_unsupported_architecture(good_file: Path) -> None:
    data = good_file.read_bytes()
    length = (5).to_bytes(8, "little")  # general.architecture's value, "llama": same length
    good_file.write_bytes(data.replace(length + b"llama", length + b"bloom", 1))
    _one_line_error(good_file, "unsupported GGUF architecture 'bloom'")
