"""Tests for legato.toy_model: determinism, offline loading, the tokenizer's contract."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from legato import toy_model
from legato.toy_model import (
    MARKER_FILE,
    build_toy_model,
    default_toy_model_dir,
    describe,
    legato_home,
)


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


# -- building ------------------------------------------------------------------


def test_same_seed_is_byte_identical_across_processes(toy_model_dir: Path, tmp_path: Path) -> None:
    # A second process, with other thread counts and hash seeds, must agree byte for byte.
    out = tmp_path / "again"
    env = {**os.environ, "RAYON_NUM_THREADS": "4", "TOKENIZERS_PARALLELISM": "true"}
    env["PYTHONHASHSEED"] = "12345"
    code = "import sys; from legato.toy_model import build_toy_model; build_toy_model(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=120)
    assert _digests(out) == _digests(toy_model_dir)
    assert set(_digests(out)) == {
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        MARKER_FILE,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_other_seed_changes_only_the_weights(toy_model_dir: Path, tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)  # an existing empty directory is replaced by the build
    out = build_toy_model(tmp_path, seed=1)
    assert out == tmp_path
    ours, default = _digests(out), _digests(toy_model_dir)
    assert ours["model.safetensors"] != default["model.safetensors"]
    assert ours[MARKER_FILE] != default[MARKER_FILE]
    for same in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        assert ours[same] == default[same], same


def test_files_hold_nothing_path_dependent(toy_model_dir: Path) -> None:
    for name in _digests(toy_model_dir):
        if name != "model.safetensors":
            text = (toy_model_dir / name).read_text()
            assert str(toy_model_dir) not in text and "/tmp" not in text, name


def test_complete_build_is_reused_and_foreign_dirs_refused(
    toy_model_dir: Path, tmp_path: Path
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in toy_model_dir.iterdir()}
    assert build_toy_model(toy_model_dir) == toy_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in toy_model_dir.iterdir()} == before

    with pytest.raises(FileExistsError, match="remove it to rebuild"):
        build_toy_model(toy_model_dir, seed=1)  # a complete build, but of another seed
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_toy_model(foreign)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_losing_the_rename_race_returns_the_winners_build(
    toy_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "model"

    def rival_finishes_first(tmp: Path, seed: int, spec: toy_model.ToyModelSpec) -> None:
        shutil.copytree(toy_model_dir, out)  # another process renamed its build into place
        (tmp / "half-built").write_text("")

    monkeypatch.setattr(toy_model, "_build_into", rival_finishes_first)
    assert build_toy_model(out) == out
    assert _digests(out) == _digests(toy_model_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # our temp dir is gone


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(tmp: Path, seed: int, spec: toy_model.ToyModelSpec) -> None:
        (tmp / "config.json").write_text("{")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(toy_model, "_build_into", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        build_toy_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_default_dir_lives_under_legato_home(toy_model_dir: Path, legato_home_dir: Path) -> None:
    assert toy_model_dir == legato_home_dir / "toy-model-v1-seed0"
    assert default_toy_model_dir() == toy_model_dir
    assert json.loads((toy_model_dir / MARKER_FILE).read_text())["seed"] == 0


def test_legato_home_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LEGATO_HOME", str(tmp_path / "home"))
    assert legato_home() == tmp_path / "home"
    monkeypatch.delenv("LEGATO_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert legato_home() == tmp_path / "xdg" / "legato"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert legato_home() == tmp_path / "user" / ".cache" / "legato"


def test_describe(toy_model_dir: Path) -> None:
    text = describe(toy_model_dir)
    assert "LlamaForCausalLM" in text
    assert "3,950,848" in text and "F32" in text
    assert "layers        4, hidden 256" in text
    assert "4 query, 2 key/value, head_dim 64" in text
    assert "vocab         2048 (bos 0, eos 1, pad 2)" in text
    assert "model.safetensors" in text and "tokenizer.json" in text


# -- the model -----------------------------------------------------------------


def test_config_sizes_and_special_ids(toy_model_dir: Path) -> None:
    config = json.loads((toy_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 2048
    assert (config["hidden_size"], config["intermediate_size"]) == (256, 688)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (4, 4)
    assert config["num_key_value_heads"] == 2
    assert config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    generation = json.loads((toy_model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


def test_transformers_loads_offline_and_generates(
    toy_model_dir: Path, toy_tokenizer: PreTrainedTokenizerBase
) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir, dtype=torch.float32)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 8_000_000
    assert all(p.dtype == torch.float32 for p in model.parameters())

    ids = toy_tokenizer("The lighthouse keeper", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 2048)
    assert torch.isfinite(logits).all()

    first = model.generate(ids, max_new_tokens=12, do_sample=False)
    again = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert first.shape == (1, ids.shape[1] + 12)
    assert torch.equal(first, again)
    assert len(set(first[0, ids.shape[1] :].tolist())) > 1  # not one token over and over


# -- the tokenizer -------------------------------------------------------------


def test_vocab_and_special_token_ids(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(toy_tokenizer) == 2048
    assert (toy_tokenizer.bos_token, toy_tokenizer.bos_token_id) == ("<|bos|>", 0)
    assert (toy_tokenizer.eos_token, toy_tokenizer.eos_token_id) == ("<|eos|>", 1)
    assert (toy_tokenizer.pad_token, toy_tokenizer.pad_token_id) == ("<|pad|>", 2)
    assert toy_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    assert toy_tokenizer.all_special_ids == [0, 1, 2, 3, 4]
    assert toy_tokenizer.model_max_length == 2048


def test_encoding_prepends_bos_once(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = toy_tokenizer("hi").input_ids
    assert ids[0] == 0 and 0 not in ids[1:] and 1 not in ids
    assert toy_tokenizer("hi", add_special_tokens=False).input_ids == ids[1:]
    assert toy_tokenizer("").input_ids == [0]


@pytest.mark.parametrize(
    "text", ["héllo 世界 🙂", "", " ", "  \n\t\r\n x  \n\n", "<b>Ünïcödé</b> 👩🏽‍🔬 ẞ 𝔘"]
)
def test_round_trip(toy_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = toy_tokenizer(text).input_ids
    assert toy_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert toy_tokenizer.decode(ids) == "<|bos|>" + text
    assert toy_tokenizer.decode(ids[1:]) == text


def test_common_text_compresses(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    text = "The scheduler looked at the queue and chose the requests that fit."
    assert len(toy_tokenizer(text, add_special_tokens=False).input_ids) < len(text) / 2.5


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=64))
def test_round_trip_random_unicode(toy_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = toy_tokenizer(text, add_special_tokens=False).input_ids
    assert toy_tokenizer.decode(ids) == text


def test_special_tokens_decode_and_skip(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [3] + toy_tokenizer("user", add_special_tokens=False).input_ids + [4, 1, 2, 2]
    assert toy_tokenizer.decode(ids) == "<|im_start|>user<|im_end|><|eos|><|pad|><|pad|>"
    assert toy_tokenizer.decode(ids, skip_special_tokens=True) == "user"
    # Special tokens written in text are recognised as such (as in every HF tokenizer).
    assert toy_tokenizer("a<|im_end|>b", add_special_tokens=False).input_ids[1] == 4


def test_raw_tokenizers_library_agrees(
    toy_model_dir: Path, toy_tokenizer: PreTrainedTokenizerBase
) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(toy_model_dir / "tokenizer.json"))
    text = "héllo 世界 🙂\n  code: x = [1, 2]"
    assert raw.encode(text).ids == toy_tokenizer(text).input_ids
    assert raw.decode(raw.encode(text).ids) == text


def test_reloading_from_files_matches(toy_model_dir: Path) -> None:
    fresh = AutoTokenizer.from_pretrained(toy_model_dir)
    assert fresh("héllo 世界 🙂").input_ids[0] == fresh.bos_token_id


# -- the chat template ---------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 🙂"},
]


def test_chat_template_renders_chatml(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    with_prompt = toy_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert with_prompt == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = toy_tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert isinstance(without, str) and without.endswith("<|im_end|>\n")
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_chat_template_tokenizes_with_one_bos(toy_tokenizer: PreTrainedTokenizerBase) -> None:
    rendered = toy_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    ids = toy_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if not isinstance(ids, list):  # a BatchEncoding in transformers 5
        ids = ids["input_ids"]
    assert ids == toy_tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[:2] == [0, 3] and ids.count(0) == 1
    assert toy_tokenizer.decode(ids) == rendered
