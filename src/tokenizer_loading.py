"""Loading a model's tokenizer: from a Hugging Face model directory or a GGUF file.

Local files only, never the hub. Used by the engine, the render-only client,
``LLM`` and the GGUF converter. Never imports trio, torch or ``legato.models``:
the front end gets its tokenizer from here without loading model code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer in ``path``, a model directory or a GGUF file. Blocks."""
    if path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in a GGUF file.

    Built by transformers' GGUF tokenizer conversion. ``PreTrainedTokenizerFast``
    is asked directly: ``AutoTokenizer`` would first parse the whole file once
    more to pick a class (seconds, for the same result). Blocks about 2 s for a
    49k-token vocabulary.
    """
    from transformers import PreTrainedTokenizerFast

    file = Path(path).resolve()
    return PreTrainedTokenizerFast.from_pretrained(
        str(file.parent), gguf_file=file.name, local_files_only=True
    )
