"""Fixtures for structured outputs: a grammar compiler on the toy model's real tokenizer,
and a constrained sampling loop (random logits, the step's bitmask, the torch sampler's mask)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch

from legato.structured import GrammarCompiler, GrammarState, TokenizerInfo, allocate_bitmask
from legato.structured.mask import apply_token_bitmask, bitmask_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Generate = Callable[..., tuple[str, list[int]]]


@pytest.fixture(scope="session")
def grammar_compiler(toy_tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    """One compiler over the toy tokenizer, with the model's vocabulary padded past it."""
    info = TokenizerInfo.from_hf(toy_tokenizer, vocab_size=len(toy_tokenizer) + 40)
    return GrammarCompiler(info)


@pytest.fixture(scope="session")
def constrained_generate(toy_tokenizer: PreTrainedTokenizerBase) -> Generate:
    """``generate(state, seed, max_steps=400, eos_bias=0.0, prefer="")`` -> (text, ids without EOS).

    Samples from random logits under the state's mask each step, as the engine
    does, until EOS; fails the test if the grammar never lets it stop. Tokens
    whose text holds a character of ``prefer`` get a bonus (e.g. closing
    quotes and braces, so that free-form JSON ends in a few hundred steps).
    """
    texts = [toy_tokenizer.decode([t]) for t in range(len(toy_tokenizer))]

    def generate(
        state: GrammarState,
        seed: int,
        max_steps: int = 400,
        eos_bias: float = 0.0,
        prefer: str = "",
    ) -> tuple[str, list[int]]:
        compiler = state.compiler
        gen = torch.Generator().manual_seed(seed)
        mask = allocate_bitmask(1, compiler.vocab_size)
        eos = sorted(compiler.eos_token_ids)
        out: list[int] = []
        preferred = [t for t, text in enumerate(texts) if any(c in text for c in prefer)]
        for _ in range(max_steps):
            state.fill_bitmask(mask[0])
            logits = torch.randn(1, compiler.vocab_size, generator=gen) * 3
            logits[0, eos] += eos_bias
            if prefer:
                logits[0, preferred] += 6.0
            apply_token_bitmask(
                logits,
                bitmask_tensor(mask, compiler.bitmask_words, logits.device),
                torch.tensor([0]),
            )
            token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
            state.accept([token])
            if token in compiler.eos_token_ids:
                return toy_tokenizer.decode(out), out
            out.append(token)
        raise AssertionError(f"no EOS after {max_steps} steps: {toy_tokenizer.decode(out)!r}")

    return generate


def schema_person() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }


@pytest.fixture
def person_schema() -> dict[str, Any]:
    return schema_person()
