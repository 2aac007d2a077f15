"""Helpers shared by the benchmarks: random checkpoints of a given shape."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The 56M-parameter shape the issues measure against.
SHAPE_56M = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
)


def random_llama_checkpoint(
    out_dir: str | Path, *, seed: int = 0, with_tokenizer: bool = True, **shape: int | bool
) -> Path:
    """Save a random-weight Llama of ``shape`` (default: 56M) into ``out_dir``.

    The toy model's tokenizer is copied in when asked, so the engine can load
    the directory; its ids cover only part of the vocabulary, which does not
    change the work per token.
    """
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = LlamaConfig(**{**SHAPE_56M, **shape}, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    if with_tokenizer:
        from legato.toy_model import default_toy_model_dir

        toy = default_toy_model_dir()
        for name in os.listdir(toy):
            if "token" in name or name.endswith(".jinja"):
                shutil.copy(toy / name, out / name)
    return out
