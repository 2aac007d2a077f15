"""Fixtures shared by the tests of the output side (detokenizers, output processor)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


@pytest.fixture
def strip_tokenizer() -> Tokenizer:
    """A real tokenizer whose decoder panics (in Rust) on token 2, a lone space:
    ``Strip`` takes one character from each side of a one-character token."""
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, " ": 2, "[UNK]": 3}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Strip(" ", 1, 1)
    return tokenizer
