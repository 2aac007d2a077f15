"""Structured outputs: grammar states that constrain sampling with a per-step token bitmask.

``grammar`` (numpy + llguidance, never torch or trio) compiles a request's
constraint and yields its bitmask rows; the sampler applies the rows with
:func:`legato.kernels.token_mask.apply_token_bitmask` (torch, or Triton on CUDA).
"""

from .grammar import (
    Bitmask,
    GrammarCompiler,
    GrammarError,
    GrammarState,
    TokenizerInfo,
    allocate_bitmask,
    bitmask_allows,
    bitmask_words,
    grammar_text,
)

__all__ = [
    "Bitmask",
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "TokenizerInfo",
    "allocate_bitmask",
    "bitmask_allows",
    "bitmask_words",
    "grammar_text",
]
