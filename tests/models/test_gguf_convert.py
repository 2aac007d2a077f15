"""A GGUF file converted to a Hugging Face directory: same weights, same tokenizer and chat
template, an ordinary checkpoint for transformers too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from legato.models.gguf_checkpoint import iter_gguf_weights, open_gguf
from legato.models.gguf_convert import convert_gguf
from legato.models.loader import iter_weights
from legato.testing.gguf_files import write_gguf
from legato.tokenizer_loading import load_tokenizer
from legato.toy_model import ToyModelSpec, build_toy_model

TINY = ToyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a GGUF file with tokenizer and chat template, its conversion); mixed tensor types:
    matrices Q8_0, norms F32."""
    root = tmp_path_factory.mktemp("convert")
    source = build_toy_model(root / "hf", seed=5, spec=TINY)
    (root / "gguf").mkdir()
    gguf_file = write_gguf(source, root / "gguf" / "tiny.gguf", tensor_type="Q8_0")
    out = root / "converted"
    out.mkdir()
    convert_gguf(gguf_file, out, label="tiny")
    return gguf_file, out


def test_weights_are_the_files_exactly(converted: tuple[Path, Path]) -> None:
    gguf_file, out = converted
    ours = dict(iter_weights(out))
    theirs = dict(iter_gguf_weights(open_gguf(gguf_file)))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name].float(), tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]


def test_tokenizer_and_chat_template_carry_over(converted: tuple[Path, Path]) -> None:
    gguf_file, out = converted
    from_file, from_dir = load_tokenizer(str(gguf_file)), load_tokenizer(str(out))
    chat = [{"role": "user", "content": "héllo 🙂, what is 2 + 2?"}]
    rendered = from_file.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|bos|><|im_start|>user\n")  # the toy model's ChatML template
    assert (
        from_dir.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == rendered
    )
    for text in (rendered, "Once upon a time", "  spaces\tand\nnewlines "):
        assert from_dir.encode(text) == from_file.encode(text)
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (0, 1)


def test_transformers_loads_the_directory_as_the_file(converted: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    gguf_file, out = converted
    from_dir = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    from_file = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    ids = torch.tensor([[0, 3, 40, 41, 42, 100, 7]])
    with torch.no_grad():
        assert torch.equal(from_dir(ids).logits, from_file(ids).logits)
