"""cut_layers: a draft checkpoint from some of a model's layers, renumbered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from legato.models.layer_cut import cut_layers


def test_cut_keeps_the_chosen_layers_renumbered(toy_model_dir: Path, tmp_path: Path) -> None:
    out = cut_layers(toy_model_dir, tmp_path / "cut", [0, 3])
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    src = load_file(str(toy_model_dir / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    layers = {name.split(".")[2] for name in got if name.startswith("model.layers.")}
    assert layers == {"0", "1"}
    for name, tensor in got.items():
        original = name.replace("model.layers.1.", "model.layers.3.")
        assert torch.equal(tensor, src[original]), name
    assert {n for n in src if not n.startswith("model.layers.")} <= set(got)
    assert (out / "tokenizer.json").read_bytes() == (toy_model_dir / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"^layers: .* has 4 layers"):
        cut_layers(toy_model_dir, tmp_path / "bad", [4])
